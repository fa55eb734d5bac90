"""Structured output through `tandem serve`, as a user starts it (the CLI, the trained demo
target with its draft model speculating, both ensembles, the OpenAI API): TensorRT-LLM's
``guided_decoding_guide_type`` / ``guided_decoding_guide`` on the disaggregated ``tandem``
(KV shipped by the prefill side) and ``tandem_colocated``, and OpenAI's
``response_format`` and vLLM's ``guided_regex`` on ``/v1``. Sampled at temperature 1 every
output is valid; a guide that does not compile is refused with xgrammar's reason."""
from __future__ import annotations

import json
import queue
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tandem.client.serve.triton_server import free_ports

from ..guided_outputs import REGEX, valid
from .servers import serve_command
from .triton_calls import post_json

pytestmark = pytest.mark.e2e
pytest.importorskip("xgrammar")
DEMO = Path(__file__).resolve().parents[2] / "checkpoints" / "demo"
SCHEMA = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
EBNF = 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9] | [1-9] [0-9]'   # its language: guided_outputs.SUMS
GUIDES = {"json_schema": json.dumps(SCHEMA), "regex": REGEX, "ebnf_grammar": EBNF}


@dataclass
class Served:
    grpc_url: str
    api_url: str


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run = tmp_path_factory.mktemp("serve-guided")
    http, grpc, metrics, api = free_ports(4)
    with serve_command(
            "--model", str(DEMO / "target"),
            "--spec", "draft_target", "--draft-model", str(DEMO / "draft"), "--mode", "both",
            "--disagg-policy", "remote", "--threads", "1", "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "8",
            "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
            "--openai-port", str(api), "--run-dir", str(run / "run"), "--log-file", str(run / "server.log"),
            "--ready-timeout", "300", ready_timeout_s=420):
        yield Served(f"127.0.0.1:{grpc}", f"http://127.0.0.1:{api}/v1")


def generate(url: str, model: str, prompt: str, n: int, **guide):
    """One gRPC stream as TensorRT-LLM's end-to-end client sends guided requests
    (``guided_decoding_guide_type`` / ``_guide`` BYTES [1, 1]): texts and finish reasons
    per sequence, errors."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    inputs = {"text_input": np.array([[prompt]]).astype(object),
              "max_tokens": np.array([[64]], dtype=np.int32), "stream": np.array([[True]]),
              "temperature": np.array([[1.0]], dtype=np.float32),
              "num_return_sequences": np.array([[n]], dtype=np.int32),
              "exclude_input_in_output": np.array([[True]]),
              **{f"guided_decoding_{k}": np.array([[v]]).astype(object) for k, v in guide.items()}}
    tensors = []
    for name, value in inputs.items():
        t = grpcclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype))
        t.set_data_from_numpy(value)
        tensors.append(t)
    done: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url=url)
    client.start_stream(callback=lambda result, error: done.put(error if error else result))
    client.async_stream_infer(model, tensors, outputs=[grpcclient.InferRequestedOutput(o) for o in
                                                      ("text_output", "sequence_index", "finish_reason")])
    client.stop_stream()
    client.close()
    texts, reasons, errors = [""] * n, [""] * n, []
    while not done.empty():
        result = done.get()
        if isinstance(result, InferenceServerException):
            errors.append(str(result))
            continue
        seq = result.as_numpy("sequence_index")
        i = 0 if seq is None else int(seq[0][0])
        texts[i] += result.as_numpy("text_output")[0].decode()
        reason = result.as_numpy("finish_reason")
        if reason is not None and reason.reshape(-1)[0]:
            reasons[i] = reason.reshape(-1)[0].decode()
    return texts, reasons, errors


@pytest.mark.parametrize("model", ["tandem", "tandem_colocated"])
@pytest.mark.parametrize("kind", ["json_schema", "regex", "ebnf_grammar", "json"])
def test_every_sample_of_the_tensorrt_llm_interface_is_valid(served, model, kind):
    guide = {"guide_type": kind, **({"guide": GUIDES[kind]} if kind in GUIDES else {})}
    texts, reasons, errors = generate(served.grpc_url, model, "def main():", 4, **guide)
    assert errors == []
    # any JSON value may be a string as long as max_tokens; the bounded guides always end
    assert all(r == "stop" for r in reasons) or kind == "json", (texts, reasons)
    assert all(valid(kind, t, SCHEMA) for t, r in zip(texts, reasons) if r == "stop"), texts


@pytest.mark.parametrize("model", ["tandem", "tandem_colocated"])
def test_a_guide_that_does_not_compile_is_refused_by_name(served, model):
    _, _, errors = generate(served.grpc_url, model, "x", 1, guide_type="json_schema",
                             guide='{"type": "nonsense"}')
    assert len(errors) == 1 and "guided_decoding_guide" in errors[0], errors
    assert 'Unsupported type "nonsense"' in errors[0]
    _, _, errors = generate(served.grpc_url, model, "x", 1, guide_type="yaml")
    assert len(errors) == 1 and "guided_decoding_guide_type" in errors[0], errors


def test_openai_response_format_json_schema_and_json_object(served):
    status, body = post_json(f"{served.api_url}/chat/completions", {
        "model": "tandem", "messages": [{"role": "user", "content": "A person:"}], "max_tokens": 64,
        "temperature": 1.0, "n": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}})
    assert status == 200, body
    assert all(valid("json_schema", c["message"]["content"], SCHEMA) for c in body["choices"]), body
    status, body = post_json(f"{served.api_url}/chat/completions", {
        "model": "tandem", "messages": [{"role": "user", "content": "A dict:"}], "max_tokens": 96,
        "temperature": 1.0, "response_format": {"type": "json_object"}})
    assert status == 200, body
    choice = body["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_openai_vllm_guided_regex_on_completions(served):
    status, body = post_json(f"{served.api_url}/completions", {
        "model": "tandem", "prompt": "Mail:", "max_tokens": 32, "temperature": 1.0, "n": 2,
        "guided_regex": REGEX})
    assert status == 200, body
    assert all(re.fullmatch(REGEX, c["text"]) for c in body["choices"]), body


def test_openai_schema_that_does_not_compile_is_a_400(served):
    status, body = post_json(f"{served.api_url}/chat/completions", {
        "model": "tandem", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert status == 400, body
    assert body["error"]["param"] == "response_format" and "nonsense" in body["error"]["message"]
