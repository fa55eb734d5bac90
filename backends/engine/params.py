"""Sampling parameters, validated with messages that name the field and the allowed range."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# below this temperature sampling is greedy (as vLLM's _SAMPLING_EPS): dividing logits by
# a subnormal temperature overflows to inf and the distribution to NaN
SAMPLING_EPS = 1e-5
MAX_TOP_LOGPROBS = 20   # alternatives per position: OpenAI's limit (and vLLM's default)

# TensorRT-LLM's guided_decoding_guide_type values; "json" (any JSON value) needs no guide
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")
MAX_GUIDE_CHARS = 1 << 20   # a guide is compiled; bound its text before that


@dataclass(frozen=True, slots=True)
class GuidedDecoding:
    """Structured output: the text generated must be JSON (``json``), JSON valid against
    the schema ``guide`` (``json_schema``), match the regex ``guide`` (``regex``) or be a
    sentence of the EBNF grammar ``guide`` (``ebnf_grammar``, xgrammar's GBNF syntax with a
    ``root`` rule).

    >>> GuidedDecoding("regex", "[0-9]+").validate()
    >>> GuidedDecoding("yaml", "").validate()
    Traceback (most recent call last):
    ...
    ValueError: guided_decoding_guide_type='yaml' is invalid; allowed: one of json, json_schema, regex, ebnf_grammar
    """
    guide_type: str
    guide: str = ""

    def validate(self) -> None:
        if self.guide_type not in GUIDE_TYPES:
            raise ValueError(f"guided_decoding_guide_type={self.guide_type!r} is invalid; allowed: "
                             f"one of {', '.join(GUIDE_TYPES)}")
        if not isinstance(self.guide, str):
            raise ValueError(f"guided_decoding_guide must be text, got {type(self.guide).__name__}")
        if self.guide_type != "json" and not self.guide.strip():
            raise ValueError(f"guided_decoding_guide is empty; guided_decoding_guide_type "
                             f"{self.guide_type!r} needs one (a {GUIDE_NOUNS[self.guide_type]})")
        if len(self.guide) > MAX_GUIDE_CHARS:
            raise ValueError(f"guided_decoding_guide has {len(self.guide)} characters; allowed: up "
                             f"to {MAX_GUIDE_CHARS}")


GUIDE_NOUNS = {"json": "JSON", "json_schema": "JSON schema", "regex": "regular expression",
               "ebnf_grammar": "EBNF grammar"}


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding settings (vLLM's names and defaults).

    ``temperature`` below ``SAMPLING_EPS`` (0 included) is greedy; ``top_k == 0`` and
    ``top_p == 1`` disable those filters.

    The logits controls change the target's logits before temperature, top-k and top-p,
    in plain decoding and in speculative verification alike (vLLM's order: bad words,
    min_tokens, logit_bias, then the penalties):

    - ``repetition_penalty`` (> 0; 1 = off): a token seen in the prompt or the output has
      its logit divided by it when positive, multiplied when negative (HF, vLLM);
    - ``presence_penalty``, ``frequency_penalty`` (in [-2, 2]; 0 = off): OpenAI's, over the
      output tokens only: ``logit -= presence * (count > 0) + frequency * count``;
    - ``min_tokens``: the stop token ids (EOS included unless ``ignore_eos``) are masked,
      and stop strings do not end the request, until that many tokens were generated;
    - ``bad_words``: words never generated; each is tokenized with and without a leading
      space (as vLLM does); a one-token word is masked, a longer one has its last token
      masked when the output ends with the rest;
    - ``logit_bias``: token id -> a number added to its logit.

    ``guided_decoding`` (:class:`GuidedDecoding`) masks, after those, every token the
    guide does not allow next (structured output), in plain decoding and at every
    verified position alike.

    ``logprobs`` returns each generated token's log-probability under the distribution
    it was sampled from, after all of that (greedy: the log-softmax of the processed
    logits, i.e. at temperature 1), and ``top_logprobs`` (0..20) that many most likely
    tokens at each position under the same distribution. ``prompt_logprobs`` (None, or
    0..20 alternatives) returns the prompt's tokens' log-probabilities under the raw
    model (logprobs.py); the prompt is then computed, not taken from the prefix cache.

    >>> SamplingParams(max_tokens=32, temperature=0.0).validate()
    >>> SamplingParams(presence_penalty=2.5).validate()
    Traceback (most recent call last):
    ...
    ValueError: presence_penalty=2.5 is invalid; allowed: a number in [-2, 2] (0 = off)
    """
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    bad_words: list[str] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    guided_decoding: GuidedDecoding | None = None
    # not a sampling setting: prompts share cached KV only under the same salt (vLLM's
    # cache_salt), so tenants cannot probe each other's prompts through timing
    cache_salt: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def validate(self) -> None:
        def bad(name, value, allowed):
            raise ValueError(f"{name}={value!r} is invalid; allowed: {allowed}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens <= 0:
            bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            bad("temperature", self.temperature, "a number >= 0 (0 = greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "a number in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", self.top_k, "an integer >= 0 (0 = no top-k)")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", self.seed, "a non-negative integer or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", self.stop, "a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) \
            and math.isfinite(x)
        if not number(self.repetition_penalty) or not self.repetition_penalty > 0:
            bad("repetition_penalty", self.repetition_penalty, "a number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not number(value) or not -2 <= value <= 2:
                bad(name, value, "a number in [-2, 2] (0 = off)")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]")
        if not isinstance(self.bad_words, (list, tuple)) \
                or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            bad("bad_words", self.bad_words, "a list of non-blank strings")
        if not isinstance(self.logit_bias, dict) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 and number(b)
                for t, b in self.logit_bias.items()):
            bad("logit_bias", self.logit_bias, "a dict of token id (an integer >= 0) -> a finite "
                "number")
        if not isinstance(self.logprobs, bool):
            bad("logprobs", self.logprobs, "true or false")
        count = lambda x: isinstance(x, int) and not isinstance(x, bool) \
            and 0 <= x <= MAX_TOP_LOGPROBS
        if not count(self.top_logprobs) or (self.top_logprobs and not self.logprobs):
            bad("top_logprobs", self.top_logprobs, f"an integer in [0, {MAX_TOP_LOGPROBS}], "
                "above 0 only with logprobs")
        if self.prompt_logprobs is not None and not count(self.prompt_logprobs):
            bad("prompt_logprobs", self.prompt_logprobs, f"None or an integer in "
                f"[0, {MAX_TOP_LOGPROBS}]")
        if self.guided_decoding is not None:
            if not isinstance(self.guided_decoding, GuidedDecoding):
                bad("guided_decoding", self.guided_decoding, "a GuidedDecoding or None")
            self.guided_decoding.validate()
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            bad("cache_salt", self.cache_salt, "a string or None")
