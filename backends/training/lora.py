"""LoRA on the project's Llama-family model, saved and read in PEFT's format.

A LoRA adapter adds ``scaling * B @ A`` (``A`` [r, in], ``B`` [out, r], ``scaling =
lora_alpha / r``) to the weight of each targeted projection while the base stays frozen.
Targets are named as PEFT and HF name them (``q_proj`` ... ``down_proj``); the model here
fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``, so one
:class:`LoRALinear` wraps a fused projection and adds each targeted part's update to its
slice of the output.

On disk an adapter is what ``peft.PeftModel.from_pretrained`` reads (and what vLLM's
``--lora-modules`` loads): ``adapter_config.json`` and ``adapter_model.safetensors`` with
keys ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` [r, in] and
``...lora_B.weight`` [out, r].

>>> cfg = LoRAConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
>>> wrapped = apply_lora(model, cfg)                        # doctest: +SKIP
>>> save_adapter(model, "out/lora-shout", cfg, "smollm2-135m-instruct")   # doctest: +SKIP
>>> peft_key(3, "v_proj", "A")
'base_model.model.model.layers.3.self_attn.v_proj.lora_A.weight'
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's target name -> (the submodule of a decoder layer that computes it, its part index)
TARGETS = {"q_proj": ("self_attn", "qkv_proj", 0), "k_proj": ("self_attn", "qkv_proj", 1),
           "v_proj": ("self_attn", "qkv_proj", 2), "o_proj": ("self_attn", "o_proj", 0),
           "gate_proj": ("mlp", "gate_up_proj", 0), "up_proj": ("mlp", "gate_up_proj", 1),
           "down_proj": ("mlp", "down_proj", 0)}
# the PEFT names of each projection's parts, in output order
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(slots=True)
class LoRAConfig:
    """The adapter's shape: what ``adapter_config.json`` declares."""
    r: int = 8
    lora_alpha: float = 16.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])

    def __post_init__(self):
        unknown = sorted(set(self.target_modules) - set(TARGETS))
        if unknown or not self.target_modules:
            raise ValueError(f"LoRA target_modules {self.target_modules}: unknown {unknown}; "
                             f"allowed: {', '.join(TARGETS)}")
        if self.r < 1:
            raise ValueError(f"LoRA r must be >= 1, got {self.r}")
        self.target_modules = sorted(self.target_modules, key=list(TARGETS).index)

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.r


def peft_key(layer: int, target: str, which: str) -> str:
    """PEFT's state-dict key of a layer's ``lora_A`` / ``lora_B`` for a target."""
    group = TARGETS[target][0]
    return f"base_model.model.model.layers.{layer}.{group}.{target}.lora_{which}.weight"


class LoRALinear(nn.Module):
    """A frozen projection plus ``scaling * x @ A.T @ B.T`` on each targeted part's slice
    of its output (``parts``: (PEFT name, output width) in output order)."""

    def __init__(self, base: nn.Module, parts: list[tuple[str, int]], targets: list[str],
                 r: int, scaling: float):
        super().__init__()
        self.base, self.parts, self.scaling = base, parts, scaling
        self.enabled = True     # False: the base alone (the "without adapter" measurement)
        w = base.weight
        self.lora_A = nn.ParameterDict({n: nn.Parameter(torch.zeros(r, w.shape[1]))
                                        for n, _ in parts if n in targets})
        self.lora_B = nn.ParameterDict({n: nn.Parameter(torch.zeros(size, r))
                                        for n, size in parts if n in targets})

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """PEFT's initialisation: A Kaiming-uniform, B zero (the adapter starts as a no-op)."""
        with torch.no_grad():
            for a in self.lora_A.values():
                bound = 1 / math.sqrt(a.shape[1])    # kaiming_uniform_(a=sqrt(5)) on [r, in]
                a.copy_(torch.rand(a.shape, generator=generator) * 2 * bound - bound)
            for b in self.lora_B.values():
                b.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.enabled or not self.lora_A:
            return y
        deltas = []
        for name, size in self.parts:
            if name in self.lora_A:
                a, b = self.lora_A[name], self.lora_B[name]
                deltas.append(F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype)) * self.scaling)
            else:
                deltas.append(y.new_zeros(*y.shape[:-1], size))
        return y + torch.cat(deltas, -1).to(y.dtype)


def _part_sizes(model, proj: str) -> list[int]:
    c = model.config
    return {"qkv_proj": [c.q_size, c.kv_size, c.kv_size], "o_proj": [c.hidden_size],
            "gate_up_proj": [c.intermediate_size] * 2, "down_proj": [c.hidden_size]}[proj]


def apply_lora(model: nn.Module, cfg: LoRAConfig, seed: int = 0) -> dict[tuple[int, str], LoRALinear]:
    """Wrap the targeted projections of every decoder layer of a ``LlamaForCausalLM`` in
    :class:`LoRALinear` (PEFT-initialised from ``seed``) and freeze everything else.
    Returns the wrappers by (layer, projection name)."""
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    wrappers = {}
    for i, layer in enumerate(model.layers):
        for proj, names in PARTS.items():
            targets = [n for n in names if n in cfg.target_modules]
            if not targets:
                continue
            group = getattr(layer, TARGETS[names[0]][0])
            base = getattr(group, proj)
            w = LoRALinear(base, list(zip(names, _part_sizes(model, proj))), targets, cfg.r,
                           cfg.scaling).to(base.weight.device)
            w.reset_parameters(gen)
            setattr(group, proj, w)
            wrappers[(i, proj)] = w
    return wrappers


def lora_modules(model: nn.Module) -> dict[tuple[int, str], LoRALinear]:
    return {(i, proj): getattr(getattr(layer, TARGETS[names[0]][0]), proj)
            for i, layer in enumerate(model.layers) for proj, names in PARTS.items()
            if isinstance(getattr(getattr(layer, TARGETS[names[0]][0]), proj), LoRALinear)}


def set_lora_enabled(model: nn.Module, enabled: bool) -> None:
    for w in lora_modules(model).values():
        w.enabled = enabled


def adapter_state(model: nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's keys."""
    out = {}
    for (i, _), w in lora_modules(model).items():
        for name in w.lora_A:
            out[peft_key(i, name, "A")] = w.lora_A[name].detach().to(dtype).contiguous().clone()
            out[peft_key(i, name, "B")] = w.lora_B[name].detach().to(dtype).contiguous().clone()
    return out


def adapter_config(cfg: LoRAConfig, base_model: str) -> dict:
    """``adapter_config.json`` as PEFT writes it for a plain LoRA (no DoRA, no rsLoRA)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": cfg.r, "lora_alpha": cfg.lora_alpha, "target_modules": list(cfg.target_modules),
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
            "alpha_pattern": {}}


def save_adapter(model: nn.Module, out_dir: str | Path, cfg: LoRAConfig, base_model: str,
                 dtype: torch.dtype = torch.float32) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state(model, dtype), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config(cfg, base_model), indent=2) + "\n")
    return out


def load_adapter(model: nn.Module, adapter_dir: str | Path, max_rank: int = 256) -> LoRAConfig:
    """Wrap ``model`` for the PEFT adapter in ``adapter_dir`` and load its weights, read and
    checked against the model by the engine's loader (:func:`tandem.backends.lora.adapter.
    load_adapter`: shapes, options, the rsLoRA scaling)."""
    from ..lora.adapter import load_adapter as read_peft_adapter
    adapter = read_peft_adapter(Path(adapter_dir).name, adapter_dir, model.config, max_rank)
    cfg = LoRAConfig(adapter.rank, adapter.scaling * adapter.rank, sorted(adapter.target_modules))
    apply_lora(model, cfg)
    wrappers = lora_modules(model)
    with torch.no_grad():
        for (layer, target), (a, b) in adapter.weights.items():
            w = wrappers[(layer, TARGETS[target][1])]
            w.lora_A[target].copy_(a.to(w.lora_A[target].dtype))
            w.lora_B[target].copy_(b.to(w.lora_B[target].dtype))
    return cfg
