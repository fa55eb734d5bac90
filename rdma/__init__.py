"""KV transfer over UCX: prefill pushes KV pages, layer by layer, into pages the
decoder reserved; the decoder counts completed operations against the number it
expects.

- :mod:`.plan` — pure maths: shard schemes, page pieces and runs, transfer plans
- :mod:`.wire` / :mod:`.descriptor` — tags, control messages, the destination descriptor
- :mod:`.transport` — one UCX worker on its own thread (blocking progress)
- :mod:`.shared_pool` — the decode pool in shm: :mod:`.pool_layout` (files, mapping),
  :mod:`.pool_pages` (page owners, free stack), :mod:`.pool_owners` (attached
  processes), :mod:`.reservations` (slots, leases, counters)
- :mod:`.receiver` — kv_transfer's side; :mod:`.sender` — prefill's messenger, one
  :mod:`.transfer` per request
- :mod:`.faults` — fault injection for tests and benchmarks (``TANDEM_FAULTS``)

A leaf package: it never imports the engine (which adapts its own page pools and
allocator to :class:`SourcePool`, :class:`SharedKVPool` and
:class:`SharedPageAllocator`), and imports torch only where a torch tensor is handed
to it.
"""
from .descriptor import DestinationDescriptor
from .errors import (PeerUnreachable, PoolError, PoolExhausted, ReservationGone,
                     TransferCancelled, TransferError, TransferTimeout)
from .faults import Faults
from .plan import ModelSpec, ShardScheme, TransferPlan, ops_per_page, plan_transfer
from .receiver import KVReceiver, ReceiverConfig, TransferTrace
from .sender import ForwardStep, KVSender, SenderConfig, SourcePool
from .transfer import Transfer
from .shared_pool import PoolSpec, PoolStats, SharedKVPool, SharedPageAllocator, SlotStatus

__all__ = [
    "DestinationDescriptor", "ModelSpec", "ShardScheme", "TransferPlan", "ops_per_page",
    "plan_transfer", "KVReceiver", "ReceiverConfig", "TransferTrace", "KVSender",
    "SenderConfig", "SourcePool", "Transfer", "ForwardStep", "PoolSpec", "PoolStats",
    "SharedKVPool", "SharedPageAllocator", "SlotStatus", "ReservationGone",
    "TransferError", "PeerUnreachable", "TransferTimeout", "TransferCancelled", "PoolError",
    "PoolExhausted", "Faults",
]
