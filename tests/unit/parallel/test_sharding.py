"""The tensor-parallel split (backends/parallel/sharding.py) as maths: each rank's share of
a model, run in threads that sum their partial outputs through a barrier, gives the
whole model's hidden states (fp32) on every tiny architecture, at 2 ranks (KV heads
split) and 4 (KV heads replicated); and sizes that do not divide are refused by name."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tandem.backends.models import load_model
from tandem.backends.models.config import ModelConfig
from tandem.backends.models.llama import forward_dense
from tandem.backends.parallel.sharding import check_tp, kv_heads, q_heads, rank_config, shard_model_


class ThreadAllReduce:
    """``tp`` threads' all-reduce: each adds its partial in, all wait, all read the sum."""

    def __init__(self, tp: int):
        self.tp, self.barrier, self.lock = tp, threading.Barrier(tp), threading.Lock()
        self.total = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.total = x.clone() if self.total is None else self.total + x
        self.barrier.wait()
        out = self.total.clone()
        if self.barrier.wait() == 0:
            self.total = None
        self.barrier.wait()
        return out


@pytest.mark.parametrize("tp", [2, 4])
def test_the_ranks_shares_sum_to_the_whole_model(tiny_checkpoint, tp):
    whole = load_model(tiny_checkpoint, dtype="float32")
    ids = torch.randint(3, whole.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = forward_dense(whole, ids)
    reduce = ThreadAllReduce(tp)
    shards = [shard_model_(load_model(tiny_checkpoint, dtype="float32"), tp, r, reduce) for r in range(tp)]
    assert shards[1].rank_config.num_attention_heads == whole.config.num_attention_heads // tp
    assert shards[1].config == whole.config, "the model's own config stays whole"

    def run(model):
        torch.set_num_threads(1)
        with torch.no_grad():
            return forward_dense(model, ids)

    with ThreadPoolExecutor(tp) as pool:
        outs = list(pool.map(run, shards))
    for out in outs:
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


def test_a_row_parallel_bias_is_added_once():
    """o_proj's bias stays on the leader and is zero elsewhere: each rank adding it would
    add it tp times."""
    import copy
    from tandem.backends.models.llama import LlamaForCausalLM
    model = LlamaForCausalLM(ModelConfig("llama", 32, 16, 32, 1, 2, 2, 8, o_bias=True)).requires_grad_(False)
    model.layers[0].self_attn.o_proj.bias.fill_(1.0)
    leader = shard_model_(copy.deepcopy(model), 2, 0, lambda x: x)
    other = shard_model_(copy.deepcopy(model), 2, 1, lambda x: x)
    assert torch.equal(leader.layers[0].self_attn.o_proj.bias, torch.ones(16))
    assert torch.equal(other.layers[0].self_attn.o_proj.bias, torch.zeros(16))


def test_heads_and_replicas():
    cfg = ModelConfig("llama", 32, 64, 96, 1, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    assert [q_heads(cfg, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [kv_heads(cfg, 2, r) for r in range(2)] == [range(0, 1), range(1, 2)]
    # 8 ranks over 2 KV heads: 4 replica sets of 2 ranks, each set holding both heads
    assert [kv_heads(cfg, 8, r).start for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert rank_config(cfg, 8).num_key_value_heads == 1


@pytest.mark.parametrize("heads,kv,tp", [(8, 2, 2), (8, 2, 4), (8, 2, 8), (8, 8, 4), (4, 1, 4), (12, 4, 2)])
def test_each_rank_reads_its_own_kv_heads_as_the_transfer_plan_places_them(heads, kv, tp):
    """Every query head computed once, on a rank holding its KV head; each rank's KV
    heads where rdma's ShardScheme (what transfers are planned with) puts them."""
    from tandem.rdma.plan import ShardScheme
    cfg = ModelConfig("llama", 32, 8 * heads, 64, 1, num_attention_heads=heads, num_key_value_heads=kv,
                      head_dim=8)
    group = heads // kv
    scheme = ShardScheme(tp, replica_sets=max(1, tp // kv))
    seen = []
    for r in range(tp):
        assert {h // group for h in q_heads(cfg, tp, r)} <= set(kv_heads(cfg, tp, r))
        assert (kv_heads(cfg, tp, r).start, kv_heads(cfg, tp, r).stop) == scheme.head_range(r, kv)
        seen += q_heads(cfg, tp, r)
    assert sorted(seen) == list(range(heads))


@pytest.mark.parametrize("tp,field", [(3, "num_attention_heads 8"), (16, "num_attention_heads 8"),
                                      (0, "allowed: an integer >= 1")])
def test_sizes_that_do_not_divide_are_refused_by_name(tp, field):
    cfg = ModelConfig("llama", 32, 64, 96, 1, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=field):
        check_tp(cfg, tp)


def test_an_mlp_width_that_does_not_divide_is_named():
    cfg = ModelConfig("llama", 32, 64, 90, 1, num_attention_heads=4, num_key_value_heads=4, head_dim=16)
    with pytest.raises(ValueError, match="intermediate_size 90"):
        check_tp(cfg, 4)
