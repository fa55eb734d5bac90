"""The requests in flight (backends/triton/in_flight.py): cancellations and aborts,
once each."""

from __future__ import annotations

from .fakes import FakeEngine, Request


def test_in_flight_applies_a_cancellation_that_comes_before_submit_returns():
    from tandem.backends.triton.generate_request import GenerateRequest
    from tandem.backends.triton.in_flight import InFlight
    from tandem.backends.triton.response_stream import ResponseStream

    engine = FakeEngine("/x")
    in_flight = InFlight(engine, poll_s=0.005)
    try:
        sent = []
        early = ResponseStream(GenerateRequest([1], stream=True), sent.append)
        in_flight.add("k1", Request(), early)
        assert in_flight.cancel("k1") and early.closed and sent[-1].code == "CANCELLED"
        assert engine.aborted == []                  # no engine request id yet
        in_flight.started("k1", "req-7")
        assert engine.aborted == ["req-7"]
        in_flight.submitted("k1")
        assert len(in_flight) == 0
        assert not in_flight.cancel("k1") and not in_flight.cancel("unknown")

        late = ResponseStream(GenerateRequest([1], stream=True), sent.append)
        in_flight.add("k2", Request(), late)
        in_flight.started("k2", "req-8")
        in_flight.submitted("k2")
        assert in_flight.cancel("k2") and engine.aborted == ["req-7", "req-8"]
        assert len(in_flight) == 0
    finally:
        in_flight.close("bye")


def test_a_stream_that_ended_aborts_its_unfinished_sequences_once():
    """The submitting thread and the cancel watcher may both see a stream close (a
    sibling was refused): its running sequences are aborted once, not once per observer."""
    from tandem.backends.triton.generate_request import GenerateRequest
    from tandem.backends.triton.in_flight import InFlight
    from tandem.backends.triton.response_stream import ResponseStream

    engine = FakeEngine("/x")
    in_flight = InFlight(engine, poll_s=3600)      # the watcher stays asleep: ended() by hand
    try:
        stream = ResponseStream(GenerateRequest([1], stream=True, num_return_sequences=2), [].append)
        in_flight.add("k", Request(), stream)
        in_flight.started("k", "req-0", 0)
        assert stream.fail("the pool is too small")
        in_flight.ended("k")             # the submitting thread
        in_flight.ended("k")             # the watcher, before submitted() forgets the entry
        in_flight.submitted("k")
        assert engine.aborted == ["req-0"] and len(in_flight) == 0
    finally:
        in_flight.close("bye")
