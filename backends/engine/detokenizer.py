"""Incremental detokenization with stop strings.

Byte-level BPE can split one character over several tokens; text is released only
once it decodes cleanly, and while stop strings are set, the last few characters are
held back so a stop string is never streamed in part. With ``min_tokens`` a stop string
ends the text only when completed by a token after the first ``min_tokens`` (as vLLM).
"""
from __future__ import annotations

from tokenizers import Tokenizer

_CONTEXT = 5  # tokens decoded before the new ones, so merges at the boundary come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], stop: list[str],
                 min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self.num_added = 0
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> None:
        """Append one generated token; sets ``stopped`` if a stop string completed."""
        if self.tokenizer is None or self.stopped:
            return
        self.num_added += 1
        self.ids.append(token_id)
        decode = lambda a, b: self.tokenizer.decode(self.ids[a:b], skip_special_tokens=True)
        prefix = decode(self.prefix_offset, self.read_offset)
        full = decode(self.prefix_offset, len(self.ids))
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # an incomplete character: wait for the next token
        before = len(self.text)
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.stop and self.num_added > self.min_tokens:
            start = max(0, before - self.hold)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True

    def take(self, final: bool) -> str:
        """Text not yet handed out (all of it when ``final``)."""
        end = len(self.text) if final or self.stopped else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
