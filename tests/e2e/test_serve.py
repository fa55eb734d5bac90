"""`tandem serve --mode colocated` on a real tritonserver, driven the way users drive it:
the ensemble ``tandem_colocated`` (preprocess -> llm -> postprocess) with the
conventional text interface, and ``llm`` itself as the token-level model.

One server per module (starting it is the slow part); the tiny untrained demo
checkpoint keeps generation fast. When the module is done with the server, its fixture
stops it and checks that nothing is left behind.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys

import pytest

from tandem.backends.triton.generate_request import INPUT_NAMES
from tandem.backends.triton.response_arrays import ENGINE_OUTPUT_NAMES, OUTPUT_NAMES
from tandem.client.generate import GenerateError, build_inputs, parse_response, stream_generate
from tandem.client.serve.options import MODES
from tandem.client.serve.triton_server import free_ports, stub_processes

from .triton_calls import http_post, metric, metric_reaches, sse_events

pytestmark = pytest.mark.e2e
MODEL = "tandem_colocated"
MAX_NUM_SEQS = 8


@pytest.fixture(scope="module")
def server(serve):
    with serve("serve", max_num_seqs=MAX_NUM_SEQS, mode="colocated") as srv:
        yield srv
        stop_leaves_no_process_behind(srv)


def stop_leaves_no_process_behind(server):
    """The teardown check of ``server``, after every test of the module that used it."""
    pid = server.process.pid
    assert len(stub_processes(server.run_dir)) == 4      # preprocess, llm, postprocess, cancel
    server.stop()
    assert stub_processes(server.run_dir) == []
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert not server.is_ready()
    # every model unloaded: no cancelled request was left in flight
    log = (server.run_dir / "tritonserver.log").read_text(errors="replace")
    assert not re.search(r"Found [1-9]\d* model versions that have in-flight inferences", log)
    assert log.count("successfully unloaded") == len(MODES["colocated"])


@pytest.fixture(scope="module")
def reference(greedy_reference):
    """The offline engine with the server's settings: what greedy output must equal."""
    return greedy_reference(8, max_num_seqs=MAX_NUM_SEQS)


def test_server_and_models_ready(server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url)
    assert client.is_server_ready()
    assert all(client.is_model_ready(m) for m in MODES["colocated"])
    config = client.get_model_config(MODEL)
    assert config["platform"] == "ensemble"
    assert [i["name"] for i in config["input"]] == list(INPUT_NAMES)
    assert [o["name"] for o in config["output"]] == list(OUTPUT_NAMES)
    llm = client.get_model_config("llm")
    assert llm["model_transaction_policy"]["decoupled"] is True
    assert [o["name"] for o in llm["output"]][:len(ENGINE_OUTPUT_NAMES)] == list(ENGINE_OUTPUT_NAMES)


def test_stream_over_grpc_sends_step_responses_then_final(server, reference):
    responses = list(stream_generate(server.grpc_url, "def main():", model=MODEL, max_tokens=8,
                                     temperature=0.0, stream=True, timeout_s=60))
    assert len(responses) >= 2
    assert [r.final for r in responses] == [False] * (len(responses) - 1) + [True]
    assert all(r.finish_reason == "" for r in responses[:-1])
    assert responses[-1].finish_reason in ("stop", "length")
    # one step per response, or several merged when the sender fell behind (reply_pump):
    # the counts only grow, and the last one is every token
    counts = [r.num_output_tokens for r in responses]
    assert counts == sorted(set(counts)) and counts[0] >= 1
    assert counts[-1] == len(reference("def main():", 8).token_ids)
    assert responses[-1].num_input_tokens > 0
    assert "".join(r.text for r in responses) == reference("def main():", 8).text


def test_non_streaming_sends_one_response_with_the_whole_text(server):
    params = dict(model=MODEL, max_tokens=8, temperature=0.0, timeout_s=60)
    streamed = list(stream_generate(server.grpc_url, "import os", stream=True, **params))
    whole = list(stream_generate(server.grpc_url, "import os", stream=False, exclude_input_in_output=False,
                                 **params))
    assert len(whole) == 1 and whole[0].final
    # greedy: the same tokens either way; the non-streaming text starts with the prompt
    assert whole[0].text == "import os" + "".join(r.text for r in streamed)
    assert whole[0].num_output_tokens == streamed[-1].num_output_tokens
    excluded = list(stream_generate(server.grpc_url, "import os", stream=False, exclude_input_in_output=True,
                                    **params))
    assert excluded[0].text == "".join(r.text for r in streamed)


@pytest.mark.parametrize("stream", [True, False])
def test_llm_token_level_output_ids_equal_llm_generate(server, reference, stream):
    want = reference("def fib(n):", 10)
    responses = list(stream_generate(server.grpc_url, want.prompt_token_ids, model="llm", max_tokens=10,
                                     temperature=0.0, stream=stream, timeout_s=60))
    assert [t for r in responses for t in r.output_ids] == want.token_ids
    assert "".join(r.text for r in responses) == want.text     # no prompt echo at token level
    assert responses[-1].num_input_tokens == len(want.prompt_token_ids)
    # streamed: a response per step, or fewer when steps were merged behind a busy sender
    assert (1 <= len(responses) <= len(want.token_ids)) if stream else len(responses) == 1


@pytest.mark.parametrize("ids,max_tokens,error", [
    ([], 4, "input_ids: is empty"),
    ([5, 2000], 4, r"input_ids: token id 2000 is not in the vocabulary; allowed: ids in \[0, 1999\]"),
    ([5] * 2048, 1, "input_ids: has 2048 tokens; the context is 2048 tokens"),
    ([5] * 2040, 10, "max_tokens: got 10; the prompt has 2040 tokens of a 2048-token context; allowed: <= 8"),
])
def test_llm_refuses_bad_token_requests_naming_the_field(server, ids, max_tokens, error):
    with pytest.raises(GenerateError, match=f"^{error}"):
        list(stream_generate(server.grpc_url, ids, model="llm", max_tokens=max_tokens, timeout_s=60))


def test_http_generate_endpoints(server):
    status, body = http_post(server, MODEL, "generate", {"text_input": "def f(", "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    out = json.loads(body)
    assert out["text_output"].startswith("def f(") and out["finish_reason"] in ("stop", "length")
    assert 1 <= out["num_output_tokens"] <= 4

    status, body = http_post(server, MODEL, "generate_stream",
                             {"text_input": "def f(", "max_tokens": 4, "temperature": 0, "stream": True})
    assert status == 200, body
    events = sse_events(body)
    assert len(events) == out["num_output_tokens"]
    assert "def f(" + "".join(e["text_output"] for e in events) == out["text_output"]


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("top_p", 1.5), ("top_p", 0.0), ("temperature", -1.0),
                                         ("top_k", -3), ("text_input", "")])
def test_bad_parameter_returns_an_error_naming_the_field(server, field, value):
    body = {"text_input": "hello", "max_tokens": 4, field: value}
    status, text = http_post(server, MODEL, "generate", body)
    assert status == 400
    assert f", {field}: " in json.loads(text)["error"]   # "in ensemble 'tandem_colocated', top_p: ..."


def test_bad_parameter_over_grpc(server):
    with pytest.raises(GenerateError, match=r"top_p: .*allowed: a number in \(0, 1\]"):
        list(stream_generate(server.grpc_url, "hello", model=MODEL, top_p=1.5, timeout_s=60))


@pytest.mark.parametrize("model", [MODEL, "llm"])
def test_cancelled_stream_is_aborted_and_server_stays_healthy(server, model):
    """Through the ensemble, postprocess carries the cancellation back to llm (Triton does
    not cancel the step in flight); called directly, llm sees it itself."""
    import tritonclient.grpc as grpcclient

    aborted_before = metric(server, "tandem_requests_finished_total", "llm", reason="abort")
    prompt = "class A:" if model == MODEL else [0, 412, 9, 77]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(model, build_inputs(prompt, max_tokens=2000, min_tokens=2000, stream=True),
                              enable_empty_final_response=True)
    for _ in range(2):
        result, error = results.get(timeout=60)
        assert error is None and not parse_response(result).final
    client.stop_stream(cancel_requests=True)
    while (answer := results.get(timeout=30))[1] is None:   # responses already on the way, then the error
        assert not parse_response(answer[0]).final
    assert "CANCELLED" in str(answer[1].status())
    client.close()

    # the engine aborted the sequence long before its 2000 tokens
    metric_reaches(server, "tandem_requests_finished_total", "llm", aborted_before + 1, reason="abort",
                   failing="the cancelled request was not aborted in the engine")
    assert metric(server, "tandem_requests_in_engine", "llm") == 0
    assert server.is_ready()
    after = list(stream_generate(server.grpc_url, "x = 1", model=MODEL, max_tokens=3, stream=True, timeout_s=60))
    assert after[-1].final


def test_tensorrt_llm_stop_request_ends_the_stream_it_names(server):
    """TensorRT-LLM's stop convention (inflight_batcher_llm_client --stop-after-ms): on the
    same gRPC stream, a second request with the first one's request id, ``stop`` = true and
    empty input_ids; the first stream ends with its final response, the engine aborts the
    sequence and frees its pages, the stop request gets an empty final response."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    aborted_before = metric(server, "tandem_requests_finished_total", "llm", reason="abort")
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("llm", build_inputs([0, 412, 9, 77], max_tokens=2000, min_tokens=2000, stream=True),
                              request_id="1", enable_empty_final_response=True)
    for _ in range(2):
        result, error = results.get(timeout=60)
        assert error is None and not parse_response(result).final
    ids = grpcclient.InferInput("input_ids", [1, 0], "INT32")
    ids.set_data_from_numpy(np.zeros((1, 0), dtype=np.int32))
    stop = grpcclient.InferInput("stop", [1, 1], "BOOL")
    stop.set_data_from_numpy(np.array([[True]]))
    client.async_stream_infer("llm", [ids, stop], request_id="1", enable_empty_final_response=True)
    finals = 0
    while finals < 2:                 # the stopped stream's and the stop request's
        result, error = results.get(timeout=60)
        assert error is None, error
        finals += parse_response(result).final
    client.stop_stream()
    client.close()
    metric_reaches(server, "tandem_requests_finished_total", "llm", aborted_before + 1, reason="abort",
                   failing="the stopped request was not aborted in the engine")
    assert metric(server, "tandem_requests_in_engine", "llm") == 0


def test_concurrent_streams_each_get_their_own_tokens(server, reference):
    import tritonclient.grpc as grpcclient

    prompts = ["def a():", "import sys", "class B:"]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    for i, p in enumerate(prompts):
        client.async_stream_infer(MODEL, build_inputs(p, max_tokens=6, temperature=0.0), request_id=str(i),
                                  enable_empty_final_response=True)
    texts, done = {i: "" for i in range(len(prompts))}, set()
    while len(done) < len(prompts):
        result, error = results.get(timeout=60)
        assert error is None
        rid = int(result.get_response().id)
        r = parse_response(result)
        texts[rid] += r.text
        if r.final:
            done.add(rid)
    client.stop_stream()
    client.close()
    assert [texts[i] for i in range(len(prompts))] == [reference(p, 6).text for p in prompts]


def test_cli_generate_prints_json_lines(server):
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.client.cli", "generate", "def g():", "--url", server.grpc_url,
         "--model-name", MODEL, "--stream", "--json", "--max-tokens", "3", "--temperature", "0"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines and lines[-1]["final"] and lines[-1]["finish_reason"] in ("stop", "length")


def test_cli_serve_shuts_down_on_sigint(demo_checkpoint, tmp_path):
    ports = [str(port) for port in free_ports(4)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.client.cli", "serve", "--model", str(demo_checkpoint), "--mode", "colocated", "--dtype", "float32", "--enforce-eager",
         "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2], "--threads", "1",
         "--openai-port", ports[3],
         "--run-dir", str(tmp_path / "run"), "--log-file", str(tmp_path / "server.log")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C to stop."):
                break
        assert any(f"127.0.0.1:{ports[1]}" in line for line in lines), "".join(lines)
        assert any(line.split()[:2] == ["ensemble", MODEL] for line in lines), "".join(lines)
        assert stub_processes(tmp_path / "run")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert stub_processes(tmp_path / "run") == []
        assert not any(name.startswith("tandem_") and str(proc.pid) in name
                       for name in os.listdir("/dev/shm")), "shared-memory regions left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
