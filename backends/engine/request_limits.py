"""What a request may ask for: the context, the KV pages it holds, the speculative
lookahead. Pure and torch-free: the engine checks requests with it, and so do the
Triton adapters before any work starts (the text models run without torch).

A broken limit raises :class:`LimitError`, a ``ValueError`` whose message is the
engine's; ``field`` and ``problem`` say the same against a request's inputs, as an
adapter reports it (``"max_tokens: got 80; ..."``).
"""
from __future__ import annotations

from ..kv_cache.pages import pages_needed
from ..speculative.config import MAX_NUM_SPECULATIVE_TOKENS, SpeculativeConfig


def _lookahead(num_speculative_tokens: int) -> int:
    # the verify step writes the k drafts past the scheduled token, and the proposer
    # the KV of one more
    return num_speculative_tokens + 1 if num_speculative_tokens else 0


# positions past the context any speculative step may touch (the rotary table and the
# compiled decode's page tables are sized once for the largest k)
MAX_LOOKAHEAD_SLOTS = _lookahead(MAX_NUM_SPECULATIVE_TOKENS)


def lookahead_slots(speculative: SpeculativeConfig | None) -> int:
    """Token slots a decoding sequence holds beyond its tokens: k + 1 with speculation.

    >>> lookahead_slots(None), lookahead_slots(SpeculativeConfig("ngram", 3))
    (0, 4)
    """
    if speculative is None or not speculative.enabled:
        return 0
    return _lookahead(speculative.num_speculative_tokens)


def pages_for_request(num_prompt_tokens: int, max_tokens: int, page_size: int,
                      lookahead: int = 0) -> int:
    """KV pages a request holds at its longest: prompt, every output token, lookahead.

    >>> pages_for_request(30, 2, page_size=16), pages_for_request(30, 2, 16, lookahead=4)
    (2, 3)
    """
    return pages_needed(num_prompt_tokens + max_tokens + lookahead, page_size)


class LimitError(ValueError):
    """A request over a limit. ``str()`` is the engine's message; ``field`` (``"prompt"``
    or the input at fault) and ``problem`` are the adapters' wording of it."""

    def __init__(self, message: str, field: str, problem: str):
        super().__init__(message)
        self.field, self.problem = field, problem


def check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """The prompt must leave room for ``max_tokens`` new tokens in the context.

    >>> check_context(60, 4, max_model_len=64)
    >>> check_context(60, 5, max_model_len=64)
    Traceback (most recent call last):
    ...
    tandem.backends.engine.request_limits.LimitError: prompt (60 tokens) + max_tokens (5) = 65 exceeds the context (max_model_len=64); allowed: max_tokens <= 4
    """
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise LimitError(
            f"prompt has {num_prompt_tokens} tokens; the context (max_model_len) is "
            f"{max_model_len}, leaving room for at least one new token",
            "prompt", f"has {num_prompt_tokens} tokens; the context is {max_model_len} "
                      "tokens, leaving room for at least one new token")
    if max_tokens > room:
        raise LimitError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
            f"{num_prompt_tokens + max_tokens} exceeds the context (max_model_len="
            f"{max_model_len}); allowed: max_tokens <= {room}",
            "max_tokens", f"got {max_tokens}; the prompt has {num_prompt_tokens} tokens of a "
                          f"{max_model_len}-token context; allowed: <= {room}")


def check_pool_fit(num_prompt_tokens: int, max_tokens: int, page_size: int, num_pages: int,
                   lookahead: int = 0, pool: str = "pool") -> int:
    """The request's pages (:func:`pages_for_request`), refused when they exceed the
    ``num_pages`` of the whole pool: such a request could never run.

    >>> check_pool_fit(30, 2, page_size=16, num_pages=2)
    2
    >>> check_pool_fit(30, 2, 16, num_pages=2, lookahead=4)
    Traceback (most recent call last):
    ...
    tandem.backends.engine.request_limits.LimitError: request needs 3 KV pages (32 tokens), the pool has 2; lower max_tokens or raise num_pages
    """
    need = pages_for_request(num_prompt_tokens, max_tokens, page_size, lookahead)
    if need > num_pages:
        raise LimitError(
            f"request needs {need} KV pages ({num_prompt_tokens + max_tokens} tokens), the "
            f"{pool} has {num_pages}; lower max_tokens or raise num_pages",
            "max_tokens", f"the prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) "
                          f"need {need} KV pages; the {pool} has {num_pages} (lower max_tokens, "
                          "or serve with more num_pages)")
    return need
