"""A request's state inside the engine."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ..lora.request import LoRARequest
from .logits_processors import LogitsControls
from .logprobs import PromptLogprobs, TopLogprobs
from .params import SamplingParams
from .request_perf import RequestPerf


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class DraftState:
    """A proposer's view of one sequence (draft model or MTP head): its cached length,
    and the logits (for MTP also the hidden state) its last run left for the next
    step's first draft. Only the proposers give it meaning."""
    computed: int = 0
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


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
    num_preemptions: int = 0
    draft: DraftState = field(default_factory=DraftState)
    controls: LogitsControls | None = None   # None: no control changes its logits
    logprobs: list[float] | None = None      # one per output token, with params.logprobs
    cumulative_logprob: float = 0.0
    top_logprobs: list[TopLogprobs] | None = None   # one per output token, with params.top_logprobs
    prompt_logprobs: PromptLogprobs | None = None   # with params.prompt_logprobs
    prompt_logprobs_sent: bool = False
    lora: LoRARequest | None = None          # its adapter (None: the base model)
    lora_slot: int = 0                       # the adapter's slot while it runs (0: none)
    # prefix caching (prefix_caching.py): keys of its full pages so far; of its pages,
    # the first num_matched_pages came from the cache and the first num_published are in it
    page_keys: list[bytes] = field(default_factory=list)
    num_matched_pages: int = 0
    num_published: int = 0
    num_cached_tokens: int | None = None     # prompt tokens the cache served (first admission)
    # what return_perf_metrics reports (request_perf.py); times in ns since the epoch
    arrival_ns: int = field(default_factory=time.time_ns)
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0
    num_allocated_pages: int = 0
    num_first_pages: int = 0                 # allocated when first admitted
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    def append_token(self, token: int, logprob: float | None = None,
                     top: TopLogprobs | None = None) -> None:
        self.last_token_ns = time.time_ns()
        if not self.output_ids:
            self.first_token_ns = self.last_token_ns
        self.output_ids.append(token)
        if self.controls is not None:
            self.controls.append(token)
        if self.logprobs is not None:
            self.logprobs.append(logprob)
            self.cumulative_logprob += logprob
        if self.top_logprobs is not None:
            self.top_logprobs.append(top)

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

    def drop_kv(self) -> None:
        """Its KV is gone (finished, preempted): nothing is cached, for target or proposer."""
        self.num_computed = 0
        self.num_matched_pages = self.num_published = 0
        self.draft = DraftState()

    def record_drafts(self, num_drafts: int, num_accepted: int) -> None:
        self.num_draft_tokens += num_drafts
        self.num_accepted_draft_tokens += num_accepted

    def perf(self, page_size: int) -> RequestPerf:
        return RequestPerf(
            reused_pages=(self.num_cached_tokens or 0) // page_size, new_pages=self.num_first_pages,
            total_pages=self.num_allocated_pages, arrival_ns=self.arrival_ns,
            first_scheduled_ns=self.first_scheduled_ns, first_token_ns=self.first_token_ns,
            last_token_ns=self.last_token_ns, draft_tokens=self.num_draft_tokens,
            accepted_draft_tokens=self.num_accepted_draft_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
