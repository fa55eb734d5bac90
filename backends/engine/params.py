"""Sampling parameters, validated with messages that name the field and the allowed range."""
from __future__ import annotations

from dataclasses import dataclass, field

# below this temperature sampling is greedy (as vLLM's _SAMPLING_EPS): dividing logits by
# a subnormal temperature overflows to inf and the distribution to NaN
SAMPLING_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding settings (vLLM's names and defaults).

    ``temperature`` below ``SAMPLING_EPS`` (0 included) is greedy; ``top_k == 0`` and
    ``top_p == 1`` disable those filters.

    >>> SamplingParams(max_tokens=32, temperature=0.0).validate()
    """
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

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
