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


def test_a_spike_moves_the_average_as_twice_the_average_would():
    """A lazy proposer's catch-up on a long plain stretch lands in one step: clipped, it
    cannot keep a cost dear for long; a lasting rise is still followed."""
    t = CostTable(alpha=0.5)
    t.observe(("propose", 8, 2, "model"), 2.0)
    t.observe(("propose", 8, 2, "model"), 30.0)        # 15x: counts as 2x
    assert t.estimate(("propose", 8, 2, "model")) == pytest.approx(3.0)
    for _ in range(8):
        t.observe(("propose", 8, 2, "model"), 10.0)    # the machine got slower
    assert t.estimate(("propose", 8, 2, "model")) == pytest.approx(10.0, rel=0.01)


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


# a verify step as cheap as a plain one: a sequence keeps drafting while its acceptance falls
FLAT = {k: 13.5 for k in range(4)}


def test_a_collapsed_sequence_backs_off_then_probes_with_a_longer_backoff_each_time():
    """A sequence whose drafts are all rejected stops drafting, probes after the
    backoff, and backs off twice as long when the probe fails too."""
    c = controller(step=FLAT)
    plan = lambda: c.plan(1, ["a"], ["draft_target"])
    lengths = []
    for _ in range(3):
        while not c.backing_off("a", "draft_target"):   # a drafts, every one rejected
            choice = plan()
            assert choice.ks[0] > 0
            c.observe_accepted("a", "draft_target", choice.ks[0], 0)
        skipped = 0
        while (choice := plan()).ks[0] == 0:
            assert choice.reason == "backoff"
            skipped += 1
        lengths.append(skipped)                          # then a probe drafted again
        c.observe_accepted("a", "draft_target", choice.ks[0], 0)
    assert lengths == [adaptive.BACKOFF_MIN, 2 * adaptive.BACKOFF_MIN, 4 * adaptive.BACKOFF_MIN]


def test_a_row_that_would_be_slowed_stops_the_batch_speculating():
    """Every row of a verify step pays its price: a sequence backing off (or drafting
    too poorly) would get its one token later than from a plain step, so the batch
    decodes plainly although the other sequence would gain."""
    c = controller()
    for _ in range(adaptive.MIN_ROUNDS + 5):
        c.observe_accepted("bad", "mtp", 3, 0)
        c.observe_accepted("good", "mtp", 3, 3)
    assert c.backing_off("bad", "mtp")
    choice = c.plan(1, ["bad", "good"], ["mtp", "mtp"])
    assert (choice.k, choice.reason) == (0, "slows_row")
    c.forget("bad")
    assert c.plan(1, ["good"], ["mtp"]).k == 3       # alone, it speculates


def test_the_closed_batch_case_every_row_gains_or_none_drafts():
    """The batch-16 case the engine measured: verifying one draft costs 1.6x a plain
    step. Most rows accept their first draft 90% of the time, a few 40%: the batch
    would gain tokens per ms, but the few would advance slower than plainly, and a run
    lasts as long as its slowest request."""
    costs = {0: 12.0, 1: 19.0, 2: 30.0, 3: 42.0}
    acc = [[0.9, 0.8, 0.7]] * 13 + [[0.4, 0.3, 0.2]] * 3
    assert choose_k(costs, acc, 3).k == 1                       # tokens per ms alone
    assert choose_k(costs, acc, 3, row_floor=1.0).reason == "slows_row"
    assert choose_k(costs, [[0.9, 0.8, 0.7]] * 16, 3, row_floor=1.0).k == 1


def test_an_accepted_probe_resets_the_backoff():
    c = controller(step=FLAT)
    plan = lambda: c.plan(1, ["a"], ["ngram"])
    while not c.backing_off("a", "ngram"):
        plan()
        c.observe_accepted("a", "ngram", 3, 0)
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


def test_a_model_proposer_that_does_not_pay_keeps_the_batch_plain():
    """--spec auto's batch: the ngram sequence drafts cheaply and is accepted; the MTP
    head's drafts are all rejected. Letting the ngram row alone draft would make the
    other pay a verify step for its one token: the batch decodes plainly (slows_row);
    with that row gone it speculates by ngram."""
    c = controller(propose=4.0)                  # the model's drafting: 4 ms per token
    for _ in range(10):
        c.observe_accepted("lookup", "ngram", 3, 3)
        c.observe_accepted("head", "mtp", 3, 0)
    assert c.plan(1, ["lookup", "head"], ["ngram", "mtp"]).reason == "slows_row"
    choice = c.plan(1, ["lookup"], ["ngram"])
    assert choice.reason == "speculate" and choice.k > 0


def test_auto_lets_the_model_draft_for_every_row_when_that_pays():
    """--spec auto's batch at high load: the prompt lookup matches one row but its drafts
    are mostly rejected, the head drafts well for the other. By method, the lookup row
    pays the verify step for little (slows_row); with the head drafting for both rows
    every one gains, and the plan says the head drafts for the lookup row too."""
    c = controller(step={0: 10.0, 1: 16.0, 2: 19.0, 3: 22.0}, propose=0.5)
    for _ in range(10):
        for accepted in (0, 0, 1):
            c.observe_accepted("lookup", "ngram", 3, accepted)
        c.observe_accepted("head", "mtp", 3, 3)
    assert not c.backing_off("lookup", "ngram")
    rids, methods = ["lookup", "head"], ["ngram", "mtp"]
    assert c.plan(1, rids, methods).reason == "slows_row"
    choice = c.plan(1, rids, methods, model="mtp")
    assert choice.reason == "speculate" and choice.ks == (choice.k, choice.k) and choice.k > 0
    assert choice.methods == ("mtp", "mtp")
    # where the lookup's drafts are accepted, each row drafts by its own method
    for _ in range(10):
        c.observe_accepted("lookup", "ngram", 3, 3)
    assert c.plan(1, rids, methods, model="mtp").methods is None


def test_auto_drafts_each_matched_row_by_whichever_proposer_drafts_it_better():
    """Two rows the prompt lookup matches: for one its drafts have collapsed (it backs
    off), for the other they are accepted; the head drafts well only for the first. By
    method the backing-off row rides along with one token (slows_row); with the head for
    every row the second row loses its lookup's long drafts; each row by its better
    proposer speculates, and the plan says who drafts which."""
    c = controller(step={0: 10.0, 1: 16.0, 2: 19.0, 3: 22.0}, propose=0.5)
    for _ in range(10):
        c.observe_accepted("collapsed", "ngram", 3, 0)
        c.observe_accepted("collapsed", "mtp", 3, 3)
        c.observe_accepted("repeating", "ngram", 3, 3)
        c.observe_accepted("repeating", "mtp", 3, 0)
    assert c.backing_off("collapsed", "ngram") and not c.backing_off("repeating", "ngram")
    rids, methods = ["collapsed", "repeating"], ["ngram", "ngram"]
    assert c.plan(1, rids, methods).reason == "slows_row"
    choice = c.plan(1, rids, methods, model="mtp")
    assert choice.reason == "speculate" and choice.k == 3 and choice.ks == (3, 3)
    assert choice.methods == ("mtp", "ngram")


def test_a_plain_choice_keeps_the_methods_it_was_asked():
    c = controller(step={0: 10.0, 1: 30.0, 2: 40.0, 3: 50.0})
    choice = c.plan(1, ["a", "b"], ["ngram", None], model="mtp")
    assert choice.k == 0 and choice.methods is None


def test_exploring_measures_a_neighbour_of_the_best_k():
    """Every EXPLORE_EVERY-th choice re-measures a k next to the chosen one, never a far
    one (three drafts each at a big batch cost several plain steps)."""
    c = controller(step={0: 10.0, 1: 40.0, 2: 60.0, 3: 80.0})   # k = 0 is best
    explored = [ch.k for ch in (c.plan(1, ["a"], ["mtp"]) for _ in range(3 * adaptive.EXPLORE_EVERY))
                if ch.reason == "explore"]
    assert explored == [1, 1, 1]


def test_a_marginal_gain_is_not_worth_speculating():
    costs = {0: 10.0, 1: 10.0}
    assert choose_k(costs, [[0.05]], 1).k == 1                       # 5% more tokens per ms
    assert choose_k(costs, [[0.05]], 1, margin=adaptive.SPECULATE_MARGIN).k == 0


def test_where_plain_keeps_winning_most_steps_skip_the_planning():
    """After PLAIN_STREAK plain choices at a bucket, only every REPLAN_EVERY-th step
    plans (looks up every sequence's proposal); a choice to speculate ends the streak."""
    c = controller(step={0: 10.0, 1: 40.0, 2: 60.0, 3: 80.0})
    planned = 0
    for _ in range(adaptive.PLAIN_STREAK + 4 * adaptive.REPLAN_EVERY):
        fast = c.plain_without_planning(1)
        if fast is None:
            planned += 1
            assert c.plan(1, ["a"], ["mtp"]).k in (0, 1)      # plain (or exploring k=1)
        else:
            assert (fast.k, fast.reason) == (0, "plain_faster")
    assert planned == adaptive.PLAIN_STREAK + 4
    assert c.plain_without_planning(2) is None                 # another bucket plans
    for k in range(4):
        c.observe_cost(("step", 1, k), 10.0)                   # speculating became free
    while c.plain_without_planning(1) is not None:
        pass
    assert c.plan(1, ["a"], ["mtp"]).k == 3
    assert c.plain_without_planning(1) is None
    assert SpecController(3, adaptive=False).plain_without_planning(1) is None


def test_the_work_between_steps_makes_fewer_longer_steps_pay():
    """A server streams every step's outputs: time paid per step whatever k was. The
    same drafts that do not pay in a bare loop pay where each step carries that cost."""
    c = controller(step={0: 10.0, 1: 16.0, 2: 20.0, 3: 24.0})
    for i in range(20):            # half the first drafts accepted
        c.observe_accepted("a", "mtp", 3, i % 2)
    assert c.plan(1, ["a"], ["mtp"]).k == 0
    c.observe_cost(("gap", 1, 0), 20.0)
    assert c.step_ms(1, 0, "model") == 30.0 and c.step_ms(1, 2, "model") == 40.0
    assert c.plan(1, ["a"], ["mtp"]).k > 0
