"""Repeated, interleaved measurements and the medians and ratios reported from them.

A shared, noisy host swings single runs by 2x, so the serving benchmarks measure every
point several times, the modes interleaved (A, B, C, A, B, C, ...), and report the
median with its spread (min..max). A ratio (conditional over the better of the other
two modes) is taken per repeat, from measurements made side by side, then its median.

>>> s = spread([3.0, 1.0, 2.0]); (s["median"], s["min"], s["max"])
(2.0, 1.0, 3.0)
>>> r = ratio_to_best({"conditional": [10, 9, 12], "colocated": [10, 10, 10],
...                    "disaggregated": [8, 12, 6]}, higher_is_better=True)
>>> r["median"], r["runs"]
(1.0, [1.0, 0.75, 1.2])
"""
from __future__ import annotations

import statistics
from typing import Callable

TARGET, OTHERS = "conditional", ("colocated", "disaggregated")


def interleaved(points: list, modes: list[str], repeats: int,
                measure: Callable[[str, object, int], dict]) -> dict[str, dict[object, list[dict]]]:
    """``measure(mode, point, repeat)`` for every point, ``repeats`` times, the modes
    taking turns: ``{mode: {point: [result per repeat]}}``."""
    out: dict[str, dict[object, list[dict]]] = {m: {p: [] for p in points} for m in modes}
    for point in points:
        for rep in range(repeats):
            for mode in modes:
                out[mode][point].append(measure(mode, point, rep))
    return out


def spread(values: list[float | None]) -> dict:
    """Median, min and max of the values that exist (None when none does)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "runs": list(values)}
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3),
            "max": round(max(xs), 3), "runs": list(values)}


def ratio(mine: list[dict], theirs: list[dict], key: str) -> dict:
    """Per repeat, ``mine[key] / theirs[key]``; their spread.

    >>> ratio([{"x": 3.0}, {"x": 2.0}], [{"x": 2.0}, {"x": None}], "x")["runs"]
    [1.5, None]
    """
    return spread([round(a[key] / b[key], 3) if a.get(key) and b.get(key) else None
                   for a, b in zip(mine, theirs)])


def summarize_runs(runs: list[dict], keys: list[str]) -> dict:
    """Per key, the :func:`spread` of that key over the repeats."""
    return {k: spread([r.get(k) for r in runs]) for k in keys}


def ratio_to_best(runs: dict[str, list[float | None]], higher_is_better: bool,
                  target: str = TARGET, others: tuple[str, ...] = OTHERS) -> dict:
    """Per repeat, ``target``'s value over the better of ``others``' values of the same
    repeat; the :func:`spread` of those ratios."""
    ratios = []
    for i, value in enumerate(runs[target]):
        theirs = [runs[m][i] for m in others if m in runs and runs[m][i] is not None]
        if value is None or not theirs:
            ratios.append(None)
            continue
        best = max(theirs) if higher_is_better else min(theirs)
        ratios.append(round(value / best, 3) if best else None)
    return spread(ratios)


def ratios_to_best(runs: dict, points: list) -> dict:
    """Per point of a sweep (``runs[mode][point]``: its repeats' results), ``target``
    over the better of ``others`` in output and per-request decode tok/s and ITL p99;
    empty unless every mode ran."""
    if not {TARGET, *OTHERS} <= set(runs):
        return {}
    out = {}
    for p in points:
        def of(key):
            return {m: [x[key] for x in runs[m][p]] for m in runs}
        out[str(p)] = {"output_tok_s": ratio_to_best(of("output_tok_s"), True),
                       "decode_tok_s": ratio_to_best(of("decode_tok_s_median"), True),
                       "itl_ms_p99": ratio_to_best(of("itl_ms_p99"), False)}
    return out


def error_bars(stats: list[dict]) -> tuple[list[float], list[list[float]]]:
    """Medians and matplotlib's ``yerr`` (below, above) of :func:`spread` results;
    NaN where a point has no value.

    >>> error_bars([{"median": 2.0, "min": 1.5, "max": 3.0}, {"median": None}])
    ([2.0, nan], [[0.5, nan], [1.0, nan]])
    """
    nan = float("nan")
    med = [nan if s.get("median") is None else s["median"] for s in stats]
    lo = [nan if s.get("median") is None else s["median"] - s["min"] for s in stats]
    hi = [nan if s.get("median") is None else s["max"] - s["median"] for s in stats]
    return med, [lo, hi]


def fmt(s: dict, digits: int = 1) -> str:
    """``median (min–max)`` for a table cell.

    >>> fmt({"median": 2.0, "min": 1.5, "max": 3.25})
    '2.0 (1.5–3.2)'
    """
    if s.get("median") is None:
        return "–"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def ratios_table(ratios: dict, point: str) -> list[str]:
    """The markdown rows of :func:`ratios_to_best`'s result, ``point`` naming its first
    column (``concurrency``, ``long prompts/s``)."""
    if not ratios:
        return []
    lines = ["", f"| {point} | conditional / better: output tok/s | decode tok/s | ITL p99 |",
             "|---:|---:|---:|---:|"]
    for at, x in ratios.items():
        lines.append(f"| {at} | {fmt(x['output_tok_s'], 3)} | {fmt(x['decode_tok_s'], 3)} | "
                     f"{fmt(x['itl_ms_p99'], 3)} |")
    return lines
