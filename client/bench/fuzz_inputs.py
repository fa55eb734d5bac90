"""What ``tandem bench fuzz`` sends: hypothesis strategies for random and adversarial
requests to each of the server's interfaces (pure: no server here).

- **OpenAI** completions and chat bodies: every field the API knows, each either a
  plausible value or an adversarial one (huge, negative, NaN and infinities, wrong types,
  deep nesting, huge strings, grammars that explode), plus unknown fields and raw bodies
  that are no JSON at all (invalid UTF-8, truncated).
- **Triton's HTTP generate** endpoint of an ensemble: its inputs as JSON, the same way,
  and with every value of its input's JSON type but out of range (``typed``: past
  Triton's own parser, into the models' checks).
- **gRPC streams** to an ensemble: each input as a tensor of a random dtype and shape.

Plausible values keep ``max_tokens`` small, so that requests the server accepts end fast.
"""
from __future__ import annotations

import json

from hypothesis import strategies as st

BIG = 2 ** 70
HUGE_TEXT = "x" * 200_000

# values no field expects: each interface must refuse them with a clear 4xx
adversarial = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-BIG, max_value=BIG),
    st.sampled_from([0, -1, 2 ** 31, 2 ** 63, 2 ** 64, -(2 ** 63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.just(HUGE_TEXT),
    st.lists(st.integers(min_value=-BIG, max_value=BIG), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    st.recursive(st.integers(), lambda inner: st.lists(inner, max_size=2), max_leaves=40),
)

# grammars meant to be slow or huge to compile
exploding_regex = st.sampled_from(["(a*)*b", "(a|aa)*c" * 20, "[" * 50, "(" * 1000 + ")" * 1000,
                                   "\\", "a{1000000}", "(?P<x>a)(?P=x)" * 10, ""])


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


exploding_schema = st.one_of(
    st.integers(min_value=1, max_value=300).map(_deep_schema),
    st.just({"type": "string", "enum": [f"v{i}" for i in range(20_000)]}),
    st.just({"type": "array", "items": {"$ref": "#"}}),
    st.just({"type": "object", "properties": {"x": {"$ref": "#/nope"}}}),
    st.just({"type": "integer", "minimum": 5, "maximum": 1}),
    st.dictionaries(st.text(max_size=8), adversarial, max_size=4),
)


def field(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: plausible two times in three, adversarial otherwise."""
    return st.one_of(plausible, plausible, adversarial)


_SAMPLING = {
    "max_tokens": field(st.integers(min_value=1, max_value=6)),
    "temperature": field(st.floats(min_value=0, max_value=2)),
    "top_p": field(st.floats(min_value=0.01, max_value=1)),
    "top_k": field(st.integers(min_value=0, max_value=50)),
    "seed": field(st.integers(min_value=0, max_value=2 ** 32)),
    "n": field(st.integers(min_value=1, max_value=2)),
    "stop": field(st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5), max_size=3))),
    "presence_penalty": field(st.floats(min_value=-2, max_value=2)),
    "frequency_penalty": field(st.floats(min_value=-2, max_value=2)),
    "repetition_penalty": field(st.floats(min_value=0.5, max_value=2)),
    "min_tokens": field(st.integers(min_value=0, max_value=3)),
    "stream": field(st.booleans()),
    "logprobs": field(st.integers(min_value=0, max_value=5)),
    "ignore_eos": field(st.booleans()),
    "cache_salt": field(st.text(min_size=1, max_size=10)),
    "user": field(st.text(max_size=10)),
    "logit_bias": field(st.dictionaries(st.integers(0, 100).map(str), st.floats(-100, 100), max_size=2)),
    "response_format": st.one_of(
        st.just({"type": "json_object"}), st.just({"type": "text"}),
        exploding_schema.map(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}),
        adversarial),
    "guided_regex": st.one_of(st.just("[a-z]{1,4}"), exploding_regex, adversarial),
    "guided_choice": field(st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3)),
    "guided_json": st.one_of(exploding_schema, adversarial),
    "no_such_field": adversarial,
}

_text = st.one_of(st.text(max_size=30), st.just("def f(x):"), st.just(HUGE_TEXT))
_message = st.fixed_dictionaries({"role": field(st.sampled_from(["user", "system", "assistant"])),
                                  "content": field(_text)})


def openai_body(kind: str) -> st.SearchStrategy:
    """A JSON body for ``/v1/completions`` (kind "completions") or ``/v1/chat/completions``."""
    base = ({"prompt": field(st.one_of(_text, st.lists(_text, max_size=2)))} if kind == "completions"
            else {"messages": field(st.lists(_message, max_size=3))})
    return st.fixed_dictionaries({"model": field(st.just("tandem")), **base}, optional=_SAMPLING)


# values of the type an input declares, out of its range: they pass Triton's own JSON
# parser (which answers a wrong JSON type itself, with 500) and reach the models' checks
_int32 = st.one_of(st.integers(min_value=1, max_value=6), st.integers(min_value=-2 ** 31, max_value=2 ** 31 - 1))
_fp32 = st.one_of(st.floats(min_value=0, max_value=2), st.floats(allow_nan=True, allow_infinity=True, width=32))
_uint64 = st.integers(min_value=0, max_value=2 ** 64 - 1)
_words = st.lists(st.one_of(st.text(max_size=5), st.just(HUGE_TEXT)), max_size=3)


def triton_generate_body(text_model: bool, typed: bool = False) -> st.SearchStrategy:
    """A JSON body for Triton's ``/v2/models/<ensemble>/generate``: ``typed`` keeps each
    input's JSON type (the models judge the values), else any value (Triton's parser)."""
    def pick(plausible, typed_bad):
        return st.one_of(plausible, typed_bad) if typed else field(plausible)
    prompt = ({"text_input": pick(_text, st.just(""))} if text_model
              else {"input_ids": pick(st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=8),
                                      st.lists(st.integers(min_value=-2 ** 31, max_value=2 ** 31 - 1),
                                               max_size=3000))})
    optional = {"max_tokens": pick(st.integers(min_value=1, max_value=6), _int32),
                "temperature": pick(st.floats(min_value=0, max_value=2), _fp32),
                "top_p": pick(st.floats(min_value=0.01, max_value=1), _fp32),
                "top_k": pick(st.integers(min_value=0, max_value=50), _int32),
                "seed": pick(st.integers(min_value=0, max_value=2 ** 32), _uint64),
                "stop_words": pick(st.lists(st.text(min_size=1, max_size=5), max_size=3), _words),
                "bad_words": pick(st.lists(st.text(min_size=1, max_size=5), max_size=3), _words),
                "num_return_sequences": pick(st.integers(min_value=1, max_value=2), _int32),
                "min_tokens": pick(st.integers(min_value=0, max_value=3), _int32),
                "repetition_penalty": pick(st.floats(min_value=0.5, max_value=2), _fp32),
                "presence_penalty": pick(st.floats(min_value=-2, max_value=2), _fp32),
                "frequency_penalty": pick(st.floats(min_value=-2, max_value=2), _fp32),
                "return_log_probs": pick(st.booleans(), st.booleans()),
                "exclude_input_in_output": pick(st.booleans(), st.booleans()),
                "stream": pick(st.booleans(), st.booleans())}
    if not typed:
        optional |= {"guided_decoding_backend": adversarial, "no_such_input": adversarial}
    return st.fixed_dictionaries(prompt, optional=optional)


def encode(body) -> bytes:
    """JSON as a client might send it, NaN and infinities included (Python's json emits them)."""
    return json.dumps(body, allow_nan=True).encode()


# bodies that are no JSON object at all
raw_body = st.one_of(
    st.binary(max_size=64),
    st.just(b"\xff\xfe{\"prompt\": \"\xc3\x28\"}"),
    st.just(b'{"prompt": "unterminated'),
    st.just(b"[]"), st.just(b"null"), st.just(b'"text"'),
    st.just(b'{"prompt": "a", "max_tokens": 1e999}'),
    st.just(b'{' * 10_000 + b'}' * 10_000),
)

# gRPC: (input name, Triton dtype, shape, seed of the values); an ensemble's inputs and more
GRPC_DTYPES = ("BYTES", "INT32", "INT64", "UINT64", "FP32", "FP64", "BOOL", "FP16", "INT8")
grpc_tensor = st.tuples(
    st.sampled_from(["text_input", "input_ids", "max_tokens", "temperature", "top_p", "top_k", "seed",
                     "stop_words", "bad_words", "stream", "num_return_sequences", "min_tokens",
                     "return_log_probs", "exclude_input_in_output", "end_id", "pad_id", "no_such_input"]),
    st.sampled_from(GRPC_DTYPES),
    st.sampled_from([[1, 1], [1], [2, 1], [1, 0], [1, 3], [3], []]),
    st.integers(min_value=0, max_value=2 ** 31),
)
grpc_request = st.lists(grpc_tensor, min_size=1, max_size=6, unique_by=lambda t: t[0])
