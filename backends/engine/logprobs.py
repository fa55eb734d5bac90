"""Log probabilities a request asks for: of the tokens it got, of the k most likely
tokens at each of those positions, and of its prompt's own tokens. Pure tensor maths
over one log-softmax per position, so a token's log probability and the same token's
value among the alternatives are the same float (lm-evaluation-harness decides "greedy"
by comparing them)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class TopLogprobs:
    """The k most likely tokens at one position, most likely first."""
    token_ids: list[int]
    logprobs: list[float]


@dataclass(slots=True)
class Logprobs:
    """Of a run of tokens at consecutive positions: each one's log probability, and the
    alternatives at each position (None when the request asked for none)."""
    chosen: list[float]
    top: list[TopLogprobs] | None = None

    def __getitem__(self, index: slice) -> "Logprobs":
        return Logprobs(self.chosen[index], None if self.top is None else self.top[index])

    def __len__(self) -> int:
        return len(self.chosen)


def ranked(logprobs: torch.Tensor, tokens: list[int], k: int) -> Logprobs:
    """``logprobs`` [N, V] (log-softmaxed rows): row i's value at ``tokens[i]``, and with
    ``k`` > 0 its k largest values and their token ids.

    >>> lp = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]]))
    >>> r = ranked(lp, [1, 2], 2)
    >>> [round(x, 4) for x in r.chosen], [t.token_ids for t in r.top]
    ([-1.204, -0.3567], [[0, 1], [2, 1]])
    >>> r.top[1].logprobs[0] == r.chosen[1]
    True
    """
    index = torch.tensor(tokens, dtype=torch.long, device=logprobs.device)[:, None]
    chosen = logprobs.gather(-1, index)[:, 0].tolist()
    if k <= 0:
        return Logprobs(chosen)
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return Logprobs(chosen, [TopLogprobs(i, v) for i, v in zip(ids.tolist(), values.tolist())])


@dataclass(slots=True)
class PromptLogprobs:
    """A prompt's tokens' log probabilities under the model's raw distribution (the
    log-softmax of its logits, before any sampling setting): position j's is
    log p(prompt[j] | prompt[:j]); position 0 has none (None, as OpenAI returns it).
    Filled chunk by chunk as the prompt is computed (:meth:`add_chunk`)."""
    token_ids: list[int]
    k: int                                   # alternatives per position
    logprobs: list[float | None] = field(default_factory=lambda: [None])
    top: list[TopLogprobs] = field(default_factory=lambda: [TopLogprobs([], [])])

    @property
    def complete(self) -> bool:
        return len(self.logprobs) >= len(self.token_ids)

    def wants(self, start: int, end: int) -> tuple[int, int] | None:
        """Of a chunk computing positions start..end-1, the rows whose next token is a
        prompt token not recorded yet (a recomputed chunk, after preemption, adds none):
        (first row, row count), or None."""
        first = len(self.logprobs) - 1       # the position predicting the next one missing
        last = min(end, len(self.token_ids) - 1)
        if self.complete or not start <= first < last:
            return None
        return first - start, last - first

    def add_chunk(self, logits: torch.Tensor) -> None:
        """``logits`` [n, V] at the next n positions to record (raw, any dtype)."""
        n = logits.shape[0]
        at = len(self.logprobs)
        r = ranked(logits.float().log_softmax(-1), self.token_ids[at:at + n], self.k)
        self.logprobs.extend(r.chosen)
        self.top.extend(r.top if r.top is not None else [TopLogprobs([], []) for _ in range(n)])
