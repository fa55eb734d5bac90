"""Speculative decoding's settings, metrics and the verification kernel with
FlashInfer's signature; the proposers and the verification step live in the engine."""
from ..lazy import lazy_exports

_EXPORTS = {"METHODS": ".config", "SpeculativeConfig": ".config",
            "SpecDecodeMetrics": ".metrics", "chain_speculative_sampling": ".verify"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
