"""What a request may cost is bounded before the work starts: the context and the KV
pool (one rule for the engine and the adapters, :mod:`tandem.backends.engine.request_limits`),
stop words by count and length, token prompts by the context before conversion, text
prompts by bytes before tokenizing."""
import subprocess
import sys

import numpy as np
import pytest

from tandem.backends.engine.request_limits import (MAX_LOOKAHEAD_SLOTS, LimitError, check_context,
                                                   check_pool_fit, lookahead_slots, pages_for_request)
from tandem.backends.models.tokenizer import load_tokenizer, max_token_bytes
from tandem.backends.speculative.config import MAX_NUM_SPECULATIVE_TOKENS, SpeculativeConfig
from tandem.backends.triton.generate_request import (MAX_STOP_WORD_CHARS, MAX_STOP_WORDS, RequestError,
                                                     as_request_error, check_text_length,
                                                     parse_generate_request, parse_token_request)
from tandem.backends.triton.generate_request import check_context as check_request_context


def text_request(**extra):
    return {"text_input": np.array([[b"def f():"]], dtype=object), **extra}.get


@pytest.mark.parametrize("words, problem", [
    ([b"x"] * (MAX_STOP_WORDS + 1), f"allowed: up to {MAX_STOP_WORDS}"),
    ([b"y" * (MAX_STOP_WORD_CHARS + 1)], f"allowed: up to {MAX_STOP_WORD_CHARS}"),
    ([b""] * (4 * MAX_STOP_WORDS + 1), f"allowed: up to {MAX_STOP_WORDS}"),
])
def test_stop_words_are_bounded_in_count_and_length(words, problem):
    with pytest.raises(RequestError, match=problem) as e:
        parse_generate_request(text_request(stop_words=np.array([words], dtype=object)))
    assert e.value.field == "stop_words"


def test_the_most_stop_words_allowed_pass_and_padding_is_ignored():
    words = [b"w%d" % i for i in range(MAX_STOP_WORDS)] + [b""] * 3
    req = parse_generate_request(text_request(stop_words=np.array([words], dtype=object)))
    assert len(req.stop_words) == MAX_STOP_WORDS


def test_token_prompt_longer_than_the_context_is_refused_by_its_size():
    ids = np.zeros((1, 10_000_000), dtype=np.int32)
    with pytest.raises(RequestError, match="has 10000000 tokens; the context is 64") as e:
        parse_token_request({"input_ids": ids}.get, vocab_size=100, max_model_len=64)
    assert e.value.field == "input_ids"


def test_text_longer_than_the_context_can_hold_is_refused_without_tokenizing(demo_checkpoint):
    tok = load_tokenizer(demo_checkpoint)
    bound = max_token_bytes(tok)
    longest = max(tok.get_vocab(), key=len)
    assert len(tok.encode(longest * 50).ids) * bound >= len((longest * 50).encode())  # a real bound
    with pytest.raises(RequestError, match="text_input: has 10000000 bytes"):
        check_text_length("a" * 10_000_000, 512, bound)
    check_text_length("a" * 512, 512, bound)    # may fit: tokenized and checked exactly later


# -- the context ---------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, max_tokens, context", [(63, 1, 64), (1, 63, 64), (32, 32, 64),
                                                         (1, 1, 2)])
def test_a_request_that_fills_the_context_exactly_is_accepted(prompt, max_tokens, context):
    check_context(prompt, max_tokens, context)
    check_request_context(prompt, max_tokens, context, "input_ids")


@pytest.mark.parametrize("prompt, max_tokens, field, engine, adapter", [
    (64, 1, "prompt",
     "prompt has 64 tokens; the context (max_model_len) is 64, leaving room for at least one new token",
     "input_ids: has 64 tokens; the context is 64 tokens, leaving room for at least one new token"),
    (900, 1, "prompt",
     "prompt has 900 tokens; the context (max_model_len) is 64, leaving room for at least one new token",
     "input_ids: has 900 tokens; the context is 64 tokens, leaving room for at least one new token"),
    (60, 5, "max_tokens",
     "prompt (60 tokens) + max_tokens (5) = 65 exceeds the context (max_model_len=64); "
     "allowed: max_tokens <= 4",
     "max_tokens: got 5; the prompt has 60 tokens of a 64-token context; allowed: <= 4"),
    (1, 64, "max_tokens",
     "prompt (1 tokens) + max_tokens (64) = 65 exceeds the context (max_model_len=64); "
     "allowed: max_tokens <= 63",
     "max_tokens: got 64; the prompt has 1 tokens of a 64-token context; allowed: <= 63"),
])
def test_a_request_past_the_context_says_what_is_allowed(prompt, max_tokens, field, engine, adapter):
    """The engine's message names its setting, the adapters' the request's input."""
    with pytest.raises(LimitError) as e:
        check_context(prompt, max_tokens, max_model_len=64)
    assert (str(e.value), e.value.field) == (engine, field)
    with pytest.raises(RequestError) as r:
        check_request_context(prompt, max_tokens, 64, "input_ids")
    assert str(r.value) == adapter and r.value.field == adapter.split(":")[0]


def test_a_limit_error_is_a_value_error_the_engine_raises():
    with pytest.raises(ValueError, match="max_model_len"):
        check_context(10, 1, max_model_len=10)


@pytest.mark.parametrize("prompt_field", ["input_ids", "text_input"])
def test_the_adapter_names_the_prompt_by_its_input(prompt_field):
    with pytest.raises(RequestError, match=f"^{prompt_field}: has 8 tokens") as e:
        check_request_context(8, 1, 8, prompt_field)
    assert e.value.field == prompt_field


# -- the KV pool ---------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, max_tokens, page_size, lookahead, pages", [
    (1, 1, 16, 0, 1), (8, 8, 16, 0, 1), (8, 9, 16, 0, 2), (30, 2, 16, 4, 3), (12, 4, 4, 0, 4),
    (12, 4, 4, 1, 5), (1, 1, 1, 17, 19),
])
def test_a_request_holds_the_pages_of_its_whole_sequence_and_lookahead(prompt, max_tokens, page_size,
                                                                       lookahead, pages):
    assert pages_for_request(prompt, max_tokens, page_size, lookahead) == pages
    assert check_pool_fit(prompt, max_tokens, page_size, pages, lookahead) == pages   # the bound


@pytest.mark.parametrize("lookahead", [0, 1, 4])
def test_a_request_one_page_over_the_pool_is_refused(lookahead):
    need = pages_for_request(10, 10, 4, lookahead)
    with pytest.raises(LimitError) as e:
        check_pool_fit(10, 10, page_size=4, num_pages=need - 1, lookahead=lookahead)
    assert str(e.value) == (f"request needs {need} KV pages (20 tokens), the pool has {need - 1}; "
                            "lower max_tokens or raise num_pages")
    assert e.value.field == "max_tokens"


def test_the_decode_pool_refusal_names_max_tokens_and_the_pool():
    """kv_transfer's wording: the request is refused before any page is reserved."""
    with pytest.raises(LimitError) as e:
        check_pool_fit(30, 2, page_size=16, num_pages=2, lookahead=4, pool="decode pool")
    assert str(as_request_error(e.value)) == (
        "max_tokens: the prompt (30 tokens) + max_tokens (2) need 3 KV pages; the decode pool "
        "has 2 (lower max_tokens, or serve with more num_pages)")


# -- speculative lookahead -----------------------------------------------------------------

@pytest.mark.parametrize("speculative, slots", [
    (None, 0), (SpeculativeConfig(), 0), (SpeculativeConfig(None, num_speculative_tokens=5), 0),
    *((SpeculativeConfig("ngram", num_speculative_tokens=k), k + 1)
      for k in (1, 3, MAX_NUM_SPECULATIVE_TOKENS)),
    (SpeculativeConfig("mtp", num_speculative_tokens=2, mtp_head="m"), 3),
    (SpeculativeConfig("draft_target", num_speculative_tokens=4, draft_model="d"), 5),
])
def test_a_speculative_step_holds_k_plus_one_slots_past_its_tokens(speculative, slots):
    assert lookahead_slots(speculative) == slots


def test_the_speculative_maximum_is_the_lookahead_of_the_largest_k_allowed():
    largest = SpeculativeConfig("ngram", num_speculative_tokens=MAX_NUM_SPECULATIVE_TOKENS)
    largest.validate()
    assert MAX_LOOKAHEAD_SLOTS == lookahead_slots(largest) == MAX_NUM_SPECULATIVE_TOKENS + 1
    with pytest.raises(ValueError, match=f"allowed: 1..{MAX_NUM_SPECULATIVE_TOKENS}$"):
        SpeculativeConfig("ngram", num_speculative_tokens=MAX_NUM_SPECULATIVE_TOKENS + 1).validate()


def test_the_limits_load_without_torch():
    """The text models check requests with them, and run without torch."""
    code = ("import sys, tandem.backends.engine.request_limits; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
