"""Transfer plans: which bytes of which page move from which prefill rank to which
decode rank, as pure functions of the two sides' geometry.

Both sides compute the same plan from the destination descriptor: the sender to know
what to send, the receiver to know what each arriving operation is and how many to
expect. Nothing here touches memory or the network.

An *operation* is one contiguous byte range on both sides (one UCX message). Its
index in the plan is its identity on the wire. The order is layer-major, so a layer's
operations have consecutive indices:

    for model, for layer, for (dst rank, src rank) pair, for unit (page or run), for piece

A *unit* is one page, or, when a pair moves whole pages, a run of pages that are
consecutive in the destination pool (capped at ``max_run_pages``). A *piece* is the
contiguous part of a page one pair moves: the whole page, the K and V halves of a
head range (HND), or one token's head range of K or V (NHD).

>>> spec = ModelSpec("target", num_layers=2, num_kv_heads=8, head_dim=128, page_size=16,
...                  dtype="bfloat16")
>>> plan = plan_transfer((spec,), page_ids=[4, 5, 6, 9], num_tokens=60,
...                      src=ShardScheme(1), dst=ShardScheme(1), max_run_pages=16)
>>> plan.num_ops, plan.layer_ops[0].npages.tolist()   # runs [4,5,6] and [9], per layer
(4, [3, 1])
>>> plan_transfer((spec,), [4, 5, 6, 9], 60, ShardScheme(2), ShardScheme(1)).num_ops
32
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import numpy as np

# rdma imports nothing of tandem (the layer order), so it holds its own copy of
# tandem.backends.kv_cache.pages' names and page count; tests/rdma/test_plan.py holds
# the two equal. The order is the wire's layout code (wire.py).
KV_LAYOUTS = ("HND", "NHD")

# bytes per element; the transfer moves bytes and never needs the dtype itself
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "uint8": 1, "int8": 1}


def pages_needed(num_tokens: int, page_size: int) -> int:
    """ceil(num_tokens / page_size).

    >>> pages_needed(33, 16)
    3
    """
    return -(-num_tokens // page_size)


@dataclass(frozen=True, slots=True)
class ShardScheme:
    """How one side shards KV heads over its tensor-parallel ranks.

    Ranks form ``replica_sets`` groups of ``tp_size // replica_sets`` consecutive ranks;
    each group holds all KV heads, split evenly by head range among its ranks. Plain
    tensor parallelism is one set; replicated KV (MLA-style, every rank holds
    everything) is ``replica_sets == tp_size``.

    >>> s = ShardScheme(tp_size=4, replica_sets=2)
    >>> [s.head_range(r, num_kv_heads=8) for r in range(4)]
    [(0, 4), (4, 8), (0, 4), (4, 8)]
    """
    tp_size: int = 1
    replica_sets: int = 1

    def __post_init__(self):
        if self.tp_size < 1 or self.replica_sets < 1 or self.tp_size % self.replica_sets:
            raise ValueError(f"ShardScheme(tp_size={self.tp_size}, replica_sets="
                             f"{self.replica_sets}): need tp_size >= 1 and replica_sets "
                             "a divisor of tp_size")

    @property
    def ranks_per_set(self) -> int:
        return self.tp_size // self.replica_sets

    def replica_set(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.ranks_per_set

    def ranks_of_set(self, replica_set: int) -> range:
        start = replica_set * self.ranks_per_set
        return range(start, start + self.ranks_per_set)

    def heads_per_rank(self, num_kv_heads: int) -> int:
        if num_kv_heads % self.ranks_per_set:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split over "
                             f"{self.ranks_per_set} ranks per replica set")
        return num_kv_heads // self.ranks_per_set

    def head_range(self, rank: int, num_kv_heads: int) -> tuple[int, int]:
        """Global KV head range ``[lo, hi)`` that ``rank`` holds."""
        self._check_rank(rank)
        n = self.heads_per_rank(num_kv_heads)
        lo = (rank % self.ranks_per_set) * n
        return lo, lo + n

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} out of range 0..{self.tp_size - 1}")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Geometry of one model's KV pool (unsharded head count). ``leader_only``: the model
    runs on rank 0 alone on either side (a draft model or MTP head beside a
    tensor-parallel target), so rank 0 holds its KV whole whatever the sides' sharding."""
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "bfloat16"
    kv_layout: str = "HND"
    leader_only: bool = False

    def __post_init__(self):
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout {self.kv_layout!r} is not supported; allowed: "
                             f"{', '.join(KV_LAYOUTS)}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; allowed: "
                             f"{', '.join(DTYPE_SIZES)}")
        for f in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}={getattr(self, f)} is invalid; allowed: >= 1")
        if not self.name or len(self.name.encode()) > 255:
            raise ValueError("model name must be 1..255 bytes")

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def split(self, scheme: "ShardScheme") -> "ShardScheme":
        """How a side sharded as ``scheme`` holds this model's KV.

        >>> ModelSpec("draft", 2, 2, 8, 4, leader_only=True).split(ShardScheme(4))
        ShardScheme(tp_size=1, replica_sets=1)
        """
        return ShardScheme(1) if self.leader_only else scheme

    def heads_per_rank(self, scheme: "ShardScheme") -> int:
        """KV heads of this model a rank of a side sharded as ``scheme`` holds."""
        return self.split(scheme).heads_per_rank(self.num_kv_heads)

    def page_shape(self, heads: int) -> tuple[int, ...]:
        """One page of one layer: [2, H, page_size, D] (HND) or [2, page_size, H, D] (NHD)."""
        if self.kv_layout == "HND":
            return (2, heads, self.page_size, self.head_dim)
        return (2, self.page_size, heads, self.head_dim)

    def page_bytes(self, heads: int) -> int:
        return 2 * heads * self.page_size * self.head_dim * self.itemsize

    def pool_bytes(self, heads: int, num_pages: int) -> int:
        return self.num_layers * num_pages * self.page_bytes(heads)


@dataclass(frozen=True, slots=True)
class Piece:
    """A contiguous byte range of one page: offsets from each side's page start."""
    src_off: int
    dst_off: int
    nbytes: int


def page_pieces(kv_layout: str, src_heads: tuple[int, int], dst_heads: tuple[int, int],
                heads: tuple[int, int], page_size: int, head_dim: int,
                itemsize: int) -> list[Piece]:
    """Contiguous pieces that move global KV heads ``heads`` of one page from a rank
    holding ``src_heads`` to a rank holding ``dst_heads``.

    HND keeps a head range contiguous per K and V (two pieces, one if the range is the
    whole page on both sides); NHD interleaves heads within each token, so a partial
    head range is one piece per token per K/V.

    >>> len(page_pieces("HND", (0, 8), (0, 8), (0, 8), 16, 128, 2))
    1
    >>> len(page_pieces("HND", (0, 8), (0, 4), (0, 4), 16, 128, 2))
    2
    >>> len(page_pieces("NHD", (0, 8), (0, 4), (0, 4), 16, 128, 2))
    32
    """
    return _box_pieces(_page_box(kv_layout, src_heads, dst_heads, heads, page_size, head_dim),
                       itemsize)


def num_page_pieces(kv_layout: str, src_heads: tuple[int, int], dst_heads: tuple[int, int],
                    heads: tuple[int, int], page_size: int, head_dim: int) -> int:
    """``len(page_pieces(...))`` without building them (O(1): for cost checks).

    >>> num_page_pieces("NHD", (0, 8), (0, 4), (0, 4), 1 << 16, 128)
    131072
    """
    dims = _page_box(kv_layout, src_heads, dst_heads, heads, page_size, head_dim)
    n = 1
    for dm in dims[:_merged_from(dims)]:
        n *= dm[4]
    return n


def _page_box(kv_layout, src_heads, dst_heads, heads, page_size, head_dim):
    lo, hi = heads
    if not (src_heads[0] <= lo < hi <= src_heads[1] and dst_heads[0] <= lo < hi <= dst_heads[1]):
        raise ValueError(f"heads {heads} not held by both sides {src_heads}, {dst_heads}")
    hs, hd = src_heads[1] - src_heads[0], dst_heads[1] - dst_heads[0]
    kv = (2, 2, 0, 0, 2)
    head = (hs, hd, lo - src_heads[0], lo - dst_heads[0], hi - lo)
    tok = (page_size, page_size, 0, 0, page_size)
    dim = (head_dim, head_dim, 0, 0, head_dim)
    if kv_layout == "HND":
        return [kv, head, tok, dim]
    if kv_layout == "NHD":
        return [kv, tok, head, dim]
    raise ValueError(f"kv_layout {kv_layout!r} is not supported; allowed: {', '.join(KV_LAYOUTS)}")


def _merged_from(dims) -> int:
    """The innermost dims the box covers fully on both sides merge into one piece:
    the index of the outermost of them."""
    k = len(dims) - 1
    while k > 0 and dims[k][0] == dims[k][1] == dims[k][4]:
        k -= 1
    return k


def _box_pieces(dims, itemsize: int) -> list[Piece]:
    """Maximal contiguous pieces of a box inside two row-major arrays of the same rank.

    ``dims`` lists, outermost first, ``(src_size, dst_size, src_start, dst_start, count)``.
    """
    src_strides, dst_strides, s, d = [], [], 1, 1
    for src_size, dst_size, *_ in reversed(dims):
        src_strides.append(s)
        dst_strides.append(d)
        s, d = s * src_size, d * dst_size
    src_strides.reverse()
    dst_strides.reverse()
    k = _merged_from(dims)
    piece = dims[k][4] * src_strides[k]
    pieces = []
    for idx in itertools.product(*(range(dm[4]) for dm in dims[:k])):
        src_off = sum((dims[i][2] + j) * src_strides[i] for i, j in enumerate(idx))
        dst_off = sum((dims[i][3] + j) * dst_strides[i] for i, j in enumerate(idx))
        src_off += dims[k][2] * src_strides[k]
        dst_off += dims[k][3] * dst_strides[k]
        pieces.append(Piece(src_off * itemsize, dst_off * itemsize, piece * itemsize))
    return pieces


def page_runs(page_ids, max_run_pages: int) -> list[tuple[int, int]]:
    """Runs ``(first index, length)`` of consecutive page ids, at most ``max_run_pages`` long.

    >>> page_runs([3, 4, 5, 9, 10, 2], max_run_pages=2)
    [(0, 2), (2, 1), (3, 2), (5, 1)]
    """
    if max_run_pages < 1:
        raise ValueError(f"max_run_pages={max_run_pages} is invalid; allowed: >= 1")
    runs, start = [], 0
    for i in range(1, len(page_ids) + 1):
        if (i == len(page_ids) or page_ids[i] != page_ids[i - 1] + 1
                or i - start == max_run_pages):
            runs.append((start, i - start))
            start = i
    return runs


def assign_replica_sets(src: ShardScheme, dst: ShardScheme, seed: int) -> list[int]:
    """For each destination replica set, the source replica set that feeds it.

    A random permutation of the source sets, repeated: every source set sends when
    there are at least as many destination sets, and the choice is the same on every
    process that knows ``seed``.

    >>> sorted(assign_replica_sets(ShardScheme(4, 4), ShardScheme(4, 4), seed=7))
    [0, 1, 2, 3]
    """
    order = list(range(src.replica_sets))
    random.Random(seed).shuffle(order)
    return [order[k % len(order)] for k in range(dst.replica_sets)]


@dataclass(frozen=True, slots=True)
class ShardPair:
    src_rank: int
    dst_rank: int
    heads: tuple[int, int]   # global KV head range moved between them


def shard_pairs(src: ShardScheme, dst: ShardScheme, num_kv_heads: int,
                seed: int = 0) -> list[ShardPair]:
    """Every (source rank, destination rank) pair that moves heads, sorted by (dst, src).

    >>> [(p.src_rank, p.dst_rank, p.heads) for p in shard_pairs(ShardScheme(2), ShardScheme(1), 8)]
    [(0, 0, (0, 4)), (1, 0, (4, 8))]
    >>> [(p.src_rank, p.dst_rank, p.heads) for p in shard_pairs(ShardScheme(1), ShardScheme(2), 8)]
    [(0, 0, (0, 4)), (0, 1, (4, 8))]
    """
    feeds = assign_replica_sets(src, dst, seed)
    pairs = []
    for dst_rank in range(dst.tp_size):
        d_lo, d_hi = dst.head_range(dst_rank, num_kv_heads)
        for src_rank in src.ranks_of_set(feeds[dst.replica_set(dst_rank)]):
            s_lo, s_hi = src.head_range(src_rank, num_kv_heads)
            lo, hi = max(s_lo, d_lo), min(s_hi, d_hi)
            if lo < hi:
                pairs.append(ShardPair(src_rank, dst_rank, (lo, hi)))
    return pairs


@dataclass(frozen=True, slots=True)
class LayerOps:
    """One model's operations for one layer, in op order; the same for every layer.

    ``first``/``npages`` index the sequence's page list; offsets are from the start of
    page ``first`` in each side's pool (layer and page base added by the caller).
    """
    src_rank: np.ndarray  # int32
    dst_rank: np.ndarray  # int32
    first: np.ndarray     # int64: index of the unit's first page in the page list
    npages: np.ndarray    # int64: pages in the unit
    src_off: np.ndarray   # int64
    dst_off: np.ndarray   # int64
    nbytes: np.ndarray    # int64

    def __len__(self) -> int:
        return len(self.nbytes)


def layer_ops(spec: ModelSpec, page_ids, src: ShardScheme, dst: ShardScheme,
              max_run_pages: int = 1, seed: int = 0) -> LayerOps:
    """The operations that move one layer of ``page_ids`` (destination page ids)."""
    src, dst = spec.split(src), spec.split(dst)
    cols = {k: [] for k in LayerOps.__slots__}
    runs = page_runs(list(page_ids), max_run_pages)
    for pair in shard_pairs(src, dst, spec.num_kv_heads, seed):
        s_heads = src.head_range(pair.src_rank, spec.num_kv_heads)
        d_heads = dst.head_range(pair.dst_rank, spec.num_kv_heads)
        pieces = page_pieces(spec.kv_layout, s_heads, d_heads, pair.heads, spec.page_size,
                             spec.head_dim, spec.itemsize)
        whole = (len(pieces) == 1 and pieces[0].nbytes == spec.page_bytes(s_heads[1] - s_heads[0])
                 == spec.page_bytes(d_heads[1] - d_heads[0]))
        units = runs if whole else [(i, 1) for i in range(len(page_ids))]
        first = np.repeat(np.array([u[0] for u in units], dtype=np.int64), len(pieces))
        npages = np.repeat(np.array([u[1] for u in units], dtype=np.int64), len(pieces))
        n = len(first)
        tile = lambda xs: np.tile(np.array(xs, dtype=np.int64), len(units))
        cols["src_rank"].append(np.full(n, pair.src_rank, dtype=np.int32))
        cols["dst_rank"].append(np.full(n, pair.dst_rank, dtype=np.int32))
        cols["first"].append(first)
        cols["npages"].append(npages)
        cols["src_off"].append(tile([p.src_off for p in pieces]))
        cols["dst_off"].append(tile([p.dst_off for p in pieces]))
        # a run of whole pages is one piece of npages pages
        cols["nbytes"].append(tile([p.nbytes for p in pieces]) * (npages if whole else 1))
    empty = {"src_rank": np.int32, "dst_rank": np.int32}
    return LayerOps(**{k: (np.concatenate(v) if v else np.zeros(0, empty.get(k, np.int64)))
                       for k, v in cols.items()})


@dataclass(frozen=True, slots=True)
class OpRef:
    """What one operation index names: a KV op (model, layer, row of LayerOps) or a
    context blob (``model == -1``, ``row`` = blob index)."""
    model: int
    layer: int
    row: int


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """All operations of one transfer; ``num_ops`` is what the receiver's counter expects."""
    models: tuple[ModelSpec, ...]
    layer_ops: tuple[LayerOps, ...]
    model_base: tuple[int, ...]     # first op index of each model
    context_nbytes: tuple[int, ...]
    num_kv_ops: int

    @property
    def num_ops(self) -> int:
        return self.num_kv_ops + len(self.context_nbytes)

    def op_index(self, model: int, layer: int, row: int) -> int:
        return self.model_base[model] + layer * len(self.layer_ops[model]) + row

    def context_op(self, i: int) -> int:
        return self.num_kv_ops + i

    def locate(self, op: int) -> OpRef:
        """Inverse of :meth:`op_index` / :meth:`context_op`; raises on an unknown index."""
        if not 0 <= op < self.num_ops:
            raise IndexError(f"op {op} out of range 0..{self.num_ops - 1}")
        if op >= self.num_kv_ops:
            return OpRef(-1, -1, op - self.num_kv_ops)
        m = int(np.searchsorted(self.model_base, op, side="right")) - 1
        layer, row = divmod(op - self.model_base[m], len(self.layer_ops[m]))
        return OpRef(m, layer, row)

    def context_offset(self, i: int) -> int:
        return sum(self.context_nbytes[:i])


def plan_transfer(models, page_ids, num_tokens: int, src: ShardScheme, dst: ShardScheme,
                  max_run_pages: int = 1, context_nbytes=(), seed: int = 0) -> TransferPlan:
    """The plan for moving ``num_tokens`` tokens of KV held in destination pages ``page_ids``
    (the same ids in every model's pool) plus the context blobs."""
    models = tuple(models)
    if not models:
        raise ValueError("a transfer needs at least one model")
    if len({m.page_size for m in models}) != 1:
        raise ValueError("all models of a transfer share one page_size (they share page ids)")
    need = pages_needed(num_tokens, models[0].page_size)
    if num_tokens < 1 or need != len(page_ids):
        raise ValueError(f"{num_tokens} tokens need {need} pages, got {len(page_ids)}")
    ops, bases, total = [], [], 0
    for spec in models:
        lo = layer_ops(spec, page_ids, src, dst, max_run_pages, seed)
        ops.append(lo)
        bases.append(total)
        total += spec.num_layers * len(lo)
    if any(n < 1 for n in context_nbytes):
        raise ValueError(f"context blob sizes must be >= 1 byte, got {tuple(context_nbytes)}")
    return TransferPlan(models, tuple(ops), tuple(bases), tuple(int(n) for n in context_nbytes),
                        total)


def num_runs(page_ids, max_run_pages: int) -> int:
    """``len(page_runs(page_ids, max_run_pages))`` in O(pages) numpy.

    >>> num_runs([3, 4, 5, 9, 10, 2], max_run_pages=2)
    4
    """
    if max_run_pages < 1:
        raise ValueError(f"max_run_pages={max_run_pages} is invalid; allowed: >= 1")
    ids = np.asarray(page_ids, dtype=np.int64)
    if not len(ids):
        return 0
    cuts = np.flatnonzero(np.diff(ids) != 1) + 1
    segments = np.diff(np.concatenate(([0], cuts, [len(ids)])))
    return int((-(-segments // max_run_pages)).sum())


def count_layer_ops(spec: ModelSpec, page_ids, src: ShardScheme, dst: ShardScheme,
                    max_run_pages: int = 1, seed: int = 0) -> int:
    """``len(layer_ops(...))`` without building it: O(pages + rank pairs), whatever the
    page size. What a receiver of a descriptor checks costs against before planning.

    >>> spec = ModelSpec("t", 2, 8, 128, 16)
    >>> count_layer_ops(spec, [4, 5, 6, 9], ShardScheme(1), ShardScheme(1), 16)
    2
    """
    src, dst = spec.split(src), spec.split(dst)
    runs = None
    total = 0
    for pair in shard_pairs(src, dst, spec.num_kv_heads, seed):
        s_heads = src.head_range(pair.src_rank, spec.num_kv_heads)
        d_heads = dst.head_range(pair.dst_rank, spec.num_kv_heads)
        pieces = num_page_pieces(spec.kv_layout, s_heads, d_heads, pair.heads, spec.page_size,
                                 spec.head_dim)
        if s_heads == d_heads:     # whole pages: runs of them
            if runs is None:
                runs = num_runs(page_ids, max_run_pages)
            total += runs
        else:
            total += pieces * len(page_ids)
    return total


def count_ops(models, page_ids, src: ShardScheme, dst: ShardScheme, max_run_pages: int = 1,
              num_context: int = 0, seed: int = 0) -> tuple[int, int]:
    """``(plan.num_ops, the largest model's operations per layer)`` of the plan
    :func:`plan_transfer` would build, without building it."""
    total, widest = num_context, 0
    for spec in models:
        n = count_layer_ops(spec, page_ids, src, dst, max_run_pages, seed)
        total += spec.num_layers * n
        widest = max(widest, n)
    return total, widest


def ops_per_page(spec: ModelSpec, src: ShardScheme, dst: ShardScheme) -> float:
    """Operations per page per layer, over all ranks, without run coalescing."""
    return len(layer_ops(spec, [0], src, dst, max_run_pages=1))
