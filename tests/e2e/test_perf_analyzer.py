"""Triton's perf_analyzer (from the tritonclient wheel) against the colocated streaming model.

A real tritonserver on the tiny demo checkpoint; perf_analyzer over gRPC with
--streaming. Exact request counts (--request-count) rather than stability windows,
so the run is short and its count is known. A perf_analyzer that cannot load its
libraries fails the tests with what to install; it never skips them.
"""

from __future__ import annotations

import pytest

from tandem.client.bench.perf_analyzer import PerfAnalyzerError, PerfAnalyzerUnavailable, PerfOptions, check, profile

pytestmark = pytest.mark.e2e

# the disaggregated streaming ensemble (preprocess -> kv_transfer -> prefill -> decode -> postprocess)
MODEL_NAME = "tandem"
REQUESTS = 8
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def analyzer():
    """perf_analyzer's version line; fails (not skips) the tests when it cannot start."""
    try:
        return check()
    except PerfAnalyzerUnavailable as exc:
        message = str(exc)
    pytest.fail(message, pytrace=False)  # outside the except: no chained traceback around the hint


@pytest.fixture(scope="module")
def server(analyzer, serve):
    with serve("perf", 180, exit_timeout_s=10, max_num_seqs=8, mode="disaggregated") as srv:
        yield srv


def options(server, **overrides) -> PerfOptions:
    return PerfOptions(**{"url": server.grpc_url, "model": MODEL_NAME, "concurrency": (1, 2),
                          "max_tokens": MAX_TOKENS, "temperature": 0.0, "request_count": REQUESTS,
                          "timeout_s": 60, **overrides})


def test_streaming_perf_analyzer_completes_at_concurrency_1_and_2(analyzer, server, tmp_path):
    assert analyzer.startswith("Perf Analyzer Version 2.51")
    points = profile(options(server), tmp_path)

    assert [p.concurrency for p in points] == [1, 2]
    for p in points:
        assert p.request_count == REQUESTS, p
        assert p.throughput_per_s > 0 and p.response_throughput_per_s > p.throughput_per_s, p
        # every measured request streamed several responses and ended with a finish reason
        assert p.unfinished_requests == 0, p
        assert 1 < p.responses_per_request <= p.output_tokens_per_request <= MAX_TOKENS, p
        assert 0 < p.first_response.avg_ms < p.latency.avg_ms, p
    assert (tmp_path / "c2.profile.json").exists() and (tmp_path / "c2.csv").exists()


def test_a_request_error_fails_the_run_with_the_servers_message(analyzer, server, tmp_path):
    with pytest.raises(PerfAnalyzerError, match=r"max_tokens: got 0; allowed"):
        profile(options(server, concurrency=(1,), max_tokens=0, request_count=2), tmp_path)


def test_an_unknown_model_fails_the_run(analyzer, server, tmp_path):
    with pytest.raises(PerfAnalyzerError, match="no_such_model"):
        profile(options(server, model="no_such_model", concurrency=(1,), request_count=2), tmp_path)
