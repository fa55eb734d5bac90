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

from ..parallel.group import RankFailed

from ..engine.inbox import Inbox
from ..engine.config import EngineConfig
from ..engine.prefill_engine import PrefillEngine, PrefillHooks, PrefillRequest
from ..lora.request import LoRARequest
from .kv_views import source_pool
from .pool import TARGET, shard_scheme

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
        """With ``config.tensor_parallel_size`` > 1 the engine's ranks keep their KV in
        shared memory this process maps, and one messenger per rank sends that rank's
        share of each page (the plan's pieces of its head range); the layer counter
        advances on the leader, whose all-reduces keep every rank in step."""
        self.engine = PrefillEngine.from_config(config, hooks=self)
        tp = self.tp = config.tensor_parallel_size
        model = self.engine.model
        self.scheme = shard_scheme(model.config.num_key_value_heads, tp)
        self.kv_names = [TARGET] + ([self.engine.proposer_name] if self.engine.proposer is not None else [])
        # the one context blob: the last prefilled token's hidden state
        self.context_nbytes = model.config.hidden_size * model.embed_tokens.weight.element_size()
        self.senders = []
        try:
            for rank in range(tp):
                self.senders.append(KVSender(self._source_pools(rank), rank, self.scheme, sender_config,
                                             name="prefill-messenger" + (f"-r{rank}" if tp > 1 else "")))
        except BaseException:   # (UCX could not start a worker): nothing left running
            for sender in self.senders:
                sender.close()
            self.engine.close()
            raise
        self.sender = self.senders[0]
        self._faults = self.sender.config.faults
        self._jobs: dict[str, tuple[DestinationDescriptor, DoneCallback]] = {}
        self._transfers: dict[str, list[Transfer]] = {}   # a job's transfers, by rank
        self._inbox: Inbox[PrefillMessage] = Inbox()
        self._ids = itertools.count()
        # jobs submitted whose on_done has not run: shutdown lets them finish
        self._pending = 0
        self._closing = False
        self._settled = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="tandem-prefill", daemon=True)
        # runs on the engine thread before each step (the torch threads: PrefillThreads)
        self.before_step: Callable[[], None] | None = None
        # called (on the engine thread, once) when the engine can prefill no more: a
        # tensor-parallel rank died; every job taken has ended with the cause by then
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.failure: BaseException | None = None

    def _source_pools(self, rank: int) -> dict:
        """Rank ``rank``'s KV as its messenger sends it: the target's share, and on rank 0
        the proposer's KV, whole (the proposer runs there alone)."""
        pools = {TARGET: source_pool(TARGET, self.engine.rank_pools[rank], self.scheme)}
        if self.engine.proposer is not None and rank == 0:
            pools[self.engine.proposer_name] = source_pool(self.engine.proposer_name,
                                                           self.engine.proposer.pool)
        return pools

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
        for sender in self.senders:
            sender.close()
        self.engine.close()

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
        if desc.src.tp_size != self.tp:
            raise ValueError(f"the decode side planned this transfer for a prefill of {desc.src.tp_size} "
                             f"tensor-parallel rank(s); this prefill runs {self.tp} (set the decode server's "
                             f"--prefill-tp {self.tp})")
        if [m.name for m in desc.models] != self.kv_names:
            raise ValueError(f"the reservation is for the KV of {[m.name for m in desc.models]}; "
                             f"this prefill produces {self.kv_names} (do both sides speculate "
                             f"alike?)")
        self.sender.check(desc, (self.context_nbytes,))
        with self._settled:
            if self.failure is not None:
                raise PrefillClosing(f"this prefill's engine stopped ({self.failure}); it is restarting, "
                                     "retry later")
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
            # the decoder's cache holds the first pages: only the rest travel; every rank
            # sends its share of the same page ids
            ts = self._transfers[rid] = []
            for sender in self.senders:
                ts.append(sender.begin(desc, req.pages[desc.first_page:],
                                       on_done=lambda t, rid=rid: self._transfer_done(rid, t)))
            if req.num_cached:
                for sender, t in zip(self.senders, ts):
                    self._announce_final(sender, t, req.num_cached)
        except Exception as e:   # this request alone; it is aborted after the step
            log.exception("request %s: its KV transfer could not start", rid)
            self._inbox.post(FailJob(rid, f"the KV transfer could not start ({e})"))

    @staticmethod
    def _announce_final(sender: KVSender, t: Transfer, end: int) -> None:
        """Tokens up to ``end`` came from the prefix cache: their KV, of every model and
        layer, is final as if a forward had just computed it."""
        for m in t.plan.models:
            step = sender.step(m.name, {t: end})
            for layer in range(m.num_layers):
                step.layer_done(layer)

    def before_forward(self, chunks, model=TARGET):
        steps = []
        for rank, sender in enumerate(self.senders):
            live = {self._transfers[r.request_id][rank]: end for r, end in chunks
                    if r.request_id in self._transfers}
            live = {t: end for t, end in live.items() if not t.done}   # failed ones: nothing to send
            if live:
                steps.append(sender.step(model, live).layer_done)
        if len(steps) <= 1:
            return steps[0] if steps else None
        # the leader passed the layer: its all-reduce waited for every rank's, which
        # follows that rank's KV write of the layer

        def layer_done(layer: int) -> None:
            for step in steps:
                step(layer)
        return layer_done

    def on_prefilled(self, req: PrefillRequest) -> None:
        ts = self._transfers.get(req.request_id)
        if ts is not None and ts[0].plan.context_nbytes and not ts[0].done:
            self.sender.send_context(ts[0], [req.hidden])   # rank 0's to send

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
            except RankFailed as exc:   # the engine itself: it cannot prefill until restarted
                return self._stop_failed(exc)
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
            self.sender.give_up(desc)   # the decoder need not wait for its lease
            return _call(on_done, str(e))
        self._jobs[rid] = (desc, on_done)

    def _stop_failed(self, exc: BaseException) -> None:
        """A rank died: end every job with the cause, take no more, tell the owner."""
        log.critical("the prefill engine stopped: %s", exc)
        with self._settled:
            self.failure = exc
        why = f"the prefill engine stopped ({exc})"
        for rid in list(self._jobs):
            self._abort(rid, why)
        for rid in [r.request_id for r in (*self.engine.waiting, *self.engine.running)]:
            self.engine.abort(rid)
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _finish(self, rid: str, t) -> None:
        """One of the job's transfers ended. The job ends when every rank's completed,
        or at the first that failed (then the prefill, if still running, is pointless,
        what it published leaves the cache, and the other ranks' transfers stop)."""
        ts = self._transfers.get(rid)
        if ts is None:
            return   # ended already
        error = next((x.error for x in ts if x.error is not None), None)
        if error is None and not all(x.done for x in ts):
            return   # another rank is still sending
        self._transfers.pop(rid)
        job = self._jobs.pop(rid, None)
        if error is not None:
            self._cancel(ts, f"another prefill rank's transfer failed ({error})")
        if job is None:
            return   # aborted already
        if error is None and rid in self.engine.finished:
            self.engine.release(rid)
        else:
            self.engine.abort(rid)
        _call(job[1], None if error is None else str(error))

    def _cancel(self, ts: list[Transfer], why: str) -> None:
        """Stop a job's transfers still running (each rank's messenger stops its own)."""
        for sender, t in zip(self.senders, ts):
            if not t.done:
                sender.cancel(t, why)

    def _abort(self, rid: str, message: str) -> None:
        # The transfer (if begun) can no longer complete: it is stopped, and the
        # receiver told, so the decoder recomputes (or fails) the request now. Sends
        # already in flight may read pages freed here, but only into a reservation that
        # will never be READY.
        ts = self._transfers.pop(rid, None)
        if ts is not None:
            self._cancel(ts, f"the prefill ended ({message})")
        job = self._jobs.pop(rid, None)
        self.engine.abort(rid)
        if job is not None:
            self.sender.give_up(job[0])
            _call(job[1], message)


def _call(cb: DoneCallback, error: str | None) -> None:
    try:
        cb(error)
    except Exception:
        log.exception("prefill on_done callback failed")
