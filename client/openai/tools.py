"""Tool calls on ``/v1/chat/completions``: the request's ``tools`` and ``tool_choice``
checked, the grammar that enforces ``required`` and a named function, and the model's
output shaped as OpenAI's ``tool_calls`` (whole, or as stream deltas).

=================  ===================================================================
``tool_choice``    what happens
=================  ===================================================================
``"none"``         the tools go to the chat template; the output is text
``"auto"``         (the default with tools) the tools go to the template and the output is
                   read by the server's ``--tool-call-parser`` (:mod:`.tool_parsers`);
                   without one it is a 400, as vLLM refuses it
``"required"``     the output is a JSON array (``minItems`` 1; ``maxItems`` 1 with
                   ``parallel_tool_calls: false``) of ``{"name", "parameters"}`` objects,
                   one alternative per tool (its name an enum of one, its ``parameters`` its
                   schema), enforced by the ensemble's json_schema guide (xgrammar)
named function     the output is that function's arguments: its ``parameters`` schema
=================  ===================================================================

As vLLM answers: ``finish_reason`` is ``"tool_calls"`` where ``required`` or ``auto``
called a tool and the model stopped by itself, ``"stop"`` for a named function.

>>> plan = plan_tools([{"type": "function", "function": {"name": "add", "parameters": {
...     "type": "object", "properties": {"a": {"type": "integer"}}}}}], "required", False)
>>> json.loads(plan.guide())["maxItems"]
1
>>> merge_deltas(plan.stream().feed('[{"name": "add", "parameters": {"a": 1}}]'))["tool_calls"][0]["function"]
{'name': 'add', 'arguments': '{"a": 1}'}
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from .protocol import OpenAIError, invalid
from .tool_parsers import Call, ToolParser, tool_parser

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")      # OpenAI's rule for a function's name
MODES = ("none", "auto", "required")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- the request ----------------------------------------------------------------------------
def check_tools(tools: list[dict]) -> list[dict]:
    """``tools`` as OpenAI defines them, or a 400 naming the field at fault
    (``tools[1].function.name``). Returns them as given."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type", "function") != "function":
            raise invalid(f"{where}.type", f"got {tool.get('type')!r}; allowed: 'function'")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise invalid(f"{where}.function", "missing; send {'name': ..., 'parameters': {...}}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise invalid(f"{where}.function.name", f"got {name!r}; allowed: 1 to 64 letters, digits, _ or -")
        if name in seen:
            raise invalid(f"{where}.function.name", f"{name!r} is named twice; tool names must differ")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not (isinstance(params, dict) and params.get("type", "object") == "object"):
            raise invalid(f"{where}.function.parameters", "allowed: a JSON Schema of type 'object' (or none)")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise invalid(f"{where}.function.description", "allowed: a string")
    return tools


def parameters_of(tool: dict) -> dict:
    return tool["function"].get("parameters") or EMPTY_PARAMETERS


@dataclass(slots=True, frozen=True)
class ToolPlan:
    """What a chat request asks of tools: ``mode`` one of none, auto, required, named
    (``name`` the function), the tools, and whether several calls may come."""

    mode: str = "none"
    tools: tuple[dict, ...] = ()
    name: str | None = None
    parallel: bool = True

    @property
    def template_tools(self) -> list[dict] | None:
        """What the chat template gets as ``tools`` (transformers' ``apply_chat_template(tools=)``)."""
        return list(self.tools) or None

    @property
    def guided(self) -> bool:
        return self.mode in ("required", "named")

    def guide(self) -> str | None:
        """The json_schema guide that enforces ``required`` / a named function (vLLM's), or None."""
        if self.mode == "named":
            return json.dumps(parameters_of(next(t for t in self.tools if t["function"]["name"] == self.name)))
        if self.mode != "required":
            return None
        defs: dict[str, Any] = {}
        alternatives = []
        for i, tool in enumerate(self.tools):
            params = dict(parameters_of(tool))
            # a tool's "$ref": "#/$defs/X" points at the root: its $defs go there
            for key, value in (params.pop("$defs", None) or {}).items():
                if defs.setdefault(key, value) != value:
                    raise invalid(f"tools[{i}].function.parameters", f"$defs {key!r} differs from another "
                                                                    "tool's of that name; rename one")
            alternatives.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                                "parameters": params},
                                 "required": ["name", "parameters"]})
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": {"type": "object", "anyOf": alternatives}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return json.dumps(schema)

    def check_parser(self, parser_name: str | None) -> None:
        if self.mode == "auto" and parser_name is None:
            raise invalid("tool_choice", "'auto' (the default with tools) needs a tool-call parser: start the "
                                         "server with --tool-call-parser (e.g. hermes); or send tool_choice "
                                         "'required', a named function or 'none'")

    def stream(self, parser_name: str | None = None) -> "ToolStream":
        """A choice's reader of the model's text (one per choice: it keeps state)."""
        parser = tool_parser(parser_name) if self.mode == "auto" else None
        return ToolStream(self, parser)

    def answer(self, text: str, reason: str, parser_name: str | None = None) -> tuple[dict, str]:
        """A whole choice's ``message`` and ``finish_reason``: its streamed deltas merged."""
        reader = self.stream(parser_name)
        return merge_deltas(reader.feed(text) + reader.finish()), reader.finish_reason(reason)


def plan_tools(tools: list[dict] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan:
    """The :class:`ToolPlan` of a request's fields; a 400 naming the field for a bad one.

    >>> plan_tools(None, None, None).mode
    'none'
    >>> plan_tools([{"type": "function", "function": {"name": "f"}}],
    ...            {"type": "function", "function": {"name": "f"}}, None).name
    'f'
    """
    parallel = parallel_tool_calls is not False
    if not tools:
        if tool_choice is not None:
            raise invalid("tool_choice", "only allowed with tools; send tools, or no tool_choice")
        return ToolPlan(parallel=parallel)
    tools = tuple(check_tools(tools))
    names = [t["function"]["name"] for t in tools]
    if tool_choice is None:
        return ToolPlan("auto", tools, parallel=parallel)
    if isinstance(tool_choice, str):
        if tool_choice not in MODES:
            raise invalid("tool_choice", f"got {tool_choice!r}; allowed: 'none', 'auto', 'required' or "
                                         "{'type': 'function', 'function': {'name': ...}}")
        return ToolPlan(tool_choice, tools, parallel=parallel)
    if not isinstance(tool_choice, dict) or tool_choice.get("type", "function") != "function":
        raise invalid("tool_choice", "allowed: 'none', 'auto', 'required' or {'type': 'function', "
                                     "'function': {'name': ...}}")
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise invalid("tool_choice", "a named function needs {'type': 'function', 'function': {'name': ...}}")
    if name not in names:
        raise invalid("tool_choice", f"names the function {name!r}, which is not in tools ({', '.join(names)})")
    return ToolPlan("named", tools, name, parallel)


def template_messages(messages) -> list[dict]:
    """The chat messages as the template gets them (transformers' message dicts): an
    assistant's ``tool_calls`` with their ``arguments`` parsed into a dict (as vLLM
    hands them to templates), a tool message's ``tool_call_id``."""
    out = []
    for i, m in enumerate(messages):
        msg = {"role": m.role, "content": m.text()}
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(call, f"messages[{i}].tool_calls[{j}]")
                                 for j, call in enumerate(m.tool_calls)]
        out.append(msg)
    return out


def _template_call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or call.get("type", "function") != "function" or not isinstance(fn.get("name"), str):
        raise invalid("messages", f"{where}: allowed: {{'id': ..., 'type': 'function', 'function': "
                                  "{'name': ..., 'arguments': '<JSON>'}}")
    args = fn.get("arguments")
    if isinstance(args, str) and args:
        try:
            args = json.loads(args)
        except ValueError as e:
            raise invalid("messages", f"{where}.function.arguments: not JSON ({e})") from None
    return {**call, "type": "function", "function": {**fn, "arguments": args if args else {}}}


def _errors_on_tools(exc: BaseException) -> BaseException:
    if isinstance(exc, OpenAIError) and exc.status == 400 and exc.param == "response_format":
        return OpenAIError(400, f"tools: a tool's parameters schema does not compile: {exc.message}",
                           param="tools", code=exc.code)
    return exc


async def guide_errors_on_tools(events: AsyncIterator) -> AsyncIterator:
    """``events`` (:func:`~.responses.merged`'s) with the ensemble's refusal of the guide
    named as the field that made it, ``tools`` (the ensemble calls it ``response_format``)."""
    try:
        async for ev in events:
            if ev.error is not None:
                ev.error = _errors_on_tools(ev.error)
            yield ev
    finally:
        await events.aclose()


# ---- the response -----------------------------------------------------------------------------
@dataclass(slots=True)
class _Sent:
    id: str
    name: str
    arguments: int = 0     # characters of arguments sent


@dataclass(slots=True)
class ToolStream:
    """One choice's text as OpenAI's chat deltas: ``{"content": ...}`` and
    ``{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}`` (the
    first entry of a call carries its id, type and name; later ones more of its
    ``arguments`` string). :meth:`feed` takes the text as it arrives, :meth:`finish`
    the end; a whole response is the deltas merged (:func:`merge_deltas`), so streamed
    and whole answers agree."""

    plan: ToolPlan
    parser: ToolParser | None = None
    text: str = ""
    calls: list[_Sent] = field(default_factory=list)
    held: str = ""      # auto: whitespace held back (dropped if only tool calls follow)

    def feed(self, text: str) -> list[dict]:
        self.text += text
        if self.plan.mode == "named":
            return self._named(text)
        if self.plan.mode == "required":
            return self._required()
        if self.parser is not None:
            return self._auto(self.parser.feed(text))
        return [{"content": text}] if text else []

    def finish(self) -> list[dict]:
        if self.plan.mode == "named" and not self.calls:
            return self._named("")
        if self.parser is not None:
            out = self._auto(self.parser.finish())
            if self.held and not self.calls:
                out.append({"content": self.held})
            self.held = ""
            return out
        return []

    def finish_reason(self, reason: str) -> str:
        """``tool_calls`` where ``required`` or ``auto`` called a tool and the model stopped
        by itself; a named function keeps ``stop`` (vLLM's answers)."""
        if reason == "stop" and self.calls and self.plan.mode in ("required", "auto"):
            return "tool_calls"
        return reason

    def _named(self, text: str) -> list[dict]:
        if not self.calls:
            self.calls.append(_Sent(call_id(), self.plan.name))
            return [{"tool_calls": [_entry(0, self.calls[0], text)]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []

    def _required(self) -> list[dict]:
        entries = []
        for i, found in enumerate(scan_calls(self.text)):
            if found.name is None or (i and not self.plan.parallel):
                break
            args = found.arguments(self.text)
            if i == len(self.calls):
                self.calls.append(_Sent(call_id(), found.name))
                entries.append(_entry(i, self.calls[i], args))
            elif len(args) > self.calls[i].arguments:
                entries.append({"index": i, "function": {"arguments": args[self.calls[i].arguments:]}})
            self.calls[i].arguments = len(args)
        return [{"tool_calls": entries}] if entries else []

    def _auto(self, items: list[str | Call]) -> list[dict]:
        out = []
        for item in items:
            if isinstance(item, Call):
                if self.calls and not self.plan.parallel:
                    continue     # parallel_tool_calls: false keeps the first call (vLLM's filter)
                self.calls.append(_Sent(call_id(), item.name, len(item.arguments)))
                out.append({"tool_calls": [_entry(len(self.calls) - 1, self.calls[-1], item.arguments)]})
                self.held = ""
            elif item.strip():
                out.append({"content": self.held + item})
                self.held = ""
            else:
                self.held += item
        return out


def _entry(index: int, sent: _Sent, arguments: str) -> dict:
    return {"index": index, "id": sent.id, "type": "function",
            "function": {"name": sent.name, "arguments": arguments}}


def merge_deltas(deltas: list[dict]) -> dict:
    """Deltas as one message: ``content`` (None when there is none beside tool calls) and
    ``tool_calls`` (left out when there are none)."""
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for e in d.get("tool_calls", ()):
            if e["index"] not in calls:
                calls[e["index"]] = {"id": e["id"], "type": "function",
                                     "function": {"name": e["function"]["name"], "arguments": ""}}
            calls[e["index"]]["function"]["arguments"] += e["function"].get("arguments", "")
    if not calls:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}


# ---- required: a JSON array of {"name", "parameters"} read as it arrives -----------------------
@dataclass(slots=True)
class FoundCall:
    """An element of the array so far: its name once its string is whole, and where its
    ``parameters`` value starts and (once it has) ends in the text."""

    name: str | None = None
    start: int | None = None
    end: int | None = None
    scalar: bool = False

    def arguments(self, text: str) -> str:
        """The parameters' text so far: an open object, array or string to the end of
        ``text``; a number or literal only once it has ended."""
        if self.start is None or (self.end is None and self.scalar):
            return ""
        return text[self.start:self.end]


def scan_calls(text: str) -> list[FoundCall]:
    """The elements of the JSON array ``text`` (whole or cut anywhere).

    >>> [(c.name, c.arguments('[{"name": "f", "parameters": {"x": [1')) for c in
    ...  scan_calls('[{"name": "f", "parameters": {"x": [1')]
    [('f', '{"x": [1')]
    """
    calls: list[FoundCall] = []
    depth, in_string, escaped, expect_key = 0, False, False, False
    key_start = value_start = None
    key = value_key = None
    value_kind = ""             # of the member value at depth 2: "string", "container", "scalar"

    def end_value(end: int) -> None:
        nonlocal value_key, value_kind
        if value_key == "name" and value_kind == "string":
            try:
                name = json.loads(text[value_start:end])
            except ValueError:
                name = None
            calls[-1].name = name if isinstance(name, str) else None
        elif value_key == "parameters":
            calls[-1].end = end
        value_key, value_kind = None, ""

    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 2 and key_start is not None:
                    try:
                        key = json.loads(text[key_start:i + 1])
                    except ValueError:
                        key = None
                    key_start = None
                elif depth == 2 and value_kind == "string":
                    end_value(i + 1)
            continue
        if depth == 2 and value_key is not None and not value_kind and not ch.isspace():
            value_kind = "string" if ch == '"' else "container" if ch in "[{" else "scalar"
            value_start = i
            if value_key == "parameters":
                calls[-1].start, calls[-1].scalar = i, value_kind == "scalar"
        if ch == '"':
            in_string = True
            if depth == 2 and expect_key:
                key_start, expect_key = i, False
        elif ch in "[{":
            depth += 1
            if depth == 2:
                calls.append(FoundCall())
                expect_key = True
        elif ch in "]}":
            if depth == 2 and value_kind == "scalar":
                end_value(len(text[:i].rstrip()))
            depth -= 1
            if depth == 2 and value_kind == "container":
                end_value(i + 1)
        elif depth == 2 and ch == ",":
            if value_kind == "scalar":
                end_value(len(text[:i].rstrip()))
            expect_key = True
        elif depth == 2 and ch == ":":
            value_key, value_kind = key, ""
    return calls
