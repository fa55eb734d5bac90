"""``tandem bench prefix``' pure parts: the chat turns resend the conversation exactly,
the system prompt is shared, texts never repeat across levels, the cached share, the
goals' ratios per path and the disaggregated routing counts (no server, no timing
thresholds)."""
from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from tandem.client.bench import prefix
from tandem.client.bench.request_client import RequestOutput
from tandem.client.bench.sse import parse_event
from tandem.client.bench.prefix_workload import (ASSISTANT, USER, Conversation, cached_share, conversations,
                                                 level_stats, offsets, pieces_per_level, system_prompts)


@pytest.mark.parametrize("turns", [1, 2, 5])
def test_each_turn_extends_the_previous_conversation_exactly(turns):
    conv = Conversation([f"message {i}" for i in range(turns)])
    reply, prompts = None, []
    while not conv.done:
        prompts.append(conv.next(reply))
        reply = f" reply {len(prompts)}"
    assert prompts[0] == f"{USER}message 0{ASSISTANT}"
    for k in range(1, turns):
        assert prompts[k] == prompts[k - 1] + f" reply {k}" + f"{USER}message {k}{ASSISTANT}"
        assert prompts[k].startswith(prompts[k - 1])


def test_conversations_deal_messages_in_order():
    convs = conversations([str(i) for i in range(6)], 3)
    assert [c.messages for c in convs] == [["0", "1", "2"], ["3", "4", "5"]]


def test_the_system_prompt_is_shared_and_the_questions_unique():
    prefix = "You are a careful assistant. " * 20
    prompts = system_prompts(prefix, ["a?", "b?", "c?"])
    assert all(p.startswith(prefix) for p in prompts)
    assert len({p[len(prefix):] for p in prompts}) == 3


@pytest.mark.parametrize("concurrency", [[1], [1, 2, 4, 8]])
@pytest.mark.parametrize("repeats", [1, 3])
def test_no_text_is_sent_twice(concurrency, repeats):
    workloads, requests, turns = ["chat", "system"], 6, 4
    starts, total = offsets(workloads, concurrency, repeats, requests, turns)
    used = []
    for (w, c, rep), start in starts.items():
        used += range(start, start + pieces_per_level(w, requests, turns, c))
    assert sorted(used) == list(range(total))


def test_a_level_has_two_requests_per_stream_and_a_conversation_per_stream():
    assert pieces_per_level("system", 4, 4, 8) == 16
    assert pieces_per_level("chat", 4, 4, 8) == 8 * 4


def test_usage_with_cached_tokens_is_read():
    ev = parse_event('{"choices": [], "usage": {"prompt_tokens": 440, "completion_tokens": 32, '
                     '"prompt_tokens_details": {"cached_tokens": 400}}}')
    assert (ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens) == (440, 400, 32)
    ev = parse_event('{"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}')
    assert ev.cached_tokens is None


def test_stats_cached_share_and_ttft():
    rs = [RequestOutput("first", chunk_s=[0.1, 0.2], output_tokens=2, prompt_tokens=40, cached_tokens=0),
          RequestOutput("later", chunk_s=[0.05, 0.1], output_tokens=2, prompt_tokens=120, cached_tokens=96),
          RequestOutput("later", error="HTTP 500", prompt_tokens=1000, cached_tokens=0)]
    assert cached_share(rs) == round(96 / 160, 4)
    s = level_stats(rs, 1.0)
    assert s["errors"] == 1 and s["output_tok_s"] == 4.0
    assert s["ttft_ms_p50"] == pytest.approx(75.0) and s["ttft_first_ms_p50"] == 100.0
    assert s["ttft_later_ms_p50"] == 50.0


def test_goals_are_ratios_per_repeat_per_path():
    cold = [{"ttft_ms_p50": 100.0}] * 3
    runs = {"system": {"colocated-on": {1: [{"ttft_ms_p50": 30.0}, {"ttft_ms_p50": 20.0}, {"ttft_ms_p50": 40.0}]},
                       "colocated-off": {1: cold},
                       "disaggregated-on": {1: [{"ttft_ms_p50": 50.0}] * 3}, "disaggregated-off": {1: cold}}}
    g = prefix.goals(runs, [1], ["colocated", "disaggregated"])
    warm = "warm TTFT / cold (400-token cached prefix)"
    assert g["colocated"][warm]["ratio"]["1"]["runs"] == [0.3, 0.2, 0.4]
    assert g["colocated"][warm]["ratio"]["1"]["median"] == 0.3 and g["colocated"][warm]["met"]["1"] is True
    assert g["disaggregated"][warm]["ratio"]["1"]["median"] == 0.5 and g["disaggregated"][warm]["met"]["1"] is False
    # a goal against vLLM needs its runs; a path not measured has none
    assert "chat TTFT p50 / vLLM-CPU" not in g["colocated"]
    assert prefix.goals(runs, [1], ["colocated"]).keys() == {"colocated"}


@pytest.mark.parametrize("paths,peers,servers", [
    (["colocated", "disaggregated"], True,
     ["colocated-on", "colocated-off", "disaggregated-on", "disaggregated-off", "vllm"]),
    (["disaggregated"], False, ["disaggregated-on", "disaggregated-off"])])
def test_servers_per_path_caching_on_and_off(paths, peers, servers):
    assert prefix.server_names(paths, peers) == servers
    assert [prefix.path_of(s) for s in servers] == [s.rsplit("-", 1)[0] if s != "vllm" else None for s in servers]


@pytest.mark.parametrize("server,model", [("colocated-on", "tandem_colocated"), ("disaggregated-off", "tandem"),
                                          ("vllm", "tandem")])
def test_each_path_is_asked_for_its_own_ensemble(server, model):
    assert prefix._request("hi", 4, server, "system").model == model


def test_tables_per_path_keep_vllm():
    per_c = {"1": {"ttft_ms_p50": {"median": 1.0, "min": 1.0, "max": 1.0}}}
    summary = {"chat": {s: per_c for s in prefix.server_names(["colocated", "disaggregated"], True)}}
    rows = [ln.split(" |")[0][2:] for ln in prefix.table(summary, "chat", [1], "ttft_ms_p50", 1, "disaggregated")[2:]]
    assert rows == ["disaggregated-on", "disaggregated-off", "vllm"]


def test_routing_counters_per_level():
    text = ('# TYPE tandem_disagg_requests_total counter\n'
            'tandem_disagg_requests_total{model="kv_transfer",version="1",path="local",reason="cached_prefix"} 7\n'
            'tandem_disagg_requests_total{model="kv_transfer",version="1",path="remote",reason="long_prompt"} 2\n'
            'tandem_disagg_requests_total{model="kv_transfer",version="2",path="remote",reason="long_prompt"} 1\n'
            'tandem_kv_pages{state="free"} 90\n')
    before = prefix.routed(text)
    assert before == {"local/cached_prefix": 7.0, "remote/long_prompt": 3.0}
    after = {**before, "local/cached_prefix": 16.0, "local/short_prompt": 1.0}
    level = prefix.routed_delta(before, after)
    assert level == {"local/cached_prefix": 9, "local/short_prompt": 1}
    runs = {"system": {"disaggregated-on": {"1": [{"routed": level}, {"routed": {"local/cached_prefix": 9}}]},
                       "colocated-on": {"1": [{}]}}}
    assert prefix.routing_table(runs, [1])[2] == \
        "| system: disaggregated-on | local/cached_prefix 18, local/short_prompt 1 |"
    assert prefix.routing_table({"system": {"colocated-on": {"1": [{}]}}}, [1]) == []


def test_chat_loop_sends_the_servers_reply_back():
    """Against a stand-in server: every later turn carries the previous prompt and the
    reply streamed to it; the usage's cached tokens reach the results."""
    async def main():
        seen = []

        async def handle(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                              if ln.lower().startswith(b"content-length")))
            req = json.loads(await reader.readexactly(length))
            seen.append(req["prompt"])
            reply = f" r{len(seen)}"
            chunks = [{"choices": [{"index": 0, "text": reply, "finish_reason": "length"}]},
                      {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 1,
                                                "prompt_tokens_details": {"cached_tokens": 8}}}]
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"
                         + b"".join(b"data: %s\n\n" % json.dumps(c).encode() for c in chunks) + b"data: [DONE]\n\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            results, _ = await prefix.chat_loop(port, conversations(["a", "b", "c"], 3), 1, 1, "colocated-on")
        return results, seen

    results, seen = asyncio.run(main())
    assert seen[1] == seen[0] + " r1" + f"{USER}b{ASSISTANT}"
    assert seen[2] == seen[1] + " r2" + f"{USER}c{ASSISTANT}"
    assert [r.kind for r in results] == ["first", "later", "later"]
    assert all(r.cached_tokens == 8 and r.prompt_tokens == 10 for r in results)


def test_options():
    p = argparse.ArgumentParser()
    prefix.add_arguments(p)
    a = p.parse_args(["--no-peers", "--concurrency", "1,8", "--turns", "3"])
    assert a.no_peers and a.concurrency == [1, 8] and a.turns == 3
    assert not p.parse_args([]).no_peers
    assert p.parse_args([]).paths == ["colocated", "disaggregated"]
    assert p.parse_args(["--paths", "disaggregated"]).paths == ["disaggregated"]
    with pytest.raises(SystemExit):
        p.parse_args(["--paths", "both"])
    with pytest.raises(SystemExit):
        p.parse_args(["--workloads", "bogus"])
