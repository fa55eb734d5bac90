"""The engine's target split over tensor-parallel ranks (backends/parallel): the leader's
scheduler plans every step alone and the other ranks follow its plan.

Each step the leader sends the :class:`~.model_runner.ForwardBatch` to the ranks, then
runs its own share; every rank plans attention over the same page ids in its own KV pool
(its KV heads only), and the row-parallel layers' all-reduces keep the ranks in step, so
when the leader has passed a layer, every rank has written that layer's KV (where a KV
messenger counts layers, it counts on the leader). The leader alone computes logits,
samples, and runs a draft model or MTP head (whole, on its hidden states, which the
all-reduces make complete).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Callable

import torch

from ..kv_cache import KVPagePool
from ..models import LlamaForCausalLM, load_model
from ..parallel.group import FAILED, READY, RankFailed, RankGroup, RankSpec, connect
from ..parallel.sharding import shard_model_
from .config import EngineConfig
from .kv_pool import check_pool_fits, kv_page_pool
from .model_runner import ForwardBatch, ModelRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RankWork:
    """What a rank builds: the engine's config and the pages its KV pool holds (the
    leader's count: page ids are shared); ``rank_pool(rank)``, when the leader's pool is
    external (the shared decode pool), maps that rank's share of it instead (a picklable
    callable: it travels to the rank process)."""
    config: EngineConfig
    num_pages: int
    rank_pool: Callable[[int], KVPagePool] | None = None


def start_ranks(config: EngineConfig, num_pages: int,
                rank_pool: Callable[[int], KVPagePool] | None = None) -> RankGroup:
    """Ranks 1..tp-1 started and joined (they load and cut the model meanwhile)."""
    return RankGroup(config.tensor_parallel_size, config.tp_timeout_s, RankWork(config, num_pages, rank_pool),
                     rank_main)


def shard_leader(model: LlamaForCausalLM, group: RankGroup) -> None:
    shard_model_(model, group.tp, 0, group.all_reduce)


def rank_main(spec: RankSpec, conn: Connection) -> None:
    """A rank's process: build its share, then run each step the leader sends until the
    pipe closes (the leader stopped or died) or a step fails (the group is then broken)."""
    torch.set_num_threads(spec.threads)
    work: RankWork = spec.payload
    try:
        collective = connect(spec)
        c = work.config
        model = shard_model_(load_model(c.model_dir, c.dtype, c.device), spec.tp, spec.rank,
                             collective.all_reduce)
        dtype = model.embed_tokens.weight.dtype
        if work.rank_pool is None:
            pool = kv_page_pool(c, model.rank_config, work.num_pages, dtype)
        else:
            pool = work.rank_pool(spec.rank)
            check_pool_fits(c, pool, model.rank_config, dtype)
        runner = ModelRunner(model, pool)
    except Exception as err:   # reported to the leader, which fails its start with it
        conn.send((FAILED, f"{type(err).__name__}: {err}"))
        return
    conn.send((READY, None))
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            return
        try:
            runner.forward(batch)
        except Exception as err:
            log.error("tensor-parallel rank %d: a step failed (%s); the group is broken", spec.rank, err)
            raise SystemExit(1)


class TensorParallelRunner(ModelRunner):
    """The leader's :class:`ModelRunner`: each forward is sent to the other ranks first."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPagePool, group: RankGroup):
        super().__init__(model, pool)
        self.group = group

    def forward(self, batch: ForwardBatch, on_layer_done=None):
        self.group.send(batch)
        try:
            return super().forward(batch, on_layer_done)
        except RankFailed as err:
            self.group.fail(str(err))
        except Exception as err:   # the ranks may be inside this step's all-reduces: out of step now
            self.group.fail(f"the leader's step failed ({type(err).__name__}: {err})")
