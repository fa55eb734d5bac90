"""Messages from any thread to one engine thread, and the engine thread's stop flag.
The inbox does not look at what it carries: each owner posts its own message types.

>>> box = Inbox()
>>> box.post(("add", 1))
>>> box.take(busy=lambda: False)
[('add', 1)]
>>> box.stop(); box.stopped, box.take(busy=lambda: False)
(True, [])
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Inbox(Generic[T]):
    def __init__(self):
        self._items: deque[T] = deque()
        self._cv = threading.Condition()
        self.stopped = False

    def post(self, item: T) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self.stopped = True
            self._cv.notify()

    def take(self, busy: Callable[[], bool], timeout: float | None = None) -> list[T]:
        """Every message posted so far; while there is none, the engine is not ``busy()``
        and not stopped, sleep — at most ``timeout`` seconds when given (the caller has
        something to poll), else until a message or the stop."""
        with self._cv:
            while not self._items and not busy() and not self.stopped:
                if timeout is not None:
                    self._cv.wait(timeout)
                    break
                self._cv.wait()
            items = list(self._items)
            self._items.clear()
            return items
