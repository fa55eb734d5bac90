"""What ``tandem bench lora`` sends, and the figures it takes from the replies.

Two phases at one concurrency: ``base`` (every request to the base model) and ``mix``
(each request's ``model`` cycles through the adapters, then the base); and a run-time
load under load: streams of the mix running while a new adapter is loaded and sent
requests, each stream's inter-token gaps around the load against their median.

>>> model_cycle(["a0", "a1"], "tandem", 5)
['a0', 'a1', 'tandem', 'a0', 'a1']
>>> phase_models("base", ["a0", "a1"], "tandem", 3)
['tandem', 'tandem', 'tandem']
"""
from __future__ import annotations

import re
import statistics

from tandem.client.bench.repeats import spread

PHASES = ("base", "mix")


def adapter_names(n: int) -> list[str]:
    """``a0``, ``a1``, ... : the adapters served from the start."""
    return [f"a{i}" for i in range(n)]


def model_cycle(adapters: list[str], base: str, n: int) -> list[str]:
    """``n`` requests' models: each adapter in turn, then the base, and again."""
    names = [*adapters, base]
    return [names[i % len(names)] for i in range(n)]


def phase_models(phase: str, adapters: list[str], base: str, n: int) -> list[str]:
    """The models of a phase's ``n`` requests (``base``: the base model alone)."""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r}; allowed: {', '.join(PHASES)}")
    return [base] * n if phase == "base" else model_cycle(adapters, base, n)


def phase_order(rep: int) -> list[str]:
    """The phases of a repeat, which goes first alternating, so that neither always
    follows the other's warm (or disturbed) server.

    >>> phase_order(0), phase_order(1)
    (['base', 'mix'], ['mix', 'base'])
    """
    return list(PHASES) if rep % 2 == 0 else list(reversed(PHASES))


def mix_over_base(runs: dict[str, list[dict]], key: str = "output_tok_s") -> dict:
    """Per repeat, the mix's ``key`` over the base's (measured side by side); their
    :func:`~.repeats.spread`.

    >>> mix_over_base({"base": [{"output_tok_s": 100.0}, {"output_tok_s": 80.0}, {"output_tok_s": 90.0}],
    ...                "mix": [{"output_tok_s": 90.0}, {"output_tok_s": 60.0}, {"output_tok_s": 81.0}]})["median"]
    0.9
    """
    return ratios(runs["mix"], runs["base"], key)


def ratios(mine: list[dict], theirs: list[dict], key: str) -> dict:
    """Per repeat, ``mine[key] / theirs[key]`` (None where either is missing); their spread."""
    return spread([round(a[key] / b[key], 3) if a.get(key) and b.get(key) else None
                   for a, b in zip(mine, theirs)])


def gaps(timeline: list[float]) -> list[tuple[float, float]]:
    """(start, end) of each gap between consecutive chunks of one stream (absolute times).

    >>> gaps([1.0, 1.5, 1.75])
    [(1.0, 1.5), (1.5, 1.75)]
    """
    return list(zip(timeline, timeline[1:]))


def worst_gap(timelines: list[list[float]], t0: float, t1: float) -> float | None:
    """The longest inter-token gap of any stream that overlaps ``[t0, t1]`` (seconds;
    None when no gap does): how long a running stream waited across that window.

    >>> worst_gap([[0.0, 1.0, 1.2, 2.0], [0.5, 0.6]], 1.1, 1.5)
    0.8
    >>> worst_gap([[0.0, 1.0]], 2.0, 3.0) is None
    True
    """
    inside = [b - a for t in timelines for a, b in gaps(t) if b > t0 and a < t1]
    return round(max(inside), 6) if inside else None


def stall(timelines: list[list[float]], t_load: float, t_done: float) -> dict:
    """What loading an adapter at ``t_load`` (its first requests done by ``t_done``) did to
    the running streams: the median inter-token gap of all of them (one step), the worst
    gap overlapping the load's window, and the worst of those that ended in an equally
    long window just before it (the same streams, nothing loaded: the control), in ms
    and in steps; and how many steps the load added to that worst gap (a new request's
    prefill stalls the streams a step anyway, with or without an adapter to load).

    >>> s = stall([[0.0, 0.1, 0.2, 0.3, 0.6, 0.7]], t_load=0.35, t_done=0.55)
    >>> s["median_itl_ms"], s["worst_gap_ms"], s["worst_gap_steps"], s["control_worst_gap_ms"]
    (100.0, 300.0, 3.0, 100.0)
    >>> s["extra_steps"]    # what the load added to the worst gap the streams saw anyway
    2.0
    """
    all_gaps = [b - a for t in timelines for a, b in gaps(t)]
    median = statistics.median(all_gaps) if all_gaps else None
    worst = worst_gap(timelines, t_load, t_done)
    # the control: gaps that ended in the window before (one that spans the load is the load's)
    before = [b - a for t in timelines for a, b in gaps(t) if t_load - (t_done - t_load) < b <= t_load]
    control = round(max(before), 6) if before else None

    def ms(x):
        return None if x is None else round(1000 * x, 2)

    def steps(x):
        return round(x / median, 2) if x is not None and median else None
    return {"median_itl_ms": ms(median), "worst_gap_ms": ms(worst), "worst_gap_steps": steps(worst),
            "control_worst_gap_ms": ms(control), "control_worst_gap_steps": steps(control),
            "extra_steps": steps(worst - control) if worst is not None and control is not None else None,
            "window_ms": ms(t_done - t_load)}


def counters(metrics_text: str, name: str) -> dict[str, float]:
    """``{model: value}`` of a counter in a Prometheus text (summed over its other labels).

    >>> counters('tandem_lora_loads_total{model="decode",version="1"} 5\\n'
    ...          'tandem_lora_loads_total{model="prefill",version="1"} 2', "tandem_lora_loads_total")
    {'decode': 5.0, 'prefill': 2.0}
    """
    out: dict[str, float] = {}
    for m in re.finditer(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", metrics_text, re.M):
        model = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))).get("model", "")
        out[model] = out.get(model, 0.0) + float(m.group(2))
    return out


def grown(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """How much each counter grew (the unchanged left out).

    >>> grown({"decode": 4.0}, {"decode": 5.0, "prefill": 1.0, "llm": 0.0})
    {'decode': 1, 'prefill': 1}
    """
    return {k: int(v - before.get(k, 0.0)) for k, v in sorted(after.items()) if v > before.get(k, 0.0)}
