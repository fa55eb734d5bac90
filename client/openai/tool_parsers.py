"""Tool-call parsers for ``tool_choice: "auto"``: the model's text, as it arrives, split
into content and tool calls. The server's ``--tool-call-parser NAME`` picks one (vLLM's
names); each choice gets its own (a parser keeps state).

``hermes`` reads the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
of Hermes 2 Pro, Qwen2.5 and Qwen3 chat templates; the text outside them is content.
Streamed, text that may be the start of ``<tool_call>`` is held back until it is known
not to be, and a call is handed over whole once its closing tag arrives (or the text
ends after a complete JSON object). A block whose JSON is malformed, or that is not
``{"name": <string>, "arguments": <object>}``, stays in the content as it was written.

>>> p = tool_parser("hermes")
>>> p.feed('Sure.<tool_') + p.feed('call>{"name": "f", "arguments": {"x": 1}}</tool_call>') + p.finish()
['Sure.', Call(name='f', arguments='{"x": 1}')]
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True, frozen=True)
class Call:
    """A whole tool call: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str


class ToolParser(Protocol):
    def feed(self, text: str) -> list[str | Call]:
        """The next piece of the model's text in; the content (strings) and calls it completes out."""

    def finish(self) -> list[str | Call]:
        """The text ended: what was held back."""


def held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may begin ``tag``.

    >>> held_prefix("abc<tool", "<tool_call>"), held_prefix("a<b", "<tool_call>")
    (5, 0)
    """
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.buffer = ""
        self.in_call = False

    def feed(self, text: str) -> list[str | Call]:
        self.buffer += text
        out: list[str | Call] = []
        while True:
            if self.in_call:
                end = self.buffer.find(self.END)
                if end < 0:
                    return out
                out.append(self._block(self.buffer[:end], closed=True))
                self.buffer, self.in_call = self.buffer[end + len(self.END):], False
            else:
                start = self.buffer.find(self.START)
                if start < 0:
                    keep = held_prefix(self.buffer, self.START)
                    sendable, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                    return out + ([sendable] if sendable else [])
                if start:
                    out.append(self.buffer[:start])
                self.buffer, self.in_call = self.buffer[start + len(self.START):], True

    def finish(self) -> list[str | Call]:
        rest, self.buffer = self.buffer, ""
        if self.in_call:      # the text ended inside a block: a call if its JSON is whole
            self.in_call = False
            return [self._block(rest, closed=False)]
        return [rest] if rest else []

    def _block(self, body: str, closed: bool) -> str | Call:
        call = parse_call(body)
        if call is not None:
            return call
        return self.START + body + (self.END if closed else "")


def parse_call(body: str) -> Call | None:
    """``{"name": ..., "arguments": {...}}`` as a :class:`Call`; None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return Call(value["name"], json.dumps(args, ensure_ascii=False))


TOOL_PARSERS = {"hermes": HermesParser}


def tool_parser(name: str | None) -> ToolParser | None:
    """A new parser of that name (None for None); a ValueError naming the known ones."""
    if name is None:
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool-call parser {name!r}; allowed: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
