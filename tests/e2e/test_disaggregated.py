"""The disaggregated ensemble on a real tritonserver: preprocess, kv_transfer, prefill
and decode in their own processes, KV over UCX into the shared decode pool; its greedy
text equals the colocated ``tandem`` model's on the same server."""
from __future__ import annotations

import json
import urllib.request

import pytest

from tandem.client.generate import GenerateError, stream_generate
from tandem.client.serve import ServeOptions, TritonServer, stub_processes

pytestmark = pytest.mark.e2e
DISAGG = "tandem_disaggregated"
PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\nclass Path:", "x",
           "# " + "the quick brown fox jumps over the lazy dog " * 3]


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_checkpoint):
    run_dir = tmp_path_factory.mktemp("serve-disagg")
    # small pages and chunks: several pages per prompt, chunked prefill
    srv = TritonServer(ServeOptions(model_dir=str(demo_checkpoint), torch_threads=1, max_num_seqs=8,
                                    page_size=4, max_num_batched_tokens=8, mode="disaggregated"),
                       run_dir=run_dir, log_file=run_dir / "tritonserver.log", ready_timeout_s=240)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def _text(server, model, prompt, **params):
    responses = list(stream_generate(server.grpc_url, prompt, model=model, timeout_s=60,
                                     max_tokens=10, temperature=0.0, **params))
    assert responses[-1].final
    return "".join(r.text for r in responses), responses


@pytest.mark.parametrize("prompt", PROMPTS)
def test_grpc_stream_equals_colocated(server, prompt):
    want, _ = _text(server, "tandem", prompt, stream=True)
    got, responses = _text(server, DISAGG, prompt, stream=True)
    assert got == want
    assert responses[-1].finish_reason in ("stop", "length")
    assert len(responses) >= 2     # streamed: one response per step


def test_concurrent_streams_each_get_their_own_tokens(server):
    import queue

    import tritonclient.grpc as grpcclient

    from tandem.client.generate import build_inputs, parse_response
    prompts = [f"def f{i}(x):\n    return x * {i}" + " + 1" * i for i in range(8)]
    expected = [_text(server, "tandem", p, stream=True)[0] for p in prompts]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    for i, p in enumerate(prompts):
        client.async_stream_infer(DISAGG, build_inputs(p, max_tokens=10, temperature=0.0),
                                  request_id=str(i), enable_empty_final_response=True)
    texts, done = [""] * len(prompts), set()
    while len(done) < len(prompts):
        result, error = results.get(timeout=60)
        assert error is None, error
        r = parse_response(result)
        rid = int(result.get_response().id)
        texts[rid] += r.text
        if r.final:
            done.add(rid)
    client.stop_stream()
    client.close()
    assert texts == expected


def test_http_generate_non_streaming_equals_colocated(server):
    def post(model):
        body = {"text_input": "def main():", "max_tokens": 6, "temperature": 0}
        req = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/generate",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    got, want = post(DISAGG), post("tandem")
    assert got["text_output"] == want["text_output"]
    assert got["num_output_tokens"] == want["num_output_tokens"]


def test_bad_input_is_refused_before_any_reservation(server):
    with pytest.raises(GenerateError, match=r"max_tokens: "):
        list(stream_generate(server.grpc_url, "hello", model=DISAGG, max_tokens=0, timeout_s=60))
    got, _ = _text(server, DISAGG, "hello", stream=True)   # still healthy
    assert got


def test_zz_stop_removes_processes_and_the_shared_pool(server):
    pid = server.process.pid
    assert len(stub_processes(server.run_dir)) == 5
    server.stop()
    assert stub_processes(server.run_dir) == []
    import os
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"tandem-kv-{pid}-")]
    # every model unloaded cleanly: no stub crashed on the way out
    log = (server.run_dir / "tritonserver.log").read_text(errors="replace")
    assert "Caught signal" not in log and "Segmentation fault" not in log
    assert log.count("successfully unloaded") == 5 + 1   # five models and the ensemble
