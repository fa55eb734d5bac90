"""Requests whose prompt KV another process computes (disaggregated prefill).

The decode engine holds each such request outside its scheduler until the request's
:class:`KVTicket` reports that the KV has arrived (the transfer's counter reached its
expected value); it then admits it with :meth:`LLMEngine.add_prefilled`. Polling is
non-blocking, so a slow transfer never stalls the running batch.

A transfer that fails (the prefill process died or was restarting, the link dropped,
the reservation timed out) costs its request nothing but time under the ``recompute``
policy (the default; vLLM's ``kv_load_failure_policy`` names it): the sequence is still
fresh, so the engine prefills its prompt itself, as it does for a request routed to it,
and its output is the one the transfer would have given. Under ``fail`` the request
ends with UNAVAILABLE ("retry").
"""
from __future__ import annotations

import logging
from typing import Protocol

from .outputs import RequestOutput
from .sequence import Sequence

log = logging.getLogger(__name__)


class KVTransferFailed(RuntimeError):
    """The prompt KV will not arrive (prefill died, timed out, or was reclaimed);
    ``reason`` is a short code for metrics (timeout, sender_error, gone, ...)."""

    def __init__(self, message: str, reason: str = "failed"):
        super().__init__(message)
        self.reason = reason


class KVTicket(Protocol):
    # the first pages poll() hands over are the engine's own cached ones (shared, not
    # transferred): the engine counts them as prefix-cache hits
    num_cached_pages: int

    def poll(self) -> list[int] | None:
        """The pages (now owned by the caller) once the KV arrived, else None;
        raises :class:`KVTransferFailed` when it never will."""

    def cancel(self) -> None:
        """The request went away: give the reservation up now (its pages come back at
        once, or as soon as no receive into them is in flight) and let the prefill
        side learn it, so it stops computing for nobody."""


RECOMPUTE, FAIL = "recompute", "fail"
KV_LOAD_FAILURE_POLICIES = (RECOMPUTE, FAIL)


class PendingPrefills:
    """Sequences waiting for their KV, in arrival order (engine thread only)."""

    poll_s = 0.002   # how often an otherwise idle engine polls the counters

    def __init__(self, on_failure: str = RECOMPUTE):
        """``on_failure``: what a failed transfer's request gets (one of
        :data:`KV_LOAD_FAILURE_POLICIES`, see the module docstring)."""
        if on_failure not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy {on_failure!r}; allowed: "
                             f"{', '.join(KV_LOAD_FAILURE_POLICIES)}")
        self.on_failure = on_failure
        self._waiting: dict[str, tuple[Sequence, KVTicket]] = {}
        self._failed: list[RequestOutput] = []
        self._recompute: list[Sequence] = []
        self.failures: dict[str, int] = {}   # failed transfers by reason, since start
        self.recomputed = 0                  # ... of which decode prefilled the prompt itself

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def add(self, seq: Sequence, ticket: KVTicket) -> None:
        self._waiting[seq.request_id] = (seq, ticket)

    def request_ids(self) -> list[str]:
        return list(self._waiting)

    def ready(self) -> list[tuple[Sequence, list[int], int]]:
        """Sequences whose KV arrived, with their pages and how many of them came from
        the engine's prefix cache; failures are kept for :meth:`take_failed`."""
        out = []
        for rid, (seq, ticket) in list(self._waiting.items()):
            try:
                pages = ticket.poll()
            except Exception as e:   # this request's KV will not come: it alone ends
                if not isinstance(e, KVTransferFailed):
                    log.exception("request %s: polling its KV transfer failed", rid)
                    e = KVTransferFailed(f"the KV transfer could not be checked ({e})", "error")
                del self._waiting[rid]
                self.failures[e.reason] = self.failures.get(e.reason, 0) + 1
                if self.on_failure == RECOMPUTE:
                    log.warning("request %s: %s; prefilling it here", rid, e)
                    self.recomputed += 1
                    self._recompute.append(seq)
                    continue
                log.warning("request %s: %s", rid, e)
                # the server's failure, not the request's: a retry may well succeed
                self._failed.append(_ended(seq, "error", error=f"{e}; retry", code="UNAVAILABLE"))
                continue
            if pages is not None:
                del self._waiting[rid]
                out.append((seq, pages, ticket.num_cached_pages))
        return out

    def take_failed(self) -> list[RequestOutput]:
        failed, self._failed = self._failed, []
        return failed

    def recompute(self, seq: Sequence) -> None:
        """Have the engine prefill ``seq`` itself after all (its KV arrived but cannot be
        used), whatever the failure policy."""
        self._recompute.append(seq)

    def take_recompute(self) -> list[Sequence]:
        """Sequences whose transfer failed, for the engine to prefill itself (still
        fresh: no page, nothing computed, nothing sampled)."""
        seqs, self._recompute = self._recompute, []
        return seqs

    def cancel(self, request_id: str) -> RequestOutput | None:
        entry = self._waiting.pop(request_id, None)
        if entry is None:
            return None
        seq, ticket = entry
        try:
            ticket.cancel()
        except Exception:   # the request ends anyway; its reservation's lease reclaims it
            log.exception("request %s: cancelling its KV transfer failed", request_id)
        return _ended(seq, "abort")


def _ended(seq: Sequence, reason: str, error: str | None = None,
           code: str | None = None) -> RequestOutput:
    return RequestOutput(seq.request_id, [], "", True, reason, len(seq.prompt_ids), 0, error, code)
