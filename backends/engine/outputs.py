"""Output processing: a step's tokens appended to their sequences, stopped at the first
stop condition, detokenized incrementally and handed out as :class:`RequestOutput` deltas;
a finished request's resources given back through the engine's ``release``."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from .detokenizer import IncrementalDetokenizer
from .isolation import describe
from .request_perf import RequestPerf
from .logprobs import Logprobs, PromptLogprobs, TopLogprobs, ranked
from .sampler import sampling_logprobs
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
    # with SamplingParams.top_logprobs: the alternatives at each new token's position
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # with SamplingParams.prompt_logprobs: on the request's first output only
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0      # prompt tokens whose KV came from the prefix cache
    perf: RequestPerf | None = None  # what return_perf_metrics reports, so far


# (sequence, finish reason, the proposer KV rows known right, or None: all) -> None
Release = Callable[[Sequence, str, "int | None"], None]


class OutputProcessor:
    """Tokens in, :class:`RequestOutput` out, one detokenizer per running request.

    ``release(seq, reason, draft_computed)`` is called first when a request finishes: the
    engine forgets it and gives its pages back (``draft_computed``: how many proposer KV
    rows were right before a speculative step drafted, when it finishes in one)."""

    def __init__(self, tokenizer, max_model_len: int, page_size: int, release: Release):
        self.tokenizer, self.max_model_len, self.page_size = tokenizer, max_model_len, page_size
        self.release = release
        self.detoks: dict[str, IncrementalDetokenizer] = {}

    def add(self, seq: Sequence) -> None:
        self.detoks[seq.request_id] = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_ids, seq.params.stop, seq.params.min_tokens)

    def commit(self, seq: Sequence, tokens: list[int], logprobs: Logprobs | None = None,
               draft_computed: int | None = None) -> RequestOutput:
        """Append a sequence's new tokens; if that raises, the sequence alone fails."""
        try:
            return self._append(seq, tokens, logprobs, draft_computed)
        except Exception as exc:
            return self.fail(seq, exc)

    def fail(self, seq: Sequence, exc: Exception) -> RequestOutput:
        log.error("request %s failed in the engine step; the others go on", seq.request_id,
                  exc_info=exc)
        return self.finish(seq, "error", error=f"the request failed in the engine step "
                                               f"({describe(exc)}); other requests were not affected")

    def guide_ended(self, seq: Sequence, draft_computed: int | None = None) -> RequestOutput:
        """The guide allows no token that the request's other settings leave: a complete
        output ends as "stop"; otherwise the request ends with an error that says why."""
        if seq.controls.guide.completed:
            return self.finish(seq, "stop", draft_computed=draft_computed)
        return self.finish(seq, "error", error=(
            f"guided decoding: after {len(seq.output_ids)} output tokens the guide allows no "
            "token that the request's other settings (min_tokens, bad_words, logit_bias, "
            "end_id or stop ids) leave possible; the output so far is incomplete"))

    def finish(self, seq: Sequence, reason: str, new_ids: list[int] = (), error: str | None = None,
               draft_computed: int | None = None) -> RequestOutput:
        self.release(seq, reason, draft_computed)
        seq.finish_reason = reason
        detok = self.detoks.pop(seq.request_id)
        text = detok.take(final=True) if error is None else ""
        return self._output(seq, list(new_ids), text, reason, error)

    def _append(self, seq: Sequence, tokens: list[int], logprobs: Logprobs | None,
                draft_computed: int | None) -> RequestOutput:
        """Append new tokens, stopping exactly at the first stop condition."""
        detok = self.detoks[seq.request_id]
        for n, token in enumerate(tokens, 1):
            if logprobs is None:
                seq.append_token(token)
            else:
                seq.append_token(token, logprobs.chosen[n - 1],
                                 None if logprobs.top is None else logprobs.top[n - 1])
            detok.add(token)
            if token in seq.stop_ids or detok.stopped or (
                    seq.controls is not None and seq.controls.guide is not None
                    and seq.controls.guide.terminated):
                return self.finish(seq, "stop", tokens[:n], draft_computed=draft_computed)
            if len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                return self.finish(seq, "length", tokens[:n], draft_computed=draft_computed)
        return self._output(seq, tokens, detok.take(final=False), None)

    def _output(self, seq, new_ids, text, reason, error=None) -> RequestOutput:
        out = RequestOutput(seq.request_id, new_ids, text, reason is not None, reason,
                            len(seq.prompt_ids), len(seq.output_ids), error,
                            num_cached_tokens=seq.num_cached_tokens or 0,
                            perf=seq.perf(self.page_size))
        if seq.logprobs is not None:
            out.new_logprobs = seq.logprobs[len(seq.logprobs) - len(new_ids):]
            out.cumulative_logprob = seq.cumulative_logprob
        if seq.top_logprobs is not None:
            out.new_top_logprobs = seq.top_logprobs[len(seq.top_logprobs) - len(new_ids):]
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent \
                and (seq.prompt_logprobs.complete or reason is not None):
            out.prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        return out


def sequence_logprobs(logits: torch.Tensor, tokens: list[list[int]],
                      seqs: list[Sequence]) -> list[Logprobs | None]:
    """Per request asking for them, the log-probabilities of its new tokens at positions
    0.. of its processed logits ([B, V] or [B, n, V]), with the alternatives it asked
    for; None for the others."""
    out: list[Logprobs | None] = [None] * len(seqs)
    rows = [i for i, s in enumerate(seqs) if s.logprobs is not None]
    if not rows:
        return out
    logits = logits if logits.dim() == 3 else logits[:, None]
    logprobs = sampling_logprobs(torch.cat([logits[i, :len(tokens[i])] for i in rows]),
                                 [seqs[i].params for i in rows for _ in tokens[i]])
    flat = ranked(logprobs, [t for i in rows for t in tokens[i]],
                  max(seqs[i].params.top_logprobs for i in rows))
    for i in rows:
        n, k = len(tokens[i]), seqs[i].params.top_logprobs
        mine, flat = flat[:n], flat[n:]
        out[i] = Logprobs(mine.chosen, None if not k else [
            TopLogprobs(t.token_ids[:k], t.logprobs[:k]) for t in mine.top])
    return out
