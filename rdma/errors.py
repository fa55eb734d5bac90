"""Errors a KV transfer reports to its user."""
from __future__ import annotations


class TransferError(RuntimeError):
    """A KV transfer failed; the message says why and what was left behind (nothing)."""


class PeerUnreachable(TransferError):
    """The other side's UCX worker could not be reached (or answered no handshake)."""


class TransferTimeout(TransferError):
    """The other side stopped taking part in a transfer for longer than the timeout."""
