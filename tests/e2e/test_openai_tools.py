"""Tool calls through `tandem serve` (the CLI, the trained demo checkpoint, ``--tool-call-parser
hermes``), driven by the official ``openai`` package unchanged: ``tool_choice`` "required"
and a named function, whole and streamed, sampled at temperature 1, every call's arguments
parsed and validated against its tool's schema (the grammar guarantees it); a tool-result
round trip; ``pydantic_function_tool`` with ``chat.completions.parse``; a schema xgrammar
cannot compile refused naming ``tools``. The pieces without a server:
tests/unit/client/test_openai_tools.py."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest

from tandem.client.serve.triton_server import free_ports

from .servers import serve_command

pytestmark = pytest.mark.e2e
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
DEMO = Path(__file__).resolve().parents[2] / "checkpoints" / "demo" / "target"
MODEL = "tandem"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo, and what is 2 + 3?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    run = tmp_path_factory.mktemp("serve-tools")
    http, grpc, metrics, api = free_ports(4)
    with serve_command(
            "--model", str(DEMO), "--threads", "1", "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "8",
            "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
            "--openai-port", str(api), "--tool-call-parser", "hermes", "--run-dir", str(run / "run"),
            "--log-file", str(run / "server.log"), "--ready-timeout", "300", ready_timeout_s=360) as cmd:
        assert any("tool calls parsed as hermes" in line for line in cmd.output), "".join(cmd.output)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{api}/v1", api_key="unused", max_retries=0, timeout=120)


def valid_calls(calls) -> list[str]:
    """The calls' names, each one's arguments checked against its tool's schema."""
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [c.function.name for c in calls]


def streamed_calls(stream) -> tuple[list, str, int]:
    """The tool calls of a stream as the openai package's users put them together, the
    finish reason, and how many argument deltas came."""
    calls: dict[int, dict] = {}
    reason, deltas = None, 0
    for chunk in stream:
        choice = chunk.choices[0]
        reason = choice.finish_reason or reason
        for d in choice.delta.tool_calls or []:
            if d.id:      # the first entry of a call names it
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = {"id": d.id, "type": "function", "name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
            deltas += bool(d.function.arguments)
    return ([openai.types.chat.ChatCompletionMessageToolCall.model_validate(
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}})
        for _, c in sorted(calls.items())], reason, deltas)


def test_required_calls_validate_whole_and_streamed(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=3, n=2, max_tokens=200)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        valid_calls(choice.message.tool_calls)
    calls, reason, deltas = streamed_calls(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=4, max_tokens=200,
        parallel_tool_calls=False, stream=True))
    assert reason == "tool_calls" and len(valid_calls(calls)) == 1 and deltas > 1


def test_a_named_function_is_called_with_valid_arguments(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                       temperature=1.0, seed=5, max_tokens=100)
    assert r.choices[0].finish_reason == "stop"           # vLLM's (and OpenAI's) for a named function
    assert valid_calls(r.choices[0].message.tool_calls) == ["get_weather"]
    calls, reason, deltas = streamed_calls(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=6, max_tokens=100,
        stream=True))
    assert reason == "stop" and valid_calls(calls) == ["get_weather"] and deltas > 1


def test_a_tool_result_goes_back_through_the_template(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=200, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    after = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=8)
    assert after.choices[0].message.tool_calls is None and after.choices[0].message.content
    # the tool's answer is in the prompt: more prompt tokens than the conversation without it
    without = client.chat.completions.create(model=MODEL, messages=history[:-1], tools=TOOLS, tool_choice="none",
                                             temperature=0, max_tokens=1)
    assert after.usage.prompt_tokens > without.usage.prompt_tokens > first.usage.prompt_tokens


def test_pydantic_function_tool_parses(client):
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        city: str = Field(max_length=10)
        unit: Literal["c", "f"]

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
              temperature=1.0, seed=7, max_tokens=100)
    parsed = r.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, GetWeather) and len(parsed.city) <= 10


def test_auto_is_answered_and_a_schema_that_does_not_compile_names_tools(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=bad, tool_choice="required", max_tokens=8)
    assert e.value.body["param"] == "tools" and "nonsense" in e.value.body["message"]
