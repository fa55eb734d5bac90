"""Decode steps on the CPU through ``torch.compile``: the CPU's CUDA graph.

At small batches a decode step of the demo target is mostly per-operator overhead;
inductor fuses each layer's norms, rotary and residual arithmetic into a few C++ kernels
and calls the linears' GEMMs directly, with no Python between them. Attention stays
outside the graph: each layer calls the opaque op ``tandem::paged_attention``, which runs
the step's planned :class:`~.model_runner.PagedAttention` (KV append and the CPU twin of
FlashInfer's wrapper, exactly the eager code), as vLLM's piecewise graphs leave attention
to a "forward context". So the graph's only varying shape is the batch size, marked
dynamic: one graph for batch 1 and one for every larger batch (no padding, no graph per
context length), compiled at start-up by :meth:`CompiledDecode.warm_up`.

Whether compiling pays depends on the CPU, the dtype and the batch: warm-up times the
compiled and the eager step at every bucket of :func:`~.graph_runner.capture_sizes` and
keeps the compiled one only where it measured faster (:func:`buckets_worth_compiling`).

Speculation's verify steps (k + 1 tokens per sequence, attention by the prefill wrapper
inside the same opaque op) run through the same dynamic graph: only the number of
tokens differs. Warm-up times them per (bucket, k) for the ``verify_ks`` it is given, up
to :data:`VERIFY_MAX_BUCKET` (beyond, a verify batch is GEMM-bound and runs eagerly),
and keeps the compiled ones that measured faster.
Inductor's FX-graph and AOT caches persist under ``cache_dir``, so a restart loads the
kernels instead of compiling them again; so does warm-up's decision (which buckets and
(bucket, k) to keep compiled, with the timings it was made from), keyed by what the timings
depend on: the model's shapes, dtype, buckets, draft counts, torch, threads and CPU. A
restart on the same machine compiles what was kept and measures nothing (delete
``cache_dir/tandem-warmup`` to measure again). Fused kernels round differently from the eager
ones: fp32 agrees to ~1e-6; bf16 greedy text can differ from the eager engine's at
near-ties.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .graph_runner import padded_size
from .model_runner import ForwardBatch, ModelRunner, PagedAttention

log = logging.getLogger(__name__)

# compiled must beat eager by this factor to be kept (the timings are noisy)
KEEP_MARGIN = 0.95
VERIFY_MAX_BUCKET = 16   # the largest batch whose verify steps are timed and may be compiled


def default_cache_dir() -> str:
    """``$TORCHINDUCTOR_CACHE_DIR`` if the user set it, else ``~/.cache/tandem/inductor``
    (inductor's own default is under /tmp, which a reboot empties; torch writes that default
    into the variable itself when its inductor is first imported, e.g. by loading a model,
    so the variable holding exactly torch's default counts as unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default
        if given != torch_default():
            return given
    return os.path.join(base, "tandem", "inductor")


def buckets_worth_compiling(timings: dict[int, tuple[float, float]],
                            margin: float = KEEP_MARGIN) -> list[int]:
    """The buckets whose compiled step beat the eager one: ``timings`` maps a batch
    bucket to (eager ms, compiled ms) per step.

    >>> buckets_worth_compiling({1: (5.0, 3.5), 2: (6.0, 5.9), 8: (15.0, 16.0)})
    [1]
    """
    return sorted(b for b, (eager, compiled) in timings.items() if compiled < margin * eager)


class _Forward:
    """The step being run: what ``tandem::paged_attention`` attends with."""
    attention: PagedAttention | None = None


@torch.library.custom_op("tandem::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """One layer's KV append and attention with the running step's :class:`PagedAttention`.
    Opaque to inductor: the page table, context lengths and the pool's writes never
    enter the graph (the layers' data dependence keeps the calls in order)."""
    return _Forward.attention.forward(layer, q, k, v)


@paged_attention.register_fake
def _(q, k, v, layer):
    return torch.empty_like(q)


class _OpAttention:
    """The model's attention backend inside the graph."""

    def forward(self, layer, q, k, v):
        return paged_attention(q, k, v, layer)


def model_step(model):
    """``(input_ids [N], cos, sin [N, 1, D]) -> pre-norm hidden [N, hidden]``: the
    model's forward after the rotary lookup (which reads positions on the host)."""
    attn = _OpAttention()

    def step(input_ids, cos, sin):
        x = model.embed_tokens(input_ids)
        for layer in model.layers:
            x = layer(x, cos, sin, attn)
        return x
    return step


def _utf8_locale() -> None:
    """Inductor reads its UTF-8 code templates in the locale's encoding; an embedded
    interpreter without a locale (Triton's Python-backend stubs) has ASCII."""
    import locale
    if locale.getpreferredencoding(False).lower().replace("-", "") != "utf8":
        for name in ("C.UTF-8", "C.utf8", "en_US.UTF-8"):
            try:
                locale.setlocale(locale.LC_CTYPE, name)
                return
            except locale.Error:
                continue


@dataclass(slots=True)
class WarmUp:
    """What :meth:`CompiledDecode.warm_up` did: seconds spent, ms per step by bucket."""
    seconds: float
    timings: dict[int, tuple[float, float]]   # bucket -> (eager ms, compiled ms)
    compiled: list[int]
    # (bucket, k) -> (eager ms, compiled ms) of verify steps, and those kept compiled
    verify_timings: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    verify_compiled: list[tuple[int, int]] = field(default_factory=list)
    remembered: bool = False     # the decision (and timings) of an earlier warm-up here

    def describe(self) -> str:
        per = ", ".join(f"{b}: {e:.2f}/{c:.2f}" for b, (e, c) in sorted(self.timings.items()))
        how = "decided by an earlier warm-up on this machine; " if self.remembered else ""
        text = (f"compiled decode for batch buckets {self.compiled or 'none'} "
                f"(warm-up {self.seconds:.1f} s; {how}eager/compiled ms per step: {per or 'not measured'})")
        if self.verify_timings:
            per = ", ".join(f"{b}/k{k}: {e:.2f}/{c:.2f}"
                            for (b, k), (e, c) in sorted(self.verify_timings.items()))
            text += f"; verify (bucket/k) compiled for {self.verify_compiled or 'none'} ({per})"
        return text


def save_warm_up(path: Path, key: dict, warm: WarmUp) -> None:
    """Write ``warm``'s decision and timings for ``key`` (atomically: a torn file is never read)."""
    data = {"key": key, "compiled": warm.compiled, "verify_compiled": [list(x) for x in warm.verify_compiled],
            "timings": [[b, *t] for b, t in sorted(warm.timings.items())],
            "verify_timings": [[b, k, *t] for (b, k), t in sorted(warm.verify_timings.items())]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def load_warm_up(path: Path, key: dict) -> WarmUp | None:
    """The warm-up saved at ``path`` for exactly ``key``; None when there is none (or it
    cannot be read, or was made for another key).

    >>> import tempfile; p = Path(tempfile.mkdtemp()) / "w.json"
    >>> save_warm_up(p, {"cpu": "x"}, WarmUp(9.0, {1: (5.0, 3.0)}, [1], {(1, 2): (6.0, 7.0)}, []))
    >>> w = load_warm_up(p, {"cpu": "x"}); (w.compiled, w.timings, w.verify_timings, w.remembered)
    ([1], {1: (5.0, 3.0)}, {(1, 2): (6.0, 7.0)}, True)
    >>> load_warm_up(p, {"cpu": "y"}) is None
    True
    """
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            return None
        return WarmUp(0.0, {b: (e, c) for b, e, c in data["timings"]}, list(data["compiled"]),
                      {(b, k): (e, c) for b, k, e, c in data["verify_timings"]},
                      [tuple(x) for x in data["verify_compiled"]], remembered=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def _ms_per_step(fn, steps: int) -> float:
    """CPU ms (the process's CPU time: on a busy host wall time would time the other
    processes as well, and decide by noise)."""
    start = time.process_time()
    for _ in range(steps):
        fn()
    return 1000 * (time.process_time() - start) / steps


class CompiledDecode:
    """Plain decode batches of ``runner``'s model through one compiled step (the engine's
    ``decode_graphs`` slot: ``forward(batch)`` -> hidden, or None for a batch it does not
    take: not plain decode, or a bucket where eager measured faster).

    ``buckets``: the batch sizes that are timed and decided (a batch of n belongs to the
    smallest bucket >= n; larger than all: eager). ``verify_ks``: the draft counts whose
    verify steps :meth:`forward_verify` takes, at buckets up to
    :data:`VERIFY_MAX_BUCKET`. Until :meth:`warm_up` decides, every bucket (and every
    (bucket, k)) is compiled."""

    def __init__(self, runner: ModelRunner, buckets: list[int], cache_dir: str | None = None,
                 verify_ks: list[int] = ()):
        _utf8_locale()
        # inductor reads the variable whenever it opens its caches
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache_dir or default_cache_dir())
        # no freezing: inductor's caches refuse frozen graphs, so every start would
        # compile again; the GEMMs are the eager ones (oneDNN's packed bf16 through an
        # opaque op, models/packed_linear.py; MKL in fp32)
        self.runner, self.buckets = runner, sorted(buckets)
        self.compiled = list(self.buckets)
        self.verify_compiled = {(b, k) for b in self.buckets if b <= VERIFY_MAX_BUCKET
                                for k in verify_ks}
        self.rotary = runner.model.rotary_table()
        self.step = torch.compile(model_step(runner.model))
        self.warmed: WarmUp | None = None

    def compile_for_threads(self, counts, scratch_page: int, scratch_pages: list[int] | None = None) -> None:
        """Compile every kept step for each torch thread count in ``counts`` too (the
        compiled graphs are guarded on the thread count: a step at a count not seen here
        would recompile, ~1 s on the demo target and ~30 s on SmolLM2 here)."""
        before = torch.get_num_threads()
        batches = [batch for _, batch in self._kept_batches(scratch_page, scratch_pages)]
        try:
            for n in sorted(set(counts) - {before}):
                torch.set_num_threads(n)
                for batch in batches:
                    self.run(batch)
        finally:
            torch.set_num_threads(before)

    def _kept_batches(self, scratch_page: int, scratch_pages: list[int] | None):
        """((bucket, k), batch) for every kept step: token 0 at position 0 writing only
        ``scratch_page``, verify batches (k > 0) the ``scratch_pages``."""
        pages = scratch_pages or [scratch_page]
        for bucket, k in [(b, 0) for b in self.compiled] + sorted(self.verify_compiled):
            yield (bucket, k), ForwardBatch([[0] * (k + 1)] * bucket, [0] * bucket,
                                            [pages if k else [scratch_page]] * bucket)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The compiled step on any batch of new tokens (the caller decides that it pays)."""
        inputs, attention = self.runner.attention(batch)
        cos, sin = self.rotary.lookup(inputs.positions)
        ids = inputs.input_ids
        if ids.shape[0] > 1:   # one graph for every batch > 1 (1 is specialised anyway)
            for t in (ids, cos, sin):
                torch._dynamo.mark_dynamic(t, 0)
        _Forward.attention = attention
        try:
            return self.step(ids, cos, sin)
        finally:
            _Forward.attention = None

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        bucket = padded_size(len(batch.token_ids), self.buckets)
        if bucket not in self.compiled or any(len(t) != 1 for t in batch.token_ids):
            return None
        return self.run(batch)

    def forward_verify(self, batch: ForwardBatch, k: int) -> torch.Tensor | None:
        """A verify batch (at most k + 1 tokens per sequence) through the compiled step
        where warm-up kept it for (bucket, k); None otherwise."""
        if (padded_size(len(batch.token_ids), self.buckets), k) not in self.verify_compiled:
            return None
        return self.run(batch)

    def warm_up(self, scratch_page: int, measure: bool = True, rounds: int = 5,
                steps: int = 3, scratch_pages: list[int] | None = None) -> WarmUp:
        """Compile (or load from the cache) every graph now, so no request waits for it;
        with ``measure``, keep the compiled step only for the buckets (and verify
        (bucket, k)) where it is faster. The timed batches write only ``scratch_page``
        (token 0 at position 0); verify batches the ``scratch_pages`` (``[scratch_page]``
        by default: enough for k + 1 <= page_size)."""
        start = time.perf_counter()
        key, memory = self._warm_up_key(), self._warm_up_file()
        remembered = load_warm_up(memory, key) if measure else None
        if remembered is not None:   # compile what it kept (from inductor's cache), time nothing
            self.compiled, self.verify_compiled = list(remembered.compiled), set(remembered.verify_compiled)
            measure = False
        timings: dict[tuple[int, int], tuple[float, float]] = {}
        for (bucket, k), batch in self._kept_batches(scratch_page, scratch_pages):
            compiled = lambda: self.run(batch)
            try:
                compiled()
            except Exception:   # e.g. no working compiler, or a cache entry left torn by a kill
                log.exception("compiling the decode step failed; decoding eagerly (if the cache "
                              "is damaged, remove %s)", os.environ["TORCHINDUCTOR_CACHE_DIR"])
                self.compiled, self.verify_compiled = [], set()
                break
            if not measure:
                continue
            eager = lambda: self.runner.forward(batch)
            eager()
            runs = [(_ms_per_step(eager, steps), _ms_per_step(compiled, steps))
                    for _ in range(rounds)]        # interleaved; the fastest round of each
            timings[(bucket, k)] = (min(e for e, _ in runs), min(c for _, c in runs))
        if remembered is not None:
            self.warmed = dataclasses.replace(remembered, seconds=time.perf_counter() - start,
                                              compiled=list(self.compiled),
                                              verify_compiled=sorted(self.verify_compiled))
            return self.warmed
        decode = {b: t for (b, k), t in timings.items() if k == 0}
        verify = {shape: t for shape, t in timings.items() if shape[1]}
        if measure and self.compiled:
            self.compiled = buckets_worth_compiling(decode)
        if measure and self.verify_compiled:
            self.verify_compiled = {shape for shape, (e, c) in verify.items() if c < KEEP_MARGIN * e}
        self.warmed = WarmUp(time.perf_counter() - start, decode, list(self.compiled), verify,
                             sorted(self.verify_compiled))
        if measure and timings:
            save_warm_up(memory, key, self.warmed)
        return self.warmed

    def _warm_up_key(self) -> dict:
        """What warm-up's timings depend on (not the weights' values: their shapes)."""
        cfg = self.runner.model.config
        model = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else vars(cfg)
        return json.loads(json.dumps({
            "model": model, "kind": type(self.runner.model).__name__, "dtype": str(self.runner.dtype),
            "page_size": self.runner.pool.page_size, "kv_layout": self.runner.pool.kv_layout,
            "buckets": self.buckets, "verify": sorted(self.verify_compiled), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpu": _cpu_model()}, default=str))

    def _warm_up_file(self) -> Path:
        digest = hashlib.sha256(json.dumps(self._warm_up_key(), sort_keys=True).encode()).hexdigest()[:16]
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "tandem-warmup" / f"{digest}.json"
