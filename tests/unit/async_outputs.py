"""An ``AsyncEngine`` ``on_output`` callback for tests: each request's outputs, and a wait
for a number of requests to finish."""
from __future__ import annotations

import threading


class OutputCollector:
    def __init__(self):
        self.outs: dict[str, list] = {}
        self._finished = threading.Semaphore(0)

    def __call__(self, out) -> None:
        self.outs.setdefault(out.request_id, []).append(out)
        if out.finished:
            self._finished.release()

    def wait(self, requests: int, timeout: float) -> bool:
        """Whether ``requests`` more requests finished, each within ``timeout`` seconds."""
        return all(self._finished.acquire(timeout=timeout) for _ in range(requests))
