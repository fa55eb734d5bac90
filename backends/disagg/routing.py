"""Conditional disaggregation: where each request's prompt is prefilled.

``kv_transfer`` decides per request, before it reserves anything: a request routed
``local`` gets no reservation (its descriptor is the no-transfer sentinel), prefill
passes it through, and the decode engine prefills it itself — chunked, mixed into its
decode batch, as the colocated engine does. A request routed ``remote`` goes to the
prefill side (the server's prefill process, or the prefill servers of
``--prefill-endpoints``) and its KV into pages the decoder reserved.

:func:`choose_path` is a pure function of the prompt length, the prefill side's backlog
(:class:`PrefillLoad`: prompts sent there whose KV has not all arrived, and their
tokens, from which it estimates the wait), and the decode batch's load
(:class:`DecodeLoad`), under the thresholds of a :class:`RoutingPolicy`. Its answer is a
:class:`Route` (path and reason), which the ``tandem_disagg_requests_total`` metric
counts.

Rules of the ``conditional`` policy, in order:

1. ``no_prefill`` — a one-token prompt has nothing to prefill (local, every policy);
   ``prompt_logprobs`` — a request for its prompt's log-probabilities needs the logits
   at every prompt position, which only the engine that samples computes (local, every
   policy; the prefill side never samples);
2. ``short_prompt`` — a prompt of at most ``local_prompt_tokens`` is prefilled where
   it decodes (one mixed step costs the running streams less than the transfer and the
   two extra hops cost this request) — unless the decode engine's own prefill backlog,
   this prompt included, would exceed ``max_local_prefill_tokens``: then
   ``decode_busy``, to the prefill side. Only the tokens decode has not cached count
   (``cached_tokens``: its prefix cache holds the rest): a long prompt whose prefix
   decode holds is a short prompt, ``cached_prefix``;
3. ``prefill_down`` / ``prefill_busy`` — a longer prompt is prefilled here while the
   prefill side is down (its prefill servers failed the last job: none took it), or
   when its estimated wait exceeds ``max_prefill_wait_ms``, and decode's backlog has
   room for it;
4. ``long_prompt`` — otherwise to the prefill side, so no long prefill stalls the
   decode batch.

>>> p = RoutingPolicy()
>>> choose_path(40, PrefillLoad(), DecodeLoad(), p)
Route(path='local', reason='short_prompt')
>>> choose_path(1500, PrefillLoad(), DecodeLoad(), p)
Route(path='remote', reason='long_prompt')
>>> choose_path(1500, PrefillLoad(requests=3, tokens=6000), DecodeLoad(prefill_tokens=100), p)
Route(path='local', reason='prefill_busy')
>>> choose_path(1500, PrefillLoad(), DecodeLoad(), p, cached_tokens=1472)
Route(path='local', reason='cached_prefix')
>>> RoutingPolicy.parse("conditional:local_prompt_tokens=64").local_prompt_tokens
64
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

LOCAL, REMOTE = "local", "remote"
PATHS = (LOCAL, REMOTE)
CONDITIONAL = "conditional"
# conditional: per request; remote: every prompt to the prefill side (the plain
# disaggregated server); local: every prompt prefilled by decode (for comparisons)
POLICIES = (CONDITIONAL, REMOTE, LOCAL)
REASONS = ("no_prefill", "policy", "short_prompt", "cached_prefix", "decode_busy", "prefill_down",
           "prefill_busy", "long_prompt")


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    """The prefill side as this decode server sees it: prompts sent there whose KV has
    not all arrived yet, and how many tokens they prefill; ``down`` while its prefill
    servers failed the last job and are not yet due for another try."""
    requests: int = 0
    tokens: int = 0
    down: bool = False


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    """The decode engine's own prefill backlog: prompt tokens of local-path requests
    (admitted, waiting, or routed to it and still on the way) whose KV it has not
    computed yet. Each of them is a chunk
    mixed into a decode step, which every running stream waits for."""
    prefill_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Route:
    path: str      # LOCAL | REMOTE
    reason: str    # one of REASONS


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """The policy and its thresholds (defaults measured on a 2-core CPU host with the
    demo model, bf16; see the README, "Conditional disaggregation")."""
    mode: str = CONDITIONAL
    local_prompt_tokens: int = 256        # prompts up to this long prefill where they decode
    prefill_tokens_per_s: int = 5000      # the prefill side's speed, for its estimated wait
    max_prefill_wait_ms: int = 1000       # a longer estimated wait: prefill locally ...
    max_local_prefill_tokens: int = 2048  # ... while decode's own backlog stays within this

    def __post_init__(self):
        if self.mode not in POLICIES:
            raise ValueError(f"disagg_policy {self.mode!r}; allowed: {', '.join(POLICIES)}")
        for f in fields(self)[1:]:
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < (1 if f.name == "prefill_tokens_per_s" else 0):
                raise ValueError(f"disagg_policy: {f.name}={value!r}; allowed: an integer >= "
                                 f"{1 if f.name == 'prefill_tokens_per_s' else 0}")

    @classmethod
    def parse(cls, text: str) -> "RoutingPolicy":
        """``"conditional"``, ``"remote"``, ``"local"``, optionally with thresholds:
        ``"conditional:local_prompt_tokens=128,max_prefill_wait_ms=500"``.

        >>> RoutingPolicy.parse("remote").mode
        'remote'
        >>> RoutingPolicy.parse("sometimes")
        Traceback (most recent call last):
        ValueError: disagg_policy 'sometimes'; allowed: conditional, remote, local
        """
        mode, _, rest = (text or CONDITIONAL).strip().partition(":")
        names = [f.name for f in fields(cls)][1:]
        values: dict[str, int] = {}
        for item in filter(None, (x.strip() for x in rest.split(","))):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or key not in names:
                raise ValueError(f"disagg_policy: {item!r} is not name=value with a name of "
                                 f"{', '.join(names)}")
            try:
                values[key] = int(raw)
            except ValueError:
                raise ValueError(f"disagg_policy: {key}={raw.strip()!r}; allowed: an integer") from None
        return replace(cls(mode.strip() or CONDITIONAL), **values)

    def estimated_wait_s(self, prefill: PrefillLoad) -> float:
        """How long a prompt sent now waits for the prefill side's backlog.

        >>> RoutingPolicy(prefill_tokens_per_s=4000).estimated_wait_s(PrefillLoad(2, 3000))
        0.75
        """
        return prefill.tokens / self.prefill_tokens_per_s


def choose_path(prompt_len: int, prefill: PrefillLoad, decode: DecodeLoad,
                policy: RoutingPolicy, cached_tokens: int = 0, prompt_logits: bool = False) -> Route:
    """Where a prompt of ``prompt_len`` tokens, the first ``cached_tokens`` of them in
    decode's prefix cache, is prefilled (see the module docstring); ``prompt_logits``:
    the request asked for its prompt's log-probabilities.

    >>> choose_path(1500, PrefillLoad(), DecodeLoad(), RoutingPolicy(), prompt_logits=True)
    Route(path='local', reason='prompt_logprobs')
    """
    if prompt_len <= 1:
        return Route(LOCAL, "no_prefill")
    if prompt_logits:
        return Route(LOCAL, "prompt_logprobs")
    if policy.mode != CONDITIONAL:
        return Route(policy.mode, "policy")
    prompt_len -= cached_tokens     # what a prefill would compute
    fits_here = decode.prefill_tokens + prompt_len <= policy.max_local_prefill_tokens
    if prompt_len <= policy.local_prompt_tokens:
        if not fits_here:
            return Route(REMOTE, "decode_busy")
        return Route(LOCAL, "cached_prefix" if cached_tokens else "short_prompt")
    if fits_here and prefill.down:
        return Route(LOCAL, "prefill_down")
    if fits_here and policy.estimated_wait_s(prefill) * 1000 > policy.max_prefill_wait_ms:
        return Route(LOCAL, "prefill_busy")
    return Route(REMOTE, "long_prompt")
