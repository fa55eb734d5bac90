"""The prefill side: a :class:`PrefillEngine` on its own thread, streaming each
request's KV into the pages a decoder reserved.

Per request: ``submit(descriptor, prompt_ids, on_done)``. The engine prefills
``prompt_ids[:-1]`` in chunks; the messenger (:class:`tandem.rdma.KVSender`) begins
the transfer when pages are allocated, is told of every forward before it runs and
of every layer as it completes, gets the last token's hidden state as the context
blob, and reports completion on its own thread — which only queues the page release
onto the engine thread (the allocator is not thread-safe). ``on_done(error)`` runs
when every send completed (``None``) or the transfer failed (a message).

A descriptor is held against this prefill's own pools in :meth:`PrefillService.submit`
(the caller's thread): a forged or mismatched one is refused there, alone, before any
plan is built. A transfer the decode side ends — the request was cancelled, its
reservation timed out or was refused — aborts that request's prefill: nothing is
computed for nobody.

With the engine's prefix cache, a request's first pages may come from the cache: no
forward computes them, so the messenger is told at admission that their KV is final
(every layer of every model). Pages the decoder already holds (``desc.first_page``: its
own cache had them) are computed here if not cached — later tokens attend to them —
but never sent. A request that fails, or whose transfer fails, leaves nothing it alone
published in the cache.

>>> svc = PrefillService(EngineConfig("checkpoints/demo/target"))   # doctest: +SKIP
>>> svc.start(); svc.submit(desc, prompt_ids, on_done=print)         # doctest: +SKIP
"""
from __future__ import annotations

import functools
import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Callable

from tandem.rdma import DestinationDescriptor, KVSender, SenderConfig, Transfer

from ..engine.inbox import Inbox
from ..engine.config import EngineConfig
from ..engine.prefill_engine import PrefillEngine, PrefillHooks, PrefillRequest
from ..lora.request import LoRARequest
from .kv_views import source_pool
from .pool import TARGET

log = logging.getLogger(__name__)
DoneCallback = Callable[[str | None], None]


class PrefillClosing(RuntimeError):
    """The service is shutting down and takes no new job."""


# -- what other threads tell the engine thread --------------------------------------------
@dataclass(frozen=True, slots=True)
class AddJob:
    """Prefill ``prompt_ids[:-1]`` into ``desc``'s reservation; ``on_done`` ends it."""
    request_id: str
    desc: DestinationDescriptor
    prompt_ids: list[int]
    on_done: DoneCallback
    cache_salt: str | None = None
    lora: LoRARequest | None = None


@dataclass(frozen=True, slots=True)
class FailJob:
    """The job cannot go on (its transfer could not start): abort it with ``error``."""
    request_id: str
    error: str


@dataclass(frozen=True, slots=True)
class TransferEnded:
    """The messenger finished the job's transfer (completed, or failed: ``transfer.error``)."""
    request_id: str
    transfer: Transfer


PrefillMessage = AddJob | FailJob | TransferEnded


class PrefillService(PrefillHooks):
    def __init__(self, config: EngineConfig, sender_config: SenderConfig | None = None):
        self.engine = PrefillEngine.from_config(config, hooks=self)
        pools = {TARGET: source_pool(TARGET, self.engine.pool)}
        if self.engine.proposer is not None:
            name = self.engine.proposer_name
            pools[name] = source_pool(name, self.engine.proposer.pool)
        self.kv_names = list(pools)
        model = self.engine.model
        # the one context blob: the last prefilled token's hidden state
        self.context_nbytes = model.config.hidden_size * model.embed_tokens.weight.element_size()
        self.sender = KVSender(pools, config=sender_config, name="prefill-messenger")
        self._faults = self.sender.config.faults
        self._jobs: dict[str, tuple[DestinationDescriptor, DoneCallback]] = {}
        self._transfers: dict[str, Transfer] = {}
        self._inbox: Inbox[PrefillMessage] = Inbox()
        self._ids = itertools.count()
        # jobs submitted whose on_done has not run: shutdown lets them finish
        self._pending = 0
        self._closing = False
        self._settled = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="tandem-prefill", daemon=True)
        # runs on the engine thread before each step (the torch threads: PrefillThreads)
        self.before_step: Callable[[], None] | None = None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0, drain_s: float = 0.0) -> None:
        """Stop; with ``drain_s``, first refuse new jobs and give the ones taken that
        long to finish their transfers (an unload, a draining server: the decoders
        reserved pages for them and wait)."""
        with self._settled:
            self._closing = True
            if not self._settled.wait_for(lambda: self._pending == 0, timeout=drain_s):
                log.warning("prefill: %d job(s) still in flight after %.0f s; they are cut",
                            self._pending, drain_s)
        self._inbox.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.sender.close()

    # -- any thread -----------------------------------------------------------------------
    def submit(self, desc: DestinationDescriptor, prompt_ids: list[int],
               on_done: DoneCallback, cache_salt: str | None = None,
               lora: LoRARequest | None = None) -> str:
        """Prefill ``prompt_ids[:-1]`` into ``desc``'s reservation; ``cache_salt``: the
        request's prefixes are cached for requests of the same salt only; ``lora``: the
        adapter its KV is computed under (the decoder's). Raises
        :class:`PrefillClosing` once :meth:`shutdown` began."""
        if len(prompt_ids) - 1 != desc.num_tokens:
            raise ValueError(f"the reservation holds {desc.num_tokens} tokens; a prompt of "
                             f"{len(prompt_ids)} tokens prefills {len(prompt_ids) - 1}")
        if [m.name for m in desc.models] != self.kv_names:
            raise ValueError(f"the reservation is for the KV of {[m.name for m in desc.models]}; "
                             f"this prefill produces {self.kv_names} (do both sides speculate "
                             f"alike?)")
        self.sender.check(desc, (self.context_nbytes,))
        with self._settled:
            if self._closing:
                raise PrefillClosing("this prefill server is shutting down; retry on another")
            self._pending += 1
        rid = f"prefill-{next(self._ids)}"
        job = AddJob(rid, desc, list(prompt_ids), functools.partial(self._settle, on_done),
                     cache_salt, lora)
        delay = self._faults.prefill_delay_s() if self._faults is not None else 0.0
        if delay:
            timer = threading.Timer(delay, self._inbox.post, (job,))
            timer.daemon = True
            timer.start()
        else:
            self._inbox.post(job)
        return rid

    def _settle(self, on_done: DoneCallback, error: str | None) -> None:
        """A job's one end (every job's on_done runs exactly once)."""
        try:
            on_done(error)
        finally:
            with self._settled:
                self._pending -= 1
                self._settled.notify_all()

    # -- messenger thread -----------------------------------------------------------------
    def _transfer_done(self, rid: str, t) -> None:
        self._inbox.post(TransferEnded(rid, t))

    # -- engine thread: hooks -------------------------------------------------------------
    def on_admit(self, req: PrefillRequest) -> None:
        rid = req.request_id
        desc, _ = self._jobs[rid]
        try:
            # the decoder's cache holds the first pages: only the rest travel
            t = self.sender.begin(desc, req.pages[desc.first_page:],
                                  on_done=lambda t, rid=rid: self._transfer_done(rid, t))
            self._transfers[rid] = t
            if req.num_cached:
                self._announce_final(t, req.num_cached)
        except Exception as e:   # this request alone; it is aborted after the step
            log.exception("request %s: its KV transfer could not start", rid)
            self._inbox.post(FailJob(rid, f"the KV transfer could not start ({e})"))

    def _announce_final(self, t: Transfer, end: int) -> None:
        """Tokens up to ``end`` came from the prefix cache: their KV, of every model and
        layer, is final as if a forward had just computed it."""
        for m in t.plan.models:
            step = self.sender.step(m.name, {t: end})
            for layer in range(m.num_layers):
                step.layer_done(layer)

    def before_forward(self, chunks, model=TARGET):
        live = {self._transfers[r.request_id]: end for r, end in chunks
                if r.request_id in self._transfers}
        live = {t: end for t, end in live.items() if not t.done}   # failed ones: nothing to send
        return self.sender.step(model, live).layer_done if live else None

    def on_prefilled(self, req: PrefillRequest) -> None:
        t = self._transfers.get(req.request_id)
        if t is not None and t.plan.context_nbytes and not t.done:
            self.sender.send_context(t, [req.hidden])

    # -- engine thread: loop --------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            items = self._inbox.take(self.engine.has_work)
            if self._inbox.stopped:
                return
            for msg in items:
                match msg:
                    case AddJob(rid, desc, prompt_ids, on_done, cache_salt, lora):
                        self._add(rid, desc, prompt_ids, on_done, cache_salt, lora)
                    case FailJob(rid, error):
                        self._abort(rid, error)
                    case TransferEnded(rid, transfer):
                        self._finish(rid, transfer)
            if self.before_step is not None:
                try:
                    self.before_step()
                except Exception:
                    log.exception("the prefill's step hook failed")
            try:
                self.engine.step()
            except Exception:
                log.exception("prefill step failed")
                for rid in [r.request_id for r in (*self.engine.waiting, *self.engine.running)]:
                    self._abort(rid, "prefill failed (see the server log)")
            for rid, why in self.engine.take_failed():   # one request's failure, alone
                self._abort(rid, why)

    def _add(self, rid: str, desc, prompt_ids, on_done, cache_salt=None, lora=None) -> None:
        try:
            self.engine.add(rid, prompt_ids[:-1], last_token=prompt_ids[-1],
                            cache_salt=cache_salt, lora=lora)
        except ValueError as e:
            return _call(on_done, str(e))
        self._jobs[rid] = (desc, on_done)

    def _finish(self, rid: str, t) -> None:
        """The transfer ended: every send completed, or it failed (then the prefill,
        if still running, is pointless, and what it published leaves the cache)."""
        self._transfers.pop(rid, None)
        job = self._jobs.pop(rid, None)
        if job is None:
            return   # aborted already
        if t.error is None and rid in self.engine.finished:
            self.engine.release(rid)
        else:
            self.engine.abort(rid)
        _call(job[1], None if t.error is None else str(t.error))

    def _abort(self, rid: str, message: str) -> None:
        # The transfer (if begun) can no longer complete: the decoder's reservation
        # times out. Sends already in flight may read pages freed here, but only into
        # a reservation that will never be READY.
        self._transfers.pop(rid, None)
        job = self._jobs.pop(rid, None)
        self.engine.abort(rid)
        if job is not None:
            _call(job[1], message)


def _call(cb: DoneCallback, error: str | None) -> None:
    try:
        cb(error)
    except Exception:
        log.exception("prefill on_done callback failed")
