"""The serving benchmark's statistics: what its table and goals are computed from."""
from tandem.client.bench.serving_workload import StreamLog, percentile, poisson_arrivals, summarize


def test_poisson_arrivals_have_the_asked_rate_and_are_reproducible():
    xs = poisson_arrivals(0.5, 2000.0, seed=3)
    assert 900 < len(xs) < 1100 and xs == sorted(xs) and all(0 < x < 2000 for x in xs)
    assert xs == poisson_arrivals(0.5, 2000.0, seed=3) != poisson_arrivals(0.5, 2000.0, seed=4)
    assert poisson_arrivals(0.0, 10.0, seed=0) == []


def test_percentile_is_nearest_rank():
    xs = list(range(1, 101))
    assert (percentile(xs, 50), percentile(xs, 99), percentile(xs, 100)) == (50, 99, 100)
    assert percentile([], 50) is None


def test_summary_of_a_stalled_stream():
    """A stream with one 500 ms stall among 10 ms gaps: the median ITL stays at 10 ms,
    the max shows the stall, and its decode speed counts tokens after the first."""
    log = StreamLog("b0", "background", 10, sent_at=0.0)
    t = 0.1
    for i in range(100):
        log.events.append((t, 1))
        t += 0.5 if i == 50 else 0.01
    long = StreamLog("l0", "long", 1500, sent_at=0.2, events=[(0.9, 1), (0.95, 1)])
    s = summarize([log, long], window=(0.0, 10.0))
    assert s["itl_ms_p50"] == 10.0 and s["itl_ms_max"] == 500.0
    assert s["ttft_ms_p50"] == 700.0 and s["requests_long"] == 1
    assert log.decode_tokens_per_s() == 99 / (log.events[-1][0] - log.events[0][0])
    assert abs(long.decode_tokens_per_s() - 20.0) < 1e-9
    # the median over both streams
    assert s["decode_tok_s_median"] == round((log.decode_tokens_per_s() + long.decode_tokens_per_s()) / 2, 1)
