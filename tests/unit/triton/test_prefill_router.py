"""The decode server's router to prefill servers (backends/triton/prefill_router.py):
endpoints parsed strictly, and an endpoint that fails skipped for a while — briefly
when it refused the connection, longer and longer when it hung — without a server
(the router's clients are replaced by fakes that fail as tritonclient's do)."""
from __future__ import annotations

import numpy as np
import pytest

from tandem.backends.triton import prefill_router
from tandem.backends.triton.prefill_router import (HUNG_DOWN_S, REFUSED_DOWN_S, EndpointHealth, PrefillRouter,
                                                   PrefillUnavailable, parse_endpoints)


def test_endpoints_are_host_and_port():
    assert parse_endpoints("a:1, b:2,") == ["a:1", "b:2"]
    for bad in ("a", ":1", "a:0", "a:70000", "a:x"):
        with pytest.raises(ValueError, match="prefill_endpoints"):
            parse_endpoints(bad)


def test_a_hung_endpoint_is_skipped_longer_each_time_and_forgiven_on_success():
    h = EndpointHealth()
    h.failed(hung=True, now=0.0)
    assert h.down_for(0.0) == HUNG_DOWN_S[0]
    for _ in range(10):
        h.failed(hung=True, now=100.0)
    assert h.down_for(100.0) == HUNG_DOWN_S[1]          # capped
    h.succeeded()
    assert h.down_for(100.0) == 0.0
    h.failed(hung=False, now=200.0)                      # refused: a restart is near
    assert h.down_for(200.0) == REFUSED_DOWN_S


class Refusal(Exception):
    """As tritonclient's InferenceServerException: a status and a message."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self._status, self._message = status, message

    def status(self):
        return self._status

    def message(self):
        return self._message


class FakeClient:
    def __init__(self, outcome):
        self.outcome, self.calls, self.closed = outcome, 0, False

    def infer(self, model, inputs, client_timeout=None):
        self.calls += 1
        self.inputs = inputs
        if self.outcome is not None:
            raise self.outcome

    def close(self):
        self.closed = True


def router_with(monkeypatch, outcomes: dict, clock: list[float]):
    """A router whose endpoints answer as ``outcomes`` says (None: the job is taken)."""
    made: list[FakeClient] = []
    r = PrefillRouter(list(outcomes))

    def client(url):
        with r._lock:
            c = r._clients.get(url)
            if c is None:
                c = r._clients[url] = FakeClient(outcomes[url])
                made.append(c)
            return c
    monkeypatch.setattr(r, "_client", client)
    monkeypatch.setattr(prefill_router.time, "monotonic", lambda: clock[0])
    return r, made


IDS, DESC = np.array([1, 2, 3], dtype=np.int32), np.zeros(8, dtype=np.uint8)


def test_a_hung_server_costs_one_job_its_timeout_then_is_skipped(monkeypatch):
    clock = [0.0]
    hung = Refusal("StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded")
    r, made = router_with(monkeypatch, {"p:1": hung}, clock)
    with pytest.raises(PrefillUnavailable, match=r"^unavailable: no prefill server took the job: p:1: Deadline"):
        r.submit(IDS, DESC)
    assert made[0].closed                                  # a fresh channel next time
    clock[0] = 1.0
    with pytest.raises(PrefillUnavailable, match="skipped for 1.0 s more") as e:
        r.submit(IDS, DESC)
    assert str(e.value).endswith("retry") and len(made) == 1    # not tried again
    clock[0] = 2.5                                         # its time is up: tried again
    with pytest.raises(PrefillUnavailable, match="Deadline"):
        r.submit(IDS, DESC)
    assert len(made) == 2


def test_jobs_go_to_the_live_endpoint_while_the_other_is_down(monkeypatch):
    clock = [0.0]
    refused = Refusal("StatusCode.UNAVAILABLE", "failed to connect to all addresses")
    r, made = router_with(monkeypatch, {"dead:1": refused, "live:2": None}, clock)
    taken = [r.submit(IDS, DESC) for _ in range(4)]
    assert taken == ["live:2"] * 4
    assert sum(c.calls for c in made if c.outcome is not None) == 1   # skipped after its refusal


def test_a_job_the_server_refuses_does_not_mark_it_down(monkeypatch):
    clock = [0.0]
    bad = Refusal("StatusCode.INVALID_ARGUMENT", "kv_descriptor: forged")
    r, made = router_with(monkeypatch, {"p:1": bad}, clock)
    for _ in range(2):
        with pytest.raises(PrefillUnavailable, match="forged"):
            r.submit(IDS, DESC)
    assert made[0].calls == 2 and not made[0].closed


def test_the_router_says_when_no_prefill_server_takes_jobs_and_when_one_does(monkeypatch):
    clock, said = [100.0], []
    refused = Refusal("StatusCode.UNAVAILABLE", "failed to connect to all addresses")
    r, made = router_with(monkeypatch, {"p:1": refused}, clock)
    r._on_down = said.append
    with pytest.raises(PrefillUnavailable):
        r.submit(IDS, DESC)
    assert said == [100.0 + prefill_router.LOCAL_WHILE_DOWN_S]   # decode prefills meanwhile
    made[0].outcome = None
    clock[0] = 106.0
    monkeypatch.setattr(r, "_client", lambda url: made[0])
    assert r.submit(IDS, DESC) == "p:1" and said[-1] is None


def test_the_prompts_cache_salt_travels_with_the_job(monkeypatch):
    """The prefill server's prefix cache keys pages by the salt too: it goes along as
    the prefill model's optional ``cache_salt`` input (and is absent without one)."""
    r, made = router_with(monkeypatch, {"p:1": None}, [0.0])
    r.submit(IDS, DESC)
    assert [i.name() for i in made[0].inputs] == ["input_ids", "kv_descriptor"]
    r.submit(IDS, DESC, cache_salt="tenant-a")
    salt = made[0].inputs[-1]
    assert (salt.name(), salt.datatype(), salt.shape()) == ("cache_salt", "BYTES", [1, 1])
