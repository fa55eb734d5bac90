"""Prompt lookup's incremental n-gram index answers as the full scan does, at every
length of a growing sequence."""
from hypothesis import given, settings, strategies as st

from tandem.backends.engine.proposers.ngram import NgramIndex, propose_ngram


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=40), k=st.integers(1, 5),
       max_n=st.integers(1, 4), min_n=st.integers(1, 4), step=st.integers(1, 5))
def test_the_index_proposes_what_the_scan_does_as_tokens_arrive(tokens, k, max_n, min_n, step):
    min_n, max_n = min(min_n, max_n), max(min_n, max_n)
    index = NgramIndex(max_n, min_n)
    for length in list(range(1, len(tokens) + 1, step)) + [len(tokens)]:   # several at a time too
        got = index.propose(tokens.__getitem__, length, k)
        assert got == propose_ngram(tokens[:length], k, max_n, min_n), length
