"""Adaptive speculation in the engine: whatever k the controller picks per step and per
sequence (0 included, mid-sequence), and whichever method drafts, greedy output is the
plain engine's, the proposer's KV follows every committed token, and the choice is
counted. The controller's decisions are scripted here; its maths is tested with given
costs in test_adaptive.py."""
from __future__ import annotations

import itertools

import pytest
import torch

from tandem.backends import LLM, SamplingParams, SpeculativeConfig
from tandem.backends.engine.proposers import AutoProposer, MTPProposer
from tandem.backends.speculative.adaptive import Choice, SpecController

from ..hf_reference import prompts
from .test_speculative import OracleHead

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
# k per step; each sequence drafts it on two steps of three (the third: none)
SCHEDULE = [3, 0, 1, 2, 0, 0, 3, 2, 1, 3]


def all_prompts():
    repetitive = [[11, 12, 13, 14, 15] * 4, [7, 8, 9] * 6 + [7]]   # ngram matches at once
    return prompts(384)[:4] + repetitive


class Scripted(SpecController):
    """The controller with its choice replaced by a schedule of k, staggered over the
    sequences (each drafts on two steps of three); under --spec auto every fourth step
    the model drafts for every other sequence the prompt lookup matches, so matched rows
    of one step draft by either proposer. What it learns is kept."""
    __slots__ = ("schedule", "steps", "handed_over")

    def plan(self, bucket, rids, methods, model=None):
        n = next(self.steps)
        k = self.schedule[n % len(self.schedule)]
        ks = tuple(0 if m is None or (i + n) % 3 == 0 else k for i, m in enumerate(methods))
        by_model = None if model is None or n % 4 != 1 else \
            tuple(model if m == "ngram" and i % 2 == n % 8 // 4 else m for i, m in enumerate(methods))
        if by_model is not None and max(ks):
            self.handed_over += sum(m != b and k > 0 for m, b, k in zip(methods, by_model, ks))
        return Choice(max(ks), ks, "speculate" if max(ks) else "plain_faster", methods=by_model)


def script(engine, schedule=SCHEDULE):
    scripted = Scripted(engine.controller.max_k, adaptive=True)
    scripted.schedule, scripted.steps, scripted.handed_over = schedule, itertools.count(), 0
    engine.spec.controller = scripted
    return scripted


def make(target_dir, method, proposer_dir=None, **kw):
    paths = {"draft_target": dict(draft_model=str(proposer_dir)),
             "mtp": dict(mtp_head=str(proposer_dir)), "ngram": {},
             "auto": dict(mtp_head=str(proposer_dir))}[method]
    return LLM(target_dir, page_size=4, speculative=SpeculativeConfig(
        method, 3, adaptive=True, **paths, **kw))


def assert_no_leak(llm):
    a = llm.engine.allocator
    assert a.num_free == a.num_pages and not llm.engine.has_unfinished()


@pytest.mark.parametrize("method", ["draft_target", "mtp", "ngram", "auto"])
def test_greedy_output_is_plain_whatever_k_each_step_drafts(target_dir, other_draft_dir,
                                                            random_mtp_dir, method):
    ps = all_prompts()
    plain = [o.token_ids for o in LLM(target_dir, page_size=4).generate(ps, GREEDY)]
    proposer = other_draft_dir if method == "draft_target" else random_mtp_dir
    llm = make(target_dir, method, proposer)
    script(llm.engine)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == plain
    assert [o.token_ids for o in llm.generate(ps[1:3], GREEDY)] == plain[1:3]
    m = llm.engine.spec_metrics
    assert m.num_drafts > 0
    ks = {k for k, _ in m.steps_by_choice}
    assert {0, 1, 2, 3} <= ks, m.steps_by_choice       # every k was taken, plain steps too
    assert_no_leak(llm)


def test_a_self_draft_stays_in_sync_through_plain_steps(target_dir):
    """The draft is the target: every draft is accepted only if the draft's KV holds
    every committed token, through the plain steps and the steps it sat out."""
    llm = make(target_dir, "draft_target", target_dir)
    script(llm.engine)
    llm.generate(all_prompts(), GREEDY)
    m = llm.engine.spec_metrics
    assert m.num_drafts > 20 and m.acceptance_rate >= 0.98


def test_an_mtp_head_stays_in_sync_through_plain_and_ngram_steps(target_dir, random_mtp_dir):
    """An oracle head (the target itself) drafts right only from complete head state:
    every MTP draft accepted, though ngram drafted and plain steps ran between them."""
    llm = make(target_dir, "auto", random_mtp_dir)
    engine = llm.engine
    prompt = [11, 12, 13, 14, 15] * 2 + prompts(384)[3]
    oracle = OracleHead(engine.model, prompt[0])
    assert isinstance(engine.proposer, AutoProposer)
    engine.proposer.model = MTPProposer(oracle, engine.model, engine.proposer.runner.pool)
    script(engine)
    plain = LLM(target_dir, page_size=4).generate(prompt, GREEDY)[0]
    assert llm.generate(prompt, GREEDY)[0].token_ids == plain.token_ids
    rounds, drafted, accepted = engine.spec_metrics.by_method["mtp"]
    assert rounds > 3 and accepted == drafted     # ngram's drafts may be rejected; the head's never
    assert "ngram" in engine.spec_metrics.by_method


def test_auto_drafts_by_ngram_where_the_prompt_matches_and_by_the_model_elsewhere(
        target_dir, random_mtp_dir):
    llm = make(target_dir, "auto", random_mtp_dir)
    scripted = script(llm.engine, [3])
    ps = all_prompts()
    plain = [o.token_ids for o in LLM(target_dir, page_size=4).generate(ps, GREEDY)]
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == plain
    by = llm.engine.spec_metrics.by_method
    assert by["ngram"][0] > 0 and by["mtp"][0] > 0, by
    assert scripted.handed_over > 0      # rows the prompt matched, drafted by the head


def test_pinned_k_keeps_every_step_at_k(target_dir, other_draft_dir):
    llm = LLM(target_dir, speculative=SpeculativeConfig("draft_target", 3, draft_model=str(other_draft_dir)))
    llm.generate(prompts(384)[:3], GREEDY)
    m = llm.engine.spec_metrics
    assert set(m.steps_by_choice) == {(3, "fixed")} and m.num_draft_tokens == 3 * m.num_drafts


def test_measured_adaptive_speculation_is_lossless_and_counts_its_choices(target_dir, other_draft_dir):
    """The real controller on this machine's timings: whatever it picks, the tokens are
    plain's, and each step's choice is counted with its reason."""
    ps = all_prompts()
    plain = [o.token_ids for o in LLM(target_dir, page_size=4).generate(ps, GREEDY)]
    llm = make(target_dir, "draft_target", other_draft_dir)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == plain
    m = llm.engine.spec_metrics
    assert sum(m.steps_by_choice.values()) > 0
    assert {r for _, r in m.steps_by_choice} <= {"speculate", "plain_faster", "no_draft", "backoff",
                                                  "explore"}
    assert llm.engine.controller.seqs == {}           # finished sequences are forgotten
    assert_no_leak(llm)


class GivenCosts(SpecController):
    """The controller on costs the test gives: nothing measured replaces them."""
    __slots__ = ()

    def observe_cost(self, key, ms):
        pass


def test_a_wrong_draft_backs_off_on_given_costs(target_dir, other_draft_dir):
    """Costs pinned to 'a verify step costs what a decode step does': a draft that is
    nearly always wrong still stops drafting, by backoff, and probes again later."""
    llm = make(target_dir, "draft_target", other_draft_dir)
    c = llm.engine.spec.controller = GivenCosts(3)
    for k in range(4):
        c.costs.seed(("step", 1, k), 10.0 + 0.01 * k)
    llm.generate(prompts(384)[:1], SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))
    steps = llm.engine.spec_metrics.steps_by_choice
    reasons = {r for _, r in steps}
    assert "backoff" in reasons and "speculate" in reasons, steps


def test_sampled_requests_through_every_k_reproduce_with_their_seed(target_dir, random_mtp_dir):
    """Sampling (not greedy) through the scripted k's, sequences drafting different
    numbers in one step: a seeded request's tokens depend only on its seed."""
    params = SamplingParams(max_tokens=30, temperature=0.9, top_k=40, seed=7, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = make(target_dir, "auto", random_mtp_dir)
        script(llm.engine)
        runs.append([o.token_ids for o in llm.generate(all_prompts(), params)])
    assert runs[0] == runs[1] and all(len(t) == 30 for t in runs[0])


@pytest.mark.parametrize("method", ["mtp", "draft_target"])
def test_a_lazy_proposer_catches_up_to_the_kv_an_eager_one_writes(target_dir, random_mtp_dir,
                                                                   other_draft_dir, method):
    """Adaptive speculation runs the proposer only when it drafts: through plain steps it
    lags (the MTP head keeping the target's rows; at most MAX_LAG tokens) and catches up
    on all of it at once. Its KV then equals that of a proposer that ran after every step."""
    from tandem.backends.engine.proposers.base import MAX_LAG
    engines = []
    for lazy in (True, False):
        llm = make(target_dir, method, random_mtp_dir if method == "mtp" else other_draft_dir)
        e = llm.engine
        e.proposer.lazy = lazy
        script(e, [0])                                  # plain steps only
        e.add_request(prompts(384)[2], SamplingParams(max_tokens=100, temperature=0.0))
        for _ in range(40):
            e.step()
        engines.append(e)
    lazy, eager = engines
    (seq,), (ref,) = lazy.seqs.values(), eager.seqs.values()
    assert seq.output_ids == ref.output_ids
    assert 0 < ref.draft.computed - seq.draft.computed <= MAX_LAG   # it lagged, within the bound
    assert lazy.proposer.in_sync(seq) and not lazy.proposer.ready(seq)
    lazy.proposer.flush([seq])
    assert lazy.proposer.ready(seq) and seq.draft.computed == ref.draft.computed
    kv, kv_ref = lazy.proposer.runner.pool.kv, eager.proposer.runner.pool.kv
    page = lazy.config.page_size
    for slot in range(seq.draft.computed):
        a = kv[:, seq.pages[slot // page], :, :, slot % page]
        b = kv_ref[:, ref.pages[slot // page], :, :, slot % page]
        assert torch.allclose(a, b, atol=1e-5), slot
    torch.testing.assert_close(seq.draft.hidden, ref.draft.hidden, atol=1e-5, rtol=1e-5)
