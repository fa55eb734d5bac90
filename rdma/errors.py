"""Errors the KV transfer and the shared decode pool report to their users."""
from __future__ import annotations


class TransferError(RuntimeError):
    """A KV transfer failed; the message says why and what was left behind (nothing)."""


class PeerUnreachable(TransferError):
    """The other side's UCX worker could not be reached (or answered no handshake)."""


class TransferTimeout(TransferError):
    """The other side stopped taking part in a transfer for longer than the timeout."""


class TransferCancelled(TransferError):
    """The receiver refused or ended the transfer (the request was cancelled, its
    reservation timed out or is gone, or the descriptor did not prove its secret)."""


class PoolError(RuntimeError):
    """The shared decode pool refused an operation."""


class PoolExhausted(PoolError):
    """Not enough free pages, or no free reservation slot; nothing was allocated."""


class ReservationGone(PoolError):
    """The (slot, generation) names a reservation that no longer exists."""
