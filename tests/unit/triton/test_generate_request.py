"""The request parsers (backends/triton/generate_request.py): TensorRT-LLM's inputs and
defaults, and every bad field named with what is allowed."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from tandem.backends.triton.generate_request import (RequestError, check_context, parse_generate_request,
                                                     parse_token_request)

from .fakes import CONTEXT, VOCAB, FakeTokenizer
from .model_calls import arrays


def _get(**inputs):
    return lambda name: inputs.get(name)


def test_defaults_are_documented_ones():
    req = parse_generate_request(_get(text_input=np.array([[b"hi"]], dtype=object)))
    assert (req.prompt, req.max_tokens, req.stream, req.temperature, req.top_p, req.top_k) == \
        ("hi", 16, False, 1.0, 1.0, 0)
    assert (req.seed, req.stop_words, req.end_id, req.exclude_input_in_output) == (None, [], None, False)
    assert (req.bad_words, req.pad_id, req.num_return_sequences, req.repetition_penalty, req.presence_penalty,
            req.frequency_penalty, req.min_tokens, req.length_penalty, req.embedding_bias,
            req.return_log_probs) == ([], None, 1, 1.0, 0.0, 0.0, 0, 1.0, [], False)
    params = req.sampling_params()
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty, params.min_tokens,
            params.bad_words, params.logit_bias, params.logprobs) == (1.0, 0.0, 0.0, 0, [], {}, False)


BAD_SAMPLING = [
    ("max_tokens", 0, np.int32, ">= 1"),
    ("max_tokens", -5, np.int32, ">= 1"),
    ("temperature", -0.5, np.float32, ">= 0"),
    ("temperature", math.nan, np.float32, ">= 0"),
    ("temperature", math.inf, np.float32, ">= 0"),
    ("top_p", 1.5, np.float32, "(0, 1]"),
    ("top_p", 0.0, np.float32, "(0, 1]"),
    ("top_p", -0.1, np.float32, "(0, 1]"),
    ("top_k", -1, np.int32, ">= 0"),
    ("end_id", 100, np.int32, "[0, 99]"),
    ("end_id", -1, np.int32, "[0, 99]"),
    ("pad_id", 100, np.int32, "[0, 99]"),
    ("beam_width", 2, np.int32, "allowed: 1 (Tandem has no beam search"),
    ("beam_width", 0, np.int32, "allowed: 1"),
    ("num_return_sequences", 0, np.int32, "[1, 16]"),
    ("num_return_sequences", 17, np.int32, "[1, 16]"),
    ("repetition_penalty", 0.0, np.float32, "> 0 (1 = off)"),
    ("presence_penalty", 2.5, np.float32, "[-2, 2]"),
    ("frequency_penalty", -3.0, np.float32, "[-2, 2]"),
    ("frequency_penalty", math.nan, np.float32, "[-2, 2]"),
    ("min_tokens", 17, np.int32, "[0, max_tokens=16]"),
    ("min_length", -1, np.int32, "[0, max_tokens=16]"),
    ("length_penalty", math.inf, np.float32, "a finite number"),
    ("return_context_logits", True, np.bool_, "not supported: Tandem returns no context logits; allowed: false"),
    ("return_generation_logits", True, np.bool_, "not supported"),
]


@pytest.mark.parametrize("field,value,dtype,allowed", [
    ("text_input", b"", object, "non-empty"),
    ("text_input", b"\xff\xfe", object, "UTF-8"),
    *BAD_SAMPLING,
])
def test_bad_field_is_named_with_allowed_values(field, value, dtype, allowed):
    inputs = {"text_input": np.array([[b"hi"]], dtype=object), field: np.array([[value]], dtype=dtype)}
    with pytest.raises(RequestError) as err:
        parse_generate_request(inputs.get, vocab_size=VOCAB)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ") and allowed in str(err.value)


@pytest.mark.parametrize("field,value,dtype,allowed", BAD_SAMPLING)
def test_token_requests_share_the_sampling_checks(field, value, dtype, allowed):
    inputs = {"input_ids": np.array([[1, 2]], dtype=np.int32), field: np.array([[value]], dtype=dtype)}
    with pytest.raises(RequestError) as err:
        parse_token_request(inputs.get, VOCAB, CONTEXT)
    assert err.value.field == field and allowed in str(err.value)


@pytest.mark.parametrize("ids,message", [
    (np.zeros((1, 0), dtype=np.int32), "input_ids: is empty"),
    (np.array([[1, 100]], dtype=np.int32), r"input_ids: token id 100 is not in the vocabulary; allowed: ids in \[0, 99\]"),
    (np.array([[-1]], dtype=np.int32), "input_ids: token id -1 is not in the vocabulary"),
    (np.array([[1.0, 2.0]], dtype=np.float32), "input_ids: has type float32; allowed: INT32"),
    (np.array([[1, 2], [3, 4]], dtype=np.int32), r"input_ids: expected one sequence of shape \[1, n\], got shape \[2, 2\]"),
    (np.ones((1, CONTEXT), dtype=np.int32), f"input_ids: has {CONTEXT} tokens; the context is {CONTEXT} tokens"),
    (None, "input_ids: is required"),
])
def test_bad_input_ids_are_named(ids, message):
    with pytest.raises(RequestError, match=f"^{message}"):
        parse_token_request({"input_ids": ids}.get, VOCAB, CONTEXT)


def test_max_tokens_must_fit_the_context_left_by_the_prompt():
    inputs = arrays(input_ids=range(60), max_tokens=5)
    with pytest.raises(RequestError, match=r"^max_tokens: got 5; the prompt has 60 tokens of a 64-token "
                                           r"context; allowed: <= 4$"):
        parse_token_request(inputs.get, VOCAB, CONTEXT)
    assert parse_token_request(arrays(input_ids=range(60), max_tokens=4).get, VOCAB, CONTEXT).prompt == \
        list(range(60))
    check_context(63, 1, CONTEXT, "text_input")
    with pytest.raises(RequestError, match="^text_input: has 64 tokens"):
        check_context(64, 1, CONTEXT, "text_input")


def test_missing_text_and_batched_text_are_rejected():
    with pytest.raises(RequestError, match="text_input: is required"):
        parse_generate_request(_get())
    with pytest.raises(RequestError, match="text_input: expected one value, got 2"):
        parse_generate_request(_get(text_input=np.array([[b"a"], [b"b"]], dtype=object)))


def test_tensorrt_llm_conventions():
    req = parse_generate_request(_get(
        text_input=np.array([[b"hi"]], dtype=object),
        random_seed=np.array([[7]], dtype=np.uint64),          # TensorRT-LLM's name for seed
        stop_words=np.array([[b"\n\n", b"", b"def"]], dtype=object),  # "" pads ragged lists
        end_id=np.array([[5]], dtype=np.int32)))
    assert (req.seed, req.stop_words, req.end_id) == (7, ["\n\n", "def"], 5)
    params = req.sampling_params()
    assert params.stop_token_ids == [5] and params.ignore_eos  # end_id replaces EOS
    assert params.stop == ["\n\n", "def"] and params.seed == 7


def test_every_tensorrt_llm_sampling_input_reaches_the_engine():
    """Each input of the TensorRT-LLM text ensemble maps onto the engine's SamplingParams."""
    req = parse_token_request(arrays(
        input_ids=[1, 2], max_tokens=8, num_return_sequences=3, beam_width=1, seed=2**64 - 2,
        repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.25, min_length=4,
        bad_words=["", "ab", ""], embedding_bias_words=["a", "", "ba"], embedding_bias_weights=[1.5, 9.0, -1.0],
        pad_id=0, length_penalty=0.7, return_log_probs=True, return_num_input_tokens=True,
        return_num_output_tokens=False, return_finish_reason=True).get, VOCAB, CONTEXT)
    assert (req.num_return_sequences, req.length_penalty, req.pad_id) == (3, pytest.approx(0.7), 0)
    p0, p2 = req.sampling_params(0, FakeTokenizer()), req.sampling_params(2, FakeTokenizer())
    assert (p0.seed, p2.seed) == (2**64 - 2, 0)        # seed + i, as a UINT64 wraps
    assert (p0.repetition_penalty, p0.presence_penalty, p0.frequency_penalty) == \
        (pytest.approx(1.3), 0.5, -0.25)
    assert (p0.min_tokens, p0.bad_words, p0.logprobs, p0.max_tokens) == (4, ["ab"], True, 8)
    # every token of a word gets its weight; "" pads; 'a' is 97 % 100, 'b' 98
    assert p0.logit_bias == {97: pytest.approx(0.5), 98: -1.0}
    p0.validate()
    # min_tokens (the newer name) wins over min_length, as seed over random_seed
    both = parse_token_request(arrays(input_ids=[1], min_tokens=2, min_length=5).get, VOCAB, CONTEXT)
    assert both.min_tokens == 2
    with pytest.raises(RequestError, match="embedding_bias_words: this model has no tokenizer"):
        req.sampling_params(0, None)


@pytest.mark.parametrize("extra,message", [
    (dict(embedding_bias_words=["a", "b"], embedding_bias_weights=[1.0]),
     "embedding_bias_weights: has 1 weights for 2 embedding_bias_words; allowed: one weight per word"),
    (dict(embedding_bias_words=["a"]), "embedding_bias_weights: has 0 weights for 1"),
    (dict(embedding_bias_words=["a"], embedding_bias_weights=[math.inf]),
     "embedding_bias_weights: got inf; allowed: finite numbers"),
    (dict(bad_words=["  "]), "bad_words: got '  '; allowed: non-blank strings"),
    (dict(bad_words=["w"] * 17), "bad_words: has 17 words; allowed: up to 16"),
])
def test_word_lists_are_checked(extra, message):
    with pytest.raises(RequestError, match=f"^{re.escape(message)}"):
        parse_token_request(arrays(input_ids=[1], **extra).get, VOCAB, CONTEXT)
