"""Chat messages as one prompt: the checkpoint's chat template, or a plain one.

A checkpoint's template is its ``chat_template.jinja`` or the ``chat_template`` of its
``tokenizer_config.json`` (a string, or a list of named templates: ``default`` is used).
It is rendered as Hugging Face's ``apply_chat_template`` renders it: Jinja2's sandbox
with ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``, ``strftime_now``, a
``tojson`` that keeps non-ASCII, the tokenizer's special tokens (``bos_token``,
``eos_token``, ...) as variables, ``add_generation_prompt=True``. The prompt goes to the
ensemble as text and is tokenized there with the tokenizer's special tokens, so a
``bos_token`` the template writes first is dropped when the tokenizer adds one itself
(``add_bos_token``): one BOS, as ``apply_chat_template(tokenize=True)`` gives.

Without a template (the demo checkpoints have none) the **plain template** applies:
each message as ``<role>: <content>`` and a newline, then ``assistant:``:

>>> PLAIN.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
'system: Be brief.\\nuser: Hi\\nassistant:'

With tools, the plain template writes them first as one short line of signatures (their
names and parameters' names, not the schemas: a checkpoint without a template was not
taught to read them, and a small one has little context), an assistant's tool calls after
its content as Hermes' ``<tool_call>{...}</tool_call>`` (what the ``hermes`` parser reads),
and a tool result as a ``tool: <content>`` line:

>>> PLAIN.render([{"role": "assistant", "content": "", "tool_calls": [
...     {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
...     {"role": "tool", "tool_call_id": "call_1", "content": "2"}],
...     tools=[{"type": "function", "function": {"name": "f", "parameters": {"properties": {"x": {}, "y": {}}}}},
...            {"type": "function", "function": {"name": "now"}}])
'tools: f(x, y), now()\\nassistant: <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\\ntool: 2\\nassistant:'
>>> ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
...              "{% if add_generation_prompt %}<assistant>{% endif %}").render([{"role": "user", "content": "Hi"}])
'<user>Hi<assistant>'
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

PLAIN_SOURCE = "plain"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the messages (its ``raise_exception``) or failed to render."""


class ChatTemplate:
    """A Jinja2 chat template, compiled once; :meth:`render` turns messages into a prompt."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, strip_bos: bool = False,
                 origin: str = "template"):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.strip_bos = strip_bos
        self.origin = origin        # where it came from (a file), or "plain"

    @cached_property
    def _template(self):
        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The prompt; ``tools`` (OpenAI's tool dicts) go to the template as transformers'
        ``apply_chat_template(tools=...)`` passes them."""
        try:
            text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools or None, documents=None, **self.special_tokens)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None
        bos = self.special_tokens.get("bos_token")
        if self.strip_bos and bos and text.startswith(bos):
            text = text[len(bos):]
        return text

    @classmethod
    def for_checkpoint(cls, model_dir: str | Path | None) -> "ChatTemplate":
        """The checkpoint's template, or :data:`PLAIN` when it has none."""
        if model_dir is None:
            return PLAIN
        model_dir = Path(model_dir)
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        jinja_file = model_dir / "chat_template.jinja"
        source, origin = config.get("chat_template"), str(config_file)
        if jinja_file.is_file():
            source, origin = jinja_file.read_text(), str(jinja_file)
        elif isinstance(source, list):   # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not source:
            return PLAIN
        special = {k: _token_text(config[k]) for k in SPECIAL_TOKENS if config.get(k) is not None}
        return cls(source, special, strip_bos=bool(config.get("add_bos_token")), origin=origin)


def _token_text(token) -> str:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    return token.get("content", "") if isinstance(token, dict) else str(token)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (HF marks assistant text with it):
    rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


PLAIN = ChatTemplate(
    "{% if tools %}tools: {% for t in tools %}{{ t.function.name }}("
    "{{ (t.function.parameters or {}).properties | default({}) | list | join(', ') }})"
    "{% if not loop.last %}, {% endif %}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}", origin=PLAIN_SOURCE)
