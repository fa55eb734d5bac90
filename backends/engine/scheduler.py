"""Continuous batching: waiting/running queues, chunked prefill under a per-step token
budget, admission by free pages, and preemption (recompute) when pages run out. With
prefix caching a fresh sequence starts from the cached pages of its prompt's prefix."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..kv_cache import KVAllocator, pages_needed
from .prefix_caching import PrefixCaching
from .sequence import Sequence, SeqStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def start(self) -> int:
        return self.seq.num_computed

    @property
    def end(self) -> int:
        return self.seq.num_computed + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """This chunk reaches the sequence's last token, so a new token is sampled."""
        return self.end == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """The interface between scheduler and engine for one step (vLLM's name)."""
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, allocator: KVAllocator, page_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, num_lookahead_slots: int = 0,
                 prefix: PrefixCaching | None = None):
        self.allocator = allocator
        self.prefix = prefix
        # speculative decoding writes KV for k drafts (and the draft model one token)
        # beyond the scheduled tokens: reserve those slots too
        self.num_lookahead_slots = num_lookahead_slots
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []     # admission order: oldest first

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        plan = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # running sequences first (decodes and unfinished prefill chunks), oldest first;
        # when pages run out the newest running sequence is preempted
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted in this loop
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self._reserve(seq, seq.num_computed + n + self.num_lookahead_slots):
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            else:
                plan.seqs.append(ScheduledSeq(seq, n))
                budget -= n
        # then admit waiting sequences while pages, slots and budget last
        while self.waiting and budget > 0 and not plan.preempted \
                and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self.prefix.match(seq) if self.prefix is not None else None
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self._reserve(seq, seq.num_computed + n + self.num_lookahead_slots):
                if hit:    # the cached pages go back (still cached) until it fits
                    self._release(seq)
                break
            if hit is not None:
                self.prefix.admitted(seq, hit)
            if not seq.first_scheduled_ns:
                seq.first_scheduled_ns = time.time_ns()
                seq.num_first_pages = seq.num_allocated_pages
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            plan.seqs.append(ScheduledSeq(seq, n))
            budget -= n
        return plan

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's pages and slot."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        need = pages_needed(num_tokens, self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        # decided and taken in one step: a shared pool's pages may go to another
        # process between a check and an alloc
        pages = self.allocator.try_alloc(need)
        if pages is None:
            return False
        seq.num_allocated_pages += len(pages)
        seq.pages.extend(pages)
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back pages beyond those holding ``num_tokens`` tokens (rejected drafts)."""
        keep = pages_needed(num_tokens, self.page_size)
        if len(seq.pages) > keep:
            self.allocator.free(seq.pages[keep:])
            del seq.pages[keep:]

    def _preempt(self, seq: Sequence) -> None:
        # recompute preemption: drop the KV, keep the tokens, go back to the queue's head
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.pages:
            self.allocator.free(seq.pages)
            seq.pages = []
        seq.drop_kv()
