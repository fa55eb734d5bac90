"""The prefix-cache audit on a real server (``--kv-audit 1``): the test flips a byte in a
page decode cached in the shared pool (it maps the pool's shared memory, as kv_transfer
does), and the next request over that prefix gets the greedy reference anyway, every
time — on decode's own prefill (its cache hit is audited) and on the transfer path
(``--disagg-policy remote``: kv_transfer shares the cached pages into the reservation,
decode audits them when it claims it and prefills the prompt itself when one changed).
``tandem_prefix_cache_corrupt_pages_total`` counts each find; the pages come back."""
from __future__ import annotations

import random

import pytest
import torch

from tandem.client.generate import stream_generate

from .triton_calls import busy_pages, eventually, metric, settled

pytestmark = pytest.mark.e2e
SETTINGS = dict(page_size=4, max_num_batched_tokens=16, max_num_seqs=4)
PROMPT = list(range(5, 5 + 4 * 9 + 1))          # 9 full pages before its last token
ROUNDS = 3


@pytest.fixture(scope="module", params=["conditional", "remote"])
def server(request, serve):
    with serve(f"serve-audit-{request.param}", 240, mode="disaggregated", kv_audit=1.0,
               disagg_policy=request.param, **SETTINGS) as srv:
        yield srv


def tokens(server, prompt) -> list[int]:
    responses = list(stream_generate(server.grpc_url, prompt, model="tandem_tokens", timeout_s=60,
                                     max_tokens=8, temperature=0.0, stream=True))
    assert responses[-1].final and responses[-1].finish_reason in ("stop", "length")
    return [t for r in responses for t in r.output_ids]


def flip_a_cached_byte(server, prompt, rng) -> int:
    """Flip one byte of one of ``prompt``'s cached pages in the server's shared pool
    (any layer, K or V); returns the page."""
    from tandem.backends.disagg.kv_views import shared_page_pool
    from tandem.backends.engine.prefix_caching import prompt_page_keys
    from tandem.rdma import SharedKVPool

    pool = SharedKVPool.open(f"tandem-kv-{server.process.pid}-decode")
    try:
        keys = prompt_page_keys(prompt, SETTINGS["page_size"], pool.cache_root(), None)
        pages = pool.cache_pages(keys)
        assert len(pages) == len(keys) == 9, (pages, len(keys))
        page = rng.choice(pages)
        kv = shared_page_pool(pool, 0, "target").kv
        flat = kv[rng.randrange(kv.shape[0]), page].view(-1).view(torch.uint8)
        flat[rng.randrange(flat.numel())] ^= 0xFF
        return page
    finally:
        pool.close()


def test_a_flipped_cached_page_is_never_served(server, greedy_reference):
    want = greedy_reference(8, **SETTINGS)(PROMPT).token_ids
    assert tokens(server, PROMPT) == want                   # computed, and cached
    rng = random.Random(5)
    found0 = metric(server, "tandem_prefix_cache_corrupt_pages_total", "decode")
    for attempt in range(1, ROUNDS + 1):     # each round's request republished what it recomputed
        flip_a_cached_byte(server, PROMPT, rng)
        assert tokens(server, PROMPT) == want, f"round {attempt}: a changed page was served"

        def counted():
            assert metric(server, "tandem_prefix_cache_corrupt_pages_total", "decode") == found0 + attempt
        eventually(counted, timeout_s=30)
    assert metric(server, "tandem_prefix_cache_audited_pages_total", "decode") > 0
    # nothing stays reserved by a cut hit (in use: the cached pages, held by nobody)
    assert settled(lambda: busy_pages(server, "decode"))[1] == 0
