"""Multi-LoRA serving: PEFT adapters loaded into a pool of slots and applied per row of a
batch (rows of different adapters, and of none, computed together). Names load on
first use."""
from ..lazy import lazy_exports

_EXPORTS = {"LoRARequest": ".request", "LoRAAdapter": ".adapter", "load_adapter": ".adapter",
            "TARGET_MODULES": ".adapter", "LoRAPool": ".pool", "LoRAStats": ".pool", "LoRABatch": ".batch",
            "plan_lora": ".batch"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
