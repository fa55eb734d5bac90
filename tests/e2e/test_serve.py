"""A real tritonserver with the tandem model, driven the way users drive it.

One server per module (starting it is the slow part); the tiny untrained demo
checkpoint keeps generation fast. The last test stops the server, so it runs last.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from tandem.backends.triton.generate_request import INPUT_NAMES, OUTPUT_NAMES
from tandem.client.generate import GenerateError, build_inputs, parse_response, stream_generate
from tandem.client.serve import ServeOptions, TritonServer, free_port, stub_processes

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_checkpoint):
    run_dir = tmp_path_factory.mktemp("serve")
    srv = TritonServer(ServeOptions(model_dir=str(demo_checkpoint), torch_threads=1, max_num_seqs=8),
                       run_dir=run_dir, log_file=run_dir / "tritonserver.log", ready_timeout_s=180)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def http_post(server, path, body):
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/tandem/{path}",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(server, name, **labels):
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    want = {"model": "tandem", "version": "1", **labels}
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) == want:
            return float(m.group(2))
    return 0.0


def test_server_and_model_ready(server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url)
    assert client.is_server_ready() and client.is_model_ready("tandem")
    config = client.get_model_config("tandem")
    assert config["model_transaction_policy"]["decoupled"] is True
    assert {i["name"] for i in config["input"]} == set(INPUT_NAMES)
    assert [o["name"] for o in config["output"]] == list(OUTPUT_NAMES)


def test_stream_over_grpc_sends_step_responses_then_final(server):
    responses = list(stream_generate(server.grpc_url, "def main():", max_tokens=8, temperature=0.0,
                                     stream=True, timeout_s=60))
    assert len(responses) >= 2
    assert [r.final for r in responses] == [False] * (len(responses) - 1) + [True]
    assert all(r.finish_reason == "" for r in responses[:-1])
    assert responses[-1].finish_reason in ("stop", "length")
    assert [r.num_output_tokens for r in responses] == list(range(1, len(responses) + 1))
    assert responses[-1].num_input_tokens > 0


def test_non_streaming_sends_one_response_with_the_whole_text(server):
    params = dict(max_tokens=8, temperature=0.0, timeout_s=60)
    streamed = list(stream_generate(server.grpc_url, "import os", stream=True, **params))
    whole = list(stream_generate(server.grpc_url, "import os", stream=False, exclude_input_in_output=False,
                                 **params))
    assert len(whole) == 1 and whole[0].final
    # greedy: the same tokens either way; the non-streaming text starts with the prompt
    assert whole[0].text == "import os" + "".join(r.text for r in streamed)
    assert whole[0].num_output_tokens == streamed[-1].num_output_tokens


def test_http_generate_endpoints(server):
    status, body = http_post(server, "generate", {"text_input": "def f(", "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    out = json.loads(body)
    assert out["text_output"].startswith("def f(") and out["finish_reason"] in ("stop", "length")
    assert 1 <= out["num_output_tokens"] <= 4

    status, body = http_post(server, "generate_stream",
                             {"text_input": "def f(", "max_tokens": 4, "temperature": 0, "stream": True})
    assert status == 200, body
    events = [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]
    assert len(events) == out["num_output_tokens"]
    assert "def f(" + "".join(e["text_output"] for e in events) == out["text_output"]


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("top_p", 1.5), ("temperature", -1.0),
                                         ("top_k", -3), ("text_input", "")])
def test_bad_parameter_returns_an_error_naming_the_field(server, field, value):
    body = {"text_input": "hello", "max_tokens": 4, field: value}
    status, text = http_post(server, "generate", body)
    assert status == 400
    assert json.loads(text)["error"].startswith(f"{field}: ")


def test_bad_parameter_over_grpc(server):
    with pytest.raises(GenerateError, match=r"^top_p: .*allowed: a number in \[0, 1\]"):
        list(stream_generate(server.grpc_url, "hello", top_p=1.5, timeout_s=60))


def test_cancelled_stream_is_aborted_and_server_stays_healthy(server):
    import tritonclient.grpc as grpcclient

    aborted_before = metric(server, "tandem_requests_finished_total", reason="abort")
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("tandem", build_inputs("class A:", max_tokens=2000, stream=True),
                              enable_empty_final_response=True)
    for _ in range(2):
        result, error = results.get(timeout=60)
        assert error is None and not parse_response(result).final
    client.stop_stream(cancel_requests=True)
    client.close()

    # the engine aborted the sequence long before its 2000 tokens
    deadline = time.monotonic() + 30
    while metric(server, "tandem_requests_finished_total", reason="abort") < aborted_before + 1:
        assert time.monotonic() < deadline, "the cancelled request was not aborted in the engine"
        time.sleep(0.1)
    assert metric(server, "tandem_requests_in_engine") == 0
    assert server.is_ready()
    after = list(stream_generate(server.grpc_url, "x = 1", max_tokens=3, stream=True, timeout_s=60))
    assert after[-1].final


def test_concurrent_streams_each_get_their_own_tokens(server):
    prompts = ["def a():", "import sys", "class B:"]
    expected = {p: list(stream_generate(server.grpc_url, p, max_tokens=6, temperature=0.0, timeout_s=60))
                for p in prompts}

    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    for i, p in enumerate(prompts):
        client.async_stream_infer("tandem", build_inputs(p, max_tokens=6, temperature=0.0), request_id=str(i),
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
    for i, p in enumerate(prompts):
        assert texts[i] == "".join(r.text for r in expected[p])


def test_cli_generate_prints_json_lines(server):
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.client.cli", "generate", "def g():", "--url", server.grpc_url,
         "--stream", "--json", "--max-tokens", "3", "--temperature", "0"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines and lines[-1]["final"] and lines[-1]["finish_reason"] in ("stop", "length")


def test_zz_stop_leaves_no_process_behind(server):
    """Runs last in this module: it stops the shared server."""
    pid = server.process.pid
    assert stub_processes(server.run_dir), "expected a running Python backend stub"
    server.stop()
    assert stub_processes(server.run_dir) == []
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert not server.is_ready()


def test_cli_serve_shuts_down_on_sigint(demo_checkpoint, tmp_path):
    ports = [str(free_port()) for _ in range(3)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.client.cli", "serve", "--model", str(demo_checkpoint),
         "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2], "--threads", "1",
         "--run-dir", str(tmp_path / "run"), "--log-file", str(tmp_path / "server.log")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C to stop."):
                break
        assert any(f"127.0.0.1:{ports[1]}" in line for line in lines), "".join(lines)
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
