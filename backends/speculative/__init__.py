from .config import METHODS, SpeculativeConfig
from .metrics import SpecDecodeMetrics
from .verify import chain_speculative_sampling

__all__ = ["METHODS", "SpeculativeConfig", "SpecDecodeMetrics", "chain_speculative_sampling"]
