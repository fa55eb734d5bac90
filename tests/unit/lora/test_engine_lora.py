"""LoRA through the engine: greedy tokens with an adapter equal HF transformers with
PEFT's merged weights (fp32) for attention-only, MLP-only and all-7 target sets, with
speculation off and on (the proposer drafts from the base, the target verifies with the
adapter); a batch mixing adapters and the base gives each row what it gets alone; the
prefix cache never shares pages between adapters; slots are taken and given back."""
from __future__ import annotations

import pytest
import torch

from tandem.backends import LLM, SamplingParams, SpeculativeConfig
from tandem.backends.engine.model_runner import ForwardBatch
from tandem.backends.engine.prefix_caching import model_root, prompt_page_keys
from tandem.backends.engine.step_runner import StepRunner
from tandem.backends.lora import LoRARequest

from ..async_outputs import OutputCollector
from ..tiny_checkpoints import make_checkpoint
from .adapters import TARGET_SETS, make_adapter, merged_greedy

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def prompts(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (m,), generator=g).tolist() for m in (5, 21, 12, 9)[:n]]


@pytest.fixture(scope="module")
def adapters(target_dir, checkpoint_root):
    """One adapter per target set: different ranks, alpha and rsLoRA, so scaling shows."""
    shapes = {"attention": dict(r=4, alpha=8), "mlp": dict(r=8, alpha=4),
              "all": dict(r=2, alpha=6, use_rslora=True)}
    return {name: LoRARequest(name, i, str(make_adapter(
                target_dir, checkpoint_root / f"lora_{name}", TARGET_SETS[name], seed=i, **shapes[name])))
            for i, name in enumerate(TARGET_SETS, 1)}


@pytest.fixture(scope="module")
def specs(target_dir, random_mtp_dir):
    return {None: None,
            "draft_target_self": SpeculativeConfig("draft_target", 3, draft_model=str(target_dir)),
            "mtp": SpeculativeConfig("mtp", 3, mtp_head=str(random_mtp_dir))}


def reference(target_dir, lora: LoRARequest | None, ps):
    return [list(t) for t in merged_greedy(str(target_dir), lora and lora.path,
                                           tuple(map(tuple, ps)), NEW_TOKENS)]


@pytest.mark.parametrize("spec", [None, "draft_target_self", "mtp"])
@pytest.mark.parametrize("targets", list(TARGET_SETS))
def test_greedy_with_an_adapter_matches_peft_merged(target_dir, adapters, specs, spec, targets):
    llm = LLM(target_dir, dtype="float32", max_loras=2, max_lora_rank=8, speculative=specs[spec])
    ps, lora = prompts(), adapters[targets]
    out = llm.generate(ps, GREEDY, lora=lora)
    assert [o.token_ids for o in out] == reference(target_dir, lora, ps)
    assert [o.token_ids for o in out] != reference(target_dir, None, ps)   # the adapter matters
    if spec is not None:
        assert llm.engine.spec_metrics.num_draft_tokens > 0     # the target verified drafts


@pytest.mark.parametrize("arch", ["llama3_rope_tied", "qwen2", "qwen3"])
def test_every_architecture_applies_all_seven_modules(arch, checkpoint_root):
    """Tied embeddings, q/k/v biases (qwen2), q/k norms and a head_dim apart from
    hidden / heads (qwen3): the adapter lands on the right slices of the fused layers."""
    base = make_checkpoint(arch, checkpoint_root)
    lora = LoRARequest("all7", 1, str(make_adapter(base, checkpoint_root / f"lora_all_{arch}", r=3, alpha=5)))
    ps = prompts()
    out = LLM(base, dtype="float32", max_loras=1, max_lora_rank=4).generate(ps, GREEDY, lora=lora)
    assert [o.token_ids for o in out] == reference(base, lora, ps)


def test_an_adapter_of_some_layers_leaves_the_others_alone(target_dir, checkpoint_root):
    lora = LoRARequest("layer1", 1, str(make_adapter(target_dir, checkpoint_root / "lora_layer1",
                                                    layers_to_transform=[1], r=4, seed=9)))
    ps = prompts()
    out = LLM(target_dir, dtype="float32", max_loras=1, max_lora_rank=4).generate(ps, GREEDY, lora=lora)
    assert [o.token_ids for o in out] == reference(target_dir, lora, ps)


@pytest.mark.parametrize("spec", [None, "mtp"])
def test_a_mixed_batch_gives_each_row_what_it_gets_alone(target_dir, adapters, specs, spec):
    ps = prompts(4, seed=7)
    loras = [adapters["attention"], None, adapters["all"], adapters["mlp"]] * 2
    ps = ps + ps[::-1]
    llm = LLM(target_dir, dtype="float32", max_loras=3, max_lora_rank=8, speculative=specs[spec],
              enable_prefix_caching=False)
    together = [o.token_ids for o in llm.generate(ps, GREEDY, lora=loras)]
    alone = [llm.generate([p], GREEDY, lora=lr)[0].token_ids for p, lr in zip(ps, loras)]
    assert together == alone
    assert together == [reference(target_dir, lr, [p])[0] for p, lr in zip(ps, loras)]


def test_the_prefix_cache_keys_pages_by_adapter(target_dir, adapters):
    llm = LLM(target_dir, dtype="float32", max_loras=2, max_lora_rank=8, page_size=8)
    engine, prompt = llm.engine, prompts(2, seed=3)[1]          # 21 tokens: 2 full pages

    def run(lora):
        seq = engine.make_sequence(prompt, GREEDY, lora=lora)
        engine.add(seq)
        while engine.has_unfinished():
            engine.step()
        return seq

    first = {name: run(adapters.get(name)) for name in (None, "attention", "mlp")}
    # what kv_transfer asks the decode engine's cache for: the same keys
    root = model_root(engine.config)
    for name, seq in first.items():
        want = prompt_page_keys(prompt, 8, root, None, lora=adapters.get(name))
        assert seq.page_keys[:len(want)] == want
    assert all(s.num_cached_tokens == 0 for s in first.values())   # nobody reuses another's KV
    keys = [set(s.page_keys) for s in first.values()]
    assert all(len(k) >= 2 for k in keys)
    assert not (keys[0] & keys[1]) and not (keys[0] & keys[2]) and not (keys[1] & keys[2])
    again = {name: run(adapters.get(name)) for name in (None, "attention", "mlp")}
    for name, seq in again.items():   # each reuses its own pages, and its tokens stay the same
        assert seq.num_cached_tokens == 16
        assert seq.output_ids == first[name].output_ids


def test_slots_are_held_while_running_and_errors_leave_others_running(target_dir, adapters, checkpoint_root):
    llm = LLM(target_dir, dtype="float32", max_loras=1, max_lora_rank=8)
    engine = llm.engine
    rid = engine.add_request(prompts(1)[0], GREEDY, lora=adapters["attention"])
    slot = engine.seqs[rid].lora_slot
    assert slot == 1 and engine.lora_pool.slots[slot].refs == 1
    with pytest.raises(ValueError, match="all 1 adapter slots are held"):
        engine.add_request(prompts(1)[0], GREEDY, lora=adapters["mlp"])
    with pytest.raises(ValueError, match="rank 8 is above max_lora_rank=4"):
        LLM(target_dir, dtype="float32", max_loras=1, max_lora_rank=4).generate(
            prompts(1), GREEDY, lora=adapters["mlp"])
    assert list(engine.seqs) == [rid]            # the refused requests left nothing behind
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert engine.lora_pool.slots[slot].refs == 0 and engine.lora_pool.idle
    # the slot is free to be evicted now: the other adapter loads into it
    assert llm.generate(prompts(1), GREEDY, lora=adapters["mlp"])[0].token_ids == \
        reference(target_dir, adapters["mlp"], prompts(1))[0]


def test_an_engine_without_lora_refuses_an_adapter(target_dir, adapters):
    llm = LLM(target_dir, dtype="float32")
    with pytest.raises(ValueError, match="LoRA is off"):
        llm.generate(prompts(1), GREEDY, lora=adapters["attention"])
    with pytest.raises(TypeError, match="LoRARequest"):
        llm.generate(prompts(1), GREEDY, lora="attention")


def test_graphed_or_compiled_decode_is_bypassed_when_a_row_uses_an_adapter():
    class Graphs:       # stands in for GraphedDecode / CompiledDecode
        def forward(self, batch):
            return "graphed"

        def forward_verify(self, batch, k):
            return "graphed"

    class Runner:
        def forward(self, batch):
            return None, "eager"

    step = StepRunner(Runner(), None, None, 4)
    step.decode_graphs = Graphs()
    base = ForwardBatch([[1]], [3], [[0]], [0])
    adapted = ForwardBatch([[1], [2]], [3, 4], [[0], [1]], [0, 2])
    assert step.forward(base) == step.verify_forward(base, 1) == "graphed"
    assert step.forward(adapted) == step.verify_forward(adapted, 1) == "eager"


@pytest.mark.parametrize("spec", [None, "mtp"])
def test_the_disaggregated_path_prefills_and_decodes_under_the_adapter(target_dir, adapters, specs, spec):
    """Prefill engine -> KV copied page by page -> decode engine's add_prefilled: the
    adapter's greedy tokens, and the same prefix-cache keys on both sides."""
    from tandem.backends.engine import EngineConfig, LLMEngine
    from tandem.backends.engine.prefill_engine import PrefillEngine
    config = dict(dtype="float32", page_size=4, max_loras=2, max_lora_rank=8, speculative=specs[spec])
    prefill = PrefillEngine.from_config(EngineConfig(str(target_dir), **config))
    decoder = LLMEngine(EngineConfig(str(target_dir), **config))
    ps, loras = prompts(3, seed=5), [adapters["all"], None, adapters["mlp"]]
    for i, (p, lr) in enumerate(zip(ps, loras)):
        prefill.add(f"p{i}", p[:-1], last_token=p[-1], lora=lr)
    done = {}
    while prefill.has_work():
        done.update((r.request_id, r) for r in prefill.step())
    seqs = []
    for i, (p, lr) in enumerate(zip(ps, loras)):
        r = done[f"p{i}"]
        pages = decoder.allocator.alloc(len(r.pages))
        decoder.pool.kv[:, pages] = prefill.pool.kv[:, r.pages]
        if spec is not None:
            decoder.proposer.runner.pool.kv[:, pages] = prefill.proposer.pool.kv[:, r.pages]
        seq = decoder.make_sequence(p, GREEDY, lora=lr)
        decoder.add_prefilled(seq, pages)
        seqs.append((seq, list(r.page_keys)))
        prefill.release(f"p{i}")
    assert not prefill.lora_pool.slots[1].refs and not prefill.lora_pool.slots[2].refs
    while decoder.has_unfinished():
        decoder.step()
    for (seq, keys), p, lr in zip(seqs, ps, loras):
        assert seq.output_ids == reference(target_dir, lr, [p])[0]
        n = min(len(keys), len(seq.page_keys))
        assert n and seq.page_keys[:n] == keys[:n]


def test_the_async_engine_fails_only_the_request_a_full_pool_refuses(target_dir, adapters):
    from tandem.backends.engine.async_engine import AsyncEngine
    eng = AsyncEngine(str(target_dir), dtype="float32", max_loras=1, max_lora_rank=8)
    on_output = OutputCollector()
    outs = on_output.outs
    p = prompts(1)[0]
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = eng.submit(p, long, on_output, lora=adapters["attention"])
    refused = eng.submit(p, GREEDY, on_output, lora=adapters["mlp"])
    eng.start()
    try:
        assert on_output.wait(2, timeout=60)
    finally:
        eng.shutdown()
    assert eng.lora.loaded == {"attention": 0} and eng.lora.requests == {"attention": 1}
    assert outs[refused][-1].finish_reason == "error"
    assert "all 1 adapter slots are held" in outs[refused][-1].error
    tokens = [t for o in outs[first] for t in o.new_token_ids]
    assert outs[first][-1].finish_reason == "length" and len(tokens) == 40


def test_a_name_reloaded_from_other_files_never_reads_the_old_kv(target_dir, adapters):
    llm = LLM(target_dir, dtype="float32", max_loras=1, max_lora_rank=8, page_size=8)
    engine, prompt = llm.engine, prompts(2, seed=3)[1]
    first, second = (LoRARequest("x", 1, adapters[n].path) for n in ("attention", "mlp"))
    engine.load_lora(first)
    assert llm.generate([prompt], GREEDY, lora=first)[0].token_ids == reference(target_dir, adapters["attention"], [prompt])[0]
    assert engine.unload_lora("x") and not engine.unload_lora("x")
    engine.load_lora(second)
    seq = engine.make_sequence(prompt, GREEDY, lora=second)
    engine.add(seq)
    while engine.has_unfinished():
        engine.step()
    assert seq.num_cached_tokens == 0
    assert seq.output_ids == reference(target_dir, adapters["mlp"], [prompt])[0]
    with pytest.raises(ValueError, match="LoRA is off"):
        LLM(target_dir, dtype="float32").engine.load_lora(first)
