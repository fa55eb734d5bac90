"""Prefix caching on a real tritonserver, caching on by default: a repeated prompt's KV
comes from the cache, its greedy text unchanged, as the responses (``num_cached_tokens``,
``return_perf_metrics``) and the metrics say; a ``cache_salt`` keeps prefixes apart.

Colocated (`--mode colocated`) and disaggregated: there decode's cache lives in the
shared pool, kv_transfer routes a prompt whose prefix decode holds as the short prompt
it then is (prefilled in decode from the cache), and a longer new suffix goes to the
prefill side, which sends only the pages decode lacks."""
from __future__ import annotations

import json

import pytest

from .triton_calls import eventually, http_post, metric, settled

pytestmark = pytest.mark.e2e
MODEL = "tandem_colocated"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n" * 6


@pytest.fixture(scope="module")
def server(serve):
    with serve("serve", max_num_seqs=4, mode="colocated") as srv:
        yield srv


def generate(server, **extra):
    status, body = http_post(server, MODEL, "generate", {"text_input": PROMPT, "max_tokens": 8, "temperature": 0,
                                                         "return_perf_metrics": True, **extra})
    assert status == 200, body
    return json.loads(body)


def test_a_repeated_prompt_is_served_from_the_cache_with_the_same_text(server):
    cold, warm = generate(server), generate(server)
    assert cold["num_cached_tokens"] == 0 and cold["kv_cache_reused_blocks"] == 0
    assert warm["num_cached_tokens"] > 0 and warm["num_cached_tokens"] == 16 * warm["kv_cache_reused_blocks"]
    assert warm["num_cached_tokens"] >= cold["num_input_tokens"] - 16
    assert warm["text_output"] == cold["text_output"]
    assert warm["kv_cache_alloc_new_blocks"] < cold["kv_cache_alloc_new_blocks"]
    assert 0 < warm["arrival_time_ns"] <= warm["first_scheduled_time_ns"] <= warm["first_token_time_ns"] \
        <= warm["last_token_time_ns"]

    def counted():   # the models' metrics are polled every 0.5 s
        assert metric(server, "tandem_prefix_cache_hits_total", "llm") >= warm["num_cached_tokens"], \
            "tandem_prefix_cache_hits_total never counted the hit"
    eventually(counted)
    assert metric(server, "tandem_prefix_cache_pages", "llm") > 0


def test_a_salt_keeps_prefixes_apart(server):
    first, again = generate(server, cache_salt="tenant-a"), generate(server, cache_salt="tenant-a")
    assert first["num_cached_tokens"] == 0 and again["num_cached_tokens"] > 0
    assert generate(server, cache_salt="tenant-b")["num_cached_tokens"] == 0
    assert first["text_output"] == again["text_output"]


# -- disaggregated ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def disagg(serve):
    # prompts of more than 16 uncached tokens go to the prefill process
    with serve("serve-disagg", 240, max_num_seqs=4, mode="disaggregated",
               disagg_policy="conditional:local_prompt_tokens=16") as srv:
        yield srv


def disagg_generate(server, prompt, **extra):
    status, body = http_post(server, "tandem", "generate", {"text_input": prompt, "max_tokens": 8,
                                                            "temperature": 0, **extra})
    assert status == 200, body
    return json.loads(body)


def routed(server, path, reason) -> float:
    return metric(server, "tandem_disagg_requests_total", "kv_transfer", path=path, reason=reason)


def received_bytes(server) -> float:
    """kv_transfer's received bytes once the metric (polled every 0.5 s) stopped moving."""
    return settled(lambda: metric(server, "tandem_kv_received_bytes_total", "kv_transfer"))


def test_disaggregated_a_cached_prefix_makes_a_long_prompt_short(disagg):
    cold = disagg_generate(disagg, PROMPT, cache_salt="a")
    assert cold["num_cached_tokens"] == 0
    before = routed(disagg, "local", "cached_prefix")
    warm = disagg_generate(disagg, PROMPT, cache_salt="a")
    assert warm["num_cached_tokens"] >= cold["num_input_tokens"] - 16 > 0
    assert warm["text_output"] == cold["text_output"]

    def routed_as_cached():
        assert routed(disagg, "local", "cached_prefix") > before, "kv_transfer never routed the warm prompt as cached"
    eventually(routed_as_cached)


def test_disaggregated_prefill_sends_only_what_decode_lacks(disagg):
    """A new turn on a cached conversation goes to the prefill process, which sends only
    the pages after decode's cached prefix; the text equals the one computed from
    nothing (another salt shares nothing)."""
    turn = PROMPT + "\n\nclass Tree:\n    def __init__(self, left, right):\n        self.left = left\n" * 2
    n0 = disagg_generate(disagg, PROMPT, cache_salt="b")["num_input_tokens"]   # decode caches it
    before = routed(disagg, "remote", "long_prompt")
    b0 = received_bytes(disagg)
    cached = disagg_generate(disagg, turn, cache_salt="b")
    b1 = received_bytes(disagg)
    fresh = disagg_generate(disagg, turn, cache_salt="c")
    b2 = received_bytes(disagg)
    assert fresh["num_cached_tokens"] == 0
    # KV bytes over UCX (pages and the one context blob): the cached pages stayed behind
    pages, shared = -(-(fresh["num_input_tokens"] - 1) // 16), cached["num_cached_tokens"] // 16
    assert 0 < b1 - b0 < (b2 - b1) * (pages - shared + 1) / pages
    # the prefill process had the conversation cached too: it computed only the turn

    def prefill_hit():
        assert metric(disagg, "tandem_prefix_cache_hits_total", "prefill") > 0, \
            "the prefill's own cache never counted a hit"
    eventually(prefill_hit)
    assert metric(disagg, "tandem_prefix_cache_hits_total", "decode") >= cached["num_cached_tokens"]
    # the turn's tokens may part from the conversation's in its last page
    assert cached["num_cached_tokens"] >= 16 * ((n0 - 1) // 16 - 1) > 0
    assert cached["num_cached_tokens"] % 16 == 0
    assert cached["text_output"] == fresh["text_output"]
    assert routed(disagg, "remote", "long_prompt") >= before + 2
