"""Scripts written for the TensorRT-LLM backend, run unchanged against
`tandem serve --ensemble-name ensemble` (disaggregated) on a real tritonserver.

The client below is written from the contract of tensorrtllm_backend v0.14.0's
``inflight_batcher_llm/client/end_to_end_grpc_client.py`` (the release paired with
Triton 2.51), not copied from it:

- it always sends ``text_input`` BYTES [1, 1], ``max_tokens`` INT32 [1, 1], ``stream``
  BOOL [1, 1], ``num_return_sequences`` and ``beam_width`` INT32 [1, 1] and
  ``temperature`` FP32 [1, 1]; when asked, ``stop_words`` / ``bad_words`` /
  ``embedding_bias_words`` BYTES [1, N], ``embedding_bias_weights`` FP32 [1, N], the
  penalties FP32 [1, 1], ``end_id`` / ``pad_id`` INT32 [1, 1], ``return_log_probs`` /
  ``return_context_logits`` / ``return_generation_logits`` BOOL [1, 1];
- it requests the outputs ``text_output`` (+ ``cum_log_probs`` and ``output_log_probs``,
  ``context_logits``, ``generation_logits``, ``sequence_index`` when it asked for them);
- it opens a gRPC stream, sends one request, closes the stream (which waits for every
  response) and reads each response's ``as_numpy("text_output")[0].decode()``: appended
  per ``sequence_index`` when streaming, assigned otherwise; an error arrives as an
  ``InferenceServerException`` in the callback;
- ``--check-outputs`` compares the texts with the expected ones: with temperature 0, the
  greedy completion (non-streaming texts start with the prompt).

The expected texts come from the offline engine (``LLM.generate``) with the same
settings, log probs from Hugging Face transformers' fp32 logits.
"""
from __future__ import annotations

import json
import queue
import re
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import pytest

from tandem.client.serve.triton_server import free_ports, stub_processes

from .servers import serve_command

pytestmark = pytest.mark.e2e
MODEL = "ensemble"          # the TensorRT-LLM client accepts only "ensemble" and "tensorrt_llm_bls"
MAX_NUM_SEQS = 8
PROMPTS = ["The quick brown fox", "def fibonacci(n):"]
FOX = PROMPTS[0]


# ---- the client, from the end-to-end gRPC client's contract ---------------------------
def prepare_inputs(prompt: str, output_len: int, *, streaming: bool, beam_width: int = 1,
                   num_return_sequences: int = 1, temperature: float = 1.0, stop_words=(), bad_words=(),
                   repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
                   embedding_bias_words=None, embedding_bias_weights=None, end_id=None, pad_id=None,
                   return_log_probs=False, return_context_logits=False, return_generation_logits=False,
                   **extra) -> dict[str, np.ndarray]:
    """The tensors the client sends, with its names, dtypes and shapes ([1, 1] and [1, N]);
    ``extra`` adds other inputs of the TensorRT-LLM ensemble (e.g. ``random_seed``)."""
    text = np.array([[prompt]]).astype(object)
    inputs = {
        "text_input": text,
        "max_tokens": np.ones_like(text).astype(np.int32) * output_len,
        "stream": np.array([[streaming]], dtype=bool),
        # the client asks beam searches for one sequence and clips on its side
        "num_return_sequences": np.array([[num_return_sequences if beam_width == 1 else 1]], dtype=np.int32),
        "beam_width": np.array([[beam_width]], dtype=np.int32),
        "temperature": np.array([[temperature]], dtype=np.float32),
    }
    if bad_words:
        inputs["bad_words"] = np.array([list(bad_words)], dtype=object)
    if stop_words:
        inputs["stop_words"] = np.array([list(stop_words)], dtype=object)
    for name, value in (("repetition_penalty", repetition_penalty), ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty)):
        if value is not None:
            inputs[name] = np.array([[value]], dtype=np.float32)
    for name, value in (("return_log_probs", return_log_probs), ("return_context_logits", return_context_logits),
                        ("return_generation_logits", return_generation_logits)):
        if value:
            inputs[name] = np.array([[value]], dtype=bool)
    if embedding_bias_words is not None:
        inputs["embedding_bias_words"] = np.array([list(embedding_bias_words)], dtype=object)
        inputs["embedding_bias_weights"] = np.array([list(embedding_bias_weights)], dtype=np.float32)
    for name, value in (("end_id", end_id), ("pad_id", pad_id)):
        if value is not None:
            inputs[name] = np.array([[value]], dtype=np.int32)
    return {**inputs, **extra}


@dataclass
class Completion:
    texts: list[str]                                  # one per sequence
    errors: list[str] = field(default_factory=list)
    log_probs: dict[int, list[float]] = field(default_factory=dict)
    cum_log_probs: dict[int, float] = field(default_factory=dict)
    shapes: list[dict[str, tuple]] = field(default_factory=list)   # of each response


def run_inference(url: str, inputs: dict[str, np.ndarray], model: str = MODEL) -> Completion:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    streaming = bool(inputs["stream"][0][0])
    beam_width = int(inputs["beam_width"][0][0])
    n = int(inputs["num_return_sequences"][0][0])
    tensors = []
    for name, value in inputs.items():
        t = grpcclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype))
        t.set_data_from_numpy(value)
        tensors.append(t)
    wanted = ["text_output"]
    if "return_log_probs" in inputs:
        wanted += ["cum_log_probs", "output_log_probs"]
    if "return_context_logits" in inputs:
        wanted.append("context_logits")
    if "return_generation_logits" in inputs:
        wanted.append("generation_logits")
    if n > 1:
        wanted.append("sequence_index")

    done: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url=url)

    def callback(box, result, error):
        box.put(error if error else result)

    client.start_stream(callback=partial(callback, done))
    client.async_stream_infer(model, tensors, outputs=[grpcclient.InferRequestedOutput(o) for o in wanted],
                              request_id="1")
    client.stop_stream()          # returns once the server closed the stream
    client.close()

    out = Completion([""] * n)
    while not done.empty():
        result = done.get()
        if isinstance(result, InferenceServerException):
            out.errors.append(str(result))
            continue
        out.shapes.append({name: result.as_numpy(name).shape for name in wanted})
        output = result.as_numpy("text_output")
        seq = result.as_numpy("sequence_index")
        seq = 0 if seq is None else int(seq[0][0])
        if streaming and beam_width == 1:
            out.texts[seq] += output[0].decode("utf-8")
        else:
            out.texts[seq] = output[0].decode("utf-8")
        log_probs = result.as_numpy("output_log_probs")
        if log_probs is not None:
            out.log_probs.setdefault(seq, []).extend(float(x) for x in log_probs[0][0])
            out.cum_log_probs[seq] = float(result.as_numpy("cum_log_probs")[0][0])
    return out


# ---- the server and the references ---------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_checkpoint):
    """`tandem serve --ensemble-name ensemble`, as a user starts it; ``(grpc_url, banner, run dir)``."""
    run_dir = tmp_path_factory.mktemp("trtllm")
    http, grpc, metrics = map(str, free_ports(3))
    with serve_command(
            "--ensemble-name", MODEL, "--model",
            str(demo_checkpoint), "--dtype", "float32", "--enforce-eager", "--threads", "1", "--max-num-seqs",
            str(MAX_NUM_SEQS), "--http-port", http,
            "--grpc-port", grpc, "--metrics-port", metrics, "--run-dir", str(run_dir / "run"),
            "--log-file", str(run_dir / "tritonserver.log"), "--ready-timeout", "300", ready_timeout_s=360) as cmd:
        yield f"127.0.0.1:{grpc}", cmd.banner, run_dir / "run"


@pytest.fixture(scope="module")
def url(server):
    return server[0]


@pytest.fixture(scope="module")
def engine(offline_llm):
    """The offline engine with the server's settings: what the server's texts must equal."""
    return offline_llm(max_num_seqs=MAX_NUM_SEQS)


def offline(engine, prompt, max_tokens, **params):
    from tandem.backends.engine.params import SamplingParams
    return engine.generate(prompt, SamplingParams(max_tokens=max_tokens, **params))[0]


def greedy(engine, prompt, max_tokens=16, **params):
    return offline(engine, prompt, max_tokens, temperature=0.0, **params)


# ---- the tests -----------------------------------------------------------------------
def test_serve_announces_the_ensemble_under_the_tensorrt_llm_name(server):
    _, banner, run_dir = server
    assert any(line.split()[:3] == ["ensemble", MODEL, "="] and "tandem" in line for line in banner), banner
    assert any(line.split()[:2] == ["ensemble", "tandem"] for line in banner), banner
    assert len(stub_processes(run_dir)) == 6    # one set of steps behind both names, and cancel


def test_the_ensemble_declares_every_tensor_the_client_sends(url):
    """Triton refuses an input a model does not declare: each tensor of a request with
    every option set is declared, with the client's dtype."""
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc import model_config_pb2
    from tritonclient.utils import np_to_triton_dtype

    config = grpcclient.InferenceServerClient(url).get_model_config(MODEL).config
    declared = {i.name: model_config_pb2.DataType.Name(i.data_type)[len("TYPE_"):] for i in config.input}
    everything = prepare_inputs("x", 4, streaming=True, num_return_sequences=2, temperature=0.5,
                                stop_words=["a"], bad_words=["b"], repetition_penalty=1.1, presence_penalty=0.1,
                                frequency_penalty=0.1, embedding_bias_words=["c"], embedding_bias_weights=[1.0],
                                end_id=2, pad_id=0, return_log_probs=True, return_context_logits=True,
                                return_generation_logits=True)
    for name, value in everything.items():
        want = "STRING" if np_to_triton_dtype(value.dtype) == "BYTES" else np_to_triton_dtype(value.dtype)
        assert declared.get(name) == want, name
    outputs = {o.name for o in config.output}
    assert {"text_output", "cum_log_probs", "output_log_probs", "context_logits", "generation_logits",
            "batch_index", "sequence_index"} <= outputs


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_check_outputs(url, engine, prompt):
    """``--check-outputs`` with temperature 0: the non-streaming text is the prompt and its
    greedy completion."""
    got = run_inference(url, prepare_inputs(prompt, 16, streaming=False, temperature=0.0))
    assert got.errors == []
    assert got.texts == [prompt + greedy(engine, prompt).text]
    assert got.shapes == [{"text_output": (1,)}]       # one string per row


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streaming_appends_the_deltas(url, engine, prompt):
    got = run_inference(url, prepare_inputs(prompt, 16, streaming=True, temperature=0.0))
    assert got.errors == [] and len(got.shapes) >= 2
    assert got.texts == [greedy(engine, prompt).text]          # streaming never repeats the prompt
    assert {s["text_output"] for s in got.shapes} == {(1,)}


@pytest.mark.parametrize("streaming", [False, True])
def test_stop_words(url, engine, streaming):
    words = ["sen", ""]          # [1, N]; the "" TensorRT-LLM pads ragged lists with is ignored
    assert "sen" in greedy(engine, FOX).text
    got = run_inference(url, prepare_inputs(FOX, 16, streaming=streaming, temperature=0.0, stop_words=words))
    want = greedy(engine, FOX, stop=["sen"]).text
    assert got.errors == [] and "sen" not in want
    assert got.texts == [(FOX if not streaming else "") + want]


@pytest.mark.parametrize("streaming", [False, True])
def test_num_return_sequences_gives_independent_samples(url, engine, streaming):
    """n samples of one prompt; with a seed, sample i is the engine's with seed + i."""
    inputs = prepare_inputs(FOX, 12, streaming=streaming, num_return_sequences=2, temperature=1.0,
                            random_seed=np.array([[1234]], dtype=np.uint64))
    got = run_inference(url, inputs)
    assert got.errors == []
    want = [offline(engine, FOX, 12, temperature=1.0, seed=1234 + i).text for i in range(2)]
    assert want[0] != want[1]
    assert got.texts == [(FOX if not streaming else "") + w for w in want]
    assert {s["sequence_index"] for s in got.shapes} == {(1, 1)}


@pytest.mark.parametrize("streaming", [False, True])
def test_return_log_probs(url, engine, demo_checkpoint, streaming):
    """``cum_log_probs`` [1, 1] and ``output_log_probs`` [1, 1, n] per response: each
    generated token's log-probability (greedy: under the model's softmax at temperature
    1), checked against transformers' fp32 logits."""
    import torch
    from transformers import AutoModelForCausalLM

    got = run_inference(url, prepare_inputs(FOX, 10, streaming=streaming, temperature=0.0, return_log_probs=True))
    assert got.errors == []
    ref = greedy(engine, FOX, 10)
    model = AutoModelForCausalLM.from_pretrained(str(demo_checkpoint), dtype=torch.float32).eval()
    ids = torch.tensor([ref.prompt_token_ids + ref.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(ref.prompt_token_ids) - 1:-1].float()
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ref.token_ids)[:, None])[:, 0].tolist()
    assert got.log_probs[0] == pytest.approx(want, abs=2e-3)
    assert got.cum_log_probs[0] == pytest.approx(sum(want), abs=1e-2)
    assert all(s["cum_log_probs"] == (1, 1) and len(s["output_log_probs"]) == 3 for s in got.shapes)
    if not streaming:
        assert got.shapes[0]["output_log_probs"] == (1, 1, len(ref.token_ids))


@pytest.mark.parametrize("options,error", [
    (dict(beam_width=2), "beam_width: got 2; allowed: 1 (Tandem has no beam search"),
    (dict(return_context_logits=True), "return_context_logits: not supported"),
    (dict(return_generation_logits=True), "return_generation_logits: not supported"),
])
def test_what_tandem_cannot_do_is_refused_with_a_clear_error(url, options, error):
    got = run_inference(url, prepare_inputs(FOX, 8, streaming=False, **options))
    assert len(got.errors) == 1 and error in got.errors[0], got.errors
    assert got.texts == [""]


def test_bad_words_remove_a_word_the_greedy_text_contained(url, engine):
    assert re.search(r"\bself\b", greedy(engine, FOX).text)
    got = run_inference(url, prepare_inputs(FOX, 16, streaming=False, temperature=0.0, bad_words=["self", ""]))
    assert got.errors == []
    assert not re.search(r"\bself\b", got.texts[0])
    assert got.texts == [FOX + greedy(engine, FOX, bad_words=["self"]).text]


def test_penalties_are_applied(url, engine):
    penalties = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5)
    got = run_inference(url, prepare_inputs(FOX, 16, streaming=True, temperature=0.0, **penalties))
    want = greedy(engine, FOX, **penalties).text
    assert got.errors == [] and got.texts == [want]
    assert want != greedy(engine, FOX).text


def test_min_length_holds_back_stop_words(url, engine):
    got = run_inference(url, prepare_inputs(FOX, 16, streaming=True, temperature=0.0, stop_words=["sen"],
                                            min_length=np.array([[4]], dtype=np.int32)))
    want = greedy(engine, FOX, stop=["sen"], min_tokens=4).text
    assert got.errors == [] and got.texts == [want]
    assert len(want) > len(greedy(engine, FOX, stop=["sen"]).text)


def test_embedding_bias_reaches_the_logits(url, engine):
    tokenizer = engine.engine.tokenizer
    bias = {}
    for word, weight in (("call", 30.0), ("self", -30.0)):
        for t in tokenizer.encode(word, add_special_tokens=False).ids:
            bias[t] = bias.get(t, 0.0) + weight
    got = run_inference(url, prepare_inputs(FOX, 12, streaming=False, temperature=0.0,
                                            embedding_bias_words=["call", "self"],
                                            embedding_bias_weights=[30.0, -30.0]))
    want = greedy(engine, FOX, 12, logit_bias=bias).text
    assert got.errors == [] and got.texts == [FOX + want]
    assert want != greedy(engine, FOX, 12).text


def test_end_id_ends_the_text_and_pad_id_is_accepted(url, engine):
    ref = greedy(engine, FOX)
    end = ref.token_ids[2]
    got = run_inference(url, prepare_inputs(FOX, 16, streaming=False, temperature=0.0, end_id=end, pad_id=0))
    want = greedy(engine, FOX, stop_token_ids=[end], ignore_eos=True)
    assert got.errors == [] and got.texts == [FOX + want.text]
    assert len(want.token_ids) < len(ref.token_ids)


# the client's guided decoding flags (newer than v0.14.0): --guided-decoding-guide-type and
# --guided-decoding-guide, sent as np.array([[value]]).astype(object)
@pytest.mark.parametrize("guide_type,guide,check", [
    # any JSON value may outlast 30 tokens (a long string): it starts as one
    ("json", None, lambda t: t[:1] and t[:1] in '{["-0123456789tfn'),
    ("json_schema", '{"properties": {"answer": {"title": "Answer", "type": "integer"}}, '
                    '"required": ["answer"], "title": "Answer", "type": "object"}',
     lambda t: type(json.loads(t)["answer"]) is int),
    ("regex", r"\d+", lambda t: re.fullmatch(r"\d+", t)),
    ("ebnf_grammar", "root ::= [0-9]+", lambda t: re.fullmatch(r"[0-9]+", t)),
])
@pytest.mark.parametrize("streaming", [False, True])
def test_guided_decoding_flags(url, guide_type, guide, check, streaming):
    pytest.importorskip("xgrammar")
    extra = {"guided_decoding_guide_type": np.array([[guide_type]]).astype(object),
             "exclude_input_in_output": np.array([[True]], dtype=bool)}
    if guide is not None:
        extra["guided_decoding_guide"] = np.array([[guide]]).astype(object)
    got = run_inference(url, prepare_inputs("What is the year after 2024? Answer:", 30, streaming=streaming,
                                            temperature=0.0, **extra))
    assert got.errors == [], got.errors
    assert check(got.texts[0]), got.texts
