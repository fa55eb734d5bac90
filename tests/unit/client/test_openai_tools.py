"""Tool calls on the OpenAI API (client/openai/tools.py, tool_parsers.py) without a server:
the tools and tool_choice checked (a 400 naming the field), the grammar that enforces
``required`` / a named function (compiled by xgrammar: what it accepts and refuses), the
hermes parser whole and streamed in any chunking, the model's text as OpenAI's
``tool_calls`` (streamed deltas merge to the whole answer), the messages a template gets,
and the chat route itself over a stand-in ensemble. Through `tandem serve` and the
`openai` package: tests/e2e/test_openai_tools.py."""
from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.client.openai.app import create_app
from tandem.client.openai.chat_template import PLAIN, ChatTemplate
from tandem.client.openai.ensemble_request import DEFAULT_DECLARED, GUIDE_INPUTS, ensemble_inputs, upstream_error
from tandem.client.openai.protocol import ChatCompletionRequest, ChatMessage, OpenAIError
from tandem.client.openai.responses import Event
from tandem.client.openai.tool_parsers import Call, HermesParser, tool_parser
from tandem.client.openai.tools import (ToolPlan, guide_errors_on_tools, merge_deltas, plan_tools, scan_calls,
                                        template_messages)
from tandem.client.openai.triton_backend import EnsembleResponse, ModelInterface

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}


def tool(name: str, parameters: dict | None = None) -> dict:
    fn = {"name": name, "description": f"the {name} function"}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


TOOLS = [tool("get_weather", WEATHER), tool("add", ADD), tool("now")]


def chunkings(text: str):
    """``text`` cut at the points hypothesis picks."""
    return st.lists(st.integers(0, len(text)), max_size=12).map(
        lambda cuts: [text[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(text)])])


def streamed(plan: ToolPlan, pieces: list[str], parser: str | None = None) -> list[dict]:
    reader = plan.stream(parser)
    return [d for p in pieces for d in reader.feed(p)] + reader.finish()


# ---- tools and tool_choice ---------------------------------------------------------------------
@pytest.mark.parametrize("choice,mode,name", [(None, "auto", None), ("none", "none", None), ("auto", "auto", None),
                                              ("required", "required", None),
                                              ({"type": "function", "function": {"name": "add"}}, "named", "add")])
def test_tool_choice_modes(choice, mode, name):
    plan = plan_tools(TOOLS, choice, None)
    assert (plan.mode, plan.name, plan.parallel, plan.template_tools) == (mode, name, True, TOOLS)


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "retrieval", "function": {"name": "f"}}], None, "tools[0].type"),
    ([{"type": "function"}], None, "tools[0].function"),
    ([{"type": "function", "function": {"description": "no name"}}], None, "tools[0].function.name"),
    ([tool("bad name!")], None, "tools[0].function.name"),
    ([tool("f"), tool("f")], None, "tools[1].function.name"),
    ([tool("f", {"type": "string"})], None, "tools[0].function.parameters"),
    ([tool("f", ["not", "a", "schema"])], None, "tools[0].function.parameters"),
    (None, "required", "tool_choice"),
    ([], {"type": "function", "function": {"name": "f"}}, "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (TOOLS, {"type": "code_interpreter"}, "tool_choice"),
])
def test_malformed_tools_and_tool_choice_are_a_400_naming_the_field(tools, choice, param):
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools,
                                tool_choice=choice)
    with pytest.raises(OpenAIError) as e:
        req.unsupported()
    assert (e.value.status, e.value.param) == (400, param)
    assert e.value.message.startswith(param)


def test_auto_needs_a_parser_and_the_error_says_how_to_start_the_server():
    with pytest.raises(OpenAIError) as e:
        plan_tools(TOOLS, None, None).check_parser(None)
    assert e.value.param == "tool_choice" and "--tool-call-parser" in e.value.message
    plan_tools(TOOLS, "auto", None).check_parser("hermes")
    for choice in ("none", "required"):
        plan_tools(TOOLS, choice, None).check_parser(None)
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("mistral")


def test_the_deprecated_functions_are_refused_not_ignored():
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], functions=[{"name": "f"}])
    with pytest.raises(OpenAIError) as e:
        req.unsupported()
    assert e.value.param == "functions"


# ---- the grammar --------------------------------------------------------------------------------
def required_schema(parallel: bool = True) -> dict:
    return json.loads(plan_tools(TOOLS, "required", parallel).guide())


def test_required_is_an_array_of_one_alternative_per_tool_as_vllm_builds_it():
    schema = required_schema()
    assert (schema["type"], schema["minItems"], "maxItems" in schema) == ("array", 1, False)
    alternatives = schema["items"]["anyOf"]
    assert [a["properties"]["name"]["enum"] for a in alternatives] == [["get_weather"], ["add"], ["now"]]
    assert [a["properties"]["parameters"] for a in alternatives] == [WEATHER, ADD, {"type": "object", "properties": {}}]
    assert all(a["required"] == ["name", "parameters"] for a in alternatives)
    assert required_schema(parallel=False)["maxItems"] == 1


def test_named_is_the_functions_parameters():
    assert json.loads(plan_tools(TOOLS, {"type": "function", "function": {"name": "add"}}, None).guide()) == ADD
    assert plan_tools(TOOLS, "auto", None).guide() is None and plan_tools(TOOLS, "none", None).guide() is None


def test_defs_of_each_tool_move_to_the_root_where_their_refs_point():
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    with_ref = {"type": "object", "properties": {"p": {"$ref": "#/$defs/point"}}, "$defs": {"point": point}}
    schema = json.loads(plan_tools([tool("f", with_ref), tool("g", with_ref)], "required", None).guide())
    assert schema["$defs"] == {"point": point}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    clash = {**with_ref, "$defs": {"point": {"type": "string"}}}
    with pytest.raises(OpenAIError) as e:
        plan_tools([tool("f", with_ref), tool("g", clash)], "required", None).guide()
    assert e.value.param == "tools[1].function.parameters"


def test_the_guide_goes_to_the_ensemble_as_json_schema_and_not_beside_another():
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                tool_choice="required")
    arrays = ensemble_inputs(req, "x", DEFAULT_DECLARED | set(GUIDE_INPUTS), index=0, max_tokens=8)
    assert arrays["guided_decoding_guide_type"].tolist() == [[b"json_schema"]]
    assert json.loads(arrays["guided_decoding_guide"][0, 0]) == required_schema()
    with pytest.raises(OpenAIError) as e:
        ensemble_inputs(req, "x", DEFAULT_DECLARED, index=0, max_tokens=8)
    assert e.value.param == "tools"
    for extra in (dict(response_format={"type": "json_object"}), dict(guided_regex="[a-z]+")):
        both = ChatCompletionRequest(**req.model_dump(exclude_none=True), **extra)
        with pytest.raises(OpenAIError) as e:
            both.unsupported()
        assert e.value.param == next(iter(extra))
    auto = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                 response_format={"type": "json_object"})
    assert auto.guide()[2] == "response_format"      # auto is not guided: response_format stands


def test_the_ensembles_refusal_of_a_tool_schema_names_tools():
    refusal = upstream_error("in ensemble 'tandem', guided_decoding_guide: the json_schema guide does not compile: "
                             'Unsupported type "nonsense"')

    async def events():
        yield Event(0, error=refusal)

    got = asyncio.run(_first(guide_errors_on_tools(events())))
    assert (got.error.status, got.error.param) == (400, "tools") and "nonsense" in got.error.message


async def _first(events):
    async for ev in events:
        return ev


@pytest.fixture(scope="module")
def grammar():
    """xgrammar's verdict on a text under a json_schema guide, with the demo tokenizer."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string
    return lambda schema, text: _is_grammar_accept_string(
        xgr.Grammar.from_json_schema(schema, any_whitespace=False), text)


@pytest.mark.parametrize("parallel,text,ok", [
    (True, '[{"name": "add", "parameters": {"a": 1, "b": 2}}]', True),
    (True, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]', True),
    (False, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]', False),
    (True, '[]', False),
    (True, '[{"name": "mul", "parameters": {"a": 1, "b": 2}}]', False),
    (True, '[{"name": "add", "parameters": {"a": 1}}]', False),
    (True, '[{"name": "add", "parameters": {"city": "Oslo"}}]', False),
    (True, '[{"name": "now", "parameters": {"x": 1}}]', False),
])
def test_xgrammar_accepts_exactly_the_calls_that_validate(grammar, parallel, text, ok):
    schema = plan_tools(TOOLS, "required", parallel).guide()
    assert grammar(schema, text) is ok
    if ok:
        for call in json.loads(text):
            tool_ = next(t for t in TOOLS if t["function"]["name"] == call["name"])
            jsonschema.validate(call["parameters"], tool_["function"].get("parameters", {}))


# ---- hermes ----------------------------------------------------------------------------------------
HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo <{\\"}>"}}\n'
          '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\nDone <tool')


def hermes(pieces: list[str]) -> list[str | Call]:
    p = HermesParser()
    out = [item for piece in pieces for item in p.feed(piece)] + p.finish()
    merged: list[str | Call] = []     # adjacent content joined: the chunking may split it anywhere
    for item in out:
        if isinstance(item, str) and merged and isinstance(merged[-1], str):
            merged[-1] += item
        else:
            merged.append(item)
    return merged


def test_hermes_reads_the_calls_and_keeps_the_text_around_them():
    assert hermes([HERMES]) == ["Let me check.\n", Call("get_weather", '{"city": "Oslo <{\\"}>"}'), "\n",
                                Call("add", '{"a": 1, "b": 2}'), "\nDone <tool"]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_hermes_streamed_in_any_chunking_gives_the_whole_answer(data):
    assert hermes(data.draw(chunkings(HERMES))) == hermes([HERMES])


def test_hermes_holds_back_only_what_may_start_a_tag():
    p = HermesParser()
    assert p.feed("a <tool") == ["a "] and p.feed("bar") == ["<toolbar"] and p.feed("<") == []
    assert p.finish() == ["<"]


@pytest.mark.parametrize("block", ['{"name": "f", "arguments": {"x": 1}', 'not json', '{"arguments": {}}',
                                   '{"name": "f", "arguments": [1]}', '["f"]'])
def test_a_malformed_block_stays_content_as_written(block):
    text = f"a<tool_call>{block}</tool_call>b"
    assert hermes([text]) == [text]
    assert hermes(["x<tool_call>" + block]) == ["x<tool_call>" + block]     # unclosed at the end


def test_a_call_whose_closing_tag_never_came_is_still_a_call():
    assert hermes(['<tool_call>{"name": "now"}']) == [Call("now", "{}")]


# ---- the answer: whole and streamed ---------------------------------------------------------------
REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "a,}]\\"{[", "unit": "c"}}, '
            '{"name": "add", "parameters": {"a": -12, "b": 7}}, {"name": "now", "parameters": {}}]')


def test_required_whole_answer():
    message, reason = plan_tools(TOOLS, "required", None).answer(REQUIRED, "stop")
    assert reason == "tool_calls" and message["content"] is None and message["role"] == "assistant"
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add", "now"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": 'a,}]"{[', "unit": "c"}, {"a": -12, "b": 7}, {}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 3


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_required_streamed_in_any_chunking_merges_to_the_whole_answer(data):
    plan = plan_tools(TOOLS, "required", None)
    deltas = streamed(plan, data.draw(chunkings(REQUIRED)))
    whole, _ = plan.answer(REQUIRED, "stop")
    assert _without_ids(merge_deltas(deltas)) == _without_ids(whole)
    for d in deltas:     # each call's first entry names it; later ones carry arguments only
        for e in d["tool_calls"]:
            assert set(e) in ({"index", "id", "type", "function"}, {"index", "function"})


def test_required_arguments_stream_as_they_arrive():
    plan = plan_tools(TOOLS, "required", None)
    pieces = [REQUIRED[i:i + 3] for i in range(0, len(REQUIRED), 3)]
    entries = [e for d in streamed(plan, pieces) for e in d["tool_calls"]]
    first = [e for e in entries if "id" in e]
    assert [e["index"] for e in first] == [0, 1, 2] and first[0]["function"]["name"] == "get_weather"
    assert sum(1 for e in entries if e["index"] == 0) > 5      # many argument deltas, not one at the end


def test_parallel_tool_calls_false_keeps_one_call():
    plan = plan_tools(TOOLS, "required", False)
    assert len(plan.answer(REQUIRED, "stop")[0]["tool_calls"]) == 1
    auto = plan_tools(TOOLS, "auto", False)
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": "add"}</tool_call>'
    assert [c["function"]["name"] for c in auto.answer(text, "stop", "hermes")[0]["tool_calls"]] == ["now"]


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_named_streams_its_arguments_and_keeps_stop(data):
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "add"}}, None)
    args = '{"a": 1, "b": 22}'
    deltas = streamed(plan, [p for p in data.draw(chunkings(args)) if p])
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "add" and "id" in deltas[0]["tool_calls"][0]
    message, reason = plan.answer(args, "stop")
    assert _without_ids(merge_deltas(deltas)) == _without_ids(message)
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": args}
    assert message["content"] is None and reason == "stop"     # vLLM: "stop" for a named function


@pytest.mark.parametrize("text,reason,want_reason,want_content,want_calls", [
    ("Hello there", "stop", "stop", "Hello there", None),
    ('\n<tool_call>{"name": "now", "arguments": {}}</tool_call>\n', "stop", "tool_calls", None, ["now"]),
    ('Sure: <tool_call>{"name": "now", "arguments": {}}</tool_call>', "stop", "tool_calls", "Sure: ", ["now"]),
    ('<tool_call>{"name": "now", "arguments": {}}</tool_call> and', "length", "length", " and", ["now"]),
    ("  \n", "stop", "stop", "  \n", None),
])
def test_auto_answers(text, reason, want_reason, want_content, want_calls):
    plan = plan_tools(TOOLS, "auto", None)
    message, got_reason = plan.answer(text, reason, "hermes")
    assert (got_reason, message["content"]) == (want_reason, want_content)
    assert ([c["function"]["name"] for c in message.get("tool_calls", [])] or None) == want_calls
    chunks = [text[i:i + 2] for i in range(0, len(text), 2)]
    assert _without_ids(merge_deltas(streamed(plan, chunks, "hermes"))) == _without_ids(message)


def test_none_and_no_tools_are_plain_text():
    for plan in (plan_tools(TOOLS, "none", None), plan_tools(None, None, None)):
        text = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
        assert plan.answer(text, "stop", "hermes") == ({"role": "assistant", "content": text}, "stop")
        assert streamed(plan, ["a", "b"], "hermes") == [{"content": "a"}, {"content": "b"}]


def test_a_cut_required_answer_keeps_length():
    plan = plan_tools(TOOLS, "required", None)
    message, reason = plan.answer(REQUIRED[:60], "length")
    cut = message["tool_calls"][0]["function"]["arguments"]
    assert reason == "length" and len(message["tool_calls"]) == 1 and cut.startswith('{"city": "a,}]\\"{[')
    assert plan.answer(REQUIRED, "stop")[0]["tool_calls"][0]["function"]["arguments"].startswith(cut)


@pytest.mark.parametrize("text,names,args", [
    ('[{"name": "f", "parameters": 12}, {"parameters": true, "name": "g"}]', ["f", "g"], ["12", "true"]),
    ('[{"name": "f\\"x", "parameters": "s,}"}]', ['f"x'], ['"s,}"']),
    ('[{"name": "f", "parameters": {"a": [1, {"b": "]"}]}}]', ["f"], ['{"a": [1, {"b": "]"}]}']),
])
def test_scan_calls(text, names, args):
    found = scan_calls(text)
    assert [c.name for c in found] == names and [c.arguments(text) for c in found] == args
    cut = text[:text.index("12") + 1] if "12" in text else text[:-3]
    assert all(not c.arguments(cut) or c.arguments(cut) in c.arguments(text) for c in scan_calls(cut))


def _without_ids(message: dict) -> dict:
    return {**message, "tool_calls": [{**c, "id": None} for c in message.get("tool_calls", [])]}


# ---- messages through the template -----------------------------------------------------------------
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
ROUND_TRIP = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "3"}]


def test_tool_messages_reach_the_template_as_transformers_passes_them():
    msgs = template_messages([ChatMessage(**m) for m in ROUND_TRIP])
    assert msgs[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
    assert msgs[2] == {"role": "tool", "content": "3", "tool_call_id": "call_1"}
    empty = {**CALL, "function": {"name": "now", "arguments": ""}}
    assert template_messages([ChatMessage(role="assistant", tool_calls=[empty])])[0]["tool_calls"][0][
        "function"]["arguments"] == {}


@pytest.mark.parametrize("call", [{**CALL, "function": {"name": "add", "arguments": "{not json"}},
                                  {**CALL, "type": "retrieval"}, {"id": "x"}])
def test_a_malformed_tool_call_in_the_messages_is_a_400(call):
    with pytest.raises(OpenAIError) as e:
        template_messages([ChatMessage(role="assistant", tool_calls=[call])])
    assert e.value.param == "messages" and "messages[0].tool_calls[0]" in e.value.message


def test_the_plain_template_writes_tools_calls_and_results():
    prompt = PLAIN.render(template_messages([ChatMessage(**m) for m in ROUND_TRIP]), tools=[tool("now")])
    assert prompt == ('tools: now()\n'
                      'user: 1+2?\nassistant: <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
                      'tool: 3\nassistant:')
    assert PLAIN.render([{"role": "user", "content": "hi"}], tools=None) == "user: hi\nassistant:"


def test_a_template_that_takes_tools_gets_them():
    template = ChatTemplate(   # the shape of Qwen2.5's: tools in the system turn, calls as hermes blocks
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}("
        "{{ t.function.parameters.required | join(',') }}){% endfor %}</tools>{% endif %}{% for m in messages %}[{{ m.role }}]{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
        "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}")
    prompt = template.render(template_messages([ChatMessage(**m) for m in ROUND_TRIP]), tools=TOOLS[:2])
    assert prompt == ('<tools>get_weather(city)add(a,b)</tools>[user]1+2?[assistant]<tool_call>{"name": "add", '
                      '"arguments": {"a": 1, "b": 2}}</tool_call>[tool]3#call_1')


# ---- the chat route over a stand-in ensemble -------------------------------------------------------
class FakeBackend:
    """Answers every request with ``text`` in pieces of 3 characters; records the inputs."""

    def __init__(self, text: str, error: OpenAIError | None = None):
        self.text, self.error, self.sent = text, error, []

    async def interface(self, model):
        return ModelInterface(frozenset(DEFAULT_DECLARED | set(GUIDE_INPUTS)), frozenset())

    async def direct_route(self, model):
        return model, None

    def declares_output(self, model, name):
        return False

    async def generate(self, model, arrays, request_id="", outputs=(), cancel_model=None):
        self.sent.append(arrays)
        if self.error is not None:
            raise self.error
        pieces = [self.text[i:i + 3] for i in range(0, len(self.text), 3)]
        for k, piece in enumerate(pieces):
            yield EnsembleResponse(piece, "stop" if k == len(pieces) - 1 else "", 5, k + 1)


def post(app, body: dict) -> tuple[int, bytes]:
    sent, payload = [], [json.dumps(body).encode()]

    async def receive():     # the body, then a client that stays connected
        if payload:
            return {"type": "http.request", "body": payload.pop(), "more_body": False}
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "server": ("127.0.0.1", 9000), "client": ("127.0.0.1", 5000),
             "headers": [(b"content-type", b"application/json")]}
    asyncio.run(app(scope, receive, send))
    status = next(m for m in sent if m["type"] == "http.response.start")["status"]
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def chat_app(text: str, parser: str | None = None, error=None):
    app = create_app("127.0.0.1:1", ["tandem"], tool_call_parser=parser)
    app.state.frontend.backend = FakeBackend(text, error)
    return app


BODY = {"model": "tandem", "messages": ROUND_TRIP, "tools": TOOLS, "max_tokens": 64}


def test_the_route_answers_required_whole_and_streamed_in_openais_shapes():
    app = chat_app(REQUIRED)
    status, raw = post(app, {**BODY, "tool_choice": "required"})
    answer = json.loads(raw)["choices"][0]
    assert status == 200 and answer["finish_reason"] == "tool_calls" and answer["message"]["content"] is None
    assert [c["function"]["name"] for c in answer["message"]["tool_calls"]] == ["get_weather", "add", "now"]
    sent = app.state.frontend.backend.sent[0]
    assert json.loads(sent["guided_decoding_guide"][0, 0]) == required_schema()
    prompt = sent["text_input"][0, 0].decode()
    assert "tools: get_weather(city, unit), add(a, b), now()\n" in prompt and "\ntool: 3\n" in prompt
    status, raw = post(app, {**BODY, "tool_choice": "required", "stream": True})
    events = [json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert _without_ids(merge_deltas(deltas[1:-1])) == _without_ids(answer["message"])
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls" and raw.endswith(b"data: [DONE]\n\n")


def test_the_route_refuses_auto_without_a_parser_and_answers_with_one():
    status, raw = post(chat_app("x"), BODY)
    assert status == 400 and json.loads(raw)["error"]["param"] == "tool_choice"
    text = 'Ok <tool_call>{"name": "now", "arguments": {}}</tool_call>'
    status, raw = post(chat_app(text, parser="hermes"), BODY)
    answer = json.loads(raw)["choices"][0]
    assert status == 200 and answer["finish_reason"] == "tool_calls" and answer["message"]["content"] == "Ok "
    assert answer["message"]["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}


def test_the_route_names_tools_when_the_ensemble_refuses_their_schema():
    refusal = upstream_error("in ensemble 'tandem', guided_decoding_guide: the json_schema guide does not compile: "
                             "Unsupported type")
    for stream in (False, True):
        status, raw = post(chat_app("x", error=refusal), {**BODY, "tool_choice": "required", "stream": stream})
        assert status == 400 and json.loads(raw)["error"]["param"] == "tools"
