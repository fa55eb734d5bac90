"""The engine's settings and the KV pool size they imply: the one place their
defaults are written (torch-free, so Triton's light models can read them). The offline API (``LLM``), Triton's ``config.pbtxt``
settings and ``tandem serve`` all read them from here.

>>> EngineConfig("checkpoints/demo/target").page_size
16
>>> ENGINE_DEFAULTS["kv_layout"], ENGINE_DEFAULTS["max_num_batched_tokens"]
('HND', 512)
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

from ..kv_cache.pages import KV_LAYOUTS, pages_needed
from ..models.config import DTYPE_BYTES, DTYPE_CHOICES, DTYPES, ModelConfig
from ..models.dtype import AUTO, resolve_dtype
from ..models.model_path import resolve_model_path
from ..speculative.config import SpeculativeConfig
from ..cpu_kernels import cxx_compiler   # here too: tests turn compiling off through this name

DEFAULT_KV_CACHE_BYTES = 512 << 20
COMPILE_MODES = ("auto", "all")


@dataclass(slots=True, frozen=True)
class EngineConfig:
    model_dir: str
    # "auto": bf16 where the device computes it natively, else fp32 (models/dtype.py);
    # resolved when the config is made, so ``dtype`` is always the one that runs
    dtype: str = AUTO
    page_size: int = 16
    kv_layout: str = "HND"
    num_pages: int | None = None      # default: a 512 MiB KV pool, capped at what is useful
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings
    device: str = "cpu"
    speculative: SpeculativeConfig | None = None
    # vLLM's name: every step eager, no CUDA graphs (GPU) and no compiled decode (CPU)
    enforce_eager: bool = False
    # CPU: the decode step through torch.compile, compiled at start-up (compiled_decode.py).
    # "auto": kept for the batch buckets where warm-up measured it faster than eager;
    # "all": for every bucket. Off with enforce_eager or without a C++ compiler.
    compile: str = "auto"
    # inductor's persistent caches (a restart loads instead of compiling); default
    # $TORCHINDUCTOR_CACHE_DIR, else ~/.cache/tandem/inductor
    compile_cache_dir: str | None = None
    # the torch thread counts the steps will run with besides the one at start-up (decode
    # borrowing the prefill side's core switches between two): torch.compile guards on the
    # thread count, so each is compiled at start-up, not by the first step that uses it
    compile_thread_counts: tuple[int, ...] = ()
    # automatic prefix caching (vLLM's name): full pages of computed KV are kept and
    # shared by later prompts with the same prefix (prefix_caching.py)
    enable_prefix_caching: bool = True
    # the share of prefix-cache hits whose pages' checksums (recorded at publication) are
    # recomputed before use; a changed page is dropped and recomputed (kv_cache/page_audit.py)
    kv_audit: float = 0.01
    # the share of hits declined and computed afresh, each recomputed page compared with
    # the cached one of its key; one that holds other KV is dropped (page_audit.py)
    kv_audit_recompute: float = 0.0
    # the serving model's version: part of every cache key, so a rolled version never
    # reads an older one's KV
    model_version: str = ""
    # multi-LoRA (backends/lora): adapter slots held at once (0: LoRA off) and the largest
    # adapter rank they take (vLLM's names and defaults); engine-only for now, not yet
    # Triton/`tandem serve` settings
    max_loras: int = 0
    max_lora_rank: int = 16
    # tensor parallelism (vLLM's name): the target split over this many ranks, one process
    # each (the engine's process is the leader), gloo between them on a CPU
    # (backends/parallel); every collective gives up after tp_timeout_s, so a dead rank
    # fails the step instead of hanging it
    tensor_parallel_size: int = 1
    tp_timeout_s: float = 60.0
    dtype_reason: str = field(default="", compare=False)   # why this dtype (set with "auto")

    def __post_init__(self) -> None:
        # a GGUF file (or a directory of one) loads as its converted, cached HF directory
        object.__setattr__(self, "model_dir", self.model_dir and str(resolve_model_path(self.model_dir)))
        if self.dtype == AUTO:
            choice = resolve_dtype(AUTO, self.device)
            object.__setattr__(self, "dtype", choice.dtype)
            object.__setattr__(self, "dtype_reason", choice.reason)

    def validate(self) -> None:
        if self.speculative is not None:
            self.speculative.validate()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; allowed: {', '.join(DTYPE_CHOICES)}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile={self.compile!r}; allowed: {', '.join(COMPILE_MODES)}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout={self.kv_layout!r}; allowed: {', '.join(KV_LAYOUTS)}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}; allowed: an integer >= 1")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras={self.max_loras}, max_lora_rank={self.max_lora_rank}; "
                             "allowed: max_loras >= 0 (0: no LoRA), max_lora_rank >= 1")
        if self.tensor_parallel_size < 1 or self.tp_timeout_s <= 0:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}, tp_timeout_s="
                             f"{self.tp_timeout_s}; allowed: an integer >= 1 and seconds > 0")
        if self.tensor_parallel_size > 1 and self.device != "cpu":
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} on {self.device}: ranks "
                             "run on the CPU (gloo) so far; allowed: device cpu, or 1 rank")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"num_pages={self.num_pages}; allowed: an integer >= 1")
        for name in ("kv_audit", "kv_audit_recompute"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value!r}; allowed: 0 to 1 (the share of prefix-cache hits "
                                 "whose pages are checked)")

    def compiles(self) -> bool:
        """Whether the engine compiles its decode step (a CPU with a C++ compiler for
        inductor, not ``enforce_eager``, one rank: a compiled step holds a whole model)."""
        return (self.device == "cpu" and not self.enforce_eager and self.tensor_parallel_size == 1
                and cxx_compiler() is not None)

    def num_pages_for(self, model: ModelConfig) -> int:
        """``num_pages``, or the default pool size for ``model``."""
        return self.num_pages or default_num_pages(model, self.dtype, self.page_size,
                                                   self.max_num_seqs, self.max_model_len)


# every field's default, for the layers that carry these settings in other forms
ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineConfig) if f.default is not MISSING}


def kv_page_bytes(model: ModelConfig, page_size: int, dtype: str) -> int:
    """Bytes of one page across all of ``model``'s layers (K and V)."""
    return (2 * model.num_hidden_layers * model.num_key_value_heads * page_size * model.head_dim
            * DTYPE_BYTES[dtype])


def default_num_pages(model: ModelConfig, dtype: str, page_size: int, max_num_seqs: int,
                      max_model_len: int | None = None) -> int:
    """A 512 MiB pool, capped at what ``max_num_seqs`` full-length sequences can use."""
    useful = max_num_seqs * pages_needed(max_model_len or model.max_position_embeddings, page_size)
    return max(1, min(DEFAULT_KV_CACHE_BYTES // kv_page_bytes(model, page_size, dtype), useful))
