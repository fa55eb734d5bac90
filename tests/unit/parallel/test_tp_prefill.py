"""The prefill engine at tensor_parallel_size 2: every rank's KV pool lives in shared
memory the leader maps (the KV messenger's process reads all of them); put together by
head range they hold one rank's KV; when the messenger is told a layer is done, every
rank has written that layer; a dead rank stops the engine by name; the ranks and their
pool files end with it."""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading

import pytest
import torch

from tandem.backends.engine import EngineConfig
from tandem.backends.engine.prefill_engine import PrefillEngine, PrefillHooks
from tandem.backends.parallel.group import RankFailed

PROMPTS = [list(range(3, 30)), list(range(40, 51)), list(range(60, 97))]


def prefill(engine: PrefillEngine, prompts) -> dict:
    for i, p in enumerate(prompts):
        engine.add(f"r{i}", p)
    while engine.has_work():
        engine.step()
    return {i: engine.finished[f"r{i}"] for i in range(len(prompts))}


def whole_kv(engine: PrefillEngine, pages) -> torch.Tensor:
    """Every rank's share of ``pages`` side by side by KV head (HND: dim 3)."""
    return torch.cat([p.kv[:, pages] for p in engine.rank_pools], dim=3)


def tpkv_files() -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith("tandem-tpkv-")]


@pytest.fixture
def engines(target_dir):
    made = []

    def make(tp: int, hooks=None, max_num_batched_tokens=16) -> PrefillEngine:
        engine = PrefillEngine.from_config(EngineConfig(str(target_dir), dtype="float32", page_size=4, num_pages=48,
                                                        max_num_batched_tokens=max_num_batched_tokens,
                                                        tensor_parallel_size=tp), hooks)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def test_two_ranks_hold_one_ranks_kv_in_memory_the_leader_maps(engines):
    before = tpkv_files()
    one, two = engines(1), engines(2)
    assert len(two.rank_pools) == 2 and two.rank_pools[1].num_kv_heads == one.pool.num_kv_heads // 2
    assert tpkv_files() == before, "the pool files are unlinked once every rank mapped its own"
    a, b = prefill(one, PROMPTS), prefill(two, PROMPTS)
    for i in a:
        torch.testing.assert_close(whole_kv(two, b[i].pages), one.pool.kv[:, a[i].pages], atol=1e-5, rtol=0)
        torch.testing.assert_close(b[i].hidden, a[i].hidden, atol=1e-4, rtol=0)


class Snapshots(PrefillHooks):
    """At each layer's done signal, a copy of that layer of every rank's pool."""

    def __init__(self):
        self.engine, self.seen = None, []

    def before_forward(self, chunks, model="target"):
        pages = list(chunks[0][0].pages)

        def layer_done(layer):
            self.seen.append((layer, pages, [p.kv[layer, pages].clone() for p in self.engine.rank_pools]))
        return layer_done


def test_a_layer_is_done_only_once_every_rank_wrote_it(engines):
    """The leader's attention writes its KV before the layer's all-reduces, another
    rank's may still be on its way: a messenger told of the layer at that point would
    send the other rank's pages unwritten. Rank 1 is held stopped as each step starts
    (it lags for a moment), and what each signal saw equals the final KV (each page is
    written once: the chunks here fill whole pages)."""
    hooks = Snapshots()
    engine = hooks.engine = engines(2, hooks, max_num_batched_tokens=8)
    rank = engine.tp_group.procs[0].pid
    engine.add("r0", list(range(3, 67)))    # 64 tokens: 8 chunks of 8, 2 pages each
    while engine.has_work():
        os.kill(rank, signal.SIGSTOP)
        threading.Timer(0.2, os.kill, (rank, signal.SIGCONT)).start()
        engine.step()
    layers = engine.model.config.num_hidden_layers
    assert [layer for layer, _, _ in hooks.seen] == list(range(layers)) * 8
    final = [p.kv.clone() for p in engine.rank_pools]
    for signal_no, (layer, pages, shares) in enumerate(hooks.seen):
        step = signal_no // layers
        chunk = pages[2 * step:2 * step + 2]   # the pages this step wrote
        for r, share in enumerate(shares):
            idx = [pages.index(p) for p in chunk]
            assert torch.equal(share[idx], final[r][layer, chunk]), (layer, r)


def test_a_dead_rank_stops_the_prefill_by_name(engines):
    engine = engines(2)
    engine.tp_group.procs[0].kill()
    engine.tp_group.procs[0].join(10)
    engine.add("r0", PROMPTS[0])
    with pytest.raises(RankFailed, match="rank 1"):
        engine.step()


def test_the_ranks_end_with_the_engine(target_dir):
    engine = PrefillEngine.from_config(EngineConfig(str(target_dir), dtype="float32", page_size=4, num_pages=16,
                                                    tensor_parallel_size=2))
    (proc,) = engine.tp_group.procs
    engine.close()
    assert not proc.is_alive() and tpkv_files() == []


def test_a_prefill_that_fails_to_build_leaves_no_rank_and_no_file(target_dir):
    """The ranks start first (they load while the leader does); when the leader's build
    fails after them (here: an MTP head made for another model), they are stopped and
    their pool files removed."""
    from tandem.backends.speculative import SpeculativeConfig
    wrong_head = SpeculativeConfig("mtp", 2, mtp_head="checkpoints/demo/mtp")
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(ValueError, match="mtp_head"):
        PrefillEngine.from_config(EngineConfig(str(target_dir), dtype="float32", page_size=4, num_pages=16,
                                               tensor_parallel_size=2, speculative=wrong_head))
    assert set(os.listdir("/dev/shm")) == before
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("tandem-tp-rank")]
