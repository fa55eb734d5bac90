from .async_engine import AsyncEngine
from .llm import LLM, CompletionOutput
from .llm_engine import EngineConfig, LLMEngine, RequestOutput
from .params import SamplingParams

__all__ = ["AsyncEngine", "LLM", "CompletionOutput", "EngineConfig", "LLMEngine",
           "RequestOutput", "SamplingParams"]
