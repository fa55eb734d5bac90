"""The decode KV pool's geometry, from a checkpoint and the engine settings.

kv_transfer creates the pool (it needs only ``config.json``), decode maps it; both
derive the same spec from the same settings.
"""
from __future__ import annotations

from tandem.rdma import ModelSpec, PoolSpec
from tandem.rdma.plan import DTYPE_SIZES

from ..engine.prefill_engine import TARGET  # the target model's KV in the pool
from ..models.config import ModelConfig
from ..speculative import SpeculativeConfig

CONTEXT = "penultimate_hidden"    # the one context blob: the prompt's last prefilled hidden state


def context_nbytes(model_dir: str, dtype: str) -> int:
    """Bytes of the context blob (the hidden state of the last prefilled token)."""
    return ModelConfig.from_dir(model_dir).hidden_size * DTYPE_SIZES[dtype]


def decode_pool_spec(name: str, model_dir: str, dtype: str, page_size: int, kv_layout: str,
                     num_pages: int, num_slots: int = 256,
                     speculative: SpeculativeConfig | None = None) -> PoolSpec:
    """``name`` keys the shared-memory files: include model name, version and instance.
    With speculation the proposer's KV (draft model or MTP head) sits next to the
    target's under the same page ids, and one reservation carries both."""
    def kv(kv_name, cfg):
        return ModelSpec(kv_name, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                         page_size, dtype, kv_layout)
    models = (kv(TARGET, ModelConfig.from_dir(model_dir)),)
    if speculative is not None and speculative.enabled:
        models += (kv(speculative.kv_name, speculative.kv_config(model_dir)),)
    return PoolSpec(name, models, num_pages, num_slots=num_slots,
                    context_bytes=context_nbytes(model_dir, dtype))


def server_pool_name(tag: str = "decode") -> str:
    """The pool name every model process of one tritonserver derives alike: the
    server's pid (the stubs' parent) keys it, so two servers never share a pool."""
    import os
    return f"tandem-kv-{os.getppid()}-{tag}"


def open_or_create(spec: PoolSpec, timeout_s: float = 120.0):
    """kv_transfer and decode load in parallel: whichever comes first creates the pool."""
    from tandem.rdma import SharedKVPool
    try:
        return SharedKVPool.create(spec)
    except FileExistsError:
        pool = SharedKVPool.open(spec.name, timeout_s=timeout_s)
    if pool.spec.models != spec.models or pool.spec.num_pages != spec.num_pages:
        pool.close(release=False)
        raise ValueError(f"shared KV pool {spec.name!r} exists with another geometry "
                         f"({pool.spec}); expected {spec}")
    return pool
