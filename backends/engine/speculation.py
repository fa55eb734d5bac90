"""The decode engine's speculation: per step, how many tokens each sequence drafts and by
which method (the adaptive controller's plan), the drafts, their verification in one target
forward (lossless: :func:`~.sampler.verify_drafts`), the accepted tokens committed and the
rejected KV rolled back; what each part cost is fed back to the controller. After a plain
step the proposer catches up on what the target computed."""
from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future, wait
from dataclasses import replace
from typing import Callable

import torch

from ..speculative.adaptive import Choice, SpecController
from ..speculative.metrics import SpecDecodeMetrics
from .graph_runner import capture_sizes, padded_size
from .isolation import isolate
from .model_runner import ForwardBatch
from .outputs import OutputProcessor, RequestOutput, sequence_logprobs
from .proposers import MAX_LAG, PLAIN_MAX_LAG, Proposer, StepHidden
from .sampler import verify_drafts
from .scheduler import ScheduledSeq, Scheduler
from .sequence import Sequence
from .step_controls import StepControls
from .step_runner import StepRunner

log = logging.getLogger(__name__)

# a step's speculation: the controller's choice, and who drafts for each sequence
Plan = tuple[Choice, list["str | None"]]


def drafting_kind(methods: list[str | None], ks: tuple[int, ...]) -> str:
    """What drafted in a step, for its cost: "model" when any row drafted by a model."""
    return "model" if any(m not in (None, "ngram") for m, k in zip(methods, ks) if k) else "ngram"


class Speculation:
    """``proposer`` drafts, ``controller`` plans each step (both replaceable, e.g. by tests);
    ``outputs`` commits what a step accepted; ``clock`` times steps in wall time (adaptive
    speculation's goal is tokens per second as a client sees them: a server's other
    processes take the cores per step, whatever k)."""

    def __init__(self, proposer: Proposer, controller: SpecController, target: StepRunner,
                 outputs: OutputProcessor, controls: StepControls, scheduler: Scheduler,
                 metrics: SpecDecodeMetrics, max_num_seqs: int,
                 clock: Callable[[], float] = time.perf_counter):
        self.proposer, self.controller, self.target = proposer, controller, target
        self.outputs, self.controls, self.scheduler, self.clock = outputs, controls, scheduler, clock
        self.metrics = metrics
        self._buckets = capture_sizes(max_num_seqs)
        # (clock, bucket) at the end of the last step that ran sequences: the time from
        # there to the next step is what serving a step costs outside it
        self._step_ended: tuple[float, int] | None = None

    def bucket(self, batch_size: int) -> int:
        return padded_size(batch_size, self._buckets) or batch_size

    def seed_costs(self) -> None:
        """Start-up step costs for the controller; the engine's own step times replace them."""
        for (bucket, k), ms in self.target.step_costs(self.controller.max_k, self.clock).items():
            self.controller.seed_step(bucket, k, ms)

    def forget(self, request_id: str) -> None:
        self.controller.forget(request_id)
        self.proposer.forget(request_id)

    # -- around each step ----------------------------------------------------------
    def step_began(self) -> None:
        """A server's work between two steps (streaming the outputs, taking requests in)
        is paid once per step whatever k was: it makes fewer, longer steps pay more."""
        if self._step_ended is not None:
            ended, bucket = self._step_ended
            self.controller.observe_gap(bucket, 1000 * (self.clock() - ended))
        self._step_ended = None

    def step_ended(self, batch_size: int, more: bool) -> None:
        """``more``: requests remain (an idle wait after the last one is no step's cost)."""
        if more:
            self._step_ended = (self.clock(), self.bucket(batch_size))

    def choose(self, scheduled: list[ScheduledSeq]) -> Plan | None:
        """How many tokens each sequence of a decode step drafts, and by which method;
        None: not a decode step, or the proposer is behind on some sequence (or, with k
        pinned, cannot draft for one), so the step decodes plainly and it catches up."""
        if not all(s.num_new_tokens == 1 and s.samples for s in scheduled):
            return None
        seqs = [s.seq for s in scheduled]
        bucket = self.bucket(len(seqs))
        fast = self.controller.plain_without_planning(bucket)
        if fast is not None:
            self.metrics.record_choice(fast.k, fast.reason)
            return fast, [None] * len(seqs)
        if not all(self.proposer.in_sync(s) for s in seqs):
            return None
        methods = [self.proposer.method_for(s) for s in seqs]
        if not self.controller.adaptive and None in methods:
            return None   # pinned k: a batch speculates only when every sequence drafts
        choice = self.controller.plan(bucket, [s.request_id for s in seqs], methods,
                                      self.proposer.fallback_method)
        self.metrics.record_choice(choice.k, choice.reason)
        if self.controller.choices.get(bucket, 0) % 1024 == 1:    # why it chooses, now and then
            log.info("adaptive speculation, %s", self.controller.describe(bucket))
        return choice, methods if choice.methods is None else list(choice.methods)

    def after_plain_step(self, seqs: list[Sequence], batch: ForwardBatch, hidden: torch.Tensor,
                         plan: Plan | None, ms: float) -> list[RequestOutput]:
        """A plain step ran ``batch`` for ``seqs`` (prefill, decode or mixed; ``plan``: the
        controller chose it, ``ms`` its cost): the proposer sees what the target saw. Its
        cost is observed before the catch-up (a lazy proposer's kept rows run in batches
        every MAX_LAG tokens: work the plain step does not need)."""
        bucket = self.bucket(len(seqs))
        if plan is not None:
            self.controller.observe_step(bucket, 0, ms)
        ptr = list(itertools.accumulate(batch.qo_lens, initial=0))
        step_hidden: StepHidden = {s.request_id: (batch.starts[i], hidden[ptr[i]:ptr[i + 1]])
                                   for i, s in enumerate(seqs)}
        live = [s for s in seqs if not s.is_finished]
        # while the controller keeps choosing plain steps, a lazy proposer leaves decoded
        # rows for longer: a request may end before it drafts again
        lag = PLAIN_MAX_LAG if plan is not None and self.controller.decoding_plainly(bucket) else MAX_LAG
        return isolate(live, lambda seqs: self.proposer.catch_up(seqs, step_hidden, lag) or [],
                       self.outputs.fail)

    # -- the speculative step --------------------------------------------------------
    def _propose(self, seqs: list[Sequence], ks: tuple[int, ...],
                 methods: list[str | None]) -> list[list[int]]:
        """Each sequence's ``ks[i]`` drafts, from its method's proposer (one batch each)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        for method in dict.fromkeys(m for m, k in zip(methods, ks) if k):
            rows = [i for i, (m, k) in enumerate(zip(methods, ks)) if k and m == method]
            group = [seqs[i] for i in rows]
            out = self.proposer.drafter(method).propose(
                group, max(ks[i] for i in rows), self.controls.draft_process(group)).tolist()
            for i, d in zip(rows, out):
                drafts[i] = d[:ks[i]]
        return drafts

    def step(self, seqs: list[Sequence], plan: Plan) -> list[RequestOutput]:
        """Draft ``choice.ks[i]`` tokens for sequence i (0: none, it is verified with its
        one token), verify them in one target forward, keep each accepted prefix plus one
        target token, roll the rejected KV back. Sequences drafting the same number are
        verified together (the rejection sampler's [B, k + 1] rows)."""
        choice, methods = plan
        ks, width = choice.ks, choice.k + 1
        # a lazy model proposer first catches up on the rows it kept (every MAX_LAG tokens
        # it would anyway): outside the drafting's measured cost, which is then what
        # drafting k tokens costs, not how long the proposer sat out before
        behind = [s for s, m, k in zip(seqs, methods, ks) if k and m not in (None, "ngram")]
        if behind:
            self.proposer.flush(behind)
        before = [replace(s.draft) for s in seqs]
        groups: dict[int, list[int]] = {}
        for i, k in enumerate(ks):
            groups.setdefault(k, []).append(i)
        masks: dict[int, Future | None] = {}
        began = self.clock()
        try:
            drafts = self._propose(seqs, ks, methods)
            proposed = self.clock()
            draft_rows = {k: torch.tensor([drafts[i] for i in rows], dtype=torch.long).view(len(rows), k)
                          for k, rows in groups.items()}
            for k, rows in groups.items():
                masks[k] = self.controls.start([seqs[i] for i in rows], k + 1, draft_rows[k] if k else None)
            starts = [s.num_computed for s in seqs]
            # the target verifies under each row's adapter (the drafts came from the base)
            batch = ForwardBatch([[s.token_ids(s.num_computed, s.num_tokens)[0], *d]
                                  for s, d in zip(seqs, drafts)], starts, [s.pages for s in seqs],
                                 [s.lora_slot for s in seqs])
            hidden = self.target.verify_forward(batch, choice.k)
            logits = self.target.logits(hidden)
            ptr = list(itertools.accumulate(batch.qo_lens, initial=0))
            verified = torch.full((len(seqs), width), -1, dtype=torch.int32)
            accepted, dead, logprobs = [0] * len(seqs), {}, [None] * len(seqs)
            for k, rows in groups.items():
                group = [seqs[i] for i in rows]
                if len(groups) == 1:
                    rows_logits = logits.view(len(seqs), k + 1, -1)
                else:
                    index = torch.tensor([ptr[i] + j for i in rows for j in range(k + 1)])
                    rows_logits = logits[index].view(len(rows), k + 1, -1)
                d = draft_rows[k]
                # controls at each position, the drafts before it counted as output (lossless)
                group_dead = self.controls.apply(rows_logits, group, d if k else None, masks[k])
                v, a = verify_drafts(rows_logits, d, [s.params for s in group],
                                     [len(s.output_ids) for s in group])
                lp = sequence_logprobs(rows_logits, [v[j, :a[j] + 1].tolist() for j in range(len(rows))],
                                       group)
                for j, i in enumerate(rows):
                    verified[i, :k + 1], accepted[i], logprobs[i] = v[j], a[j], lp[j]
                    if j in group_dead:
                        dead[i] = group_dead[j]
        except Exception:
            for s, draft in zip(seqs, before):   # proposing advanced the drafts' caches
                s.draft = draft
            for m in masks.values():
                if m is not None:
                    wait([m])
            raise
        outputs, survivors = [], []
        for i, s in enumerate(seqs):
            if ks[i]:
                self.metrics.record(accepted[i], ks[i], methods[i])
                self.controller.observe_accepted(s.request_id, methods[i], ks[i], accepted[i])
                s.record_drafts(ks[i], accepted[i])
            s.num_computed = starts[i] + 1 + accepted[i]
            # a request finishing here publishes only the proposer KV that was right
            # before it drafted (an MTP head's draft rows are rewritten after verifying)
            right = before[i].computed
            # a guide left position dead[i] without a token: what came before it is
            # kept, as plain decoding would have emitted it, then the sequence ends
            n = min(accepted[i] + 1, dead.get(i, ks[i] + 1))
            outputs.append(self.outputs.commit(s, verified[i, :n].tolist(), logprobs[i][:n]
                                               if logprobs[i] is not None else None, right))
            if n <= accepted[i] and not s.is_finished:
                outputs.append(self.outputs.guide_ended(s, right))
            if not s.is_finished:
                survivors.append(i)
        if len(groups) == 1:
            hidden = hidden.view(len(seqs), width, -1)
        else:   # rows past a sequence's own drafts: zeros (-1 tokens), as past a rejection
            padded = hidden.new_zeros(len(seqs), width, hidden.shape[-1])
            for i in range(len(seqs)):
                padded[i, :ptr[i + 1] - ptr[i]] = hidden[ptr[i]:ptr[i + 1]]
            hidden = padded

        def after_verify(rows: list[int]) -> list[RequestOutput]:
            live = [seqs[i] for i in rows]
            self.proposer.after_verify(live, verified[rows], hidden[rows], [starts[i] for i in rows])
            for s in live:
                self.scheduler.trim(s, max(s.num_tokens, s.draft.computed))
            return []

        if survivors:
            outputs += isolate(survivors, after_verify, lambda i, exc: self.outputs.fail(seqs[i], exc))
        bucket = self.bucket(len(seqs))
        self.controller.observe_propose(bucket, choice.k, drafting_kind(methods, ks), 1000 * (proposed - began))
        self.controller.observe_step(bucket, choice.k, 1000 * (self.clock() - proposed))
        return outputs
