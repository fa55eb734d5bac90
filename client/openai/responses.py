"""The ensemble's responses as OpenAI's: whole responses, and SSE chunks for ``stream``.

Each choice is one ensemble request (:class:`Choice`); :func:`merged` runs a request's
choices side by side and hands their responses over in arrival order, so a streamed
response interleaves its choices by ``index`` as OpenAI's does. Closing the merged
iterator (the client went away) cancels every choice still running, and with it its
gRPC stream.

Log probabilities: the ensemble returns the sampled token's (``output_log_probs``); the
token's text comes from ``output_ids`` when the ensemble returns them, else from the
response's text (:func:`tokens_of`: exact with one token per response, which is the case
without speculation). The alternatives at each position (``output_top_*``) and the
prompt's log probabilities (``prompt_*``) come as token ids, named by the checkpoint's
tokenizer (``token_id:N`` without one, as vLLM names them with
``return_tokens_as_token_ids``).

>>> c = Choice(0)
>>> c.add(EnsembleResponse(text="ab", num_input_tokens=3, num_output_tokens=2, finish_reason="length"))
'ab'
>>> c.text, c.finish_reason, c.completion_tokens
('ab', 'length', 2)
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import AsyncIterator

from .protocol import OpenAIError
from .triton_backend import EnsembleResponse

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass(slots=True)
class Choice:
    """What one choice has produced so far."""

    index: int
    parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None                       # None: not reported
    tokens: list[str] = field(default_factory=list)       # with logprobs
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[str, float]]] = field(default_factory=list)   # alternatives per token
    prompt: "PromptPart | None" = None                     # with prompt log probabilities

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, r: EnsembleResponse, tokenizer=None) -> str:
        """Take one response in; returns its new text. ``tokenizer`` (a ``tokenizers``
        Tokenizer) names the tokens of its log probabilities (:func:`tokens_of`)."""
        self.prompt_tokens = max(self.prompt_tokens, r.num_input_tokens)
        self.completion_tokens = max(self.completion_tokens, r.num_output_tokens)
        if r.num_cached_tokens is not None:
            self.cached_tokens = max(self.cached_tokens or 0, r.num_cached_tokens)
        if r.finish_reason:
            self.finish_reason = r.finish_reason
        if r.text:
            self.parts.append(r.text)
        if r.log_probs:
            self.tokens += tokens_of(r, tokenizer)
            self.logprobs += r.log_probs
        for ids, values in zip(r.top_ids, r.top_log_probs):
            self.tops.append(list(zip(token_names(ids, tokenizer), values)))
        if r.prompt_ids and self.prompt is None:
            self.prompt = PromptPart.of(r, tokenizer)
        return r.text


def token_names(ids: list[int], tokenizer=None) -> list[str]:
    """Each token's text (``token_id:N`` without a tokenizer).

    >>> token_names([5, 9])
    ['token_id:5', 'token_id:9']
    """
    if tokenizer is None:
        return [f"token_id:{i}" for i in ids]
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


@dataclass(slots=True)
class PromptPart:
    """The prompt's tokens with their log probabilities (None at 0) and alternatives."""
    ids: list[int]
    tokens: list[str]
    logprobs: list[float | None]
    top_ids: list[list[int]]
    tops: list[list[tuple[str, float]]]

    @classmethod
    def of(cls, r: EnsembleResponse, tokenizer=None) -> "PromptPart":
        return cls(r.prompt_ids, token_names(r.prompt_ids, tokenizer), r.prompt_log_probs, r.prompt_top_ids,
                   [list(zip(token_names(ids, tokenizer), values))
                    for ids, values in zip(r.prompt_top_ids, r.prompt_top_log_probs)])

    def vllm(self) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: per position (None at 0) the token and its
        alternatives by id: ``{"logprob", "rank", "decoded_token"}`` (a rank only where
        the token is among the alternatives)."""
        out: list[dict | None] = [None]
        for j in range(1, len(self.ids)):
            entries = {str(self.ids[j]): {"logprob": finite(self.logprobs[j]), "rank": None,
                                          "decoded_token": self.tokens[j]}}
            for rank, (i, (name, value)) in enumerate(zip(self.top_ids[j], self.tops[j]), 1):
                if str(i) in entries:
                    entries[str(i)]["rank"] = rank
                else:
                    entries[str(i)] = {"logprob": finite(value), "rank": rank, "decoded_token": name}
            out.append(entries)
        return out


def finite(logprob: float) -> float:
    """JSON has no -inf: a token the sampling settings exclude reads -9999.0 (vLLM's)."""
    return max(logprob, -9999.0)


def tokens_of(r: EnsembleResponse, tokenizer=None) -> list[str]:
    """The text of each token whose log probability ``r`` carries: from ``output_ids``
    when the ensemble returns them; else the response's text, cut where the tokenizer
    cuts it when that gives as many tokens (several tokens come in one response with
    speculation); else the whole text on the first token and "" on the others. The
    pieces always join to the response's text.

    >>> tokens_of(EnsembleResponse("ab", log_probs=[-0.1, -0.2]))
    ['ab', '']
    """
    k = len(r.log_probs)
    if tokenizer is not None and len(r.output_ids) == k:
        return [tokenizer.decode([i], skip_special_tokens=False) for i in r.output_ids]
    if k == 1:
        return [r.text]
    if tokenizer is not None and r.text:
        starts = [a for a, _ in tokenizer.encode(r.text, add_special_tokens=False).offsets]
        if len(starts) == k and starts == sorted(starts):
            cuts = [0, *starts[1:], len(r.text)]
            return [r.text[a:b] for a, b in zip(cuts, cuts[1:])]
    return [r.text] + [""] * (k - 1)


@dataclass(slots=True)
class Event:
    """One item of :func:`merged`: a response of choice ``index``, or its error."""

    index: int
    response: EnsembleResponse | None = None
    error: BaseException | None = None


async def merged(streams: list[AsyncIterator[EnsembleResponse]]) -> AsyncIterator[Event]:
    """The responses of every stream (choice ``i`` = ``streams[i]``) as they arrive;
    ends when every stream has ended. Closing it cancels the streams still running."""
    if len(streams) == 1:   # the usual case: no tasks, no queue between the stream and the response
        stream = streams[0]
        try:
            async for r in stream:
                yield Event(0, r)
        except asyncio.CancelledError:
            raise
        except Exception as exc:   # noqa: BLE001 - handed to the consumer
            yield Event(0, error=exc)
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue[Event | None] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[EnsembleResponse]) -> None:
        try:
            async for r in stream:
                await queue.put(Event(i, r))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:   # noqa: BLE001 - handed to the consumer
            await queue.put(Event(i, error=exc))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    running = len(tasks)
    try:
        while running:
            event = await queue.get()
            if event is None:
                running -= 1
            else:
                yield event
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def first_events(events: AsyncIterator[Event], n: int) -> list[Event]:
    """Read until each of the ``n`` choices has answered once (or one failed): a request
    the ensemble refuses is an HTTP error, not a stream that starts and then fails.
    Raises the first error."""
    seen, buffered = set(), []
    while len(seen) < n:
        try:
            event = await events.__anext__()
        except StopAsyncIteration:
            break
        if event.error is not None:
            raise event.error
        buffered.append(event)
        seen.add(event.index)
    return buffered


def error_event(exc: BaseException) -> str:
    err = exc if isinstance(exc, OpenAIError) else OpenAIError(500, f"internal error: {exc}")
    return sse(err.body())


# ---- completions --------------------------------------------------------------------------------
def completion_logprobs(choice: Choice, start: int = 0, offset: int = 0, with_prompt: bool = False) -> dict:
    """OpenAI's completions ``logprobs`` object for tokens ``start:`` of ``choice``,
    ``offset`` = the text offset of the first of them; ``with_prompt`` (``echo``): the
    prompt's tokens first (the first one's log probability and alternatives null).
    ``top_logprobs`` holds, per position, the token itself and the alternatives asked
    for, token text -> log probability (vLLM's shape)."""
    tokens, lps = choice.tokens[start:], choice.logprobs[start:]
    tops = [[(t, lp), *alts] for t, lp, alts in zip(tokens, lps, choice.tops[start:] or [[]] * len(tokens))]
    offsets, pos = [], offset
    prompt = choice.prompt if with_prompt else None
    if prompt is not None:
        ppos = 0
        for t in prompt.tokens:
            offsets.append(ppos)
            ppos += len(t)
        tokens = prompt.tokens + tokens
        lps = prompt.logprobs + lps
        tops = [None] + [[(t, lp), *alts] for t, lp, alts in
                         zip(prompt.tokens[1:], prompt.logprobs[1:], prompt.tops[1:])] + tops
    for t in choice.tokens[start:]:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [None if lp is None else finite(lp) for lp in lps],
            "top_logprobs": [None if top is None else _by_text(top) for top in tops],
            "text_offset": offsets}


def _by_text(entries: list[tuple[str, float]]) -> dict[str, float]:
    """Token text -> log probability; of two tokens with the same text the likelier one
    (lm-evaluation-harness calls a token greedy when its value is the dict's largest, so
    a likelier token hiding behind the same text must not be lost).

    >>> _by_text([("a", -2.0), ("a", -1.0), ("b", -3.0)])
    {'a': -1.0, 'b': -3.0}
    """
    out: dict[str, float] = {}
    for name, value in entries:
        out[name] = max(out.get(name, -float("inf")), finite(value))
    return out


def chat_logprobs(choice: Choice, start: int = 0, top: int = 0) -> dict:
    """OpenAI's chat ``logprobs``: per token its text, log probability and bytes, and the
    ``top`` most likely tokens at its position."""
    def entry(t: str, lp: float) -> dict:
        return {"token": t, "logprob": finite(lp), "bytes": list(t.encode("utf-8"))}
    content = []
    alts = choice.tops[start:] or [[]] * len(choice.tokens[start:])
    for t, lp, alt in zip(choice.tokens[start:], choice.logprobs[start:], alts):
        content.append({**entry(t, lp), "top_logprobs": [entry(n, v) for n, v in alt[:top]]})
    return {"content": content}
