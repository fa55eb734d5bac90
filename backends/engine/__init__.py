"""The engine: scheduler, model runner, proposers and verification, the offline and
async APIs, the prefill-only engine. Names load on first use."""
from ..lazy import lazy_exports

_EXPORTS = {"AsyncEngine": ".async_engine", "LLM": ".llm", "CompletionOutput": ".llm",
            "EngineConfig": ".config", "ENGINE_DEFAULTS": ".config",
            "default_num_pages": ".config", "LLMEngine": ".llm_engine",
            "RequestOutput": ".outputs", "SamplingParams": ".params",
            "PrefillEngine": ".prefill_engine"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
