"""One request's transfer from one prefill rank: which plan rows this rank sends, in
the order their pages become final, a cursor per layer past the ones sent, and the
counts of operations posted and completed. :class:`~.sender.KVSender`'s thread is the
only one that changes it."""
from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np

from .descriptor import DestinationDescriptor
from .errors import TransferTimeout


class Transfer:
    """One request's transfer from this rank. ``wait()`` or ``done`` / ``error``.

    It keeps its own progress: per model and layer, the units (plan rows) in the order
    their pages become final, a cursor past the ones sent, and how far the forward has
    computed; the counts of operations posted and completed. The messenger thread is
    the only one that changes it; the engine reads ``done``, ``error`` and the plan.
    """

    def __init__(self, desc: DestinationDescriptor, src_pages: list[int], rank: int,
                 models: list[int], on_done: Callable | None):
        plan = desc.plan()
        self.desc, self.src_pages, self.rank, self.on_done = desc, src_pages, rank, on_done
        self.plan = plan
        self.source_index = models   # plan model index -> SourcePool list index
        self.model_index = {m.name: i for i, m in enumerate(plan.models)}
        self.error: Exception | None = None
        self.active = False
        self.finished = threading.Event()
        self.sent = self.completed = self.staged = 0
        self.bytes_sent = 0
        self.last_progress = time.monotonic()
        self.layer_computed_at: dict[tuple[str, int], float] = {}
        self.started_at = time.monotonic()
        self.finished_at: float | None = None
        self.pending_context = None
        self.nonce, self.open_deadline = 0, 0.0   # the Open awaiting the receiver's answer
        self.drop_after: int | None = None        # fault injection: abandon after this many sends
        ps = plan.models[0].page_size
        self._rows, self._final, self._ptr, self._final_tokens = [], [], [], []
        total = 0
        for m, lo in zip(plan.models, plan.layer_ops):
            rows = np.flatnonzero(lo.src_rank == rank)
            # absolute token positions: the first pages may be decode's already
            final = np.minimum((desc.first_page + lo.first[rows] + lo.npages[rows]) * ps,
                               desc.num_tokens)
            order = np.argsort(final, kind="stable")
            self._rows.append(rows[order].tolist())
            self._final.append(final[order].tolist())
            self._ptr.append([0] * m.num_layers)
            self._final_tokens.append([0] * m.num_layers)
            total += m.num_layers * len(rows)
        self.num_context = len(plan.context_nbytes) if rank == 0 else 0
        self.total = total + self.num_context

    @property
    def done(self) -> bool:
        return self.finished.is_set()

    @property
    def all_completed(self) -> bool:
        """Active, and every operation of the plan (this rank's share) completed."""
        return self.active and self.completed >= self.total

    def stalled(self, now: float, timeout_s: float) -> bool:
        """Operations are in flight and none completed for ``timeout_s``."""
        return self.active and self.sent > self.completed and now - self.last_progress > timeout_s

    # -- messenger thread ----------------------------------------------------------------
    def activate(self) -> None:
        """The peer is reachable: sends may start."""
        self.active = True

    def layer_computed(self, model: str, layer: int, end: int, at: float) -> int:
        """The forward computed ``layer`` of ``model`` for tokens up to ``end`` (at
        time ``at``); returns the model's index in the plan."""
        m = self.model_index[model]
        self._final_tokens[m][layer] = end
        self.layer_computed_at[(model, layer)] = at
        return m

    def take_ready(self, m: int, layer: int) -> list[int]:
        """The plan rows of model ``m``'s ``layer`` whose pages are now final and not yet
        taken, in order; the cursor moves past them."""
        rows, final, limit = self._rows[m], self._final[m], self._final_tokens[m][layer]
        start = end = self._ptr[m][layer]
        while end < len(rows) and final[end] <= limit:
            end += 1
        self._ptr[m][layer] = end
        return rows[start:end]

    def hold_context(self, arrays) -> None:
        """Context blobs that arrived before the transfer was active."""
        self.pending_context = arrays

    def take_context(self):
        """The held context blobs (None if none), no longer held."""
        arrays, self.pending_context = self.pending_context, None
        return arrays

    def op_posted(self, nbytes: int, staged: bool = False) -> None:
        if self.sent == self.completed:
            self.last_progress = time.monotonic()   # the stall clock starts now
        self.sent += 1
        self.bytes_sent += nbytes
        self.staged += staged

    def op_completed(self) -> None:
        self.completed += 1
        self.last_progress = time.monotonic()

    def finish(self, error: Exception | None = None) -> None:
        """Done: every send completed (no ``error``) or the transfer failed."""
        self.error = error
        self.finished_at = time.monotonic()
        self.finished.set()

    def wait(self, timeout: float | None = None) -> "Transfer":
        """Block until every send completed; raises the transfer's error."""
        if not self.finished.wait(timeout):
            raise TransferTimeout(f"transfer to reservation {self.desc.slot}/"
                                  f"{self.desc.generation} still running after {timeout}s")
        if self.error is not None:
            raise self.error
        return self
