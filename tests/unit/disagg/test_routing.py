"""Conditional disaggregation's routing policy as a pure function
(backends/disagg/routing.py), the decode load board, and the settings that carry it."""
from __future__ import annotations

import itertools
import os

import pytest

from tandem.backends.disagg.routing import (LOCAL, POLICIES, REASONS, REMOTE, DecodeLoad,
                                            PrefillLoad, Route, RoutingPolicy, choose_path)

P = RoutingPolicy()   # the defaults: local_prompt_tokens 256, 5000 tok/s, 1000 ms, 2048 tokens
IDLE, BUSY = PrefillLoad(), PrefillLoad(requests=4, tokens=6000)   # 0 s and 1.2 s of wait


@pytest.mark.parametrize("prompt_len", [2, 17, 100, 256])
@pytest.mark.parametrize("prefill", [IDLE, BUSY])
def test_short_prompts_prefill_where_they_decode(prompt_len, prefill):
    assert choose_path(prompt_len, prefill, DecodeLoad(), P) == Route(LOCAL, "short_prompt")


@pytest.mark.parametrize("prompt_len", [257, 1024, 2048, 100_000])
def test_long_prompts_go_to_an_idle_prefill_side(prompt_len):
    assert choose_path(prompt_len, IDLE, DecodeLoad(), P) == Route(REMOTE, "long_prompt")


def test_a_busy_prefill_side_keeps_long_prompts_here_while_decode_has_room():
    assert choose_path(1500, BUSY, DecodeLoad(prefill_tokens=0), P) == Route(LOCAL, "prefill_busy")
    assert choose_path(1500, BUSY, DecodeLoad(prefill_tokens=548), P) == Route(LOCAL, "prefill_busy")
    # decode's own backlog would pass max_local_prefill_tokens: queued there after all
    assert choose_path(1500, BUSY, DecodeLoad(prefill_tokens=549), P) == Route(REMOTE, "long_prompt")
    assert choose_path(3000, BUSY, DecodeLoad(), P) == Route(REMOTE, "long_prompt")


def test_the_wait_threshold_is_strict():
    at = PrefillLoad(requests=3, tokens=5000)        # exactly 1000 ms
    assert choose_path(1000, at, DecodeLoad(), P).path == REMOTE
    assert choose_path(1000, PrefillLoad(3, 5001), DecodeLoad(), P).path == LOCAL


def test_a_short_prompt_goes_to_the_prefill_side_when_decode_is_backed_up():
    assert choose_path(200, IDLE, DecodeLoad(prefill_tokens=1900), P) == Route(REMOTE, "decode_busy")
    assert choose_path(200, IDLE, DecodeLoad(prefill_tokens=1848), P) == Route(LOCAL, "short_prompt")


@pytest.mark.parametrize("mode", POLICIES)
def test_a_one_token_prompt_has_nothing_to_prefill_under_every_policy(mode):
    assert choose_path(1, BUSY, DecodeLoad(), RoutingPolicy(mode)) == Route(LOCAL, "no_prefill")


@pytest.mark.parametrize("prompt_len", [2, 300, 5000])
def test_fixed_policies_ignore_the_load(prompt_len):
    for prefill, decode in itertools.product((IDLE, BUSY), (DecodeLoad(), DecodeLoad(10_000))):
        assert choose_path(prompt_len, prefill, decode, RoutingPolicy("remote")) == Route(REMOTE, "policy")
        assert choose_path(prompt_len, prefill, decode, RoutingPolicy("local")) == Route(LOCAL, "policy")


def test_every_answer_is_a_known_path_and_reason():
    lengths, loads = (1, 2, 255, 256, 257, 2048, 4096), (0, 1000, 5000, 5001, 50_000)
    for n, tokens, backlog, mode in itertools.product(lengths, loads, loads, POLICIES):
        r = choose_path(n, PrefillLoad(1 if tokens else 0, tokens), DecodeLoad(backlog),
                        RoutingPolicy(mode))
        assert r.path in (LOCAL, REMOTE) and r.reason in REASONS


def test_thresholds_move_the_decision():
    tight = RoutingPolicy.parse("conditional:local_prompt_tokens=8,max_prefill_wait_ms=100,"
                                "prefill_tokens_per_s=1000,max_local_prefill_tokens=500")
    assert choose_path(8, IDLE, DecodeLoad(), tight).reason == "short_prompt"
    assert choose_path(9, IDLE, DecodeLoad(), tight).reason == "long_prompt"
    assert choose_path(9, PrefillLoad(1, 101), DecodeLoad(), tight).reason == "prefill_busy"
    assert tight.estimated_wait_s(PrefillLoad(1, 500)) == 0.5


@pytest.mark.parametrize("text, mode", [("", "conditional"), ("conditional", "conditional"),
                                        (" remote ", "remote"), ("local", "local"),
                                        ("conditional:", "conditional")])
def test_parse_policies(text, mode):
    assert RoutingPolicy.parse(text) == RoutingPolicy(mode)


@pytest.mark.parametrize("text, says", [
    ("always", "allowed: conditional, remote, local"),
    ("conditional:local_prompt_tokens", "is not name=value"),
    ("conditional:short=3", "is not name=value"),
    ("conditional:local_prompt_tokens=abc", "allowed: an integer"),
    ("conditional:local_prompt_tokens=-1", "allowed: an integer >= 0"),
    ("conditional:prefill_tokens_per_s=0", "allowed: an integer >= 1"),
])
def test_parse_refuses_with_what_is_allowed(text, says):
    with pytest.raises(ValueError, match=says):
        RoutingPolicy.parse(text)


def test_engine_settings_carry_the_policy():
    from tandem.backends.triton.settings import EngineSettings

    def settings(**params):
        cfg = {"parameters": {"model_dir": {"string_value": "/m"},
                              **{k: {"string_value": v} for k, v in params.items()}}}
        return EngineSettings.from_model_config(cfg)

    assert settings().routing_policy() == RoutingPolicy()
    assert settings(disagg_policy="${disagg_policy}").routing_policy() == RoutingPolicy()
    assert settings(disagg_policy="remote").routing_policy().mode == "remote"
    assert settings(torch_threads="1").idle_threads == 1
    assert settings(torch_threads="1", decode_idle_threads="2").idle_threads == 2
    assert settings(torch_threads="1").prefill_idle_threads_or_threads == 1
    assert settings(torch_threads="1", prefill_idle_threads="2").prefill_idle_threads_or_threads == 2
    with pytest.raises(ValueError, match="prefill_idle_threads=-1"):
        settings(prefill_idle_threads="-1")
    with pytest.raises(ValueError, match="config.pbtxt: disagg_policy 'x'"):
        settings(disagg_policy="x")


def test_serve_options_default_to_conditional_and_borrow_the_idle_prefill_core(tmp_path):
    from tandem.client.serve.options import ServeOptions, ServerError
    cores = str(os.cpu_count() or 2)
    values = ServeOptions.of(model_dir=str(tmp_path)).template_values()
    assert values["disagg_policy"] == "conditional" and values["decode_idle_threads"] == cores
    remote = ServeOptions.of(model_dir=str(tmp_path), disagg_policy="remote").template_values()
    assert remote["decode_idle_threads"] == "0"      # today's always-remote server, unchanged
    # prefill borrows decode's cores whenever it runs beside decode
    assert values["prefill_idle_threads"] == remote["prefill_idle_threads"] == cores
    fixed = ServeOptions.of(model_dir=str(tmp_path), torch_threads=1).template_values()
    assert fixed["decode_idle_threads"] == fixed["prefill_idle_threads"] == "0"   # threads given: no borrowing
    with pytest.raises(ServerError, match="--disagg-policy"):
        ServeOptions.of(model_dir=str(tmp_path), disagg_policy="sometimes").template_values()


def test_load_board_round_trip_and_a_dead_writer():
    from tandem.backends.disagg.decode_load import DecodeLoadBoard
    name = f"tandem-test-board-{os.getpid()}"
    assert DecodeLoadBoard.open_if_exists(name) is None
    writer = DecodeLoadBoard(name, create=True)
    reader = DecodeLoadBoard.open_if_exists(name)
    try:
        assert reader.read() == DecodeLoad(0)
        writer.publish(prefill_tokens=777)
        assert reader.read() == DecodeLoad(777)
        writer._words[2] = 2 ** 22 + 12345      # a pid that does not run: its backlog died with it
        assert reader.read() == DecodeLoad(0)
    finally:
        reader.close()
        writer.close(unlink=True)
    assert DecodeLoadBoard.open_if_exists(name) is None


def test_step_hook_publishes_the_backlog_and_switches_threads_with_the_prefill_side():
    import torch

    from tandem.backends.disagg.decode_load import DecodeLoadBoard, DecodeStepHook
    from tandem.backends.engine.sequence import Sequence

    class Sched:
        waiting = [Sequence("a", [1] * 300, None, frozenset())]
        running = [Sequence("b", [1] * 50, None, frozenset(), num_computed=20),
                   Sequence("c", [1] * 8, None, frozenset(), num_computed=8)]

    class Engine:
        scheduler = Sched()

    class Pool:
        reserved = 0

        def backlog(self):
            return self.reserved, self.reserved * 4

    name = f"tandem-test-hook-{os.getpid()}"
    board, pool, before = DecodeLoadBoard(name, create=True), Pool(), torch.get_num_threads()
    try:
        torch.set_num_threads(2)   # the team sized on the main thread, as decode does
        hook = DecodeStepHook(Engine(), pool, board, threads=1, idle_threads=2, borrow_min_seqs=2)
        hook()
        assert board.read() == DecodeLoad(330) and torch.get_num_threads() == 2
        pool.reserved = 1           # a prompt waits for the prefill side: its core goes back
        hook()
        assert torch.get_num_threads() == 1
        pool.reserved = 0
        hook()
        assert torch.get_num_threads() == 2
        Sched.running.pop()         # a batch too small to gain from a second core
        hook()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
        board.close(unlink=True)


def test_in_transit_matches_routes_against_what_decode_took_in():
    """A burst of short prompts: each sees the ones routed just before it, until decode
    has taken them in (then they are in its published backlog instead)."""
    from tandem.backends.disagg.decode_load import InTransit
    t = InTransit(horizon_s=2.0)
    assert t.observe(writer=5, taken_in=1000, now=0.0) == 0      # decode's count so far
    t.add(200, now=0.0)
    assert t.observe(5, 1000, now=0.01) == 200
    t.add(100, now=0.01)
    t.add(50, now=0.01)
    assert t.observe(5, 1250, now=0.02) == 100                   # first in, first matched
    assert t.observe(5, 1250, now=0.03) == 100                   # nothing new arrived
    assert t.observe(5, 1350, now=0.04) == 0
    t.add(300, now=0.04)
    assert t.observe(5, 1350, now=3.0) == 0                       # never arrived: dropped
    t.add(80, now=3.0)
    assert t.observe(9, 0, now=3.01) == 80                        # a new decode: its own count
    assert t.observe(9, 80, now=3.02) == 0


def test_routes_in_transit_turn_a_burst_of_short_prompts_remote():
    """kv_transfer's view during a burst: the backlog decode published has not grown
    yet, but what was routed to it has."""
    from tandem.backends.disagg.decode_load import InTransit
    policy, t, routes = RoutingPolicy(), InTransit(), []
    for i in range(12):
        backlog = DecodeLoad(prefill_tokens=0 + t.observe(writer=1, taken_in=0, now=i * 1e-3))
        route = choose_path(250, PrefillLoad(), backlog, policy)
        if route.path == LOCAL:
            t.add(250, now=i * 1e-3)
        routes.append(route.reason)
    assert routes == ["short_prompt"] * 8 + ["decode_busy"] * 4    # 8 x 250 = 2000 <= 2048


def test_step_hook_counts_the_prompt_tokens_it_takes_in_once():
    from tandem.backends.disagg.decode_load import DecodeLoadBoard, DecodeStepHook
    from tandem.backends.engine.sequence import Sequence

    class Sched:
        waiting = [Sequence("local", [1] * 30, None, frozenset()),
                   Sequence("remote", [1] * 40, None, frozenset(), num_computed=39)]
        running: list = []

    class Engine:
        scheduler = Sched()

    name = f"tandem-test-taken-{os.getpid()}"
    board = DecodeLoadBoard(name, create=True)
    try:
        hook = DecodeStepHook(Engine(), None, board, threads=1, idle_threads=1)
        hook()
        assert board.taken_in() == (os.getpid(), 30) and board.read() == DecodeLoad(31)
        Sched.running, Sched.waiting = Sched.waiting, []          # scheduled
        hook()
        Sched.running[1].num_computed = 0                         # preempted: recomputes,
        Sched.running, Sched.waiting = Sched.running[:1], Sched.running[1:]   # not new
        hook()
        assert board.taken_in() == (os.getpid(), 30)
        Sched.waiting = Sched.waiting + [Sequence("local2", [1] * 7, None, frozenset())]
        hook()
        assert board.taken_in()[1] == 37
    finally:
        board.close(unlink=True)


def test_a_long_prompt_is_prefilled_here_while_the_prefill_side_is_down():
    down = PrefillLoad(down=True)
    assert choose_path(1500, down, DecodeLoad(), P) == Route(LOCAL, "prefill_down")
    # no room here: to the prefill side, whose handoff then fails and leaves it to decode anyway
    assert choose_path(1500, down, DecodeLoad(prefill_tokens=1000), P) == Route(REMOTE, "long_prompt")
    for mode in ("remote", "local"):     # the fixed policies stay fixed
        assert choose_path(1500, down, DecodeLoad(), RoutingPolicy(mode)).reason == "policy"
