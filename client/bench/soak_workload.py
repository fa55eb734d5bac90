"""The soak benchmark's workload and verdicts, without a server.

A soak sends ``N`` requests at concurrency ``C`` through the ensemble. Each request is
drawn from a seeded plan: a prompt from a fixed pool, greedy or sampled, a fraction
with extreme sampling values, a fraction cancelled after a random number of
responses. Every request ends in one :class:`Outcome`; :func:`summarize` counts them
and checks what a server under faults must hold to: nothing hung, every failure
with a clear reason, every completed greedy text exact.

>>> plan = make_plan(200, prompts=["a", "b"], cancel_frac=0.25, extreme_frac=0.1, seed=1)
>>> len(plan), sum(p.cancel_after is not None for p in plan) in range(30, 70)
(200, True)
>>> plan == make_plan(200, prompts=["a", "b"], cancel_frac=0.25, extreme_frac=0.1, seed=1)
True
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import asdict, dataclass, field

# values a client may legally send that stress the sampler: a subnormal and a huge
# temperature, a top_p that keeps one token, top_k 1
EXTREME_SAMPLING = (
    {"temperature": 1e-45},
    {"temperature": 1e30},
    {"temperature": 1.0, "top_p": 1e-9},
    {"temperature": 5.0, "top_k": 1},
    {"temperature": 0.7, "top_p": 1.0, "top_k": 0},
)
# what a failure message must not be: empty, a traceback, or a cause-less "internal error"
UNCLEAR = ("traceback (most recent call last)", "internal error: none")


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    index: int
    prompt: str
    max_tokens: int
    sampling: dict                  # temperature, top_p, top_k, seed (the request's inputs)
    kind: str                       # "greedy" | "sampled" | "extreme"
    cancel_after: int | None        # responses received before the client cancels

    @property
    def greedy(self) -> bool:
        return self.kind == "greedy"


def make_plan(n: int, prompts: list[str], cancel_frac: float, extreme_frac: float,
              seed: int, sampled_frac: float = 0.2, max_tokens: tuple[int, int] = (8, 32),
              prefixes: list[str] = (), prefix_frac: float = 0.0) -> list[PlannedRequest]:
    """``n`` requests, reproducible from ``seed``; ``prefix_frac`` of them start with one
    of ``prefixes`` (shared preambles: later requests hit the prefix cache).

    >>> p = make_plan(100, ["x"], 0, 0, seed=2, prefixes=["A:", "B:"], prefix_frac=0.5)
    >>> sorted({r.prompt for r in p})
    ['A:x', 'B:x', 'x']
    """
    rng = random.Random(seed)
    plan = []
    for i in range(n):
        r = rng.random()
        if r < extreme_frac:
            kind, sampling = "extreme", dict(rng.choice(EXTREME_SAMPLING), seed=rng.randrange(1 << 31))
        elif r < extreme_frac + sampled_frac:
            kind, sampling = "sampled", {"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(1 << 31)}
        else:
            kind, sampling = "greedy", {"temperature": 0.0}
        tokens = rng.randint(*max_tokens)
        cancel = rng.randint(0, tokens - 1) if rng.random() < cancel_frac else None
        prompt = rng.choice(prompts)
        if prefixes and rng.random() < prefix_frac:
            prompt = rng.choice(prefixes) + prompt
        plan.append(PlannedRequest(i, prompt, tokens, sampling, kind, cancel))
    return plan


@dataclass(slots=True)
class Outcome:
    """How one request ended, seen by its client."""
    index: int
    kind: str
    status: str                     # "ok" | "failed" | "cancelled" | "hung"
    started_at: float
    ended_at: float
    text: str = ""
    finish_reason: str = ""
    error: str | None = None
    exact: bool | None = None       # greedy and ok: equal to the engine's own text
    cached_tokens: int = 0          # prompt tokens the prefix cache served (the server says)

    @property
    def clear(self) -> bool:
        """A failure's message names its cause."""
        msg = (self.error or "").strip().lower()
        return bool(msg) and not any(u in msg for u in UNCLEAR)


@dataclass(slots=True)
class SoakSummary:
    requests: int
    by_status: dict[str, int]
    hung: int
    failed: int
    failed_unclear: int
    greedy_checked: int
    greedy_inexact: int
    errors: dict[str, int] = field(default_factory=dict)   # message -> count (the 20 commonest)

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def goals_met(self) -> bool:
        return self.hung == 0 and self.failed_unclear == 0 and self.greedy_inexact == 0


def summarize(outcomes: list[Outcome]) -> SoakSummary:
    """Counts by status, and the three verdicts: hung, unclear failures, inexact greedy.

    >>> s = summarize([Outcome(0, "greedy", "ok", 0, 1, exact=True),
    ...                Outcome(1, "greedy", "failed", 0, 1, error="internal error: none"),
    ...                Outcome(2, "extreme", "failed", 0, 1, error="unavailable: the decode KV pool is full")])
    >>> (s.failed, s.failed_unclear, s.greedy_checked, s.greedy_inexact, s.goals_met)
    (2, 1, 1, 0, False)
    """
    status = Counter(o.status for o in outcomes)
    failed = [o for o in outcomes if o.status == "failed"]
    checked = [o for o in outcomes if o.exact is not None]
    messages = Counter(_shape(o.error or "") for o in failed)
    return SoakSummary(
        requests=len(outcomes), by_status=dict(status), hung=status.get("hung", 0),
        failed=len(failed), failed_unclear=sum(not o.clear for o in failed),
        greedy_checked=len(checked), greedy_inexact=sum(not o.exact for o in checked),
        errors=dict(messages.most_common(20)))


def _shape(message: str) -> str:
    """A message with its numbers blanked, so that alike failures count together."""
    import re
    return re.sub(r"\d+", "N", message.strip())[:200]


def timeline(outcomes: list[Outcome], start: float, bin_s: float) -> dict[str, list[int]]:
    """Requests ending in each ``bin_s`` window after ``start``, by status.

    >>> timeline([Outcome(0, "greedy", "ok", 0, 1.5), Outcome(1, "greedy", "failed", 0, 3.1)], 0, 2)
    {'ok': [1, 0], 'failed': [0, 1], 'cancelled': [0, 0], 'hung': [0, 0]}
    """
    n = int(max((o.ended_at - start for o in outcomes), default=0) // bin_s) + 1
    out = {s: [0] * n for s in ("ok", "failed", "cancelled", "hung")}
    for o in outcomes:
        out[o.status][int((o.ended_at - start) // bin_s)] += 1
    return out
