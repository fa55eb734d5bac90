"""Tandem's engine: models, paged KV cache, attention, scheduling, speculation."""
from .engine import LLM, SamplingParams
from .speculative import SpeculativeConfig

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig"]
