"""Stream latency bookkeeping behind the TTFT / ITL metrics."""
from tandem.backends.triton.latency import Deltas, StreamClock


def test_first_token_response_gives_ttft_then_gaps_give_itl():
    clock = StreamClock(start=100.0)
    assert clock.tokens(0, now=100.1) == (None, None)      # a response with no tokens
    assert clock.tokens(1, now=100.5) == (0.5, None)
    assert clock.tokens(4, now=100.75) == (None, 0.25)     # several accepted tokens: one gap
    assert clock.tokens(1, now=101.0) == (None, 0.25)


def test_deltas_turn_totals_into_increments_and_never_go_negative():
    d = Deltas()
    assert [d.take("a", t) for t in (3, 3, 10)] == [3, 0, 7]
    assert d.take("b", 5) == 5
    assert d.take("a", 2) == 0      # a reset source (restarted pool) never decrements a counter
