"""Prefill-only engine for disaggregated serving: chunked prefill, never sampling.

A request is ``prompt[:-1]`` (the decoder treats the last prompt token as its first
decode token and samples from it). All of a request's pages are allocated when it
is admitted — the KV messenger must know every source page before the first chunk
runs, and a prefill whose pages are being streamed must never be preempted. Each
forward is announced to a :class:`PrefillHooks` (which returns the ``on_layer_done``
callback that lets a messenger push a layer's pages while later layers compute);
a finished prefill keeps its pages until :meth:`PrefillEngine.release` (after its
transfer completed), and exposes the final hidden state of its last token.

With speculation the engine also fills the proposer's KV (draft model or MTP head) for
every chunk right after the target's forward — same page ids, its own pool — and
announces that forward to the hooks under the proposer's KV name.

With ``enable_prefix_caching`` (the default) the engine keeps a prefix cache of its own,
keyed as the colocated engine keys its pages (:class:`.prefix_caching.PrefixCaching`:
model fingerprint and version, the request's ``cache_salt`` and adapter; with an MTP head a page's
key covers the token after it). An admitted request takes the longest cached chain of
full pages of ``prompt[:-1]`` short of its last token (whose hidden state the decoder
needs, so it is always computed), computes from the first page it lacks, and publishes
each full page once the target's and the proposer's KV of it are complete; the pages
it took are in ``req.pages[:req.num_cached // page_size]`` and no forward announces
them (:class:`PrefillHooks` is told of them at admission through ``req.num_cached``).
An aborted or failed request withdraws what it alone published.

With ``max_loras`` a request may name a LoRA adapter (:class:`~..lora.LoRARequest`): the
target computes its KV under the adapter, as the decode engine continues it (the
proposer's KV stays the base's, as the decode engine's proposer drafts from the base).

>>> eng = PrefillEngine.from_config(EngineConfig("checkpoints/demo/target"))  # doctest: +SKIP
>>> eng.add("r0", [1, 2, 3, 4])                                               # doctest: +SKIP
>>> done = eng.step()            # one chunked-prefill forward; finished ones  # doctest: +SKIP
>>> done[0].hidden.shape, eng.release("r0")                                   # doctest: +SKIP
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..kv_cache import KVAllocator, KVPagePool, pages_needed
from ..kv_cache.prefix_cache import CachingKVAllocator
from ..lora import LoRAPool, LoRARequest
from ..models import load_model
from .config import EngineConfig
from .isolation import describe, isolate
from .kv_pool import kv_page_pool, make_kv_pool
from .model_runner import ForwardBatch, ModelRunner
from .prefix_caching import PrefixCacheStats, PrefixCaching, request_salt
from .proposers import ProposerPrefill, load_proposer_model
from .tensor_parallel import TensorParallelRanks, TensorParallelRunner, rank_lora_pool, start_shared_ranks

log = logging.getLogger(__name__)
LayerCallback = Callable[[int], None]
TARGET = "target"     # the target model's KV, as the hooks and a KV transfer name it


@dataclass(slots=True, eq=False)
class PrefillRequest:
    request_id: str
    token_ids: list[int]              # prompt[:-1]: the KV this prefill produces
    last_token: int | None = None     # prompt[-1]: the MTP head's last row reads it
    cache_salt: str | None = None     # prefixes are shared only under the same salt
    lora: LoRARequest | None = None   # its adapter (None: the base model)
    lora_slot: int = 0                # the adapter's slot while it holds it
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0               # tokens whose KV came from the prefix cache (full pages)
    # prefix caching: the keys of its full pages; its first num_published pages are in the
    # cache (the num_cached // page_size it took, then those it published)
    page_keys: list[bytes] = field(default_factory=list)
    num_published: int = 0
    hidden: torch.Tensor | None = None   # pre-norm hidden state of the last token, when done

    @property
    def done(self) -> bool:
        return self.num_computed == len(self.token_ids)


class PrefillHooks:
    """What a KV messenger sees of the prefill engine (all on the engine's thread)."""

    def on_admit(self, req: PrefillRequest) -> None:
        """Pages were allocated for ``req`` (``req.pages``, in sequence order); its first
        ``req.num_cached`` tokens' KV (target and proposer) came from the prefix cache and
        is final: no forward computes it."""

    def before_forward(self, chunks: list[tuple[PrefillRequest, int]],
                       model: str = TARGET) -> LayerCallback | None:
        """A forward of ``model`` (the target, or the proposer's KV name) computes each
        request's tokens up to ``end`` (exclusive); the returned callable is told after
        each layer."""
        return None

    def on_prefilled(self, req: PrefillRequest) -> None:
        """``req``'s last chunk ran; ``req.hidden`` is set."""


class PrefillEngine:
    def __init__(self, model, pool: KVPagePool, allocator: KVAllocator,
                 max_num_batched_tokens: int = 512, max_num_seqs: int = 64,
                 hooks: PrefillHooks | None = None,
                 proposer: tuple[str, ProposerPrefill] | None = None,
                 prefix: PrefixCaching | None = None, lora_pool: LoRAPool | None = None,
                 ranks: TensorParallelRanks | None = None):
        """``proposer``: (its KV name, the filler of its KV) with speculation;
        ``prefix``: prefix caching on ``allocator`` (a :class:`CachingKVAllocator`);
        ``lora_pool``: the adapter slots requests' adapters load into (None: no LoRA);
        ``ranks``: the other tensor-parallel ranks (``model`` and ``pool`` are then rank
        0's share)."""
        self.model, self.pool, self.allocator = model, pool, allocator
        self.prefix, self.lora_pool = prefix, lora_pool
        self.proposer_name, self.proposer = proposer or (None, None)
        self.tp_group = ranks.group if ranks is not None else None
        # every rank's KV pool, rank 0's first: the other ranks' are mapped from shared memory
        self.rank_pools = [pool] + (ranks.pools if ranks is not None else [])
        if self.tp_group is None:
            self.runner = ModelRunner(model, pool, lora_pool)
        else:
            self.runner = TensorParallelRunner(model, pool, self.tp_group, lora_pool)
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.hooks = hooks or PrefillHooks()
        self.waiting: deque[PrefillRequest] = deque()
        self.running: list[PrefillRequest] = []        # admission order, pages allocated
        self.finished: dict[str, PrefillRequest] = {}  # holding pages until released
        self._failed: list[tuple[str, str]] = []

    @classmethod
    def from_config(cls, config: EngineConfig, hooks: PrefillHooks | None = None) -> "PrefillEngine":
        """Build from an :class:`EngineConfig`; with ``config.speculative``
        the proposer's KV is filled as well."""
        config.validate()
        model = load_model(config.model_dir, config.dtype, config.device)
        dtype = model.embed_tokens.weight.dtype
        ranks = start_shared_ranks(config, model) if config.tensor_parallel_size > 1 else None
        try:   # a failure here stops the ranks and removes their pool files
            pool, allocator = make_kv_pool(config, model.rank_config, dtype)
            proposer, spec = None, config.speculative
            if spec is not None and spec.has_kv:   # ngram has no KV to fill
                p = load_proposer_model(spec, model, config.dtype, config.device)
                proposer = (spec.kv_name, ProposerPrefill(
                    p, model, kv_page_pool(config, p.config, pool.num_pages, dtype)))
            cached_pools = [pool] + ([proposer[1].pool] if proposer is not None else [])
            prefix = (PrefixCaching.for_config(config, allocator, cached_pools)
                      if isinstance(allocator, CachingKVAllocator) else None)
            lora_pool = rank_lora_pool(config, model, config.tensor_parallel_size, 0)
            if ranks is not None:
                ranks.ready()
        except BaseException:
            if ranks is not None:
                ranks.stop()
            raise
        return cls(model, pool, allocator, config.max_num_batched_tokens,
                   config.max_num_seqs, hooks, proposer, prefix, lora_pool, ranks)

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (they also end when this process does)."""
        if self.tp_group is not None:
            self.tp_group.stop()

    # -- requests -------------------------------------------------------------------------
    def add(self, request_id: str, token_ids: list[int], last_token: int | None = None,
            cache_salt: str | None = None, lora: LoRARequest | None = None) -> PrefillRequest:
        """Prefill ``token_ids`` (a prompt without its last token, ``last_token``, which
        the MTP head's last row needs); ``cache_salt``: its cached prefixes are shared
        only with requests of the same salt (and adapter); ``lora``: the adapter its KV
        is computed under (its slot is taken now: an adapter that does not load, or a
        full pool, raises before the request is queued)."""
        if not token_ids:
            raise ValueError("nothing to prefill: a one-token prompt goes straight to decode")
        if self._find(request_id) is not None:
            raise ValueError(f"request_id {request_id!r} is already in use")
        need = pages_needed(len(token_ids), self.pool.page_size)
        if need > self.allocator.num_pages:
            raise ValueError(f"prefill of {len(token_ids)} tokens needs {need} KV pages, the "
                             f"prefill pool has {self.allocator.num_pages}")
        if last_token is None and self.proposer is not None and self.proposer.reads_next_token:
            raise ValueError("the MTP head's KV needs the prompt's last token (last_token)")
        if lora is not None and self.lora_pool is None:
            raise ValueError(f"request names LoRA adapter {lora.name!r} but LoRA is off "
                             "(max_loras=0); allowed: no adapter, or max_loras >= 1")
        req = PrefillRequest(request_id, list(token_ids), last_token, cache_salt, lora)
        if self.prefix is not None:
            known = req.token_ids + ([last_token] if last_token is not None else [])
            req.page_keys = self.prefix.keys(known, request_salt(cache_salt, lora))
        if lora is not None:
            req.lora_slot = self.lora_pool.acquire(lora)
        self.waiting.append(req)
        return req

    def release(self, request_id: str) -> None:
        """Free a finished prefill's pages (its transfer completed); the pages it
        published stay cached."""
        req = self.finished.pop(request_id)
        self._free(req)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (failed, cancelled, its transfer failed): what it
        alone published leaves the cache, its pages are freed."""
        req = self._find(request_id)
        if req is None:
            return False
        for queue in (self.waiting, self.running):
            if req in queue:
                queue.remove(req)
        self.finished.pop(request_id, None)
        if self.prefix is not None and req.pages:
            self.prefix.withdraw_pages(req.pages, req.num_cached // self.pool.page_size,
                                       req.num_published)
        self._free(req)
        return True

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return PrefixCacheStats.of(self.prefix) if self.prefix is not None else None

    def reset_prefix_cache(self) -> int:
        """Drop every cached page (held pages stay with their requests); returns how many
        were cached."""
        return self.prefix.reset() if self.prefix is not None else 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[PrefillRequest]:
        """Admit what fits, run one chunked-prefill forward; returns requests whose
        prefill just finished (they keep their pages until :meth:`release`). A request
        whose part of the forward raises is dropped alone (see :meth:`take_failed`). With
        tensor-parallel ranks, a broken group (a rank died) raises
        :class:`~..parallel.group.RankFailed`, before the step or after the one it broke
        in: this engine cannot prefill until it is started anew."""
        if self.tp_group is not None:
            self.tp_group.check()
        self._admit()
        chunks, budget = [], self.max_num_batched_tokens
        for req in self.running:
            if budget == 0:
                break
            n = min(len(req.token_ids) - req.num_computed, budget)
            chunks.append((req, req.num_computed + n))
            budget -= n
        if not chunks:
            return []
        done = [r for r in isolate(chunks, self._forward, self._fail) if r is not None]
        if self.tp_group is not None:
            self.tp_group.check()
        return done

    def take_failed(self) -> list[tuple[str, str]]:
        """``(request_id, why)`` of the requests dropped since the last call (pages freed)."""
        failed, self._failed = self._failed, []
        return failed

    def _forward(self, chunks: list[tuple[PrefillRequest, int]]) -> list[PrefillRequest]:
        on_layer_done = self.hooks.before_forward(chunks)
        batch = ForwardBatch([r.token_ids[r.num_computed:end] for r, end in chunks],
                             [r.num_computed for r, _ in chunks], [r.pages for r, _ in chunks],
                             [r.lora_slot for r, _ in chunks] if self.lora_pool else None)
        inputs, hidden = self.runner.forward(batch, on_layer_done=on_layer_done)
        if self.proposer is not None:
            next_ids = ([_shifted(r, end) for r, end in chunks]
                        if self.proposer.reads_next_token else None)
            self.proposer.run(batch, next_ids, hidden,
                              self.hooks.before_forward(chunks, self.proposer_name))
        last = inputs.last_rows.tolist()
        done = []
        for i, (req, end) in enumerate(chunks):   # nothing above changed a request's state
            req.num_computed = end
            self._publish(req)     # target and proposer KV of the chunk are both written
            if req.done:
                req.hidden = hidden[last[i]].clone()
                self.running.remove(req)
                self.finished[req.request_id] = req
                done.append(req)
                try:
                    self.hooks.on_prefilled(req)
                except Exception as exc:
                    self._fail((req, end), exc)
                    done.pop()
        return done

    def _fail(self, chunk: tuple[PrefillRequest, int], exc: Exception) -> None:
        req = chunk[0]
        log.error("prefill of %s failed; the others go on", req.request_id, exc_info=exc)
        self.abort(req.request_id)
        self._failed.append((req.request_id, f"the prefill failed ({describe(exc)})"))

    def _admit(self) -> None:
        # all pages up front, oldest first (FIFO: a large request is not starved)
        ps = self.pool.page_size
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            need = pages_needed(len(req.token_ids), ps)
            # the last prefilled token is always computed: its hidden state is the context
            queried = (len(req.token_ids) - 1) // ps
            cached = self.prefix.take(req.page_keys[:queried]) if self.prefix is not None else []
            fresh = self.allocator.try_alloc(need - len(cached))
            if fresh is None:
                if cached:
                    self.allocator.free(cached)
                break
            req.pages = cached + fresh
            req.num_computed = req.num_cached = len(cached) * ps
            req.num_published = len(cached)
            if self.prefix is not None:
                self.prefix.count_lookup(queried, len(cached))
            self.running.append(self.waiting.popleft())
            self.hooks.on_admit(req)

    def _publish(self, req: PrefillRequest) -> None:
        if self.prefix is None:
            return
        known = len(req.token_ids) + (req.last_token is not None)
        n = self.prefix.num_publishable(req.num_computed, known)
        if n > req.num_published:
            self.prefix.publish_pages(req.pages, req.page_keys, req.num_published, n)
            req.num_published = n

    def _find(self, request_id: str) -> PrefillRequest | None:
        if request_id in self.finished:
            return self.finished[request_id]
        return next((r for r in (*self.waiting, *self.running) if r.request_id == request_id), None)

    def _free(self, req: PrefillRequest) -> None:
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
        if req.lora_slot:
            self.lora_pool.release(req.lora_slot)
            req.lora_slot = 0


def _shifted(req: PrefillRequest, end: int) -> list[int]:
    """The chunk's tokens one ahead (t_{i+1} for row i), as the MTP head reads them."""
    nxt = req.token_ids[req.num_computed + 1:end + 1]
    if end == len(req.token_ids):
        nxt.append(req.last_token)
    return nxt
