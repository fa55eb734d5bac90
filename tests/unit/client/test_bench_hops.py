"""tandem bench hops without a server: CPU time read from /proc, rounds summarized per
hop, the table's rows."""
from __future__ import annotations

import os

from tandem.client.bench.hops import cpu_s, serving_hops, summarize, table


def test_cpu_time_of_a_process_grows_with_its_work_and_is_zero_once_gone():
    before = cpu_s(os.getpid())
    sum(i * i for i in range(2_000_000))
    assert cpu_s(os.getpid()) > before
    assert cpu_s(2 ** 22 + 12345) == 0.0     # above pid_max's default: no such process


def test_rounds_are_summarized_per_token_with_their_spread():
    rounds = [{"tokens": 1000, "responses": 1000, "wall_s": 2.0,
               "cpu_s": {"stub:decode": d, "stub:postprocess": 0.5, "tritonserver": 0.7, "frontend": 0.0,
                         "load generator": 0.3}}
              for d in (1.0, 2.0, 1.5)]
    s = summarize(rounds)
    assert s["cpu_us_per_token"]["stub:decode"] == 1500.0
    assert s["cpu_us_per_token_min_max"]["stub:decode"] == [1000.0, 2000.0]
    assert s["responses_per_token"] == 1.0 and s["output_tok_s"] == 500.0 and s["tokens"] == 3000
    # the gRPC path's client is the load generator; the OpenAI path's is the frontend
    assert serving_hops("grpc", s["cpu_us_per_token"]) == 500.0 + 700.0 + 300.0
    assert serving_hops("openai", s["cpu_us_per_token"]) == 500.0 + 700.0
    text = table({"grpc": {"a": s, "b": s}})
    assert text.splitlines()[0].split() == ["CPU", "µs", "per", "token", "grpc", "a", "grpc", "b"]
    assert any(line.startswith("serving hops") for line in text.splitlines())
    assert not any(line.startswith("frontend") for line in text.splitlines())   # no OpenAI column
