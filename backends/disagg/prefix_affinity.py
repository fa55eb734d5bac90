"""Cache-aware choice of a prefill endpoint: the one whose prefix cache likely holds
the longest prefix of the prompt, balanced against how much work it already has.
Pure and torch-free: whoever calls passes the time.

A decode server with several ``--prefill-endpoints`` cannot see their caches, so it
keeps an approximate index, as SGLang's router keeps a radix tree per worker: per
endpoint, the page keys (:func:`~tandem.backends.kv_cache.page_hash.page_keys`, a hash
chain over the full pages of ``prompt[:-1]``) of the prompts it sent there, bounded
(``max_pages`` per endpoint, least recently used evicted; a chain is inserted tail
first, so a prefix's first pages are evicted last, as the prefill server's own
allocator frees them). A prompt's overlap with an endpoint is the number of leading
keys found there, in tokens.

Load is each endpoint's estimated backlog in tokens: every job adds the tokens it
leaves to compute there (prompt minus overlap), and the backlog drains at
``tokens_per_s`` (a prefill server acks at once, so nothing tells when it finished).
As NVIDIA Dynamo's KV router scores overlap against load, an endpoint's score is
``cache_weight * overlap_tokens - backlog_tokens``: with weight 1, the endpoint where
the job's KV is ready first (its backlog plus what it must compute is smallest). A hot
prefix so stays on its endpoint until that one's backlog exceeds the prefix's cost on
another, and then spills. Ties go to the least loaded, then round robin.

>>> a = PrefixAffinity(2, AffinityPolicy(page_size=16, tokens_per_s=1000))
>>> system = list(range(64))                          # a shared prefix of 4 pages
>>> p = a.plan(system + [7, 8], usable=[True, True], start=1, now=0.0)
>>> p.order, p.overlap_tokens                         # nothing cached: round robin
((1, 0), (0, 0))
>>> a.taken(p, 1, now=0.0)
>>> q = a.plan(system + [9, 10], usable=[True, True], start=0, now=1.0)
>>> q.order, q.overlap_tokens                         # endpoint 1 holds the prefix
((1, 0), (0, 64))
>>> a.forget(1)                                       # it failed: perhaps restarted empty
>>> a.plan(system + [9, 10], [True, True], 0, now=1.0).overlap_tokens
(0, 0)
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from ..kv_cache.page_hash import page_keys, root_key

CACHE_AWARE, ROUND_ROBIN = "cache_aware", "round_robin"
PREFILL_ROUTINGS = (CACHE_AWARE, ROUND_ROBIN)
_ROOT = root_key("tandem.prefix_affinity")


@dataclass(frozen=True, slots=True)
class AffinityPolicy:
    """The index's granularity (tokens per page: the decode server's, which its
    prefill servers' caches likely share), how much a cached token weighs against a
    token of backlog (0: least loaded only), how fast an endpoint works its backlog
    off, and the index's bound."""
    page_size: int = 16
    cache_weight: float = 1.0
    tokens_per_s: float = 5000.0
    max_pages: int = 16384       # keys kept per endpoint (16 B each, ~100 B with the LRU)

    def __post_init__(self):
        if self.page_size < 1:
            raise ValueError(f"prefill routing: page_size={self.page_size!r}; allowed: >= 1")
        if not self.cache_weight >= 0:
            raise ValueError(f"prefill routing: cache_weight={self.cache_weight!r}; allowed: >= 0")
        if not self.tokens_per_s > 0:
            raise ValueError(f"prefill routing: tokens_per_s={self.tokens_per_s!r}; allowed: > 0")
        if self.max_pages < 1:
            raise ValueError(f"prefill routing: max_pages={self.max_pages!r}; allowed: >= 1")


class PageLRU:
    """The page keys one endpoint was sent, least recently used first, at most ``cap``.

    >>> lru = PageLRU(cap=3)
    >>> lru.add([b"a", b"b"]); lru.add([b"x", b"y"])   # the older chain's tail b"b" goes
    >>> lru.match([b"a", b"b"]), lru.match([b"x", b"y", b"z"]), len(lru)
    (1, 2, 3)
    """

    __slots__ = ("cap", "_keys")

    def __init__(self, cap: int):
        self.cap, self._keys = cap, OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are held (a chain: the first miss ends the prefix)."""
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n

    def add(self, keys: Sequence[bytes]) -> None:
        """Hold ``keys`` (a prompt's chain), the first most recently used."""
        for k in reversed(keys):
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.cap:
            self._keys.popitem(last=False)

    def clear(self) -> None:
        self._keys.clear()


@dataclass(slots=True)
class Backlog:
    """Tokens an endpoint is estimated to have left to prefill, as of ``at`` (seconds).

    >>> b = Backlog()
    >>> b.add(3000, now=10.0, rate=1000.0); b.level(11.0, 1000.0), b.level(20.0, 1000.0)
    (2000.0, 0.0)
    """
    tokens: float = 0.0
    at: float = 0.0

    def level(self, now: float, rate: float) -> float:
        return max(0.0, self.tokens - rate * max(0.0, now - self.at))

    def add(self, tokens: float, now: float, rate: float) -> None:
        self.tokens, self.at = self.level(now, rate) + tokens, max(now, self.at)


def prompt_keys(input_ids: Sequence[int], page_size: int) -> list[bytes]:
    """The index's keys of a prompt: its full pages of ``input_ids[:-1]`` (what prefill
    computes; the last token is decode's).

    >>> len(prompt_keys(range(33), 16)), len(prompt_keys(range(32), 16))
    (2, 1)
    """
    ids = [int(t) for t in input_ids][:-1]
    return page_keys(ids, page_size, _ROOT)


def try_order(overlap_tokens: Sequence[float], load_tokens: Sequence[float], usable: Sequence[bool],
              start: int, cache_weight: float = 1.0, cache_aware: bool = True) -> tuple[int, ...]:
    """Endpoints in the order to try them: the usable ones best score first
    (``cache_weight * overlap - load``; ties to the least loaded, then round robin from
    ``start``), then the unusable ones (down) in round-robin order. Without
    ``cache_aware``: round robin over the usable ones, as a plain router does.

    >>> try_order([0, 0, 0], [0, 0, 0], [True] * 3, start=1)                  # round robin
    (1, 2, 0)
    >>> try_order([0, 512, 0], [0, 100, 0], [True] * 3, start=0)              # the cached prefix
    (1, 0, 2)
    >>> try_order([0, 512, 0], [0, 900, 50], [True] * 3, start=0)             # ... spills
    (0, 2, 1)
    >>> try_order([0, 512, 0], [0, 0, 0], [True, False, True], start=0)       # down: last
    (0, 2, 1)
    >>> try_order([0, 512, 0], [0, 0, 0], [True] * 3, start=2, cache_aware=False)
    (2, 0, 1)
    """
    n = len(usable)

    def rr(i: int) -> int:
        return (i - start) % n

    if cache_aware:
        def key(i):
            return (load_tokens[i] - cache_weight * overlap_tokens[i], load_tokens[i], rr(i))
    else:
        key = rr
    live = sorted((i for i in range(n) if usable[i]), key=key)
    return tuple(live + sorted((i for i in range(n) if not usable[i]), key=rr))


@dataclass(frozen=True, slots=True)
class Placement:
    """One job's plan: the order to try endpoints in, and what :meth:`PrefixAffinity.taken`
    records for the one that took it."""
    order: tuple[int, ...]
    keys: tuple[bytes, ...]
    overlap_tokens: tuple[int, ...]     # per endpoint
    prompt_tokens: int                  # what prefill computes without a cache


class PrefixAffinity:
    """The index and backlogs of ``num_endpoints`` endpoints (not thread-safe: the
    router holds its lock around each call)."""

    def __init__(self, num_endpoints: int, policy: AffinityPolicy = AffinityPolicy()):
        self.policy = policy
        self._index = [PageLRU(policy.max_pages) for _ in range(num_endpoints)]
        self._backlog = [Backlog() for _ in range(num_endpoints)]

    def plan(self, input_ids: Sequence[int], usable: Sequence[bool], start: int, now: float,
             keys: Sequence[bytes] | None = None) -> Placement:
        """Where to send a prompt (``keys``: its :func:`prompt_keys` at the policy's
        page size, when computed already: the router hashes outside its lock)."""
        page_size = self.policy.page_size
        if len(usable) != len(self._index):
            raise ValueError(f"{len(usable)} endpoints' health for {len(self._index)} endpoints")
        keys = tuple(prompt_keys(input_ids, page_size) if keys is None else keys)
        overlap = tuple(idx.match(keys) * page_size for idx in self._index)
        load = [b.level(now, self.policy.tokens_per_s) for b in self._backlog]
        order = try_order(overlap, load, usable, start, self.policy.cache_weight)
        return Placement(order, keys, overlap, max(0, len(input_ids) - 1))

    def taken(self, placement: Placement, endpoint: int, now: float) -> None:
        """Endpoint ``endpoint`` took the job: it now holds the prompt's pages and its work."""
        self._index[endpoint].add(placement.keys)
        self._backlog[endpoint].add(placement.prompt_tokens - placement.overlap_tokens[endpoint], now,
                                    self.policy.tokens_per_s)

    def forget(self, endpoint: int) -> None:
        """Endpoint ``endpoint`` failed: it may come back restarted, with an empty cache
        and queue, so nothing known about it is trusted."""
        self._index[endpoint].clear()
        self._backlog[endpoint] = Backlog()

    def pages(self, endpoint: int) -> int:
        return len(self._index[endpoint])

    def backlog_tokens(self, endpoint: int, now: float) -> float:
        return self._backlog[endpoint].level(now, self.policy.tokens_per_s)
