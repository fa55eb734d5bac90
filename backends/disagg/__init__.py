"""Disaggregated serving: the glue between the engines (:mod:`..engine`) and the KV
transfer (:mod:`tandem.rdma`), with no Triton in it.

- :mod:`.pool` — the decode pool's geometry, derived from the checkpoint
- :mod:`.prefill_service` — the prefill engine on its own thread, streaming KV
- :mod:`.decode` — the decode engine on the shared pool; tickets over reservations
"""
from .decode import SharedPoolTicket, decode_engine
from .pool import (CONTEXT, TARGET, context_nbytes, decode_pool_spec, default_num_pages,
                   open_or_create, server_pool_name)
from .prefill_service import PrefillService

__all__ = ["SharedPoolTicket", "decode_engine", "CONTEXT", "TARGET", "context_nbytes",
           "decode_pool_spec", "default_num_pages", "open_or_create", "server_pool_name",
           "PrefillService"]
