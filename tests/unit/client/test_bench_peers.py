"""``tandem bench peers``' pure parts: a level's statistics, the load generator against a
stand-in server, the prompts and the option checks (no server, no timing thresholds).
How both servers' streams parse: test_bench_request_client.py."""
from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from tandem.client.bench import peers
from tandem.client.bench.openai_load import closed_loop, summarize
from tandem.client.bench.peer_servers import spec_config, tandem_command, vllm_command
from tandem.client.bench.peers_workload import auto_dtype, exact_request, kinds, requests_per_level
from tandem.client.bench.report import cpu_info
from tandem.client.bench.request_client import RequestOutput, openai_body

from .test_bench_request_client import VLLM_STREAM

def test_summary_counts_tokens_gaps_and_kinds():
    a = RequestOutput("cold", chunk_s=[0.1, 0.2, 0.4], output_tokens=4)   # a chunk of 2 tokens
    b = RequestOutput("warm", chunk_s=[0.05, 0.15], output_tokens=2)
    bad = RequestOutput("cold", error="HTTP 500")
    s = summarize([a, b, bad], wall_s=2.0)
    assert s["requests"] == 3 and s["errors"] == 1 and s["first_error"] == "HTTP 500"
    assert s["output_tok_s"] == 3.0                                  # 6 tokens / 2 s
    assert s["tokens_per_chunk"] == round(6 / 5, 3)
    assert s["ttft_cold_ms_p50"] == 100.0 and s["ttft_warm_ms_p50"] == 50.0
    assert s["itl_ms_p50"] == 100.0                                   # gaps 0.1, 0.2, 0.1
    assert s["tpot_ms_p50"] == pytest.approx(100.0)                   # (0.3 / 3 and 0.1 / 1)


def test_load_generator_against_a_chunked_sse_server():
    """The whole client path: HTTP/1.1, chunked, SSE, usage; and an HTTP error."""
    async def main():
        seen = []

        async def handle(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
            req = json.loads(await reader.readexactly(length))
            seen.append(req)
            if req["prompt"] == "bad":
                writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 5\r\n\r\nnope!")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                for i in range(0, len(VLLM_STREAM), 50):
                    piece = VLLM_STREAM[i:i + 50]
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reqs = [exact_request("m", "x", 2, vllm=True, kind="cold"),
                exact_request("m", "bad", 2, vllm=True, kind="warm"),
                exact_request("m", "y", 2, vllm=False, kind="cold")]
        async with server:
            results, wall = await closed_loop("127.0.0.1", port, reqs, 2)
        return results, wall, seen

    results, wall, seen = asyncio.run(main())
    assert [r.kind for r in results] == ["cold", "warm", "cold"]
    assert results[0].error is None and results[0].tokens == 2 and len(results[0].chunk_s) == 2
    assert results[1].error.startswith("HTTP 400")
    assert wall > 0 and len(seen) == 3


def test_bodies_ask_for_exact_greedy_streams():
    b = openai_body(exact_request("tandem", "p", 128, vllm=False))
    assert b["min_tokens"] == b["max_tokens"] == 128 and b["temperature"] == 0.0 and b["stream"]
    assert b["stream_options"] == {"include_usage": True} and "ignore_eos" not in b
    assert openai_body(exact_request("tandem", "p", 128, vllm=True))["ignore_eos"] is True


def test_levels_alternate_kinds_and_never_reuse_a_prompt():
    assert kinds(4) == ["cold", "warm", "cold", "warm"]
    assert requests_per_level(8, 16) == 32 and requests_per_level(8, 1) == 8
    starts, total = peers.offsets([1, 2, 16], 3, 8)
    spans = sorted((s, s + requests_per_level(8, c)) for (_, c), s in starts.items())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] == total


CPUINFO = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx avx2 fma\n\nprocessor\t: 1\n"


def test_cpu_flags_decide_the_dtype():
    info = cpu_info(CPUINFO)
    assert info["model"] == "AMD EPYC 7B13" and info["flags"] == ["avx2"]
    assert auto_dtype(info) == "float32"
    assert auto_dtype(cpu_info(CPUINFO.replace("avx2", "avx2 avx512f avx512_bf16"))) == "bfloat16"


def parser():
    p = argparse.ArgumentParser()
    peers.add_arguments(p)
    return p


@pytest.mark.parametrize("argv", [["--concurrency", "0"], ["--concurrency", "1,1"], ["--methods", "eagle"],
                                  ["--servers", "sglang"], ["--repeats", "0"], ["--dtype", "float16"],
                                  ["--requests", "-1"], ["--tandem-mode", "prefill"]])
def test_bad_options_end_the_parse(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    assert e.value.code == 2


def test_defaults_and_schedule():
    a = parser().parse_args([])
    assert a.dtype in ("float32", "bfloat16") and list(a.concurrency) == [1, 2, 4, 8, 16] and a.repeats == 3
    cfgs = peers.configs(a.servers, a.methods)
    assert ("vllm", "mtp") not in cfgs and ("tandem", "draft_model") not in cfgs and len(cfgs) == 8
    assert ("tandem", "auto") in cfgs and ("vllm", "auto") not in cfgs
    assert list(peers.groups(cfgs)) == ["plain", "ngram", "draft", "auto"]
    assert [peers.rotated(["a", "b"], i) for i in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]


def test_ratios_are_taken_per_repeat():
    def runs(values):
        return {1: [{"output_tok_s": v, "itl_ms_p50": 10.0, "ttft_cold_ms_p50": 100.0} for v in values]}
    r = {("tandem", "none"): runs([120, 90, 100]), ("vllm", "none"): runs([100, 100, 50]),
         ("tandem", "mtp"): runs([200, 200, 200]), ("vllm", "ngram"): runs([100, 100, 100]),
         ("vllm", "draft_model"): runs([50, 50, 50])}
    comp = peers.comparisons(r, [1])["1"]
    assert comp["plain"]["output_tok_s"]["runs"] == [1.2, 0.9, 2.0]
    assert comp["plain"]["output_tok_s"]["median"] == 1.2
    assert comp["best_speculation"]["vllm"] == "vllm/ngram" and comp["best_speculation"]["output_tok_s"]["median"] == 2.0


def test_variants_are_compared_with_plain_tandem_and_run_with_their_options(tmp_path):
    def runs(values):
        return {1: [{"output_tok_s": v, "ttft_cold_ms_p50": 100.0} for v in values]}
    r = {("tandem", "none"): runs([100, 100, 100]), ("tandem-jemalloc", "none"): runs([110, 90, 105])}
    comp = peers.comparisons(r, [1])
    assert comp["1"]["tandem-jemalloc"]["output_tok_s"]["runs"] == [1.1, 0.9, 1.05]
    assert "tandem-jemalloc / tandem, output tok/s | 1.05" in peers.ratio_table(comp, [1])
    a = parser().parse_args(["--servers", "tandem,tandem-tcmalloc,tandem-colocated"])
    assert [peers.engine(s) for s in a.servers] == ["tandem"] * 3
    assert peers.tandem_mode("tandem-colocated", a) == "colocated" and peers.tandem_mode("tandem-tcmalloc", a) == \
        "disaggregated"


def test_server_commands():
    from pathlib import Path
    cmd = vllm_command(Path("py"), Path("ckpt"), 8123, "float32", "draft_model", 3, Path("draft"))
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == spec_config("draft_model", 3, Path("draft"))
    assert "--speculative-config" not in vllm_command(Path("py"), Path("c"), 1, "float32", "none", 3, None)
    t = tandem_command(Path("ckpt"), 9001, "float32", "mtp", 2, "disaggregated", Path("/tmp/x"))
    assert t[t.index("--openai-port") + 1] == "9001" and t[t.index("--spec") + 1] == "mtp"
    with pytest.raises(ValueError):
        spec_config("mtp", 3, None)
