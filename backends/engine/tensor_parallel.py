"""The engine's target split over tensor-parallel ranks (backends/parallel): the leader's
scheduler plans every step alone and the other ranks follow its plan.

Each step the leader sends the :class:`~.model_runner.ForwardBatch` to the ranks, then
runs its own share; every rank plans attention over the same page ids in its own KV pool
(its KV heads only), and the row-parallel layers' all-reduces keep the ranks in step, so
when the leader has passed a layer's all-reduce, every rank has written that layer's KV
(where a KV messenger counts layers, it counts on the leader, after those all-reduces:
:class:`LayerDoneAfterAllReduce`). The leader alone computes logits,
samples, and runs a draft model or MTP head (whole, on its hidden states, which the
all-reduces make complete). LoRA adapters are cut as their projections are; the leader's
pool takes the slots and each step tells the ranks what the slots it uses hold.
"""
from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Callable

import torch

from ..kv_cache import KVPagePool
from ..lora import LoRAPool
from ..lora.pool import SlotContents, lora_dtype
from ..models import LlamaForCausalLM, load_model
from ..parallel.group import FAILED, READY, RankFailed, RankGroup, RankSpec, connect
from .rank_pools import RankPoolFiles
from ..parallel.sharding import projection_slices, rank_config, shard_model_
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


@dataclass(frozen=True, slots=True)
class RankStep:
    """One step for the ranks: the batch, and the adapters its slots hold that the ranks
    do not yet (each as the leader read it, whole: a rank cuts its share), pickled into
    bytes (a tensor sent bare would go as a shared-memory handle, for the pipe's owner to
    keep alive)."""
    batch: ForwardBatch
    loads: dict[int, tuple[SlotContents, bytes]]


def rank_lora_pool(config: EngineConfig, model: LlamaForCausalLM, tp: int, rank: int) -> LoRAPool | None:
    """Rank ``rank``'s share of the adapter slots (None: LoRA is off); a split leader's
    keeps each adapter as read, for its ranks."""
    if not config.max_loras:
        return None
    split = tp > 1
    return LoRAPool(model.config, config.max_loras, config.max_lora_rank, config.device,
                    lora_dtype(config.device, model.embed_tokens.weight.dtype),
                    projection_slices(model.config, tp, rank) if split else None, keep_read=split and rank == 0)


def start_ranks(config: EngineConfig, num_pages: int,
                rank_pool: Callable[[int], KVPagePool] | None = None) -> RankGroup:
    """Ranks 1..tp-1 started and joined (they load and cut the model meanwhile)."""
    return RankGroup(config.tensor_parallel_size, config.tp_timeout_s, RankWork(config, num_pages, rank_pool),
                     rank_main)


def start_group(config: EngineConfig, model: LlamaForCausalLM, num_pages: int,
                rank_pool: Callable[[int], KVPagePool] | None = None) -> RankGroup:
    """Ranks 1..tp-1 started (building their shares meanwhile) and the leader's ``model``
    cut to rank 0's share; call ``wait_ready`` once the leader built the rest."""
    group = start_ranks(config, num_pages, rank_pool)
    try:
        shard_model_(model, group.tp, 0, group.all_reduce)
    except Exception:
        group.stop()
        raise
    return group


@dataclass(slots=True)
class TensorParallelRanks:
    """A leader's ranks 1..tp-1 whose KV pools it maps too (``pools``, by rank from 1):
    what a prefill engine needs, whose messenger sends every rank's pages."""
    group: RankGroup
    pools: list[KVPagePool]
    files: RankPoolFiles

    def ready(self) -> None:
        """Wait for every rank to build its share; the pool files are then unlinked (every
        rank mapped its own), also when a rank failed."""
        try:
            self.group.wait_ready()
        finally:
            self.files.unlink()

    def stop(self) -> None:
        """The leader failed to build its share: stop the ranks, remove the files."""
        self.group.stop()
        self.files.unlink()


def start_shared_ranks(config: EngineConfig, model: LlamaForCausalLM) -> TensorParallelRanks:
    """Ranks 1..tp-1 started with their KV pools in shared memory the leader maps, and
    ``model`` cut to rank 0's share; call :meth:`TensorParallelRanks.ready` once the
    leader built the rest."""
    tp = config.tensor_parallel_size
    share = rank_config(model.config, tp)
    num_pages = config.num_pages_for(share)
    files, pools = RankPoolFiles.create(
        tp, num_layers=share.num_hidden_layers, num_pages=num_pages, num_kv_heads=share.num_key_value_heads,
        page_size=config.page_size, head_dim=share.head_dim,
        dtype=str(model.embed_tokens.weight.dtype).removeprefix("torch."), kv_layout=config.kv_layout)
    try:
        group = start_group(config, model, num_pages, files)
    except BaseException:
        files.unlink()
        raise
    return TensorParallelRanks(group, pools, files)


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
        lora_pool = rank_lora_pool(c, model, spec.tp, spec.rank)
        runner = ModelRunner(model, pool, lora_pool)
    except Exception as err:   # reported to the leader, which fails its start with it
        conn.send((FAILED, f"{type(err).__name__}: {err}"))
        return
    conn.send((READY, None))
    while True:
        try:
            step: RankStep = conn.recv()
        except (EOFError, OSError):
            return
        try:
            for slot, (contents, adapter) in step.loads.items():
                lora_pool.mirror(slot, contents, pickle.loads(adapter))
            runner.forward(step.batch)
        except Exception as err:
            log.error("tensor-parallel rank %d: a step failed (%s); the group is broken", spec.rank, err)
            raise SystemExit(1)


class TensorParallelRunner(ModelRunner):
    """The leader's :class:`ModelRunner`: each forward is sent to the other ranks first."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPagePool, group: RankGroup,
                 lora_pool: LoRAPool | None = None):
        super().__init__(model, pool, lora_pool)
        self.group = group
        self.ranks_hold: dict[int, SlotContents] = {}   # what the ranks' adapter slots hold

    def forward(self, batch: ForwardBatch, on_layer_done=None):
        if torch.get_num_threads() != self.group.threads:
            # the leader's share on whichever thread steps (a server's engine thread
            # starts with the process's default, and its thread hooks would borrow more)
            torch.set_num_threads(self.group.threads)
        self.group.send(RankStep(batch, self._new_adapters(batch)))
        lagged = LayerDoneAfterAllReduce(on_layer_done) if on_layer_done is not None else None
        try:
            out = super().forward(batch, lagged)
            if lagged is not None:
                lagged.finish()
            return out
        except RankFailed as err:
            self.group.fail(str(err))
        except Exception as err:   # the ranks may be inside this step's all-reduces: out of step now
            self.group.fail(f"the leader's step failed ({type(err).__name__}: {err})")


    def _new_adapters(self, batch: ForwardBatch) -> dict[int, tuple[SlotContents, bytes]]:
        loads = {}
        for slot in set(batch.lora_slots or ()) - {0}:
            contents = self.lora_pool.contents(slot)
            if self.ranks_hold.get(slot) != contents:
                loads[slot] = (contents, pickle.dumps(self.lora_pool.adapter(slot)))
                self.ranks_hold[slot] = contents
        return loads


class LayerDoneAfterAllReduce:
    """The leader's attention tells a layer done once its own KV of the layer is written;
    another rank writes its share of that layer only before the layer's first all-reduce,
    which the leader passes later. So layer ``i`` is passed on when the leader's layer
    ``i + 1`` is (the all-reduces of layer ``i`` lie between), and the last layer when
    the forward returned."""

    def __init__(self, on_layer_done: Callable[[int], None]):
        self.on_layer_done, self.last = on_layer_done, -1

    def __call__(self, layer: int) -> None:
        if layer > 0:
            self.on_layer_done(layer - 1)
        self.last = layer

    def finish(self) -> None:
        if self.last >= 0:
            self.on_layer_done(self.last)
