"""The decode engine on the shared pool when things go wrong: a cancelled request gives
its reservation up at once and its prefill stops; a dead kv_transfer's reservation is
reclaimed by decode's own housekeeping, and its request prefilled by decode (or, under
the ``fail`` policy, ended with a retryable error); kv_transfer reserving in another process
never makes a decode step fail; a forged descriptor is refused before the engine
sees it, and a prefill refuses one that does not fit it."""
from __future__ import annotations

import dataclasses
import secrets
import threading

import pytest

from tandem.backends.disagg import PoolHousekeeper, SharedPoolTicket, context_nbytes, decode_engine
from tandem.backends.engine import SamplingParams
from tandem.rdma import DestinationDescriptor
from tandem.rdma.shared_pool import CANCELLED
from tandem.rdma.wire import MalformedMessage

from ..rdma.fixtures import started_peers
from ..rdma.peers import wait_for
from .peers import Peer

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = list(range(5, 40))


class Outputs:
    def __init__(self):
        self.tokens, self.reason, self.error, self.code = [], None, None, None
        self.done = threading.Event()

    def __call__(self, out):
        self.tokens.extend(out.new_token_ids)
        if out.finished:
            self.reason, self.error, self.code = out.finish_reason, out.error, out.error_code
            self.done.set()


def counters(pool):
    s = pool.stats()
    return s.free, s.reserved, s.in_use, s.slots_active


def reserve(rx_peer, model_dir, n=len(PROMPT) - 1) -> DestinationDescriptor:
    return DestinationDescriptor.from_bytes(rx_peer(
        "rx_reserve", n, context_nbytes=(context_nbytes(model_dir, "float32"),)))


@pytest.fixture
def doomed_peer():
    with started_peers(Peer) as start:
        yield start


def test_a_cancelled_request_frees_its_reservation_and_stops_its_prefill(
        demo_checkpoint, make_decode_pool, rx_peer, prefill_peer):
    model_dir = str(demo_checkpoint)
    pool = make_decode_pool(model_dir)
    start = counters(pool)
    rx_peer("rx_start", pool.spec.name, fail_grace_s=30.0)
    # the prefill holds its job a while: the request is cancelled before it starts
    prefill_peer("prefill_start", model_dir, page_size=4, num_pages=32,
                 faults="prefill_delay_ms=800")
    prefill_pages = prefill_peer("prefill_pages")
    engine = decode_engine(pool, model_dir, dtype="float32")
    engine.start()
    try:
        d = reserve(rx_peer, model_dir)
        out = Outputs()
        rid = engine.submit_prefilled(PROMPT, GREEDY,
                                      SharedPoolTicket.for_descriptor(pool, d.to_bytes()), out)
        prefill_peer.send("prefill_run", [(d.to_bytes(), PROMPT)])
        engine.abort(rid)
        assert out.done.wait(30) and out.reason == "abort"
        # given up at once: the receiver ends it, its pages come back
        wait_for(lambda: pool.poll(d.slot, d.generation).failed)
        st = pool.poll(d.slot, d.generation)
        assert st.error == CANCELLED and counters(pool) == start
        # the prefill learns it when it opens the transfer, and stops
        [result] = prefill_peer.result(30)
        assert "refused" in result and "not live" in result
        assert prefill_peer("prefill_pages") == prefill_pages
    finally:
        engine.shutdown()
    prefill_peer("prefill_start", model_dir, page_size=4, num_pages=32)


def _dead_kv_transfer(model_dir, pool, doomed_peer, **engine_args):
    """A request whose reservation's owner (kv_transfer) is killed before any KV came:
    its output and the engine's failure counters, after decode's housekeeping reclaimed
    the reservation."""
    start = counters(pool)
    rx = doomed_peer("kv_transfer-doomed")
    rx("rx_start", pool.spec.name, fail_grace_s=30.0, timeout_s=600.0)   # no lease saves us
    housekeeper = PoolHousekeeper(pool, every_s=0.05)
    engine = decode_engine(pool, model_dir, dtype="float32", **engine_args)
    engine.start()
    try:
        d = reserve(rx, model_dir)
        out = Outputs()
        engine.submit_prefilled(PROMPT, GREEDY, SharedPoolTicket.for_descriptor(pool, d.to_bytes()),
                                out)
        rx.kill()
        assert out.done.wait(60)
        wait_for(lambda: counters(pool) == start)   # the reclaimed and the served pages are back
        return out, engine.transfer_failures, engine.transfer_recomputes
    finally:
        engine.shutdown()
        housekeeper.stop()


def test_a_request_whose_transfer_failed_is_prefilled_by_decode(demo_checkpoint, make_decode_pool,
                                                                doomed_peer):
    """kv_load_failure_policy "recompute" (the default): the request costs time, not its
    answer — the greedy tokens are the ones a request decode prefilled from the start gets."""
    model_dir = str(demo_checkpoint)
    pool = make_decode_pool(model_dir)
    out, failures, recomputed = _dead_kv_transfer(model_dir, pool, doomed_peer)
    assert out.reason == "length" and out.error is None, out.error
    assert failures == {"owner_died": 1} and recomputed == 1
    reference = Outputs()
    engine = decode_engine(pool, model_dir, dtype="float32")
    engine.start()
    try:
        engine.submit(PROMPT, GREEDY, reference)
        assert reference.done.wait(60) and reference.reason == "length"
    finally:
        engine.shutdown()
    assert out.tokens == reference.tokens and len(out.tokens) == GREEDY.max_tokens


def test_decode_reclaims_a_dead_kv_transfers_reservation(demo_checkpoint, make_decode_pool,
                                                         doomed_peer):
    """kv_load_failure_policy "fail": the request ends with a clear, retryable error."""
    model_dir = str(demo_checkpoint)
    pool = make_decode_pool(model_dir)
    out, failures, recomputed = _dead_kv_transfer(model_dir, pool, doomed_peer,
                                                  kv_load_failure_policy="fail")
    assert out.reason == "error"
    assert "the process holding the reservation died" in out.error
    assert out.code == "UNAVAILABLE"          # not the request's fault: retry
    assert failures == {"owner_died": 1} and recomputed == 0


def test_kv_transfer_reserving_meanwhile_never_fails_a_decode_step(
        demo_checkpoint, make_decode_pool, doomed_peer):
    """kv_transfer reserves in its own process: the decoder's allocation is decided
    under the pool's lock, so a page taken in between means 'wait' (or preempt),
    never an exception that ends the batch."""
    model_dir = str(demo_checkpoint)
    pool = make_decode_pool(model_dir, num_pages=24)
    churn = doomed_peer("kv_transfer-churn")
    churn("pool_open", pool.spec.name)
    engine = decode_engine(pool, model_dir, dtype="float32", max_num_batched_tokens=64)
    engine.start()
    try:
        outs = [Outputs() for _ in range(6)]
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        for i, out in enumerate(outs):
            engine.submit(list(range(3 + i, 20 + i)), params, out)
        churn.send("pool_reserve_churn", 4.0, 1)
        for out in outs:
            assert out.done.wait(120)
        assert [o.reason for o in outs] == ["length"] * 6, [o.error for o in outs]
        assert [len(o.tokens) for o in outs] == [24] * 6
        made, full = churn.result(120)
        assert made and full      # it did take pages the engine was after
    finally:
        engine.shutdown()
    assert pool.stats().free == 24


def test_forged_descriptors_are_refused_before_the_engine(demo_checkpoint, make_decode_pool,
                                                          rx_peer, prefill_peer):
    model_dir = str(demo_checkpoint)
    pool = make_decode_pool(model_dir)
    rx_peer("rx_start", pool.spec.name)
    d = reserve(rx_peer, model_dir)
    forged = {
        "wrong secret": dataclasses.replace(d, secret=secrets.token_bytes(16), _plan=None),
        "slot out of range": dataclasses.replace(d, slot=pool.spec.num_slots + 5, _plan=None),
        "another generation": dataclasses.replace(d, generation=d.generation + 1, _plan=None),
        "page out of range": dataclasses.replace(d, page_ids=d.page_ids[:-1] + (10**6,),
                                                 _plan=None),
    }
    for why, f in forged.items():
        with pytest.raises(MalformedMessage):
            SharedPoolTicket.for_descriptor(pool, f.to_bytes(), len(PROMPT))
    with pytest.raises(MalformedMessage, match="holds"):
        SharedPoolTicket.for_descriptor(pool, d.to_bytes(), len(PROMPT) + 1)
    assert SharedPoolTicket.for_descriptor(pool, d.to_bytes(), len(PROMPT)).secret == d.secret
    # a prefill refuses what does not fit it, on the submitting thread
    prefill_peer("prefill_start", model_dir, page_size=4, num_pages=32)
    no_ctx = dataclasses.replace(d, context_nbytes=(8,), _plan=None)
    assert "context blobs" in prefill_peer("prefill_submit", no_ctx.to_bytes(), PROMPT)
    pool.cancel(d.slot, d.generation, d.secret)


def test_the_kv_transfer_settings_and_their_environment_fallbacks(monkeypatch):
    from tandem.backends.disagg import default_headroom
    from tandem.backends.triton.settings import EngineSettings

    def settings(**params):
        cfg = {"parameters": {k: {"string_value": str(v)} for k, v in
                              {"model_dir": "/m", **params}.items()}}
        return EngineSettings.from_model_config(cfg)
    monkeypatch.delenv("TANDEM_KV_INTERFACE", raising=False)
    monkeypatch.delenv("TANDEM_KV_TRANSPORTS", raising=False)
    monkeypatch.delenv("TANDEM_FAULTS", raising=False)
    s = settings()
    assert (s.net_devices, s.transports, s.fault_plan(), s.kv_headroom_pages) == ("lo", "", None, None)
    monkeypatch.setenv("TANDEM_KV_INTERFACE", "eth0")
    monkeypatch.setenv("TANDEM_KV_TRANSPORTS", "tcp")
    monkeypatch.setenv("TANDEM_FAULTS", "drop_sender=0.5")
    s = settings()
    assert s.net_devices == "eth0" and s.transports == "tcp" and s.fault_plan().drop_sender == 0.5
    s = settings(kv_interface="all", kv_transports="tcp,sm", faults="transfer_fail=1@at_counter", kv_headroom_pages=4)
    assert s.net_devices == "all" and s.transports == "tcp,sm"
    assert s.fault_plan().transfer_fail_at == "at_counter"
    assert s.kv_headroom_pages == 4
    with pytest.raises(ValueError, match="faults: .*transfer_fail=3"):
        settings(faults="transfer_fail=3")
    with pytest.raises(ValueError, match="kv_drain_s"):
        settings(kv_drain_s=0)
    # one page per running sequence (and its speculative lookahead), at most a quarter
    assert default_headroom(4096, 16, 64) == 64 and default_headroom(40, 4, 64) == 10
