"""Reservations: the slots through which kv_transfer hands received KV to decode.

A slot holds a state, a generation, a 128-bit secret, a lease deadline, the expected
and completed operation counts and a context buffer. Its lifecycle: FREE -> RESERVED
(kv_transfer, receives in flight) -> READY (all operations completed) -> claimed by
decode (pages change owner, slot FREE again); or -> FAILED (timeout, sender error,
unclaimed, owner died, cancelled), pages freed at once, slot kept FAILED for
``fail_grace_s`` so the decoder can read why, then FREE. A FAILED slot is reused
before its grace ends when no FREE one is left: failed slots never block a
reservation while pages are free. The generation increments on every reservation of
a slot, and everything that names a reservation names (slot, generation); what
proves a right to it is the secret (:meth:`Reservations.verify`).

A reservation that fails while receives into its pages are still posted (a link cut
mid-transfer) is first *doomed* (:meth:`Reservations.doom`): it stays RESERVED, so its
pages stay out of every allocation, but carries its error, and :meth:`poll` reads it as
FAILED at once, so the request fails within the transfer timeout; its receiver frees
the pages (:meth:`fail`) once no receive can land in them.

A cancel from the decoder (:meth:`Reservations.cancel`) frees a READY reservation at
once; a RESERVED one may still have receives in flight into its pages, so the cancel
is a request its receiver acts on (``slot_cancel``), freeing the pages once no
receive can land in them.
"""
from __future__ import annotations

import hmac
import time
from dataclasses import dataclass

import numpy as np

from .errors import PoolError, PoolExhausted, ReservationGone
from .pool_layout import H_CANCELLED, H_FAILED, ControlBlock
from .pool_pages import SharedPages

FREE, RESERVED, READY, FAILED = 0, 1, 2, 3
STATE_NAMES = {FREE: "free", RESERVED: "reserved", READY: "ready", FAILED: "failed"}

# why a reservation failed
OK, TIMEOUT, SENDER_ERROR, UNCLAIMED, OWNER_DIED, CANCELLED, INJECTED, PREFILL_FAILED = range(8)
FAILURE_REASONS = {
    OK: "ok",
    TIMEOUT: "no KV arrived within the transfer timeout (prefill died, stalled or unreachable)",
    SENDER_ERROR: "a transfer operation failed (the prefill process died mid-transfer)",
    UNCLAIMED: "the decoder did not claim the transferred KV within its lease",
    OWNER_DIED: "the process holding the reservation died",
    CANCELLED: "the reservation was cancelled",
    INJECTED: "a fault was injected (TANDEM_FAULTS)",
    PREFILL_FAILED: "the prefill side gave the request up (its prefill failed or was aborted)",
}
# short names, for metric labels and logs
FAILURE_CODES = {OK: "ok", TIMEOUT: "timeout", SENDER_ERROR: "sender_error",
                 UNCLAIMED: "unclaimed", OWNER_DIED: "owner_died", CANCELLED: "cancelled",
                 INJECTED: "injected", PREFILL_FAILED: "prefill_failed"}


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
    """The slot arrays of a :class:`~.pool_layout.ControlBlock`. :meth:`poll`,
    :meth:`add_completed` and :meth:`cancel_requested` are lock-free; every other
    method expects the pool's lock."""

    def __init__(self, ctl: ControlBlock, pages: SharedPages, num_slots: int,
                 fail_grace_s: float):
        self._ctl, self._pages = ctl, pages
        self.num_slots, self.fail_grace_s = num_slots, fail_grace_s

    def reset(self) -> None:
        """Every slot free (a new pool)."""
        self._ctl.slot_state[:] = FREE

    def num_active(self) -> int:
        """Reservations RESERVED or READY."""
        return int(self.live().sum())

    def in_range(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots

    # -- kv_transfer's side --------------------------------------------------------------
    def live(self) -> np.ndarray:
        """A mask of the slots whose reservation is live (RESERVED or READY)."""
        state = self._ctl.slot_state
        return (state == RESERVED) | (state == READY)

    def reserve(self, num_pages: int, expected_ops: int, timeout_s: float, owner: int,
                secret: bytes, keep_free: int = 0,
                pins: list[int] = ()) -> tuple[int, int, list[int]]:
        """Take a slot and ``num_pages`` pages for ``owner``, leaving ``keep_free``
        pages free, the slot sharing the cached pages ``pins`` (found under this lock):
        (slot, generation, pages); nothing is taken if either runs out."""
        c = self._ctl
        slot = self._pick_slot()
        cache = self._pages.cache
        cache.pin(slot, list(pins))   # first: the pages it shares are not evicted for it
        try:
            pages = self._pages.alloc(num_pages, owner, slot, keep_free)
        except BaseException:
            cache.unpin(slot, to_owner=False)
            raise
        gen = (int(c.slot_gen[slot]) + 1) & 0xFFFFFFFF or 1
        c.slot_gen[slot] = gen
        c.slot_owner[slot] = owner
        c.slot_expected[slot] = expected_ops
        c.slot_counter[slot] = 0
        c.slot_error[slot] = OK
        c.slot_pages[slot] = num_pages
        c.slot_cancel[slot] = 0
        c.secrets[slot] = np.frombuffer(secret, np.uint8)
        c.slot_deadline[slot] = time.monotonic() + timeout_s
        c.slot_state[slot] = RESERVED
        return slot, gen, pages

    def _pick_slot(self) -> int:
        """The lowest FREE slot, else the FAILED slot whose grace ends first."""
        c = self._ctl
        free = np.flatnonzero(c.slot_state == FREE)
        if len(free):
            return int(free[0])
        failed = np.flatnonzero(c.slot_state == FAILED)
        if len(failed):
            return int(failed[np.argmin(c.slot_deadline[failed])])
        raise PoolExhausted(f"all {self.num_slots} reservation slots are in use")

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

    def cancel_requested(self, slot: int, generation: int) -> bool:
        """Lock-free: whether the decoder asked to cancel this reservation."""
        return int(self._ctl.slot_cancel[slot]) == generation

    def mark_ready(self, slot: int, generation: int, claim_lease_s: float) -> bool:
        """RESERVED -> READY; a reservation the decoder cancelled meanwhile fails
        instead (nobody would claim it). Whether it is READY."""
        c = self._ctl
        if (c.slot_gen[slot] != generation or c.slot_state[slot] != RESERVED
                or c.slot_error[slot] != OK):   # gone, or doomed
            return False
        if c.slot_cancel[slot] == generation:
            self.fail_slot(slot, CANCELLED)
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

    def doom(self, slot: int, generation: int, reason: int) -> bool:
        """A RESERVED reservation reads as failed from now on while its pages stay held
        (receives into them may still land); :meth:`fail` frees them later. Whether it
        was live."""
        c = self._ctl
        if c.slot_gen[slot] != generation or c.slot_state[slot] != RESERVED:
            return False
        c.slot_error[slot] = reason
        return True

    def fail_slot(self, slot: int, reason: int) -> None:
        """Free the slot's pages (and end its pins) and keep it FAILED for the grace
        period."""
        c = self._ctl
        self._pages.free_reserved(slot)
        self._pages.cache.unpin(slot, to_owner=False)
        c.slot_state[slot] = FAILED
        c.slot_error[slot] = reason
        c.slot_deadline[slot] = time.monotonic() + self.fail_grace_s
        c.hdr[H_FAILED] += 1

    def fail_owned(self, owner: int, reason: int) -> None:
        """Fail every live reservation of ``owner``."""
        for slot in self.owned(owner):
            self.fail_slot(slot, reason)

    def fail_pinning(self, reason: int) -> None:
        """Fail every live reservation that shares cached pages (their owner is going)."""
        for slot in np.flatnonzero(self.live() & (self._ctl.slot_num_pins > 0)):
            self.fail_slot(int(slot), reason)

    def owned(self, owner: int) -> list[int]:
        """The live (RESERVED or READY) reservations of ``owner``."""
        c = self._ctl
        return np.flatnonzero((c.slot_owner == owner) & ((c.slot_state == RESERVED)
                                                         | (c.slot_state == READY))).tolist()

    def expire(self, now: float) -> None:
        """Lease housekeeping: unclaimed READY slots fail, FAILED slots become FREE."""
        c = self._ctl
        c.slot_state[(c.slot_deadline < now) & (c.slot_state == FAILED)] = FREE
        for slot in np.flatnonzero((c.slot_deadline < now) & (c.slot_state == READY)):
            self.fail_slot(int(slot), UNCLAIMED)

    # -- the decoder's side --------------------------------------------------------------
    def verify(self, slot: int, generation: int, secret: bytes) -> bool:
        """Whether (slot, generation, secret) names a reservation of this pool, live or
        ended (constant-time comparison of the secret)."""
        c = self._ctl
        if not self.in_range(slot) or int(c.slot_gen[slot]) != generation:
            return False
        return hmac.compare_digest(c.secrets[slot].tobytes(), bytes(secret))

    def poll(self, slot: int, generation: int) -> SlotStatus:
        """Lock-free; a reused slot (or one out of range) reads as FAILED(CANCELLED)."""
        c = self._ctl
        if not self.in_range(slot):
            return SlotStatus(FAILED, generation, 0, 0, CANCELLED)
        state, gen = int(c.slot_state[slot]), int(c.slot_gen[slot])
        if gen != generation:
            return SlotStatus(FAILED, generation, 0, 0, CANCELLED)
        error = int(c.slot_error[slot])
        if state in (FREE, RESERVED) and error != OK:
            state = FAILED   # failed, and its grace period is over; or doomed
        return SlotStatus(state, gen, int(c.slot_counter[slot]), int(c.slot_expected[slot]),
                          error)

    def claim(self, slot: int, generation: int, owner: int, secret: bytes | None = None) -> list[int]:
        """A READY reservation's pages become ``owner``'s, the cached pages it shares
        first (``owner`` holds them now; it must be the cache's owner), then the ones
        it received; the slot is FREE again. With ``secret``, only if it is the
        reservation's."""
        c = self._ctl
        if not self.in_range(slot):
            raise ReservationGone(f"slot {slot} out of range 0..{self.num_slots - 1}")
        state = int(c.slot_state[slot])
        if c.slot_gen[slot] != generation:
            raise ReservationGone(f"reservation {slot}/{generation} no longer exists "
                                  f"(slot now at generation {int(c.slot_gen[slot])})")
        if secret is not None and not self.verify(slot, generation, secret):
            raise ReservationGone(f"reservation {slot}/{generation}: wrong secret")
        if state == FREE and c.slot_error[slot] == OK:
            raise ReservationGone(f"reservation {slot}/{generation} was already claimed")
        if state in (FAILED, FREE) or (state == RESERVED and c.slot_error[slot] != OK):
            raise ReservationGone(f"KV transfer for reservation {slot}/{generation} failed: "
                                  f"{FAILURE_REASONS[int(c.slot_error[slot])]}")
        if state != READY:
            raise PoolError(f"reservation {slot}/{generation} is {STATE_NAMES[state]}, "
                            "not ready")
        shared = self._pages.cache.pinned(slot)
        if shared and owner != self._pages.cache.owner:
            raise PoolError(f"reservation {slot}/{generation} shares cached pages; only the "
                            "cache's owner (decode) can claim it")
        pages = self._pages.hand_over(slot, owner)
        self._pages.cache.unpin(slot, to_owner=True)
        c.slot_state[slot] = FREE
        return shared + pages

    def cancel(self, slot: int, generation: int) -> bool:
        """The decoder gives the reservation up: a READY one fails (pages freed) now; a
        RESERVED one is marked for its receiver, which stops taking its data and frees
        its pages once no receive is in flight. Whether it was live."""
        c = self._ctl
        if not self.in_range(slot) or c.slot_gen[slot] != generation:
            return False
        state = int(c.slot_state[slot])
        if state == READY:
            self.fail_slot(slot, CANCELLED)
        elif state == RESERVED and c.slot_error[slot] == OK:   # not doomed already
            c.slot_cancel[slot] = generation
        else:
            return False
        c.hdr[H_CANCELLED] += 1
        return True
