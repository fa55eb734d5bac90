"""Tandem's engine: models, paged KV cache, attention, scheduling, speculation.

Layers, each importing only those below it (README, Layout): ``models`` ->
``speculative``; ``kv_cache`` -> ``attention``; both -> ``engine`` -> ``training`` |
``disagg`` -> ``triton``. Imports are lazy: a Triton stub loads only what its model
uses.
"""
from .lazy import lazy_exports

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig"]
__getattr__ = lazy_exports(__name__, {"LLM": ".engine.llm", "SamplingParams": ".engine.params",
                                      "SpeculativeConfig": ".speculative.config"})
