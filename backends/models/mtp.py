"""The MTP head: one decoder layer that drafts from the target's hidden states.

EAGLE-style with the RMSNorms EAGLE dropped put back. Row ``i`` of the head sees the
token ``t_{i+1}`` and the target's hidden state ``h_i`` (so token buffers are shifted
left by one against hidden states) and predicts ``t_{i+2}``:

    x_i   = proj([embed_norm(embed(t_{i+1})); hidden_norm(h_i)])
    g_i   = decoder_layer(x_i)                  # attends over rows 0..i, rope position i
    logit = lm_head(target.norm(g_i))           # the target's frozen final norm and lm_head

``g_i`` lives in the target's pre-norm hidden space (training regresses it onto
``h_{i+1}``), so a draft of several tokens feeds ``g_i`` back in place of ``h``.
``use_norms=False`` is the EAGLE-1 variant without the re-introduced norms.

``fuse_layers`` (EAGLE-3-style, e.g. ``(1, 3, 5)``): the first draft step's hidden input is
not ``h_i`` but a fusion of those target layers' outputs at row ``i`` (low/mid/high),

    h_i := fc([fuse_norm_1(o_1,i); ...; fuse_norm_k(o_k,i)])      # k*H -> H (norms: use_norms)

computed by :meth:`MTPHead.fuse`; later draft steps still feed ``g`` back. ``o_l`` is the
residual stream after decoder layer ``l`` (0-based), so the last layer's is ``h_i`` itself.
The embeddings and lm_head belong to the target and are shared, never copied.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from .config import ModelConfig
from .layers import AttentionBackend, DecoderLayer, RMSNorm
from .llama import LlamaForCausalLM

MTP_ARCHITECTURE = "TandemMTPHead"


class MTPHead(nn.Module):
    """``intermediate_size``: the head's MLP width (default the target's; a narrower one
    makes a smaller checkpoint, e.g. checkpoints/smollm2/mtp)."""

    def __init__(self, target_cfg: ModelConfig, use_norms: bool = True,
                 fuse_layers: tuple[int, ...] | None = None, intermediate_size: int | None = None):
        super().__init__()
        self.config = dataclasses.replace(target_cfg, num_hidden_layers=1,
                                          intermediate_size=intermediate_size
                                          or target_cfg.intermediate_size)
        self.rank_config = self.config      # whole on the leader rank, as a draft model is
        self.narrow_mlp = self.config.intermediate_size != target_cfg.intermediate_size
        self.use_norms = use_norms
        self.fuse_layers = check_fuse_layers(fuse_layers, target_cfg.num_hidden_layers)
        h = target_cfg.hidden_size
        if self.fuse_layers is not None:
            k = len(self.fuse_layers)
            self.fuse_norms = nn.ModuleList(
                RMSNorm(h, target_cfg.rms_norm_eps) if use_norms else nn.Identity()
                for _ in range(k))
            self.fc = nn.Linear(k * h, h, bias=False)
        self.embed_norm = RMSNorm(h, target_cfg.rms_norm_eps) if use_norms else nn.Identity()
        self.hidden_norm = RMSNorm(h, target_cfg.rms_norm_eps) if use_norms else nn.Identity()
        self.proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(self.config, 0)
        if not use_norms:
            self.layer.input_layernorm = nn.Identity()

    def forward(self, target: LlamaForCausalLM, next_ids: torch.Tensor, hidden: torch.Tensor,
                positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """next_ids [N] (t_{i+1}), hidden [N, H] (h_i, pre-norm) -> g [N, H] (pre-norm)."""
        x = torch.cat([self.embed_norm(target.embed_tokens(next_ids)), self.hidden_norm(hidden)], -1)
        cos, sin = target.rotary_table().lookup(positions)
        return self.layer(self.proj(x), cos, sin, attn)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., k*H] (the ``fuse_layers`` outputs, concatenated in that order)
        -> the first draft step's hidden input [..., H]."""
        if self.fuse_layers is None:
            raise ValueError("mtp_head: this head has no fuse_layers; feed it h_i directly")
        k, h = len(self.fuse_layers), self.config.hidden_size
        if features.shape[-1] != k * h:
            raise ValueError(f"mtp_head: fused features have {features.shape[-1]} channels; "
                             f"fuse_layers {list(self.fuse_layers)} need {k} x {h}")
        parts = features.split(h, -1)
        return self.fc(torch.cat([norm(x) for norm, x in zip(self.fuse_norms, parts)], -1))


def check_fuse_layers(fuse_layers, num_layers: int) -> tuple[int, ...] | None:
    """``fuse_layers`` as a tuple (None: the plain head), refusing what a target of
    ``num_layers`` decoder layers cannot give.

    >>> check_fuse_layers([1, 3, 5], 6)
    (1, 3, 5)
    """
    if fuse_layers is None:
        return None
    layers = tuple(int(x) for x in fuse_layers)
    if len(layers) < 2 or len(set(layers)) != len(layers) or \
            any(not 0 <= x < num_layers for x in layers):
        raise ValueError(f"mtp_head: fuse_layers {list(layers)} is invalid; allowed: two or more "
                         f"distinct layer indices in 0..{num_layers - 1}")
    return layers


def save_mtp_head(head: MTPHead, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                  extra: dict | None = None) -> None:
    from safetensors.torch import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": [MTP_ARCHITECTURE], "use_norms": head.use_norms,
           "hidden_size": head.config.hidden_size, "vocab_size": head.config.vocab_size,
           "torch_dtype": str(dtype).removeprefix("torch."), **(extra or {})}
    if head.fuse_layers is not None:      # absent: the plain head (old checkpoints load as before)
        cfg["fuse_layers"] = list(head.fuse_layers)
    if head.narrow_mlp:                   # absent: the target's MLP width
        cfg["intermediate_size"] = head.config.intermediate_size
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({k: v.to(dtype).contiguous() for k, v in head.state_dict().items()},
              str(out / "model.safetensors"))


def load_mtp_head(head_dir: str | Path, target: LlamaForCausalLM) -> MTPHead:
    """Load a head saved by :func:`save_mtp_head` for this target (shapes are checked)."""
    from safetensors.torch import load_file
    head_dir = Path(head_dir)
    path = head_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"mtp_head: no config.json in {head_dir}")
    cfg = json.loads(path.read_text())
    if MTP_ARCHITECTURE not in cfg.get("architectures", []):
        raise ValueError(f"mtp_head: {head_dir} is not a {MTP_ARCHITECTURE} checkpoint")
    if cfg["hidden_size"] != target.config.hidden_size or cfg["vocab_size"] != target.config.vocab_size:
        raise ValueError(f"mtp_head: {head_dir} was trained for hidden {cfg['hidden_size']}, vocab "
                         f"{cfg['vocab_size']}; the target has {target.config.hidden_size}, "
                         f"{target.config.vocab_size}")
    w = target.embed_tokens.weight
    head = MTPHead(target.config, use_norms=cfg["use_norms"], fuse_layers=cfg.get("fuse_layers"),
                   intermediate_size=cfg.get("intermediate_size"))
    state = load_file(str(head_dir / "model.safetensors"))
    head.load_state_dict(state)
    # the head runs in the target's dtype and on its device (load_state_dict keeps fp32 params)
    return head.to(device=w.device, dtype=w.dtype).eval().requires_grad_(False)
