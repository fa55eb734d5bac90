"""What a request may cost is bounded before the work starts (issue 12 j): stop words
by count and length, token prompts by the context before conversion, text prompts
by bytes before tokenizing."""
import numpy as np
import pytest

from tandem.backends.models.tokenizer import load_tokenizer, max_token_bytes
from tandem.backends.triton.generate_request import (MAX_STOP_WORD_CHARS, MAX_STOP_WORDS, RequestError,
                                                     check_text_length, parse_generate_request,
                                                     parse_token_request)


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
