"""A request's state inside the engine."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0               # tokens whose KV is in the cache
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    arrival: int = 0                    # admission order; preemption takes the newest first
    num_preemptions: int = 0
    # speculative decoding: the draft's (or MTP head's) cached length, and the logits
    # (and for MTP the hidden state) its last run left for the next step's first draft
    draft_computed: int = 0
    draft_logits: torch.Tensor | None = None
    draft_hidden: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
