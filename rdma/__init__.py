"""KV transfer over UCX: prefill pushes KV pages, layer by layer, into pages the
decoder reserved; the decoder counts completed operations against the number it
expects.

- :mod:`.plan` — pure maths: shard schemes, page pieces and runs, transfer plans
- :mod:`.wire` / :mod:`.descriptor` — tags, control messages, the destination descriptor
- :mod:`.transport` — one UCX worker on its own thread (blocking progress)
- :mod:`.shared_pool` — the decode pool, allocator, reservations and counters in shm
- :mod:`.receiver` — kv_transfer's side; :mod:`.sender` — prefill's messenger

Nothing here imports torch unless a torch tensor or ``KVPagePool`` is handed to it.
"""
from .descriptor import DestinationDescriptor
from .errors import PeerUnreachable, TransferError, TransferTimeout
from .plan import ModelSpec, ShardScheme, TransferPlan, ops_per_page, plan_transfer
from .receiver import KVReceiver, ReceiverConfig, TransferTrace
from .sender import ForwardStep, KVSender, SenderConfig, SourcePool, Transfer
from .shared_pool import (PoolSpec, PoolStats, ReservationGone, SharedKVPool,
                          SharedPageAllocator, SlotStatus)

__all__ = [
    "DestinationDescriptor", "ModelSpec", "ShardScheme", "TransferPlan", "ops_per_page",
    "plan_transfer", "KVReceiver", "ReceiverConfig", "TransferTrace", "KVSender",
    "SenderConfig", "SourcePool", "Transfer", "ForwardStep", "PoolSpec", "PoolStats",
    "SharedKVPool", "SharedPageAllocator", "SlotStatus", "ReservationGone",
    "TransferError", "PeerUnreachable", "TransferTimeout",
]
