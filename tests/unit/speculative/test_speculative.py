"""Speculative decoding in the engine: lossless, measured, leak-free."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn

from tandem.backends import LLM, SamplingParams, SpeculativeConfig
from tandem.backends.models.llama import forward_dense
from tandem.backends.engine.proposers import DraftModelProposer, MTPProposer, NgramProposer, Proposer

from ..hf_reference import NEW_TOKENS, hf_greedy, prompts

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


@pytest.mark.parametrize("cls", [DraftModelProposer, MTPProposer, NgramProposer])
def test_every_proposer_has_the_protocols_methods(cls):
    """The engine calls a proposer only through :class:`Proposer`'s methods, by keyword too."""
    for name in ("ready", "catch_up", "propose", "after_verify"):
        want = [p for p in inspect.signature(getattr(Proposer, name)).parameters if p != "self"]
        got = [p for p in inspect.signature(getattr(cls, name)).parameters if p != "self"]
        assert got == want, (cls.__name__, name)


def spec_llm(target_dir, method, k, draft, **kw):
    key = "draft_model" if method == "draft_target" else "mtp_head"
    return LLM(target_dir, speculative=SpeculativeConfig(method, k, **{key: str(draft)}), **kw)


def assert_no_leak(llm):
    a = llm.engine.allocator
    assert a.num_free == a.num_pages and not llm.engine.has_unfinished()


# -- losslessness -------------------------------------------------------------------

@pytest.mark.parametrize("method", ["draft_target", "mtp"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_identical_with_speculation(target_dir, other_draft_dir, random_mtp_dir,
                                                     method, k):
    draft = other_draft_dir if method == "draft_target" else random_mtp_dir
    ref = hf_greedy(str(target_dir))
    ps = prompts(384)
    llm = spec_llm(target_dir, method, k, draft)
    batched = llm.generate(ps, GREEDY)
    assert [tuple(o.token_ids) for o in batched] == list(ref)
    single = llm.generate(ps[3], GREEDY)[0]
    assert tuple(single.token_ids) == ref[3]
    assert llm.engine.spec_metrics.num_drafts > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
@pytest.mark.parametrize("page_size", [1, 3])
def test_page_boundary_spills(target_dir, kv_layout, page_size):
    ref = hf_greedy(str(target_dir))
    llm = spec_llm(target_dir, "draft_target", 3, target_dir, page_size=page_size,
                   kv_layout=kv_layout)
    outs = llm.generate(prompts(384)[:4], GREEDY)
    assert [tuple(o.token_ids) for o in outs] == list(ref[:4])
    assert_no_leak(llm)


# -- acceptance -----------------------------------------------------------------------

def test_self_speculation_accepts_nearly_everything(target_dir):
    rates = {}
    for k in (1, 3):
        llm = spec_llm(target_dir, "draft_target", k, target_dir)
        llm.generate(prompts(384), GREEDY)
        m = llm.engine.spec_metrics
        rates[k] = m.acceptance_rate
        assert m.acceptance_rate >= 0.98
        assert m.mean_acceptance_length >= 0.98 * (k + 1)
        assert len(m.per_position_acceptance) == k
    assert rates[3] >= rates[1] - 0.01


def test_wrong_draft_is_rejected_and_counted(target_dir, other_draft_dir):
    llm = spec_llm(target_dir, "draft_target", 3, other_draft_dir)
    llm.generate(prompts(384), GREEDY)
    m = llm.engine.spec_metrics
    assert m.num_draft_tokens == 3 * m.num_drafts
    assert m.acceptance_rate < 0.5
    assert m.mean_acceptance_length == 1 + m.num_accepted_tokens / m.num_drafts


class OracleHead(nn.Module):
    """An 'MTP head' that returns the target's own next hidden state: row i (token
    t_{i+1} at rope position i) recomputes the target over t_0..t_{i+1}. With
    ``off_by_one`` it reads the token buffer one slot late (t_i for row i)."""

    def __init__(self, target, first_token: int, off_by_one: bool = False):
        super().__init__()
        self.config = dataclasses.replace(target.config, num_hidden_layers=1)
        self.rank_config = self.config      # what a runner plans attention with, as MTPHead
        self.buffer = {0: first_token}
        self.off_by_one = off_by_one
        self.anchor = nn.Parameter(torch.zeros(1))   # device/dtype for the runner

    def forward(self, target, next_ids, hidden, positions, attn):
        ids = next_ids.roll(1) if self.off_by_one else next_ids
        out = []
        for tok, pos in zip(ids.tolist(), positions.tolist()):
            self.buffer[pos + 1] = tok
            ctx = torch.tensor([[self.buffer[i] for i in range(pos + 2)]])
            out.append(forward_dense(target, ctx)[0, -1])
        return torch.stack(out)


@pytest.mark.parametrize("off_by_one", [False, True])
def test_mtp_oracle_acceptance(target_dir, random_mtp_dir, off_by_one):
    llm = spec_llm(target_dir, "mtp", 3, random_mtp_dir)
    engine = llm.engine
    prompt = prompts(384)[3]
    oracle = OracleHead(engine.model, prompt[0], off_by_one)
    engine.spec.proposer = MTPProposer(oracle, engine.model, engine.proposer.runner.pool)
    out = llm.generate(prompt, GREEDY)[0]
    assert tuple(out.token_ids) == hf_greedy(str(target_dir))[3]
    rate = engine.spec_metrics.acceptance_rate
    if off_by_one:
        assert rate < 0.3
    else:
        assert rate == 1.0


# -- KV invariants --------------------------------------------------------------------

def test_cached_length_after_accepting_j_of_k(target_dir, other_draft_dir):
    llm = spec_llm(target_dir, "draft_target", 3, other_draft_dir)
    e = llm.engine
    rid = e.add_request(prompts(384)[2], GREEDY)
    seq = e.seqs[rid]
    e.step()                                   # prefill
    seen = 0
    while e.has_unfinished():
        before, n_out = seq.num_computed, len(seq.output_ids)
        accepted_before = e.spec_metrics.num_accepted_tokens
        e.step()
        j = e.spec_metrics.num_accepted_tokens - accepted_before
        if seq.is_finished:
            break
        assert seq.num_computed == before + 1 + j
        assert len(seq.output_ids) == n_out + 1 + j
        seen += 1
    assert seen > 5


def test_garbage_in_rejected_slots_changes_nothing(target_dir, other_draft_dir):
    ps = prompts(384)[:3]
    clean = spec_llm(target_dir, "draft_target", 3, other_draft_dir).generate(ps, GREEDY)
    llm = spec_llm(target_dir, "draft_target", 3, other_draft_dir, page_size=4)
    e = llm.engine
    for p in ps:
        e.add_request(p, GREEDY)
    got = {}
    g = torch.Generator().manual_seed(0)
    while e.has_unfinished():
        for out in e.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        for seq in e.seqs.values():   # poison every slot past the valid lengths
            for pool, valid in ((e.pool, seq.num_computed),
                                (e.proposer.runner.pool, seq.draft.computed)):
                for slot in range(valid, len(seq.pages) * 4):
                    page, off = seq.pages[slot // 4], slot % 4
                    pool.kv[:, page, :, :, off] = torch.randn(
                        pool.kv[:, page, :, :, off].shape, generator=g) * 100
    assert [got[f"req-{i}"] for i in range(3)] == [o.token_ids for o in clean]


# -- sampling, seeds, stops -----------------------------------------------------------

def test_seeded_sampling_reproduces_with_speculation(target_dir):
    p = SamplingParams(max_tokens=30, temperature=0.9, top_k=40, top_p=0.95, seed=11)
    ps = prompts(384)[:3]
    a = spec_llm(target_dir, "draft_target", 3, target_dir).generate(ps, p)
    b = spec_llm(target_dir, "draft_target", 3, target_dir).generate(ps[1], p)[0]
    assert a[1].token_ids == b.token_ids and len(b.token_ids) == 30


def test_seeded_sampling_is_the_same_with_speculation_off_or_at_any_k(target_dir):
    """A seeded request's tokens depend on its seed alone (seeded_draws.py): speculation
    off, k 1 or 4, alone or in a batch (the reference soak compares seeded requests so)."""
    p = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=5)
    ps = prompts(384)[:3]
    plain = [o.token_ids for o in LLM(target_dir).generate(ps, p)]
    for k in (1, 4):
        spec = spec_llm(target_dir, "draft_target", k, target_dir)
        assert [o.token_ids for o in spec.generate(ps, p)] == plain
        assert spec.generate(ps[2], p)[0].token_ids == plain[2]
    assert len({tuple(t) for t in plain}) == 3


def test_stops_inside_accepted_drafts_truncate_exactly(target_dir):
    ps = prompts(384)[:4]
    free = LLM(target_dir).generate(ps, GREEDY)
    for max_tokens in (5, 6, 7):
        p = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        outs = spec_llm(target_dir, "draft_target", 3, target_dir).generate(ps, p)
        assert [o.token_ids for o in outs] == [f.token_ids[:max_tokens] for f in free]
    stop_tok = free[0].token_ids[9]
    first = free[0].token_ids.index(stop_tok)
    p = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop_token_ids=[stop_tok])
    llm = spec_llm(target_dir, "draft_target", 3, target_dir)
    out = llm.generate(ps[0], p)[0]
    assert out.finish_reason == "stop" and out.token_ids == free[0].token_ids[:first + 1]
    assert_no_leak(llm)


def test_bad_speculative_config_is_refused(target_dir, tmp_path):
    for cfg, field in [(SpeculativeConfig("medusa", 3, draft_model="x"), "method"),
                       (SpeculativeConfig("draft_target", 0, draft_model="x"), "num_speculative_tokens"),
                       (SpeculativeConfig("draft_target", 3), "draft_model"),
                       (SpeculativeConfig("mtp", 3), "mtp_head")]:
        with pytest.raises(ValueError, match=field):
            LLM(target_dir, speculative=cfg)
    with pytest.raises(FileNotFoundError, match="mtp_head"):
        LLM(target_dir, speculative=SpeculativeConfig("mtp", 2, mtp_head=str(tmp_path)))
