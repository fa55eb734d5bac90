"""Prefix caching on a real tritonserver (`tandem serve --mode colocated`, caching on by
default): a repeated prompt's KV comes from the cache, its greedy text unchanged, as the
responses (``num_cached_tokens``, ``return_perf_metrics``) and the metrics say; a
``cache_salt`` keeps prefixes apart."""
from __future__ import annotations

import json
import time

import pytest

from tandem.client.serve.options import ServeOptions
from tandem.client.serve.triton_server import TritonServer

from .triton_calls import http_post, metric

pytestmark = pytest.mark.e2e
MODEL = "tandem_colocated"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n" * 6


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_checkpoint):
    run_dir = tmp_path_factory.mktemp("serve")
    srv = TritonServer(ServeOptions.of(model_dir=str(demo_checkpoint), torch_threads=1, max_num_seqs=4,
                                       mode="colocated", enforce_eager=True),
                       run_dir=run_dir, log_file=run_dir / "tritonserver.log", ready_timeout_s=180,
                       exit_timeout_s=30)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


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
    deadline = time.monotonic() + 10    # the models' metrics are polled every 0.5 s
    while metric(server, "tandem_prefix_cache_hits_total", "llm") < warm["num_cached_tokens"]:
        assert time.monotonic() < deadline, "tandem_prefix_cache_hits_total never counted the hit"
        time.sleep(0.2)
    assert metric(server, "tandem_prefix_cache_pages", "llm") > 0


def test_a_salt_keeps_prefixes_apart(server):
    first, again = generate(server, cache_salt="tenant-a"), generate(server, cache_salt="tenant-a")
    assert first["num_cached_tokens"] == 0 and again["num_cached_tokens"] > 0
    assert generate(server, cache_salt="tenant-b")["num_cached_tokens"] == 0
    assert first["text_output"] == again["text_output"]
