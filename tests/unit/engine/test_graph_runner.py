"""Decode steps through the graph runner (padding, static buffers, scratch page), run on
the CPU with the eager stand-in for CUDA graphs: the same tokens and KV as eager steps."""
from __future__ import annotations

import pytest
import torch

from tandem.backends import LLM, SamplingParams
from tandem.backends.engine.graph_runner import EagerGraphs, GraphedDecode
from tandem.backends.engine.model_runner import ForwardBatch, ModelRunner
from tandem.backends.kv_cache import KVPagePool
from tandem.backends.models import load_model

from ..hf_reference import NEW_TOKENS, hf_greedy, prompts


class CountingGraphs(EagerGraphs):
    def __init__(self):
        self.captures, self.replays = 0, 0

    def capture(self, fn):
        self.captures += 1
        replay = super().capture(fn)

        def counted():
            self.replays += 1
            replay()
        return counted


@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
@pytest.mark.parametrize("batch_size", [1, 3, 5])
def test_graphed_decode_step_equals_the_eager_step(tiny_checkpoint, kv_layout, batch_size):
    model = load_model(tiny_checkpoint, "float32")
    cfg, page_size, num_pages = model.config, 4, 64
    pools = [KVPagePool.for_model(cfg, num_pages, page_size, torch.float32, kv_layout, "cpu")
             for _ in range(2)]
    g = torch.Generator().manual_seed(batch_size)
    lens = torch.randint(1, 20, (batch_size,), generator=g).tolist()
    page_lists, nxt = [], 0
    for n in lens:   # room for two decode tokens
        count = (n + 2 + page_size - 1) // page_size
        page_lists.append(list(range(nxt, nxt + count)))
        nxt += count
    scratch = num_pages - 1
    prefill = ForwardBatch([torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in lens],
                           [0] * batch_size, page_lists)
    for pool in pools:
        ModelRunner(model, pool).forward(prefill)
    decode = ForwardBatch([[int(t)] for t in torch.randint(3, cfg.vocab_size, (batch_size,), generator=g)],
                          lens, page_lists)
    _, eager = ModelRunner(model, pools[0]).forward(decode)
    graphs = CountingGraphs()
    runner = GraphedDecode(model, pools[1], scratch, max_num_seqs=8, max_pages_per_seq=8,
                           graphs=graphs)
    graphed = runner.forward(decode)
    torch.testing.assert_close(graphed, eager, atol=1e-5, rtol=1e-5)
    used = sorted(p for pages in page_lists for p in pages)
    torch.testing.assert_close(pools[1].kv[:, used], pools[0].kv[:, used], atol=1e-5, rtol=1e-5)
    untouched = [p for p in range(num_pages) if p not in used and p != scratch]
    assert not pools[1].kv[:, untouched].any(), "padding wrote outside the scratch page"
    # the next step of the same size replays the captured one
    assert runner.forward(ForwardBatch(decode.token_ids, [n + 1 for n in lens], page_lists)) is not None
    assert (graphs.captures, graphs.replays) == (1, 2)


def test_batches_a_graph_cannot_hold_run_eagerly(tiny_checkpoint):
    model = load_model(tiny_checkpoint, "float32")
    pool = KVPagePool.for_model(model.config, 16, 4, torch.float32, "HND", "cpu")
    runner = GraphedDecode(model, pool, 15, max_num_seqs=2, max_pages_per_seq=2, graphs=EagerGraphs())
    assert runner.forward(ForwardBatch([[5]] * 3, [0, 0, 0], [[0], [1], [2]])) is None    # > 2 rows
    assert runner.forward(ForwardBatch([[5, 6]], [0], [[0]])) is None                    # 2 new tokens
    assert runner.forward(ForwardBatch([[5]], [8], [[0, 1, 2]])) is None                 # > 2 pages
    with pytest.raises(ValueError, match="fewer pages"):
        runner.forward(ForwardBatch([[5]], [4], [[0]]))                                  # no page for it


@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
def test_engine_with_graphed_decode_matches_hf(tiny_checkpoint, kv_layout):
    ref = hf_greedy(str(tiny_checkpoint))
    llm = LLM(tiny_checkpoint, dtype="float32", page_size=7, kv_layout=kv_layout, max_num_seqs=8)
    graphs = CountingGraphs()
    llm.engine.target.decode_graphs = llm.engine.target.make_decode_graphs(llm.engine.proposer, graphs)
    # prompts of different lengths finish at different steps: the batch shrinks
    params = [SamplingParams(max_tokens=NEW_TOKENS - 3 * i, temperature=0.0) for i in range(8)]
    outs = llm.generate(prompts(llm.engine.model.config.vocab_size), params)
    for i, out in enumerate(outs):
        assert tuple(out.token_ids) == ref[i][:NEW_TOKENS - 3 * i], f"prompt {i} diverged from HF"
    assert graphs.captures <= 4 < graphs.replays       # sizes 8, 4, 2, 1 at most
    a = llm.engine.allocator
    assert a.num_free == a.num_pages - 1               # all but the scratch page


def test_draft_decode_steps_replay_too(tiny_checkpoint):
    """With graphs the draft's k - 1 decode steps per speculative step replay as well."""
    from tandem.backends import SpeculativeConfig
    ref = hf_greedy(str(tiny_checkpoint))
    spec = SpeculativeConfig("draft_target", 3, draft_model=str(tiny_checkpoint))
    llm = LLM(tiny_checkpoint, dtype="float32", speculative=spec, max_num_seqs=8)
    graphs = CountingGraphs()
    llm.engine.target.decode_graphs = llm.engine.target.make_decode_graphs(llm.engine.proposer, graphs)
    outs = llm.generate(prompts(llm.engine.model.config.vocab_size), SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0))
    assert [tuple(o.token_ids) for o in outs] == list(ref)
    assert llm.engine.spec_metrics.acceptance_rate >= 0.98    # the draft is the target
    assert llm.engine.proposer.fast_decode is not None and graphs.replays > 0
