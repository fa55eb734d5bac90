"""The prefix cache in the Triton layer: ``num_cached_tokens`` on every response,
TensorRT-LLM's ``return_perf_metrics`` outputs, ``cache_salt`` to the engine, the
Prometheus series."""
import sys
import types

import numpy as np
import pytest

from tandem.backends.engine.llm_engine import RequestOutput
from tandem.backends.engine.prefix_caching import PrefixCacheStats
from tandem.backends.engine.request_perf import RequestPerf
from tandem.backends.triton.generate_request import parse_token_request
from tandem.backends.triton.perf_outputs import PERF_OUTPUT_NAMES, PERF_OUTPUTS
from tandem.backends.triton.postprocess import ensemble_outputs
from tandem.backends.triton.response_stream import ResponseStream

from .fakes import metric, stand_in_pb_utils

PERF = RequestPerf(reused_pages=4, new_pages=1, total_pages=2, arrival_ns=10, first_scheduled_ns=11,
                   first_token_ns=12, last_token_ns=13, draft_tokens=8, accepted_draft_tokens=6)


def request(**inputs):
    arrays = {"input_ids": np.array([[5, 6, 7]], dtype=np.int32), "stream": np.array([[True]])}
    arrays.update({k: np.array([[v]], dtype=np.object_ if isinstance(v, bytes) else None)
                   for k, v in inputs.items()})
    return parse_token_request(arrays.get, vocab_size=100, max_model_len=64)


def replies(req):
    sent = []
    stream = ResponseStream(req, sent.append)
    stream.on_output(RequestOutput("r", [9], "x", True, "length", 3, 1, num_cached_tokens=64, perf=PERF))
    return sent[0].outputs


def test_num_cached_tokens_is_on_every_response_the_perf_outputs_behind_the_flag():
    plain = replies(request())
    assert int(plain["num_cached_tokens"][0, 0]) == 64
    assert all(int(plain[n][0, 0]) == 0 for n in PERF_OUTPUT_NAMES if n != "num_cached_tokens")
    full = replies(request(return_perf_metrics=True))
    values = {n: full[n][0, 0].item() for n in PERF_OUTPUT_NAMES}
    assert values == {"num_cached_tokens": 64, "kv_cache_alloc_new_blocks": 1, "kv_cache_reused_blocks": 4,
                      "kv_cache_alloc_total_blocks": 2, "arrival_time_ns": 10, "first_scheduled_time_ns": 11,
                      "first_token_time_ns": 12, "last_token_time_ns": 13, "acceptance_rate": 0.75,
                      "total_accepted_draft_tokens": 6, "total_draft_tokens": 8}
    for name, (_, dtype, _) in PERF_OUTPUTS.items():     # TensorRT-LLM's types, [1, 1]
        assert full[name].dtype == dtype and full[name].shape == (1, 1), name
    # postprocess passes them on to the ensemble's response unchanged
    out = ensemble_outputs(full.get)
    assert {n: out[n][0, 0].item() for n in PERF_OUTPUT_NAMES} == values


def test_cache_salt_reaches_the_engine_and_is_bounded():
    from tandem.backends.triton.generate_request import RequestError
    assert request(cache_salt=b"tenant-a").sampling_params().cache_salt == "tenant-a"
    assert request().sampling_params().cache_salt is None
    with pytest.raises(RequestError, match="cache_salt: has 300 characters"):
        request(cache_salt=b"x" * 300)


def test_prometheus_has_the_hit_rate_cached_pages_and_evictions(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stand_in_pb_utils())
    monkeypatch.delitem(sys.modules, "tandem.backends.triton.metrics", raising=False)
    from tandem.backends.triton.metrics import EngineMetrics
    m = EngineMetrics("llm", "1")
    engine = types.SimpleNamespace(spec_metrics=None, kv_pages=(30, 2),
                                   prefix_cache=PrefixCacheStats(400, 300, 12, 5))
    m.poll_engine(engine)
    engine.prefix_cache = PrefixCacheStats(500, 300, 10, 7)
    m.poll_engine(engine)
    assert (metric("tandem_prefix_cache_queries_total"), metric("tandem_prefix_cache_hits_total")) == (500, 300)
    assert metric("tandem_prefix_cache_evictions_total") == 7 and metric("tandem_prefix_cache_pages") == 10
    assert metric("tandem_prefix_cache_hit_rate") == pytest.approx(0.6)
