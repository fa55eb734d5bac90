"""Speculative decoding settings."""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("draft_target", "mtp", "ngram")
AUTO = "auto"   # prompt lookup where it matches, the model proposer (MTP head, else draft) elsewhere
KV_NAMES = {"draft_target": "draft", "mtp": "mtp"}     # ngram proposes without a model or KV
NO_SPECULATION = "none"            # how settings and the CLI spell method=None
DEFAULT_NUM_SPECULATIVE_TOKENS = 3
MAX_NUM_SPECULATIVE_TOKENS = 16   # the most drafts one step verifies


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """``method=None`` is plain decoding. ``"auto"`` drafts by prompt lookup (ngram) for
    a sequence whose tokens hold a match and by the model proposer otherwise: it becomes
    ``method`` = the model's (``"mtp"`` with ``mtp_head``, else ``"draft_target"`` with
    ``draft_model``, else ``"ngram"``) with ``auto=True``, so everything keyed on the
    proposer's KV (KV transfer, prefix caching) sees the model it keeps KV for.
    ``adaptive``: each step picks k in 0..num_speculative_tokens from measured costs and
    acceptance (backends/speculative/adaptive.py); off: every step drafts k tokens
    (``tandem serve`` turns it on unless ``--spec-adaptive off``).

    >>> SpeculativeConfig("mtp", num_speculative_tokens=2, mtp_head="checkpoints/demo/mtp").validate()
    >>> c = SpeculativeConfig("auto", mtp_head="checkpoints/demo/mtp")
    >>> c.method, c.auto
    ('mtp', True)
    """
    method: str | None = None
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    draft_model: str | None = None
    mtp_head: str | None = None
    # ngram (prompt lookup, vLLM's names): match the last n tokens, n from max down to min
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    # the proposer scores only this many of its most frequent tokens (draft_vocab.py);
    # None: the whole vocabulary
    draft_vocab_size: int | None = None
    adaptive: bool = False
    auto: bool = False     # ngram where it matches (set by method="auto")

    def __post_init__(self) -> None:
        if self.method == AUTO:
            model = "mtp" if self.mtp_head else "draft_target" if self.draft_model else "ngram"
            object.__setattr__(self, "method", model)
            object.__setattr__(self, "auto", True)

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def has_kv(self) -> bool:
        """The proposer is a model with a KV cache of its own (not ngram)."""
        return self.method in KV_NAMES

    @property
    def kv_name(self) -> str | None:
        """The proposer's KV as a KV transfer names it (next to the target's)."""
        return KV_NAMES.get(self.method)

    def kv_config(self, target_dir: str):
        """The proposer's KV geometry (a ModelConfig), read without loading weights:
        the draft's own config, or the target's with the MTP head's single layer."""
        import dataclasses

        from ..models.config import ModelConfig
        if self.method == "draft_target":
            return ModelConfig.from_dir(self.draft_model)
        if self.method == "mtp":
            return dataclasses.replace(ModelConfig.from_dir(target_dir), num_hidden_layers=1)
        return None

    def validate(self) -> None:
        if self.method is None:
            return
        if self.method not in METHODS:
            raise ValueError(f"speculative method={self.method!r} is invalid; allowed: "
                             f"{', '.join(METHODS)} or None")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens={k!r} is invalid; allowed: "
                             f"1..{MAX_NUM_SPECULATIVE_TOKENS}")
        if self.method == "draft_target" and not self.draft_model:
            raise ValueError("method='draft_target' needs draft_model (a checkpoint directory)")
        if self.method == "mtp" and not self.mtp_head:
            raise ValueError("method='mtp' needs mtp_head (a checkpoint directory)")
        n = self.draft_vocab_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1
                              or not self.has_kv):
            raise ValueError(f"draft_vocab_size={n!r} is invalid; allowed: None or an integer "
                             ">= 1 with draft_target or mtp")
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min}, prompt_lookup_max="
                             f"{self.prompt_lookup_max}; allowed: 1 <= min <= max <= 16")
