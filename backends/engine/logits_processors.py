"""Per-request logits controls (vLLM's names, semantics and order): bad words,
min_tokens, logit_bias, then the repetition, frequency and presence penalties.

They change the target's logits before temperature, top-k and top-p. A speculative
step applies them at each of its ``k + 1`` positions with the drafts before that
position counted as output, so position ``j`` gets exactly the logits a plain step
would get had the first ``j`` drafts been sampled: verification stays lossless.

A guided request's grammar matcher (:mod:`.guided`) travels here too: it sees every
committed token, and the engine masks its rows after these controls.

Only a request that uses a control carries a :class:`LogitsControls`; a step whose
batch has none calls nothing here. The maths are pure tensor functions over rows
(``[N, V]``), applied in place to the rows that need them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from .params import SamplingParams

if TYPE_CHECKING:
    from .guided import GuideState

NEG_INF = float("-inf")


# -- the maths --------------------------------------------------------------------------

def mask_tokens(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Set ``logits[rows[i], tokens[i]]`` to -inf (bad words, min_tokens), in place.

    >>> mask_tokens(torch.zeros(2, 3), torch.tensor([0, 1]), torch.tensor([2, 0]))
    tensor([[0., 0., -inf],
            [-inf, 0., 0.]])
    """
    return logits.index_put_((rows, tokens),
                             torch.tensor(NEG_INF, dtype=logits.dtype, device=logits.device))


def add_logit_bias(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                   bias: torch.Tensor) -> torch.Tensor:
    """``logits[rows[i], tokens[i]] += bias[i]``, in place (OpenAI's logit_bias,
    TensorRT-LLM's embedding_bias).

    >>> add_logit_bias(torch.zeros(1, 3), torch.tensor([0, 0]), torch.tensor([0, 2]),
    ...                torch.tensor([1.5, -2.0]))
    tensor([[ 1.5000,  0.0000, -2.0000]])
    """
    return logits.index_put_((rows, tokens), bias.to(logits.dtype), accumulate=True)


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> torch.Tensor:
    """vLLM's ``apply_penalties``, in place: a token seen in the prompt or the output has
    its logit divided by ``repetition`` if positive, multiplied if not (HF's
    repetition penalty); then OpenAI's ``logit -= frequency * count + presence * (count > 0)``
    over the output counts.

    logits [N, V]; prompt_mask [N, V] bool; output_counts [N, V]; the penalties [N].

    >>> logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    >>> apply_penalties(logits, torch.tensor([[True, True, False, False]]),
    ...                 torch.tensor([[0.0, 0.0, 2.0, 0.0]]), torch.tensor([2.0]),
    ...                 torch.tensor([0.25]), torch.tensor([0.5]))
    tensor([[ 1.0000, -4.0000, -0.5000,  1.0000]])
    """
    counts = output_counts.to(logits.dtype)
    seen = prompt_mask | (counts > 0)
    penalty = torch.where(seen, repetition[:, None].to(logits.dtype), 1.0)
    logits *= torch.where(logits > 0, 1.0 / penalty, penalty)
    logits -= frequency[:, None].to(logits.dtype) * counts
    logits -= presence[:, None].to(logits.dtype) * (counts > 0).to(logits.dtype)
    return logits


def banned_by_words(bad_words: list[tuple[int, ...]], context: list[int]) -> list[int]:
    """The last tokens of the bad words whose other tokens end ``context`` (vLLM's
    ``apply_bad_words``: a one-token word is always banned).

    >>> banned_by_words([(5,), (7, 8), (1, 2, 3)], [9, 7])
    [5, 8]
    """
    out = []
    for word in bad_words:
        n = len(word) - 1
        if n <= len(context) and (n == 0 or tuple(context[len(context) - n:]) == word[:n]):
            out.append(word[-1])
    return out


def bad_words_token_ids(words: list[str], encode: Callable[[str], list[int]]
                        ) -> list[tuple[int, ...]]:
    """vLLM's tokenization of ``bad_words``: each word (left-stripped) as it is, and
    with a leading space when that gives a different first token and as many tokens,
    so the word is banned at the start of a text and in its middle.

    >>> vocab = {"cat": [7], " cat": [8], "hot dog": [3, 4], " hot dog": [5, 4]}
    >>> bad_words_token_ids(["cat", " hot dog"], vocab.__getitem__)
    [(7,), (8,), (3, 4), (5, 4)]
    """
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        if plain:
            out.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


# -- one request's state ----------------------------------------------------------------

@dataclass(slots=True, eq=False)
class LogitsControls:
    """One request's logits controls, built once when it is admitted; the output
    token counts (for the penalties) grow with each appended token, never recounted."""
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_tokens: int
    stop_ids: list[int]                   # masked while fewer than min_tokens were generated
    bad_words: list[tuple[int, ...]]      # token id sequences
    bias_ids: torch.Tensor | None         # [M] long
    bias_values: torch.Tensor | None      # [M] fp32
    prompt_mask: torch.Tensor | None      # [V] bool, with penalties only
    output_counts: torch.Tensor | None    # [V] fp32, with penalties only
    guide: GuideState | None = None       # structured output: the grammar matcher

    @classmethod
    def build(cls, params: SamplingParams, prompt_ids: list[int], stop_ids: frozenset[int],
              vocab_size: int, bad_words: list[tuple[int, ...]],
              device: torch.device | str = "cpu",
              guide: GuideState | None = None) -> LogitsControls | None:
        """The controls of a request, or None when it uses none (it then costs nothing).
        Its tensors live on ``device``, the logits'."""
        masks_stops = params.min_tokens > 0 and bool(stop_ids)
        if not (params.has_penalties or masks_stops or bad_words or params.logit_bias
                or guide is not None):
            return None
        prompt_mask = output_counts = None
        if params.has_penalties:
            prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            prompt_mask[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
            output_counts = torch.zeros(vocab_size, device=device)
        bias_ids = bias_values = None
        if params.logit_bias:
            bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
            bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32,
                                       device=device)
        return cls(params.repetition_penalty, params.frequency_penalty, params.presence_penalty,
                   params.min_tokens, sorted(stop_ids), bad_words, bias_ids, bias_values,
                   prompt_mask, output_counts, guide)

    @property
    def has_penalties(self) -> bool:
        return self.output_counts is not None

    def active(self, num_generated: int) -> bool:
        """Whether one of the controls above changes the logits of the token after
        ``num_generated`` outputs (min_tokens alone stops mattering once reached; the
        guide is applied apart)."""
        return (self.has_penalties or bool(self.bad_words) or self.bias_ids is not None
                or num_generated < self.min_tokens)

    def append(self, token: int) -> None:
        if self.output_counts is not None:
            self.output_counts[token] += 1
        if self.guide is not None:
            self.guide.accept(token)


# -- a step's rows --------------------------------------------------------------------

@torch.inference_mode()
def apply_controls(logits: torch.Tensor, rows: list[int], controls: list[LogitsControls],
                   outputs: list[list[int]], drafts: torch.Tensor | None = None) -> torch.Tensor:
    """Apply the controls of the requests in ``rows`` to their logits, in place, at
    every position; the other rows are not touched.

    logits [B, n, V]; per row in ``rows``: its controls and its output tokens so far;
    ``drafts`` [B, m] (m >= n - 1; None for m = 0): tokens after the output, of which
    the last ``n - 1`` sit before positions 1..n-1. Position ``j`` sees
    ``outputs + drafts[:m - n + 1 + j]``: in verification (m = k, n = k + 1) the drafts
    before it, while proposing (n = 1) all drafts so far. Raises FloatingPointError
    naming the batch row when nothing finite is left in one.
    """
    _, n, v = logits.shape
    device = logits.device
    sub = logits[rows]                        # [R, n, V], a copy
    flat = sub.view(-1, v)
    ahead = drafts[rows].tolist() if drafts is not None else [[] for _ in rows]
    first = len(ahead[0]) - n + 1 if rows else 0   # drafts seen at position 0

    # bad words and min_tokens: tokens set to -inf, per position
    mask_rows, mask_ids = [], []
    for i, c in enumerate(controls):
        done = len(outputs[i]) + first
        longest = max((len(w) for w in c.bad_words), default=1) - 1
        tail = (outputs[i][max(0, len(outputs[i]) - longest):] if longest else []) + ahead[i]
        for j in range(n):
            banned = banned_by_words(c.bad_words, tail[:len(tail) - n + 1 + j]) \
                if c.bad_words else []
            if done + j < c.min_tokens:
                banned += c.stop_ids
            mask_rows += [i * n + j] * len(banned)
            mask_ids += banned
    if mask_rows:
        mask_tokens(flat, torch.tensor(mask_rows, device=device),
                    torch.tensor(mask_ids, dtype=torch.long, device=device))

    biased = [i for i, c in enumerate(controls) if c.bias_ids is not None]
    if biased:
        positions = torch.arange(n, device=device)
        ids = [controls[i].bias_ids for i in biased]
        add_logit_bias(flat,
                       torch.cat([(i * n + positions)[:, None].expand(n, len(t)).flatten()
                                  for i, t in zip(biased, ids)]),
                       torch.cat([t.repeat(n) for t in ids]),
                       torch.cat([controls[i].bias_values.repeat(n) for i in biased]))

    penalized = [i for i, c in enumerate(controls) if c.has_penalties]
    if penalized:
        cs = [controls[i] for i in penalized]
        counts = torch.stack([c.output_counts for c in cs])[:, None].repeat(1, n, 1)
        if ahead[0]:
            # the drafts a position sees count as output there
            seen = torch.zeros(len(cs), len(ahead[0]) + 1, v, device=device)
            seen[:, 1:].scatter_(-1, torch.tensor([ahead[i] for i in penalized],
                                                  device=device)[..., None], 1.0)
            counts += seen.cumsum(1)[:, first:first + n]
        prompt_mask = torch.stack([c.prompt_mask for c in cs])[:, None].expand(-1, n, -1)
        per_row = lambda name: torch.tensor([getattr(c, name) for c in cs],
                                            device=device).repeat_interleave(n)
        part = sub[penalized].view(-1, v)
        apply_penalties(part, prompt_mask.reshape(-1, v), counts.view(-1, v),
                        per_row("repetition_penalty"), per_row("frequency_penalty"),
                        per_row("presence_penalty"))
        sub[penalized] = part.view(len(cs), n, v)

    best = flat.amax(-1)
    if not bool(torch.isfinite(best).all()):
        bad = sorted({rows[int(k) // n] for k in (~torch.isfinite(best)).nonzero().flatten()})
        raise FloatingPointError(f"the processed logits of row(s) {bad} hold no finite value "
                                 "(every token banned, or the model's logits hold NaN or inf)")
    logits[rows] = sub
    return logits
