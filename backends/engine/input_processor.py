"""Input processing: a request's prompt tokenized and its parameters validated against
the model and the KV pool, then built into a :class:`Sequence` with its stop ids,
logits controls and guide. Nothing here changes the engine's state."""
from __future__ import annotations

import itertools
from typing import Container


from .config import EngineConfig
from .guided import GuideCompiler, GuideState
from .logits_processors import LogitsControls, bad_words_token_ids
from .logprobs import PromptLogprobs
from .params import SamplingParams
from .request_limits import check_context, check_pool_fit
from .sequence import Sequence


class InputProcessor:
    """``make_sequence`` for an engine with this tokenizer (None: token ids only), vocabulary,
    context length and pool; request ids ``req-0``, ``req-1``... where none is given."""

    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, eos_ids: frozenset[int],
                 max_model_len: int, num_pages: int, num_lookahead_slots: int):
        self.config, self.tokenizer, self.vocab_size = config, tokenizer, vocab_size
        self.eos_ids, self.max_model_len = eos_ids, max_model_len
        self.num_pages, self.num_lookahead_slots = num_pages, num_lookahead_slots
        self.guides: GuideCompiler | None = None   # made on the first guided request
        self._ids = itertools.count()

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; allowed: a non-empty string or token id list")
            if self.tokenizer is None:
                raise ValueError(f"prompt is text but {self.config.model_dir} has no "
                                 "tokenizer.json; pass token ids instead")
            return self.tokenizer.encode(prompt).ids
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty; allowed: a non-empty string or token id list")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in 0..{self.vocab_size - 1}")
        return ids

    def make_sequence(self, prompt: str | list[int], params: SamplingParams,
                      request_id: str | None, in_use: Container[str]) -> Sequence:
        """Validate a request and build its sequence (``in_use``: the running request ids)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        ids = self.tokenize(prompt)
        check_context(len(ids), params.max_tokens, self.max_model_len)
        check_pool_fit(len(ids), params.max_tokens, self.config.page_size, self.num_pages,
                       self.num_lookahead_slots)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in in_use:
            raise ValueError(f"request_id {rid!r} is already in use")
        vocab = self.vocab_size
        if any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias has token ids outside the vocabulary "
                             f"({sorted(t for t in params.logit_bias if t >= vocab)[:8]}); "
                             f"allowed: ids in 0..{vocab - 1}")
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_ids)
        controls = LogitsControls.build(params, ids, stop_ids, vocab,
                                        self._bad_words(params.bad_words), self.config.device,
                                        self._guide(params, stop_ids))
        return Sequence(request_id=rid, prompt_ids=ids, params=params, stop_ids=stop_ids,
                        controls=controls,
                        logprobs=[] if params.logprobs else None,
                        top_logprobs=[] if params.top_logprobs else None,
                        prompt_logprobs=None if params.prompt_logprobs is None
                        else PromptLogprobs(ids, params.prompt_logprobs))

    def _guide(self, params: SamplingParams, stop_ids: frozenset[int]) -> GuideState | None:
        """The request's grammar matcher (its guide compiled, or from the cache); raises
        GuideError (a ValueError naming guided_decoding_guide) for a guide that does not
        compile."""
        if params.guided_decoding is None:
            return None
        if self.guides is None:
            self.guides = GuideCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_ids))
        return self.guides.matcher(params.guided_decoding, stop_ids)

    def _bad_words(self, words: list[str]) -> list[tuple[int, ...]]:
        """``bad_words`` as token id sequences (vLLM's tokenization), checked against
        the vocabulary."""
        if not words:
            return []
        if self.tokenizer is None:
            raise ValueError(f"bad_words needs a tokenizer; {self.config.model_dir} has no "
                             "tokenizer.json")
        ids = bad_words_token_ids(
            words, lambda w: self.tokenizer.encode(w, add_special_tokens=False).ids)
        if any(t >= self.vocab_size for word in ids for t in word):
            raise ValueError(f"bad_words={words!r} tokenize to ids outside the model's "
                             f"vocabulary (0..{self.vocab_size - 1})")
        return ids
