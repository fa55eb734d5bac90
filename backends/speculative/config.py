"""Speculative decoding settings."""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("draft_target", "mtp")
KV_NAMES = {"draft_target": "draft", "mtp": "mtp"}
NO_SPECULATION = "none"            # how settings and the CLI spell method=None
DEFAULT_NUM_SPECULATIVE_TOKENS = 3


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """``method=None`` is plain decoding.

    >>> SpeculativeConfig("mtp", num_speculative_tokens=2, mtp_head="checkpoints/demo/mtp").validate()
    """
    method: str | None = None
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    draft_model: str | None = None
    mtp_head: str | None = None

    @property
    def enabled(self) -> bool:
        return self.method is not None

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
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens={k!r} is invalid; allowed: 1..16")
        if self.method == "draft_target" and not self.draft_model:
            raise ValueError("method='draft_target' needs draft_model (a checkpoint directory)")
        if self.method == "mtp" and not self.mtp_head:
            raise ValueError("method='mtp' needs mtp_head (a checkpoint directory)")
