"""The disaggregated ensembles on a real tritonserver (`tandem serve --mode both`):
``tandem`` (preprocess -> kv_transfer -> prefill -> decode -> postprocess, each in its
own process, KV over UCX into the shared decode pool) and ``tandem_tokens``, beside
the colocated baseline ``tandem_colocated``. Greedy output equals the offline engine's
(``LLM.generate``) with the same settings."""
from __future__ import annotations

import os
import queue
import re

import numpy as np
import pytest

from tandem.client.generate import build_inputs, parse_response, stream_generate
from tandem.client.serve.options import MODES
from tandem.client.serve.triton_server import stub_processes

from .triton_calls import (busy_pages, eventually, first_answer, http_post, metric, metric_reaches, pages_back,
                           settled, sse_events, tensors)

pytestmark = pytest.mark.e2e
DISAGG, COLOCATED, TOKENS = "tandem", "tandem_colocated", "tandem_tokens"
PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\nclass Path:", "x",
           "# " + "the quick brown fox jumps over the lazy dog " * 3]
# small pages and chunks: several pages per prompt, chunked prefill
SETTINGS = dict(max_num_seqs=8, page_size=4, max_num_batched_tokens=8)


@pytest.fixture(scope="module")
def server(serve):
    # six stubs load slowly on a busy machine
    with serve("serve-disagg", 300, mode="both", disagg_policy="remote", **SETTINGS) as srv:
        yield srv
        stop_removes_processes_and_the_shared_pool(srv)


def stop_removes_processes_and_the_shared_pool(server):
    """The teardown check of ``server``, after every test of the module that used it."""
    pid = server.process.pid
    # preprocess, kv_transfer, prefill, decode, postprocess, llm, cancel
    assert len(stub_processes(server.run_dir)) == 7
    server.stop()
    assert stub_processes(server.run_dir) == []
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"tandem-kv-{pid}-")]
    # every model unloaded cleanly: no stub crashed, no cancelled request was left in flight
    log = (server.run_dir / "tritonserver.log").read_text(errors="replace")
    assert "Caught signal" not in log and "Segmentation fault" not in log
    assert not re.search(r"Found [1-9]\d* model versions that have in-flight inferences", log)
    assert log.count("successfully unloaded") == len(MODES["both"])   # six models, three ensembles


@pytest.fixture(scope="module")
def reference(greedy_reference):
    """``LLM.generate``'s greedy completion (token ids, text), 10 tokens unless asked."""
    return greedy_reference(10, **SETTINGS)


def _stream(server, model, prompt, **params):
    params = {"max_tokens": 10, "temperature": 0.0, "stream": True, **params}
    responses = list(stream_generate(server.grpc_url, prompt, model=model, timeout_s=60, **params))
    assert responses[-1].final and responses[-1].finish_reason in ("stop", "length")
    return "".join(r.text for r in responses), responses


@pytest.mark.parametrize("prompt", PROMPTS)
def test_grpc_stream_equals_colocated_and_the_engine(server, reference, prompt):
    want = reference(prompt).text
    got, responses = _stream(server, DISAGG, prompt)
    assert got == want
    assert _stream(server, COLOCATED, prompt)[0] == want
    assert len(responses) >= 2     # streamed: one response per step


def test_http_generate_stream_sse_equals_the_engine(server, reference):
    body = {"text_input": PROMPTS[0], "max_tokens": 10, "temperature": 0, "stream": True}
    for model in (DISAGG, COLOCATED):
        status, text = http_post(server, model, "generate_stream", body)
        assert status == 200, text
        events = sse_events(text)
        assert len(events) >= 2 and events[-1]["finish_reason"] in ("stop", "length")
        assert "".join(e["text_output"] for e in events) == reference(PROMPTS[0]).text, model


def test_http_generate_non_streaming_echoes_the_prompt(server, reference):
    import json

    body = {"text_input": "def main():", "max_tokens": 6, "temperature": 0}
    status, text = http_post(server, DISAGG, "generate", body)
    assert status == 200, text
    out = json.loads(text)
    assert out["text_output"] == "def main():" + reference("def main():", 6).text
    assert out["num_output_tokens"] == len(reference("def main():", 6).token_ids)


@pytest.mark.parametrize("stream", [True, False])
def test_tandem_tokens_output_ids_equal_the_engine(server, reference, stream):
    want = reference(PROMPTS[1])
    _, responses = _stream(server, TOKENS, want.prompt_token_ids, stream=stream)
    assert [t for r in responses for t in r.output_ids] == want.token_ids
    assert "".join(r.text for r in responses) == want.text
    # streamed: a response per step, or fewer when steps were merged behind a busy sender
    assert (1 <= len(responses) <= len(want.token_ids)) if stream else len(responses) == 1


def test_cancelled_stream_is_aborted_in_decode_and_the_server_stays_healthy(server, reference):
    """Triton 2.51 does not cancel an ensemble step in flight: decode learns of the
    cancellation from postprocess (backends/triton/cancel_channel.py)."""
    import tritonclient.grpc as grpcclient

    aborted_before = metric(server, "tandem_requests_finished_total", "decode", reason="abort")
    idle_pages = settled(lambda: busy_pages(server, "decode"))
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(DISAGG, build_inputs("class A:", max_tokens=2000, min_tokens=2000, stream=True),
                              enable_empty_final_response=True)
    for _ in range(2):
        result, error = results.get(timeout=60)
        assert error is None and not parse_response(result).final
    client.stop_stream(cancel_requests=True)
    while (answer := results.get(timeout=30))[1] is None:
        assert not parse_response(answer[0]).final
    assert "CANCELLED" in str(answer[1].status())
    client.close()

    metric_reaches(server, "tandem_requests_finished_total", "decode", aborted_before + 1, reason="abort",
                   failing="decode did not abort the cancelled request")
    assert metric(server, "tandem_requests_in_engine", "decode") == 0
    # the sequence's decode pages went back (the gauge is refreshed every 0.5 s)
    pages_back(server, idle_pages, "decode", failing="the cancelled request's pages were not freed")
    assert server.is_ready()
    assert _stream(server, DISAGG, PROMPTS[2])[0] == reference(PROMPTS[2]).text


def test_closing_the_sse_connection_aborts_the_stream(server, reference):
    """A browser or curl that goes away mid-stream: decode aborts the sequence and
    frees its pages."""
    import http.client
    import json
    aborted_before = metric(server, "tandem_requests_finished_total", "decode", reason="abort")
    idle_pages = settled(lambda: busy_pages(server, "decode"))
    host, port = server.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", f"/v2/models/{DISAGG}/generate_stream",
                 body=json.dumps({"text_input": "class A:", "max_tokens": 2000, "min_tokens": 2000, "stream": True}))
    response = conn.getresponse()
    assert response.status == 200
    assert response.fp.readline()     # the first event is under way
    conn.sock.close()
    conn.close()
    metric_reaches(server, "tandem_requests_finished_total", "decode", aborted_before + 1, reason="abort",
                   failing="decode did not abort the abandoned stream")
    pages_back(server, idle_pages, "decode", failing="the abandoned stream's pages were not freed")
    assert _stream(server, DISAGG, PROMPTS[2])[0] == reference(PROMPTS[2]).text


def test_metrics_cover_latency_tokens_and_the_kv_transfer(server, reference):
    _stream(server, DISAGG, PROMPTS[1])
    _stream(server, COLOCATED, PROMPTS[1])

    def counted():
        for model in ("decode", "llm"):
            assert metric(server, "tandem_time_to_first_token_seconds_count", model) >= 1
            assert metric(server, "tandem_inter_token_latency_seconds_count", model) >= 1
            assert metric(server, "tandem_generation_tokens_total", model) >= 10
            assert metric(server, "tandem_prompt_tokens_total", model) >= 1
            assert metric(server, "tandem_kv_pages", model, state="free") > 0
        assert metric(server, "tandem_kv_received_bytes_total", "kv_transfer") > 0
        assert metric(server, "tandem_kv_reservations_total", "kv_transfer") >= 1
        assert metric(server, "tandem_kv_transfer_seconds_count", "kv_transfer") >= 1
    eventually(counted)


def _one(value, dtype):
    return np.array([[value]], dtype=dtype)


HELLO = _one(b"hello", object)
BAD_TEXT_REQUESTS = {
    "empty text_input": ("text_input", dict(text_input=_one(b"", object))),
    "prompt over the context": ("text_input", dict(text_input=_one(b"word " * 3000, object))),
    "max_tokens 0": ("max_tokens", dict(text_input=HELLO, max_tokens=_one(0, np.int32))),
    "max_tokens negative": ("max_tokens", dict(text_input=HELLO, max_tokens=_one(-3, np.int32))),
    "max_tokens above the context": ("max_tokens", dict(text_input=HELLO, max_tokens=_one(5000, np.int32))),
    "temperature < 0": ("temperature", dict(text_input=HELLO, temperature=_one(-0.5, np.float32))),
    "top_p 0": ("top_p", dict(text_input=HELLO, top_p=_one(0.0, np.float32))),
    "top_p > 1": ("top_p", dict(text_input=HELLO, top_p=_one(1.5, np.float32))),
    "wrong dtype": ("max_tokens", dict(text_input=HELLO, max_tokens=_one(4.0, np.float32))),
    "wrong shape": ("text_input", dict(text_input=np.array([[b"a", b"b"]], dtype=object))),
    "invalid UTF-8": ("text_input", dict(text_input=_one(b"\xff\xfe", object))),
    # Triton counts a request's inputs, not which ones: without text_input an ensemble
    # whose first step needs it would end with no response and no error
    "no text_input": ("text_input", dict(max_tokens=_one(4, np.int32))),
}
BAD_TOKEN_REQUESTS = {
    "empty input_ids": ("input_ids", dict(input_ids=np.zeros((1, 0), dtype=np.int32))),
    "id out of the vocabulary": ("input_ids", dict(input_ids=np.array([[5, 2000]], dtype=np.int32))),
    "prompt over the context": ("input_ids", dict(input_ids=np.full((1, 2048), 5, dtype=np.int32))),
    "max_tokens above the context": ("max_tokens", dict(input_ids=np.full((1, 2040), 5, dtype=np.int32),
                                                        max_tokens=_one(9, np.int32))),
    "no input_ids": ("input_ids", dict(max_tokens=_one(4, np.int32))),
}


@pytest.mark.parametrize("model,case", [(DISAGG, c) for c in BAD_TEXT_REQUESTS]
                         + [(TOKENS, c) for c in BAD_TOKEN_REQUESTS])
def test_bad_input_returns_an_error_naming_the_field(server, model, case):
    field, inputs = (BAD_TEXT_REQUESTS if model == DISAGG else BAD_TOKEN_REQUESTS)[case]
    result, error = first_answer(server.grpc_url, model, tensors(**inputs))
    assert error is not None, f"{case}: accepted"
    # ours read "in ensemble 'tandem', max_tokens: got 0; allowed: ..."; Triton's own
    # (dtype, shape) name the input in quotes
    assert re.search(rf"(, {field}: |'{field}')", error.message()), error.message()
    assert server.is_ready()


def test_a_request_with_no_inputs_is_refused(server):
    # with every input optional, Triton's own check (which named the missing one) no
    # longer applies; its ensemble still refuses, saying there are none
    result, error = first_answer(server.grpc_url, DISAGG, [])
    assert error is not None and "0 inputs" in error.message(), error


def test_the_server_is_healthy_after_bad_input(server, reference):
    # every refusal happened before kv_transfer reserved pages (or in it): the pool is whole
    for _ in range(3):
        assert _stream(server, DISAGG, PROMPTS[0])[0] == reference(PROMPTS[0]).text


def _batch(server, requests: list[tuple[str, dict]], model: str = DISAGG) -> list[str]:
    """Send every request at once on one gRPC stream; the texts, by request."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    for i, (prompt, params) in enumerate(requests):
        client.async_stream_infer(model, build_inputs(prompt, **params), request_id=str(i),
                                  enable_empty_final_response=True)
    texts, done = [""] * len(requests), set()
    while len(done) < len(requests):
        result, error = results.get(timeout=120)
        assert error is None, error
        r = parse_response(result)
        rid = int(result.get_response().id)
        texts[rid] += r.text
        if r.final:
            done.add(rid)
    client.stop_stream()
    client.close()
    return texts


GREEDY = [(f"def f{i}(x):\n    return x * {i}" + " + 1" * i, dict(max_tokens=8, temperature=0.0))
          for i in range(8)]
SAMPLED = [(f"class C{i}:\n    def __init__(self",
            dict(max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=100 + i)) for i in range(8)]
CONCURRENT = [r for pair in zip(GREEDY, SAMPLED) for r in pair]    # interleaved


@pytest.fixture(scope="module")
def first_batch(server):
    return _batch(server, CONCURRENT)


def test_16_concurrent_streams_with_different_settings(server, reference, first_batch):
    assert first_batch[0::2] == [reference(p, 8).text for p, _ in GREEDY]
    assert all(first_batch[1::2])
    # really sampled: not all the same as greedy
    assert any(text != reference(p, 8).text for text, (p, _) in zip(first_batch[1::2], SAMPLED))


def test_a_second_concurrent_run_reproduces_the_first(server, reference, first_batch):
    second = _batch(server, CONCURRENT)
    assert second[0::2] == [reference(p, 8).text for p, _ in GREEDY]
    assert second[1::2] == first_batch[1::2]      # seeded: reproducible


@pytest.mark.parametrize("model", [DISAGG, COLOCATED])
def test_a_subnormal_temperature_beside_greedy_streams_breaks_nothing(server, reference, model):
    """temperature 1e-45 is positive and finite (validation accepts it); dividing logits
    by it overflows: it samples greedily, and 4 greedy streams beside it keep their text."""
    greedy = [(f"def g{i}(y):\n    return y - {i}", dict(max_tokens=8, temperature=0.0)) for i in range(4)]
    tiny = ("def h(z):\n    return", dict(max_tokens=8, temperature=1e-45))
    texts = _batch(server, [*greedy[:2], tiny, *greedy[2:]], model)
    assert texts[:2] + texts[3:] == [reference(p, 8).text for p, _ in greedy]
    assert texts[2] == reference(tiny[0], 8).text
