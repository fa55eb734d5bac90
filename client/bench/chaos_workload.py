"""The chaos soak's workload, fault schedule and verdict, without a server.

The workload is what the default path serves in production, seeded and reproducible:
greedy, seeded-sampled and guided (JSON schema, regex) requests, a few with extreme
sampling values, shared system prompts and multi-turn chats (each turn's prompt extends
the previous turn's, so the prefix cache is hit), a share cancelled at a random point.
Seeded sampling is reproducible whatever the batch and the speculation
(engine/seeded_draws.py), so every completed request, not only the greedy ones, has one
right answer: the text a fault-free server with prefix caching off returns for it.

The faults fire on a schedule (:func:`parse_schedule`): ``ACTION:MODEL:SECONDS``.

>>> [str(f) for f in parse_schedule("kill:prefill:10, stop:decode:20.5,flood::30")]
['kill:prefill:10', 'stop:decode:20.5', 'flood::30']
"""
from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field

from tandem.client.bench.args import ArgumentTypeError, non_negative_float
from tandem.client.bench.soak_workload import EXTREME_SAMPLING, Outcome

# what a scheduled fault does: SIGKILL a stub (the OOM killer), SIGSTOP it and SIGCONT it
# after --stop-s (a frozen cgroup, a host that stalls), roll the model to a new version
# under load (Triton's repository API), or flood the KV pool with long prompts
ACTIONS = ("kill", "stop", "roll", "flood")
MODELS = ("prefill", "decode", "kv_transfer", "postprocess")
DEFAULT_SCHEDULE = ("kill:prefill:8,stop:prefill:18,stop:decode:28,kill:kv_transfer:38,stop:kv_transfer:50,"
                    "flood::60,roll:decode:72,kill:postprocess:86,stop:postprocess:98,roll:kv_transfer:108,"
                    "kill:decode:120")
SYSTEM_PROMPTS = [
    "You are a careful Python reviewer. Answer with code only, no prose, and keep every\n"
    "function short, typed and documented. The user pastes the start of a file.\n\n",
    "# Project conventions: four spaces, no tabs; names from the field; pure functions for\n"
    "# the maths; every error a user can cause names its field. Continue the file below.\n\n",
    "Complete the following module of a small command-line tool that reads CSV files,\n"
    "validates their columns and writes a summary report as JSON to standard output.\n\n",
]
USER_TURNS = [
    "def parse_row(row):\n    ", "class Report:\n    def __init__(self, rows):", "import csv\nimport json\n\n",
    "def validate(columns, required):\n    ", "for name, value in summary.items():\n    ",
    "def main(argv=None):\n    parser = ", "with open(path, newline='') as f:\n    ", "def mean(xs):\n    return",
]
# a chat's later turns: the previous prompt, a canned answer, the next request
FOLLOW_UPS = ["\n    return row\n\n# now handle empty files\n", "\n    pass\n\n# and write the tests\n",
              "\n    ...\n\n# add type hints to everything above\n"]
GUIDES = [
    ("json_schema", json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                                 "count": {"type": "integer"}},
                                "required": ["name", "count"]})),
    ("regex", r"(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?"),
    ("json", ""),
]


@dataclass(frozen=True, slots=True)
class ChaosRequest:
    """One planned request; ``sampling`` are the ensemble's optional inputs (build_inputs)."""
    index: int
    prompt: str
    max_tokens: int
    sampling: dict
    kind: str                       # "greedy" | "seeded" | "guided" | "extreme"
    cancel_after: int | None        # responses received before the client cancels
    chat: int | None = None         # the chat it is a turn of (None: a single request)
    turn: int = 0                   # its turn in the chat (0: the first, or a single request)

    @property
    def greedy(self) -> bool:
        return self.kind == "greedy"

    def key(self) -> str:
        """Requests with equal keys must get equal text (the reference is asked once)."""
        return json.dumps([self.prompt, self.max_tokens, sorted(self.sampling.items())])


def make_plan(n: int, seed: int, cancel_frac: float = 0.2, seeded_frac: float = 0.2,
              guided_frac: float = 0.1, extreme_frac: float = 0.02, chat_frac: float = 0.3,
              max_tokens: tuple[int, int] = (8, 32)) -> list[ChaosRequest]:
    """``n`` requests, reproducible from ``seed``. Every prompt starts with one of the
    shared system prompts; ``chat_frac`` of them are turns 2..4 of a chat whose earlier
    turns come first in the plan.

    >>> p = make_plan(400, seed=1)
    >>> len(p), p == make_plan(400, seed=1), {r.kind for r in p} == {"greedy", "seeded", "guided", "extreme"}
    (400, True, True)
    >>> later = [r for r in p if r.turn > 0]
    >>> len(later) > 40 and all(any(q.chat == r.chat and q.turn == r.turn - 1 and q.index < r.index
    ...                             and r.prompt.startswith(q.prompt) for q in p) for r in later)
    True
    """
    rng = random.Random(seed)
    plan: list[ChaosRequest] = []
    chats: dict[int, tuple[str, int]] = {}      # an open chat's last prompt and turn
    for i in range(n):
        if chats and rng.random() < chat_frac:
            chat = rng.choice(sorted(chats))
            last, turn = chats.pop(chat)
            prompt, turn = last + rng.choice(FOLLOW_UPS) + rng.choice(USER_TURNS), turn + 1
            if turn < 3:
                chats[chat] = (prompt, turn)
        else:
            chat, turn = (i if rng.random() < chat_frac else None), 0
            prompt = rng.choice(SYSTEM_PROMPTS) + rng.choice(USER_TURNS)
            if chat is not None:
                chats[chat] = (prompt, turn)
        kind, sampling = _sampling(rng, seeded_frac, guided_frac, extreme_frac)
        tokens = rng.randint(*max_tokens)
        cancel = rng.randint(0, tokens - 1) if rng.random() < cancel_frac else None
        plan.append(ChaosRequest(i, prompt, tokens, sampling, kind, cancel, chat, turn))
    return plan


def _sampling(rng: random.Random, seeded_frac: float, guided_frac: float,
              extreme_frac: float) -> tuple[str, dict]:
    r = rng.random()
    if r < extreme_frac:
        return "extreme", dict(rng.choice(EXTREME_SAMPLING), seed=rng.randrange(1 << 31))
    if r < extreme_frac + seeded_frac:
        return "seeded", {"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(1 << 31)}
    if r < extreme_frac + seeded_frac + guided_frac:
        guide_type, guide = rng.choice(GUIDES)
        sampling = {"temperature": 0.0} if rng.random() < 0.5 else \
            {"temperature": 1.0, "seed": rng.randrange(1 << 31)}
        return "guided", dict(sampling, guided_decoding_guide_type=guide_type,
                              **({"guided_decoding_guide": guide} if guide else {}))
    return "greedy", {"temperature": 0.0}


# -- the fault schedule ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ScheduledFault:
    action: str
    model: str                      # "" for flood
    at_s: float

    def __str__(self) -> str:
        return f"{self.action}:{self.model}:{self.at_s:g}"


def parse_schedule(text: str) -> list[ScheduledFault]:
    """``"kill:prefill:10,flood::30"`` -> the faults in time order.

    >>> parse_schedule("roll:nothing:3")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: 'roll:nothing:3': the model must be one of prefill, decode, kv_transfer, postprocess
    """
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        parts = item.split(":")
        if len(parts) != 3:
            raise ArgumentTypeError(f"{item!r}: must be ACTION:MODEL:SECONDS, e.g. kill:prefill:15 or flood::30")
        action, model, at = (p.strip() for p in parts)
        if action not in ACTIONS:
            raise ArgumentTypeError(f"{item!r}: the action must be one of {', '.join(ACTIONS)}")
        if (action == "flood") != (model == ""):
            raise ArgumentTypeError(f"{item!r}: flood takes no model; the other actions take one")
        if model and model not in MODELS:
            raise ArgumentTypeError(f"{item!r}: the model must be one of {', '.join(MODELS)}")
        try:
            seconds = non_negative_float(at)
        except ArgumentTypeError as exc:
            raise ArgumentTypeError(f"{item!r}: the seconds {exc}") from None
        out.append(ScheduledFault(action, model, seconds))
    return sorted(out, key=lambda f: f.at_s)


def schedule(text: str) -> str:
    """``--schedule``'s type: ``text`` as written, once it parses."""
    parse_schedule(text)
    return text


# -- the verdict -----------------------------------------------------------------------------

@dataclass(slots=True)
class FaultRecord:
    """A fault as it happened: when it began and when the server answered right again."""
    fault: str                      # e.g. "kill:prefill", "transfer_fail@mid_layers"
    began_s: float
    ended_s: float | None           # None: still unrecovered when the run ended
    misses: dict[str, int] = field(default_factory=dict)   # why probes failed meanwhile -> count


@dataclass(slots=True)
class Difference:
    """A completed response that differs from the reference: what a user would have got wrong."""
    request: int
    kind: str
    chat: int | None
    cached_tokens: int | None
    got: str
    want: str
    faults_around: list[str] = field(default_factory=list)


def differences(plan: list[ChaosRequest], outcomes: list[Outcome], reference: dict[str, str],
                faults: list[FaultRecord], cached: dict[int, int], start: float,
                margin_s: float = 5.0) -> list[Difference]:
    """Every completed request whose text is not its reference's, with the faults that
    were under way within ``margin_s`` of its lifetime (times relative to ``start``).

    >>> plan = [ChaosRequest(0, "a", 4, {}, "greedy", None), ChaosRequest(1, "b", 4, {}, "greedy", None)]
    >>> outs = [Outcome(0, "greedy", "ok", 10, 11, text="x"), Outcome(1, "greedy", "ok", 30, 31, text="y")]
    >>> ref = {plan[0].key(): "x", plan[1].key(): "z"}
    >>> d = differences(plan, outs, ref, [FaultRecord("kill:decode", 28, 35)], {1: 2}, start=0)
    >>> [(x.request, x.got, x.want, x.cached_tokens, x.faults_around) for x in d]
    [(1, 'y', 'z', 2, ['kill:decode'])]
    """
    out = []
    for o in outcomes:
        if o.status != "ok":
            continue
        req = plan[o.index]
        want = reference.get(req.key())
        if want is None or o.text == want:
            continue
        lo, hi = o.started_at - start - margin_s, o.ended_at - start + margin_s
        around = [f.fault for f in faults if f.began_s <= hi and (f.ended_s is None or f.ended_s >= lo)]
        out.append(Difference(o.index, req.kind, req.chat, cached.get(o.index), o.text, want, around))
    return out


def completed_keys(plan: list[ChaosRequest], outcomes: list[Outcome]) -> dict[str, ChaosRequest]:
    """One request per distinct key among the completed ones: what the reference replays."""
    return {plan[o.index].key(): plan[o.index] for o in outcomes if o.status == "ok"}


def kinds(plan: list[ChaosRequest], outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    """Outcomes by request kind and status."""
    out: dict[str, Counter] = {}
    for o in outcomes:
        out.setdefault(plan[o.index].kind, Counter())[o.status] += 1
    return {k: dict(v) for k, v in sorted(out.items())}
