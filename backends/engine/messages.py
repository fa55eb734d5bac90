"""What other threads tell the engine thread of :class:`~.async_engine.AsyncEngine`
(through its :class:`~.inbox.Inbox`): one frozen dataclass per kind of message, so
the engine thread dispatches with ``match`` instead of decoding tuples by position.

>>> msg = Abort("req-3")
>>> match msg:
...     case AddRequest(seq=seq): print("add", seq.request_id)
...     case Abort(request_id=rid): print("abort", rid)
abort req-3
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:   # annotations only: this module stays free of the engine's imports
    from .outputs import RequestOutput
    from .remote_prefill import KVTicket
    from .sequence import Sequence

OutputCallback = Callable[["RequestOutput"], None]


@dataclass(frozen=True, slots=True)
class AddRequest:
    """A validated request to schedule; ``on_output`` gets each of its deltas."""
    seq: Sequence
    on_output: OutputCallback

    @property
    def request_id(self) -> str:
        return self.seq.request_id


@dataclass(frozen=True, slots=True)
class AddRemote:
    """A request whose prompt KV another process computes: held until ``ticket``
    hands over the pages (see :class:`~.remote_prefill.PendingPrefills`)."""
    seq: Sequence
    ticket: KVTicket
    on_output: OutputCallback

    @property
    def request_id(self) -> str:
        return self.seq.request_id


@dataclass(frozen=True, slots=True)
class Abort:
    """End a request, queued or waiting for its KV (the client went away)."""
    request_id: str


EngineMessage = AddRequest | AddRemote | Abort
