"""LoRA adapters with tensor parallelism: each rank holds its share of every adapter (A and
B cut as their projections are), so greedy tokens at 2 ranks, and at 4 with replicated KV
heads, equal HF transformers with PEFT's merged weights (fp32), in a batch mixing
adapters and the base, with the fused CPU kernel and with the segmented matmuls, and
with MTP speculation; the ranks hold whatever the leader's slots hold as they are evicted,
reused and reloaded from other files, from the weights the leader read; a prefill engine at 2 ranks writes one rank's KV
under the adapter."""
from __future__ import annotations

import shutil

import pytest
import torch

from tandem.backends import SpeculativeConfig
from tandem.backends.engine import EngineConfig
from tandem.backends.engine.prefill_engine import PrefillEngine
from tandem.backends.lora import LoRARequest
from tandem.backends.lora.adapter import module_shapes
from tandem.backends.lora.pool import LoRAPool
from tandem.backends.models.config import ModelConfig
from tandem.backends.parallel.sharding import projection_slices

from ..lora.adapters import TARGET_SETS, make_adapter, merged_greedy
from .test_tp_engine import GREEDY, NEW_TOKENS, prompts
from .test_tp_prefill import PROMPTS, whole_kv


def reference(target_dir, lora: LoRARequest | None, ps) -> list[list[int]]:
    return [list(t) for t in merged_greedy(str(target_dir), lora and lora.path, tuple(map(tuple, ps)), NEW_TOKENS)]


@pytest.fixture(scope="module")
def adapters(target_dir, checkpoint_root):
    shapes = {"attention": dict(r=4, alpha=8), "mlp": dict(r=8, alpha=4), "all": dict(r=2, alpha=6, use_rslora=True)}
    return {name: LoRARequest(name, i, str(make_adapter(
                target_dir, checkpoint_root / f"tp_lora_{name}", TARGET_SETS[name], seed=10 + i, **shapes[name])))
            for i, name in enumerate(TARGET_SETS, 1)}


def test_a_ranks_share_of_an_adapter_is_its_projections_share():
    cfg = ModelConfig("llama", 32, 16, 24, 1, num_attention_heads=4, num_key_value_heads=2, head_dim=4)
    whole = module_shapes(cfg)
    for tp in (2, 4):
        shares = [LoRAPool(cfg, 1, 2, slices=projection_slices(cfg, tp, r)).shapes for r in range(tp)]
        for m, (fan_in, fan_out) in whole.items():
            if m in ("o_proj", "down_proj"):     # row-parallel: the inputs are split
                assert sum(s[m][0] for s in shares) == fan_in and all(s[m][1] == fan_out for s in shares)
            elif m in ("k_proj", "v_proj") and tp > cfg.num_key_value_heads:   # replicated heads
                assert all(s[m] == (fan_in, fan_out // cfg.num_key_value_heads) for s in shares)
            else:
                assert all(s[m][0] == fan_in for s in shares) and sum(s[m][1] for s in shares) == fan_out


@pytest.mark.parametrize("tp,kernels", [(2, "all"), (2, "0"), (4, "all")])
def test_a_mixed_batch_on_split_ranks_matches_peft_merged(target_dir, adapters, engines, monkeypatch, tp, kernels):
    monkeypatch.setenv("TANDEM_CPU_KERNELS", kernels)     # the ranks start with it too
    ps = prompts(4, seed=7)
    loras = [adapters["attention"], None, adapters["all"], adapters["mlp"]]
    llm = engines(target_dir, tensor_parallel_size=tp, max_loras=3, max_lora_rank=8)
    got = [o.token_ids for o in llm.generate(ps, GREEDY, lora=loras)]
    assert got == [reference(target_dir, lr, [p])[0] for p, lr in zip(ps, loras)]
    assert got[1] != reference(target_dir, adapters["all"], [ps[1]])[0], "an adapter changes the tokens"


def test_speculation_with_an_adapter_on_two_ranks_stays_lossless(target_dir, random_mtp_dir, adapters, engines):
    ps = prompts(3, seed=2)
    llm = engines(target_dir, tensor_parallel_size=2, max_loras=1, max_lora_rank=8,
                  speculative=SpeculativeConfig("mtp", 3, mtp_head=str(random_mtp_dir)))
    got = [o.token_ids for o in llm.generate(ps, GREEDY, lora=adapters["all"])]
    assert got == reference(target_dir, adapters["all"], ps)
    assert llm.engine.spec_metrics.num_draft_tokens > 0


def test_the_ranks_hold_what_the_leaders_slots_hold(target_dir, adapters, engines, tmp_path):
    """One slot: each adapter evicts the last; a name unloaded and loaded from other files
    holds the new adapter on every rank; the ranks get the weights the leader read (its
    files may be gone by the step that first uses it)."""
    llm = engines(target_dir, tensor_parallel_size=2, max_loras=1, max_lora_rank=8, enable_prefix_caching=False)
    p = prompts(2, seed=3)[1:]
    for name in ("attention", "mlp", "attention"):
        assert llm.generate(p, GREEDY, lora=adapters[name])[0].token_ids == reference(target_dir, adapters[name], p)[0]
    assert llm.engine.lora_pool.evictions == 2
    renamed = [LoRARequest("x", 7, adapters[n].path) for n in ("mlp", "all")]
    for lora, name in zip(renamed, ("mlp", "all")):
        llm.engine.unload_lora("x")
        llm.engine.load_lora(lora)
        assert llm.generate(p, GREEDY, lora=lora)[0].token_ids == reference(target_dir, adapters[name], p)[0]
    gone = LoRARequest("gone", 8, str(shutil.copytree(adapters["mlp"].path, tmp_path / "gone")))
    llm.engine.load_lora(gone)
    shutil.rmtree(gone.path)
    assert llm.generate(p, GREEDY, lora=gone)[0].token_ids == reference(target_dir, adapters["mlp"], p)[0]


def test_a_prefill_on_two_ranks_writes_one_ranks_kv_under_the_adapter(target_dir, adapters):
    def engine(tp):
        return PrefillEngine.from_config(EngineConfig(
            str(target_dir), dtype="float32", page_size=4, num_pages=48, max_num_batched_tokens=16,
            tensor_parallel_size=tp, max_loras=1, max_lora_rank=8, enable_prefix_caching=False))

    def prefill_under(e: PrefillEngine, lora) -> dict:
        for i, p in enumerate(PROMPTS):
            e.add(f"r{i}", p, lora=lora)
        while e.has_work():
            e.step()
        return {i: e.finished[f"r{i}"] for i in range(len(PROMPTS))}

    made = []
    try:
        base, one, two = (made.append(engine(tp)) or made[-1] for tp in (1, 1, 2))
        c, a, b = prefill_under(base, None), prefill_under(one, adapters["all"]), prefill_under(two, adapters["all"])
        for i in a:
            torch.testing.assert_close(whole_kv(two, b[i].pages), one.pool.kv[:, a[i].pages], atol=1e-4, rtol=0)
            assert not torch.allclose(one.pool.kv[:, a[i].pages], base.pool.kv[:, c[i].pages], atol=1e-3)
    finally:
        for e in made:
            e.close()
