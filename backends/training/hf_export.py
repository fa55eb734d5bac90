"""Save a :class:`LlamaForCausalLM` as a Hugging Face Llama checkpoint.

The inverse of ``models.loader.hf_to_tandem``: fused ``qkv_proj`` / ``gate_up_proj``
are split back into HF's q/k/v and gate/up projections under ``model.`` names, and
``config.json`` is written so both :func:`tandem.backends.models.load_model` and
``transformers.LlamaForCausalLM.from_pretrained`` read it.

>>> save_hf_checkpoint(model, "checkpoints/demo/target", dtype=torch.bfloat16,
...                    special_ids={"bos": 0, "eos": 1, "pad": 2})  # doctest: +SKIP
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..models import LlamaForCausalLM, ModelConfig

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def tandem_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Split fused projections and rename to HF keys (``model.`` prefix, ``lm_head`` at top)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        if key.startswith("lm_head."):
            if not cfg.tie_word_embeddings:
                out[key] = t
            continue
        if ".qkv_proj." in key:
            q, k, v = t.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=0)
            for name, part in zip("qkv", (q, k, v)):
                out["model." + key.replace("qkv_proj", f"{name}_proj")] = part
        elif ".gate_up_proj." in key:
            gate, up = t.split(cfg.intermediate_size, dim=0)
            out["model." + key.replace("gate_up_proj", "gate_proj")] = gate
            out["model." + key.replace("gate_up_proj", "up_proj")] = up
        else:
            out["model." + key] = t
    # safetensors refuses views sharing storage; each tensor gets its own
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def hf_config(cfg: ModelConfig, dtype: torch.dtype,
              special_ids: dict[str, int] | None = None) -> dict:
    if cfg.model_type != "llama" or cfg.qk_norm or cfg.qkv_bias or cfg.o_bias:
        raise ValueError("hf_export: only plain Llama configs (no biases, no q/k norm) are exported")
    ids = special_ids or {}
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": DTYPE_NAMES[dtype],
    }
    if cfg.rope_scaling.rope_type != "default":
        s = cfg.rope_scaling
        d["rope_scaling"] = {
            "rope_type": s.rope_type, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings}
    for name in ("bos", "eos", "pad"):
        if name in ids:
            d[f"{name}_token_id"] = ids[name]
    if "bos" not in ids and cfg.bos_token_id is not None:
        d["bos_token_id"] = cfg.bos_token_id
    if "eos" not in ids and cfg.eos_token_ids:
        d["eos_token_id"] = list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_ids[0]
    return d


def save_hf_checkpoint(model: LlamaForCausalLM, out_dir: str | Path,
                       dtype: torch.dtype = torch.bfloat16,
                       special_ids: dict[str, int] | None = None) -> Path:
    """Write config.json + model.safetensors (and generation_config.json) into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    save_file(tandem_to_hf(state, cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(cfg, dtype, special_ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out
