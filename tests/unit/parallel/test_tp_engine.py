"""The engine at tensor_parallel_size 2 and 4 (rank processes, gloo): greedy tokens equal
one rank's and HF transformers' (fp32) on every tiny architecture, with each speculation
method; a rank that dies fails the requests in flight with a message naming it, without
hanging, and every later request too (the group is broken, never reused); the ranks end
with the engine."""
from __future__ import annotations

import pytest
import torch

from tandem.backends import LLM, SamplingParams, SpeculativeConfig
from tandem.backends.parallel.group import RankFailed

from ..lora.adapters import merged_greedy

NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def prompts(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (m,), generator=g).tolist() for m in (5, 21, 12, 9)[:n]]


def tokens(llm: LLM, ps, params=GREEDY) -> list[list[int]]:
    outs = llm.generate(ps, params)
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def hf_greedy(model_dir, ps) -> list[list[int]]:
    return [list(t) for t in merged_greedy(str(model_dir), None, tuple(map(tuple, ps)), NEW_TOKENS)]


def test_two_ranks_match_one_rank_and_hf(tiny_checkpoint, engines):
    ps = prompts()
    llm = engines(tiny_checkpoint, tensor_parallel_size=2)
    assert llm.engine.model.rank_config.num_attention_heads == llm.engine.model.config.num_attention_heads // 2
    assert llm.engine.pool.num_kv_heads == 1      # 2 KV heads split over 2 ranks
    got = tokens(llm, ps)
    assert got == hf_greedy(tiny_checkpoint, ps)
    assert got == tokens(llm, ps), "a second pass, from every rank's cached prefix pages, gives the same"
    assert llm.engine.prefix.allocator.stats.hit_pages > 0


def test_the_trained_demo_target_on_two_ranks_matches_hf(engines):
    from tandem.client.paths import DEMO_CHECKPOINTS
    target, ps = DEMO_CHECKPOINTS / "target", prompts()
    assert tokens(engines(target, tensor_parallel_size=2), ps) == hf_greedy(target, ps)


def test_four_ranks_replicate_kv_heads(target_dir, engines):
    ps = prompts(4)
    llm = engines(target_dir, tensor_parallel_size=4)
    assert llm.engine.pool.num_kv_heads == 1 and len(llm.engine.tp_group.procs) == 3
    assert tokens(llm, ps) == hf_greedy(target_dir, ps)


@pytest.mark.parametrize("method", ["draft_target", "mtp", "ngram"])
def test_speculation_stays_lossless_on_two_ranks(target_dir, other_draft_dir, random_mtp_dir, engines, method):
    """The proposer runs whole on the leader; the target verifies across the ranks."""
    spec = {"draft_target": SpeculativeConfig("draft_target", 3, draft_model=str(other_draft_dir)),
            "mtp": SpeculativeConfig("mtp", 3, mtp_head=str(random_mtp_dir)),
            "ngram": SpeculativeConfig("ngram", 3)}[method]
    ps = [p * 2 for p in prompts()]      # repeats, so prompt lookup drafts too
    llm = engines(target_dir, tensor_parallel_size=2, speculative=spec)
    assert tokens(llm, ps) == hf_greedy(target_dir, ps)
    assert llm.engine.spec_metrics.num_draft_tokens > 0


def test_a_dead_rank_stops_the_engine_by_name(target_dir, engines):
    """A rank that died between steps: the next step raises, naming it (a server's
    engine thread stops on it and the model is restarted), and so does every later one."""
    llm = engines(target_dir, tensor_parallel_size=2, tp_timeout_s=20)
    ps = prompts(2)
    assert tokens(llm, ps) == hf_greedy(target_dir, ps)
    rank1 = llm.engine.tp_group.procs[0]
    rank1.kill()
    rank1.join(10)
    with pytest.raises(RankFailed, match=r"rank 1 \(pid \d+\) exited with code -9"):
        llm.generate(ps, GREEDY)
    with pytest.raises(RankFailed, match="broken"):
        llm.engine.step()


def test_a_rank_that_dies_inside_a_step_stops_the_engine_without_a_hang(target_dir, engines, monkeypatch):
    """Killed right after it was sent a step: the leader's next all-reduce finds it gone
    (or gives up after tp_timeout_s), and that step raises, naming it."""
    llm = engines(target_dir, tensor_parallel_size=2, tp_timeout_s=20)
    group = llm.engine.tp_group
    send, sent = group.send, []

    def send_then_kill(message):
        send(message)
        sent.append(message)
        if len(sent) == 3:
            group.procs[0].kill()

    monkeypatch.setattr(group, "send", send_then_kill)
    ps = prompts(2)
    for p in ps:
        llm.engine.add(llm.engine.make_sequence(p, GREEDY))
    with pytest.raises(RankFailed, match="rank 1"):   # the step it died in stops the engine
        while True:
            llm.engine.step()
    assert len(sent) == 3
    with pytest.raises(RankFailed, match="broken"):
        llm.engine.step()


def test_the_ranks_end_with_the_engine(target_dir):
    llm = LLM(target_dir, dtype="float32", tensor_parallel_size=2)
    procs = list(llm.engine.tp_group.procs)
    llm.engine.close()
    assert all(not p.is_alive() for p in procs)


@pytest.mark.parametrize("kw,message", [
    (dict(tensor_parallel_size=3), "num_attention_heads 4"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size=0"),
])
def test_a_split_the_engine_cannot_run_is_refused_before_any_rank_starts(target_dir, kw, message):
    with pytest.raises(ValueError, match=message):
        LLM(target_dir, dtype="float32", **kw)
