"""The proposer protocol: what the engine asks of a speculative method's drafter.

A proposer keeps, per sequence, whatever lets it draft from where the target is
(the draft model's and MTP head's ``seq.draft``: cached length and the hidden row their
last run left for the next step's first draft token). The engine calls, in order:

- ``ready(seq)`` — can it draft for this sequence now? A batch speculates only when
  every sequence in it is ready; otherwise it decodes plainly;
- ``catch_up(seqs, step_hidden)`` after a plain (prefill, decode or mixed) target step;
- ``propose(seqs, k, process)`` -> ``[B, k]`` greedy draft tokens (``process``, when
  given, changes each step's draft logits in place first: the requests' logits controls);
- ``after_verify(seqs, tokens, target_hidden, starts)`` once the target has verified.

With adaptive speculation (or ``--spec auto``) the engine asks instead, per step:
``in_sync(seq)`` (its state covers the sequence; ngram: always), ``method_for(seq)``
(the method that would draft for it now, None: none can) and ``drafter(method)`` (the
proposer that drafts by it); a sequence drafting nothing in a speculative step is
verified with its one scheduled token, and ``after_verify`` still sees it. ``forget(id)``
when a request ends.

At start-up the engine asks ``plain_decode_runner()`` for a model whose plain decode
steps it may compile or graph, and hands the result back with ``use_fast_decode``.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from ..sequence import Sequence

# a lazy proposer (adaptive speculation) catches up on a prompt's chunks at once, and on
# decoded tokens at the latest when this many wait: it bounds the rows kept and how late
# the prefix cache sees the proposer's KV of generated text (4 pages of 16)
MAX_LAG = 64
# ... and while adaptive speculation keeps choosing plain steps: a request that ends
# before drafting again never needs the rows (at batch 16 on two cores the catch-up every
# MAX_LAG tokens was ~2% of a plain step's cost)
PLAIN_MAX_LAG = 512

# per request id: (first target position computed this step, hidden rows [n, H])
StepHidden = dict[str, tuple[int, torch.Tensor]]
# (draft logits [B, V], the drafts so far [B, j] or None) -> None, in place
DraftProcess = Callable[[torch.Tensor, "torch.Tensor | None"], None]


class Proposer(Protocol):
    name: str
    # a method besides the sequence's own that can draft for any sequence (``--spec auto``'s
    # model proposer, weighed against the prompt lookup); None: none
    fallback_method: str | None

    def ready(self, seq: Sequence) -> bool:
        """Whether ``seq`` can be drafted for in this step."""

    def catch_up(self, seqs: list[Sequence], step_hidden: StepHidden | None = None,
                 max_lag: int = MAX_LAG) -> None:
        """Bring the proposer's state up to the target's after a plain step
        (``step_hidden``: the target's hidden rows of that step, for an MTP head; a
        lazy proposer may leave up to ``max_lag`` tokens of decoded text to later)."""

    def propose(self, seqs: list[Sequence], k: int,
                process: DraftProcess | None = None) -> torch.Tensor:
        """``[B, k]`` draft tokens for ``seqs``, each of which is ``ready``."""

    def after_verify(self, seqs: list[Sequence], tokens: torch.Tensor, target_hidden: torch.Tensor,
                     starts: list[int]) -> None:
        """The target verified: ``tokens`` ``[B, k+1]`` (-1 padded past the accepted ones),
        ``target_hidden`` ``[B, k+1, H]``, ``starts`` the target's cached length before."""

    def in_sync(self, seq: Sequence) -> bool:
        """Whether its state covers ``seq`` (a lazy proposer: once it has caught up)."""

    def method_for(self, seq: Sequence) -> str | None:
        """The method that would draft for ``seq`` now; None: none can."""

    def drafter(self, method: str) -> "Proposer":
        """The proposer that drafts by ``method``."""

    def flush(self, seqs: list[Sequence]) -> None:
        """Catch up now on everything a lazy proposer left to later for ``seqs``, so that
        drafting for them costs only the drafting."""

    def forget(self, request_id: str) -> None:
        """The request ended: drop what is kept for it."""

    def plain_decode_runner(self):
        """The :class:`~..model_runner.ModelRunner` whose one-token decode steps the engine
        may compile or graph for this proposer (the draft model's); None: none."""

    def use_fast_decode(self, steps) -> None:
        """Run those decode steps through ``steps`` (a graphed or compiled decode)."""
