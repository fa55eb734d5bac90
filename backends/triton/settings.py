"""Engine settings carried by a model's ``config.pbtxt`` ``parameters``, each field
declared once with what ``tandem serve`` needs to offer it as an option (:func:`setting`:
its flag and help; the ``TANDEM_*`` variable follows from the flag).

``tandem serve`` renders them into the config; Triton hands the config to the
model as JSON (``args["model_config"]``), where each parameter reads
``{"string_value": "..."}``.

>>> cfg = {"parameters": {"model_dir": {"string_value": "/m"}, "page_size": {"string_value": "32"}}}
>>> s = EngineSettings.from_model_config(cfg)
>>> (s.model_dir, s.page_size, s.kv_layout, s.num_pages)
('/m', 32, 'HND', 0)
>>> flag_of(fields(EngineSettings)[0]).flag
'--model'
"""

from __future__ import annotations

import json
import os
from dataclasses import Field, dataclass, field, fields
from pathlib import Path

from ..engine.config import COMPILE_MODES, ENGINE_DEFAULTS, EngineConfig
from ..kv_cache.pages import KV_LAYOUTS
from ..models.config import DTYPE_CHOICES
from ..models.dtype import AUTO, resolve_dtype
from ..speculative.config import (AUTO, DEFAULT_NUM_SPECULATIVE_TOKENS, METHODS, NO_SPECULATION,
                                  SpeculativeConfig)

# environment fallbacks of the KV transfer's settings (a parameter in config.pbtxt wins)
ENV_INTERFACE = "TANDEM_KV_INTERFACE"
ENV_TRANSPORTS = "TANDEM_KV_TRANSPORTS"
ENV_FAULTS = "TANDEM_FAULTS"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


FIELD_DEFAULT = object()   # a flag's default is its field's


@dataclass(frozen=True, slots=True)
class Flag:
    """How a setting is offered on a command line: ``--page-size`` (``TANDEM_PAGE_SIZE`` in the
    environment), its help (argparse's ``%(default)s`` allowed), choices, metavar, and
    its default there when that is not the field's (a server's fixed ports against a
    library's free ones)."""

    flag: str
    help: str = ""
    choices: tuple | None = None
    metavar: str | None = None
    default: object = FIELD_DEFAULT


def setting(default=None, flag: str | None = None, help: str = "", *, choices=None, metavar=None,
            default_factory=None, flag_default=FIELD_DEFAULT) -> Field:
    """A dataclass field; with ``flag``, also a command-line option (see :class:`Flag`)."""
    metadata = ({"flag": Flag(flag, help, tuple(choices) if choices else None, metavar, flag_default)}
                if flag else {})
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def flag_of(f: Field) -> Flag | None:
    """The command-line option of a field declared with :func:`setting` (None: none)."""
    return f.metadata.get("flag")


def parse_value(f: Field, raw: str):
    """``raw`` (a config.pbtxt string) as the value of field ``f``, by its annotation.

    >>> [parse_value(f, "1") for f in fields(EngineSettings) if f.name in ("page_size", "enforce_eager", "dtype")]
    ['1', 1, True]
    """
    kind = str(f.type)
    if kind == "str":
        return raw
    if kind == "float":
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"config.pbtxt: parameter {f.name}={raw!r} is not a number") from None
    if kind == "bool":
        word = raw.lower()
        if word not in _TRUE + _FALSE:
            raise ValueError(f"config.pbtxt: parameter {f.name}={raw!r}; allowed: 1 or 0")
        return word in _TRUE
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"config.pbtxt: parameter {f.name}={raw!r} is not an integer") from None


@dataclass(slots=True, frozen=True)
class EngineSettings:
    model_dir: str = setting("", "--model", "HF checkpoint directory, a .gguf file (converted once, "
                             "cached in $TANDEM_CACHE_DIR/gguf, else ~/.cache/tandem/gguf), "
                             "smollm2-135m-instruct (SmolLM2-135M-Instruct, the GGUF make install "
                             "installs), or demo (default: checkpoints/demo/target if "
                             "trained, else an untrained demo checkpoint in .cache/demo-untrained)")
    dtype: str = setting(ENGINE_DEFAULTS["dtype"], "--dtype", choices=DTYPE_CHOICES, help=(
        "weights' and KV's dtype; auto (default): bfloat16 where the CPU computes it natively "
        "(avx512_bf16 or amx_bf16), else float32"))
    page_size: int = setting(ENGINE_DEFAULTS["page_size"], "--page-size",
                             "tokens per KV page (default: %(default)s)")
    num_pages: int = setting(0, "--num-pages", "KV pages in the pool (default: %(default)s = automatic)")
    kv_layout: str = setting(ENGINE_DEFAULTS["kv_layout"], "--kv-layout", choices=KV_LAYOUTS)
    max_num_seqs: int = setting(ENGINE_DEFAULTS["max_num_seqs"], "--max-num-seqs",
                                "sequences per batch (default: %(default)s)")
    max_num_batched_tokens: int = setting(ENGINE_DEFAULTS["max_num_batched_tokens"], "--max-num-batched-tokens",
                                          "tokens per step (default: %(default)s)")
    torch_threads: int = setting(0, "--threads", "torch threads of each engine process (default: %(default)s "
                                 "= all cores; disaggregated: half each for prefill and decode)")
    cancel_poll_ms: int = 20              # how often in-flight requests are checked for cancellation
    spec_method: str = setting(NO_SPECULATION, "--spec", "speculative decoding method; auto: prompt lookup "
                               "(ngram) for a sequence whose tokens hold a match, the MTP head (else the draft) "
                               "otherwise (default: %(default)s)", choices=(NO_SPECULATION, *METHODS, AUTO))
    num_speculative_tokens: int = setting(DEFAULT_NUM_SPECULATIVE_TOKENS, "--k",
                                          "draft tokens per step with --spec; with --spec-adaptive on the most "
                                          "(default: %(default)s)")
    spec_adaptive: str = setting("on", "--spec-adaptive", choices=("on", "off"), help=(
        "with --spec: each step drafts 0..k tokens, the number with the most expected tokens per second from "
        "step costs measured on this machine and each sequence's recent acceptance (0: a plain step); off: "
        "always k (default: %(default)s)"))
    draft_model: str = setting("", "--draft-model", "draft checkpoint (default: checkpoints/demo/draft)")
    mtp_head: str = setting("", "--mtp-head", "MTP head checkpoint (default: the first of checkpoints/smollm2/mtp and checkpoints/demo/mtp that fits the target)")
    # decode speed (engine/config.py)
    draft_vocab_size: int = setting(
        0, "--draft-vocab-size", "with --spec draft_target or mtp: the proposer scores only its N most "
        "frequent tokens (token_frequencies.json in its checkpoint; lossless, only acceptance changes) "
        "(default: %(default)s = all)", metavar="N")
    compile: str = setting(ENGINE_DEFAULTS["compile"], "--compile", choices=COMPILE_MODES, help=(
        "CPU: the decode step through torch.compile, compiled at start-up; auto (default): kept for the batch "
        "sizes where it measured faster than eager; all: for every batch size (bf16 greedy text can differ "
        "from the eager engine's at near-ties)"))
    compile_cache_dir: str = setting("", "--compile-cache-dir", "inductor's persistent compile caches (default: "
                                     "$TORCHINDUCTOR_CACHE_DIR, else ~/.cache/tandem/inductor)", metavar="DIR")
    enforce_eager: bool = setting(False, "--enforce-eager", "run every step eagerly: no compiled decode step "
                                  "(CPU), no CUDA graphs (GPU)")
    prefix_caching: str = setting("on", "--prefix-caching", choices=("on", "off"), help=(
        "automatic prefix caching: full KV pages a prompt computed are kept and reused by later prompts with the "
        "same prefix (chat turns, system prompts); a request's cache_salt keeps its prefixes to itself "
        "(default: %(default)s)"))
    kv_audit: float = setting(ENGINE_DEFAULTS["kv_audit"], "--kv-audit", metavar="RATE", help=(
        "the share (0 to 1) of prefix-cache hits whose pages' checksums, recorded when they were published, are "
        "recomputed before use; a page that changed is dropped from the cache and recomputed, never served "
        "(tandem_prefix_cache_corrupt_pages_total) (default: %(default)s; 0: no checksums)"))
    kv_audit_recompute: float = setting(ENGINE_DEFAULTS["kv_audit_recompute"], "--kv-audit-recompute",
                                        metavar="RATE", help=(
        "the share (0 to 1) of prefix-cache hits declined and computed afresh, each recomputed page compared with "
        "the cached page of its key: catches a page that was wrong when published, which checksums cannot; one "
        "that disagrees is dropped (tandem_prefix_cache_disagreeing_pages_total). Costs the declined hits' prefill "
        "(default: %(default)s)"))
    max_loras: int = setting(0, "--max-loras", help=(
        "LoRA adapters held at once in each engine's adapter slots; a request names one by the OpenAI model field "
        "or the lora_name / lora_task_id input (default: %(default)s = no LoRA)"))
    max_lora_rank: int = setting(16, "--max-lora-rank", "the largest adapter rank the slots hold (default: %(default)s)")
    lora_dir: str = ""                    # the server's adapter registry (tandem serve: <run dir>/loras)
    tensor_parallel_size: int = setting(1, "--tp", metavar="N", help=(
        "tensor-parallel ranks of each engine this server runs (colocated, prefill, decode): the model split over N "
        "processes on this host (the model's stub and N - 1 it starts), sharing its --threads (default: "
        "%(default)s)"))
    prefill_tensor_parallel_size: int = setting(0, "--prefill-tp", metavar="N", help=(
        "the prefill engine's ranks, where they differ from --tp; on a decode server that sends its prefills to "
        "--prefill-endpoints, the ranks those prefill servers run (the KV transfers are planned for their split) "
        "(default: --tp)"))
    decode_tensor_parallel_size: int = setting(0, "--decode-tp", metavar="N", help=(
        "the decode engine's ranks, where they differ from --tp (default: --tp)"))
    prefill_endpoints: str = setting("", "--prefill-endpoints", "host:port,... gRPC endpoints of prefill servers "
                                     "(`tandem serve --mode prefill`) that this decode server sends its prefills "
                                     "to (default: its own)")
    prefill_routing: str = setting("cache_aware", "--prefill-routing", choices=("cache_aware", "round_robin"), help=(
        "with several --prefill-endpoints, which one takes a prompt: cache_aware (default): the one most likely "
        "to hold a long prefix of it in its prefix cache (from the prompts sent to each), unless that one's "
        "backlog outweighs the cached tokens; round_robin: in turn"))
    # conditional disaggregation (backends/disagg/routing.py): where kv_transfer sends each prompt
    disagg_policy: str = setting(
        "conditional", "--disagg-policy", "where a disaggregated server prefills each prompt: conditional "
        "(default: short prompts, or all while the prefill side is busy, in decode's own batch; long ones on "
        "the prefill side), remote (always the prefill side), local (always decode); thresholds as "
        "conditional:local_prompt_tokens=256,max_prefill_wait_ms=1000,prefill_tokens_per_s=5000,"
        "max_local_prefill_tokens=2048", metavar="POLICY")
    decode_idle_threads: int = 0          # decode's torch threads while prefill idles; 0: torch_threads
    decode_borrow_min_seqs: int = 12      # ... and while its batch holds at least this many sequences
    prefill_idle_threads: int = 0         # the local prefill's torch threads while decode has no sequence
    # the KV transfer (kv_transfer, prefill, decode)
    kv_interface: str = setting(
        "", "--kv-interface", "network devices the KV cache travels on between prefill and decode servers "
        "(UCX_NET_DEVICES of the KV transfer): an interface (eth0), an RDMA port (mlx5_0:1; needs a UCX built "
        "with verbs: the wheel's has none, so set RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true to load the "
        "system's), comma separated, or all (default: lo, i.e. one host only)", metavar="IFACE[,IFACE...]")
    kv_transports: str = setting(
        "", "--kv-transports", "UCX transports the KV transfer may use (UCX_TLS), e.g. tcp: TCP only, no "
        "shared memory or CMA even where UCX sees one host (network namespaces, containers); rc,ud,sm with "
        "RDMA (default: UCX's choice)", metavar="TLS")
    kv_load_failure_policy: str = setting(
        "recompute", "--kv-load-failure-policy", choices=("recompute", "fail"), help=(
            "a request whose prompt KV transfer failed (the prefill process died or was restarting, the link "
            "dropped, the transfer timed out): recompute (default): decode prefills the prompt itself and serves "
            "it; fail: it ends with UNAVAILABLE (vLLM's name)"))
    kv_headroom_pages: int | None = None  # pages reservations leave to running sequences; None: auto
    kv_transfer_timeout_s: int = 10       # a reservation fed nothing this long fails
    kv_drain_s: int = 30                  # an unloading kv_transfer waits this long for its transfers
    faults: str = setting("", "--faults", "fault injection for tests and benchmarks, passed to the models "
                          "(config parameter `faults`, env TANDEM_FAULTS), e.g. 'transfer_fail=0.05@mid_layers,"
                          "seed=1'; format: rdma/faults.py (default: off)", metavar="SPEC")

    dtype_reason: str = ""                # why this dtype (set when it was auto)

    def __post_init__(self) -> None:
        # resolved where the settings are made (tandem serve), so every model of a server
        # renders and runs the same concrete dtype
        if self.dtype == AUTO:
            choice = resolve_dtype(AUTO, "cpu")
            object.__setattr__(self, "dtype", choice.dtype)
            object.__setattr__(self, "dtype_reason", choice.reason)

    @classmethod
    def from_model_config(cls, model_config: dict) -> "EngineSettings":
        params = {k: v.get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}
        if not params.get("model_dir"):
            raise ValueError("config.pbtxt: parameter model_dir is required (a checkpoint directory)")
        values: dict = {}
        for f in fields(cls):
            raw = params.get(f.name, "").strip()
            if raw and not raw.startswith("${"):  # unset, or an unrendered template placeholder
                values[f.name] = parse_value(f, raw)
        s = cls(**values)
        s.check()
        return s

    def check(self) -> None:
        if self.num_pages < 0:
            raise ValueError(f"config.pbtxt: num_pages={self.num_pages}; allowed: >= 1, or 0 for automatic")
        try:
            self.engine_config().validate()
        except ValueError as e:
            raise ValueError(f"config.pbtxt: {e}") from None
        if self.cancel_poll_ms < 1:
            raise ValueError(f"config.pbtxt: cancel_poll_ms={self.cancel_poll_ms}; allowed: an integer >= 1")
        if self.torch_threads < 0:
            raise ValueError(f"config.pbtxt: torch_threads={self.torch_threads}; allowed: >= 0 (0 = all cores)")
        if self.kv_headroom_pages is not None and self.kv_headroom_pages < 0:
            raise ValueError(f"config.pbtxt: kv_headroom_pages={self.kv_headroom_pages}; allowed: >= 0")
        for name in ("kv_transfer_timeout_s", "kv_drain_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"config.pbtxt: {name}={getattr(self, name)}; allowed: an integer >= 1")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"config.pbtxt: kv_load_failure_policy={self.kv_load_failure_policy!r}; "
                             "allowed: recompute, fail")
        if self.decode_borrow_min_seqs < 0:
            raise ValueError(f"config.pbtxt: decode_borrow_min_seqs={self.decode_borrow_min_seqs}; allowed: >= 0")
        if self.prefill_idle_threads < 0:
            raise ValueError(f"config.pbtxt: prefill_idle_threads={self.prefill_idle_threads}; allowed: >= 0 "
                             "(0: torch_threads)")
        if self.decode_idle_threads < 0:
            raise ValueError(f"config.pbtxt: decode_idle_threads={self.decode_idle_threads}; allowed: >= 0 "
                             "(0 = torch_threads)")
        try:
            self.routing_policy()
        except ValueError as e:
            raise ValueError(f"config.pbtxt: {e}") from None
        try:
            self.fault_plan()
        except ValueError as e:
            raise ValueError(f"config.pbtxt: faults: {e}") from None

    @property
    def engine_num_pages(self) -> int | None:
        return self.num_pages or None

    @property
    def threads(self) -> int:
        return self.torch_threads or (os.cpu_count() or 1)

    def speculative(self) -> SpeculativeConfig | None:
        if self.spec_method == NO_SPECULATION:
            return None
        return SpeculativeConfig(self.spec_method, self.num_speculative_tokens,
                                 draft_model=self.draft_model or None, mtp_head=self.mtp_head or None,
                                 draft_vocab_size=self.draft_vocab_size or None,
                                 adaptive=self.spec_adaptive == "on")

    def routing_policy(self):
        """Where kv_transfer sends each prompt (:class:`~tandem.backends.disagg.routing.RoutingPolicy`)."""
        from ..disagg.routing import RoutingPolicy
        return RoutingPolicy.parse(self.disagg_policy)

    @property
    def idle_threads(self) -> int:
        """Decode's torch threads while the prefill side has nothing to do."""
        return self.decode_idle_threads or self.threads

    @property
    def prefill_idle_threads_or_threads(self) -> int:
        """The local prefill's torch threads while decode holds no sequence."""
        return self.prefill_idle_threads or self.threads

    @property
    def net_devices(self) -> str:
        """The UCX network devices the KV transfer uses (loopback unless configured)."""
        return self.kv_interface or os.environ.get(ENV_INTERFACE, "") or "lo"

    @property
    def transports(self) -> str:
        """The UCX transports the KV transfer may use ("": UCX's choice)."""
        return self.kv_transports or os.environ.get(ENV_TRANSPORTS, "")

    def fault_plan(self):
        """The faults to inject (``faults``, else ``$TANDEM_FAULTS``); None: none."""
        from tandem.rdma.faults import Faults
        return Faults.configured(self.faults or os.environ.get(ENV_FAULTS, ""))

    @property
    def prefill_tp(self) -> int:
        """The prefill engine's tensor-parallel ranks (here, or on the prefill servers)."""
        return self.prefill_tensor_parallel_size or self.tensor_parallel_size

    @property
    def decode_tp(self) -> int:
        """The decode engine's tensor-parallel ranks (its shared pool is split for them)."""
        return self.decode_tensor_parallel_size or self.tensor_parallel_size

    def engine_config(self, **overrides) -> EngineConfig:
        return EngineConfig(self.model_dir, **(self.engine_kwargs() | overrides))

    def engine_kwargs(self) -> dict:
        return dict(dtype=self.dtype, page_size=self.page_size, kv_layout=self.kv_layout,
                    num_pages=self.engine_num_pages, max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=self.max_num_batched_tokens,
                    speculative=self.speculative(), enable_prefix_caching=self.prefix_caching == "on",
                    compile=self.compile,
                    compile_cache_dir=self.compile_cache_dir or None, enforce_eager=self.enforce_eager,
                    kv_audit=self.kv_audit, kv_audit_recompute=self.kv_audit_recompute,
                    max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                    tensor_parallel_size=self.tensor_parallel_size)

    def adapters(self):
        """The server's LoRA adapter registry (:mod:`.lora_registry`), or None without LoRA."""
        if not self.max_loras or not self.lora_dir:
            return None
        from .lora_registry import AdapterRegistry
        config = json.loads((Path(self.model_dir) / "config.json").read_text())
        return AdapterRegistry(self.lora_dir, config, self.max_lora_rank)


def model_limits(model_dir: str) -> tuple[int, int]:
    """``(vocab_size, max_model_len)`` of a checkpoint: what every model on the request
    path checks token ids and lengths against (the engine's context is the checkpoint's
    ``max_position_embeddings``; ``tandem serve`` sets no other)."""
    from tandem.backends.models.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    return cfg.vocab_size, cfg.max_position_embeddings
