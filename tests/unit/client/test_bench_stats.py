"""The benchmarks' one percentile, swept: numpy's default (linear interpolation) on
every size and quantile, its bounds, order and edge cases. The serving benchmarks'
nearest-rank percentile is gone: p99s of any two benchmarks compare."""
from __future__ import annotations

import random
import statistics

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tandem.client.bench.stats import ms, percentile

QS = [0, 1, 5, 10, 25, 33.3, 50, 66.7, 75, 90, 95, 99, 99.9, 100]
finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 10, 99, 100, 101, 1000])
@pytest.mark.parametrize("q", QS)
def test_it_is_numpys_linear_percentile(n, q):
    xs = [random.Random(n).uniform(0, 100) for _ in range(n)]
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-12)


@settings(deadline=None)   # a shared, loaded host
@given(st.lists(finite, min_size=1, max_size=60), st.floats(min_value=0, max_value=100))
def test_it_agrees_with_numpy_on_any_values(xs, q):
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-9, abs=1e-6)


@settings(deadline=None)
@given(st.lists(finite, min_size=1, max_size=60))
def test_ends_are_min_and_max_and_the_middle_is_the_median(xs):
    assert percentile(xs, 0) == min(xs) and percentile(xs, 100) == max(xs)
    assert percentile(xs, 50) == pytest.approx(statistics.median(xs), rel=1e-12, abs=1e-9)


@settings(deadline=None)
@given(st.lists(finite, min_size=1, max_size=60), st.floats(min_value=0, max_value=100),
       st.floats(min_value=0, max_value=100))
def test_it_grows_with_q_and_stays_within_the_values(xs, a, b):
    lo, hi = sorted((a, b))
    assert min(xs) <= percentile(xs, lo) <= percentile(xs, hi) + 1e-9 <= max(xs) + 2e-9


@settings(deadline=None)
@given(st.lists(finite, min_size=1, max_size=40), st.randoms())
def test_the_order_of_the_values_does_not_matter(xs, rng):
    shuffled = list(xs)
    rng.shuffle(shuffled)
    assert [percentile(shuffled, q) for q in QS] == [percentile(xs, q) for q in QS]


def test_between_two_ranks_it_interpolates():
    xs = list(range(1, 101))             # nearest rank would say 50, 99, 100
    assert (percentile(xs, 50), percentile(xs, 99), percentile(xs, 100)) == (50.5, 99.01, 100)
    assert percentile([10.0, 20.0], 25) == 12.5 and percentile([7.0], 99) == 7.0


def test_no_values_have_no_percentile_and_q_is_of_0_to_100():
    assert percentile([], 50) is None
    for q in (-1, 100.5, float("nan")):
        with pytest.raises(ValueError):
            percentile([1.0], q)


def test_milliseconds_rounded():
    assert ms(0.123456) == 123.46 and ms(0.123456, 1) == 123.5 and ms(None) is None
