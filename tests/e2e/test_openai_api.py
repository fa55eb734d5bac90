"""The OpenAI-compatible API of `tandem serve`, driven by the official ``openai`` package.

One `tandem serve` per module, started as a user starts it (the CLI, the default
disaggregated ensemble ``tandem``, the tiny untrained demo checkpoint, ``--openai-port``);
its greedy text is compared with what the ensemble itself answers over gRPC
(``tandem.client.generate.stream_generate``) for the same prompt. The last test stops the
server with Ctrl-C and checks that the API stopped with it.
"""
from __future__ import annotations

import json
import signal
import subprocess
import urllib.request
from dataclasses import dataclass

import pytest

from tandem.client.generate import stream_generate
from tandem.client.openai.chat_template import PLAIN
from tandem.client.serve.triton_server import free_port, free_ports

from .servers import serve_command
from .triton_calls import busy_pages, metric, metric_reaches, pages_back, post_json, settled

pytestmark = pytest.mark.e2e
openai = pytest.importorskip("openai")
MODEL = "tandem"
PROMPT = "def fibonacci(n):\n    "


@dataclass
class Served:
    proc: subprocess.Popen
    grpc_url: str
    metrics_url: str
    base_url: str
    output: list


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_checkpoint):
    run = tmp_path_factory.mktemp("serve-openai")
    http, grpc, metrics, api = free_ports(4)
    with serve_command(
            "--model", str(demo_checkpoint), "--threads", "1", "--dtype", "float32", "--enforce-eager",
            "--max-num-seqs", "8", "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
            "--openai-port", str(api), "--run-dir", str(run / "run"), "--log-file", str(run / "server.log"),
            "--ready-timeout", "300", ready_timeout_s=360) as cmd:
        assert any(f"http://127.0.0.1:{api}/v1" in line for line in cmd.output), "".join(cmd.output)
        yield Served(cmd.proc, f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics",
                     f"http://127.0.0.1:{api}/v1", cmd.output)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=120)


def ensemble_text(served, prompt: str, max_tokens: int, **params) -> tuple[str, str, int]:
    """(text, finish_reason, prompt tokens) the ensemble answers itself, greedy."""
    text, last = "", None
    for r in stream_generate(served.grpc_url, prompt, model=MODEL, max_tokens=max_tokens, temperature=0.0,
                             stream=True, timeout_s=120, **params):
        text += r.text
        last = r if r.finish_reason else last
    return text, last.finish_reason, last.num_input_tokens


def post(served, path: str, body: dict) -> tuple[int, dict]:
    return post_json(served.base_url + path, body)


def test_models_lists_the_text_ensemble(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_greedy_text_equals_the_ensembles(served, client):
    want, reason, prompt_tokens = ensemble_text(served, PROMPT, 12)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (prompt_tokens, 12, prompt_tokens + 12)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and len(chunks) > 3      # streamed, step by step


def test_chat_streamed_and_not_through_the_plain_template(served, client):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "class Stack:"}]
    want, _, prompt_tokens = ensemble_text(served, PLAIN.render(messages), 10)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == prompt_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_are_independent_and_seeded(client):
    kwargs = dict(model=MODEL, prompt="import ", max_tokens=8, temperature=1.0, n=2, seed=11)
    r = client.completions.create(**kwargs)
    assert [c.index for c in r.choices] == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 16
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]   # same seed, same choices
    assert r.choices[0].text != r.choices[1].text                            # seed + index: they differ
    chunks = list(client.completions.create(**kwargs, stream=True))
    for i in (0, 1):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) == r.choices[i].text


def test_stop_strings_end_the_text_before_them(served, client):
    full, _, _ = ensemble_text(served, PROMPT, 24)
    stop = next(full[i:i + 2] for i in range(2, len(full) - 2) if full.find(full[i:i + 2]) > 0)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full[:full.find(stop)], "stop")
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                  stop=["\x00never", stop])
    assert r.choices[0].text == full[:full.find(stop)]


@pytest.mark.parametrize("body,param", [
    (dict(max_tokens=100000), "max_tokens"),     # the ensemble's INVALID_ARG: over the context
    (dict(temperature=7), "temperature"),         # this API's own check
    (dict(n=0), "n"),
])
def test_a_bad_parameter_is_a_400_with_openais_error_json(served, client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, **body)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    status, raw = post(served, "/completions", dict(model=MODEL, prompt=PROMPT, **body))
    assert status == 400 and set(raw) == {"error"}
    assert set(raw["error"]) == {"message", "type", "param", "code"}
    assert raw["error"]["type"] == "invalid_request_error" and param in raw["error"]["message"]


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and MODEL in e.value.body["message"]


def test_a_client_that_disconnects_mid_stream_frees_its_pages(served, client):
    idle = settled(lambda: busy_pages(served, "decode"))
    aborted = metric(served, "tandem_requests_finished_total", "decode", reason="abort")
    # most of the context (min_tokens: no early end of text): seconds of decoding; closed after 5 chunks
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2000, temperature=0, stream=True,
                                       extra_body=dict(min_tokens=2000))
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()                                # the HTTP connection goes away mid-stream
    metric_reaches(served, "tandem_requests_finished_total", "decode", aborted + 1, reason="abort",
                   failing="the engine did not stop the abandoned stream")
    pages_back(served, idle, "decode", failing="the abandoned stream's pages were not freed")
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.choices[0].text == ensemble_text(served, PROMPT, 6)[0]


def inference_count(served, model: str) -> int:
    import tritonclient.grpc as grpcclient
    with grpcclient.InferenceServerClient(served.grpc_url) as c:
        stats = c.get_inference_statistics(model, as_json=True)["model_stats"]
    return sum(int(s.get("inference_count", 0)) for s in stats)


def test_the_api_streams_from_decode_without_the_postprocess_hop(served, client):
    """The API's per-token path: decode's replies straight out through ``tandem_direct``,
    never a postprocess execution per token; the text is the full ensemble's."""
    post0, direct0 = inference_count(served, "postprocess"), inference_count(served, "tandem_direct")
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
    assert inference_count(served, "tandem_direct") == direct0 + 1
    assert inference_count(served, "postprocess") == post0
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ensemble_text(served, PROMPT, 12)[0]


def test_the_cancel_model_refuses_what_is_not_a_cancel_token(served):
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    t = grpcclient.InferInput("cancel_token", [1], "BYTES")
    t.set_data_from_numpy(np.array([b"../decode_0/123"], dtype=np.object_))
    with grpcclient.InferenceServerClient(served.grpc_url) as c, pytest.raises(InferenceServerException) as e:
        c.infer("cancel", [t])
    assert "cancel_token" in str(e.value) and "32 hex digits" in str(e.value)


def test_a_client_that_gives_up_on_a_whole_response_frees_its_pages(served):
    """Not streamed: the frontend notices the closed connection while it waits.

    ``min_tokens``: the untrained model, sampling, can end its text after a few hundred
    tokens (1.5 s), sooner than the close is seen; 2000 tokens are seconds of decoding."""
    import http.client
    idle = settled(lambda: busy_pages(served, "decode"))
    aborted = metric(served, "tandem_requests_finished_total", "decode", reason="abort")
    host, port = served.base_url.removeprefix("http://").removesuffix("/v1").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(dict(model=MODEL, prompt=PROMPT, max_tokens=2000, min_tokens=2000)),
                 {"Content-Type": "application/json"})
    metric_reaches(served, "tandem_requests_in_engine", "decode", 1, failing="the request never reached the engine")
    conn.close()
    metric_reaches(served, "tandem_requests_finished_total", "decode", aborted + 1, reason="abort",
                   failing="the engine did not stop the abandoned request")
    pages_back(served, idle, "decode", failing="the abandoned request's pages were not freed")


def test_logprobs_of_the_sampled_tokens(served, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == r.usage.completion_tokens == 6
    assert all(x <= 0 for x in lp.token_logprobs) and "".join(lp.tokens) == r.choices[0].text
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       temperature=0, logprobs=True)
    assert len(c.choices[0].logprobs.content) == 4
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                            stream=True))
    streamed = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_penalties_reach_the_ensemble_when_it_declares_them(served, client):
    import tritonclient.grpc as grpcclient
    config = grpcclient.InferenceServerClient(served.grpc_url).get_model_config(MODEL, as_json=True)["config"]
    declared = {i["name"] for i in config["input"]}
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, presence_penalty=1.5,
                  frequency_penalty=0.5)
    if {"presence_penalty", "frequency_penalty"} <= declared:
        r = client.completions.create(**kwargs)
        assert r.usage.completion_tokens >= 1
    else:
        with pytest.raises(openai.BadRequestError, match="declares no input"):
            client.completions.create(**kwargs)


def test_token_id_prompts_complete_as_their_text_does(served, client, demo_checkpoint):
    """Token-id prompts (one list, or a list of lists: what lm-evaluation-harness sends) go
    to the token-ids twin and complete exactly as the same tokens sent as text; echo puts
    the decoded prompt first; ids outside the vocabulary are a 400 naming the field."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(demo_checkpoint / "tokenizer.json"))
    other = "class Stack:\n    def push(self, x):"
    ids = [tok.encode(PROMPT).ids, tok.encode(other).ids]
    want = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0.0).choices[0].text
            for p in (PROMPT, other)]
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=8, temperature=0.0)
    assert one.choices[0].text == want[0] and one.usage.prompt_tokens == len(ids[0])
    both = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0.0)
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == want
    echoed = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=8, temperature=0.0, echo=True)
    assert echoed.choices[0].text == tok.decode(ids[0], skip_special_tokens=False) + want[0]
    streamed = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=8, temperature=0.0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want[0]
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=[10 ** 6], max_tokens=4)
    assert exc.value.status_code == 400


def hf_logprobs(checkpoint, ids: list[int]):
    """[len(ids), V] log-softmax of HF transformers' fp32 logits (row j predicts ids[j + 1])."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_echo_with_logprobs_gives_the_prompts_log_probabilities_as_hf_does(served, client, demo_checkpoint):
    """lm-evaluation-harness's log-likelihood request, through the openai package: token ids,
    echo, logprobs 1, max_tokens 1. The prompt's tokens come first with HF's fp32 log
    probabilities (the first null); a prompt long enough for the prefill side is computed
    by decode instead, and asking twice (the prefix now cached) changes nothing."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(demo_checkpoint / "tokenizer.json"))
    ids = tok.encode((PROMPT + "if n < 2:\n        return n\n    ") * 12).ids[:300]
    ref = hf_logprobs(demo_checkpoint, ids)
    want = [None] + [float(ref[j, ids[j + 1]]) for j in range(len(ids) - 1)]
    for _ in range(2):
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1,
                                      echo=True, seed=1234)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:-1] == pytest.approx(want[1:], abs=1e-4)
        for j in range(1, len(ids)):
            top = lp.top_logprobs[j]
            best = int(ref[j - 1].argmax())
            greedy = ids[j] == best
            # lm-eval's is_greedy: the token's value is the largest in its position's dict
            assert (lp.token_logprobs[j] == max(top.values())) == greedy, j
            assert max(top.values()) == pytest.approx(float(ref[j - 1, best]), abs=1e-4)
    # a text prompt, streamed: the prompt's log probabilities lead the first chunk
    chunks = [c for c in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                                   logprobs=2, echo=True, stream=True) if c.choices]
    first = chunks[0].choices[0].logprobs
    n_prompt = len(tok.encode(PROMPT).ids)
    assert first.token_logprobs[0] is None and len(first.tokens) == n_prompt + 1
    assert all(len(d) <= 3 for d in first.top_logprobs[1:])
    # vLLM's prompt_logprobs: by token id, with ranks
    status, body = post(served, "/completions", dict(model=MODEL, prompt=ids[:20], max_tokens=1, temperature=0,
                                                     prompt_logprobs=3))
    assert status == 200, body
    got = body["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == 20
    assert got[5][str(ids[5])]["logprob"] == pytest.approx(want[5], abs=1e-4)
    assert sorted(e["rank"] for e in got[5].values() if e["rank"] is not None) == [1, 2, 3]


def test_top_logprobs_are_the_most_likely_alternatives(served, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 5 <= len(top) <= 6 and value == max(top.values())    # greedy: the token is the best
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=20)
    for entry in c.choices[0].logprobs.content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 20 and values == sorted(values, reverse=True) and values[0] == entry.logprob


def test_logit_bias_is_honoured(served, client, demo_checkpoint):
    """+100 on one token makes greedy decoding emit it; -100 on the greedy token makes it
    never appear; a token id outside the vocabulary is a 400 naming logit_bias."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(demo_checkpoint / "tokenizer.json"))
    forced = tok.encode(" banana", add_special_tokens=False).ids[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == tok.decode([forced] * 5)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    first = tok.encode(plain.choices[0].text, add_special_tokens=False).ids[0]
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                       logit_bias={str(first): -100})
    assert first not in tok.encode(banned.choices[0].text, add_special_tokens=False).ids
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias={str(10 ** 6): 5})
    assert e.value.body["param"] == "logit_bias"
    # EOS made certain: the text stops at once, unless ignore_eos (vLLM's, as load tests send it)
    eos = json.loads((demo_checkpoint / "config.json").read_text())["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                        logit_bias={str(eos): 100})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                     logit_bias={str(eos): 100}, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError) as e:       # a field this API does not know
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"min_p": 0.5})
    assert e.value.body["param"] == "min_p"


def test_an_api_key_is_required_by_the_openai_package_s_own_client(served, demo_checkpoint):
    """``--api-key``: the `openai` package sends its key as a bearer token; a wrong one is
    its AuthenticationError (401), the right one serves the same greedy text."""
    from tandem.client.openai.frontend import OpenAIFrontend
    key = "sk-tandem-e2e-key"
    with OpenAIFrontend(served.grpc_url, [MODEL], str(demo_checkpoint), port=free_port(), api_key=key) as api:
        wrong = openai.OpenAI(base_url=api.base_url, api_key="sk-wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as exc:
            wrong.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert exc.value.status_code == 401 and key not in str(exc.value.body)
        right = openai.OpenAI(base_url=api.base_url, api_key=key, max_retries=0, timeout=120)
        got = right.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.0)
        assert got.choices[0].text == ensemble_text(served, PROMPT, 8)[0]
        assert [m.id for m in right.models.list()] == [MODEL]


def test_the_frontend_counts_requests_and_errors(served, client):
    client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    text = urllib.request.urlopen(served.base_url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    assert 'tandem_openai_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'tandem_openai_errors_total{endpoint="/v1/completions",status="400"}' in text
    assert "tandem_openai_request_seconds_count" in text and "tandem_openai_time_to_first_token_seconds" in text


def test_ctrl_c_stops_the_api_with_the_server(served):
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(timeout=90) == 0, "".join(served.output)
    with pytest.raises(OSError):
        urllib.request.urlopen(served.base_url + "/models", timeout=5)
