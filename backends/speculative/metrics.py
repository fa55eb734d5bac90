"""Acceptance statistics of speculative decoding, and what adaptive speculation chose."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeMetrics:
    num_speculative_tokens: int     # the most drafts a step verifies per sequence
    num_drafts: int = 0             # verification rounds, summed over sequences
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0    # draft tokens kept (the accepted prefix)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    # decode steps by (k chosen, reason) (backends/speculative/adaptive.py's REASONS)
    steps_by_choice: dict[tuple[int, str], int] = field(default_factory=dict)
    # per proposer (``--spec auto`` has two): [rounds, draft tokens, accepted tokens]
    by_method: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        """Count from zero again (after a warm-up), for the same ``num_speculative_tokens``."""
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.num_speculative_tokens
        self.drafted_per_position = [0] * self.num_speculative_tokens
        self.steps_by_choice, self.by_method = {}, {}

    def record(self, num_accepted: int, num_drafted: int | None = None,
               method: str | None = None) -> None:
        """One sequence's verification round: ``num_drafted`` drafts (default: the most),
        the first ``num_accepted`` of them kept."""
        k = self.num_speculative_tokens if num_drafted is None else num_drafted
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += num_accepted
        for i in range(k):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        if method is not None:
            counts = self.by_method.setdefault(method, [0, 0, 0])
            counts[0] += 1
            counts[1] += k
            counts[2] += num_accepted

    def record_choice(self, k: int, reason: str) -> None:
        self.steps_by_choice[(k, reason)] = self.steps_by_choice.get((k, reason), 0) + 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per target step: 1 + accepted / drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Share of the rounds whose draft at each position was accepted (of all rounds:
        with k pinned, every round drafts every position)."""
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position]

    def as_dict(self) -> dict:
        return dict(num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
                    num_accepted_tokens=self.num_accepted_tokens,
                    acceptance_rate=self.acceptance_rate,
                    mean_acceptance_length=self.mean_acceptance_length,
                    per_position_acceptance=self.per_position_acceptance,
                    steps_by_choice={f"k={k} {reason}": n
                                     for (k, reason), n in sorted(self.steps_by_choice.items())},
                    by_method={m: dict(num_drafts=r, num_draft_tokens=d, num_accepted_tokens=a)
                               for m, (r, d, a) in self.by_method.items()})
