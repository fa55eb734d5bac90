"""The engine on its own thread, for servers: submit from any thread, outputs by callback."""
from __future__ import annotations

import logging
import threading
from typing import Callable

from ..lora.request import LoRARequest
from ..speculative.metrics import SpecDecodeMetrics
from .config import EngineConfig
from .inbox import Inbox
from .isolation import describe
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .prefix_caching import CachedPageChanged
from .messages import Abort, AddRemote, AddRequest, EngineMessage, OutputCallback
from .params import SamplingParams
from .remote_prefill import RECOMPUTE, KVTicket, PendingPrefills
from .scheduler import Scheduler

log = logging.getLogger(__name__)
FatalCallback = Callable[[BaseException], None]


class AsyncEngine:
    """Runs :class:`LLMEngine` steps on a background thread.

    ``submit`` validates in the caller's thread (raising ``ValueError`` with the field at
    fault) and only then hands the request to the loop; ``on_output`` is called on the
    engine thread for every delta, the last one with ``finished`` set.

    The thread never dies silently: if the loop itself fails (not one request, which
    ends alone), every open request ends with an UNAVAILABLE error, ``alive`` turns
    False and ``on_fatal(exc)`` is called, so the server can report the model not ready.
    """

    def __init__(self, model_dir: str, kv_pool=None, allocator=None, proposer_kv_pool=None,
                 on_fatal: FatalCallback | None = None, kv_load_failure_policy: str = RECOMPUTE,
                 rank_kv_pools=None, **engine_args):
        """``engine_args`` are :class:`EngineConfig`'s fields (dtype, page_size, ...);
        ``kv_pool``, ``allocator`` (and ``proposer_kv_pool`` with speculation) put the KV
        on an external (shared) pool, ``rank_kv_pools`` each tensor-parallel rank's
        share of it; ``kv_load_failure_policy``: what a request whose transfer failed
        gets (:mod:`.remote_prefill`)."""
        self.engine = LLMEngine(EngineConfig(str(model_dir), **engine_args), kv_pool, allocator,
                                proposer_kv_pool, rank_kv_pools)
        self.on_fatal = on_fatal
        self.failure: BaseException | None = None   # why the loop stopped, if it failed
        # waiting for their KV (disaggregated prefill)
        self._pending = PendingPrefills(kv_load_failure_policy)
        self._callbacks: dict[str, OutputCallback] = {}
        self._inbox: Inbox[EngineMessage] = Inbox()
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
        self._lock = threading.Lock()   # guards make_sequence's request-id counter
        # called on the engine thread before and after every step (the decode model
        # publishes its load and sets its threads there); it must not raise
        self.step_hook: Callable[[], None] | None = None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # -- narrow views for the server (metrics, step hooks), so it need not reach inside
    @property
    def scheduler(self) -> Scheduler:
        """The engine's waiting and running queues; read them on the engine thread only
        (a :attr:`step_hook` does)."""
        return self.engine.scheduler

    @property
    def spec_metrics(self) -> SpecDecodeMetrics | None:
        """Acceptance counters since start; None when the engine does not speculate."""
        return self.engine.spec_metrics if self.engine.proposer is not None else None

    @property
    def prefix_cache(self):
        """The prefix cache's counters (a ``PrefixCacheStats``); None when it is off."""
        from .prefix_caching import PrefixCacheStats
        prefix = self.engine.prefix
        return None if prefix is None else PrefixCacheStats.of(prefix)

    @property
    def lora(self):
        """The LoRA adapter pool's counters (a ``LoRAStats``); None when LoRA is off."""
        pool = self.engine.lora_pool
        return None if pool is None else pool.stats()

    @property
    def allocator(self):
        """The engine's KV allocator (a transfer ticket hands claimed pages to it)."""
        return self.engine.allocator

    @property
    def kv_pages(self) -> tuple[int, int]:
        """(free, used) pages of the engine's KV allocator."""
        allocator = self.engine.allocator
        return allocator.num_free, allocator.num_used

    @property
    def transfer_failures(self) -> dict[str, int]:
        """Requests whose prompt KV never arrived, by reason code, since start."""
        return dict(self._pending.failures)

    @property
    def transfer_recomputes(self) -> int:
        """Of those, the requests this engine prefilled itself (the ``recompute`` policy)."""
        return self._pending.recomputed

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The engine thread runs (or has not started yet) and has not failed."""
        return self.failure is None and (self._thread.is_alive() or self._thread.ident is None)

    def submit(self, prompt: str | list[int], params: SamplingParams,
               on_output: OutputCallback, lora: LoRARequest | None = None) -> str:
        """Queue a request (``lora``: its adapter; a full adapter pool or an adapter that
        does not load fails it alone, through ``on_output``)."""
        self._check_alive()
        with self._lock:
            seq = self.engine.make_sequence(prompt, params, lora=lora)
        self._inbox.post(AddRequest(seq, on_output))
        return seq.request_id

    def submit_prefilled(self, prompt: str | list[int], params: SamplingParams,
                         ticket: KVTicket, on_output: OutputCallback,
                         lora: LoRARequest | None = None) -> str:
        """Like :meth:`submit`, for a request whose prompt KV (all but the last token)
        another process computes: the request is admitted when ``ticket.poll()`` hands
        over the pages; until then it holds no slot and stalls no other sequence."""
        self._check_alive()
        with self._lock:
            seq = self.engine.make_sequence(prompt, params, lora=lora)
        self._inbox.post(AddRemote(seq, ticket, on_output))
        return seq.request_id

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise EngineStopped(f"the engine stopped ({describe(self.failure)}); the model "
                                "is restarting, retry later")

    def abort(self, request_id: str) -> None:
        self._inbox.post(Abort(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._inbox.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.engine.close()

    def _drain_inbox(self) -> list[tuple[OutputCallback, RequestOutput]]:
        ended = []
        # with transfers pending, poll their counters gently
        items = self._inbox.take(self.engine.has_unfinished,
                                 self._pending.poll_s if self._pending else None)
        for msg in items:
            try:
                ended += self._handle(msg)
            except Exception as exc:   # one request's message: it alone fails
                rid = msg.request_id
                log.exception("request %s: %s failed", rid, type(msg).__name__)
                cb = self._callbacks.pop(rid, None if isinstance(msg, Abort) else msg.on_output)
                if cb is not None:
                    ended.append((cb, _failed(rid, f"the request could not be queued ({describe(exc)})")))
        for seq, pages, num_cached in self._pending.ready():
            try:
                self.engine.add_prefilled(seq, pages, num_cached)
            except CachedPageChanged as exc:   # its pages are given back: compute it here
                log.warning("%s", exc)
                self._pending.recompute(seq)
            except ValueError:
                log.exception("request %s: the transferred KV cannot be admitted", seq.request_id)
                self.engine.allocator.free(pages)
                out = RequestOutput(seq.request_id, [], "", True, "error", len(seq.prompt_ids), 0,
                                    "the transferred KV could not be admitted (see the server log)")
                ended.append((self._callbacks.pop(seq.request_id), out))
        for out in self._pending.take_failed():
            ended.append((self._callbacks.pop(out.request_id), out))
        for seq in self._pending.take_recompute():
            try:
                self.engine.add(seq)
            except ValueError as exc:
                log.exception("request %s: its prompt cannot be prefilled here", seq.request_id)
                ended.append((self._callbacks.pop(seq.request_id),
                              _failed(seq.request_id, f"its KV transfer failed and its prompt could "
                                      f"not be prefilled here ({describe(exc)}); retry", "UNAVAILABLE")))
        return ended

    def _handle(self, msg: EngineMessage) -> list[tuple[OutputCallback, RequestOutput]]:
        match msg:
            case AddRequest(seq, on_output):
                self._callbacks[seq.request_id] = on_output
                self.engine.add(seq)
            case AddRemote(seq, ticket, on_output):
                self._callbacks[seq.request_id] = on_output
                self._pending.add(seq, ticket)
            case Abort(rid):
                out = self._pending.cancel(rid) or self.engine.abort(rid)
                if out is not None:
                    return [(self._callbacks.pop(rid), out)]
        return []

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as exc:   # the loop itself, not one request: stop, loudly
            self.failure = exc
            log.critical("the engine thread stopped", exc_info=exc)
            why = f"the engine stopped ({describe(exc)}); the model is restarting, retry later"
            ended = [(cb, _failed(rid, why, "UNAVAILABLE")) for rid, cb in self._callbacks.items()]
            self._callbacks.clear()
            self._deliver(ended)
            if self.on_fatal is not None:
                self.on_fatal(exc)

    def _run(self) -> None:
        while True:
            deliveries = self._drain_inbox()
            if self._inbox.stopped:
                for rid in self._pending.request_ids():
                    deliveries.append((self._callbacks.pop(rid), self._pending.cancel(rid)))
                for rid in list(self.engine.seqs):
                    deliveries.append((self._callbacks.pop(rid), self.engine.abort(rid)))
                self._deliver(deliveries)
                return
            self._deliver(deliveries)
            self._run_step_hook()
            # one request's failure ends that request inside step(); an exception out
            # of it is the step itself (scheduling, pages): the loop stops (see _loop)
            outputs = self.engine.step()
            self._run_step_hook()
            self._deliver([(self._callbacks.pop(out.request_id) if out.finished
                            else self._callbacks[out.request_id], out) for out in outputs])

    def _run_step_hook(self) -> None:
        if self.step_hook is not None:
            try:
                self.step_hook()
            except Exception:
                log.exception("the engine's step hook failed")

    @staticmethod
    def _deliver(deliveries) -> None:
        for cb, out in deliveries:
            try:
                cb(out)
            except Exception:
                log.exception("output callback failed for %s", out.request_id)


class EngineStopped(RuntimeError):
    """The engine thread failed; nothing more is accepted until the model restarts."""


def _failed(request_id: str, error: str, code: str | None = None) -> RequestOutput:
    return RequestOutput(request_id, [], "", True, "error", 0, 0, error, code)
