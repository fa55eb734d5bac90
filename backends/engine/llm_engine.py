"""The engine: requests in, one batched step at a time, token deltas out."""
from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

import torch

from ..kv_cache import KVAllocator, KVPagePool, PageAllocator, pages_needed
from ..kv_cache.prefix_cache import CachingAllocator
from ..models import load_model
from ..models.tokenizer import generation_eos_ids, load_tokenizer
from ..speculative.adaptive import Choice, SpecController
from ..speculative.config import SpeculativeConfig
from ..speculative.metrics import SpecDecodeMetrics
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .guided import GuideCompiler, GuideState, fill_guides, mask_logits
from .compiled_decode import CompiledDecode
from .graph_runner import GraphedDecode, capture_sizes, padded_size
from .isolation import describe, isolate
from .logits_processors import LogitsControls, apply_controls, bad_words_token_ids
from .model_runner import ForwardBatch, ModelRunner
from .params import SamplingParams
from .prefix_caching import PrefixCaching
from .request_perf import RequestPerf
from .proposers import (MAX_LAG, PLAIN_MAX_LAG, AutoProposer, DraftModelProposer, NgramProposer, StepHidden,
                        draft_vocab_ids, load_proposer_model, make_proposer)
from .request_limits import MAX_LOOKAHEAD_SLOTS, check_context, check_pool_fit, lookahead_slots
from .sampler import sample, token_logprobs, verify_drafts
from .scheduler import Scheduler
from .scheduler import ScheduledSeq
from .sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (deltas; ``finished`` on the last)."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None       # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None        # with "error": what went wrong, for the client
    error_code: str | None = None   # with "error": UNAVAILABLE when a retry may succeed
    # with SamplingParams.logprobs: one per new token (the log-probability under the
    # distribution it was sampled from), and the sum over all output tokens so far
    new_logprobs: list[float] = field(default_factory=list)
    cumulative_logprob: float | None = None
    num_cached_tokens: int = 0      # prompt tokens whose KV came from the prefix cache
    perf: RequestPerf | None = None  # what return_perf_metrics reports, so far


def check_pool_fits(pool: KVPagePool, cfg, dtype, config: EngineConfig) -> None:
    """An external KV pool must have the model's geometry and the engine's layout."""
    want = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, config.page_size,
            config.kv_layout, dtype)
    have = (pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.page_size, pool.kv_layout,
            pool.kv.dtype)
    if want != have:
        raise ValueError(f"external KV pool (layers, kv heads, head_dim, page_size, layout, "
                         f"dtype) = {have}; the model and engine config need {want}")


class LLMEngine:
    def __init__(self, config: EngineConfig, kv_pool: KVPagePool | None = None,
                 allocator: KVAllocator | None = None,
                 proposer_kv_pool: KVPagePool | None = None):
        """``kv_pool`` and ``allocator`` (both or neither) put the target's KV on an
        external pool, e.g. the decode pool shared with the KV receiver; with speculation
        ``proposer_kv_pool`` holds the draft's (or MTP head's) KV there too."""
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
        page_size = config.page_size
        dtype = self.model.embed_tokens.weight.dtype
        spec = config.speculative or SpeculativeConfig()
        if kv_pool is not None:
            check_pool_fits(kv_pool, cfg, dtype, config)
            if spec.has_kv and proposer_kv_pool is None:
                raise ValueError("speculative decoding on an external KV pool needs "
                                 "proposer_kv_pool: the draft KV lives next to the target's")
            num_pages, self.allocator, self.pool = kv_pool.num_pages, allocator, kv_pool
        else:
            num_pages = config.num_pages_for(cfg)
            self.allocator = (CachingAllocator(num_pages) if config.enable_prefix_caching
                              else PageAllocator(num_pages))
            self.pool = KVPagePool.for_model(cfg, num_pages, page_size, dtype, config.kv_layout,
                                             config.device)
        self.num_speculative_tokens = spec.num_speculative_tokens if spec.enabled else 0
        # the target's runner first: it packs the target's lm_head, which an MTP head shares
        self.runner = ModelRunner(self.model, self.pool)
        # what each step speculates (k per sequence), from measured costs and acceptance
        self.controller = SpecController(self.num_speculative_tokens, spec.adaptive) \
            if spec.enabled else None
        self.proposer = self._make_proposer(spec, num_pages, dtype, proposer_kv_pool)
        self.spec_metrics = SpecDecodeMetrics(self.num_speculative_tokens)
        self._buckets = capture_sizes(config.max_num_seqs)
        # what a step costs adaptive speculation, in wall time: its goal is tokens per
        # second as a client sees them. A server's other processes (tritonserver,
        # postprocess, the frontend: one response per request per step) take the cores
        # for a time that grows with the number of steps, not with k, and a step waits for
        # them in wall time where its CPU time would not show it (measured through the
        # server at c=8: pinned MTP 1.35x plain, 0.95x in the engine alone); load from
        # elsewhere slows every k alike
        self._clock = time.perf_counter
        self.num_lookahead_slots = lookahead_slots(spec)
        self.prefix = self._make_prefix_caching(spec)
        self.scheduler = Scheduler(self.allocator, page_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.num_lookahead_slots,
                                   self.prefix)
        self.decode_graphs: GraphedDecode | CompiledDecode | None = None
        if config.device.startswith("cuda") and not config.enforce_eager:
            self.decode_graphs = self.make_decode_graphs()
        elif config.compiles():
            self.decode_graphs = self.make_compiled_decode()
        if self.controller is not None and spec.adaptive:
            self._seed_costs()
        self._draft_verified: dict[str, int] = {}
        self.seqs: dict[str, Sequence] = {}
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.guides: GuideCompiler | None = None   # made on the first guided request
        self._guide_masks: ThreadPoolExecutor | None = None   # fills masks while the model runs
        # (clock, bucket) at the end of the last step that ran sequences: the time from
        # there to the next step is what serving a step costs outside it (see step)
        self._step_ended: tuple[float, int] | None = None

    def _make_prefix_caching(self, spec: SpeculativeConfig) -> PrefixCaching | None:
        """On when configured and the allocator caches (an external pool's may not)."""
        if not (self.config.enable_prefix_caching and getattr(self.allocator, "caching", False)):
            return None
        return PrefixCaching.for_config(self.config, self.allocator)

    def reset_prefix_cache(self) -> int:
        """Drop every cached page (held pages stay with their sequences); returns how
        many were cached."""
        return self.prefix.reset() if self.prefix is not None else 0

    def make_compiled_decode(self) -> CompiledDecode:
        """The CPU's compiled decode steps (the draft's too), compiled and decided now:
        the warm-up writes one page reserved here (shared with the draft's pool) and
        given back after it, so the pool's pages all serve requests again."""
        k = self.num_speculative_tokens
        scratch = self.allocator.alloc(pages_needed(k + 1, self.config.page_size))
        c, buckets = self.config, capture_sizes(self.config.max_num_seqs)
        # the target verifies k + 1 tokens per sequence, at every k adaptive speculation picks
        ks = list(range(1, k + 1)) if self.controller is not None and self.controller.adaptive else [k]
        models = [("target", self.runner, ks if k else [])]
        if isinstance(self._model_proposer(), DraftModelProposer):
            # its k - 1 decode steps, and its catch-up on the 1..k + 1 tokens a step accepted
            models.append(("draft", self._model_proposer().runner, ks if k else []))
        compiled = []
        try:
            for name, runner, verify_ks in models:
                steps = CompiledDecode(runner, buckets, c.compile_cache_dir, verify_ks)
                log.info("%s: %s", name, steps.warm_up(scratch[0], measure=c.compile == "auto",
                                                       scratch_pages=scratch).describe())
                compiled.append(steps)
        finally:
            self.allocator.free(scratch)
        if len(compiled) > 1:
            self.proposer.fast_decode = compiled[1]
        return compiled[0]

    def make_decode_graphs(self, graphs=None) -> GraphedDecode:
        """Plain decode steps replayed from graphs (CUDA graphs on a GPU; ``graphs``
        another :class:`GraphBackend`); padding rows write one page reserved here."""
        scratch = self.allocator.alloc(1)[0]
        max_pages = pages_needed(self.max_model_len + self.num_lookahead_slots,
                                 self.config.page_size)
        if isinstance(self._model_proposer(), DraftModelProposer):   # its k - 1 decode steps
            runner = self._model_proposer().runner
            self.proposer.fast_decode = GraphedDecode(runner.model, runner.pool, scratch,
                                                      self.config.max_num_seqs, max_pages, graphs)
        return GraphedDecode(self.model, self.pool, scratch, self.config.max_num_seqs,
                             max_pages, graphs)

    def _model_proposer(self):
        """The proposer with a model (draft or MTP head), or None (ngram alone)."""
        p = self.proposer
        return p.model if isinstance(p, AutoProposer) else None if isinstance(p, NgramProposer) else p

    def _seed_costs(self) -> None:
        """Start-up costs for the controller: what the compiled decode's warm-up measured,
        else the eager target at batch 1 and every k (a few ms of forwards on one
        scratch page range); the engine's own step times replace them as it runs."""
        warm = getattr(self.decode_graphs, "warmed", None)
        seeds: dict[tuple, float] = {}
        if warm is not None:
            for bucket, times in warm.timings.items():
                seeds[("step", bucket, 0)] = min(times)
            for (bucket, k), times in warm.verify_timings.items():
                seeds[("step", bucket, k)] = min(times)
        if not seeds:
            k = self.num_speculative_tokens
            scratch = self.allocator.alloc(pages_needed(k + 1, self.config.page_size))
            try:
                for kk in range(k + 1):
                    batch = ForwardBatch([[0] * (kk + 1)], [0], [scratch])
                    self.runner.forward(batch)
                    start = self._clock()
                    for _ in range(2):
                        self.runner.forward(batch)
                    seeds[("step", 1, kk)] = 1000 * (self._clock() - start) / 2
            finally:
                self.allocator.free(scratch)
        for key, ms in seeds.items():
            self.controller.costs.seed(key, ms)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Pre-norm hidden states of every new token: replayed for a plain decode batch
        that a graph holds, eager otherwise."""
        if self.decode_graphs is not None:
            hidden = self.decode_graphs.forward(batch)
            if hidden is not None:
                return hidden
        return self.runner.forward(batch)[1]

    def _verify_forward(self, batch: ForwardBatch, k: int) -> torch.Tensor:
        """Pre-norm hidden states of a verify batch (up to k + 1 tokens per sequence):
        compiled where warm-up measured it faster, eager otherwise."""
        verify = getattr(self.decode_graphs, "forward_verify", None)
        if verify is not None:
            hidden = verify(batch, k)
            if hidden is not None:
                return hidden
        return self.runner.forward(batch)[1]

    def _make_proposer(self, spec: SpeculativeConfig, num_pages: int, dtype,
                       pool: KVPagePool | None):
        """Draft KV pages share the target's page ids: one allocation serves both models."""
        if not spec.enabled:
            return None
        ngram = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_max,
                              spec.prompt_lookup_min)
        if not spec.has_kv:
            return ngram
        c = self.config
        model = load_proposer_model(spec, self.model, c.dtype, c.device)
        if pool is None:
            pool = KVPagePool.for_model(model.config, num_pages, c.page_size, dtype, c.kv_layout,
                                        c.device)
        else:
            check_pool_fits(pool, model.config, dtype, c)
            if pool.num_pages != num_pages:
                raise ValueError(f"proposer_kv_pool has {pool.num_pages} pages, the target's "
                                 f"{num_pages}: they share page ids")
        # adaptive: the proposer runs only on steps it drafts in (after plain and ngram
        # steps it catches up when it drafts next)
        proposer = make_proposer(model, self.model, pool,
                                 draft_vocab_ids(spec, self.model.config.vocab_size), spec.adaptive)
        if not spec.auto:
            return proposer
        # ngram stops drafting for a sequence whose ngram drafts the controller backed off from
        return AutoProposer(ngram, proposer,
                            lambda rid: not self.controller.backing_off(rid, ngram.name))

    # -- requests -------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; allowed: a non-empty string or token id list")
            if self.tokenizer is None:
                raise ValueError(f"prompt is text but {self.config.model_dir} has no "
                                 "tokenizer.json; pass token ids instead")
            return self.tokenizer.encode(prompt).ids
        ids = list(prompt)
        vocab = self.model.config.vocab_size
        if not ids:
            raise ValueError("prompt is empty; allowed: a non-empty string or token id list")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in 0..{vocab - 1}")
        return ids

    def make_sequence(self, prompt: str | list[int], params: SamplingParams,
                      request_id: str | None = None) -> Sequence:
        """Validate a request and build its sequence without changing engine state."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        ids = self.tokenize(prompt)
        check_context(len(ids), params.max_tokens, self.max_model_len)
        check_pool_fit(len(ids), params.max_tokens, self.config.page_size,
                       self.allocator.num_pages, self.num_lookahead_slots)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.seqs:
            raise ValueError(f"request_id {rid!r} is already in use")
        vocab = self.model.config.vocab_size
        if any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias has token ids outside the vocabulary "
                             f"({sorted(t for t in params.logit_bias if t >= vocab)[:8]}); "
                             f"allowed: ids in 0..{vocab - 1}")
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_ids)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        controls = LogitsControls.build(params, ids, stop_ids, vocab,
                                        self._bad_words(params.bad_words), self.config.device,
                                        self._guide(params, stop_ids))
        return Sequence(request_id=rid, prompt_ids=ids, params=params, stop_ids=stop_ids,
                        generator=gen, controls=controls,
                        logprobs=[] if params.logprobs else None)

    def _guide(self, params: SamplingParams, stop_ids: frozenset[int]) -> GuideState | None:
        """The request's grammar matcher (its guide compiled, or from the cache); raises
        GuideError (a ValueError naming guided_decoding_guide) for a guide that does not
        compile."""
        if params.guided_decoding is None:
            return None
        if self.guides is None:
            self.guides = GuideCompiler(self.tokenizer, self.model.config.vocab_size,
                                        sorted(self.eos_ids))
        return self.guides.matcher(params.guided_decoding, stop_ids)

    def _bad_words(self, words: list[str]) -> list[tuple[int, ...]]:
        """``bad_words`` as token id sequences (vLLM's tokenization), checked against
        the vocabulary."""
        if not words:
            return []
        if self.tokenizer is None:
            raise ValueError(f"bad_words needs a tokenizer; {self.config.model_dir} has no "
                             "tokenizer.json")
        ids = bad_words_token_ids(
            words, lambda w: self.tokenizer.encode(w, add_special_tokens=False).ids)
        vocab = self.model.config.vocab_size
        if any(t >= vocab for word in ids for t in word):
            raise ValueError(f"bad_words={words!r} tokenize to ids outside the model's "
                             f"vocabulary (0..{vocab - 1})")
        return ids

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.seqs:
            raise ValueError(f"request_id {seq.request_id!r} is already in use")
        self.seqs[seq.request_id] = seq
        self.detoks[seq.request_id] = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_ids, seq.params.stop, seq.params.min_tokens)
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
        seq.pages, seq.num_computed = list(pages), n - 1
        if self.proposer is not None:
            # the prefill filled the proposer's KV for the same tokens (its rows 0..n-2)
            seq.draft.computed = n - 1
        if self.prefix is not None:
            seq.num_matched_pages = seq.num_published = num_cached_pages
            self.prefix.admitted(seq, num_cached_pages * self.config.page_size)
        self.add(seq)

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None) -> str:
        seq = self.make_sequence(prompt, params, request_id)
        self.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    # -- one step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One batched forward. A request whose part of the step raises ends alone
        (finish_reason "error", the cause named); the others go on."""
        plan = self.scheduler.schedule()
        if self.controller is not None and self._step_ended is not None:
            # a server's work between two steps (streaming the outputs, taking requests in)
            # is paid once per step whatever k was: it makes fewer, longer steps pay more
            ended, bucket = self._step_ended
            self.controller.observe_cost(("gap", bucket, 0), 1000 * (self._clock() - ended))
        self._step_ended = None
        if not plan.seqs:
            return []
        outputs = isolate(plan.seqs, self._step, lambda s, exc: self._fail(s.seq, exc))
        if self.prefix is not None:   # after the proposer caught up: its KV is complete too
            for s in plan.seqs:
                if not s.seq.is_finished:
                    self.prefix.publish(s.seq)
        if self.controller is not None and self.has_unfinished():
            # (not after the last request: an idle wait is no step's cost)
            self._step_ended = (self._clock(), self._bucket(len(plan.seqs)))
        return outputs

    def _step(self, scheduled: list[ScheduledSeq]) -> list[RequestOutput]:
        # everything that may raise runs before the first commit (isolate retries it)
        choice = None
        if self.proposer is not None and all(s.num_new_tokens == 1 and s.samples for s in scheduled):
            choice = self._choose([s.seq for s in scheduled])
            if choice is not None and choice[0].k > 0:
                return self._speculative_step([s.seq for s in scheduled], *choice)
        began = self._clock()
        starts = [s.start for s in scheduled]
        batch = ForwardBatch([s.seq.token_ids(s.start, s.end) for s in scheduled], starts,
                             [s.seq.pages for s in scheduled])
        sampling = [s.seq for s in scheduled if s.samples]
        masks = self._start_guides(sampling, 1)
        try:
            hidden = self._forward(batch)
            ptr = list(itertools.accumulate(batch.qo_lens, initial=0))
            logits = self.runner.logits(hidden[[ptr[i + 1] - 1 for i, s in enumerate(scheduled)
                                                if s.samples]])
            dead = self._apply_controls(logits, sampling, masks=masks)
        finally:
            if masks is not None:
                wait([masks])      # a failed step leaves no fill running on a matcher
        tokens = sample(logits, [s.params for s in sampling], [s.generator for s in sampling])
        logprobs = self._logprobs(logits, [[t] for t in tokens], sampling)
        for s in scheduled:
            s.seq.num_computed = s.end
        outputs = [self._guide_ended(seq) if i in dead else self._commit(seq, [tok], lp)
                   for i, (seq, tok, lp) in enumerate(zip(sampling, tokens, logprobs))]
        if choice is not None:   # a plain decode step the controller chose: its cost, without
            # the proposer's catch-up below (kept rows run in batches every MAX_LAG tokens:
            # work the plain step does not need, which landed in its average as spikes)
            self.controller.observe_cost(("step", self._bucket(len(scheduled)), 0),
                                         1000 * (self._clock() - began))
        if self.proposer is not None:
            # prefill and mixed steps decode plainly; the proposer then sees what the target saw
            step_hidden: StepHidden = {s.seq.request_id: (starts[i], hidden[ptr[i]:ptr[i + 1]])
                                       for i, s in enumerate(scheduled)}
            live = [s.seq for s in scheduled if not s.seq.is_finished]
            # while the controller keeps choosing plain steps, a lazy proposer leaves
            # decoded rows for longer: a request may end before it drafts again
            lag = PLAIN_MAX_LAG if choice is not None and \
                self.controller.decoding_plainly(self._bucket(len(scheduled))) else MAX_LAG
            outputs += isolate(live, lambda seqs: self.proposer.catch_up(seqs, step_hidden, lag) or [],
                               self._fail)
        return outputs

    def _bucket(self, batch_size: int) -> int:
        return padded_size(batch_size, self._buckets) or batch_size

    def _choose(self, seqs: list[Sequence]) -> tuple[Choice, list[str | None]] | None:
        """How many tokens each sequence drafts in this decode step, and by which method;
        None: the proposer is behind on some sequence (or, with k pinned, cannot draft
        for one), so the step decodes plainly and the proposer catches up."""
        fast = self.controller.plain_without_planning(self._bucket(len(seqs)))
        if fast is not None:
            self.spec_metrics.record_choice(fast.k, fast.reason)
            return fast, [None] * len(seqs)
        if not all(self.proposer.in_sync(s) for s in seqs):
            return None
        methods = [self.proposer.method_for(s) for s in seqs]
        if not self.controller.adaptive and None in methods:
            return None   # pinned k: a batch speculates only when every sequence drafts
        bucket = self._bucket(len(seqs))
        model = self.proposer.model.name if isinstance(self.proposer, AutoProposer) else None
        choice = self.controller.plan(bucket, [s.request_id for s in seqs], methods, model)
        self.spec_metrics.record_choice(choice.k, choice.reason)
        if self.controller.choices.get(bucket, 0) % 1024 == 1:    # why it chooses, now and then
            log.info("adaptive speculation, %s", self.controller.describe(bucket))
        return choice, methods if choice.methods is None else list(choice.methods)

    def _propose(self, seqs: list[Sequence], ks: tuple[int, ...],
                 methods: list[str | None]) -> list[list[int]]:
        """Each sequence's ``ks[i]`` drafts, from its method's proposer (one batch each)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        for method in dict.fromkeys(m for m, k in zip(methods, ks) if k):
            rows = [i for i, (m, k) in enumerate(zip(methods, ks)) if k and m == method]
            group = [seqs[i] for i in rows]
            out = self.proposer.drafter(method).propose(
                group, max(ks[i] for i in rows), self._draft_process(group)).tolist()
            for i, d in zip(rows, out):
                drafts[i] = d[:ks[i]]
        return drafts

    def _speculative_step(self, seqs: list[Sequence], choice: Choice,
                          methods: list[str | None]) -> list[RequestOutput]:
        """Draft ``choice.ks[i]`` tokens for sequence i (0: none, it is verified with its
        one token), verify them in one target forward, keep each accepted prefix plus one
        target token, roll the rejected KV back. Sequences drafting the same number are
        verified together (the rejection sampler's [B, k + 1] rows)."""
        ks, width = choice.ks, choice.k + 1
        # a lazy model proposer first catches up on the rows it kept (every MAX_LAG tokens
        # it would anyway): outside the drafting's measured cost, which is then what
        # drafting k tokens costs, not how long the proposer sat out before
        model = self._model_proposer()
        behind = [s for s, m, k in zip(seqs, methods, ks) if k and m not in (None, "ngram")]
        if model is not None and behind and getattr(model, "lazy", False):
            model.flush(behind)
        before = [replace(s.draft) for s in seqs]
        groups: dict[int, list[int]] = {}
        for i, k in enumerate(ks):
            groups.setdefault(k, []).append(i)
        masks: dict[int, Future | None] = {}
        began = self._clock()
        try:
            drafts = self._propose(seqs, ks, methods)
            proposed = self._clock()
            draft_rows = {k: torch.tensor([drafts[i] for i in rows], dtype=torch.long).view(len(rows), k)
                          for k, rows in groups.items()}
            for k, rows in groups.items():
                masks[k] = self._start_guides([seqs[i] for i in rows], k + 1, draft_rows[k] if k else None)
            starts = [s.num_computed for s in seqs]
            batch = ForwardBatch([[s.token_ids(s.num_computed, s.num_tokens)[0], *d]
                                  for s, d in zip(seqs, drafts)], starts, [s.pages for s in seqs])
            hidden = self._verify_forward(batch, choice.k)
            logits = self.runner.logits(hidden)
            ptr = list(itertools.accumulate(batch.qo_lens, initial=0))
            verified = torch.full((len(seqs), width), -1, dtype=torch.int32)
            accepted, dead, logprobs = [0] * len(seqs), {}, [None] * len(seqs)
            for k, rows in groups.items():
                group = [seqs[i] for i in rows]
                if len(groups) == 1:
                    rows_logits = logits.view(len(seqs), k + 1, -1)
                else:
                    index = torch.tensor([ptr[i] + j for i in rows for j in range(k + 1)])
                    rows_logits = logits[index].view(len(rows), k + 1, -1)
                d = draft_rows[k]
                # controls at each position, the drafts before it counted as output (lossless)
                group_dead = self._apply_controls(rows_logits, group, d if k else None, masks[k])
                v, a = verify_drafts(rows_logits, d, [s.params for s in group],
                                     [s.generator for s in group])
                lp = self._logprobs(rows_logits, [v[j, :a[j] + 1].tolist() for j in range(len(rows))],
                                    group)
                for j, i in enumerate(rows):
                    verified[i, :k + 1], accepted[i], logprobs[i] = v[j], a[j], lp[j]
                    if j in group_dead:
                        dead[i] = group_dead[j]
        except Exception:
            for s, draft in zip(seqs, before):   # proposing advanced the drafts' caches
                s.draft = draft
            for m in masks.values():
                if m is not None:
                    wait([m])
            raise
        outputs, survivors = [], []
        # a request finishing in this step publishes only the proposer KV that was
        # right before it drafted (an MTP head's draft rows are rewritten after verifying)
        self._draft_verified = {s.request_id: d.computed for s, d in zip(seqs, before)}
        for i, s in enumerate(seqs):
            if ks[i]:
                self.spec_metrics.record(accepted[i], ks[i], methods[i])
                self.controller.observe_accepted(s.request_id, methods[i], ks[i], accepted[i])
                s.record_drafts(ks[i], accepted[i])
            s.num_computed = starts[i] + 1 + accepted[i]
            # a guide left position dead[i] without a token: what came before it is
            # kept, as plain decoding would have emitted it, then the sequence ends
            n = min(accepted[i] + 1, dead.get(i, ks[i] + 1))
            outputs.append(self._commit(s, verified[i, :n].tolist(), logprobs[i][:n]
                                        if logprobs[i] is not None else None))
            if n <= accepted[i] and not s.is_finished:
                outputs.append(self._guide_ended(s))
            if not s.is_finished:
                survivors.append(i)
        self._draft_verified = {}
        if len(groups) == 1:
            hidden = hidden.view(len(seqs), width, -1)
        else:   # rows past a sequence's own drafts: zeros (-1 tokens), as past a rejection
            padded = hidden.new_zeros(len(seqs), width, hidden.shape[-1])
            for i in range(len(seqs)):
                padded[i, :ptr[i + 1] - ptr[i]] = hidden[ptr[i]:ptr[i + 1]]
            hidden = padded

        def after_verify(rows: list[int]) -> list[RequestOutput]:
            live = [seqs[i] for i in rows]
            self.proposer.after_verify(live, verified[rows], hidden[rows], [starts[i] for i in rows])
            for s in live:
                self.scheduler.trim(s, max(s.num_tokens, s.draft.computed))
            return []

        if survivors:
            outputs += isolate(survivors, after_verify, lambda i, exc: self._fail(seqs[i], exc))
        bucket = self._bucket(len(seqs))
        kind = "model" if any(m not in (None, "ngram") for m, k in zip(methods, ks) if k) else "ngram"
        self.controller.observe_cost(("propose", bucket, choice.k, kind), 1000 * (proposed - began))
        self.controller.observe_cost(("step", bucket, choice.k), 1000 * (self._clock() - proposed))
        return outputs

    def _start_guides(self, seqs: list[Sequence], n: int,
                      drafts: torch.Tensor | None = None) -> Future | None:
        """The guided rows' bitmasks at ``n`` positions each, filled on a thread while the
        model runs (xgrammar releases the GIL); None when no row is guided."""
        rows = [i for i, s in enumerate(seqs) if s.controls is not None and s.controls.guide is not None]
        if not rows:
            return None
        if self._guide_masks is None:
            self._guide_masks = ThreadPoolExecutor(1, thread_name_prefix="tandem-guide-masks")
        ahead = drafts[rows].tolist() if drafts is not None else [[] for _ in rows]
        return self._guide_masks.submit(fill_guides, len(seqs), n, self.model.config.vocab_size, rows,
                                        [seqs[i].controls.guide for i in rows], ahead)

    def _apply_controls(self, logits: torch.Tensor, seqs: list[Sequence],
                        drafts: torch.Tensor | None = None,
                        masks: Future | None = None) -> dict[int, int]:
        """Logits controls on the rows ([B, V], or [B, n, V] in a speculative step) of
        the requests that use one, then the guides' masks; nothing at all for a batch of
        plain requests (``masks``: the guides' bitmasks from :meth:`_start_guides`; filled
        here without). Returns, per row whose guide leaves no token at a reachable
        position, the first such position (see :func:`mask_logits`)."""
        logits = logits if logits.dim() == 3 else logits[:, None]
        rows = [i for i, s in enumerate(seqs)
                if s.controls is not None and s.controls.active(len(s.output_ids))]
        if rows:
            apply_controls(logits, rows, [seqs[i].controls for i in rows],
                           [seqs[i].output_ids for i in rows], drafts)
        if masks is None:
            masks = self._start_guides(seqs, logits.shape[1], drafts)
        if masks is None:
            return {}
        return mask_logits(logits, masks.result())

    def _guide_ended(self, seq: Sequence) -> RequestOutput:
        """The guide allows no token that the request's other settings leave: a complete
        output ends as "stop"; otherwise the request ends with an error that says why."""
        if seq.controls.guide.completed:
            return self._finish(seq, "stop")
        return self._finish(seq, "error", error=(
            f"guided decoding: after {len(seq.output_ids)} output tokens the guide allows no "
            "token that the request's other settings (min_tokens, bad_words, logit_bias, "
            "end_id or stop ids) leave possible; the output so far is incomplete"))

    def _draft_process(self, seqs: list[Sequence]):
        """Drafts from the controlled logits when the batch uses controls: only speed
        depends on it (verification applies them to the target either way)."""
        if all(s.controls is None for s in seqs):
            return None
        return lambda logits, drafted: self._apply_controls(logits, seqs, drafted)

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: list[list[int]],
                  seqs: list[Sequence]) -> list[list[float] | None]:
        """Per request asking for them, the log-probabilities of its new tokens at
        positions 0.. of its processed logits ([B, V] or [B, n, V]); None for the others."""
        out: list[list[float] | None] = [None] * len(seqs)
        rows = [i for i, s in enumerate(seqs) if s.logprobs is not None]
        if not rows:
            return out
        logits = logits if logits.dim() == 3 else logits[:, None]
        flat = token_logprobs(torch.cat([logits[i, :len(tokens[i])] for i in rows]),
                              [t for i in rows for t in tokens[i]],
                              [seqs[i].params for i in rows for _ in tokens[i]])
        for i in rows:
            out[i], flat = flat[:len(tokens[i])], flat[len(tokens[i]):]
        return out

    def _commit(self, seq: Sequence, tokens: list[int],
                logprobs: list[float] | None = None) -> RequestOutput:
        """Append a sequence's new tokens; if that raises, the sequence alone fails."""
        try:
            return self._append(seq, tokens, logprobs)
        except Exception as exc:
            return self._fail(seq, exc)

    def _fail(self, seq: Sequence, exc: Exception) -> RequestOutput:
        log.error("request %s failed in the engine step; the others go on", seq.request_id,
                  exc_info=exc)
        return self._finish(seq, "error", error=f"the request failed in the engine step "
                                                f"({describe(exc)}); other requests were not affected")

    def _append(self, seq: Sequence, tokens: list[int],
                logprobs: list[float] | None = None) -> RequestOutput:
        """Append new tokens, stopping exactly at the first stop condition."""
        detok = self.detoks[seq.request_id]
        for n, token in enumerate(tokens, 1):
            seq.append_token(token, None if logprobs is None else logprobs[n - 1])
            detok.add(token)
            if token in seq.stop_ids or detok.stopped or (
                    seq.controls is not None and seq.controls.guide is not None
                    and seq.controls.guide.terminated):
                return self._finish(seq, "stop", tokens[:n])
            if len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                return self._finish(seq, "length", tokens[:n])
        return self._output(seq, tokens, detok.take(final=False), None)

    def _finish(self, seq: Sequence, reason: str, new_ids: list[int] = (),
                error: str | None = None) -> RequestOutput:
        if self.controller is not None:
            self.controller.forget(seq.request_id)
            self.proposer.forget(seq.request_id)
        if self.prefix is not None:
            if reason in ("stop", "length"):   # its last step's pages, for the next turn
                self.prefix.publish(seq, self._draft_verified.get(seq.request_id))
            else:      # cancelled or failed: nothing it alone holds stays cached
                self.prefix.withdraw(seq)
        self.scheduler.finish(seq)
        seq.finish_reason = reason
        del self.seqs[seq.request_id]
        detok = self.detoks.pop(seq.request_id)
        text = detok.take(final=True) if error is None else ""
        return self._output(seq, list(new_ids), text, reason, error)

    def _output(self, seq, new_ids, text, reason, error=None) -> RequestOutput:
        out = RequestOutput(seq.request_id, new_ids, text, reason is not None, reason,
                            len(seq.prompt_ids), len(seq.output_ids), error,
                            num_cached_tokens=seq.num_cached_tokens or 0,
                            perf=seq.perf(self.config.page_size))
        if seq.logprobs is not None:
            out.new_logprobs = seq.logprobs[len(seq.logprobs) - len(new_ids):]
            out.cumulative_logprob = seq.cumulative_logprob
        return out
