"""Disaggregated serving: the glue between the engines (:mod:`..engine`) and the KV
transfer (:mod:`tandem.rdma`), with no Triton in it. Names load on first use.

- :mod:`.pool` — the decode pool's geometry, derived from the checkpoint
- :mod:`.prefill_service` — the prefill engine on its own thread, streaming KV
- :mod:`.decode` — the decode engine on the shared pool; tickets over reservations;
  the pool's housekeeping in decode
- :mod:`.kv_views` — engine page pools over the shared pool, and as a sender's sources
- :mod:`.routing` — conditional disaggregation: where each prompt is prefilled (pure)
- :mod:`.decode_load` — decode's load for that decision, and its threads while prefill idles
"""
from ..lazy import lazy_exports

_EXPORTS = {"SharedPoolTicket": ".decode", "PoolHousekeeper": ".decode",
            "decode_engine": ".decode", "CONTEXT": ".pool", "TARGET": ".pool",
            "context_nbytes": ".pool", "decode_pool_spec": ".pool", "default_headroom": ".pool",
            "lookahead_slots": ".pool", "open_or_create": ".pool", "server_pool_name": ".pool",
            "shard_scheme": ".pool",
            "PrefillService": ".prefill_service"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
