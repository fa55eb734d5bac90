"""The ``prefill`` model's remote role (``prefill_endpoints`` set): it computes nothing
and forwards each job to a prefill server (:class:`~.prefill_router.PrefillRouter`),
which streams the KV over UCX straight into this server's reserved pages; with several,
the one whose prefix cache likely holds the prompt's prefix, balanced against load
(``prefill_routing``)."""
from __future__ import annotations

import json

import triton_python_backend_utils as pb_utils

from .prefill_base import PrefillModel
from tandem.backends.disagg.prefix_affinity import AffinityPolicy

from .prefill_router import PrefillRouter, parse_endpoints
from .settings import EngineSettings


class RemotePrefillModel(PrefillModel):
    def initialize(self, args: dict) -> None:
        s = EngineSettings.from_model_config(json.loads(args["model_config"]))
        self.load_board = None   # decode's board, opened once decode has made it
        # the prefix index counts in this server's pages (its descriptors'); a backlog
        # drains as fast as conditional routing assumes the prefill side works
        affinity = AffinityPolicy(page_size=s.page_size, tokens_per_s=s.routing_policy().prefill_tokens_per_s)
        self.router = PrefillRouter(parse_endpoints(s.prefill_endpoints), on_down=self._prefill_down,
                                    routing=s.prefill_routing, affinity=affinity)
        pb_utils.Logger.log_info(f"[prefill] forwarding to {', '.join(self.router.endpoints)} "
                                 f"({s.prefill_routing})")

    def take(self, desc, desc_arr, ids_arr, cache_salt=None) -> None:
        # the prefill server parses the descriptor again: it travels as it came;
        # raises PrefillUnavailable when every prefill server failed
        self.router.submit(ids_arr, desc_arr, cache_salt)

    def _prefill_down(self, until_s: float | None) -> None:
        """Tell kv_transfer (decode's load board) that the prefill servers took no job:
        conditional routing then prefills long prompts in decode until ``until_s``."""
        from tandem.backends.disagg import server_pool_name
        from tandem.backends.disagg.decode_load import DecodeLoadBoard

        if self.load_board is None:
            self.load_board = DecodeLoadBoard.open_if_exists(server_pool_name())
        if self.load_board is not None:
            self.load_board.prefill_down_until(0 if until_s is None else int(until_s * 1e9))

    def finalize(self) -> None:
        if getattr(self, "router", None) is not None:
            self.router.close()
