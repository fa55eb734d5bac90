"""TensorRT-LLM's adapter tensors (``lora_weights``, ``lora_config``) as a PEFT adapter.

A TensorRT-LLM client sends an adapter with its first request: ``lora_config`` ``[N, 3]``
holds per row ``(module_id, layer, rank D)``, ``lora_weights`` ``[N, W]`` the row's "in"
weights (LoRA's A, ``D x Hi``, flattened) then its "out" weights (B, ``Ho x D``), then
padding; the scaling is already in B (its ``hf_lora_convert.py`` folds alpha / r in). Later
requests send only ``lora_task_id``. Tandem writes such an adapter once, in PEFT's format,
into the server's adapter registry under its task id (name ``task-<id>``): every engine
then loads it as any other adapter.

Module ids (TensorRT-LLM's ``LoraModule``): 0 attn_qkv (q, k and v with one A), 1 attn_q,
2 attn_k, 3 attn_v, 4 attn_dense (o_proj), 5 mlp_h_to_4h (up_proj), 6 mlp_4h_to_h
(down_proj), 7 mlp_gate (gate_proj), 18 mlp_gate_up (gate and up with one A); the others
(cross attention, MoE) have no counterpart here and are refused by id. Rows of smaller rank
are padded with zeros to the largest (exactly the same product).

Torch-free (numpy and safetensors' numpy API): kv_transfer converts before it reserves.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

MODULES = {0: ("q_proj", "k_proj", "v_proj"), 1: ("q_proj",), 2: ("k_proj",), 3: ("v_proj",),
           4: ("o_proj",), 5: ("up_proj",), 6: ("down_proj",), 7: ("gate_proj",), 18: ("gate_proj", "up_proj")}
class AdapterTensorsError(ValueError):
    """What is wrong with the adapter tensors, and which of them (``field``)."""

    def __init__(self, field: str, why: str):
        super().__init__(f"{field}: {why}")
        self.field, self.why = field, why


PREFIX = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def model_shapes(config: dict) -> tuple[int, dict[str, tuple[int, int]]]:
    """(layers, module -> (in, out) features) from a checkpoint's ``config.json``."""
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    kv = config.get("num_key_value_heads") or heads
    i = config["intermediate_size"]
    q, k = heads * head_dim, kv * head_dim
    return config["num_hidden_layers"], {"q_proj": (h, q), "k_proj": (h, k), "v_proj": (h, k), "o_proj": (q, h),
                                         "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def peft_tensors(weights: np.ndarray, config: np.ndarray, model_config: dict,
                 max_rank: int) -> tuple[int, dict[str, np.ndarray]]:
    """(rank, PEFT's tensors by key) of TensorRT-LLM's adapter tensors; a ValueError names
    what is wrong (the field, the row)."""
    weights = np.asarray(weights, dtype=np.float32)
    config = np.asarray(config).astype(np.int64)
    weights = weights.reshape(-1, weights.shape[-1]) if weights.size else weights.reshape(0, 0)
    config = config.reshape(-1, config.shape[-1]) if config.size else config.reshape(0, 3)
    if config.shape[-1] != 3:
        raise AdapterTensorsError("lora_config", f"rows of {config.shape[-1]} values; allowed: "
                                                 "[module_id, layer, rank]")
    if len(weights) != len(config) or not len(config):
        raise AdapterTensorsError("lora_weights", f"{len(weights)} rows for {len(config)} lora_config rows; "
                                                  "allowed: one row per module and layer, at least one")
    layers, shapes = model_shapes(model_config)
    rank = int(config[:, 2].max())
    if rank < 1 or rank > max_rank or config[:, 2].min() < 1:
        raise AdapterTensorsError("lora_config", f"ranks {sorted(set(config[:, 2].tolist()))}; allowed: "
                                                 f"1..{max_rank} (--max-lora-rank)")
    tensors: dict[str, np.ndarray] = {}
    for row, (module_id, layer, d) in enumerate(config.tolist()):
        modules = MODULES.get(module_id)
        if modules is None:
            raise AdapterTensorsError("lora_config", f"row {row}: module id {module_id} (TensorRT-LLM's) has no "
                                                     f"counterpart in this model; allowed: {sorted(MODULES)}")
        if not 0 <= layer < layers:
            raise AdapterTensorsError("lora_config", f"row {row}: layer {layer}; allowed: 0..{layers - 1}")
        fan_in = shapes[modules[0]][0]
        outs = [shapes[m][1] for m in modules]
        need = d * fan_in + sum(outs) * d
        if weights.shape[1] < need:
            raise AdapterTensorsError("lora_weights", f"row {row}: {weights.shape[1]} values; module id "
                                                      f"{module_id} at rank {d} needs {need} ({d} x {fan_in} in, "
                                                      f"{sum(outs)} x {d} out)")
        a = np.zeros((rank, fan_in), np.float32)
        a[:d] = weights[row, :d * fan_in].reshape(d, fan_in)
        b_all = weights[row, d * fan_in:need].reshape(sum(outs), d)
        start = 0
        for m, out in zip(modules, outs):
            key = f"base_model.model.model.layers.{layer}.{PREFIX[m]}.{m}"
            if f"{key}.lora_A.weight" in tensors:
                raise AdapterTensorsError("lora_config", f"row {row}: {m} of layer {layer} twice")
            b = np.zeros((out, rank), np.float32)
            b[:, :d] = b_all[start:start + out]
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
            start += out
    return rank, tensors


def write_peft_adapter(out: Path, rank: int, tensors: dict[str, np.ndarray]) -> Path:
    """The adapter directory PEFT writes (alpha = rank: the scaling is already in B)."""
    from safetensors.numpy import save_file
    out.mkdir(parents=True, exist_ok=True)
    targets = sorted({k.split(".")[-3] for k in tensors})
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "target_modules": targets,
         "bias": "none", "lora_dropout": 0.0, "fan_in_fan_out": False}))
    return out
