"""Adaptive speculation's decision (backends/speculative/adaptive.py), from given costs
and acceptances: no timing anywhere."""
from __future__ import annotations

import pytest

from tandem.backends.speculative import adaptive
from tandem.backends.speculative.adaptive import (Acceptance, CostTable, SpecController, choose_k,
                                                  expected_tokens)

# the profile (fp32, batch 1): decode 13.5 ms, a k=3 verify 23.6 ms
PROFILE = {0: 13.5, 1: 17.0, 2: 20.3, 3: 23.6}


@pytest.mark.parametrize("rates, k, want", [
    ([], 0, 1.0), ([1.0, 1.0, 1.0], 3, 4.0), ([0.0, 1.0], 2, 1.0),
    ([0.5, 0.5, 0.5], 3, 1.875), ([0.9, 0.5], 1, 1.9)])
def test_expected_tokens_is_the_accepted_prefix_plus_one(rates, k, want):
    assert expected_tokens(rates, k) == pytest.approx(want)


def test_high_acceptance_and_cheap_verify_speculate_the_most():
    c = choose_k(PROFILE, [[0.95, 0.9, 0.85]], 3)
    assert (c.k, c.ks, c.reason) == (3, (3,), "speculate")


def test_low_acceptance_decodes_plainly():
    c = choose_k(PROFILE, [[0.2, 0.1, 0.1]], 3)
    assert (c.k, c.ks, c.reason) == (0, (0,), "plain_faster")


def test_the_last_positions_are_dropped_when_they_are_rarely_accepted():
    # first draft usually right, the later ones rarely: one draft pays, three do not
    c = choose_k(PROFILE, [[0.9, 0.05, 0.05]], 3)
    assert c.k == 1


def test_the_choice_maximises_tokens_per_ms_over_the_batch():
    costs = {0: 10.0, 1: 14.0, 2: 17.0}
    acc = [[0.8, 0.6], [0.7, 0.7], None]
    c = choose_k(costs, acc, 2)
    rates = {k: sum(1 if a is None else expected_tokens(a, k) for a in acc) / costs[k]
             for k in costs}
    assert c.k == max(rates, key=rates.get)
    assert c.ks == (c.k, c.k, 0)     # the sequence without a draft is verified alone


def test_ties_go_to_the_smaller_k():
    assert choose_k({0: 10.0, 1: 20.0}, [[1.0]], 1).k == 0     # 1 token / 10 ms = 2 / 20 ms


def test_no_sequence_with_a_draft_is_a_plain_step():
    c = choose_k(PROFILE, [None, None], 3)
    assert (c.k, c.ks, c.reason) == (0, (0, 0), "no_draft")


def test_an_acceptance_update_touches_only_the_positions_tried():
    a = Acceptance([0.5, 0.5, 0.5])
    a.update(3, 1)     # first accepted, second rejected, third never tried
    assert a.rates[0] > 0.5 and a.rates[1] < 0.5 and a.rates[2] == 0.5
    a.update(2, 2)     # both drafted positions accepted
    assert a.rates[1] > a.rates[2] == 0.5


def test_costs_average_estimate_and_seed():
    t = CostTable(alpha=0.5)
    t.seed(("step", 1, 0), 8.0)
    t.observe(("step", 1, 0), 10.0)             # a measurement replaces the seed
    t.observe(("step", 1, 0), 12.0)
    assert t.estimate(("step", 1, 0)) == 11.0
    t.seed(("step", 1, 0), 1.0)                 # a seed never overrides a measurement
    assert t.estimate(("step", 1, 0)) == 11.0
    t.observe(("step", 1, 3), 19.0)             # 4 tokens
    assert t.estimate(("step", 1, 1)) == pytest.approx(13.666, abs=1e-3)   # 2 tokens: between
    assert t.estimate(("step", 2, 1)) == pytest.approx(19.0)                # 4 tokens: measured
    assert t.estimate(("step", 8, 0)) == pytest.approx(11 + 8 / 3 * 7)      # extrapolated
    assert t.estimate(("propose", 1, 1, "model")) is None                   # another kind


def controller(max_k=3, step=None, propose=0.0):
    c = SpecController(max_k)
    for k, ms in (step or PROFILE).items():
        c.costs.seed(("step", 1, k), ms)
        if k:
            c.costs.seed(("propose", 1, k, "model"), propose * k)
    return c


def test_pinned_k_drafts_the_most_for_every_sequence_that_can():
    c = SpecController(3, adaptive=False)
    choice = c.plan(1, ["a", "b"], ["mtp", None])
    assert (choice.k, choice.ks, choice.reason) == (3, (3, 0), "fixed")
    for _ in range(20):                     # no backoff when pinned
        c.observe_accepted("a", "mtp", 3, 0)
    assert c.plan(1, ["a"], ["mtp"]).ks == (3,)


def test_a_collapsed_sequence_backs_off_then_probes_with_a_longer_backoff_each_time():
    """In a batch that speculates for another sequence's sake, a sequence whose drafts
    are all rejected stops drafting, probes after the backoff, and backs off twice as
    long when the probe fails too."""
    c = controller()
    plan = lambda: c.plan(1, ["a", "good"], ["draft_target", "draft_target"])
    lengths = []
    for _ in range(3):
        while not c.backing_off("a", "draft_target"):   # a drafts, every one rejected
            assert plan().ks[0] > 0
            c.observe_accepted("a", "draft_target", 3, 0)
            c.observe_accepted("good", "draft_target", 3, 3)
        skipped = 0
        while plan().ks[0] == 0:
            skipped += 1
        lengths.append(skipped)                          # then a probe drafted again
    assert lengths == [adaptive.BACKOFF_MIN, 2 * adaptive.BACKOFF_MIN, 4 * adaptive.BACKOFF_MIN]


def test_a_backing_off_sequence_does_not_stop_the_others():
    c = controller()
    for _ in range(adaptive.MIN_ROUNDS + 5):
        c.observe_accepted("bad", "mtp", 3, 0)
        c.observe_accepted("good", "mtp", 3, 3)
    choice = c.plan(1, ["bad", "good"], ["mtp", "mtp"])
    assert choice.k == 3 and choice.ks == (0, 3)


def test_an_accepted_probe_resets_the_backoff():
    c = controller()
    plan = lambda: c.plan(1, ["a", "good"], ["ngram", "ngram"])
    while not c.backing_off("a", "ngram"):
        plan()
        c.observe_accepted("a", "ngram", 3, 0)
        c.observe_accepted("good", "ngram", 3, 3)
    while plan().ks[0] == 0:
        pass
    c.observe_accepted("a", "ngram", 3, 2)     # the probe's drafts accepted: speculating again
    assert not c.backing_off("a", "ngram") and plan().ks[0] > 0
    assert c.seqs["a"]["ngram"].next_backoff == adaptive.BACKOFF_MIN


def test_new_sequences_start_from_their_methods_acceptance():
    c = controller()
    for _ in range(200):
        c.observe_accepted("old", "ngram", 3, 0)
    c.forget("old")
    assert "old" not in c.seqs
    assert c.plan(1, ["new"], ["ngram"]).reason == "plain_faster"   # the method's prior is low


def test_unmeasured_costs_are_explored_and_every_k_is_revisited():
    c = SpecController(2)
    first = c.plan(1, ["a"], ["mtp"])
    assert first.reason == "explore"          # nothing measured to decide from
    c.observe_cost(("step", 1, first.k), 10.0)
    for k in range(3):
        c.observe_cost(("step", 1, k), 10.0 + k)
    reasons = [c.plan(1, ["a"], ["mtp"]).reason for _ in range(adaptive.EXPLORE_EVERY)]
    assert reasons.count("explore") == 1


def test_the_proposers_cost_counts():
    acc = [[adaptive.PRIOR_ACCEPTANCE] * 3]     # what a new sequence starts from
    cheap = controller(propose=0.0).plan(1, ["a"], ["draft_target"])
    dear = controller(propose=6.0).plan(1, ["a"], ["draft_target"])
    assert cheap.k > 0 and dear.k < cheap.k
    ngram = controller(propose=6.0).plan(1, ["a"], ["ngram"])   # ngram has no model cost seeded
    assert ngram.k == cheap.k
    assert choose_k({k: PROFILE[k] for k in range(4)}, acc, 3).k == cheap.k


def test_a_model_proposer_that_does_not_pay_sits_out_while_ngram_drafts():
    """--spec auto's batch: the ngram sequences draft cheaply and are accepted; the MTP
    head's drafting costs more than its acceptance buys. Only the ngram rows draft."""
    c = controller(propose=4.0)                  # the model's drafting: 4 ms per token
    for _ in range(10):
        c.observe_accepted("lookup", "ngram", 3, 3)
        c.observe_accepted("head", "mtp", 3, 0)
    choice = c.plan(1, ["lookup", "head"], ["ngram", "mtp"])
    assert choice.reason == "speculate" and choice.ks == (choice.k, 0) and choice.k > 0


def test_a_marginal_gain_is_not_worth_speculating():
    costs = {0: 10.0, 1: 10.0}
    assert choose_k(costs, [[0.05]], 1).k == 1                       # 5% more tokens per ms
    assert choose_k(costs, [[0.05]], 1, margin=adaptive.SPECULATE_MARGIN).k == 0
