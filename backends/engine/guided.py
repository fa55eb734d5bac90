"""Structured output with xgrammar: guides compiled once per tokenizer and guide, and
per sequence a grammar matcher whose token bitmask masks the target's logits where
the decoder samples (prefill never samples, so nothing here runs there).

With speculation the mask is applied at every verified position: position ``j`` gets
the mask of the grammar state after the output and the first ``j`` drafts, so a draft
the grammar forbids has target probability 0 and is rejected like any other, and the
distribution sampled is the grammar-masked target distribution at every position (the
same argument as the logits controls'). Masks are computed by advancing the matcher
through the drafts and rolling it back at once; only committed tokens stay accepted.

>>> from tokenizers import Tokenizer                     # doctest: +SKIP
>>> compiler = GuideCompiler(Tokenizer.from_file("tokenizer.json"), vocab_size=4096)  # doctest: +SKIP
>>> guide = compiler.matcher(GuidedDecoding("regex", "[0-9]+"), stop_ids=[1])         # doctest: +SKIP
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .params import GuidedDecoding

COMPILE_TIMEOUT_S = 10.0     # a pathological guide is refused after this long
MAX_CACHED_GRAMMARS = 256
_FIELD = "guided_decoding_guide"
# xgrammar's messages start with where in its C++ they were raised: not the user's business
_CXX_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*(?:Check failed: \(.*?\) is false:\s*)?")


class GuideError(ValueError):
    """A guide xgrammar cannot compile (or not in time); the message names the field
    and gives xgrammar's reason."""

    def __init__(self, problem: str):
        super().__init__(f"{_FIELD}: {problem}")
        self.field = _FIELD


def xgrammar_reason(exc: BaseException) -> str:
    """xgrammar's error message without its source location, on one line.

    >>> xgrammar_reason(RuntimeError('[22:15:01] /project/cpp/json_schema_converter.cc:4944: '
    ...                              'Unsupported type "nonsense"\\n'))
    'Unsupported type "nonsense"'
    """
    text = " ".join(str(exc).split("\n"))
    return _CXX_PREFIX.sub("", text).strip() or type(exc).__name__


def tokenizer_info(tokenizer, vocab_size: int, stop_ids: list[int]):
    """xgrammar's view of a ``tokenizers`` tokenizer: its vocabulary type and prefix space
    as xgrammar detects them for the HF tokenizer, the model's ``vocab_size`` (the
    bitmask's width), and the added special tokens blanked, so no grammar can spell its
    text with ``<s>``-like tokens the detokenizer drops."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast    # xgrammar's own dependency

    detected = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tokenizer),
                                                  vocab_size=vocab_size, stop_token_ids=stop_ids)
    vocab = [""] * vocab_size
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            vocab[i] = token
    for i, added in tokenizer.get_added_tokens_decoder().items():
        if added.special and i < vocab_size:
            vocab[i] = ""
    return xgr.TokenizerInfo(vocab, detected.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=stop_ids, add_prefix_space=detected.add_prefix_space)


class GuideCompiler:
    """Compiles guides for one tokenizer, each (type, guide) once (an LRU of compiled
    grammars). xgrammar is imported on the first guide, not before (it takes seconds).

    A compile runs on its own thread and is waited for ``timeout_s``: past that the
    request is refused. A C++ compile cannot be interrupted: it finishes in the
    background (and is cached), and a request for the same guide meanwhile waits on it
    rather than starting another.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int],
                 timeout_s: float = COMPILE_TIMEOUT_S, max_cached: int = MAX_CACHED_GRAMMARS):
        if tokenizer is None:
            raise GuideError("this model has no tokenizer.json, which guided decoding needs")
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_ids = sorted(stop_ids)
        self.timeout_s, self.max_cached = timeout_s, max_cached
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._running: dict[tuple[str, str], threading.Event] = {}
        self._failures: OrderedDict[tuple[str, str], str] = OrderedDict()   # xgrammar's reasons
        self.compiles = 0          # how many compiles ran (the rest were cache hits)

    def _xgr_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_ids)
                # one thread per compile: a 2-core server has none to spare
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, spec: GuidedDecoding):
        """The compiled grammar of ``spec``; raises :class:`GuideError` with xgrammar's
        reason when it does not compile, or does not within ``timeout_s``."""
        spec.validate()
        key = (spec.guide_type, spec.guide)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            done = self._running.get(key)
            if done is None:
                done = self._running[key] = threading.Event()
                threading.Thread(target=self._run, args=(spec, key, done),
                                 name="tandem-guide-compile", daemon=True).start()
        if not done.wait(self.timeout_s):
            raise GuideError(f"the {spec.guide_type} guide did not compile within "
                             f"{self.timeout_s:g} s; simplify it")
        with self._lock:
            if key in self._cache:
                return self._cache[key]
            reason = self._failures.get(key, "it does not compile")
        raise GuideError(f"the {spec.guide_type} guide does not compile: {reason}")

    def _run(self, spec: GuidedDecoding, key, done: threading.Event) -> None:
        try:
            compiled = _compile(self._xgr_compiler(), spec)
        except Exception as exc:   # xgrammar raises RuntimeError for a bad guide
            with self._lock:
                self._failures[key] = xgrammar_reason(exc)
                while len(self._failures) > self.max_cached:
                    self._failures.popitem(last=False)
        else:
            with self._lock:
                self.compiles += 1
                self._cache[key] = compiled
                while len(self._cache) > self.max_cached:
                    self._cache.popitem(last=False)
        finally:
            with self._lock:
                self._running.pop(key, None)
            done.set()

    def matcher(self, spec: GuidedDecoding, stop_ids) -> GuideState:
        """A fresh matcher for one sequence; ``stop_ids`` are the tokens that end it (the
        grammar allows them once it is complete)."""
        return GuideState(self.compile(spec), sorted(stop_ids), self.vocab_size)


def _compile(compiler, spec: GuidedDecoding):
    # JSON in json.dumps' form (", " and ": ", no other whitespace): a code model left to
    # its habits pads JSON with whitespace until max_tokens, which is not JSON any more
    if spec.guide_type == "json":
        return compiler.compile_json_schema("{}", any_whitespace=False)
    if spec.guide_type == "json_schema":
        return compiler.compile_json_schema(spec.guide, any_whitespace=False)
    if spec.guide_type == "regex":
        return compiler.compile_regex(spec.guide)
    return compiler.compile_grammar(spec.guide)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GuideState:
    """One sequence's grammar matcher over its committed output tokens.

    ``fill`` computes masks at positions ahead of the output (the drafts) and leaves
    the matcher where it was; ``accept`` commits a token. Masks of the current step are
    memoised by the drafts they follow, so the verifier reuses the proposer's.
    """

    __slots__ = ("matcher", "vocab_size", "_memo")

    def __init__(self, compiled, stop_ids: list[int], vocab_size: int):
        import xgrammar as xgr

        # no stop token (ignore_eos without stop ids): the matcher ends with the grammar
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids or None,
                                          terminate_without_stop_token=not stop_ids)
        self.vocab_size = vocab_size
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    @property
    def completed(self) -> bool:
        """The output so far is a whole sentence of the grammar."""
        return self.matcher.is_completed()

    def accept(self, token: int) -> None:
        self._memo.clear()
        if not self.matcher.accept_token(int(token)):
            raise ValueError(f"token {token} is not allowed by the guide here (the mask and "
                             "the sampler disagree)")

    def fill(self, bitmask: torch.Tensor, row: int, ahead: list[int], n: int) -> list[bool]:
        """Fill ``bitmask[row + j]`` for positions ``j < n``, position ``j`` after the
        output and ``ahead[:len(ahead) - n + 1 + j]``; returns whether each position is
        reachable (a token of ``ahead`` the grammar forbids makes the rest unreachable:
        their rows stay all ones)."""
        first = len(ahead) - n + 1
        reachable = [False] * n
        accepted = 0
        try:
            for j in range(n):
                upto = first + j
                while accepted < upto:
                    if self.matcher.is_terminated() or not self.matcher.accept_token(ahead[accepted]):
                        return reachable
                    accepted += 1
                if self.matcher.is_terminated():
                    return reachable
                key = tuple(ahead[:upto])
                cached = self._memo.get(key)
                if cached is None:
                    self.matcher.fill_next_token_bitmask(bitmask, row + j)
                    self._memo[key] = bitmask[row + j].clone()
                else:
                    bitmask[row + j] = cached
                reachable[j] = True
            return reachable
        finally:
            if accepted:
                self.matcher.rollback(accepted)


@dataclass(slots=True)
class GuideMasks:
    """A step's token bitmasks: one row per (batch row, position) of the logits
    (``[B * n, ceil(V / 32)]`` int32, all ones where nothing is masked) and the flat rows
    to apply them to (the reachable positions of guided rows)."""
    bitmask: torch.Tensor
    flat_rows: list[int]
    n: int


def fill_guides(batch: int, n: int, vocab_size: int, rows: list[int], guides: list[GuideState],
                ahead: list[list[int]]) -> GuideMasks:
    """The bitmasks of the guided ``rows`` at ``n`` positions each, position ``j`` after
    the output and ``ahead[i][:len(ahead[i]) - n + 1 + j]``. Only xgrammar works here (it
    releases the GIL), so the engine fills them on a thread while the model runs."""
    bitmask = torch.full((batch * n, bitmask_words(vocab_size)), -1, dtype=torch.int32)
    flat_rows = []
    for row, guide, tokens in zip(rows, guides, ahead):
        reachable = guide.fill(bitmask, row * n, tokens, n)
        flat_rows += [row * n + j for j in range(n) if reachable[j]]
    return GuideMasks(bitmask, flat_rows, n)


@torch.inference_mode()
def mask_logits(logits: torch.Tensor, masks: GuideMasks) -> dict[int, int]:
    """Apply ``masks`` to ``logits`` [B, n, V] in place.

    Returns, per row whose guide leaves a reachable position without an allowed token
    (other controls may have removed the rest), the first such position; that row and
    those after it are set to zeros (finite, never used: the engine ends the sequence
    there)."""
    import xgrammar as xgr

    b, n, v = logits.shape
    if not masks.flat_rows:
        return {}
    flat = logits.view(b * n, v)
    xgr.apply_token_bitmask_inplace(flat, masks.bitmask.to(flat.device, non_blocking=True),
                                    vocab_size=v, indices=masks.flat_rows)
    finite = torch.isfinite(flat[masks.flat_rows].amax(-1)).tolist()
    dead: dict[int, int] = {}
    for r, ok in zip(masks.flat_rows, finite):
        if not ok and r // n not in dead:
            dead[r // n] = r % n
    for row, j in dead.items():
        logits[row, j:] = 0.0
    return dead

