"""The serving benchmark's statistics: what its table and goals are computed from."""
from tandem.client.bench.request_client import RequestOutput
from tandem.client.bench.serving_workload import poisson_arrivals, summarize, timed_gaps


def test_poisson_arrivals_have_the_asked_rate_and_are_reproducible():
    xs = poisson_arrivals(0.5, 2000.0, seed=3)
    assert 900 < len(xs) < 1100 and xs == sorted(xs) and all(0 < x < 2000 for x in xs)
    assert xs == poisson_arrivals(0.5, 2000.0, seed=3) != poisson_arrivals(0.5, 2000.0, seed=4)
    assert poisson_arrivals(0.0, 10.0, seed=0) == []


def test_summary_of_a_stalled_stream():
    """A stream with one 500 ms stall among 10 ms gaps: the median ITL stays at 10 ms,
    the max shows the stall, and its decode speed counts tokens after the first."""
    log = RequestOutput("background", "b0", start=0.0, prompt_tokens=10)
    t = 0.1
    for i in range(100):
        log.chunk_s.append(t)
        log.chunk_tokens.append(1)
        t += 0.5 if i == 50 else 0.01
    long = RequestOutput("long", "l0", start=0.2, prompt_tokens=1500, chunk_s=[0.7, 0.75], chunk_tokens=[1, 1])
    s = summarize([log, long], window=(0.0, 10.0))
    assert s["itl_ms_p50"] == 10.0 and s["itl_ms_max"] == 500.0
    assert s["ttft_ms_p50"] == 700.0 and s["requests_long"] == 1
    assert log.decode_tokens_per_s() == 99 / (log.chunk_s[-1] - log.chunk_s[0])
    assert abs(long.decode_tokens_per_s() - 20.0) < 1e-9
    # the median over both streams
    assert s["decode_tok_s_median"] == round((log.decode_tokens_per_s() + long.decode_tokens_per_s()) / 2, 1)


def test_the_window_is_on_the_requests_clock():
    """Gaps are placed at start + arrival: a request sent late has its gaps late, and a
    window before them counts none."""
    late = RequestOutput("long", "l1", start=100.0, chunk_s=[0.5, 0.6, 0.8], chunk_tokens=[1, 1, 1])
    assert [(round(t, 6), round(g, 6)) for t, g in timed_gaps(late)] == [(100.6, 0.1), (100.8, 0.2)]
    s = summarize([late], window=(0.0, 50.0))
    assert s["itl_ms_p50"] is None and s["requests_long"] == 0 and s["decode_tok_s_median"] is None
    s = summarize([late], window=(99.0, 101.0))
    assert s["itl_ms_p50"] == 150.0 and s["ttft_ms_p50"] == 500.0     # linear: between 100 and 200 ms
