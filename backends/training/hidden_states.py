"""Target hidden states for MTP-head training, computed by the engine's own forward.

The head learns from exactly what the engine will feed it at serving time: the
target's pre-norm last hidden states as :class:`~tandem.backends.engine.model_runner.ModelRunner`
computes them over the paged KV cache, in the serving dtype (bf16 by default), not
from a separate training-only implementation. They are computed once per
(target weights, token windows, dtype) and cached on disk.

>>> windows = train_windows(stream, num_windows=512, window_len=512, seed=0)  # doctest: +SKIP
>>> hs = load_or_compute(target_dir, windows, ".cache/train/mtp/hidden")     # doctest: +SKIP
>>> hs.tokens.shape, hs.hidden.shape                                          # doctest: +SKIP
(torch.Size([512, 512]), torch.Size([512, 512, 384]))

With ``fuse_layers`` (an EAGLE-3-style head, :class:`~tandem.backends.models.mtp.MTPHead`)
the outputs of those decoder layers are recorded in the same forward (hooks on the
target's layers, so the engine's forward is unchanged) and kept as ``features``
[n, W, k*H]; when the last layer is among them ``hidden`` is a view into ``features``.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.model_runner import ForwardBatch, ModelRunner
from ..kv_cache import KVPagePool, pages_needed
from ..models import LlamaForCausalLM, forward_dense, load_model

log = logging.getLogger("tandem.train")


@dataclass(slots=True)
class HiddenStates:
    tokens: torch.Tensor    # [n, W] int64: token windows, each starting at KV position 0
    hidden: torch.Tensor    # [n, W, H]: the target's pre-norm last hidden state of every token
    lengths: torch.Tensor | None = None     # [n]: tokens before the padding (None: all W)
    features: torch.Tensor | None = None    # [n, W, k*H]: outputs of a fused head's layers

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def batch_features(self, idx: torch.Tensor, device: str | torch.device = "cpu"
                       ) -> torch.Tensor | None:
        """``features`` of windows ``idx``, cut as :meth:`batch` cuts (None without them)."""
        if self.features is None:
            return None
        w = self.features.shape[1] if self.lengths is None else int(self.lengths[idx].max())
        return self.features[idx, :w].to(device)

    def batch(self, idx: torch.Tensor, device: str | torch.device = "cpu"
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Tokens, hidden states and lengths of windows ``idx``, cut after the longest of
        them (attention is causal: the padding after it changes nothing before it)."""
        if self.lengths is None:
            return self.tokens[idx].to(device), self.hidden[idx].to(device), None
        lengths = self.lengths[idx]
        w = int(lengths.max())
        return (self.tokens[idx, :w].to(device), self.hidden[idx, :w].to(device),
                lengths.to(device))


def train_windows(stream: torch.Tensor, num_windows: int, window_len: int, seed: int) -> torch.Tensor:
    """``num_windows`` distinct non-overlapping windows [n, window_len] of a token stream,
    chosen at random (seeded): a subset of the corpus sized for the machine."""
    available = stream.numel() // window_len
    if available == 0:
        raise ValueError(f"token stream has {stream.numel()} tokens, fewer than one window "
                         f"of {window_len}")
    g = torch.Generator().manual_seed(seed)
    picks = torch.randperm(available, generator=g)[:num_windows].sort().values
    idx = picks[:, None] * window_len + torch.arange(window_len)
    return stream[idx].long()


def first_windows(stream: torch.Tensor, num_windows: int, window_len: int) -> torch.Tensor:
    """The first ``num_windows`` non-overlapping windows [n, window_len] of a token stream
    (the validation windows; :func:`train_windows` picks the training ones at random)."""
    n = min(num_windows, stream.numel() // window_len)
    if n == 0:
        raise ValueError(f"validation stream has {stream.numel()} tokens, fewer than one "
                         f"window of {window_len}")
    return stream[:n * window_len].view(n, window_len).long()


@contextlib.contextmanager
def recording_layer_outputs(target: LlamaForCausalLM, layers: tuple[int, ...]):
    """Within the block, ``outputs[j]`` is the output of decoder layer ``layers[j]`` in the
    latest forward of ``target`` (forward hooks: the forward itself is unchanged)."""
    outputs: list[torch.Tensor | None] = [None] * len(layers)

    def hook(j):
        def record(_module, _args, out):
            outputs[j] = out
        return record

    handles = [target.layers[l].register_forward_hook(hook(j)) for j, l in enumerate(layers)]
    try:
        yield outputs
    finally:
        for h in handles:
            h.remove()


FORWARDS = ("auto", "paged", "dense")


def pick_forward(forward: str, device: str | torch.device) -> str:
    """``auto``: the engine's paged forward, except on CUDA without FlashInfer (the paged
    path's kernels there), where the dense training forward of the same model runs.

    >>> pick_forward("auto", "cpu"), pick_forward("dense", "cpu")
    ('paged', 'dense')
    """
    if forward not in FORWARDS:
        raise ValueError(f"forward {forward!r} is invalid; allowed: {', '.join(FORWARDS)}")
    if forward != "auto":
        return forward
    from ..attention import flashinfer_impl
    return "dense" if torch.device(device).type == "cuda" and not flashinfer_impl.available() \
        else "paged"


@torch.no_grad()   # not inference_mode: the result is a training input
def compute_hidden_states(target: LlamaForCausalLM, windows: torch.Tensor,
                          batch_windows: int = 8, page_size: int = 16,
                          fuse_layers: tuple[int, ...] | None = None, forward: str = "paged"
                          ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[n, W, H] hidden states of ``windows`` [n, W] through ModelRunner's paged prefill
    (FlashInfer-shaped wrappers; FlashInfer itself on CUDA), or with ``forward="dense"``
    the model's dense causal forward (right-padded windows: the padding is after every
    real token), returned on the CPU; with ``fuse_layers`` also those layers' outputs
    concatenated, [n, W, k*H] (the pair)."""
    cfg, w = target.config, target.embed_tokens.weight
    n, width = windows.shape
    h = cfg.hidden_size
    if forward == "dense":
        batch_windows = max(batch_windows, 32)   # no pages to size: fewer, larger forwards
        run = lambda chunk, pages: forward_dense(target, chunk).flatten(0, 1)  # noqa: E731
    else:
        per_window = pages_needed(width, page_size)
        pool = KVPagePool.for_model(cfg, batch_windows * per_window, page_size, w.dtype, "HND",
                                    w.device)
        runner = ModelRunner(target, pool)
        run = lambda chunk, pages: runner.forward(  # noqa: E731
            ForwardBatch(chunk.tolist(), [0] * len(chunk), pages))[1]
    layers = tuple(fuse_layers or ())
    features = torch.empty(n, width, len(layers) * h, dtype=w.dtype) if layers else None
    last = cfg.num_hidden_layers - 1
    # the last layer's output is the hidden state itself: a view, not a second copy
    out = features[..., layers.index(last) * h:(layers.index(last) + 1) * h] \
        if last in layers else torch.empty(n, width, h, dtype=w.dtype)
    with recording_layer_outputs(target, layers) as recorded:
        for a in range(0, n, batch_windows):
            chunk = windows[a:a + batch_windows]
            pages = None if forward == "dense" else \
                [list(range(i * per_window, (i + 1) * per_window)) for i in range(len(chunk))]
            hidden = run(chunk, pages)
            if features is not None:
                features[a:a + len(chunk)] = torch.cat(recorded, -1).view(
                    len(chunk), width, -1).cpu()
            if last not in layers:
                out[a:a + len(chunk)] = hidden.view(len(chunk), width, -1).cpu()
    return out if features is None else (out, features)


def target_fingerprint(target_dir: str | Path) -> str:
    """sha256 of the target's config.json and weights: a head is trained for one target."""
    h = hashlib.sha256()
    target_dir = Path(target_dir)
    for f in [target_dir / "config.json", *sorted(target_dir.glob("*.safetensors"))]:
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def load_or_compute(target_dir: str | Path, windows: torch.Tensor, cache_dir: str | Path,
                    dtype: str = "bfloat16", device: str = "cpu",
                    target: LlamaForCausalLM | None = None,
                    lengths: torch.Tensor | None = None,
                    fuse_layers: tuple[int, ...] | None = None,
                    forward: str = "paged") -> HiddenStates:
    """Hidden states of ``windows`` from the cache, or computed (and cached) when the
    target's weights, the windows or the dtype changed; ``lengths``: of right-padded
    windows (self-distillation rows), kept with them; ``fuse_layers``: with those layers'
    outputs as ``features`` (a separate cache entry); ``forward``: ``paged`` (the engine's)
    or ``dense`` (:func:`compute_hidden_states`), part of the cache key."""
    key = hashlib.sha256()
    key.update(target_fingerprint(target_dir).encode())
    key.update(f"{dtype}:{tuple(windows.shape)}".encode())
    key.update(windows.to(torch.int32).numpy().tobytes())
    prefix = "hidden"
    if forward != "paged":
        key.update(f"forward:{forward}".encode())
    if fuse_layers is not None:
        key.update(f"fuse_layers:{tuple(fuse_layers)}".encode())
        prefix = "fused"
    path = Path(cache_dir) / f"{prefix}-{key.hexdigest()[:16]}.pt"
    if path.is_file():
        log.info("hidden states: cached %s", path)
        return _hidden_states(windows, torch.load(path), lengths, fuse_layers)
    if target is None:
        target = load_model(target_dir, dtype, device)
    t0 = time.monotonic()
    result = compute_hidden_states(target, windows.to(target.embed_tokens.weight.device),
                                   fuse_layers=fuse_layers, forward=forward)
    saved = result if fuse_layers is None else _fused_file(*result, target, fuse_layers)
    size = sum(t.numel() * t.element_size() for t in
               ([saved] if fuse_layers is None else saved.values()))
    log.info("hidden states: %d windows x %d tokens through the %s forward in %.0f s "
             "(%s, %.0f MB%s) -> %s", *windows.shape,
             "engine's paged" if forward == "paged" else "dense", time.monotonic() - t0, dtype, size / 1e6,
             "" if fuse_layers is None else f", layers {list(fuse_layers)}", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(saved, tmp)
    tmp.replace(path)
    return _hidden_states(windows, saved, lengths, fuse_layers)


def _fused_file(hidden: torch.Tensor, features: torch.Tensor, target: LlamaForCausalLM,
                fuse_layers: tuple[int, ...]) -> dict:
    """What a fused cache entry stores: the features, and the hidden states only when
    the last layer is not among them."""
    last = target.config.num_hidden_layers - 1
    return {"features": features} if last in fuse_layers else \
        {"features": features, "hidden": hidden}


def _hidden_states(windows, saved, lengths, fuse_layers) -> HiddenStates:
    if fuse_layers is None:
        return HiddenStates(windows, saved, lengths)
    features = saved["features"]
    if "hidden" in saved:
        return HiddenStates(windows, saved["hidden"], lengths, features)
    # the last layer (the largest index) is among them: its slice, stored once
    h = features.shape[-1] // len(fuse_layers)
    j = list(fuse_layers).index(max(fuse_layers))
    return HiddenStates(windows, features[..., j * h:(j + 1) * h], lengths, features)
