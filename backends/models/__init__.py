"""Llama-family models (target, draft, MTP head) and the HF checkpoint loader.
Names load on first use (``config`` is torch-free)."""
from ..lazy import lazy_exports

_EXPORTS = {"ModelConfig": ".config", "DTYPES": ".config", "LlamaForCausalLM": ".llama",
            "forward_dense": ".llama", "load_model": ".loader", "parse_dtype": ".loader",
            "pack_linears": ".packed_linear"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
