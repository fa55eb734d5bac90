"""The adapter slots: every loaded adapter's A and B, stacked per layer and module group,
so a batch's rows index them by slot.

The model fuses q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj``, so
the pool does too: a group's A is ``[slots, in, parts * max_rank]`` (each part's A side
by side) and its B ``[slots, parts * max_rank, out]`` block-diagonal (part ``j``'s B
maps its rank block onto its output columns), so one matmul pair gives the delta of the
fused output. An adapter of rank ``r`` fills the first ``parts * r`` columns (its
:meth:`LoRAPool.width`, what the deltas compute over), the rest stay zero; its scaling
is folded into B at load. Slot 0 stays zero: "no adapter".

With tensor parallelism each rank holds its share of every adapter (``slices``: each
projection's inputs and outputs the rank computes, backends/parallel/sharding.py); the
leader's pool takes slots, and the other ranks' pools :meth:`LoRAPool.mirror` what the
leader's slots hold, step by step, from the weights the leader read (no rank reads the
files again: they may have changed or gone since).

Slots are taken by name: a request acquires its adapter's slot (loading it into a free
one, or into the least recently used one no running request holds) and releases it when
it finishes; when every slot is held, acquiring another adapter is an error.

>>> from tandem.backends.models.config import ModelConfig
>>> cfg = ModelConfig("llama", 32, 8, 16, 1, 2, 1, 4)
>>> pool = LoRAPool(cfg, max_loras=2, max_rank=4)
>>> pool.A["qkv"][0].shape, pool.B["qkv"][0].shape      # layer 0: [slots, in, 3r], [slots, 3r, q+k+v]
(torch.Size([3, 8, 12]), torch.Size([3, 12, 16]))
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.config import ModelConfig
from .adapter import LoRAAdapter, load_adapter, module_shapes
from .request import LoRARequest

# the model's fused linear layers and the adapter modules each holds, in output order
GROUPS: dict[str, tuple[str, ...]] = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                                      "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


@dataclass(slots=True, frozen=True)
class LoRAStats:
    """The pool's counters since start, for metrics: the adapters in slots now (name ->
    running requests holding it), requests admitted per adapter, loads and evictions."""
    loaded: dict[str, int]
    requests: dict[str, int]
    loads: int
    evictions: int
    max_loras: int


@dataclass(slots=True)
class Slot:
    name: str
    path: str
    groups: frozenset[str]      # the module groups the adapter changes
    rank: int
    generation: int             # the pool's load count when it was loaded: which load this is
    adapter: LoRAAdapter | None  # as read (whole), for other ranks to cut their shares from
    refs: int = 0               # running requests holding it


@dataclass(slots=True, frozen=True)
class SlotContents:
    """What a slot holds, as another rank's pool mirrors it: the adapter, its files and
    which load of them (a name reloaded from the same files is another load)."""
    name: str
    path: str
    generation: int


def local_shapes(shapes: dict[str, tuple[int, int]],
                 slices: dict[str, tuple[slice, slice]]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection's share under ``slices`` (none: whole)."""
    def size(n: int, cut: slice) -> int:
        return len(range(n)[cut])
    return {m: (size(i, slices[m][0]), size(o, slices[m][1])) if m in slices else (i, o)
            for m, (i, o) in shapes.items()}


def lora_dtype(device: str | torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype adapters are held and computed in: fp32 on a CPU, where the deltas'
    small matmuls ran about 2x faster than in bf16 (oneDNN reorders a bf16 weight on every
    call; python -m tandem.client.bench.lora_ops), the model's own on a GPU."""
    return torch.float32 if torch.device(device).type == "cpu" else model_dtype


class LoRAPool:
    """``max_loras`` adapter slots (1..max_loras; 0 is "no adapter") of rank up to
    ``max_rank``, on ``device`` in ``dtype`` (:func:`lora_dtype`); ``slices``: a
    tensor-parallel rank's inputs and outputs of each projection (None: the whole model);
    ``keep_read``: keep each adapter as read (a leader's, whose ranks get it from there)."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 slices: dict[str, tuple[slice, slice]] | None = None, keep_read: bool = False):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras={max_loras}, max_lora_rank={max_rank}; allowed: integers >= 1")
        self.config, self.max_loras, self.max_rank = cfg, max_loras, max_rank
        self.device, self.dtype = torch.device(device), dtype
        self.slices, self.keep_read = slices or {}, keep_read
        shapes = self.shapes = local_shapes(module_shapes(cfg), self.slices)
        self.A: dict[str, list[torch.Tensor]] = {}
        self.B: dict[str, list[torch.Tensor]] = {}
        # per group, the output column where each module's part starts, and the end
        self.part_cols: dict[str, list[int]] = {}
        for g, modules in GROUPS.items():
            self.part_cols[g] = [0]
            for m in modules:
                self.part_cols[g].append(self.part_cols[g][-1] + shapes[m][1])
            fan_in = shapes[modules[0]][0]
            fan_out = sum(shapes[m][1] for m in modules)
            r = len(modules) * max_rank
            self.A[g] = [torch.zeros(max_loras + 1, fan_in, r, device=device, dtype=dtype)
                         for _ in range(cfg.num_hidden_layers)]
            self.B[g] = [torch.zeros(max_loras + 1, r, fan_out, device=device, dtype=dtype)
                         for _ in range(cfg.num_hidden_layers)]
        self.slots: dict[int, Slot] = {}
        self.by_name: dict[str, int] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()    # loaded, unheld: LRU first
        self.loads = self.evictions = 0
        self.requests: dict[str, int] = {}      # acquisitions per adapter name, since start

    # -- slots ------------------------------------------------------------------------
    def acquire(self, lora: LoRARequest) -> int:
        """The slot of ``lora``'s adapter, held once more (loaded first if it is not)."""
        slot = self.by_name.get(lora.name)
        if slot is not None and self.slots[slot].path != str(Path(lora.path)) and not self.slots[slot].refs:
            # the name was unloaded and loaded again from other files (the server's
            # registry): the new adapter is read first (a bad one leaves the old in
            # place), then it takes the idle old one's slot
            adapter = load_adapter(lora.name, lora.path, self.config, self.max_rank)
            self.unload(lora.name)
            slot = self._free_slot(lora.name)
            self.load(slot, adapter, str(Path(lora.path)))
        if slot is not None:
            if self.slots[slot].path != str(Path(lora.path)):
                raise ValueError(f"LoRA adapter {lora.name!r} is loaded from {self.slots[slot].path}, "
                                 f"not {lora.path}, and running requests hold it; one name, one adapter "
                                 "at a time: retry when they finish")
        else:
            adapter = load_adapter(lora.name, lora.path, self.config, self.max_rank)
            slot = self._free_slot(lora.name)
            self.load(slot, adapter, str(Path(lora.path)))
        self.slots[slot].refs += 1
        self.idle.pop(slot, None)
        self.requests[lora.name] = self.requests.get(lora.name, 0) + 1
        return slot

    def preload(self, lora: LoRARequest) -> int:
        """Load ``lora`` now (vLLM's ``/v1/load_lora_adapter``) without a request holding
        it: it stays until evicted or unloaded."""
        slot = self.acquire(lora)
        self.release(slot)
        self.requests[lora.name] -= 1       # a load, not a request
        return slot

    def unload(self, name: str) -> bool:
        """Drop adapter ``name`` from its slot (False: it is not loaded); an adapter that
        running requests hold stays, and this raises."""
        slot = self.by_name.get(name)
        if slot is None:
            return False
        if self.slots[slot].refs:
            raise ValueError(f"LoRA adapter {name!r} is held by {self.slots[slot].refs} running "
                             "request(s); unload it when they finish")
        del self.by_name[name], self.slots[slot]
        self.idle.pop(slot, None)
        return True

    def release(self, slot: int) -> None:
        """A request holding ``slot`` finished: unheld, it becomes evictable (LRU)."""
        s = self.slots[slot]
        s.refs -= 1
        if s.refs == 0:
            self.idle[slot] = None

    def _free_slot(self, name: str) -> int:
        for slot in range(1, self.max_loras + 1):
            if slot not in self.slots:
                return slot
        if not self.idle:
            held = ", ".join(sorted(s.name for s in self.slots.values()))
            raise ValueError(f"LoRA adapter {name!r}: all {self.max_loras} adapter slots are held by "
                             f"running requests ({held}); allowed: at most max_loras={self.max_loras} "
                             "adapters at once — retry when one finishes")
        slot, _ = self.idle.popitem(last=False)
        del self.by_name[self.slots.pop(slot).name]
        self.evictions += 1
        return slot

    def stats(self) -> LoRAStats:
        return LoRAStats({s.name: s.refs for s in self.slots.values()}, dict(self.requests),
                         self.loads, self.evictions, self.max_loras)

    def width(self, slot: int, group: str) -> int:
        """The columns of ``group``'s A (rows of its B) that ``slot``'s adapter fills."""
        return len(GROUPS[group]) * self.slots[slot].rank

    def groups(self, slot: int) -> frozenset[str]:
        return self.slots[slot].groups if slot else frozenset()

    def contents(self, slot: int) -> SlotContents:
        s = self.slots[slot]
        return SlotContents(s.name, s.path, s.generation)

    def adapter(self, slot: int) -> LoRAAdapter:
        """``slot``'s adapter as read (a pool made with ``keep_read``)."""
        adapter = self.slots[slot].adapter
        if adapter is None:
            raise ValueError("this LoRA pool does not keep the adapters it read (keep_read=False)")
        return adapter

    def mirror(self, slot: int, contents: SlotContents, adapter: LoRAAdapter) -> None:
        """Hold in ``slot`` what the leader's pool holds there (``adapter``, as the leader
        read it): a rank's pool, whose slots the leader takes."""
        old = self.by_name.pop(contents.name, None)
        if old is not None and old != slot:
            del self.slots[old]
        held = self.slots.get(slot)
        if held is not None:
            self.by_name.pop(held.name, None)
        self.load(slot, adapter, contents.path, contents.generation)

    # -- weights -----------------------------------------------------------------------
    def load(self, slot: int, adapter: LoRAAdapter, path: str = "", generation: int | None = None) -> None:
        """Write ``adapter`` into ``slot`` (its scaling folded into B, cut to this rank's
        share), replacing what was there; ``generation``: the leader's, when mirroring."""
        shapes, r = self.shapes, adapter.rank
        for g, modules in GROUPS.items():
            for layer in range(self.config.num_hidden_layers):
                A, B = self.A[g][layer][slot], self.B[g][layer][slot]
                A.zero_()
                B.zero_()
                col = 0
                for j, m in enumerate(modules):
                    out = shapes[m][1]
                    ab = adapter.weights.get((layer, m))
                    if ab is not None:
                        inputs, outputs = self.slices.get(m, (slice(None), slice(None)))
                        rows = slice(j * r, (j + 1) * r)
                        A[:, rows] = ab[0][:, inputs].T.to(A.dtype)
                        B[rows, col:col + out] = (ab[1][outputs].T.double() * adapter.scaling).to(B.dtype)
                    col += out
        groups = frozenset(g for g, ms in GROUPS.items() if adapter.target_modules & set(ms))
        self.loads += 1
        self.slots[slot] = Slot(adapter.name, path, groups, r,
                                self.loads if generation is None else generation,
                                adapter if self.keep_read else None)
        self.by_name[adapter.name] = slot

    def weights(self, layer: int, group: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A ``[slots, in, rank]`` and B ``[slots, rank, out]`` of one fused linear layer."""
        return self.A[group][layer], self.B[group][layer]
