"""The argparse types of ``tandem bench``'s options: each checks its value while the
command line is parsed, so that a bad one ends the command at once (exit 2, argparse
naming the option) — before a model loads or a server starts.

>>> positive_int("8"), fraction("0.25")
(8, 0.25)
>>> positive_int("0")
Traceback (most recent call last):
...
argparse.ArgumentTypeError: must be an integer >= 1, got '0'
>>> sizes = positive_ints("1,8,16"); sizes, str(sizes)
([1, 8, 16], '1,8,16')
>>> names("colocated", "disaggregated")("colocated,bogus")
Traceback (most recent call last):
...
argparse.ArgumentTypeError: 'bogus' is not one of colocated, disaggregated (in 'colocated,bogus')
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Callable

ArgumentTypeError = argparse.ArgumentTypeError


def model_path(text: str):
    """A model option: an HF checkpoint directory as given, ``demo`` (the demo target), or
    what the server's ``--model`` also takes — a ``.gguf`` file or a packaged model's name
    (``smollm2-135m-instruct``) — as its converted HF directory (converted once, cached).

    >>> model_path("demo").parts[-2:]
    ('demo', 'target')
    """
    from pathlib import Path

    from tandem.client.paths import DEMO_CHECKPOINTS
    if text == "demo":
        return DEMO_CHECKPOINTS / "target"
    from tandem.backends.models.model_path import resolve_model_path
    try:
        return Path(resolve_model_path(text))
    except (FileNotFoundError, ValueError) as exc:
        raise ArgumentTypeError(str(exc)) from None


class CommaList(list):
    """A list that prints as it was written (``1,8,16``): the report's command line
    (``bench_report.command``) then reproduces the run."""

    def __str__(self) -> str:
        return ",".join(map(str, self))


class Bounded:
    """An int or float type with a lower bound (and an upper one); NaN and infinity are
    refused, being no count, rate or duration."""

    def __init__(self, kind: type, low: float, high: float | None = None, low_open: bool = False):
        self.kind, self.low, self.high, self.low_open = kind, low, high, low_open
        self.__name__ = kind.__name__       # argparse's fallback message names the type

    @property
    def what(self) -> str:
        noun = "an integer" if self.kind is int else "a number"
        if self.high is not None:
            return f"{noun} in [{self.low:g}, {self.high:g}]"
        return f"{noun} {'>' if self.low_open else '>='} {self.low:g}"

    def __call__(self, text: str):
        try:
            value = self.kind(text)
        except (TypeError, ValueError):
            raise ArgumentTypeError(f"must be {self.what}, got {text!r}") from None
        too_low = value <= self.low if self.low_open else value < self.low
        if (not math.isfinite(value) or too_low
                or (self.high is not None and value > self.high)):
            raise ArgumentTypeError(f"must be {self.what}, got {text!r}")
        return value


positive_int = Bounded(int, 1)
non_negative_int = Bounded(int, 0)
positive_float = Bounded(float, 0.0, low_open=True)
non_negative_float = Bounded(float, 0.0)
fraction = Bounded(float, 0.0, 1.0)


def at_least(low: int) -> Bounded:
    """An integer type with the lower bound ``low``."""
    return Bounded(int, low)


def comma_list(item: Callable, allow_empty: bool = False) -> Callable[[str], CommaList]:
    """A type for comma-separated values, each checked by ``item``, none listed twice
    (a repeated level or mode would be measured twice under one key)."""
    def parse(text: str) -> CommaList:
        parts = [x.strip() for x in text.split(",")]
        if parts == [""]:
            if allow_empty:
                return CommaList()
            raise ArgumentTypeError("must list at least one value (comma-separated)")
        values = CommaList()
        for part in parts:
            try:
                value = item(part)
            except ArgumentTypeError as exc:
                where = f" (in {text!r})" if len(parts) > 1 else ""
                raise ArgumentTypeError(f"{exc}{where}") from None
            if value in values:
                raise ArgumentTypeError(f"{part!r} is listed twice in {text!r}")
            values.append(value)
        return values
    parse.__name__ = f"comma-separated {getattr(item, '__name__', 'value')}s"
    return parse


positive_ints = comma_list(positive_int)
non_negative_floats = comma_list(non_negative_float)


def names(*allowed: str) -> Callable[[str], CommaList]:
    """A type for a comma-separated choice of ``allowed`` names (``--modes``, ``--targets``)."""
    def name(text: str) -> str:
        if text not in allowed:
            raise ArgumentTypeError(f"{text!r} is not one of {', '.join(allowed)}")
        return text
    name.__name__ = "name"
    return comma_list(name)


def token_range(text: str) -> CommaList:
    """``LO,HI``: two token counts, 1 <= LO <= HI.

    >>> token_range("1024,2048")
    [1024, 2048]
    """
    parts = text.split(",")
    if len(parts) != 2:
        raise ArgumentTypeError(f"must be LO,HI (two token counts), got {text!r}")
    lo, hi = (positive_int(x.strip()) for x in parts)
    if lo > hi:
        raise ArgumentTypeError(f"LO must not exceed HI, got {text!r}")
    return CommaList((lo, hi))


def cpu_list(text: str) -> CommaList:
    """Comma-separated CPU numbers this process may run on ('' for no pinning)."""
    usable = sorted(os.sched_getaffinity(0))
    cpus = comma_list(non_negative_int, allow_empty=True)(text)
    bad = [c for c in cpus if c not in usable]
    if bad:
        raise ArgumentTypeError(f"CPU {bad[0]} is not one this process may run on "
                                f"(allowed: {_ranges(usable)})")
    return cpus


def _ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2,5'`` (a big machine's CPU list in a line)."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def core_count(text: str) -> int:
    """A number of cores, 1 up to this machine's."""
    return Bounded(int, 1, os.cpu_count() or 1)(text)


def add_dtype(parser: argparse.ArgumentParser) -> None:
    """``--dtype``, ``auto`` by default as everywhere (bf16 only on a CPU with native bf16;
    models/dtype.py): parsed to the dtype that runs, which the report then records."""
    from tandem.backends.models.config import DTYPE_CHOICES
    from tandem.backends.models.dtype import resolve_dtype

    def dtype(value: str) -> str:
        if value not in DTYPE_CHOICES:
            raise ArgumentTypeError(f"{value!r}; allowed: {', '.join(DTYPE_CHOICES)}")
        return resolve_dtype(value).dtype

    parser.add_argument("--dtype", type=dtype, default="auto",
                        help="weights' dtype (default: auto = bfloat16 where the CPU computes it natively, "
                             "else float32)")
