"""The target's forwards for the engine's steps, and their set-up at start: plain decode
batches replayed from graphs (CUDA graphs on a GPU) or through compiled steps (the CPU),
verify batches compiled where warm-up measured them faster, eager otherwise; the draft
model's decode steps get the same treatment (:meth:`Proposer.plain_decode_runner`). What
the warm-up measured seeds adaptive speculation's step costs."""
from __future__ import annotations

import logging
import time

import torch

from ..kv_cache import KVAllocator, pages_needed
from .compiled_decode import CompiledDecode
from .config import EngineConfig
from .graph_runner import GraphedDecode, capture_sizes
from .model_runner import ForwardBatch, ModelRunner

log = logging.getLogger(__name__)


class StepRunner:
    """``forward`` / ``verify_forward`` / ``logits`` of the target; ``decode_graphs`` is the
    graphed or compiled decode (None: eager), made by :meth:`set_up`."""

    def __init__(self, runner: ModelRunner, config: EngineConfig, allocator: KVAllocator,
                 max_pages_per_seq: int):
        self.runner, self.config, self.allocator = runner, config, allocator
        self.max_pages_per_seq = max_pages_per_seq
        self.decode_graphs: GraphedDecode | CompiledDecode | None = None

    def set_up(self, proposer, verify_ks: list[int]) -> None:
        """Graphs on a GPU, compiled steps on the CPU where configured (``verify_ks``: the
        draft counts whose verify steps may compile)."""
        if self.config.device.startswith("cuda") and not self.config.enforce_eager:
            self.decode_graphs = self.make_decode_graphs(proposer)
        elif self.config.compiles():
            self.decode_graphs = self.make_compiled_decode(proposer, verify_ks)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Pre-norm hidden states of every new token: replayed for a plain decode batch
        that a graph holds, eager otherwise (always eager when a row uses a LoRA adapter:
        the graphs and compiled steps hold the base model only)."""
        if self.decode_graphs is not None and not batch.uses_lora:
            hidden = self.decode_graphs.forward(batch)
            if hidden is not None:
                return hidden
        return self.runner.forward(batch)[1]

    def verify_forward(self, batch: ForwardBatch, k: int) -> torch.Tensor:
        """Pre-norm hidden states of a verify batch (up to k + 1 tokens per sequence):
        compiled where warm-up measured it faster, eager otherwise."""
        verify = getattr(self.decode_graphs, "forward_verify", None)
        if verify is not None and not batch.uses_lora:
            hidden = verify(batch, k)
            if hidden is not None:
                return hidden
        return self.runner.forward(batch)[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.runner.logits(hidden)

    def make_compiled_decode(self, proposer, verify_ks: list[int]) -> CompiledDecode:
        """The CPU's compiled decode steps (the draft's too), compiled and decided now:
        the warm-up writes pages reserved here (shared with the draft's pool) and given
        back after it, so the pool's pages all serve requests again."""
        c = self.config
        scratch = self.allocator.alloc(pages_needed(max(verify_ks, default=0) + 1, c.page_size))
        buckets = capture_sizes(c.max_num_seqs)
        models = [("target", self.runner)]
        draft = proposer.plain_decode_runner() if proposer is not None else None
        if draft is not None:   # its k - 1 decode steps, and its catch-up on 1..k + 1 tokens
            models.append(("draft", draft))
        compiled = []
        try:
            for name, runner in models:
                steps = CompiledDecode(runner, buckets, c.compile_cache_dir, verify_ks)
                log.info("%s: %s", name, steps.warm_up(scratch[0], measure=c.compile == "auto",
                                                       scratch_pages=scratch).describe())
                steps.compile_for_threads(c.compile_thread_counts, scratch[0], scratch)
                compiled.append(steps)
        finally:
            self.allocator.free(scratch)
        if draft is not None:
            proposer.use_fast_decode(compiled[1])
        return compiled[0]

    def make_decode_graphs(self, proposer, graphs=None) -> GraphedDecode:
        """Plain decode steps replayed from graphs (CUDA graphs on a GPU; ``graphs``
        another :class:`GraphBackend`); padding rows write one page reserved here."""
        scratch = self.allocator.alloc(1)[0]
        c = self.config
        draft = proposer.plain_decode_runner() if proposer is not None else None
        if draft is not None:   # its k - 1 decode steps
            proposer.use_fast_decode(GraphedDecode(draft.model, draft.pool, scratch, c.max_num_seqs,
                                                   self.max_pages_per_seq, graphs))
        return GraphedDecode(self.runner.model, self.runner.pool, scratch, c.max_num_seqs,
                             self.max_pages_per_seq, graphs)

    def step_costs(self, max_k: int, clock=time.perf_counter) -> dict[tuple[int, int], float]:
        """Milliseconds per target step at (bucket, k): what the compiled decode's warm-up
        measured, else the eager target at batch 1 and every k (a few ms of forwards on
        one scratch page range)."""
        warm = getattr(self.decode_graphs, "warmed", None)
        costs: dict[tuple[int, int], float] = {}
        if warm is not None:
            for bucket, times in warm.timings.items():
                costs[(bucket, 0)] = min(times)
            for (bucket, k), times in warm.verify_timings.items():
                costs[(bucket, k)] = min(times)
        if costs:
            return costs
        scratch = self.allocator.alloc(pages_needed(max_k + 1, self.config.page_size))
        try:
            for k in range(max_k + 1):
                batch = ForwardBatch([[0] * (k + 1)], [0], [scratch])
                self.runner.forward(batch)
                start = clock()
                for _ in range(2):
                    self.runner.forward(batch)
                costs[(1, k)] = 1000 * (clock() - start) / 2
        finally:
            self.allocator.free(scratch)
        return costs
