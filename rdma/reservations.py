"""Reservations: the slots through which kv_transfer hands received KV to decode.

A slot holds a state, a generation, a lease deadline, the expected and completed
operation counts and a context buffer. Its lifecycle: FREE -> RESERVED (kv_transfer,
receives in flight) -> READY (all operations completed) -> claimed by decode (pages
change owner, slot FREE again); or -> FAILED (timeout, sender error, unclaimed, owner
died), pages freed at once, slot kept FAILED for ``fail_grace_s`` so the decoder can
read why, then FREE. The generation increments on every reservation of a slot, and
everything that names a reservation names (slot, generation).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .errors import PoolError, PoolExhausted, ReservationGone
from .pool_layout import H_FAILED, ControlBlock
from .pool_pages import SharedPages

FREE, RESERVED, READY, FAILED = 0, 1, 2, 3
STATE_NAMES = {FREE: "free", RESERVED: "reserved", READY: "ready", FAILED: "failed"}

# why a reservation failed
OK, TIMEOUT, SENDER_ERROR, UNCLAIMED, OWNER_DIED, CANCELLED = range(6)
FAILURE_REASONS = {
    OK: "ok",
    TIMEOUT: "no KV arrived within the transfer timeout (prefill died, stalled or unreachable)",
    SENDER_ERROR: "a transfer operation failed (the prefill process died mid-transfer)",
    UNCLAIMED: "the decoder did not claim the transferred KV within its lease",
    OWNER_DIED: "the process holding the reservation died",
    CANCELLED: "the reservation was cancelled",
}
# short names, for metric labels and logs
FAILURE_CODES = {OK: "ok", TIMEOUT: "timeout", SENDER_ERROR: "sender_error",
                 UNCLAIMED: "unclaimed", OWNER_DIED: "owner_died", CANCELLED: "cancelled"}


@dataclass(frozen=True, slots=True)
class SlotStatus:
    state: int
    generation: int
    completed: int
    expected: int
    error: int

    @property
    def ready(self) -> bool:
        return self.state == READY

    @property
    def failed(self) -> bool:
        return self.state == FAILED

    @property
    def reason(self) -> str:
        return FAILURE_REASONS.get(self.error, f"error {self.error}")

    @property
    def reason_code(self) -> str:
        return FAILURE_CODES.get(self.error, f"error_{self.error}")


class Reservations:
    """The slot arrays of a :class:`~.pool_layout.ControlBlock`. :meth:`poll` and
    :meth:`add_completed` are lock-free; every other method expects the pool's lock."""

    def __init__(self, ctl: ControlBlock, pages: SharedPages, num_slots: int,
                 fail_grace_s: float):
        self._ctl, self._pages = ctl, pages
        self.num_slots, self.fail_grace_s = num_slots, fail_grace_s

    def reset(self) -> None:
        """Every slot free (a new pool)."""
        self._ctl.slot_state[:] = FREE

    def has_free_slot(self) -> bool:
        return bool((self._ctl.slot_state == FREE).any())

    def num_active(self) -> int:
        """Reservations RESERVED or READY."""
        state = self._ctl.slot_state
        return int(((state == RESERVED) | (state == READY)).sum())

    # -- kv_transfer's side --------------------------------------------------------------
    def reserve(self, num_pages: int, expected_ops: int, timeout_s: float,
                owner: int) -> tuple[int, int, list[int]]:
        """Take a free slot and ``num_pages`` pages for ``owner``: (slot, generation,
        pages); nothing is taken if either runs out."""
        c = self._ctl
        free_slots = np.flatnonzero(c.slot_state == FREE)
        if not len(free_slots):
            raise PoolExhausted(f"all {self.num_slots} reservation slots are in use")
        slot = int(free_slots[0])
        pages = self._pages.alloc(num_pages, owner, slot)
        gen = (int(c.slot_gen[slot]) + 1) & 0xFFFFFFFF or 1
        c.slot_gen[slot] = gen
        c.slot_owner[slot] = owner
        c.slot_expected[slot] = expected_ops
        c.slot_counter[slot] = 0
        c.slot_error[slot] = OK
        c.slot_pages[slot] = num_pages
        c.slot_deadline[slot] = time.monotonic() + timeout_s
        c.slot_state[slot] = RESERVED
        return slot, gen, pages

    def arm(self, slot: int, generation: int, expected_ops: int) -> None:
        c = self._ctl
        if c.slot_gen[slot] != generation or c.slot_state[slot] != RESERVED:
            raise ReservationGone(f"reservation {slot}/{generation} is not live")
        c.slot_expected[slot] = expected_ops

    def add_completed(self, slot: int, n: int = 1) -> int:
        """Lock-free: its receiver is the counter's only writer."""
        c = int(self._ctl.slot_counter[slot]) + n
        self._ctl.slot_counter[slot] = c
        return c

    def mark_ready(self, slot: int, generation: int, claim_lease_s: float) -> bool:
        c = self._ctl
        if c.slot_gen[slot] != generation or c.slot_state[slot] != RESERVED:
            return False
        c.slot_deadline[slot] = time.monotonic() + claim_lease_s
        c.slot_state[slot] = READY
        return True

    def fail(self, slot: int, generation: int, reason: int) -> bool:
        """Fail the reservation if it is still live; whether it was."""
        c = self._ctl
        if c.slot_gen[slot] != generation or c.slot_state[slot] not in (RESERVED, READY):
            return False
        self.fail_slot(slot, reason)
        return True

    def fail_slot(self, slot: int, reason: int) -> None:
        """Free the slot's pages and keep it FAILED for the grace period."""
        c = self._ctl
        self._pages.free_reserved(slot)
        c.slot_state[slot] = FAILED
        c.slot_error[slot] = reason
        c.slot_deadline[slot] = time.monotonic() + self.fail_grace_s
        c.hdr[H_FAILED] += 1

    def fail_owned(self, owner: int, reason: int) -> None:
        """Fail every live reservation of ``owner``."""
        c = self._ctl
        live = np.flatnonzero((c.slot_owner == owner)
                              & ((c.slot_state == RESERVED) | (c.slot_state == READY)))
        for slot in live:
            self.fail_slot(int(slot), reason)

    def expire(self, now: float) -> None:
        """Lease housekeeping: unclaimed READY slots fail, FAILED slots become FREE."""
        c = self._ctl
        c.slot_state[(c.slot_deadline < now) & (c.slot_state == FAILED)] = FREE
        for slot in np.flatnonzero((c.slot_deadline < now) & (c.slot_state == READY)):
            self.fail_slot(int(slot), UNCLAIMED)

    # -- the decoder's side --------------------------------------------------------------
    def poll(self, slot: int, generation: int) -> SlotStatus:
        """Lock-free; a reused slot reads as FAILED(CANCELLED)."""
        c = self._ctl
        state, gen = int(c.slot_state[slot]), int(c.slot_gen[slot])
        if gen != generation:
            return SlotStatus(FAILED, generation, 0, 0, CANCELLED)
        error = int(c.slot_error[slot])
        if state == FREE and error != OK:
            state = FAILED   # failed, and its grace period is over
        return SlotStatus(state, gen, int(c.slot_counter[slot]), int(c.slot_expected[slot]),
                          error)

    def claim(self, slot: int, generation: int, owner: int) -> list[int]:
        """A READY reservation's pages become ``owner``'s; the slot is FREE again."""
        c = self._ctl
        state = int(c.slot_state[slot])
        if c.slot_gen[slot] != generation:
            raise ReservationGone(f"reservation {slot}/{generation} no longer exists "
                                  f"(slot now at generation {int(c.slot_gen[slot])})")
        if state == FREE and c.slot_error[slot] == OK:
            raise ReservationGone(f"reservation {slot}/{generation} was already claimed")
        if state in (FAILED, FREE):
            raise ReservationGone(f"KV transfer for reservation {slot}/{generation} failed: "
                                  f"{FAILURE_REASONS[int(c.slot_error[slot])]}")
        if state != READY:
            raise PoolError(f"reservation {slot}/{generation} is {STATE_NAMES[state]}, "
                            "not ready")
        pages = self._pages.hand_over(slot, owner)
        c.slot_state[slot] = FREE
        return pages
