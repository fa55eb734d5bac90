"""MTP-head training (``tandem train mtp``): one decoder layer on a frozen target.

The head (:class:`~tandem.backends.models.mtp.MTPHead`) is trained on the target's
hidden states, precomputed by the engine's paged forward (:mod:`.hidden_states`).
The target's embeddings, final norm and lm_head are used frozen and never copied
into the head's checkpoint. Row ``i`` of a window reads ``(t_{i+1}, h_i)``; its
output ``g_i`` is trained towards the target's next position:

    loss = ce_weight  * CE(softmax(lm_head(norm(h_{i+1}))), lm_head(norm(g_i)))
         + reg_weight * SmoothL1(g_i, h_{i+1})

The cross-entropy's labels are by default the target's own next-token distribution
(its logits at row ``i+1``, computed from the cached ``h_{i+1}`` for the price of one
lm_head GEMM): what greedy acceptance measures is agreement with the target, not
with the corpus. ``ce_labels="data"`` uses the corpus tokens instead. The hidden-state
regression keeps ``g`` in the target's hidden space, which the head needs to draft
more than one token (it then reads its own ``g`` in place of ``h``). EAGLE weights
the two as 1 (regression) : 0.1 (classification); here the classification term is
the one acceptance depends on, so it gets weight 1 and the regression 0.1 by
default (see configs/mtp.json).

``mtp.fuse_layers`` (e.g. ``[1, 3, 5]``) trains an EAGLE-3-style head whose first step reads
a fusion of those target layers' outputs (recorded with the hidden states) instead of
``h_i``; see :class:`~tandem.backends.models.mtp.MTPHead`. Such a head is freshly
initialised where its shapes are new (``fc``, the per-layer norms); ``init_from`` a plain
head copies the rest (norms, ``proj``, the decoder layer).

``unroll > 1`` adds EAGLE-3-style training-time test: step ``p`` feeds step ``p-1``'s
output back as the hidden state, at the positions and with the KV the engine's
:meth:`MTPProposer.propose` uses, weighted ``unroll_decay ** (p-1)``.

The loop (optimizer, schedule, cadence, resume) is :func:`.loop.run_training`; this
module gives it the head's batches, loss, evaluation and exports.

>>> cfg = MTPTrainConfig.from_file("configs/mtp.json")                         # doctest: +SKIP
>>> train_mtp(cfg, "checkpoints/demo/target", data, ".cache/train/mtp", "checkpoints/demo/mtp")  # doctest: +SKIP
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models import LlamaForCausalLM, load_model
from ..models.mtp import MTPHead, save_mtp_head
from .data import batch_generator, on_distill_rows
from .distill import DistillRows
from .hidden_states import (FORWARDS, HiddenStates, first_windows, load_or_compute, pick_forward,
                            target_fingerprint, train_windows)
from .lm import init_weights
from .loop import (OptimConfig, StateFile, adamw, autocast, config_section, replacing_dir,
                   run_training)

log = logging.getLogger("tandem.train")
EVAL_STEPS = 3
CONFIG_NAME = "mtp config"         # in its error messages


@dataclass(slots=True)
class MTPConfig:
    use_norms: bool = True          # the RMSNorms EAGLE dropped, re-introduced
    num_windows: int = 512          # training windows of optim.seq_len tokens (the token subset)
    hidden_dtype: str = "bfloat16"  # dtype of the target run that produces the hidden states
    ce_labels: str = "target"       # "target": the target's next-token distribution; "data"
    ce_weight: float = 1.0
    reg_weight: float = 0.1         # smooth L1 of g_i onto h_{i+1}
    unroll: int = 1                 # draft steps trained per row (training-time test)
    unroll_decay: float = 0.5       # weight of step p is unroll_decay ** (p - 1)
    distill_fraction: float = 1.0   # with --distill-data: share of steps on its rows (the rest
                                    # on num_windows windows of the corpus stream)
    fuse_layers: list[int] | None = None  # EAGLE-3-style fused input (None: h_i, the plain head)
    intermediate_size: int | None = None  # the head's MLP width (None: the target's)
    hidden_forward: str = "auto"    # target forward of the hidden states: paged (the engine's),
                                    # dense, auto (dense on CUDA without FlashInfer)


@dataclass(slots=True)
class MTPTrainConfig:
    mtp: MTPConfig = field(default_factory=MTPConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    init_from: str | None = None    # a trained head to fine-tune (e.g. on self-distillation data)

    @classmethod
    def from_dict(cls, d: dict) -> "MTPTrainConfig":
        allowed = {"mtp", "optim", "init_from", "comment"}
        if set(d) - allowed:
            raise ValueError(f"{CONFIG_NAME}: unknown sections {sorted(set(d) - allowed)}; "
                             f"allowed: {', '.join(sorted(allowed))}")
        cfg = cls(config_section(MTPConfig, d.get("mtp", {}), CONFIG_NAME),
                  config_section(OptimConfig, d.get("optim", {}), CONFIG_NAME),
                  d.get("init_from"))
        if not 0.0 <= cfg.mtp.distill_fraction <= 1.0:
            raise ValueError(f"mtp.distill_fraction {cfg.mtp.distill_fraction} is invalid; "
                             "allowed: a number in [0, 1]")
        if cfg.mtp.ce_labels not in ("target", "data"):
            raise ValueError(f"mtp.ce_labels {cfg.mtp.ce_labels!r} is invalid; allowed: target, data")
        if cfg.mtp.unroll < 1:
            raise ValueError(f"mtp.unroll {cfg.mtp.unroll} is invalid; allowed: >= 1")
        if cfg.mtp.hidden_forward not in FORWARDS:
            raise ValueError(f"mtp.hidden_forward {cfg.mtp.hidden_forward!r} is invalid; allowed: "
                             f"{', '.join(FORWARDS)}")
        if cfg.mtp.fuse_layers is not None and not isinstance(cfg.mtp.fuse_layers, list):
            raise ValueError(f"mtp.fuse_layers {cfg.mtp.fuse_layers!r} is invalid; allowed: a "
                             "list of target layer indices, e.g. [1, 3, 5], or absent")
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "MTPTrainConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict:
        return {"mtp": asdict(self.mtp), "optim": asdict(self.optim), "init_from": self.init_from}


# -- the head's training forward ---------------------------------------------------------

class UnrolledAttention:
    """Dense attention of the training forward; the engine's MTPProposer computes the
    same rows on its paged cache (tests/unit/test_mtp_training.py checks they agree).

    Step 1 is causal over its rows. Row i of step p (p >= 2) sits at position i+p-1 and sees what the head's KV cache holds when
    the engine drafts that token: step 1's rows 0..i (computed from the target's hidden
    states after verification) and row i of steps 2..p (the drafts before it)."""

    def __init__(self, batch: int):
        self.batch = batch
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, layer, q, k, v):
        b = self.batch
        r = q.shape[0] // b
        q, k, v = (x.view(b, r, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        self.kv.append((k, v))
        if len(self.kv) == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            keys = torch.cat([kk[:, :, :r] for kk, _ in self.kv], 2)
            values = torch.cat([vv[:, :, :r] for _, vv in self.kv], 2)
            i = torch.arange(r, device=q.device)
            causal = i[None, :] <= i[:, None]
            diagonal = i[None, :] == i[:, None]
            mask = torch.cat([causal] + [diagonal] * (len(self.kv) - 1), 1)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * r, out.shape[1], out.shape[3])


@dataclass(slots=True)
class StepLosses:
    loss: torch.Tensor          # weighted total, for backward
    ce: list[float]             # per draft step
    kl: list[float]             # KL(target || head) of the next-token distributions
    reg: list[float]
    top1: list[float]           # argmax agreement with the target's next token
    matches: list[torch.Tensor] = field(default_factory=list)   # per step [B, r] bool
    masks: list[torch.Tensor | None] = field(default_factory=list)  # per step, as label_mask


def unrolled_forward(head: MTPHead, target: LlamaForCausalLM, tokens: torch.Tensor,
                     hidden: torch.Tensor, steps: int,
                     features: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The head's outputs for draft steps 1..steps over windows tokens [B, W] with the
    target's hidden states [B, W, H]: row i of step p reads t_{i+p} and (step 1) h_i or
    (later steps) row i of step p-1, at position i+p-1, and is trained towards h_{i+p}.
    A fused head's step 1 reads ``head.fuse(features)`` [B, W, k*H] in place of h_i.
    Returns [B, W-1-p, H] per step (rows whose label t_{i+p+1} is in the window)."""
    b, w = tokens.shape
    attn = UnrolledAttention(b)
    if head.fuse_layers is not None:
        if features is None:
            raise ValueError(f"MTP head with fuse_layers {list(head.fuse_layers)}: no layer "
                             "features given (HiddenStates computed without fuse_layers?)")
        g = head.fuse(features[:, :w - 2])
    else:
        g = hidden[:, :w - 2]
    out = []
    for p in range(1, steps + 1):
        r = w - 1 - p
        if r < 1:
            break
        positions = (torch.arange(r, device=tokens.device) + p - 1).repeat(b)
        g = head(target, tokens[:, p:p + r].reshape(-1), g[:, :r].reshape(b * r, -1), positions,
                 attn).view(b, r, -1)
        out.append(g)
    return out


def label_mask(lengths: torch.Tensor | None, rows: int, p: int) -> torch.Tensor | None:
    """[B, rows] bool: the rows of draft step ``p`` whose label ``t_{i+p+1}`` lies before
    the padding of windows with ``lengths`` tokens (None: every row, no padding).

    >>> label_mask(torch.tensor([4, 6]), rows=4, p=1).int().tolist()
    [[1, 1, 0, 0], [1, 1, 1, 1]]
    """
    if lengths is None:
        return None
    return torch.arange(rows, device=lengths.device)[None, :] + p + 1 < lengths[:, None]


def _mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of per-row values x [B, r] over the rows of ``mask`` (all of them if None)."""
    if mask is None:
        return x.mean()
    return (x * mask).sum() / mask.sum().clamp(min=1)


def mtp_loss(head: MTPHead, target: LlamaForCausalLM, tokens: torch.Tensor, hidden: torch.Tensor,
             cfg: MTPConfig, amp: str = "bf16", lengths: torch.Tensor | None = None,
             features: torch.Tensor | None = None) -> StepLosses:
    """Loss of a batch of windows: tokens [B, W], the target's hidden states [B, W, H];
    ``lengths`` [B] (self-distillation rows are right-padded): rows whose label is padding
    do not count; ``features`` [B, W, k*H]: a fused head's layer outputs."""
    hidden = hidden.to(target.embed_tokens.weight.dtype)
    if features is not None:
        features = features.to(hidden.dtype)
    total = torch.zeros((), device=tokens.device)
    ce_l, kl_l, reg_l, top1_l, matches, masks = [], [], [], [], [], []
    with autocast(amp):
        steps = unrolled_forward(head, target, tokens, hidden, cfg.unroll, features)
    for p, g in enumerate(steps, 1):
        b, r = g.shape[:2]
        mask = label_mask(lengths, r, p)
        want = hidden[:, p:p + r]                       # h_{i+p}
        with autocast(amp):
            logits = target.compute_logits(g)
            with torch.no_grad():
                t_logits = target.compute_logits(want)  # the target's own next-token logits
        if cfg.ce_labels == "target":
            ce = F.cross_entropy(logits.flatten(0, 1), t_logits.flatten(0, 1).softmax(-1),
                                 reduction="none")
        else:
            ce = F.cross_entropy(logits.flatten(0, 1), tokens[:, p + 1:p + 1 + r].reshape(-1),
                                 reduction="none")
        ce = _mean(ce.view(b, r), mask)
        reg = _mean(F.smooth_l1_loss(g.float(), want.float(), reduction="none").mean(-1), mask)
        total = total + cfg.unroll_decay ** (p - 1) * (cfg.ce_weight * ce + cfg.reg_weight * reg)
        with torch.no_grad():
            t_logp = t_logits.float().log_softmax(-1)
            kl = _mean((t_logp.exp() * (t_logp - logits.float().log_softmax(-1))).sum(-1), mask)
            match = logits.argmax(-1) == t_logits.argmax(-1)
            top1 = _mean(match.float(), mask)
        matches.append(match)
        masks.append(mask)
        ce_l.append(ce.item())
        kl_l.append(kl.item())
        reg_l.append(reg.item())
        top1_l.append(top1.item())
    return StepLosses(total, ce_l, kl_l, reg_l, top1_l, matches, masks)


def chained_acceptance(matches: list[torch.Tensor], mask: torch.Tensor | None
                       ) -> tuple[torch.Tensor, int]:
    """Sum over rows of the teacher-forced acceptance length at k = len(matches), and the
    row count: row i accepts draft p while steps 1..p all agree with the target's argmax,
    plus the target's own token (1 + a1 + a1 a2 + ...). Only rows that have every step's
    label count (``mask``: step k's, from :func:`label_mask`). Teacher-forced: step p reads
    the data's token t_{i+p}; where that is the target's greedy token (the greedy
    self-distillation rows) this is what the engine's greedy verification accepts.

    >>> m = [torch.tensor([[True, True, False]]), torch.tensor([[True, False]])]
    >>> chained_acceptance(m, None)
    (tensor(5.), 2)
    """
    r = matches[-1].shape[1]
    alive = torch.ones_like(matches[-1], dtype=torch.float32)
    length = torch.ones_like(alive)
    for m in matches:
        alive = alive * m[:, :r].float()
        length = length + alive
    if mask is None:
        return length.sum(), length.numel()
    return (length * mask).sum(), int(mask.sum())


@torch.no_grad()
def evaluate(head: MTPHead, target: LlamaForCausalLM, data: HiddenStates, cfg: MTPConfig,
             amp: str, batch_size: int) -> dict:
    """Mean CE, regression loss and top-1 agreement per draft step (at least 3, so heads
    trained without unrolling are compared on later steps too) over validation windows.
    This is the training forward; acceptance through the engine is in :mod:`.acceptance`."""
    cfg = replace(cfg, unroll=max(cfg.unroll, EVAL_STEPS))
    was_training = head.training
    head.eval()
    device = target.embed_tokens.weight.device
    sums, n = None, 0
    accepted, accept_rows = 0.0, 0
    for a in range(0, len(data), batch_size):
        idx = torch.arange(a, min(a + batch_size, len(data)))
        tok, hid, lengths = data.batch(idx, device)
        s = mtp_loss(head, target, tok, hid, cfg, amp, lengths, data.batch_features(idx, device))
        row = s.ce + s.kl + s.reg + s.top1
        sums = [x * len(tok) for x in row] if sums is None else \
            [acc + x * len(tok) for acc, x in zip(sums, row)]
        n += len(tok)
        total, rows = chained_acceptance(s.matches[:EVAL_STEPS], s.masks[EVAL_STEPS - 1])
        accepted, accept_rows = accepted + float(total), accept_rows + rows
    head.train(was_training)
    k = len(sums) // 4
    mean = [x / n for x in sums]
    out = {name: mean[i * k:(i + 1) * k] for i, name in enumerate(("ce", "kl", "reg", "top1"))}
    # teacher-forced mean acceptance length at k = EVAL_STEPS (see chained_acceptance)
    out["accept"] = [accepted / max(1, accept_rows)]
    return out


# -- the training run ----------------------------------------------------------------------

@dataclass(slots=True)
class TokenStreams:
    train: torch.Tensor         # int [n_train]
    validation: torch.Tensor    # int [n_val]


def load_token_streams(data: str | Path | None, target_dir: str | Path,
                       work_dir: str | Path) -> TokenStreams:
    """Train/validation token streams for a target (``--data``): a ``tokens.pt`` from
    ``tandem train lm`` (the file or its directory), or a directory of sources (or, with
    ``data=None``, the stdlib corpus) tokenized with the target's tokenizer into
    ``work_dir/data``."""
    path = None if data is None else Path(data)
    if path is not None and path.is_dir() and (path / "tokens.pt").is_file():
        theirs, ours = path / "tokenizer.json", Path(target_dir) / "tokenizer.json"
        if theirs.is_file() and ours.is_file() and theirs.read_bytes() != ours.read_bytes():
            raise ValueError(f"--data {path}: its tokenizer.json differs from the target's "
                             f"({ours}); the head must see the target's token ids")
        path = path / "tokens.pt"
    if path is not None and path.is_file():
        streams = torch.load(path)
        if not isinstance(streams, dict) or {"train", "validation"} - set(streams):
            raise ValueError(f"--data {path}: expected a dict with 'train' and 'validation' "
                             "token streams (as `tandem train lm` caches them)")
        return TokenStreams(streams["train"], streams["validation"])
    if path is not None and not path.is_dir():
        raise FileNotFoundError(f"--data {path}: no such file or directory")
    from .data import prepare_data
    d = prepare_data(work_dir, root=path, tokenizer_dir=target_dir)
    return TokenStreams(d.train, d.validation)


def train_mtp(cfg: MTPTrainConfig, target_dir: str | Path, data: TokenStreams,
              work_dir: str | Path, out_dir: str | Path | None = None, device: str = "cpu",
              resume: bool = False, max_steps: int | None = None, command: str | None = None,
              hidden_cache: str | Path | None = None,
              distill: dict[str, DistillRows] | None = None) -> dict:
    """Precompute (or reuse) hidden states, train, and export the head with the best
    validation top-1 agreement to ``out_dir`` (bf16). Returns the training summary.

    ``hidden_cache`` (default ``work_dir/hidden``) can be shared by runs on one target
    (e.g. the variants with and without norms); entries are keyed by the target's
    weights, the token windows and the dtype.

    ``distill`` (:func:`.distill.load_distill_rows`): the target's own continuations of
    training prompts; ``mtp.distill_fraction`` of the steps train on them (the rest on
    ``mtp.num_windows`` windows of ``data``) and validation uses their validation rows."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    m, o = cfg.mtp, cfg.optim
    states = StateFile(work / "state.pt", "head", cfg.to_dict())
    state = states.load(resume, can_restart=True)
    if state is not None:
        if state["config"] != cfg.to_dict():
            raise ValueError(f"--resume: the config differs from the one in {states.path}")
        if state["target_fingerprint"] != target_fingerprint(target_dir):
            raise ValueError(f"--resume: {states.path} trained a head for other target weights; "
                             "pass --restart to train one for this target")
    (work / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")

    cache = Path(hidden_cache) if hidden_cache is not None else work / "hidden"
    train_hs, distill_hs, val_hs, width = target_hidden_states(cfg, target_dir, data, cache,
                                                               device, distill)
    target = load_model(target_dir, "float32", device)     # frozen: embeddings, norm, lm_head
    torch.manual_seed(o.seed)
    head = MTPHead(target.config, use_norms=m.use_norms, fuse_layers=m.fuse_layers,
                   intermediate_size=m.intermediate_size).to(device)
    init_weights(head, o.init_std)
    if cfg.init_from is not None:
        load_head_weights(head, cfg.init_from, target_dir)
    opt = adamw(head, o)
    progress = states.restore(state, head, opt)
    best = state["best"] if state is not None else None
    n_params = sum(p.numel() for p in head.parameters())
    fingerprint = target_fingerprint(target_dir)
    sets = [hs for hs in (train_hs, distill_hs) if hs is not None]
    train_tokens = sum(len(hs) * width if hs.lengths is None else int(hs.lengths.sum())
                       for hs in sets)
    log.info("MTP head (norms %s%s): %.2fM params on target %s (%s)%s; %d corpus windows x %d "
             "tokens, %d self-distillation rows (%.0f%% of the steps), %d validation windows; "
             "threads %d", m.use_norms,
             f", fused layers {m.fuse_layers}" if m.fuse_layers else "", n_params / 1e6, target_dir, fingerprint,
             f", from {cfg.init_from}" if cfg.init_from else "", len(train_hs or ()), width,
             len(distill_hs or ()), 100 * m.distill_fraction if distill_hs else 0, len(val_hs),
             torch.get_num_threads())

    def summary() -> dict:
        return {"params": n_params, "use_norms": m.use_norms, "step": progress.step,
                "steps_planned": o.steps, "train_tokens": train_tokens,
                "tokens_seen": progress.step * o.batch_size * width,
                "wall_time_s": round(progress.wall_time_s, 1), "threads": torch.get_num_threads(),
                "seed": o.seed, "device": device, "target": str(target_dir),
                "target_fingerprint": fingerprint, "command": command, "best": best,
                "config": cfg.to_dict(), "history": progress.history}

    def export(dest: Path) -> None:
        save_mtp_head(head, dest, torch.bfloat16,
                      extra={"target_fingerprint": fingerprint, "training_step": progress.step})
        (dest / "training.json").write_text(json.dumps(summary(), indent=2) + "\n")

    def validate() -> dict:
        val = evaluate(head, target, val_hs, m, o.amp, o.batch_size)
        progress.history.append({"step": progress.step,
                                 "wall_time_s": round(progress.wall_time_s, 1),
                                 **{k: [round(x, 4) for x in v] for k, v in val.items()}})
        return val

    def validate_and_keep_best(_figures) -> None:
        nonlocal best
        t_eval = time.monotonic()
        val = validate()
        log.info("step %d val %s (eval %.1f s)", progress.step, _describe(val),
                 time.monotonic() - t_eval)
        if best is None or val["top1"][0] >= best["top1"]:
            best = {"step": progress.step, "top1": val["top1"][0], "kl": val["kl"][0]}
            export(work / "best")

    def batch_at(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        hs = sets[0] if len(sets) == 1 else \
            distill_hs if on_distill_rows(o.seed, step, m.distill_fraction) else train_hs
        idx = torch.randint(0, len(hs), (o.batch_size,), generator=batch_generator(o.seed, step))
        return *hs.batch(idx, device), hs.batch_features(idx, device)

    def train_loss(batch) -> tuple[torch.Tensor, list[float]]:
        s = mtp_loss(head, target, *batch[:2], m, o.amp, batch[2], batch[3])
        return s.loss, [s.loss.item(), s.kl[0], s.reg[0], s.top1[0]]

    def save() -> None:
        states.save(progress, head, opt, best=best, target_fingerprint=fingerprint)

    if not progress.history:     # the untrained head's figures, as a baseline
        log.info("step 0 val %s", _describe(validate()))
    run_training(head, opt, o, progress, max_steps=max_steps, batch_at=batch_at,
                 train_loss=train_loss, evaluate=validate_and_keep_best, save=save,
                 tokens_per_step=o.batch_size * width,
                 log_format="loss %.4f kl %.4f reg %.4f top1 %.3f")
    result = summary()
    if progress.step >= o.steps and out_dir is not None:
        with replacing_dir(out_dir) as tmp:
            shutil.copytree(work / "best", tmp)
            (tmp / "training.json").write_text(json.dumps(result, indent=2) + "\n")
        log.info("exported the head of step %d (validation top-1 %.3f) to %s",
                 best["step"], best["top1"], Path(out_dir))
    return result


def target_hidden_states(cfg: MTPTrainConfig, target_dir: str | Path, data: TokenStreams,
                         cache: Path, device: str, distill: dict[str, DistillRows] | None = None
                         ) -> tuple[HiddenStates | None, HiddenStates | None, HiddenStates, int]:
    """The target's hidden states (from ``cache`` or computed) of the corpus's training
    windows (None when every step trains on self-distillation rows), of the
    self-distillation rows (None without them), of the validation windows (the rows'
    when there are rows), and the corpus windows' width."""
    m, o = cfg.mtp, cfg.optim
    serving = load_model(target_dir, m.hidden_dtype, device)
    width = min(o.seq_len, serving.config.max_position_embeddings)
    vocab = serving.config.vocab_size
    for name, s in (("train", data.train), ("validation", data.validation)):
        if s.numel() and (int(s.max()) >= vocab or int(s.min()) < 0):
            raise ValueError(f"--data: {name} token ids reach {int(s.max())}, outside the "
                             f"target's vocabulary 0..{vocab - 1}; tokenize with its tokenizer")
    fuse = None if m.fuse_layers is None else tuple(m.fuse_layers)
    forward = pick_forward(m.hidden_forward, device)
    train_hs = distill_hs = None
    if distill is None or (m.distill_fraction < 1.0 and m.num_windows > 0):
        train_hs = load_or_compute(target_dir, train_windows(data.train, m.num_windows, width,
                                                             o.seed),
                                   cache, m.hidden_dtype, device, serving, fuse_layers=fuse,
                                   forward=forward)
    if distill is None:
        val_hs = load_or_compute(target_dir, first_windows(data.validation, o.eval_windows, width),
                                 cache, m.hidden_dtype, device, serving, fuse_layers=fuse,
                                 forward=forward)
        return train_hs, None, val_hs, width
    rows, val_rows = distill["train"], distill["validation"]
    if rows.windows.shape[1] > serving.config.max_position_embeddings:
        raise ValueError(f"--distill-data: rows of {rows.windows.shape[1]} tokens exceed the "
                         f"target's {serving.config.max_position_embeddings} positions")
    distill_hs = load_or_compute(target_dir, rows.windows, cache, m.hidden_dtype, device,
                                 serving, rows.lengths, fuse, forward)
    n_val = min(o.eval_windows, len(val_rows))
    val_hs = load_or_compute(target_dir, val_rows.windows[:n_val], cache, m.hidden_dtype,
                             device, serving, val_rows.lengths[:n_val], fuse, forward)
    return train_hs, distill_hs, val_hs, width


def load_head_weights(head: MTPHead, init_from: str | Path, target_dir: str | Path) -> None:
    """Start from a saved head (``init_from``): same shape and norms; one trained for other
    target weights is allowed (a starting point) but logged. A fused head from a plain
    one copies every tensor the two share (norms, ``proj``, the decoder layer) and keeps its
    fresh ``fc`` and per-layer norms."""
    from safetensors.torch import load_file
    path = Path(init_from)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"init_from {path}: no config.json (an MTP head directory)")
    saved = json.loads(cfg_file.read_text())
    if saved.get("use_norms", True) != head.use_norms:
        raise ValueError(f"init_from {path}: use_norms {saved.get('use_norms')} differs from "
                         f"this config's {head.use_norms}")
    weights = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
    theirs = saved.get("fuse_layers")
    mine = None if head.fuse_layers is None else list(head.fuse_layers)
    if theirs == mine:
        head.load_state_dict(weights)
    elif theirs is None:
        missing, unexpected = head.load_state_dict(weights, strict=False)
        if unexpected:
            raise ValueError(f"init_from {path}: tensors {unexpected} have no place in this head")
        log.info("init_from %s (a plain head): copied %d tensors; fresh: %s", path,
                 len(weights), ", ".join(missing))
    else:
        raise ValueError(f"init_from {path}: fuse_layers {theirs} differ from this config's "
                         f"{mine}; allowed: the same layers, or a plain head")
    if saved.get("target_fingerprint") != target_fingerprint(target_dir):
        log.warning("init_from %s: trained for target %s, not %s", path,
                    saved.get("target_fingerprint"), target_fingerprint(target_dir))


def _describe(val: dict) -> str:
    """Validation figures per draft step, e.g. ``ce 5.1/5.2 kl ... reg ... top1 ...``."""
    return " ".join(f"{k} {_fmt(val[k])}" for k in ("ce", "kl", "reg", "top1", "accept")
                    if k in val)


def _fmt(xs: list[float]) -> str:
    return "/".join(f"{x:.4f}" for x in xs)
