"""Adaptive speculation: how many draft tokens each step verifies, from what steps cost
on this machine and what each sequence has been accepting.

A step that verifies k drafts of a sequence emits, in expectation,
``1 + a_1 + a_1 a_2 + ... + a_1 ... a_k`` of its tokens, where ``a_j`` is the chance
that draft j is accepted given that the drafts before it were (the acceptance of a
draft *position*, tracked per sequence as an exponential moving average). The step
costs the target's verify forward for the batch at (batch bucket, k) plus the
proposer's drafting; k = 0 is a plain decode step. :func:`choose_k` picks the k with
the most expected tokens per millisecond — pure, given the costs and acceptances —
among the k that slow no sequence of the batch: every row pays the verify step's price,
so a k is allowed only where each row's own expected tokens per ms are at least a plain
step's (``row_floor``). That is what "never slower than plain" needs: a step where some
rows race ahead while the others advance one token at a dearer price wins tokens per ms
for the batch but loses to plain decoding wherever the run lasts as long as its slowest
request (a closed batch, every client waiting on its own stream).

:class:`SpecController` holds what the engine measures online: step costs as moving
averages per (bucket, k), seeded by a start-up warm-up; a cell never measured is
estimated from the others by the number of tokens the target computes
(:meth:`CostTable.estimate`). A sequence whose first draft position collapses below
:data:`COLLAPSE` stops speculating for a while (backoff, doubled each time it
probe fails too), then probes with one speculative round.

>>> choose_k({0: 10.0, 1: 12.0, 2: 13.0, 3: 14.0}, [[0.9, 0.8, 0.7]], 3).k
3
>>> choose_k({0: 10.0, 1: 16.0, 2: 19.0, 3: 22.0}, [[0.3, 0.2, 0.1]], 3).reason
'plain_faster'
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from typing import Sequence

COST_ALPHA = 0.2          # weight of a new step-cost measurement
# a measurement above this many times its average counts as this many: a lazy proposer's
# catch-up on the rows of a long plain stretch lands in one drafting step now and then,
# and would otherwise keep drafting's average dear long after (a rising load still
# moves the average up by COST_ALPHA * (COST_CLIP - 1) per step)
COST_CLIP = 2.0
ACCEPT_ALPHA = 0.3        # weight of a new acceptance outcome
PRIOR_ACCEPTANCE = 0.6    # a draft position's acceptance before anything was measured
COLLAPSE = 0.15           # first-position acceptance below this: the sequence backs off
MIN_ROUNDS = 3            # rounds a sequence drafts before it can be judged collapsed
BACKOFF_MIN, BACKOFF_MAX = 8, 256   # steps without speculating, doubled per collapse
EXPLORE_EVERY = 64        # every n-th choice at a bucket measures its least fresh k
# after this many plain choices in a row at a bucket, only every REPLAN_EVERY-th step looks
# at the sequences (their proposals: an n-gram lookup each); the others decode plainly
# at once -- where speculation does not pay, choosing costs as much as it could save
PLAIN_STREAK, REPLAN_EVERY = 8, 8
# speculation must beat a plain step's expected tokens per ms by this factor: the costs and
# acceptances are noisy averages, so a marginal estimate is not worth the risk
SPECULATE_MARGIN = 1.1
# and no row of the batch may expect fewer tokens per ms than in a plain step: a row that
# does not draft (or drafts poorly) pays the verify step's price for its one token
ROW_FLOOR = 1.0

# slows_row: the batch would gain, but some row would advance slower than in a plain step
REASONS = ("fixed", "speculate", "plain_faster", "slows_row", "no_draft", "backoff", "explore")


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """Tokens one sequence emits in expectation when k drafts are verified (the accepted
    prefix plus the target's own next token).

    >>> expected_tokens([0.5, 0.5], 2), expected_tokens([0.5, 0.5], 0)
    (1.75, 1.0)
    """
    total = p = 1.0
    for a in acceptance[:k]:
        p *= a
        total += p
    return total


@dataclass(slots=True, frozen=True)
class Choice:
    """One step's speculation: k drafts for every sequence that can draft (its entry
    of ``ks``; 0 for the others), why, and the expected tokens per ms; ``methods``: who
    drafts for each sequence, where the plan changed it (None: as it was asked)."""
    k: int
    ks: tuple[int, ...]
    reason: str
    tokens_per_ms: float = field(default=0.0, repr=False, compare=False)
    methods: tuple[str | None, ...] | None = field(default=None, repr=False, compare=False)


def choose_k(step_ms: dict[int, float], acceptances: Sequence[Sequence[float] | None],
             max_k: int, margin: float = 1.0, row_floor: float = 0.0) -> Choice:
    """The k in 0..max_k with the most expected tokens per ms for the batch, a k > 0
    only where it beats the plain step by ``margin`` and leaves every row at least
    ``row_floor`` times its plain step's tokens per ms.

    ``step_ms[k]``: what a step of this batch costs with k drafts per drafting sequence
    (0: a plain decode step); ``acceptances[i]``: sequence i's per-position acceptance,
    or None when it does not draft this step (no proposal, backing off). Ties go to the
    smaller k (less work for the same tokens).

    >>> choose_k({0: 10.0, 1: 15.0, 2: 18.0}, [[0.9, 0.9], None], 2)
    Choice(k=2, ks=(2, 0), reason='speculate')
    >>> choose_k({0: 10.0, 1: 15.0, 2: 18.0}, [[0.9, 0.9], None], 2, margin=1.1).reason
    'plain_faster'
    >>> choose_k({0: 10.0, 1: 15.0, 2: 18.0}, [[0.9, 0.9], None], 2, row_floor=1.0).reason
    'slows_row'
    >>> choose_k({0: 10.0, 1: 12.0, 2: 14.0}, [[0.9, 0.9], [0.3, 0.1]], 2, row_floor=1.0).k
    1
    """
    plain = len(acceptances) / step_ms[0]
    if all(a is None for a in acceptances):
        return Choice(0, (0,) * len(acceptances), "no_draft", plain)
    best_k, best_rate, slowed = 0, plain * margin, False
    for k in range(1, max_k + 1):
        tokens = [1.0 if a is None else expected_tokens(a, k) for a in acceptances]
        rate = sum(tokens) / step_ms[k]
        if rate <= best_rate * (1 + 1e-9):
            continue
        if min(tokens) / step_ms[k] < row_floor / step_ms[0] * (1 - 1e-9):
            slowed = True
            continue
        best_k, best_rate = k, rate
    if best_k == 0:
        return Choice(0, (0,) * len(acceptances), "slows_row" if slowed else "plain_faster", plain)
    return Choice(best_k, tuple(0 if a is None else best_k for a in acceptances), "speculate",
                  best_rate)


class CostTable:
    """Moving averages of ms per step by key ``(kind, bucket, k)``, with an estimate for
    keys never measured: the same kind's cells interpolated over ``bucket * (k + 1)``,
    the tokens the target computes (a step of few tokens is mostly fixed overhead, so
    cost grows with tokens, not with k or batch alone).

    >>> t = CostTable()
    >>> t.observe(("step", 1, 0), 10.0); t.observe(("step", 1, 3), 14.0)
    >>> t.estimate(("step", 2, 0)), t.estimate(("step", 4, 3))   # 2 tokens; 16 tokens
    (11.333333333333334, 30.0)
    """

    def __init__(self, alpha: float = COST_ALPHA):
        self.alpha = alpha   # an observation is clipped at COST_CLIP times the average
        self.ms: dict[tuple, float] = {}
        self.seen: dict[tuple, int] = {}    # key -> the count of observations when last seen
        self.seeded: set[tuple] = set()     # keys that hold a start-up measurement only
        self.observations = 0

    def observe(self, key: tuple, ms: float) -> None:
        old = self.ms.get(key)
        fresh = old is None or key in self.seeded
        self.ms[key] = ms if fresh else old + self.alpha * (min(ms, COST_CLIP * old) - old)
        self.seeded.discard(key)
        self.observations += 1
        self.seen[key] = self.observations

    def seed(self, key: tuple, ms: float) -> None:
        """A start-up measurement: kept until the first measurement of ``key`` replaces it."""
        if key not in self.ms:
            self.ms[key] = ms
            self.seeded.add(key)

    def estimate(self, key: tuple) -> float | None:
        """The average of ``key``, else interpolated (see the class), else None."""
        if key in self.ms:
            return self.ms[key]
        kind, bucket, k, rest = key[0], key[1], key[2], key[3:]
        points = sorted((other[1] * (other[2] + 1), ms) for other, ms in self.ms.items()
                        if other[0] == kind and other[3:] == rest)
        if not points:
            return None
        n = bucket * (k + 1)
        xs = [x for x, _ in points]
        i = bisect.bisect_left(xs, n)
        if i < len(points) and xs[i] == n:
            return points[i][1]
        if len(points) == 1:   # proportional to tokens beyond a half fixed cost
            x, ms = points[0]
            return ms * (0.5 + 0.5 * n / x)
        lo, hi = (points[0], points[1]) if i == 0 else \
            (points[-2], points[-1]) if i == len(points) else (points[i - 1], points[i])
        (x0, y0), (x1, y1) = lo, hi
        if x1 == x0:
            return y1
        return max(min(y0, y1) * 0.5, y0 + (y1 - y0) * (n - x0) / (x1 - x0))


@dataclass(slots=True)
class Acceptance:
    """One sequence's (or one method's) acceptance per draft position, and its backoff."""
    rates: list[float]
    rounds: int = 0
    backoff: int = 0              # steps left without speculating
    next_backoff: int = BACKOFF_MIN
    probing: bool = False         # the round after a backoff

    def update(self, k: int, accepted: int, alpha: float = ACCEPT_ALPHA) -> None:
        """Positions 1..accepted were accepted and position accepted + 1 (if drafted)
        rejected; later positions were not tried, so they keep their average."""
        for j in range(min(accepted + 1, k)):
            hit = 1.0 if j < accepted else 0.0
            self.rates[j] += alpha * (hit - self.rates[j])
        self.rounds += 1

    def tick(self) -> None:
        """One step passed; at the end of a backoff the sequence probes: one round from
        the prior (its collapsed averages would never let it draft)."""
        if self.backoff:
            self.backoff -= 1
            if not self.backoff:
                self.rates, self.probing = [PRIOR_ACCEPTANCE] * len(self.rates), True

    def judge(self, accepted: int) -> None:
        """After a round: back off when the first position collapsed, or when a probe
        had its first draft rejected (for twice as long each time); a probe that
        accepted resets the next backoff's length."""
        if self.probing:
            self.probing = False
            if accepted:
                self.next_backoff = BACKOFF_MIN
                return
        elif self.rounds < MIN_ROUNDS or self.backoff or self.rates[0] >= COLLAPSE:
            return
        self.backoff, self.next_backoff = self.next_backoff, min(2 * self.next_backoff, BACKOFF_MAX)


@dataclass(slots=True)
class SpecController:
    """Per step: which sequences draft and how many tokens (:meth:`plan`); learns from
    what the engine measures (:meth:`observe_cost`, :meth:`observe_accepted`).
    ``adaptive=False`` pins k to ``max_k`` for every sequence that can draft."""
    max_k: int
    adaptive: bool = True
    costs: CostTable = field(default_factory=CostTable)
    seqs: dict[str, dict[str, Acceptance]] = field(default_factory=dict)   # rid -> method -> state
    methods: dict[str, Acceptance] = field(default_factory=dict)   # priors for new sequences
    choices: dict[int, int] = field(default_factory=dict)          # per bucket, for exploring
    plain_streak: dict[int, int] = field(default_factory=dict)     # per bucket: plain choices in a row

    def _state(self, rid: str, method: str) -> Acceptance:
        states = self.seqs.setdefault(rid, {})
        s = states.get(method)
        if s is None:
            prior = self.methods.get(method)
            rates = list(prior.rates) if prior is not None else [PRIOR_ACCEPTANCE] * self.max_k
            s = states[method] = Acceptance(rates)
        return s

    def backing_off(self, rid: str, method: str) -> bool:
        s = self.seqs.get(rid, {}).get(method)
        return s is not None and s.backoff > 0

    def step_ms(self, bucket: int, k: int, kind: str) -> float | None:
        """The estimated cost of a step at ``bucket`` with ``k`` drafts drafted by
        ``kind`` ("model" or "ngram"): target side plus proposer side, plus what the
        engine's caller spends between two steps ("gap": a server streaming each step's
        outputs), the same for every k."""
        target = self.costs.estimate(("step", bucket, k))
        if target is None:
            return None
        target += self.costs.estimate(("gap", bucket, 0)) or 0.0
        if k == 0:
            return target
        return target + (self.costs.estimate(("propose", bucket, k, kind)) or 0.0)

    def decoding_plainly(self, bucket: int) -> bool:
        """Plain steps have been chosen at ``bucket`` :data:`PLAIN_STREAK` times in a row."""
        return self.adaptive and self.plain_streak.get(bucket, 0) >= PLAIN_STREAK

    def plain_without_planning(self, bucket: int) -> Choice | None:
        """A plain step chosen without looking at the sequences (None: plan this one):
        after :data:`PLAIN_STREAK` plain choices in a row at ``bucket``, all but every
        :data:`REPLAN_EVERY`-th step. Backoffs do not count these steps down."""
        n = self.plain_streak.get(bucket, 0)
        if not self.decoding_plainly(bucket) or n % REPLAN_EVERY == 0:
            return None
        self.plain_streak[bucket] = n + 1
        return Choice(0, (), "plain_faster")

    def _rates(self, rid: str, method: str | None) -> list[float] | None:
        """What ``rid`` accepts from ``method``; None where it cannot draft or backs off."""
        s = None if method is None else self._state(rid, method)
        return None if s is None or s.backoff > 0 else s.rates

    def _better(self, rid: str, method: str | None, model: str) -> tuple[str | None, list[float] | None]:
        """Who drafts ``rid`` better at k = max_k, and its acceptance: ``method`` (the
        prompt lookup) or ``model``; a tie keeps ``method`` (cheaper), a method that cannot
        draft or backs off loses to one that can."""
        own = self._rates(rid, method)
        if method != "ngram":
            return method, own
        other = self._rates(rid, model)
        if other is not None and (own is None or
                                  expected_tokens(other, self.max_k) > expected_tokens(own, self.max_k)):
            return model, other
        return method, own

    def plan(self, bucket: int, rids: Sequence[str], methods: Sequence[str | None],
             model: str | None = None) -> Choice:
        """``methods[i]``: what would draft for sequence ``rids[i]`` (None: nothing can);
        ``model``: a proposer that can draft for every one of them (``--spec auto``'s
        model proposer), weighed too for each row the prompt lookup matches."""
        if not self.adaptive:
            return Choice(self.max_k, tuple(0 if m is None else self.max_k for m in methods), "fixed")
        acceptances = [self._rates(rid, m) for rid, m in zip(rids, methods)]
        backoff = any(a is None and m is not None for a, m in zip(acceptances, methods))
        for rid in rids:
            for state in self.seqs.get(rid, {}).values():   # a step passed for every method
                state.tick()
        if all(a is None for a in acceptances):
            return Choice(0, (0,) * len(rids), "backoff" if backoff else "no_draft")
        if self.costs.estimate(("step", bucket, 0)) is None:   # nothing measured: measure it
            return Choice(self.max_k, tuple(0 if a is None else self.max_k for a in acceptances),
                          "explore")
        # every drafting sequence by its method, or the ngram ones alone (a model proposer
        # costs more to draft with and may not pay where prompt lookup does), or each
        # ngram-matched row by whichever of the lookup and the model drafts it better:
        # where a batch's verify step is dear, a row is better off drafting than riding
        # along with its one token (a lookup that backs off, or is mostly rejected), and
        # the head's drafts for a matched row are often as good as the lookup's
        ngram = [a if m == "ngram" else None for a, m in zip(acceptances, methods)]
        options: list[tuple[str, list, tuple | None]] = []
        if any(a is not None and m != "ngram" for a, m in zip(acceptances, methods)):
            options.append(("model", acceptances, None))
        if any(a is not None for a in ngram):
            options.append(("ngram", ngram, None))
            if model is not None:
                picks = [self._better(rid, m, model) for rid, m in zip(rids, methods)]
                better = tuple(m for m, _ in picks)
                if better != tuple(methods):
                    options.append(("model", [a for _, a in picks], better))
        best = None
        for kind, acc, drafters in options:
            ms = {k: self.step_ms(bucket, k, kind) for k in range(self.max_k + 1)}
            c = choose_k(ms, acc, self.max_k, SPECULATE_MARGIN, ROW_FLOOR)
            if best is None or c.tokens_per_ms > best.tokens_per_ms * (1 + 1e-9):
                best = c if drafters is None or c.k == 0 else replace(c, methods=drafters)
        n = self.choices[bucket] = self.choices.get(bucket, 0) + 1
        if n % EXPLORE_EVERY == 0:
            # re-measure the least fresh neighbour of the best k: costs drift with the
            # machine's load, and a cell the estimate keeps too dear would never be chosen
            # again; a neighbour, because a far k (3 drafts each at batch 16) costs a step
            # several plain ones' worth
            k = min((k for k in (best.k - 1, best.k + 1) if 0 <= k <= self.max_k),
                    key=lambda k: self.costs.seen.get(("step", bucket, k), -1))
            return Choice(k, tuple(0 if a is None else k for a in acceptances), "explore")
        self.plain_streak[bucket] = self.plain_streak.get(bucket, 0) + 1 if best.k == 0 else 0
        return best

    def describe(self, bucket: int) -> str:
        """The estimates a choice at ``bucket`` is made from, for the log."""
        fmt = lambda v: "-" if v is None else f"{v:.2f}"
        cells = [f"k={k}: {fmt(self.step_ms(bucket, k, 'model'))}/{fmt(self.step_ms(bucket, k, 'ngram'))}"
                 for k in range(self.max_k + 1)]
        priors = {m: [round(r, 2) for r in a.rates] for m, a in self.methods.items()}
        return (f"bucket {bucket}: ms per step (model/ngram drafting) {', '.join(cells)}; "
                f"gap {fmt(self.costs.estimate(('gap', bucket, 0)))}; acceptance by method {priors}")

    def seed_step(self, bucket: int, k: int, ms: float) -> None:
        """A start-up measurement of the target's step at (``bucket``, ``k``)."""
        self.costs.seed(("step", bucket, k), ms)

    def observe_step(self, bucket: int, k: int, ms: float) -> None:
        """The target's side of a step that verified ``k`` drafts (0: a plain step)."""
        self.observe_cost(("step", bucket, k), ms)

    def observe_propose(self, bucket: int, k: int, kind: str, ms: float) -> None:
        """Drafting ``k`` tokens per row, by ``kind`` ("model" or "ngram")."""
        self.observe_cost(("propose", bucket, k, kind), ms)

    def observe_gap(self, bucket: int, ms: float) -> None:
        """The time from one step's end to the next one's start: what the engine's caller
        (a server streaming each step's outputs) spends per step, whatever k was."""
        self.observe_cost(("gap", bucket, 0), ms)

    def observe_cost(self, key: tuple, ms: float) -> None:
        self.costs.observe(key, ms)

    def observe_accepted(self, rid: str, method: str, k: int, accepted: int) -> None:
        s = self._state(rid, method)
        s.update(k, accepted)
        if self.adaptive:
            s.judge(accepted)
        prior = self.methods.setdefault(method, Acceptance([PRIOR_ACCEPTANCE] * self.max_k))
        prior.update(k, accepted, alpha=ACCEPT_ALPHA / 4)

    def forget(self, rid: str) -> None:
        self.seqs.pop(rid, None)
