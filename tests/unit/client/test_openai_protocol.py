"""The OpenAI-compatible API without a server: request checks, the mapping to the
ensemble's tensors, its errors as OpenAI's, chat templates rendered as transformers
renders them, and the routes (SSE chunks, ``n`` choices, usage, error JSON) driven
through the ASGI app with a stand-in for the gRPC backend."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from pydantic import ValidationError

from tandem.client.openai.app import create_app
from tandem.client.openai.chat_template import PLAIN, ChatTemplate, ChatTemplateError
from tandem.client.openai.ensemble_request import DEFAULT_DECLARED, ensemble_inputs, upstream_error
from tandem.client.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from tandem.client.openai.triton_backend import EnsembleResponse, ModelInterface

DEMO = "checkpoints/demo/target"


# ---- requests --------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -0.1), ("temperature", 2.5),
                                         ("top_p", 0), ("top_p", 1.5), ("n", 0), ("n", 17), ("seed", -1),
                                         ("presence_penalty", 3), ("frequency_penalty", -2.5),
                                         ("logprobs", 21), ("top_k", -1),
                                         # INT32 inputs: larger values would wrap around
                                         ("max_tokens", 2 ** 32 + 5), ("top_k", 2 ** 32 + 1),
                                         ("min_tokens", 2 ** 31)])
def test_out_of_range_fields_are_refused_by_name(field, value):
    with pytest.raises(ValidationError) as e:
        CompletionRequest(model="m", prompt="x", **{field: value})
    assert e.value.errors()[0]["loc"] == (field,)


def test_prompts_text_or_token_ids():
    assert CompletionRequest(model="m", prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(model="m", prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(model="m", prompt=[[1, 2], [7]]).prompts() == [[1, 2], [7]]
    for prompt in ([], [[]], [[1, 2], []], [-1], [2 ** 31], [[1], [-3]]):
        with pytest.raises(OpenAIError) as e:
            CompletionRequest(model="m", prompt=prompt).prompts()
        assert e.value.status == 400 and e.value.param == "prompt", prompt


def test_a_token_id_prompt_is_the_ensembles_input_ids():
    from tandem.client.openai.ensemble_request import ensemble_inputs
    req = CompletionRequest(model="m", prompt=[5, 6, 7], max_tokens=4)
    declared = {"input_ids", "max_tokens", "stream", "exclude_input_in_output"}
    arrays = ensemble_inputs(req, [5, 6, 7], declared, index=0, max_tokens=4, model="tandem_tokens")
    assert arrays["input_ids"].dtype.name == "int32" and arrays["input_ids"].tolist() == [[5, 6, 7]]
    assert "text_input" not in arrays and "exclude_input_in_output" not in arrays


@pytest.mark.parametrize("fields,param", [(dict(suffix="x"), "suffix"), (dict(best_of=3), "best_of"),
                                          (dict(logit_bias={"five": 1.0}), "logit_bias"),
                                          (dict(logit_bias={"-5": 1.0}), "logit_bias"),
                                          (dict(logit_bias={"5": 100.5}), "logit_bias"),
                                          (dict(stream_options={"include_usage": True}), "stream_options")])
def test_fields_tandem_cannot_honour_are_refused_not_ignored(fields, param):
    with pytest.raises(OpenAIError) as e:
        CompletionRequest(model="m", prompt="x", **fields).unsupported()
    assert (e.value.status, e.value.param) == (400, param)


@pytest.mark.parametrize("fields,param", [(dict(functions=[{"name": "f"}]), "functions"),
                                          (dict(response_format={"type": "yaml"}), "response_format"),
                                          (dict(top_logprobs=1), "top_logprobs"),
                                          (dict(stream=True, prompt_logprobs=1), "prompt_logprobs")])
def test_chat_fields_tandem_cannot_honour(fields, param):
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)
    with pytest.raises(OpenAIError) as e:
        req.unsupported()
    assert e.value.param == param


def test_chat_content_parts_and_limits():
    req = ChatCompletionRequest(model="m", max_completion_tokens=7, max_tokens=9, messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert req.messages[0].text() == "ab" and req.token_limit() == 7
    image = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(OpenAIError, match="image_url"):
        image.messages[0].text()
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=[])


# ---- the ensemble's tensors --------------------------------------------------------------------
def test_each_choice_gets_its_own_seed_and_the_batch_dimension():
    req = CompletionRequest(model="m", prompt="p", temperature=0.5, top_p=0.9, seed=2 ** 64 - 1, n=3,
                            stop=["\n\n", "", "END"])
    arrays = [ensemble_inputs(req, "p", DEFAULT_DECLARED, index=i, max_tokens=5, stream=True) for i in range(3)]
    assert [a["seed"].tolist() for a in arrays] == [[[2 ** 64 - 1]], [[0]], [[1]]]
    a = arrays[0]
    assert a["text_input"].tolist() == [[b"p"]] and a["text_input"].dtype == object
    assert a["max_tokens"].dtype == np.int32 and a["temperature"].dtype == np.float32
    assert a["stream"].tolist() == [[True]] and a["exclude_input_in_output"].tolist() == [[True]]
    assert a["stop_words"].tolist() == [[b"\n\n", b"END"]]          # "" stops nothing: left out
    assert "top_k" not in a and "presence_penalty" not in a


def test_a_penalty_is_sent_when_declared_and_refused_when_not():
    req = CompletionRequest(model="m", prompt="p", presence_penalty=0.5, min_tokens=3)
    with pytest.raises(OpenAIError) as e:
        ensemble_inputs(req, "p", DEFAULT_DECLARED, index=0, max_tokens=5)
    assert e.value.param == "presence_penalty" and "declares no input" in e.value.message
    declared = DEFAULT_DECLARED | {"presence_penalty", "min_length"}
    a = ensemble_inputs(req, "p", declared, index=0, max_tokens=5)
    assert a["presence_penalty"].tolist() == [[0.5]] and a["min_length"].tolist() == [[3]]
    neutral = CompletionRequest(model="m", prompt="p", presence_penalty=0.0, frequency_penalty=0.0)
    assert "presence_penalty" not in ensemble_inputs(neutral, "p", DEFAULT_DECLARED, index=0, max_tokens=5)


def test_logprobs_ask_for_return_log_probs():
    req = CompletionRequest(model="m", prompt="p", logprobs=0)
    with pytest.raises(OpenAIError, match="return_log_probs"):
        ensemble_inputs(req, "p", DEFAULT_DECLARED, index=0, max_tokens=5, logprobs=True)
    a = ensemble_inputs(req, "p", DEFAULT_DECLARED | {"return_log_probs"}, index=0, max_tokens=5, logprobs=True)
    assert a["return_log_probs"].tolist() == [[True]] and "num_top_log_probs" not in a


ALL_LOGPROBS = DEFAULT_DECLARED | {"return_log_probs", "num_top_log_probs", "num_prompt_log_probs",
                                   "logit_bias_token_ids", "logit_bias_values"}


@pytest.mark.parametrize("fields,want", [
    (dict(logprobs=3), {"return_log_probs": [[True]], "num_top_log_probs": [[3]]}),
    (dict(logprobs=2, echo=True), {"return_log_probs": [[True]], "num_top_log_probs": [[2]],
                                   "num_prompt_log_probs": [[2]]}),
    (dict(prompt_logprobs=4), {"num_prompt_log_probs": [[4]]}),
    (dict(logprobs=1, echo=True, prompt_logprobs=5), {"return_log_probs": [[True]], "num_top_log_probs": [[1]],
                                                      "num_prompt_log_probs": [[5]]}),
    (dict(logit_bias={"7": -100, "3": 2.5}), {"logit_bias_token_ids": [[7, 3]],
                                              "logit_bias_values": [[-100.0, 2.5]]}),
])
def test_alternatives_prompt_logprobs_and_bias_become_their_inputs(fields, want):
    req = CompletionRequest(model="m", prompt="p", **fields)
    req.unsupported()
    a = ensemble_inputs(req, "p", ALL_LOGPROBS, index=0, max_tokens=5, logprobs=req.logprobs is not None)
    assert {k: v.tolist() for k, v in a.items() if k in ALL_LOGPROBS - DEFAULT_DECLARED} == want
    with pytest.raises(OpenAIError) as e:       # an ensemble without them: refused by name
        ensemble_inputs(req, "p", DEFAULT_DECLARED | {"return_log_probs"}, index=0, max_tokens=5,
                        logprobs=req.logprobs is not None)
    assert e.value.param in ("logprobs", "prompt_logprobs", "logit_bias")


@pytest.mark.parametrize("message,status,param", [
    ("in ensemble 'tandem', max_tokens: got 0; allowed: an integer >= 1", 400, "max_tokens"),
    ("in ensemble 'tandem', stop_words: 17 stop words; allowed: at most 16", 400, "stop"),
    ("text_input: empty; allowed: non-empty UTF-8 text", 400, "prompt"),
    ("the decode KV pool is full (need 9 pages, 2 free); retry later", 503, None),
    ("unavailable: the KV transfer failed (sender died); retry", 503, None),
    ("Request for unknown model: 'tandem' has no available versions", 503, None),
    ("internal error: the engine step failed; request aborted", 500, None),
])
def test_ensemble_errors_get_the_status_their_code_means(message, status, param):
    e = upstream_error(message)
    assert (e.status, e.param, e.message) == (status, param, message)
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


# ---- chat templates -----------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ü"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "fib?"}]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA2 = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
          "<<SYS>>{{ message['content'] | trim }}<</SYS>>\n{% elif message['role'] == 'user' %}"
          "[INST] {{ message['content'] | trim }} [/INST]{% else %} {{ message['content'] | trim }} "
          "{{ eos_token }}{% endif %}{% endfor %}")
WITH_TOOLS = ("{% for m in messages %}{{ m | tojson }}\n{% if loop.last %}{% break %}{% endif %}{% endfor %}"
              "{% generation %}{{ strftime_now('%Y') | length }}{% endgeneration %}")


def test_the_plain_template_is_the_documented_format():
    assert PLAIN.render(MESSAGES) == "system: Be brief.\nuser: Hi ü\nassistant: Hello.\nuser: fib?\nassistant:"
    assert ChatTemplate.for_checkpoint(DEMO) is PLAIN                  # the demo checkpoint has none


@pytest.mark.parametrize("template", [CHATML, LLAMA2, WITH_TOOLS], ids=["chatml", "llama2", "tojson"])
def test_a_checkpoint_template_renders_as_transformers_renders_it(template, tmp_path):
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_file=f"{DEMO}/tokenizer.json", bos_token="<s>", eos_token="</s>")
    hf.chat_template = template
    want = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.for_checkpoint(tmp_path).render(MESSAGES) == want


def test_named_templates_a_jinja_file_and_one_bos(tmp_path):
    config = {"bos_token": "<s>", "add_bos_token": True,
              "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": LLAMA2}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    # the tokenizer adds <s> when the ensemble tokenizes the prompt: the template's is dropped
    assert ChatTemplate.for_checkpoint(tmp_path).render(MESSAGES[1:2]) == "[INST] Hi ü [/INST]"
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    assert ChatTemplate.for_checkpoint(tmp_path).render(MESSAGES[:1]).startswith("<|im_start|>system\n")


def test_a_template_that_refuses_the_messages_is_a_chat_template_error():
    t = ChatTemplate("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="no system role"):
        t.render(MESSAGES)


# ---- the routes, over ASGI, with a stand-in backend ---------------------------------------------
class FakeBackend:
    """Answers each request with ``script(arrays)``: a list of responses, or an error."""

    def __init__(self, script, inputs=DEFAULT_DECLARED, outputs=frozenset()):
        self.script, self.requests = script, []
        self.iface = ModelInterface(frozenset(inputs), frozenset(outputs))

    async def interface(self, model):
        return self.iface

    def declares_output(self, model, name):
        return name in self.iface.outputs

    async def ready(self):
        return True

    async def direct_route(self, model):
        return model, None

    async def generate(self, model, arrays, request_id="", outputs=None, cancel_model=None):
        self.requests.append(arrays)
        self.outputs = outputs
        for item in self.script(arrays):
            if isinstance(item, Exception):
                raise item
            await asyncio.sleep(0)
            yield item


def steps(*texts, reason="length", prompt_tokens=3):
    """Streamed responses: one per text, the last with ``reason``, then the empty final one."""
    out = [EnsembleResponse(t, reason if i == len(texts) - 1 else "", prompt_tokens, i + 1)
           for i, t in enumerate(texts)]
    return out + [EnsembleResponse(final=True)]


def call(app, path, body=None, method="POST", raw: bytes | None = None):
    """One request through the ASGI app: (status, parsed JSON or the SSE data lines);
    ``raw``: the body as sent, instead of ``body`` as JSON."""
    async def run():
        data = raw if raw is not None else json.dumps(body).encode() if body else b""
        messages = [{"type": "http.request", "body": data, "more_body": False}]
        sent = []

        async def receive():
            if messages:
                return messages.pop(0)
            await asyncio.sleep(3600)   # the client stays

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")], "scheme": "http",
                 "server": ("test", 80), "client": ("test", 1)}
        await app(scope, receive, send)
        return sent
    sent = asyncio.run(run())
    status = sent[0]["status"]
    raw = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    if raw.startswith("data: "):
        return status, [line[6:] for line in raw.split("\n\n") if line]
    return status, (json.loads(raw) if raw.startswith("{") else raw)


def app_with(backend):
    app = create_app("unused:1", ["tandem"], model_dir=DEMO)
    app.state.frontend.backend = backend
    return app


def test_completion_not_streamed_with_n_choices_and_usage():
    backend = FakeBackend(lambda a: steps("ab", "c") if a["seed"][0, 0] == 7 else steps("x", reason="stop"))
    status, body = call(app_with(backend), "/v1/completions",
                        dict(model="tandem", prompt="p", max_tokens=2, n=2, seed=7, echo=True))
    assert status == 200 and body["object"] == "text_completion"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == \
        [(0, "pabc", "length"), (1, "px", "stop")]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    # streamed from the ensemble all the same: a client that goes away can then be cancelled
    assert [r["stream"].tolist() for r in backend.requests] == [[[True]], [[True]]]


def test_completion_streamed_as_sse_ending_with_done():
    app = app_with(FakeBackend(lambda a: steps("de", "f(")))
    status, events = call(app, "/v1/completions", dict(model="tandem", prompt="p", stream=True,
                                                       stream_options={"include_usage": True}))
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["de", "f("]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


def test_chat_streamed_sends_the_role_then_content_then_finish_reason():
    backend = FakeBackend(lambda a: steps("Hi", "!", reason="stop"))
    status, events = call(app_with(backend), "/v1/chat/completions",
                          dict(model="tandem", messages=[{"role": "user", "content": "hello"}], stream=True,
                               max_tokens=4))
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks]
    assert deltas == [({"role": "assistant", "content": ""}, None), ({"content": "Hi"}, None),
                      ({"content": "!"}, None), ({}, "stop")]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert backend.requests[0]["text_input"].tolist() == [[b"user: hello\nassistant:"]]


def test_chat_without_max_tokens_may_fill_the_context():
    backend = FakeBackend(lambda a: steps("a"))
    call(app_with(backend), "/v1/chat/completions", dict(model="tandem", messages=[{"role": "user", "content": "x"}]))
    from tokenizers import Tokenizer
    n = len(Tokenizer.from_file(f"{DEMO}/tokenizer.json").encode("user: x\nassistant:").ids)
    context = json.load(open(f"{DEMO}/config.json"))["max_position_embeddings"]
    assert backend.requests[0]["max_tokens"].tolist() == [[context - n]]


def test_logprobs_carry_each_tokens_text_and_value():
    def script(a):
        return [EnsembleResponse("ab", "", 2, 2, output_ids=[5, 6], log_probs=[-0.5, -1.0]),
                EnsembleResponse("c", "length", 2, 3, log_probs=[-0.25]), EnsembleResponse(final=True)]
    backend = FakeBackend(script, inputs=DEFAULT_DECLARED | {"return_log_probs"}, outputs={"output_log_probs"})
    status, body = call(app_with(backend), "/v1/completions", dict(model="tandem", prompt="p", logprobs=0))
    lp = body["choices"][0]["logprobs"]
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(f"{DEMO}/tokenizer.json")
    assert lp["token_logprobs"] == [-0.5, -1.0, -0.25]
    assert lp["tokens"] == [tok.decode([5], skip_special_tokens=False), tok.decode([6], skip_special_tokens=False), "c"]
    assert lp["top_logprobs"][2] == {"c": -0.25} and lp["text_offset"][0] == 0
    assert "output_log_probs" in backend.outputs and "text_output" in backend.outputs
    status, body = call(app_with(FakeBackend(script)), "/v1/completions", dict(model="tandem", prompt="p", logprobs=0))
    assert status == 400 and "output_log_probs" in body["error"]["message"]


def test_echo_with_logprobs_puts_the_prompts_first_as_lm_eval_reads_them():
    """lm-evaluation-harness's request (token ids, echo, logprobs 1, max_tokens 1): the
    prompt's tokens lead, the first one's log probability null; each position's dict
    holds the token and the alternative, the greedy one's value the same float."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(f"{DEMO}/tokenizer.json")
    name = lambda i: tok.decode([i], skip_special_tokens=False)

    def script(a):
        assert a["num_prompt_log_probs"].tolist() == [[1]] and a["num_top_log_probs"].tolist() == [[1]]
        return [EnsembleResponse("x", "length", 3, 1, output_ids=[9], log_probs=[-0.5], top_ids=[[9]],
                                 top_log_probs=[[-0.5]], prompt_ids=[5, 6, 7], prompt_log_probs=[None, -2.0, -0.25],
                                 prompt_top_ids=[[], [8], [7]], prompt_top_log_probs=[[], [-1.0], [-0.25]]),
                EnsembleResponse(final=True)]
    backend = FakeBackend(script, inputs=ALL_LOGPROBS | {"input_ids"},
                          outputs={"output_log_probs", "prompt_log_probs"})
    backend.tokens_route = lambda model: _async("tandem_tokens")
    status, body = call(app_with(backend), "/v1/completions",
                        dict(model="tandem", prompt=[5, 6, 7], max_tokens=1, temperature=0, logprobs=1,
                             echo=True, seed=1234, prompt_logprobs=1))
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == [name(5), name(6), name(7), name(9)]
    assert lp["token_logprobs"] == [None, -2.0, -0.25, -0.5]
    assert lp["top_logprobs"] == [None, {name(6): -2.0, name(8): -1.0}, {name(7): -0.25}, {name(9): -0.5}]
    assert lp["text_offset"][:2] == [0, len(name(5))]
    # lm-eval's is_greedy over the continuation [7]: the token's value is the dict's largest
    assert lp["token_logprobs"][2] == max(lp["top_logprobs"][2].values())
    assert lp["token_logprobs"][1] != max(lp["top_logprobs"][1].values())
    assert body["choices"][0]["prompt_logprobs"] == [
        None, {"6": {"logprob": -2.0, "rank": None, "decoded_token": name(6)},
               "8": {"logprob": -1.0, "rank": 1, "decoded_token": name(8)}},
        {"7": {"logprob": -0.25, "rank": 1, "decoded_token": name(7)}}]
    assert set(backend.outputs) >= {"prompt_token_ids", "prompt_top_log_probs", "output_top_token_ids"}


async def _async(value):
    return value


def test_chat_top_logprobs_are_the_alternatives():
    def script(a):
        assert a["num_top_log_probs"].tolist() == [[2]]
        return [EnsembleResponse("a", "", 3, 1, log_probs=[-0.1], top_ids=[[5, 6]], top_log_probs=[[-0.1, -float("inf")]]),
                EnsembleResponse("", "stop", 3, 1), EnsembleResponse(final=True)]
    backend = FakeBackend(script, inputs=ALL_LOGPROBS, outputs={"output_log_probs"})
    status, body = call(app_with(backend), "/v1/chat/completions",
                        dict(model="tandem", messages=[{"role": "user", "content": "hi"}], logprobs=True,
                             top_logprobs=2))
    assert status == 200, body
    (entry,) = body["choices"][0]["logprobs"]["content"]
    assert entry["token"] == "a" and entry["logprob"] == -0.1
    assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.1, -9999.0]     # JSON has no -inf


@pytest.mark.parametrize("text", ["    return self.x", " def main():", "\n\n", "ab"])
def test_tokens_of_a_response_with_several_tokens_join_to_its_text(text):
    """With speculation one response carries several tokens and no ids: the text is cut
    where the tokenizer cuts it when that gives as many tokens."""
    from tokenizers import Tokenizer

    from tandem.client.openai.responses import tokens_of
    tok = Tokenizer.from_file(f"{DEMO}/tokenizer.json")
    enc = tok.encode(text, add_special_tokens=False)
    k = len(enc.ids)
    for n in (k, k + 1):
        pieces = tokens_of(EnsembleResponse(text, log_probs=[-1.0] * n), tok)
        assert len(pieces) == n and "".join(pieces) == text
    if k > 1:
        starts = [o[0] for o in enc.offsets[1:]]
        want = [text[a:b] for a, b in zip([0, *starts], [*starts, len(text)])]
        assert tokens_of(EnsembleResponse(text, log_probs=[-1.0] * k), tok) == want


@pytest.mark.parametrize("stream", [False, True])
def test_errors_are_openai_json_with_the_status(stream):
    refuse = FakeBackend(lambda a: [upstream_error("in ensemble 'tandem', max_tokens: got 600; allowed: <= 510")])
    status, body = call(app_with(refuse), "/v1/completions", dict(model="tandem", prompt="p", stream=stream))
    assert status == 400 and body["error"]["param"] == "max_tokens" and body["error"]["type"] == "invalid_request_error"
    full = FakeBackend(lambda a: [upstream_error("the decode KV pool is full; retry later")])
    assert call(app_with(full), "/v1/completions", dict(model="tandem", prompt="p", stream=stream))[0] == 503
    status, body = call(app_with(refuse), "/v1/completions", dict(model="gpt-4", prompt="p", stream=stream))
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = call(app_with(refuse), "/v1/completions", dict(model="tandem", prompt="p", temperature=9))
    assert status == 400 and body["error"]["param"] == "temperature"
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}


def test_text_that_is_not_unicode_and_a_body_that_is_not_json_are_400s():
    """JSON can spell a lone UTF-16 surrogate; no text is made of one (it used to be a
    500 where the prompt was encoded). A broken body names no field."""
    app = app_with(FakeBackend(lambda a: steps("a")))
    for path, body, param in [
            ("/v1/completions", dict(model="tandem", prompt="a\ud800b"), "prompt"),
            ("/v1/completions", dict(model="tandem", prompt="p", stop=["\udfff"]), "stop"),
            ("/v1/chat/completions", dict(model="tandem", messages=[{"role": "user", "content": "\ud83d"}]),
             "messages.0.content")]:
        status, out = call(app, path, body)
        assert status == 400 and out["error"]["param"] == param, out
        assert "lone UTF-16 surrogate" in out["error"]["message"] and "Value error" not in out["error"]["message"]
    status, out = call(app, "/v1/completions", raw=b'{"model": "tandem", "prompt": ')
    assert status == 400 and out["error"]["param"] is None and out["error"]["code"] == "invalid_json", out
    assert out["error"]["message"].startswith("the request body is not valid JSON")


def test_an_error_after_the_stream_started_is_an_error_event_then_done():
    backend = FakeBackend(lambda a: [EnsembleResponse("a", "", 1, 1), upstream_error("internal error: boom")])
    status, events = call(app_with(backend), "/v1/completions", dict(model="tandem", prompt="p", stream=True))
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "internal error: boom"


def test_models_health_metrics_and_unknown_paths():
    app = app_with(FakeBackend(lambda a: steps("a")))
    status, body = call(app, "/v1/models", method="GET")
    assert status == 200 and [m["id"] for m in body["data"]] == ["tandem"]
    assert call(app, "/v1/models/tandem", method="GET")[1]["id"] == "tandem"
    assert call(app, "/v1/models/other", method="GET")[0] == 404
    assert call(app, "/v1/nothing", method="GET")[1]["error"]["type"] == "not_found_error"
    assert call(app, "/health", method="GET")[0] == 200
    call(app, "/v1/completions", dict(model="tandem", prompt="p"))
    text = call(app, "/metrics", method="GET")[1]
    assert 'tandem_openai_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
    assert 'tandem_openai_errors_total{endpoint="/v1/models",status="404"} 1.0' in text
    # every path the API does not serve is one series, whatever a client invents
    for path in ("/v1/rand1", "/v1/rand2"):
        call(app, path)
    text = call(app, "/metrics", method="GET")[1]
    assert "/v1/rand" not in text and "/v1/nothing" not in text
    assert 'tandem_openai_errors_total{endpoint="other",status="404"} 3.0' in text   # /v1/nothing too
    assert "tandem_openai_request_seconds_bucket" in text


# ---- `tandem serve --openai-port`, the frontend's thread ------------------------------------------
def test_serve_starts_the_api_on_port_9000_unless_told_otherwise():
    from tandem.client import cli
    from tandem.client.openai.frontend import start_for, text_models
    from tandem.client.serve.options import ServeOptions
    assert cli.build_parser().parse_args(["serve"]).openai_port == 9000
    assert cli.build_parser().parse_args(["serve", "--openai-port", "0"]).openai_port == 0
    assert text_models(ServeOptions.of()) == ["tandem"]                        # not tandem_tokens
    assert text_models(ServeOptions.of(mode="both")) == ["tandem", "tandem_colocated"]
    assert text_models(ServeOptions.of(mode="prefill")) == []
    if "ensemble_name" in ServeOptions.__slots__:                           # --ensemble-name: one more id
        assert text_models(ServeOptions.of(ensemble_name="ensemble")) == ["tandem", "ensemble"]

    class Server:
        options, host, grpc_url = ServeOptions.of(mode="prefill"), "127.0.0.1", "127.0.0.1:1"
    assert start_for(Server(), 9000) is None                                 # nothing to front
    Server.options = ServeOptions.of()
    assert start_for(Server(), 0) is None                                    # turned off


def test_the_frontend_serves_in_a_thread_and_stops_and_refuses_a_taken_port():
    import socket
    import urllib.error
    import urllib.request

    from tandem.client.openai.frontend import FrontendError, OpenAIFrontend
    from tandem.client.serve.triton_server import free_port
    port = free_port()
    with OpenAIFrontend("127.0.0.1:1", ["tandem"], DEMO, port=port) as api:
        body = json.loads(urllib.request.urlopen(api.base_url + "/models", timeout=10).read())
        assert body["data"][0]["id"] == "tandem" and api.is_running()
        with pytest.raises(FrontendError, match="in use"):
            OpenAIFrontend("127.0.0.1:1", ["tandem"], port=port).start()
        # tritonserver unreachable: 503 with OpenAI's error JSON, not a hang
        req = urllib.request.Request(api.base_url + "/completions", data=b'{"model": "tandem", "prompt": "x"}',
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 503 and json.loads(e.value.read())["error"]["code"] == "unavailable"
    assert not api.is_running()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0                       # nothing listens any more


# ---- the ensemble's responses off the wire ---------------------------------------------------
def _wire_response(tensors: dict[str, np.ndarray], final: bool = False):
    """A gRPC ModelInferResponse as tritonserver sends it (raw_output_contents)."""
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

    r = service_pb2.ModelInferResponse(model_name="tandem", id="x")
    for name, arr in tensors.items():
        out = r.outputs.add()
        out.name, out.datatype = name, np_to_triton_dtype(arr.dtype)
        out.shape.extend(arr.shape)
        r.raw_output_contents.append(serialize_byte_tensor(arr).item() if arr.dtype == np.object_
                                     else arr.tobytes())
    if final:
        r.parameters["triton_final_response"].bool_param = True
    return r


@pytest.mark.parametrize("text_shape", [(1,), (1, 1)])
def test_a_response_is_read_off_its_raw_tensors(text_shape):
    from tritonclient.grpc import InferResult

    from tandem.client.openai.triton_backend import parse_result
    tensors = {"text_output": np.array(["é x".encode()], dtype=np.object_).reshape(text_shape),
               "finish_reason": np.array([[b"length"]], dtype=np.object_),
               "num_input_tokens": np.array([[7]], dtype=np.uint32),
               "num_output_tokens": np.array([[300]], dtype=np.uint32),
               "output_ids": np.array([[4, 70000]], dtype=np.int32),
               "output_log_probs": np.array([[[-0.5, -1.25]]], dtype=np.float32)}
    result = InferResult(_wire_response(tensors, final=True))
    assert result.as_numpy("text_output").reshape(-1)[0].decode() == "é x"   # what tritonclient reads
    assert parse_result(result) == EnsembleResponse(text="é x", finish_reason="length", num_input_tokens=7,
                                             num_output_tokens=300, final=True, output_ids=[4, 70000],
                                             log_probs=[-0.5, -1.25])
    empty = {"text_output": np.array([b""], dtype=np.object_), "finish_reason": np.array([[b""]], dtype=np.object_),
             "num_input_tokens": np.array([[1]], dtype=np.uint32), "num_output_tokens": np.array([[1]], dtype=np.uint32)}
    assert parse_result(InferResult(_wire_response(empty))) == EnsembleResponse(num_input_tokens=1,
                                                                                 num_output_tokens=1)


@pytest.mark.parametrize("fields,param", [(dict(min_p=0.2), "min_p"), (dict(skip_special_tokens=False),
                                                                         "skip_special_tokens"),
                                          (dict(logits_processors=["x"]), "logits_processors"),
                                          (dict(frobnicate=1), "frobnicate")])
def test_unknown_fields_are_refused_by_name_not_ignored(fields, param):
    for req in (CompletionRequest(model="m", prompt="x", **fields),
                ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)):
        with pytest.raises(OpenAIError) as e:
            req.unsupported()
        assert (e.value.status, e.value.param) == (400, param)


def test_fields_at_their_neutral_value_and_bookkeeping_fields_are_accepted():
    req = CompletionRequest(model="m", prompt="x", user="u", store=False, metadata={"a": "b"},
                            skip_special_tokens=True, min_p=0.0, stop_token_ids=[], include_stop_str_in_output=False)
    req.unsupported()


def test_ignore_eos_is_sent_when_the_ensemble_declares_it():
    req = CompletionRequest(model="m", prompt="p", ignore_eos=True)
    a = ensemble_inputs(req, "p", DEFAULT_DECLARED | {"ignore_eos"}, index=0, max_tokens=5)
    assert a["ignore_eos"].tolist() == [[True]]
    with pytest.raises(OpenAIError) as e:
        ensemble_inputs(req, "p", DEFAULT_DECLARED, index=0, max_tokens=5)
    assert e.value.param == "ignore_eos"
    assert "ignore_eos" not in ensemble_inputs(CompletionRequest(model="m", prompt="p", ignore_eos=False), "p",
                                               DEFAULT_DECLARED, index=0, max_tokens=5)
