"""The engine on its own thread, for servers: submit from any thread, outputs by callback."""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable

from .llm_engine import EngineConfig, LLMEngine, RequestOutput
from .params import SamplingParams

log = logging.getLogger(__name__)
OutputCallback = Callable[[RequestOutput], None]


class AsyncEngine:
    """Runs :class:`LLMEngine` steps on a background thread.

    ``submit`` validates in the caller's thread (raising ``ValueError`` with the field at
    fault) and only then hands the request to the loop; ``on_output`` is called on the
    engine thread for every delta, the last one with ``finished`` set.
    """

    def __init__(self, model_dir: str, **engine_args):
        """``engine_args`` are :class:`EngineConfig`'s fields (dtype, page_size, ...)."""
        self.engine = LLMEngine(EngineConfig(str(model_dir), **engine_args))
        self._callbacks: dict[str, OutputCallback] = {}
        self._inbox: deque = deque()
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
        self._lock = threading.Lock()   # guards make_sequence's request-id counter

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def start(self) -> None:
        self._thread.start()

    def submit(self, prompt: str | list[int], params: SamplingParams,
               on_output: OutputCallback) -> str:
        with self._lock:
            seq = self.engine.make_sequence(prompt, params)
        with self._wake:
            self._inbox.append(("add", seq, on_output))
            self._wake.notify()
        return seq.request_id

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._inbox.append(("abort", request_id, None))
            self._wake.notify()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _drain_inbox(self) -> list[tuple[OutputCallback, RequestOutput]]:
        aborted = []
        with self._wake:
            while not self._inbox and not self.engine.has_unfinished() and not self._stopped:
                self._wake.wait()
            items = list(self._inbox)
            self._inbox.clear()
        for kind, obj, cb in items:
            if kind == "add":
                self._callbacks[obj.request_id] = cb
                self.engine.add(obj)
            else:
                out = self.engine.abort(obj)
                if out is not None:
                    aborted.append((self._callbacks.pop(obj), out))
        return aborted

    def _loop(self) -> None:
        while True:
            deliveries = self._drain_inbox()
            if self._stopped:
                for rid in list(self.engine.seqs):
                    deliveries.append((self._callbacks.pop(rid), self.engine.abort(rid)))
                self._deliver(deliveries)
                return
            try:
                outputs = self.engine.step()
            except Exception:
                log.exception("engine step failed; aborting the running requests")
                outputs = [self.engine.abort(rid) for rid in list(self.engine.seqs)]
                for o in outputs:
                    o.finish_reason = "error"
            for out in outputs:
                cb = self._callbacks.pop(out.request_id) if out.finished \
                    else self._callbacks[out.request_id]
                deliveries.append((cb, out))
            self._deliver(deliveries)

    @staticmethod
    def _deliver(deliveries) -> None:
        for cb, out in deliveries:
            try:
                cb(out)
            except Exception:
                log.exception("output callback failed for %s", out.request_id)
