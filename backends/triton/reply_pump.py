"""An engine model's replies sent off the engine thread, a stream's tokens coalesced
while it waits, without Triton.

Sending a decoupled response is a round trip to the server (the stub waits for the
server to take it); made on the engine thread, every response of every stream in a batch
lengthens the step. So each stream's replies go into its :class:`Outbox`, and one sender
thread (:class:`ReplyPump`) sends them, streams in the order they became ready, each
stream's replies in order. A stream whose last reply is still waiting when its next
step's tokens come gets both steps in one reply (vLLM's stream interval, but adaptive:
only while the sender is behind), so every hop after this one — the ensemble's next
step, gRPC, the client — handles one response for them. The first reply never waits for
a second: the sender takes whatever is queued as soon as it is free. Every token is sent
exactly once and in order (:func:`merge`); errors and the bare final flag are never
merged into tokens, so the ``final`` reply is the last one sent.

>>> pump = ReplyPump()
>>> sent = []
>>> box = pump.outbox(sent.append)
>>> r = lambda ids, final=False: Reply(sequence=SequenceReply(ids, "".join(map(str, ids)), None, 1, ids[-1]),
...                                   final=final)
>>> box.put(r([1])); box.put(r([2])); pump.flush()
True
>>> [reply.sequence.token_ids for reply in sent] in ([[1], [2]], [[1, 2]])
True
>>> pump.close()
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import replace
from typing import Callable

from .response_arrays import SequenceReply  # noqa: F401 - the doctests' and what Reply carries
from .response_stream import Reply


def merge(first: Reply, then: Reply) -> Reply | None:
    """``first`` and ``then`` as one reply, or None when they must go apart: only two
    token replies of one sequence merge, and only before that sequence's last one.

    >>> a = Reply(sequence=SequenceReply([1], "a", None, 3, 1, log_probs=[-0.5], cum_log_prob=-0.5))
    >>> b = Reply(sequence=SequenceReply([2, 3], "bc", "stop", 3, 3, log_probs=[-1.0, 0.0],
    ...                                  cum_log_prob=-1.5), final=True)
    >>> m = merge(a, b).sequence
    >>> m.token_ids, m.text, m.finish_reason, m.num_output_tokens, m.log_probs, m.cum_log_prob
    ([1, 2, 3], 'abc', 'stop', 3, [-0.5, -1.0, 0.0], -1.5)
    >>> merge(b, a) is None
    True
    """
    s, t = first.sequence, then.sequence
    if (s is None or t is None or first.final or s.finish_reason is not None
            or s.sequence_index != t.sequence_index or first.relay is not then.relay):
        return None
    # the later reply's counts, finish reason and every other field; the tokens of both
    return Reply(sequence=replace(t, token_ids=s.token_ids + t.token_ids, text=s.text + t.text,
                                  log_probs=s.log_probs + t.log_probs, top_ids=s.top_ids + t.top_ids,
                                  top_log_probs=s.top_log_probs + t.top_log_probs,
                                  prompt=s.prompt or t.prompt),
                 relay=then.relay, final=then.final)


class Outbox:
    """One stream's replies waiting for the sender; :meth:`put` is the stream's ``send``."""
    __slots__ = ("_pump", "_send", "_pending", "_queued")

    def __init__(self, pump: "ReplyPump", send: Callable[[Reply], None]):
        self._pump = pump
        self._send = send
        self._pending: list[Reply] = []
        self._queued = False

    def put(self, reply: Reply) -> None:
        self._pump._put(self, reply)


class ReplyPump:
    """The sender thread of one model instance (started on first use; no CPU while idle)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._ready: deque[Outbox] = deque()
        self._busy = False
        self._closing = False
        self._thread: threading.Thread | None = None
        self.replies = 0       # put, and sent (a merged pair counts once): how much coalescing saved
        self.sent = 0

    def outbox(self, send: Callable[[Reply], None]) -> Outbox:
        return Outbox(self, send)

    def _put(self, box: Outbox, reply: Reply) -> None:
        with self._cv:
            self.replies += 1
            merged = merge(box._pending[-1], reply) if box._pending else None
            if merged is not None:
                box._pending[-1] = merged
            else:
                box._pending.append(reply)
            if not box._queued:
                box._queued = True
                self._ready.append(box)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="tandem-reply-pump", daemon=True)
                    self._thread.start()
                self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._busy = False
                self._cv.notify_all()          # flush() waits for an idle sender
                while not self._ready and not self._closing:
                    self._cv.wait()
                if not self._ready:
                    return
                box = self._ready.popleft()
                replies, box._pending, box._queued = box._pending, [], False
                self._busy = True
                self.sent += len(replies)
            for reply in replies:
                try:
                    box._send(reply)
                except Exception:   # the stream's own send reports and swallows its errors
                    pass
            if replies and replies[-1].final:
                box._send = None    # let go of the Triton sender with the stream's end

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every reply put so far was sent; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._ready and not self._busy, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then stop the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
