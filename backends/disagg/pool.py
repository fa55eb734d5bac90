"""The decode KV pool's geometry, from a checkpoint and the engine settings.

kv_transfer creates the pool (it needs only ``config.json``), decode maps it; both
derive the same spec from the same settings.
"""
from __future__ import annotations

from tandem.rdma import ModelSpec, PoolSpec, ShardScheme
from tandem.rdma.plan import DTYPE_SIZES

from ..engine.prefill_engine import TARGET  # the target model's KV in the pool
from ..engine.request_limits import lookahead_slots
from ..kv_cache.pages import pages_needed
from ..models.config import ModelConfig
from ..speculative import SpeculativeConfig

CONTEXT = "penultimate_hidden"    # the one context blob: the prompt's last prefilled hidden state


def context_nbytes(model_dir: str, dtype: str) -> int:
    """Bytes of the context blob (the hidden state of the last prefilled token)."""
    return ModelConfig.from_dir(model_dir).hidden_size * DTYPE_SIZES[dtype]


def decode_pool_spec(name: str, model_dir: str, dtype: str, page_size: int, kv_layout: str,
                     num_pages: int, num_slots: int = 256,
                     speculative: SpeculativeConfig | None = None,
                     headroom_pages: int | None = 0, max_num_seqs: int = 64,
                     prefix_caching: bool = False, tp: int = 1) -> PoolSpec:
    """``name`` keys the shared-memory files: include model name, version and instance.
    With speculation the proposer's KV (draft model or MTP head) sits next to the
    target's under the same page ids, and one reservation carries both.

    ``headroom_pages`` stay free of reservations for the decoder's running sequences
    (None: :func:`default_headroom`). With ``prefix_caching`` the pool keeps decode's
    prefix cache, a reservation sharing up to a whole context's pages of it.

    ``tp``: the decode engine's tensor-parallel ranks; each holds its KV heads in its own
    file, split as the engine splits them (KV heads replicated over ranks where there
    are fewer heads than ranks). A proposer (draft model, MTP head) runs on rank 0
    alone, on either side: its KV is rank 0's, whole (``leader_only``)."""
    def kv(kv_name, cfg, leader_only=False):
        return ModelSpec(kv_name, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                         page_size, dtype, kv_layout, leader_only)
    target = ModelConfig.from_dir(model_dir)
    models = (kv(TARGET, target),)
    if speculative is not None and speculative.has_kv:
        models += (kv(speculative.kv_name, speculative.kv_config(model_dir), leader_only=True),)
    if headroom_pages is None:
        headroom_pages = default_headroom(num_pages, page_size, max_num_seqs, speculative)
    max_pins = min(num_pages, pages_needed(target.max_position_embeddings, page_size)) \
        if prefix_caching else 0
    return PoolSpec(name, models, num_pages, scheme=shard_scheme(target.num_key_value_heads, tp),
                    num_slots=num_slots,
                    context_bytes=context_nbytes(model_dir, dtype),
                    headroom_pages=min(headroom_pages, num_pages - 1), max_pins=max_pins)


def shard_scheme(num_kv_heads: int, tp: int) -> ShardScheme:
    """How an engine of ``tp`` ranks holds a model's KV heads (backends/parallel's split):
    by head range, or, with fewer heads than ranks, replicated over sets of
    ``num_kv_heads`` ranks, one head each.

    >>> shard_scheme(2, 2), shard_scheme(2, 4)
    (ShardScheme(tp_size=2, replica_sets=1), ShardScheme(tp_size=4, replica_sets=2))
    """
    return ShardScheme(tp, replica_sets=tp // num_kv_heads if num_kv_heads < tp else 1)


def default_headroom(num_pages: int, page_size: int, max_num_seqs: int,
                     speculative: SpeculativeConfig | None = None) -> int:
    """Pages that let every running sequence grow by one page (and its speculative
    lookahead) without waiting for admissions, at most a quarter of the pool.

    >>> default_headroom(4096, 16, 64), default_headroom(40, 4, 8)
    (64, 8)
    """
    per_seq = pages_needed(1 + lookahead_slots(speculative), page_size)
    return min(max_num_seqs * per_seq, num_pages // 4)


def server_pool_name(tag: str = "decode") -> str:
    """The pool name every model process of one tritonserver derives alike: the
    server's pid (the stubs' parent) keys it, so two servers never share a pool."""
    import os
    return f"tandem-kv-{os.getppid()}-{tag}"


def open_or_create(spec: PoolSpec, timeout_s: float = 120.0, server_pid: int | None = None):
    """kv_transfer and decode load in parallel: whichever comes first creates the pool.
    It belongs to the tritonserver they run under (their parent, ``server_pid``): a
    pool file of the same name left by a dead server is replaced, one a live server
    uses is refused (:meth:`tandem.rdma.SharedKVPool.open_or_create`)."""
    import os

    from tandem.rdma import PoolError, SharedKVPool
    try:
        return SharedKVPool.open_or_create(spec, server_pid or os.getppid(), timeout_s)
    except PoolError as e:
        raise ValueError(str(e)) from None
