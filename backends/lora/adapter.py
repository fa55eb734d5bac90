"""LoRA adapters in PEFT's format, read and checked against the base model.

A PEFT adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``...) and ``adapter_model.safetensors`` with, per
adapted linear layer, ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``
``[r, in]`` and ``...lora_B.weight`` ``[out, r]`` (PEFT 0.21's ``save_pretrained``: the
adapter's own name is dropped from the keys). The adapted layer computes
``W x + scaling * B (A x)`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA).

Every error names the adapter and what is wrong: a rank above ``max_lora_rank``, a
module the model does not have, a shape that does not fit it, an option this engine
does not apply (biases, DoRA, per-module ranks, ``modules_to_save``...).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models.config import ModelConfig

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# options whose non-default value changes what the adapter computes: refused, not ignored
_UNSUPPORTED = {"use_dora": False, "lora_bias": False, "fan_in_fan_out": False,
                "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
                "layer_replication": None, "use_qalora": False, "target_parameters": None}


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adaptable linear layer of a model of ``cfg``."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, cfg.q_size), "k_proj": (h, cfg.kv_size), "v_proj": (h, cfg.kv_size),
            "o_proj": (cfg.q_size, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass(slots=True)
class LoRAAdapter:
    """A loaded adapter: ``weights[(layer, module)] = (A [r, in], B [out, r])`` on the CPU,
    as the file holds them; ``scaling`` multiplies ``B (A x)``."""
    name: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(m for _, m in self.weights)


def _fail(name: str, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {name!r}: {why}")


def _target_modules(name: str, value) -> list[str]:
    if value == "all-linear":      # PEFT's shorthand: every linear layer but the output one
        return list(TARGET_MODULES)
    if isinstance(value, str):
        value = [value] if value in TARGET_MODULES else None
    if not isinstance(value, list) or not value:
        raise _fail(name, f"target_modules {value!r}; allowed: a list of {', '.join(TARGET_MODULES)}")
    unknown = sorted(set(value) - set(TARGET_MODULES))
    if unknown:
        raise _fail(name, f"target module(s) {unknown} are not in this model; allowed: "
                          f"{', '.join(TARGET_MODULES)}")
    return value


def read_adapter_config(name: str, path: Path, max_rank: int) -> tuple[int, float, list[str]]:
    """(rank, scaling, target modules) of the adapter at ``path``, its options checked."""
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise _fail(name, f"cannot read {path / CONFIG_FILE} ({e})") from e
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _fail(name, f"peft_type {cfg.get('peft_type')!r}; allowed: 'LORA'")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _fail(name, f"r={r!r}; allowed: an integer >= 1")
    if r > max_rank:
        raise _fail(name, f"rank {r} is above max_lora_rank={max_rank}")
    if not isinstance(alpha, (int, float)):
        raise _fail(name, f"lora_alpha={alpha!r}; allowed: a number")
    if cfg.get("bias", "none") != "none":
        raise _fail(name, f"bias={cfg['bias']!r} is not supported; allowed: 'none'")
    for option, default in _UNSUPPORTED.items():
        if cfg.get(option, default) not in (default, None, {}, False):
            raise _fail(name, f"{option}={cfg[option]!r} is not supported (allowed: {default!r})")
    targets = _target_modules(name, cfg.get("target_modules"))
    scaling = alpha / (math.sqrt(r) if cfg.get("use_rslora", False) else r)
    return r, float(scaling), targets


def load_adapter(name: str, path: str | Path, model: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read the PEFT adapter at ``path`` and check it against ``model``."""
    path = Path(path)
    if not path.is_dir():
        raise _fail(name, f"{path} is not a directory")
    rank, scaling, targets = read_adapter_config(name, path, max_rank)
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        tensors = load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError, ValueError) as e:
        raise _fail(name, f"cannot read {path / WEIGHTS_FILE} ({e})") from e
    shapes = module_shapes(model)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise _fail(name, f"tensor {key!r} adapts no layer this engine adapts "
                              f"(allowed: {', '.join(TARGET_MODULES)} of a decoder layer)")
        layer, parent, module, ab = int(m[1]), m[2], m[3], m[4]
        if module not in TARGET_MODULES or parent != ("self_attn" if module in ATTENTION_MODULES else "mlp"):
            raise _fail(name, f"target module {parent}.{module} is not in this model; "
                              f"allowed: {', '.join(TARGET_MODULES)}")
        if module not in targets:
            raise _fail(name, f"{key} adapts {module}, which target_modules {targets} leaves out")
        if layer >= model.num_hidden_layers:
            raise _fail(name, f"{key}: layer {layer} is past the model's "
                              f"{model.num_hidden_layers} layers")
        fan_in, fan_out = shapes[module]
        want = (rank, fan_in) if ab == "A" else (fan_out, rank)
        if tuple(t.shape) != want:
            raise _fail(name, f"{key} has shape {tuple(t.shape)}; the model's {module} "
                              f"(in {fan_in}, out {fan_out}) at rank {rank} needs {want}")
        parts.setdefault((layer, module), {})[ab] = t
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise _fail(name, f"layer {layer} {module} has lora_{''.join(ab)} but not both A and B")
        weights[(layer, module)] = (ab["A"], ab["B"])
    if not weights:
        raise _fail(name, f"{path / WEIGHTS_FILE} holds no LoRA weights")
    return LoRAAdapter(name, rank, scaling, weights)
