"""Tandem's engine: models, paged KV cache, attention, scheduling, speculation."""
from .engine import LLM, SamplingParams

__all__ = ["LLM", "SamplingParams"]
