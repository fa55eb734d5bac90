"""Incremental detokenization and stop strings."""
import pytest

from tandem.backends import LLM, SamplingParams
from tandem.backends.engine.detokenizer import IncrementalDetokenizer
from tandem.backends.models.tokenizer import load_tokenizer

from ..tiny_checkpoints import make_checkpoint_with_tokenizer


@pytest.fixture(scope="module")
def model_dir(checkpoint_root):
    return make_checkpoint_with_tokenizer(checkpoint_root)


@pytest.mark.parametrize("text", ["def fib(n):\n    return n", "naïve café — ünïcödé ✓ 🐍 snake"])
def test_streamed_pieces_join_to_the_decoded_text(model_dir, text):
    tok = load_tokenizer(model_dir)
    ids = tok.encode(text).ids
    d = IncrementalDetokenizer(tok, [], [])
    pieces = []
    for t in ids:
        d.add(t)
        pieces.append(d.take(final=False))
    pieces.append(d.take(final=True))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stop_string_is_never_streamed_in_part(model_dir):
    tok = load_tokenizer(model_dir)
    ids = tok.encode("alpha beta STOP gamma").ids
    d = IncrementalDetokenizer(tok, [], ["STOP"])
    streamed = ""
    for t in ids:
        d.add(t)
        streamed += d.take(final=False)
        if d.stopped:
            break
    streamed += d.take(final=True)
    assert d.stopped and streamed == "alpha beta "


def test_engine_truncates_at_stop_string(model_dir):
    llm = LLM(model_dir)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = llm.generate("def fib(n):", params)[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    first = full.text.index(stop)
    out = llm.generate("def fib(n):", SamplingParams(max_tokens=40, temperature=0,
                                                      ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == full.text[:first]
    streamed = "".join(o.new_text for o in llm.stream("def fib(n):", SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])))
    assert streamed == out.text
