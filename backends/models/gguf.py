"""A llama.cpp GGUF file as an ordinary HF checkpoint directory.

``convert_gguf(path, out_dir)`` writes ``config.json`` (from ``llama.*`` metadata),
``model.safetensors`` (tensors under HF names, q/k un-permuted, quantized types dequantized
to fp32, float types kept), ``tokenizer.json``, ``tokenizer_config.json`` (chat template,
bos/eos) and ``generation_config.json``; the loader then reads that directory unchanged.
Where it is cached: ``model_path.py``.

>>> convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "/tmp/smollm2")  # doctest: +SKIP
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

ARCHITECTURES = ("llama",)
# llama.cpp leaf names -> HF module names (one block's; "blk.N." -> "model.layers.N.")
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                  "output": "lm_head"}
ROPE_FREQS = "rope_freqs.weight"   # llama3 rope scaling, as llama.cpp precomputes it
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def read_metadata(reader) -> dict:
    """``{key: value}`` of a ``gguf.GGUFReader``'s fields (strings decoded, arrays as lists)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def llama_config(meta: dict, tensor_names: set[str], rope_freqs: np.ndarray | None = None) -> dict:
    """The ``config.json`` of a Llama-architecture file; refuses any other architecture."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF general.architecture {arch!r} is not supported; allowed: "
                         f"{', '.join(ARCHITECTURES)} (Llama-family decoders)")

    def need(key: str):
        if f"llama.{key}" not in meta:
            raise ValueError(f"GGUF: metadata llama.{key} is missing (a Llama file has it)")
        return meta[f"llama.{key}"]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length") or meta.get("llama.rope.dimension_count")
                   or hidden // heads)
    vocab = meta.get("llama.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    if not vocab:
        raise ValueError("GGUF: no llama.vocab_size and no tokenizer.ggml.tokens to count")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    theta = float(meta.get("llama.rope.freq_base", 10000.0))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(theta),
        "rope_scaling": _rope_scaling(meta, rope_freqs, theta, head_dim),
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
    }


def _f32(x: float) -> float:
    """A GGUF float32 as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))     # str: numpy 2's repr is "np.float32(1e-05)"


def _rope_scaling(meta: dict, rope_freqs: np.ndarray | None, theta: float, head_dim: int) -> dict | None:
    kind = meta.get("llama.rope.scaling.type", "linear" if "llama.rope.scale_linear" in meta else "none")
    if rope_freqs is not None:
        return _llama3_scaling(rope_freqs, meta, theta, head_dim)
    if kind == "none":
        return None
    if kind == "linear":
        factor = meta.get("llama.rope.scaling.factor", meta.get("llama.rope.scale_linear", 1.0))
        return {"rope_type": "linear", "factor": _f32(factor)}
    raise ValueError(f"GGUF llama.rope.scaling.type {kind!r} is not supported; allowed: none, linear "
                     "(and llama3's, stored as rope_freqs)")


def llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float,
                   original: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores as ``rope_freqs`` for llama3
    rope scaling (its ``generate_extra_tensors``)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _llama3_scaling(rope_freqs: np.ndarray, meta: dict, theta: float, head_dim: int) -> dict:
    """llama3 settings that reproduce the stored factors (Llama 3.1/3.2's low 1, high 4; the
    original context from the metadata, else 8192), or a refusal."""
    params = {"rope_type": "llama3", "factor": float(rope_freqs.max()), "low_freq_factor": 1.0,
              "high_freq_factor": 4.0,
              "original_max_position_embeddings": int(meta.get("llama.rope.scaling.original_context_length", 8192))}
    want = llama3_factors(theta, head_dim, params["factor"], 1.0, 4.0,
                          params["original_max_position_embeddings"])
    if want.shape != rope_freqs.shape or not np.allclose(want, rope_freqs, rtol=1e-4):
        raise ValueError(f"GGUF {ROPE_FREQS}: rope frequency factors that llama3 rope scaling "
                         f"({params}) does not reproduce; allowed: llama3 scaling with low/high "
                         "frequency factors 1 and 4")
    return params


def hf_name(name: str) -> str:
    """The HF name of a llama.cpp tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    if m := _LAYER.fullmatch(name):
        layer, leaf, kind = m.groups()
        if leaf in LAYER_TENSORS:
            return f"model.layers.{layer}.{LAYER_TENSORS[leaf]}.{kind}"
    stem, _, kind = name.rpartition(".")
    if stem in GLOBAL_TENSORS and kind in ("weight", "bias"):
        return f"{GLOBAL_TENSORS[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} is not part of a Llama model; allowed: "
                     f"{', '.join(GLOBAL_TENSORS)}, blk.N.{{{','.join(LAYER_TENSORS)}}}")


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its converter interleaves each head's two
    rotary halves for ggml's rope): as transformers' ``LlamaTensorProcessor`` does."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def supported_types() -> tuple[str, ...]:
    from gguf import GGMLQuantizationType as T
    from gguf.quants import _type_traits   # the block types gguf can dequantize
    return ("F32", "F16", *sorted(t.name for t in _type_traits if t != T.BF16), "BF16")


def hf_tensors(reader, config: dict) -> dict:
    """Every tensor under its HF name: float types as stored, quantized ones dequantized
    to fp32, q/k un-permuted."""
    import torch
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    allowed = supported_types()
    for t in reader.tensors:
        if t.tensor_type.name not in allowed:
            raise ValueError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which cannot be "
                             f"dequantized; allowed: {', '.join(allowed)}")
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            continue
        name = hf_name(t.name)
        w = np.asarray(t.data) if t.tensor_type in (T.F32, T.F16) else dequantize(t.data, t.tensor_type)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if (leaf := t.name.split(".")[-2]) in heads:
            w = unpermute_rope(w, heads[leaf])
        tensor = torch.from_numpy(np.array(w, order="C"))   # a copy: the reader's memmap is read-only
        out[name] = tensor.to(torch.bfloat16) if t.tensor_type == T.BF16 else tensor
    return out


def convert_gguf(path: str | Path, out_dir: str | Path) -> Path:
    """Write the HF checkpoint of the GGUF at ``path`` into ``out_dir``; return it."""
    import gguf
    from safetensors.torch import save_file

    from .gguf_tokenizer import gguf_tokenizer

    path, out_dir = Path(path), Path(out_dir)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:   # the reader fails on a truncated or foreign file in many ways
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    freqs = next((np.asarray(t.data, dtype=np.float32) for t in reader.tensors if t.name == ROPE_FREQS), None)
    config = llama_config(meta, names, freqs)
    tokenizer, tok_config = gguf_tokenizer(meta)   # before the tensors: refuse early
    tensors = hf_tensors(reader, config)
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values()}
    config["torch_dtype"] = "float32" if "float32" in dtypes else dtypes.pop()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out_dir / "tokenizer.json"))
    eos = [i for i in (meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")) if i is not None]
    files = {"config.json": config, "tokenizer_config.json": tok_config,
             "generation_config.json": {"bos_token_id": config["bos_token_id"],
                                        "eos_token_id": list(dict.fromkeys(eos))}}
    for name, content in files.items():
        (out_dir / name).write_text(json.dumps(content, indent=2) + "\n")
    return out_dir
