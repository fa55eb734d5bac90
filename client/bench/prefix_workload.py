"""What ``tandem bench prefix`` sends, and the figures it takes from the replies.

Two workloads, both from texts cut out of one token stream (:class:`peers_workload.Prompts`,
so every server gets the same prompts):

- ``chat``: conversations of several turns; each turn resends the whole conversation
  (the previous prompt, the reply the server gave to it, a new user message), so every
  turn after the first starts with a prefix the server computed a turn earlier.
- ``system``: one long system prompt shared by every request, plus a short unique
  question.

>>> c = Conversation(["hi", "and then?"])
>>> c.next(None)
'\\n\\nUser: hi\\n\\nAssistant:'
>>> c.next(" hello")
'\\n\\nUser: hi\\n\\nAssistant: hello\\n\\nUser: and then?\\n\\nAssistant:'
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.client.bench.openai_load import summarize
from tandem.client.bench.peers_workload import requests_per_level
from tandem.client.bench.request_client import RequestOutput
from tandem.client.bench.stats import ms, percentile

USER, ASSISTANT = "\n\nUser: ", "\n\nAssistant:"
# the tokens the role markers take around a message, for the context-length check
MARKER_TOKENS = 8


def user_turn(message: str) -> str:
    return f"{USER}{message}{ASSISTANT}"


@dataclass(slots=True)
class Conversation:
    """One chat: its user ``messages`` (one per turn) and the prompts sent so far."""
    messages: list[str]
    sent: list[str] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.sent) == len(self.messages)

    def next(self, reply: str | None) -> str:
        """The next turn's prompt: the first message alone, then the last prompt, the
        ``reply`` it got and the next message."""
        k = len(self.sent)
        prompt = user_turn(self.messages[0]) if k == 0 else self.sent[-1] + (reply or "") + user_turn(self.messages[k])
        self.sent.append(prompt)
        return prompt


def conversations_per_level(requests: int, turns: int, concurrency: int) -> int:
    """Enough conversations for ``requests`` turns, and at least one per stream.

    >>> conversations_per_level(16, 4, 2), conversations_per_level(16, 4, 8)
    (4, 8)
    """
    return max(concurrency, math.ceil(requests / turns))


def pieces_per_level(workload: str, requests: int, turns: int, concurrency: int) -> int:
    """How many unique texts (questions or user messages) a level takes."""
    if workload == "system":
        return requests_per_level(requests, concurrency)
    return conversations_per_level(requests, turns, concurrency) * turns


def offsets(workloads: list[str], concurrency: list[int], repeats: int, requests: int, turns: int
            ) -> tuple[dict, int]:
    """The first text of every (workload, concurrency, repeat), so that no text is sent
    twice to a server (a repeat must not hit what an earlier one cached), and how many
    texts that takes.

    >>> offsets(["system", "chat"], [1], 2, 2, 2)
    ({('system', 1, 0): 0, ('system', 1, 1): 2, ('chat', 1, 0): 4, ('chat', 1, 1): 6}, 8)
    """
    out, pos = {}, 0
    for w in workloads:
        for c in concurrency:
            for rep in range(repeats):
                out[(w, c, rep)] = pos
                pos += pieces_per_level(w, requests, turns, c)
    return out, pos


def system_prompts(prefix: str, questions: list[str]) -> list[str]:
    """The shared system prompt, then each question as the user's turn.

    >>> system_prompts("Be brief.", ["a?", "b?"])[1]
    'Be brief.\\n\\nUser: b?\\n\\nAssistant:'
    """
    return [prefix + user_turn(q) for q in questions]


def conversations(messages: list[str], turns: int) -> list[Conversation]:
    """``messages`` dealt out ``turns`` to a conversation, in order."""
    return [Conversation(messages[i:i + turns]) for i in range(0, len(messages) - turns + 1, turns)]


def chat_context_tokens(turns: int, message_tokens: int, max_tokens: int) -> int:
    """About the longest conversation's tokens at its last reply (markers estimated).

    >>> chat_context_tokens(4, 32, 32)
    288
    """
    return turns * (message_tokens + MARKER_TOKENS + max_tokens)


def cached_share(results: list[RequestOutput]) -> float | None:
    """The share of prompt tokens the server says its prefix cache served, over the
    requests that reported both counts (None when none did).

    >>> r = [RequestOutput("a", prompt_tokens=100, cached_tokens=64), RequestOutput("a", prompt_tokens=100)]
    >>> cached_share(r), cached_share(r[1:])
    (0.64, None)
    """
    rep = [r for r in results if r.error is None and r.prompt_tokens and r.cached_tokens is not None]
    if not rep:
        return None
    return round(sum(r.cached_tokens for r in rep) / sum(r.prompt_tokens for r in rep), 4)


def level_stats(results: list[RequestOutput], wall_s: float) -> dict:
    """A level's figures: the load generator's summary (output tok/s, TTFT per kind of
    request, ITL), TTFT p50/p99 over all requests, and the cached-token share."""
    ttft = [r.ttft_s for r in results if r.error is None and r.ttft_s is not None]
    out = summarize(results, wall_s)
    for q in (50, 99):
        out[f"ttft_ms_p{q}"] = ms(percentile(ttft, q))
    out["cached_share"] = cached_share(results)
    out["prompt_tokens_mean"] = (round(sum(r.prompt_tokens for r in results if r.prompt_tokens)
                                       / max(1, sum(1 for r in results if r.prompt_tokens)), 1))
    return out
