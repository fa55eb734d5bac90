from .verify import chain_speculative_sampling

__all__ = ["chain_speculative_sampling"]
