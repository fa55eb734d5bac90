"""Engine behaviour: scheduling under page pressure, stops, seeds, bad input."""
import pytest
import torch

from tandem.backends import LLM, SamplingParams

from ..tiny_checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def llama_dir(checkpoint_root):
    return make_checkpoint("llama_gqa_untied", checkpoint_root)


def random_prompts(n, vocab=384, lo=3, hi=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


def test_more_requests_than_pages_all_complete_identically(llama_dir):
    """Queueing and preemption under page pressure lose nothing and change nothing."""
    prompts = random_prompts(12)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = LLM(llama_dir, page_size=4).generate(prompts, params)
    tight = LLM(llama_dir, page_size=4, num_pages=20, max_num_batched_tokens=64)
    outs = tight.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in outs)
    assert tight.engine.allocator.num_free == 20


def test_preemption_happens_and_is_lossless(llama_dir):
    prompts = random_prompts(6, lo=30, hi=31)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    llm = LLM(llama_dir, page_size=4, num_pages=16 * 2)   # room for two full sequences
    seqs = [llm.engine.make_sequence(p, params) for p in prompts]
    for s in seqs:
        llm.engine.add(s)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert sum(s.num_preemptions for s in seqs) > 0
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages
    ref = LLM(llama_dir, page_size=4).generate(prompts, params)
    assert [s.output_ids for s in seqs] == [r.token_ids for r in ref]


def test_chunked_prefill_matches_unchunked(llama_dir):
    prompts = random_prompts(4, lo=50, hi=90)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    a = LLM(llama_dir, max_num_batched_tokens=512).generate(prompts, params)
    b = LLM(llama_dir, max_num_batched_tokens=8).generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


@pytest.mark.parametrize("arch", ["llama_gqa_untied", "qwen3"])   # head_dim 16 and 32
def test_bf16_serves_chunked_prefill_and_every_batch_size(arch, checkpoint_root):
    """In bf16 the CPU kernels run where the machine has them (the small-M linear on
    AVX512-BF16, the paged attention with a compiler): chunks that need no logits
    (0 rows), batches of 1 to 9 rows, prompts longer than the token budget."""
    prompts = random_prompts(9, lo=20, hi=60, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(make_checkpoint(arch, checkpoint_root), dtype="bfloat16", max_num_batched_tokens=16)
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in outs)
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages


def test_seeded_sampling_reproduces(llama_dir):
    prompts = random_prompts(3)
    p = SamplingParams(max_tokens=20, temperature=1.0, top_k=50, top_p=0.9, seed=123)
    llm = LLM(llama_dir)
    first = llm.generate(prompts, p)
    alone = llm.generate(prompts[1], p)[0]
    assert first[1].token_ids == alone.token_ids
    other = llm.generate(prompts[1], SamplingParams(max_tokens=20, temperature=1.0, seed=124))[0]
    assert other.token_ids != alone.token_ids


def test_stop_token_and_max_tokens(llama_dir):
    llm = LLM(llama_dir)
    prompt = random_prompts(1)[0]
    free_run = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 10
    stop_at = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_at)
    out = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                              stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free_run.token_ids[:first + 1]


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=2.0), "top_p"), (dict(top_k=-1), "top_k")])
def test_bad_params_leave_engine_unchanged(llama_dir, kwargs, field):
    llm = LLM(llama_dir)
    free = llm.engine.allocator.num_free
    with pytest.raises(ValueError, match=field):
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(**kwargs))
    assert llm.engine.allocator.num_free == free and not llm.engine.has_unfinished()


def test_bad_prompts_are_refused_clearly(llama_dir):
    llm = LLM(llama_dir)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(3, 300))], SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=255))
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[5, 100000]], SamplingParams())
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text without a tokenizer", SamplingParams())
    assert not llm.engine.has_unfinished()


def test_request_larger_than_the_pool_is_refused(llama_dir):
    llm = LLM(llama_dir, page_size=4, num_pages=4)
    with pytest.raises(ValueError, match="num_pages"):
        llm.generate([list(range(3, 13))], SamplingParams(max_tokens=10))


def test_unknown_or_corrupt_model_dir(tmp_path, llama_dir):
    with pytest.raises(FileNotFoundError, match="model_dir"):
        LLM(tmp_path / "nope")
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "config.json").write_text((llama_dir / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="corrupt"):
        LLM(bad)
