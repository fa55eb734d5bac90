"""What the disaggregated models (preprocess, kv_transfer, prefill, decode) agree on,
without Triton: tensor names, the no-transfer sentinel, the shared pool's spec."""
from __future__ import annotations

import numpy as np

from ..disagg.routing import LOCAL  # noqa: F401  (the route that gets NO_TRANSFER)
from .settings import EngineSettings

INPUT_IDS = "input_ids"            # INT32 [1, n]: the tokenized prompt (preprocess)
KV_DESCRIPTOR = "kv_descriptor"    # UINT8 [1, m]: DestinationDescriptor bytes (kv_transfer)
CACHE_SALT = "cache_salt"          # STRING [1], optional: the request's prefix-cache salt
LORA_NAME = "lora_name"            # STRING [1], optional: the request's LoRA adapter (registry name)
PREFILL_ACK = "prefill_ack"        # BOOL [1, 1]: prefill accepted the job (prefill)
# no reservation, no transfer: decode prefills the prompt itself (a one-token prompt has
# nothing to prefill; conditional disaggregation routes short prompts here too)
NO_TRANSFER = b"\0"


def pool_spec(s: EngineSettings):
    """The shared decode pool of this server, from the model's settings."""
    from tandem.backends.disagg import decode_pool_spec, server_pool_name
    from tandem.backends.engine.config import default_num_pages
    from tandem.backends.models.config import ModelConfig
    num_pages = s.num_pages or default_num_pages(ModelConfig.from_dir(s.model_dir), s.dtype,
                                                 s.page_size, s.max_num_seqs)
    # with speculation the proposer's KV shares the pool (and every reservation)
    return decode_pool_spec(server_pool_name(), s.model_dir, s.dtype, s.page_size, s.kv_layout,
                            num_pages, speculative=s.speculative(),
                            headroom_pages=s.kv_headroom_pages, max_num_seqs=s.max_num_seqs,
                            prefix_caching=s.prefix_caching == "on", tp=s.decode_tp)


def as_bytes_tensor(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).reshape(1, -1).copy()


def token_ids(arr: np.ndarray) -> list[int]:
    return [int(t) for t in np.asarray(arr).reshape(-1)]
