"""The engine: requests in, one batched step at a time (schedule, run, process outputs),
token deltas out. What a step needs lives beside it: input processing
(:mod:`.input_processor`), the target's forwards and their compiled or graphed set-up
(:mod:`.step_runner`), logits controls and guides (:mod:`.step_controls`), speculation
(:mod:`.speculation`), output processing (:mod:`.outputs`)."""
from __future__ import annotations

import itertools
from concurrent.futures import wait
from typing import Callable

from ..kv_cache import KVAllocator, KVPagePool, pages_needed
from ..kv_cache.prefix_cache import CachingKVAllocator
from ..lora import LoRAPool, LoRARequest
from ..models import load_model
from ..models.tokenizer import generation_eos_ids, load_tokenizer
from ..parallel.sharding import rank_config
from ..speculative.adaptive import SpecController
from ..speculative.config import SpeculativeConfig
from ..speculative.metrics import SpecDecodeMetrics
from .config import EngineConfig
from .input_processor import InputProcessor
from .isolation import isolate
from .kv_pool import check_pool_fits, make_kv_pool
from .model_runner import ForwardBatch, ModelRunner
from .outputs import OutputProcessor, RequestOutput, sequence_logprobs
from .params import SamplingParams
from .prefix_caching import CachedPageChanged, PrefixCaching
from .proposers import build_proposer
from .request_limits import MAX_LOOKAHEAD_SLOTS, lookahead_slots
from .sampler import sample
from .scheduler import ScheduledSeq, Scheduler
from .sequence import Sequence
from .speculation import Speculation
from .step_controls import StepControls
from .step_runner import StepRunner
from .tensor_parallel import TensorParallelRunner, rank_lora_pool, start_group

__all__ = ["LLMEngine", "RequestOutput"]


class LLMEngine:
    def __init__(self, config: EngineConfig, kv_pool: KVPagePool | None = None,
                 allocator: KVAllocator | None = None,
                 proposer_kv_pool: KVPagePool | None = None,
                 rank_kv_pools: Callable[[int], KVPagePool] | None = None):
        """``kv_pool`` and ``allocator`` (both or neither) put the target's KV on an
        external pool, e.g. the decode pool shared with the KV receiver; with speculation
        ``proposer_kv_pool`` holds the draft's (or MTP head's) KV there too. With
        tensor-parallel ranks and an external pool (rank 0's share),
        ``rank_kv_pools(rank)`` gives each other rank its share (picklable: it runs in
        the rank's process)."""
        config.validate()
        if (kv_pool is None) != (allocator is None):
            raise ValueError("kv_pool and allocator go together: pass both or neither")
        self.config = config
        self.model = load_model(config.model_dir, config.dtype, config.device)
        self.tokenizer = load_tokenizer(config.model_dir)
        cfg = self.model.config
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        # positions up to the context plus speculative lookahead (the table cannot grow
        # on a GPU without a host sync)
        self.model.rotary_table().reserve(self.max_model_len + MAX_LOOKAHEAD_SLOTS)
        self.eos_ids = frozenset(cfg.eos_token_ids + generation_eos_ids(config.model_dir))
        dtype = self.model.embed_tokens.weight.dtype
        spec = config.speculative or SpeculativeConfig()
        self.tp_group = self._start_ranks(kv_pool, rank_kv_pools)
        if kv_pool is not None:
            check_pool_fits(config, kv_pool, self.model.rank_config, dtype)
            if spec.has_kv and proposer_kv_pool is None:
                raise ValueError("speculative decoding on an external KV pool needs "
                                 "proposer_kv_pool: the draft KV lives next to the target's")
            self.allocator, self.pool = allocator, kv_pool
        else:
            self.pool, self.allocator = make_kv_pool(config, self.model.rank_config, dtype)
        k = self.num_speculative_tokens = spec.num_speculative_tokens if spec.enabled else 0
        # adapters apply to the target only: a proposer drafts from the base, the target
        # verifies with the request's adapter, so speculation stays lossless
        self.lora_pool = rank_lora_pool(config, self.model, config.tensor_parallel_size, 0)
        # the target's runner first: it packs the target's lm_head, which an MTP head shares
        if self.tp_group is None:
            self.runner = ModelRunner(self.model, self.pool, self.lora_pool)
        else:
            self.runner = TensorParallelRunner(self.model, self.pool, self.tp_group, self.lora_pool)
            self.tp_group.wait_ready()
        # ngram stops drafting for a sequence whose ngram drafts the controller backed off from
        proposer = build_proposer(spec, config, self.model, self.pool.num_pages, proposer_kv_pool,
                                  lambda rid: not self.controller.backing_off(rid, "ngram")) \
            if spec.enabled else None
        self.spec_metrics = SpecDecodeMetrics(k)
        self.num_lookahead_slots = lookahead_slots(spec)
        cached_pools = [self.pool] + ([proposer.runner.pool] if spec.enabled and spec.has_kv else [])
        self.prefix = PrefixCaching.for_config(config, self.allocator, cached_pools) \
            if config.enable_prefix_caching and isinstance(self.allocator, CachingKVAllocator) else None
        self.scheduler = Scheduler(self.allocator, config.page_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.num_lookahead_slots, self.prefix)
        self.seqs: dict[str, Sequence] = {}
        self.inputs = InputProcessor(config, self.tokenizer, cfg.vocab_size, self.eos_ids,
                                     self.max_model_len, self.allocator.num_pages, self.num_lookahead_slots)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len, config.page_size, self._release)
        self.controls = StepControls(cfg.vocab_size)
        self.target = StepRunner(self.runner, config, self.allocator, pages_needed(
            self.max_model_len + self.num_lookahead_slots, config.page_size))
        # the target verifies k + 1 tokens per sequence, at every k adaptive speculation picks
        self.target.set_up(proposer, [] if not k else list(range(1, k + 1)) if spec.adaptive else [k])
        self.spec: Speculation | None = None
        if spec.enabled:
            self.spec = Speculation(proposer, SpecController(k, spec.adaptive), self.target, self.outputs,
                                    self.controls, self.scheduler, self.spec_metrics, config.max_num_seqs)
            if spec.adaptive:
                self.spec.seed_costs()

    def _start_ranks(self, kv_pool: KVPagePool | None, rank_kv_pools):
        """With ``tensor_parallel_size`` > 1: the other ranks started (building their
        shares while this process cuts its own) and the model cut to rank 0's share."""
        tp = self.config.tensor_parallel_size
        if tp == 1:
            return None
        if kv_pool is not None and rank_kv_pools is None:
            raise ValueError(f"tensor_parallel_size={tp} on an external KV pool needs each rank's share of "
                             "it (rank_kv_pools)")
        num_pages = kv_pool.num_pages if kv_pool is not None else \
            self.config.num_pages_for(rank_config(self.model.config, tp))
        return start_group(self.config, self.model, num_pages, rank_kv_pools)

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (they also end when this process does)."""
        if self.tp_group is not None:
            self.tp_group.stop()

    @property
    def proposer(self):
        return None if self.spec is None else self.spec.proposer

    @property
    def controller(self) -> SpecController | None:
        return None if self.spec is None else self.spec.controller

    @property
    def decode_graphs(self):
        return self.target.decode_graphs

    def reset_prefix_cache(self) -> int:
        """Drop every cached page (held pages stay with their sequences); returns how
        many were cached."""
        return self.prefix.reset() if self.prefix is not None else 0

    # -- requests -------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.inputs.tokenize(prompt)

    def make_sequence(self, prompt: str | list[int], params: SamplingParams,
                      request_id: str | None = None, lora: LoRARequest | None = None) -> Sequence:
        """Validate a request and build its sequence without changing engine state
        (``lora``: its adapter; the adapter's files are read when it is added)."""
        if lora is not None:
            if not isinstance(lora, LoRARequest):
                raise TypeError(f"lora must be a LoRARequest, got {type(lora).__name__}")
            if self.lora_pool is None:
                raise ValueError(f"request names LoRA adapter {lora.name!r} but LoRA is off "
                                 "(max_loras=0); allowed: no adapter, or an engine with max_loras >= 1")
        seq = self.inputs.make_sequence(prompt, params, request_id, self.seqs)
        seq.lora = lora
        return seq

    def load_lora(self, lora: LoRARequest) -> None:
        """Load an adapter before any request names it (checked as a request's adapter is)."""
        self._lora_pool(lora.name).preload(lora)

    def unload_lora(self, name: str) -> bool:
        """Drop an adapter no running request holds (False: not loaded)."""
        return self._lora_pool(name).unload(name)

    def _lora_pool(self, name: str) -> LoRAPool:
        if self.lora_pool is None:
            raise ValueError(f"LoRA adapter {name!r}: LoRA is off (max_loras=0); allowed: an "
                             "engine with max_loras >= 1")
        return self.lora_pool

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; with an adapter, its slot is taken now (loaded if it is not):
        an adapter that does not load, or a full pool, raises before anything changed."""
        if seq.request_id in self.seqs:
            raise ValueError(f"request_id {seq.request_id!r} is already in use")
        if seq.lora is not None and not seq.lora_slot:
            seq.lora_slot = self.lora_pool.acquire(seq.lora)
        self.seqs[seq.request_id] = seq
        self.outputs.add(seq)
        self.scheduler.add(seq)

    def add_prefilled(self, seq: Sequence, pages: list[int], num_cached_pages: int = 0) -> None:
        """Admit ``seq`` whose first ``n - 1`` prompt tokens' KV already sits in ``pages``
        (this engine's allocator owns them now): its first step runs the last prompt
        token as a decode token and samples the first output token. With speculation the
        pages hold the proposer's KV of those tokens too. The first ``num_cached_pages``
        came from this engine's prefix cache (the transfer skipped them). If the
        sequence is ever preempted, the engine recomputes its prompt itself."""
        n = len(seq.prompt_ids)
        if seq.output_ids or seq.num_computed or seq.pages:
            raise ValueError(f"request {seq.request_id!r} is not a fresh sequence")
        expected = pages_needed(n - 1, self.config.page_size)
        if len(pages) != expected:
            raise ValueError(f"{len(pages)} pages for {n - 1} prefilled tokens; expected {expected}")
        if seq.lora is not None and not seq.lora_slot:   # a full pool refuses it before anything changed
            seq.lora_slot = self.lora_pool.acquire(seq.lora)
        if self.prefix is not None and num_cached_pages:
            # the pages kv_transfer shared from this engine's cache, audited as a hit is
            kept = self.prefix.audited(pages[:num_cached_pages])   # gives back the cut ones
            if len(kept) < num_cached_pages:
                self.allocator.free(kept + pages[num_cached_pages:])
                raise CachedPageChanged(f"request {seq.request_id!r}: cached page {pages[len(kept)]} "
                                        "changed since it was published; prefilling afresh")
        seq.pages, seq.num_computed = list(pages), n - 1
        if self.spec is not None:
            # the prefill filled the proposer's KV for the same tokens (its rows 0..n-2)
            seq.draft.computed = n - 1
        if self.prefix is not None:
            seq.num_matched_pages = seq.num_published = num_cached_pages
            self.prefix.admitted(seq, num_cached_pages * self.config.page_size)
        self.add(seq)

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                    lora: LoRARequest | None = None) -> str:
        """Queue a request (``lora``: the adapter it runs under; None: the base model)."""
        seq = self.make_sequence(prompt, params, request_id, lora)
        self.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        return self.outputs.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def _release(self, seq: Sequence, reason: str, draft_computed: int | None) -> None:
        """A request finished: forget it and give its pages back (a completed one's full
        pages stay cached for the next turn; ``draft_computed``: the proposer KV rows that
        are right, when it finished in a speculative step)."""
        if self.spec is not None:
            self.spec.forget(seq.request_id)
        if self.prefix is not None:
            if reason in ("stop", "length"):
                self.prefix.publish(seq, draft_computed)
            else:      # cancelled or failed: nothing it alone holds stays cached
                self.prefix.withdraw(seq)
        self.scheduler.finish(seq)
        if seq.lora_slot:
            self.lora_pool.release(seq.lora_slot)
            seq.lora_slot = 0
        del self.seqs[seq.request_id]

    # -- one step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One batched forward. A request whose part of the step raises ends alone
        (finish_reason "error", the cause named); the others go on. With tensor-parallel
        ranks, a broken group (a rank died) raises, before a step or after the one it
        broke in, naming the rank: the engine cannot serve until it is started anew (a
        server's engine thread stops on it, ending every open request UNAVAILABLE with
        the cause, and the model is restarted)."""
        if self.tp_group is not None:
            self.tp_group.check()
        plan = self.scheduler.schedule()
        if self.spec is not None:
            self.spec.step_began()
        if not plan.seqs:
            return []
        outputs = isolate(plan.seqs, self._step, lambda s, exc: self.outputs.fail(s.seq, exc))
        if self.tp_group is not None:   # a rank died in this step: stop now, not at the next
            self.tp_group.check()
        if self.prefix is not None:   # after the proposer caught up: its KV is complete too
            for s in plan.seqs:
                if not s.seq.is_finished:
                    self.prefix.publish(s.seq)
        if self.spec is not None:
            self.spec.step_ended(len(plan.seqs), self.has_unfinished())
        return outputs

    PROMPT_LOGITS_ROWS = 256   # prompt positions per lm_head call: [rows, vocab] fp32 at a time

    def _record_prompt_logprobs(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor,
                                ends: list[int]) -> None:
        """For requests asking for prompt log-probabilities, the logits at the prompt
        positions this step computed (before the first commit: a failure retries cleanly;
        a recomputed chunk records nothing twice)."""
        for s, end in zip(scheduled, ends):
            lp = s.seq.prompt_logprobs
            wanted = lp.wants(s.start, s.end) if lp is not None else None
            if wanted is None:
                continue
            row = end - (s.end - s.start) + wanted[0]
            for at in range(row, row + wanted[1], self.PROMPT_LOGITS_ROWS):
                lp.add_chunk(self.target.logits(hidden[at:min(at + self.PROMPT_LOGITS_ROWS,
                                                               row + wanted[1])]))

    def _step(self, scheduled: list[ScheduledSeq]) -> list[RequestOutput]:
        # everything that may raise runs before the first commit (isolate retries it)
        spec_plan = self.spec.choose(scheduled) if self.spec is not None else None
        if spec_plan is not None and spec_plan[0].k > 0:
            return self.spec.step([s.seq for s in scheduled], spec_plan)
        began = self.spec.clock() if self.spec is not None else 0.0
        batch = ForwardBatch([s.seq.token_ids(s.start, s.end) for s in scheduled],
                             [s.start for s in scheduled], [s.seq.pages for s in scheduled],
                             [s.seq.lora_slot for s in scheduled] if self.lora_pool else None)
        sampling = [s.seq for s in scheduled if s.samples]
        masks = self.controls.start(sampling, 1)
        try:
            hidden = self.target.forward(batch)
            ends = list(itertools.accumulate(batch.qo_lens))
            self._record_prompt_logprobs(scheduled, hidden, ends)
            logits = self.target.logits(hidden[[ends[i] - 1 for i, s in enumerate(scheduled) if s.samples]])
            dead = self.controls.apply(logits, sampling, masks=masks)
        finally:
            if masks is not None:
                wait([masks])      # a failed step leaves no fill running on a matcher
        tokens = sample(logits, [s.params for s in sampling], [len(s.output_ids) for s in sampling])
        logprobs = sequence_logprobs(logits, [[t] for t in tokens], sampling)
        for s in scheduled:
            s.seq.num_computed = s.end
        outputs = [self.outputs.guide_ended(seq) if i in dead else self.outputs.commit(seq, [tok], lp)
                   for i, (seq, tok, lp) in enumerate(zip(sampling, tokens, logprobs))]
        if self.spec is not None:
            outputs += self.spec.after_plain_step([s.seq for s in scheduled], batch, hidden, spec_plan,
                                                  1000 * (self.spec.clock() - began))
        return outputs

