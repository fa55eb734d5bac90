"""The engine's side of automatic prefix caching: which keys a sequence's pages have,
what it takes from the cache when admitted, what it publishes after a step.

A sequence admitted with nothing computed takes the longest cached chain of its full
pages, stopping short of its last token (whose logits start decoding, so it is always
recomputed); it starts computing at the first page it lacks, so it never writes into
a page it shares. After a step it publishes each page whose KV is complete — the
target's and, with a draft model or MTP head, the proposer's too (same page ids, its
own pool): a hit then speculates from its first step. An MTP head's row ``i`` reads
token ``i + 1``, so a page's key includes the token after it.

The prefill engine of the disaggregated path keeps a cache of its own with the same
keys (:mod:`.prefill_engine`), through the methods here that work on keys and page
lists rather than on sequences.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..kv_cache.page_audit import PageAudit
from ..kv_cache.page_hash import page_keys, root_key
from ..kv_cache.prefix_cache import CachingKVAllocator
from ..lora.request import LoRARequest
from .config import EngineConfig
from .sequence import Sequence


def checkpoint_fingerprint(model_dir: str | os.PathLike) -> str:
    """Identifies a checkpoint's weights cheaply: its path, config and the size and
    modification time of every weight file (a rewritten checkpoint gets a new one)."""
    d = Path(model_dir).resolve()
    h = hashlib.blake2b(str(d).encode(), digest_size=16)
    for f in sorted(d.glob("*.json")) + sorted(d.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def model_fingerprint(config: EngineConfig) -> tuple:
    """What the KV of a token depends on besides the tokens: the target, its dtype, the
    proposer whose KV is cached alongside."""
    spec = config.speculative
    proposer = None
    if spec is not None and spec.has_kv:
        path = spec.draft_model if spec.method == "draft_target" else spec.mtp_head
        proposer = (spec.method, checkpoint_fingerprint(path))
    return (checkpoint_fingerprint(config.model_dir), config.dtype, proposer)


def request_salt(cache_salt: str | None, lora: LoRARequest | None = None):
    """What a request adds to its chain's root: its ``cache_salt``, and with an adapter
    the adapter's name and files (a KV computed under one adapter is another's, or the
    base model's, never; a rewritten adapter directory gets new keys). Without an
    adapter it is the salt alone, so the base model's keys do not change.

    >>> request_salt("s") == request_salt("s", LoRARequest("a", 1, "."))
    False
    """
    if lora is None:
        return cache_salt
    return (cache_salt, "lora", lora.name, checkpoint_fingerprint(lora.path))


def key_lookahead(spec) -> int:
    """Tokens after a page its KV depends on: an MTP head's row ``i`` reads token ``i + 1``."""
    return 1 if spec is not None and spec.enabled and spec.kv_name == "mtp" else 0


def prompt_page_keys(prompt: list[int], page_size: int, root: bytes, cache_salt: str | None,
                     lookahead: int = 0, lora: LoRARequest | None = None) -> list[bytes]:
    """The keys of a prompt's pages a cache can hold for it — its full pages short of the
    last token (whose logits start decoding) — for an engine whose :func:`model_root` is
    ``root``: what that engine's cache keys them by (``lora``: the request's adapter)."""
    n = (len(prompt) - 1) // page_size
    return page_keys(prompt[:n * page_size + lookahead], page_size,
                     root_key(root, request_salt(cache_salt, lora)), lookahead=lookahead)


def model_root(config: EngineConfig) -> bytes:
    """The one extra key an engine's chains start from: its model fingerprint and
    version, hashed. Another process (kv_transfer) that is told it roots a prompt's
    chain — with the request's salt — exactly as the engine does."""
    return root_key(model_fingerprint(config), config.model_version)


class CachedPageChanged(ValueError):
    """A cached page a request was given changed since it was published (the audit's
    finding): the request must compute its prompt afresh."""


@dataclass(slots=True)
class PrefixCaching:
    """Prefix caching on ``allocator`` for sequences of one engine; ``extra_keys`` (the
    model fingerprint and version) start every key chain, with the request's salt.

    The methods on page lists and keys (:meth:`keys`, :meth:`take`,
    :meth:`num_publishable`, :meth:`publish_pages`, :meth:`withdraw_pages`,
    :meth:`count_lookup`) are what the prefill engine uses for its requests;
    :meth:`match`, :meth:`publish` and :meth:`withdraw` apply them to the colocated
    engine's sequences. Nothing else withdraws from the allocator.
    """
    allocator: CachingKVAllocator
    page_size: int
    extra_keys: tuple
    lookahead: int = 0          # tokens after a page its KV depends on (MTP: 1)
    proposer_kv: bool = False   # a draft model's or MTP head's KV is cached too
    # checksums of published pages, checked on a share of hits (kv_audit; None: off)
    audit: PageAudit | None = None

    @classmethod
    def for_config(cls, config: EngineConfig, allocator: CachingKVAllocator,
                   pools: list = ()) -> "PrefixCaching":
        """The keys an engine of ``config`` makes: its model fingerprint and version, one
        token of lookahead with an MTP head, the proposer's KV cached with a KV proposer;
        with ``pools`` (the KV page pools the cache covers) and ``config.kv_audit`` > 0,
        published pages are checksummed and hits audited."""
        spec = config.speculative
        on = spec is not None and spec.enabled
        audit = PageAudit(list(pools), config.kv_audit, recompute_rate=config.kv_audit_recompute) \
            if pools and (config.kv_audit > 0 or config.kv_audit_recompute > 0) else None
        return cls(allocator, config.page_size, (model_root(config),),
                   lookahead=key_lookahead(spec), proposer_kv=on and spec.has_kv, audit=audit)

    # -- on keys and page lists -----------------------------------------------------------
    def keys(self, token_ids: list[int], cache_salt,
             known: list[bytes] = ()) -> list[bytes]:
        """Keys of ``token_ids``' full pages that have ``lookahead`` tokens after them;
        ``known``: the first ones, computed before (extended, not recomputed);
        ``cache_salt``: the request's :func:`request_salt`."""
        return page_keys(token_ids, self.page_size, root_key(*self.extra_keys, cache_salt),
                         known, self.lookahead)

    def take(self, keys: list[bytes]) -> list[int]:
        """The pages of the longest cached prefix of ``keys``, each now held once more —
        short of a page the audit found changed since it was published (that one leaves
        the cache unless another holder keeps it, and is computed afresh). A hit the
        recompute audit declines takes nothing: its pages are compared when republished."""
        pages = self.allocator.match(keys)
        if pages and self.audit is not None and self.audit.decline():
            self.allocator.free(pages)
            return []
        return self.audited(pages)

    def audited(self, pages: list[int]) -> list[int]:
        """``pages`` of a hit (held by the caller), cut before the first one the audit
        rejects; the rest are given back."""
        bad = self.audit.cut(pages) if self.audit is not None and pages else None
        if bad is None:
            return pages
        self.allocator.withdraw([pages[bad]])   # unpublished while only this hit holds it
        self.allocator.free(pages[bad:])
        return pages[:bad]

    def num_publishable(self, computed: int, num_tokens: int) -> int:
        """Full pages whose KV is complete when ``computed`` of ``num_tokens`` known tokens
        are (with lookahead, a page also needs the tokens after it)."""
        return min(computed, num_tokens - self.lookahead) // self.page_size

    def publish_pages(self, pages: list[int], keys: list[bytes], start: int, end: int) -> None:
        """Publish ``pages[start:end]`` under ``keys[start:end]`` (a key cached already
        leaves its page private)."""
        for p in range(start, end):
            if self.allocator.publish(pages[p], keys[p]):
                if self.audit is not None:
                    self.audit.record(pages[p])
            elif self.audit is not None and self.audit.recompute_rate > 0:
                self._compare(pages[p], keys[p])

    def _compare(self, fresh: int, key: bytes) -> None:
        """``fresh`` was computed for ``key``, which another page is cached under: if that
        page holds other KV, it leaves the cache and ``fresh`` takes its place."""
        held = self.allocator.match([key])
        if not held:
            return
        cached = held[0]
        if cached != fresh and not self.audit.agrees(cached, fresh):
            self.allocator.withdraw([cached])   # unpublished unless another sequence holds it
            self.allocator.free(held)
            held = []
            if self.allocator.publish(fresh, key):
                self.audit.record(fresh)
        self.allocator.free(held)

    def withdraw_pages(self, pages: list[int], start: int, end: int) -> int:
        """A request failed or was cancelled: what it published of ``pages[start:end]``
        that nobody else holds leaves the cache (pages another request shares stay).
        Returns how many pages left."""
        return self.allocator.withdraw(pages[start:end])

    def count_lookup(self, queried_pages: int, hit_pages: int) -> None:
        """An admitted request looked ``queried_pages`` up and found ``hit_pages``."""
        stats = self.allocator.stats
        stats.queried_pages += queried_pages
        stats.hit_pages += hit_pages

    # -- on the engine's sequences --------------------------------------------------------
    def _keys(self, seq: Sequence, num_pages: int) -> list[bytes]:
        if len(seq.page_keys) < num_pages:
            end = min(seq.num_tokens, num_pages * self.page_size + self.lookahead)
            # the root (salt, adapter) only matters for the first key of the chain
            salt = None if seq.page_keys else request_salt(seq.params.cache_salt, seq.lora)
            seq.page_keys = self.keys(seq.token_ids(0, end), salt, seq.page_keys)
        return seq.page_keys[:num_pages]

    def match(self, seq: Sequence) -> int | None:
        """Give a fresh ``seq`` the cached pages of its longest cached prefix; returns
        the tokens it need not compute (None: not fresh, its KV is there already, or it
        asked for its prompt's log-probabilities, which only computing the prompt gives)."""
        if seq.pages or seq.num_computed or seq.prompt_logprobs is not None:
            return None
        pages = self.take(self._keys(seq, (seq.num_tokens - 1) // self.page_size))
        if pages:
            seq.pages = pages
            seq.num_computed = seq.draft.computed = len(pages) * self.page_size
            seq.num_matched_pages = seq.num_published = len(pages)
        return len(pages) * self.page_size

    def admitted(self, seq: Sequence, hit_tokens: int) -> None:
        """``seq`` was admitted with ``hit_tokens`` from the cache: count the lookup."""
        self.count_lookup((seq.num_tokens - 1) // self.page_size, hit_tokens // self.page_size)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = hit_tokens

    def publish(self, seq: Sequence, proposer_done: int | None = None) -> None:
        """Publish ``seq``'s pages whose KV (target and proposer) is now complete;
        ``proposer_done``: how far the proposer's KV is right, when not
        ``seq.draft.computed`` (in the middle of a speculative step)."""
        done = seq.num_computed
        if self.proposer_kv:
            done = min(done, seq.draft.computed if proposer_done is None else proposer_done)
        n = self.num_publishable(done, seq.num_tokens)
        if n <= seq.num_published:
            return
        self.publish_pages(seq.pages, self._keys(seq, n), seq.num_published, n)
        seq.num_published = n

    def withdraw(self, seq: Sequence) -> None:
        """``seq`` failed or was cancelled: what it published that nobody else holds
        leaves the cache (pages another request shares stay)."""
        self.withdraw_pages(seq.pages, seq.num_matched_pages, seq.num_published)

    def reset(self) -> int:
        return self.allocator.reset()


@dataclass(slots=True, frozen=True)
class PrefixCacheStats:
    """The prefix cache since start, in tokens where vLLM counts tokens."""
    queried_tokens: int
    hit_tokens: int
    cached_pages: int
    evictions: int
    audited_pages: int = 0     # pages of hits whose checksum the audit recomputed
    corrupt_pages: int = 0     # ... found changed since publication (never served)
    recompared_pages: int = 0  # pages of declined hits recomputed and compared (--kv-audit-recompute)
    disagreeing_pages: int = 0  # ... whose cached KV was other KV (dropped, never served again)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @classmethod
    def of(cls, prefix: PrefixCaching) -> "PrefixCacheStats":
        s, a = prefix.allocator.stats, prefix.allocator
        audit = prefix.audit
        return cls(s.queried_pages * prefix.page_size, s.hit_pages * prefix.page_size, a.num_cached,
                   s.evictions, audit.checked_pages if audit else 0, audit.mismatches if audit else 0,
                   audit.compared_pages if audit else 0, audit.disagreements if audit else 0)
