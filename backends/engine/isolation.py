"""A failure stays with the request that caused it: run a batch; if it raises, run
each item alone and fail only those that raise alone.

>>> def run(xs):
...     if 0 in xs:
...         raise ZeroDivisionError("division by zero")
...     return [10 // x for x in xs]
>>> isolate([1, 0, 5], run, lambda x, e: f"{x}: {e}")
[10, '0: division by zero', 2]
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


def isolate(items: Sequence[T], run: Callable[[list[T]], list[R]],
            fail: Callable[[T, Exception], R]) -> list[R]:
    """``run(items)``, or when that raises, ``run([item])`` per item and
    ``fail(item, exc)`` for each item that raises alone. ``run`` must leave no trace
    when it raises (the engine commits a step's results only after its last fallible
    operation), so the retry computes the same thing again."""
    try:
        return run(list(items))
    except Exception as exc:
        if len(items) == 1:
            return [fail(items[0], exc)]
        log.warning("a batch of %d failed (%s: %s); retrying each alone", len(items),
                    type(exc).__name__, exc)
    out: list[R] = []
    for item in items:
        try:
            out.extend(run([item]))
        except Exception as exc:
            out.append(fail(item, exc))
    return out


def describe(exc: BaseException) -> str:
    """What a client is told about an exception: its type and message, one line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
