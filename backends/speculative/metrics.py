"""Acceptance statistics of speculative decoding."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeMetrics:
    num_speculative_tokens: int
    num_drafts: int = 0             # verification rounds, summed over sequences
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0    # draft tokens kept (the accepted prefix)
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_position = [0] * self.num_speculative_tokens

    def reset(self) -> None:
        """Count from zero again (after a warm-up), for the same ``num_speculative_tokens``."""
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += self.num_speculative_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per target step: 1 + accepted / drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position]

    def as_dict(self) -> dict:
        return dict(num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
                    num_accepted_tokens=self.num_accepted_tokens,
                    acceptance_rate=self.acceptance_rate,
                    mean_acceptance_length=self.mean_acceptance_length,
                    per_position_acceptance=self.per_position_acceptance)
