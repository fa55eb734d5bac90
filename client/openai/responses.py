"""The ensemble's responses as OpenAI's: whole responses, and SSE chunks for ``stream``.

Each choice is one ensemble request (:class:`Choice`); :func:`merged` runs a request's
choices side by side and hands their responses over in arrival order, so a streamed
response interleaves its choices by ``index`` as OpenAI's does. Closing the merged
iterator (the client went away) cancels every choice still running, and with it its
gRPC stream.

Log probabilities: the ensemble returns the sampled token's (``output_log_probs``); the
token's text comes from ``output_ids`` when the ensemble returns them, else from the
response's text (:func:`tokens_of`: exact with one token per response, which is the case
without speculation).

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
        return r.text


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
def completion_logprobs(choice: Choice, start: int = 0, offset: int = 0, top: bool = False) -> dict:
    """OpenAI's completions ``logprobs`` object for tokens ``start:`` of ``choice``,
    ``offset`` = the text offset of the first of them."""
    tokens, lps = choice.tokens[start:], choice.logprobs[start:]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": lps,
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps)] if top else None, "text_offset": offsets}


def chat_logprobs(choice: Choice, start: int = 0, top: int = 0) -> dict:
    content = []
    for t, lp in zip(choice.tokens[start:], choice.logprobs[start:]):
        entry = {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
        content.append({**entry, "top_logprobs": [entry] if top else []})
    return {"content": content}
