from .config import ModelConfig
from .llama import LlamaForCausalLM, forward_dense
from .loader import load_model, parse_dtype

__all__ = ["ModelConfig", "LlamaForCausalLM", "forward_dense", "load_model", "parse_dtype"]
