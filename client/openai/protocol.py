"""The OpenAI API's request bodies and its usage and model-list objects (pydantic), as far as
Tandem serves them (the completion and chunk bodies are built in ``responses``).

Requests are checked here (types and ranges: a bad one is a 400 naming the field);
what the ensemble itself must decide (the prompt fits the context, a stop word is not too
long) is checked there and comes back as its error. Fields OpenAI defines that Tandem
cannot honour are refused with a message that says so, never silently ignored
(:func:`unsupported`); fields no OpenAI client sends are ignored, as vLLM does.

>>> CompletionRequest(model="tandem", prompt="def f(", max_tokens=8).prompts()
['def f(']
>>> ChatCompletionRequest(model="tandem", messages=[{"role": "user", "content": "hi"}]).n
1
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# OpenAI's limits where it has them; the ensemble's own where it is stricter
MAX_N = 16              # choices per request: each is its own stream to the ensemble
MAX_LOGPROBS = 20       # alternatives per position (OpenAI's chat limit, vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 100    # OpenAI's range for a logit_bias value: [-100, 100]
INT32_MAX = 2 ** 31 - 1  # the ensemble's integer inputs are INT32: a larger value would wrap


class OpenAIError(Exception):
    """An error as OpenAI reports it: ``{"error": {"message", "type", "param", "code"}}``
    with an HTTP status.

    >>> OpenAIError(400, "n: got 0; allowed: 1..16", param="n").body()["error"]["type"]
    'invalid_request_error'
    """

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "internal_server_error",
             503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param, code="invalid_value")


def utf8_text(value):
    """A string field's value, if every string in it is text UTF-8 can carry. JSON may
    spell a lone UTF-16 surrogate (``"\\ud800"``), which no text is made of and which
    would fail later, as a 500, where the prompt is encoded."""
    for text in [value] if isinstance(value, str) else value if isinstance(value, list) else ():
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"not valid Unicode text: a lone UTF-16 surrogate "
                                 f"({text[e.start]!r}) at character {e.start}") from None
    return value


class StreamOptions(BaseModel):
    include_usage: bool = False


# fields that cannot change an answer: accepted and ignored (OpenAI's bookkeeping)
NO_EFFECT_FIELDS = frozenset({"user", "store", "metadata", "service_tier"})
# fields of vLLM's and OpenAI's APIs Tandem does not implement: accepted at the value that
# asks for nothing (clients send them so), refused by name otherwise
DEFAULT_ONLY_FIELDS = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
                       "include_stop_str_in_output": False, "use_beam_search": False, "length_penalty": 1.0,
                       "min_p": 0.0, "allowed_token_ids": None, "bad_words": None, "stop_token_ids": None,
                       "truncate_prompt_tokens": None, "return_tokens_as_token_ids": False,
                       "add_generation_prompt": True, "continue_final_message": False, "echo": False,
                       "add_special_tokens": None, "priority": 0, "top_a": 0, "typical_p": 1.0,
                       "reasoning_effort": None, "modalities": None, "prediction": None}


def unknown_fields(extra: dict[str, Any]) -> None:
    """A field the API does not know is refused, never silently ignored (a client must learn
    that ``min_p`` or ``logit_processors`` did nothing); see the two tables above.

    >>> unknown_fields({"store": False, "skip_special_tokens": True})
    >>> try:
    ...     unknown_fields({"min_p": 0.1})
    ... except OpenAIError as e:
    ...     print(e.status, e.message)
    400 min_p: got 0.1; Tandem does not implement it (allowed: 0.0, or leave it out)
    """
    for name, value in extra.items():
        if name in NO_EFFECT_FIELDS:
            continue
        if name in DEFAULT_ONLY_FIELDS:
            default = DEFAULT_ONLY_FIELDS[name]
            if value == default or value is None or (default is None and value in ([], {}, "")):
                continue
            allowed = "leave it out" if default is None else f"{default!r}, or leave it out"
            raise invalid(name, f"got {value!r}; Tandem does not implement it (allowed: {allowed})")
        raise invalid(name, "not a field this API knows; refused rather than ignored (docs/OPENAI.md lists "
                            "the fields it honours)")


class _Request(BaseModel):
    # an unknown field is kept here and refused by name (:func:`unknown_fields`)
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=0, lt=2 ** 64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions vLLM and SGLang accept too (sent to the ensemble when it declares them)
    top_k: int | None = Field(default=None, ge=0, le=INT32_MAX)
    min_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    ignore_eos: bool | None = None
    repetition_penalty: float | None = Field(default=None, gt=0)
    # vLLM's: prompts share cached KV (prefix caching) only with requests of the same salt
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # vLLM's: the prompt's tokens' log probabilities, with this many alternatives each
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # structured output: OpenAI's response_format (vLLM takes it on completions too) and
    # vLLM's structured_outputs and guided_* extras
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None

    _stop_is_text = field_validator("stop")(utf8_text)

    def stop_words(self) -> list[str]:
        words = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [w for w in words if w]   # an empty stop string stops nothing (as TensorRT-LLM)

    def guide(self) -> tuple[str, str, str] | None:
        """The structured output asked for, as the ensemble's
        ``(guided_decoding_guide_type, guided_decoding_guide)`` and the field that asked
        for it; None for free text. At most one field may ask.

        >>> CompletionRequest(model="m", prompt="x", guided_regex="[0-9]+").guide()
        ('regex', '[0-9]+', 'guided_regex')
        >>> ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
        ...                       response_format={"type": "json_object"}).guide()
        ('json_schema', '{"type": "object"}', 'response_format')
        """
        asked = [g for g in (self._response_format(), *self._vllm_guides()) if g is not None]
        if len(asked) > 1:
            raise invalid(asked[1][2], f"{asked[0][2]} already asks for structured output; send one of "
                                       f"{', '.join(g[2] for g in asked)}")
        return asked[0] if asked else None

    def _response_format(self) -> tuple[str, str, str] | None:
        fmt = self.response_format
        if not fmt:
            return None
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":   # OpenAI's JSON mode: an object
            return "json_schema", '{"type": "object"}', "response_format"
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise invalid("response_format", "json_schema needs {'json_schema': {'name': ..., "
                                                 "'schema': {...}}} with the schema an object")
            return "json_schema", json.dumps(schema), "response_format"
        raise invalid("response_format", f"type {kind!r}; allowed: text, json_object, json_schema")

    def _vllm_guides(self):
        so = self.structured_outputs or {}
        unknown = sorted(set(so) - {"json", "regex", "grammar", "choice", "json_object"})
        if unknown:
            raise invalid("structured_outputs", f"has {unknown}; allowed keys: json, regex, grammar, "
                                                "choice, json_object")
        for name, value, kind in (("guided_json", self.guided_json, "json"),
                                  ("structured_outputs.json", so.get("json"), "json"),
                                  ("guided_regex", self.guided_regex, "regex"),
                                  ("structured_outputs.regex", so.get("regex"), "regex"),
                                  ("guided_grammar", self.guided_grammar, "grammar"),
                                  ("structured_outputs.grammar", so.get("grammar"), "grammar"),
                                  ("guided_choice", self.guided_choice, "choice"),
                                  ("structured_outputs.choice", so.get("choice"), "choice")):
            if value is None:
                continue
            if kind == "json":
                if not isinstance(value, (dict, str)):
                    raise invalid(name, "allowed: a JSON schema (an object, or its text)")
                yield "json_schema", value if isinstance(value, str) else json.dumps(value), name
            elif kind == "choice":
                if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
                    raise invalid(name, "allowed: a non-empty list of strings")
                # one alternative per choice, each an EBNF string literal (JSON's escapes)
                yield "ebnf_grammar", "root ::= " + " | ".join(json.dumps(c) for c in value), name
            else:
                if not isinstance(value, str) or not value.strip():
                    raise invalid(name, "allowed: a non-empty string")
                yield ("regex" if kind == "regex" else "ebnf_grammar"), value, name
        if so.get("json_object"):
            yield "json_schema", '{"type": "object"}', "structured_outputs.json_object"

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def token_bias(self) -> dict[int, float]:
        """``logit_bias`` as token id -> value (OpenAI's: ids as strings, values in
        [-100, 100]); the ensemble checks the ids against the vocabulary.

        >>> CompletionRequest(model="m", prompt="x", logit_bias={"50256": -100}).token_bias()
        {50256: -100.0}
        """
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if token < 0 or token >= 2 ** 31 or str(token) != key.strip():
                raise invalid("logit_bias", f"key {key!r}; allowed: token ids (integers >= 0, as strings)")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise invalid("logit_bias", f"{key}: {value}; allowed: numbers in [-{MAX_LOGIT_BIAS}, "
                                            f"{MAX_LOGIT_BIAS}]")
            bias[token] = float(value)
        return bias

    def num_top_logprobs(self) -> int:
        """The alternatives asked for at each generated position."""
        return 0

    def num_prompt_logprobs(self) -> int | None:
        """The prompt's log probabilities asked for (with that many alternatives), or None."""
        return self.prompt_logprobs

    def common_unsupported(self) -> None:
        unknown_fields(self.model_extra or {})
        self.token_bias()
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "only allowed when stream is true")
        self.guide()     # a malformed response_format or guided_* field: 400 before anything is sent


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    _prompt_is_text = field_validator("prompt", "suffix")(utf8_text)

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts: text, or token ids (a list of ints, or a list of such lists).

        >>> CompletionRequest(model="m", prompt=[[1, 2], [3]]).prompts()
        [[1, 2], [3]]
        >>> CompletionRequest(model="m", prompt=[5]).prompts()
        [[5]]
        """
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise invalid("prompt", "empty; send a string, a list of strings, a list of token ids or a list "
                                    "of such lists")
        if all(isinstance(x, str) for x in p):
            return list(p)
        ids = [p] if all(isinstance(x, int) for x in p) else p
        if not all(isinstance(x, list) and x and all(isinstance(t, int) and 0 <= t < 2 ** 31 for t in x)
                   for x in ids):
            raise invalid("prompt", "token-id prompts must be non-empty lists of token ids >= 0 (one list, or "
                                    "a list of lists), not mixed with text")
        return [list(x) for x in ids]

    def unsupported(self) -> None:
        self.common_unsupported()
        if self.suffix:
            raise invalid("suffix", "not supported (no fill-in-the-middle); send none")
        if self.best_of is not None and self.best_of != self.n:
            raise invalid("best_of", f"got {self.best_of}; allowed: equal to n ({self.n}) or unset "
                                     "(no ranking of candidates)")

    def num_top_logprobs(self) -> int:
        return self.logprobs or 0

    def num_prompt_logprobs(self) -> int | None:
        """``echo`` with ``logprobs`` k: the prompt's, with k alternatives (OpenAI's legacy
        completions; lm-evaluation-harness scores with it), or vLLM's ``prompt_logprobs``."""
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(asked) if asked else None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None

    _text_is_text = field_validator("text")(utf8_text)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None     # an assistant's (checked in tools.template_messages)
    tool_call_id: str | None = None                     # a tool message's

    _content_is_text = field_validator("content", "name")(utf8_text)

    def text(self) -> str:
        """The message's text: a string, or the text parts of a content list joined."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        other = [p.type for p in self.content if p.type != "text"]
        if other:
            raise invalid("messages", f"content part of type {other[0]!r}; allowed: text")
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None     # the deprecated forms of tools and tool_choice
    function_call: Any = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def tool_plan(self):
        """What the request asks of tools (:class:`~.tools.ToolPlan`); a 400 for a bad field."""
        from .tools import plan_tools
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def guide(self) -> tuple[str, str, str] | None:
        """The structured output asked for: ``tool_choice`` "required" or a named function
        (their grammar, field ``tools``), or :meth:`_Request.guide`'s; not both."""
        other = super().guide()
        tools = self.tool_plan().guide()
        if tools is None:
            return other
        if other is not None:
            raise invalid(other[2], "tool_choice 'required' or a named function already constrains the output "
                                    f"to tool calls; send {other[2]} or that tool_choice, not both")
        return "json_schema", tools, "tools"

    def unsupported(self) -> None:
        self.common_unsupported()
        if self.functions is not None or self.function_call is not None:
            name = "functions" if self.functions is not None else "function_call"
            raise invalid(name, "the deprecated form of tools; send tools and tool_choice")
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")
        if self.prompt_logprobs is not None and self.stream:
            raise invalid("prompt_logprobs", "not returned in a streamed chat (as vLLM); send stream false")

    def num_top_logprobs(self) -> int:
        return self.top_logprobs or 0 if self.logprobs else 0


# ---- responses ------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0       # prompt tokens whose KV the prefix cache served


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # only when the ensemble reports cached tokens (model_dump leaves it out otherwise)
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=None if cached_tokens is None
                   else PromptTokensDetails(cached_tokens=cached_tokens))

    def model_dump(self, **kwargs):
        out = super().model_dump(**kwargs)
        if out.get("prompt_tokens_details") is None:
            out.pop("prompt_tokens_details", None)
        return out


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "tandem"
    root: str | None = None       # a LoRA adapter's directory (vLLM's)
    parent: str | None = None     # a LoRA adapter's base model (vLLM's)


class LoadLoRARequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's)."""
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRARequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's)."""
    lora_name: str = Field(min_length=1)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
