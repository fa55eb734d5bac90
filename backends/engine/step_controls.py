"""A step's logits controls (penalties, bias, bad words, min tokens) and guides: the guided
rows' token bitmasks are filled on a thread while the model runs (xgrammar releases the
GIL), then applied with the requests' other controls to the logits of the rows that use one;
a batch of plain requests costs nothing here."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from .guided import fill_guides, mask_logits
from .logits_processors import apply_controls
from .sequence import Sequence


class StepControls:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._masks: ThreadPoolExecutor | None = None   # made on the first guided step

    def start(self, seqs: list[Sequence], n: int, drafts: torch.Tensor | None = None) -> Future | None:
        """The guided rows' bitmasks at ``n`` positions each (``drafts`` ``[B, n - 1]``: the
        tokens before positions 1..), filled on a thread; None when no row is guided."""
        rows = [i for i, s in enumerate(seqs) if s.controls is not None and s.controls.guide is not None]
        if not rows:
            return None
        if self._masks is None:
            self._masks = ThreadPoolExecutor(1, thread_name_prefix="tandem-guide-masks")
        ahead = drafts[rows].tolist() if drafts is not None else [[] for _ in rows]
        return self._masks.submit(fill_guides, len(seqs), n, self.vocab_size, rows,
                                  [seqs[i].controls.guide for i in rows], ahead)

    def apply(self, logits: torch.Tensor, seqs: list[Sequence], drafts: torch.Tensor | None = None,
              masks: Future | None = None) -> dict[int, int]:
        """Controls on the rows ([B, V], or [B, n, V] in a speculative step, the drafts before
        each position counted as output) of the requests that use one, then the guides'
        masks (``masks`` from :meth:`start`; filled here without). Returns, per row whose
        guide leaves no token at a reachable position, the first such position (see
        :func:`~.guided.mask_logits`)."""
        logits = logits if logits.dim() == 3 else logits[:, None]
        rows = [i for i, s in enumerate(seqs)
                if s.controls is not None and s.controls.active(len(s.output_ids))]
        if rows:
            apply_controls(logits, rows, [seqs[i].controls for i in rows],
                           [seqs[i].output_ids for i in rows], drafts)
        if masks is None:
            masks = self.start(seqs, logits.shape[1], drafts)
        if masks is None:
            return {}
        return mask_logits(logits, masks.result())

    def draft_process(self, seqs: list[Sequence]) -> Callable | None:
        """Drafts from the controlled logits when the batch uses controls: only speed
        depends on it (verification applies them to the target either way)."""
        if all(s.controls is None for s in seqs):
            return None
        return lambda logits, drafted: self.apply(logits, seqs, drafted)
