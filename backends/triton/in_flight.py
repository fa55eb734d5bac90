"""An engine model's open streams and their cancellation, without Triton.

A stream is cancelled in one of two ways:

- its own Triton request reports ``is_cancelled()`` (the client called the model
  directly): a watcher thread polls the open requests, and only while there are
  any, so an idle instance uses no CPU. A step of a text ensemble is not polled
  (``poll=False``): Triton 2.51 cancels an ensemble step only when it schedules it
  (``EnsembleContext::ScheduleSteps``), never one in flight, so the poll — a round trip
  to the server per stream every ``cancel_poll_ms`` — could only ever answer no; a
  cancellation before the step began reaches the step after it, postprocess, with
  the first reply;
- postprocess reports its cancel token (the client cancelled an ensemble, which
  Triton does not pass on to the step in flight; see :mod:`.cancel_channel`), or a
  client of a direct ensemble sends it to the ``cancel`` model:
  :meth:`InFlight.cancel` by the stream's key, with ``notify=False``;
- a client of the model itself sends TensorRT-LLM's stop request (``stop`` = true,
  the request id of the stream to end; :meth:`InFlight.stop`): the stream ends with its
  final flag, as a stopped TensorRT-LLM request does.

Either way the engine aborts the sequence and the stream sends its final reply: a
CANCELLED error to a client of the model itself, but the bare final flag to an
ensemble. Triton 2.51 never releases an ensemble request one of whose steps fails
while another step is still in flight (later responses skip its in-flight count), and
postprocess steps for earlier tokens may still be running; the ensemble's client
already got its CANCELLED from the cancelled call.

A stream is one engine request per sequence (``num_return_sequences``). It is
registered before it is submitted (its replies carry the key from the first token on),
so a cancellation that arrives before ``submit`` returns is applied once the engine
request id is known (:meth:`InFlight.started`); the entry stays until every sequence
was submitted (:meth:`InFlight.submitted`) or the stream ended. A stream that ends
early (one sequence failed) has its other sequences aborted (:meth:`InFlight.ended`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .response_stream import ResponseStream


@dataclass(slots=True)
class _Entry:
    request: object             # the Triton request (``is_cancelled()``)
    stream: ResponseStream
    poll: bool = True           # ask ``is_cancelled()`` (False: postprocess carries the cancel)
    rids: dict = field(default_factory=dict)   # sequence index -> the engine's request id
    all_submitted: bool = False
    cancelled: bool = False
    ended: bool = False         # its unfinished sequences were aborted (once: the watcher may race)
    request_id: str = ""        # the client's id (Triton's request id): what a stop request names


class InFlight:
    def __init__(self, engine, poll_s: float):
        self._engine = engine
        self._poll_s = poll_s
        self._entries: dict[str, _Entry] = {}
        self._by_request_id: dict[str, str] = {}   # a client's request id -> the key of its stream
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._watch, name="tandem-cancel-watch", daemon=True)
        self._thread.start()

    def add(self, key: str, request, stream: ResponseStream, poll: bool = True, request_id: str = "") -> None:
        """Register a stream before its request is submitted; ``poll`` False: never ask its
        request ``is_cancelled()`` (an ensemble step: cancelled through :meth:`cancel`);
        ``request_id``: the client's id, which a stop request names (a later stream with
        the same id takes it over)."""
        with self._cv:
            self._entries[key] = _Entry(request, stream, poll, request_id=request_id)
            if request_id:
                self._by_request_id[request_id] = key

    def stop(self, request_id: str) -> bool:
        """TensorRT-LLM's stop request: end the stream the client sent as ``request_id``
        (with the final flag); False when no such stream is in flight."""
        with self._cv:
            key = self._by_request_id.get(request_id)
        return key is not None and self.cancel(key, notify=False)

    def started(self, key: str, rid: str, index: int = 0) -> None:
        """The engine accepted sequence ``index`` of the stream as ``rid``; aborted at
        once when the stream was cancelled or ended meanwhile."""
        with self._cv:
            e = self._entries.get(key)
            if e is None:
                return
            e.rids[index] = rid
            abort = e.cancelled or (e.stream.closed and index in e.stream.unfinished())
            if not abort:
                self._cv.notify()
        if abort:
            self._engine.abort(rid)

    def submitted(self, key: str) -> None:
        """Every sequence of the stream was submitted (or submitting stopped)."""
        with self._cv:
            e = self._entries.get(key)
            if e is None:
                return
            e.all_submitted = True
            if e.cancelled or e.stream.closed:
                self._forget(key)

    def ended(self, key: str) -> None:
        """The stream sent its final reply: forget it, and abort its sequences the
        engine still runs (a sibling failed)."""
        with self._cv:
            e = self._entries.get(key)
            if e is None:
                return
            if e.all_submitted:
                self._forget(key)
            if e.ended:     # the submitting thread and the watcher both saw it close
                return
            e.ended = True
            rids = [rid for i, rid in e.rids.items() if i in e.stream.unfinished()]
        for rid in rids:
            self._engine.abort(rid)

    def cancel(self, key: str, notify: bool = True) -> bool:
        """Cancel the stream ``key`` (any thread); False if it is unknown or had ended.
        ``notify`` False ends it with the bare final flag rather than a CANCELLED error."""
        with self._cv:
            e = self._entries.get(key)
            if e is None or e.cancelled:
                return False
            e.cancelled = True
            rids = list(e.rids.values())     # the others are aborted by started()
            if e.all_submitted:
                self._forget(key)
        if not e.stream.cancel(notify=notify):
            return False
        for rid in rids:
            self._engine.abort(rid)
        return True

    def _forget(self, key: str) -> None:   # under the lock
        e = self._entries.pop(key)
        if e.request_id and self._by_request_id.get(e.request_id) == key:
            del self._by_request_id[e.request_id]

    def __len__(self) -> int:
        with self._cv:
            return len(self._entries)

    def _watch(self) -> None:
        while True:
            with self._cv:
                while not self._entries and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
            self._poll_once()
            with self._cv:
                if not self._stopping:
                    self._cv.wait(self._poll_s)

    def _poll_once(self) -> None:
        # A method of its own so that no request object stays referenced from
        # this thread's locals while it sleeps.
        with self._cv:
            snapshot = [(key, e.request, e.stream, e.poll) for key, e in self._entries.items()]
        for key, request, stream, poll in snapshot:
            if stream.closed:
                self.ended(key)
            elif poll and stream.client_cancelled(request.is_cancelled):
                self.cancel(key)

    def close(self, message: str) -> None:
        """End every open stream with ``message`` and stop the watcher."""
        with self._cv:
            self._stopping = True
            entries = list(self._entries.values())
            self._entries.clear()
            self._by_request_id.clear()
            self._cv.notify_all()
        for e in entries:
            if e.stream.fail(message, code="UNAVAILABLE"):
                for rid in e.rids.values():
                    self._engine.abort(rid)
        self._thread.join(timeout=5)
