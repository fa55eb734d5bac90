"""The prefill router's cache-aware order (backends/triton/prefill_router.py over
backends/disagg/prefix_affinity.py): a prompt whose prefix an endpoint prefilled goes
there again, the others stay the fallbacks, an endpoint that failed loses its index,
and ``prefill_routing`` is a ``tandem serve`` option (fake clients, no server)."""
from __future__ import annotations

import argparse
from dataclasses import fields

import numpy as np
import pytest

from tandem.backends.disagg.prefix_affinity import PREFILL_ROUTINGS, AffinityPolicy
from tandem.backends.triton import prefill_router
from tandem.backends.triton.prefill_router import REFUSED_DOWN_S, PrefillRouter
from tandem.backends.triton.settings import EngineSettings, flag_of

from .test_prefill_router import FakeClient, Refusal

DESC = np.zeros(8, dtype=np.uint8)
REFUSED = Refusal("StatusCode.UNAVAILABLE", "failed to connect to all addresses")


def routed(monkeypatch, urls, clock, **options):
    """A router over ``urls`` whose fake clients answer as ``outcome[url]`` (None: taken)."""
    r, outcome = PrefillRouter(list(urls), **options), dict.fromkeys(urls)
    calls: list[str] = []

    def client(url):
        fake = FakeClient(outcome[url])
        real_infer = fake.infer

        def infer(*args, **kwargs):
            calls.append(url)
            return real_infer(*args, **kwargs)
        fake.infer = infer
        return fake
    monkeypatch.setattr(r, "_client", client)
    monkeypatch.setattr(prefill_router.time, "monotonic", lambda: clock[0])
    return r, outcome, calls


def chat(user: int, turn: int) -> np.ndarray:
    """A conversation resent whole each turn: ``turn`` earlier turns of 48 tokens, then new ones."""
    return np.array([user * 10_000 + i for i in range(48 * (turn + 1))] + [1, 2], dtype=np.int32)


def test_each_conversation_stays_on_the_endpoint_that_prefilled_it(monkeypatch):
    clock = [0.0]
    r, _, _ = routed(monkeypatch, ["a:1", "b:2", "c:3"], clock, affinity=AffinityPolicy(page_size=16))
    where = {}
    for turn in range(4):
        for user in range(6):
            clock[0] += 1.0
            url = r.submit(chat(user, turn), DESC)
            assert where.setdefault(user, url) == url, (user, turn)
    assert sorted(where.values()) == ["a:1", "a:1", "b:2", "b:2", "c:3", "c:3"]


def test_round_robin_routing_ignores_the_prefix(monkeypatch):
    clock = [0.0]
    r, _, _ = routed(monkeypatch, ["a:1", "b:2"], clock, routing="round_robin")
    assert [r.submit(chat(1, 0), DESC) for _ in range(4)] == ["a:1", "b:2", "a:1", "b:2"]


def test_an_endpoint_that_failed_is_not_trusted_with_its_old_prefixes(monkeypatch):
    clock = [0.0]
    r, outcome, calls = routed(monkeypatch, ["a:1", "b:2"], clock)
    assert r.submit(chat(1, 0), DESC) == "a:1"
    outcome["a:1"] = REFUSED                              # a:1 goes down
    clock[0] = 10.0
    assert r.submit(chat(1, 1), DESC) == "b:2"   # tried first (cached), then the fallback
    assert calls == ["a:1", "a:1", "b:2"] and r._affinity.pages(0) == 0
    outcome["a:1"] = None                                 # restarted, empty
    clock[0] = 10.0 + REFUSED_DOWN_S + 20.0
    assert [r.submit(chat(1, t), DESC) for t in (2, 3)] == ["b:2", "b:2"]


def test_a_job_the_server_refuses_keeps_its_index(monkeypatch):
    clock = [0.0]
    r, outcome, _ = routed(monkeypatch, ["a:1", "b:2"], clock)
    r.submit(chat(1, 0), DESC)
    outcome["a:1"] = Refusal("StatusCode.INVALID_ARGUMENT", "kv_descriptor: forged")
    assert r.submit(chat(1, 1), DESC) == "b:2"
    assert r._affinity.pages(0) == 3                      # the server is up: its cache is too


def test_a_hot_prefix_spills_when_its_endpoint_is_far_behind(monkeypatch):
    clock = [0.0]
    r, _, _ = routed(monkeypatch, ["a:1", "b:2"], clock, affinity=AffinityPolicy(tokens_per_s=100))
    system, taken = list(range(256)), []
    for s in range(30):                                   # 39 new tokens every 0.1 s; 10 done meanwhile
        clock[0] = 0.0 if s == 0 else 10.0 + 0.1 * s
        taken.append(r.submit(np.array(system + [9000 + s] * 40, dtype=np.int32), DESC))
    assert taken[:6] == ["a:1"] * 6 and "b:2" in taken


def test_an_unknown_routing_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="prefill_routing 'nearest'; allowed: cache_aware, round_robin"):
        PrefillRouter(["a:1"], routing="nearest")


def test_prefill_routing_is_a_serve_option_with_the_routers_choices():
    (f,) = [f for f in fields(EngineSettings) if f.name == "prefill_routing"]
    assert flag_of(f).flag == "--prefill-routing" and flag_of(f).choices == PREFILL_ROUTINGS
    assert EngineSettings().prefill_routing == "cache_aware"
    from tandem.client.serve.flags import add_flags, from_args
    p = argparse.ArgumentParser()
    add_flags(p, EngineSettings)
    assert from_args(EngineSettings, p.parse_args(["--prefill-routing", "round_robin"])).prefill_routing \
        == "round_robin"
    cfg = {"parameters": {"model_dir": {"string_value": "/m"}, "prefill_routing": {"string_value": "round_robin"}}}
    assert EngineSettings.from_model_config(cfg).prefill_routing == "round_robin"
