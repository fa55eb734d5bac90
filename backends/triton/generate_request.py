"""Request tensors of Tandem's Triton models, without Triton.

The interface is the TensorRT-LLM backend's text ensemble (v0.14.0's names, and the
newer ``min_tokens``, ``seed``, ``exclude_input_in_output`` and ``return_num_*``), so its
clients, ``genai-perf``, ``perf_analyzer`` and Triton's HTTP ``generate`` /
``generate_stream`` endpoints work unchanged. A request comes in one of two forms that
share the sampling inputs:

- text: ``text_input`` (the ensembles ``tandem`` and ``tandem_colocated``, and their
  ``preprocess`` step): :func:`parse_generate_request`;
- token ids: ``input_ids`` (``llm``, ``decode``, ``kv_transfer`` and the ensemble
  ``tandem_tokens``): :func:`parse_token_request`, the one parser those models share.

Every tensor carries the batch dimension (``max_batch_size: 1``): a client sends
``text_input`` with shape ``[1, 1]``, ``input_ids``, ``stop_words`` and the other lists
with shape ``[1, n]``. :data:`INPUTS` gives each input's Triton type and dims (the
configs declare exactly these; a unit test holds them to it).

Inputs and defaults (all but ``text_input`` / ``input_ids`` optional):

==========================  ======  ===========  ==========================================
name                        type    default      allowed
==========================  ======  ===========  ==========================================
text_input                  STRING  (required)   non-empty UTF-8 text (text form)
input_ids                   INT32   (required)   non-empty token ids in the vocabulary
                                                 (token form)
max_tokens                  INT32   16           >= 1; prompt + max_tokens <= the context
stream                      BOOL    false        true: one response per engine step
temperature                 FP32    1.0          >= 0; 0 = greedy
top_p                       FP32    1.0          (0, 1]; 1 = no nucleus filter
top_k                       INT32   0            >= 0; 0 = no top-k filter
seed, random_seed           UINT64  (random)     any; ``seed`` wins when both are given
stop_words                  STRING  none         up to 16 strings of up to 256 characters;
                                                 text stops before them; "" ignored
bad_words                   STRING  none         up to 16 non-blank strings of up to 256
                                                 characters, never generated; "" ignored
end_id                      INT32   model's EOS  a token id; replaces the EOS token
ignore_eos                  BOOL    false        true: the model's EOS does not end the
                                                 text (vLLM's; for fixed output lengths)
pad_id                      INT32   none         a token id; accepted, never used (no
                                                 response is padded)
num_return_sequences        INT32   1            1..16 independent samples of the prompt
                                                 (seeded: seed + i), each response
                                                 carrying its ``sequence_index``
beam_width                  INT32   1            1 (no beam search)
repetition_penalty          FP32    1.0          > 0; 1 = off
presence_penalty            FP32    0.0          [-2, 2]; 0 = off
frequency_penalty           FP32    0.0          [-2, 2]; 0 = off
min_tokens, min_length      INT32   0            0..max_tokens: no EOS / stop before that
                                                 many tokens; ``min_tokens`` wins
length_penalty              FP32    1.0          finite; accepted, no effect (it only
                                                 ranks beams)
embedding_bias_words        STRING  none         up to 64 words of up to 256 characters,
embedding_bias_weights      FP32    none         with one finite weight each: every token
                                                 of a word gets its weight added to its
                                                 logit; "" ignored
logit_bias_token_ids        INT32   none         up to 1024 token ids in the vocabulary,
logit_bias_values           FP32    none         with one finite value each, added to
                                                 the token's logit (OpenAI's and vLLM's
                                                 ``logit_bias``); added to the words'
return_log_probs            BOOL    false        true: ``cum_log_probs`` and
                                                 ``output_log_probs`` carry them
num_top_log_probs           INT32   0            0..20, with ``return_log_probs``: the
                                                 most likely tokens at each position
                                                 (``output_top_token_ids``/``_log_probs``)
num_prompt_log_probs        INT32   -1 (off)     0..20: the prompt's tokens' log
                                                 probabilities (raw model), with that
                                                 many alternatives each, on the first
                                                 response (``prompt_*`` outputs); such a
                                                 prompt is computed by decode, never
                                                 from the prefix cache
return_context_logits       BOOL    false        false (no logits are returned)
return_generation_logits    BOOL    false        false (no logits are returned)
return_num_input_tokens     BOOL    false        any; the outputs are on every response
return_num_output_tokens    BOOL    false        any; the outputs are on every response
return_finish_reason        BOOL    false        any; the outputs are on every response
return_perf_metrics         BOOL    false        true: the KV cache, timing and speculation
                                                 outputs (TensorRT-LLM's) carry values
cache_salt                  STRING  none         up to 256 characters: prompts share cached
                                                 KV only with the same salt
lora_name                   STRING  none         a LoRA adapter the server serves
                                                 (``--lora-modules``, /v1/load_lora_adapter)
lora_task_id                UINT64  none         TensorRT-LLM's: the adapter with that id
lora_weights, lora_config   FP16,   none         TensorRT-LLM's adapter tensors, with
                            INT32                ``lora_task_id``, on its first request:
                                                 written once as a PEFT adapter
                                                 (:mod:`.trtllm_lora`), cached after
guided_decoding_guide_type  STRING  none         json, json_schema, regex or ebnf_grammar:
                                                 structured output (xgrammar)
guided_decoding_guide       STRING  none         the schema, regex or EBNF grammar (not
                                                 for json); compiled before anything is
                                                 reserved, an invalid one refused with
                                                 xgrammar's reason
exclude_input_in_output     BOOL    false        text form only: false makes the
                                                 non-streaming text start with the
                                                 prompt (as in TensorRT-LLM); streaming
                                                 never repeats the prompt
==========================  ======  ===========  ==========================================

The ``return_*`` gates cannot withhold an output: Triton's ensemble sends a streamed
response only when it has every requested output, and perf_analyzer and genai-perf
request them all. The outputs are :mod:`.response_arrays`'.

>>> inputs = {"text_input": np.array([[b"def f():"]], dtype=object),
...           "max_tokens": np.array([[8]], dtype=np.int32)}
>>> req = parse_generate_request(inputs.get)
>>> (req.prompt, req.max_tokens, req.stream, req.num_return_sequences)
('def f():', 8, False, 1)
>>> req = parse_token_request({"input_ids": np.array([[5, 9]], dtype=np.int32)}.get,
...                           vocab_size=100, max_model_len=64)
>>> req.prompt
[5, 9]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..engine import request_limits
from ..engine.params import GUIDE_NOUNS, GUIDE_TYPES, MAX_GUIDE_CHARS, MAX_TOP_LOGPROBS, GuidedDecoding

# name -> (Triton type, dims without the batch dimension); all optional
SAMPLING_INPUTS = {
    "max_tokens": ("TYPE_INT32", [1]),
    "stream": ("TYPE_BOOL", [1]),
    "temperature": ("TYPE_FP32", [1]),
    "top_p": ("TYPE_FP32", [1]),
    "top_k": ("TYPE_INT32", [1]),
    "seed": ("TYPE_UINT64", [1]),
    "random_seed": ("TYPE_UINT64", [1]),
    "stop_words": ("TYPE_STRING", [-1]),
    "bad_words": ("TYPE_STRING", [-1]),
    "end_id": ("TYPE_INT32", [1]),
    "ignore_eos": ("TYPE_BOOL", [1]),
    "pad_id": ("TYPE_INT32", [1]),
    "num_return_sequences": ("TYPE_INT32", [1]),
    "beam_width": ("TYPE_INT32", [1]),
    "repetition_penalty": ("TYPE_FP32", [1]),
    "presence_penalty": ("TYPE_FP32", [1]),
    "frequency_penalty": ("TYPE_FP32", [1]),
    "min_tokens": ("TYPE_INT32", [1]),
    "min_length": ("TYPE_INT32", [1]),
    "length_penalty": ("TYPE_FP32", [1]),
    "embedding_bias_words": ("TYPE_STRING", [-1]),
    "embedding_bias_weights": ("TYPE_FP32", [-1]),
    "logit_bias_token_ids": ("TYPE_INT32", [-1]),
    "logit_bias_values": ("TYPE_FP32", [-1]),
    "return_log_probs": ("TYPE_BOOL", [1]),
    "num_top_log_probs": ("TYPE_INT32", [1]),
    "num_prompt_log_probs": ("TYPE_INT32", [1]),
    "return_context_logits": ("TYPE_BOOL", [1]),
    "return_generation_logits": ("TYPE_BOOL", [1]),
    "return_num_input_tokens": ("TYPE_BOOL", [1]),
    "return_num_output_tokens": ("TYPE_BOOL", [1]),
    "return_finish_reason": ("TYPE_BOOL", [1]),
    "return_perf_metrics": ("TYPE_BOOL", [1]),
    "cache_salt": ("TYPE_STRING", [1]),
    # LoRA: an adapter the server serves, by name (Tandem's, the OpenAI model field) or by
    # id (TensorRT-LLM's lora_task_id); TensorRT-LLM's weight tensors are refused
    "lora_name": ("TYPE_STRING", [1]),
    "lora_task_id": ("TYPE_UINT64", [1]),
    "lora_weights": ("TYPE_FP16", [-1, -1]),
    "lora_config": ("TYPE_INT32", [-1, 3]),
    # TensorRT-LLM's guided decoding (structured output)
    "guided_decoding_guide_type": ("TYPE_STRING", [1]),
    "guided_decoding_guide": ("TYPE_STRING", [1]),
}
INPUTS = {"text_input": ("TYPE_STRING", [1]), "input_ids": ("TYPE_INT32", [-1]), **SAMPLING_INPUTS,
          "exclude_input_in_output": ("TYPE_BOOL", [1])}
SAMPLING_NAMES = tuple(SAMPLING_INPUTS)
INPUT_NAMES = ("text_input", *SAMPLING_NAMES, "exclude_input_in_output")
TOKEN_INPUT_NAMES = ("input_ids", *SAMPLING_NAMES)

GetInput = Callable[[str], "np.ndarray | None"]
# each generated token is checked against every stop word on the engine thread
MAX_STOP_WORDS = 16
MAX_STOP_WORD_CHARS = 256
MAX_BIAS_WORDS = 64
MAX_BIAS_TOKENS = 1024
MAX_RETURN_SEQUENCES = 16
UINT64 = 1 << 64


class RequestError(ValueError):
    """A user error in one input; the message names the field and what is allowed."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"{field_name}: {problem}")
        self.field = field_name


@dataclass(slots=True)
class GenerateRequest:
    prompt: str | list[int]       # text (text form) or token ids (token form)
    max_tokens: int = 16
    stream: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_words: list[str] = field(default_factory=list)
    bad_words: list[str] = field(default_factory=list)
    end_id: int | None = None
    ignore_eos: bool = False
    pad_id: int | None = None                  # accepted; nothing is padded
    num_return_sequences: int = 1
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    length_penalty: float = 1.0                # accepted; ranks beams only, and there are none
    embedding_bias: list[tuple[str, float]] = field(default_factory=list)
    token_bias: dict[int, float] = field(default_factory=dict)   # logit_bias_token_ids/_values
    return_log_probs: bool = False
    num_top_log_probs: int = 0
    num_prompt_log_probs: int | None = None
    return_perf_metrics: bool = False
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_task_id: int | None = None
    # TensorRT-LLM's adapter tensors (with lora_task_id, on its first request)
    lora_weights: np.ndarray | None = field(default=None, repr=False)
    lora_config: np.ndarray | None = field(default=None, repr=False)
    guided_decoding: GuidedDecoding | None = None
    exclude_input_in_output: bool = False

    def sampling_params(self, index: int = 0, tokenizer=None):
        """The engine's ``SamplingParams`` for sample ``index`` of this request (a seeded
        request's sample ``i`` gets ``seed + i``). ``tokenizer`` turns
        ``embedding_bias_words`` into token ids; required when the request has them.

        >>> GenerateRequest([1], seed=7, num_return_sequences=2).sampling_params(1).seed
        8
        """
        from tandem.backends.engine.params import SamplingParams

        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=None if self.seed is None else (self.seed + index) % UINT64,
            stop=list(self.stop_words),
            stop_token_ids=[] if self.end_id is None else [self.end_id],
            # end_id replaces the model's EOS, as TensorRT-LLM's end_id does
            ignore_eos=self.ignore_eos or self.end_id is not None,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            min_tokens=self.min_tokens,
            bad_words=list(self.bad_words),
            logit_bias=logit_bias(self.embedding_bias, tokenizer, self.token_bias),
            logprobs=self.return_log_probs,
            top_logprobs=self.num_top_log_probs,
            prompt_logprobs=self.num_prompt_log_probs,
            cache_salt=self.cache_salt,
            guided_decoding=self.guided_decoding,
        )


def logit_bias(words: list[tuple[str, float]], tokenizer,
               token_bias: dict[int, float] | None = None) -> dict[int, float]:
    """TensorRT-LLM's embedding bias as the engine's ``logit_bias``: every token of each
    word (tokenized without special tokens) gets the word's weight added; a token in
    several words gets the sum; ``token_bias`` (token id -> value) adds to that.

    >>> class Tok:
    ...     def encode(self, text, add_special_tokens=True):
    ...         return type("E", (), {"ids": [ord(c) for c in text]})()
    >>> logit_bias([("ab", 1.5), ("b", -1.0)], Tok())
    {97: 1.5, 98: 0.5}
    """
    if not words:
        return dict(token_bias or {})
    if tokenizer is None:
        raise RequestError("embedding_bias_words", "this model has no tokenizer to turn words into tokens")
    bias: dict[int, float] = {}
    for word, weight in words:
        for token in tokenizer.encode(word, add_special_tokens=False).ids:
            bias[int(token)] = bias.get(int(token), 0.0) + weight
    for token, value in (token_bias or {}).items():
        bias[token] = bias.get(token, 0.0) + value
    return bias


# ---- reading one field --------------------------------------------------------------
def scalar(get: GetInput, name: str):
    """The single value of input ``name``, or None when the request omits it."""
    arr = get(name)
    if arr is None:
        return None
    flat = np.asarray(arr).reshape(-1)
    if flat.size != 1:
        raise RequestError(name, f"expected one value, got {flat.size} (shape {list(np.shape(arr))})")
    return flat[0]


def as_text(value, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(name, f"is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    return str(value)


def flag(get: GetInput, name: str, default: bool) -> bool:
    value = scalar(get, name)
    return default if value is None else bool(value)


def _int(get: GetInput, name: str, default, minimum: int, allowed: str, maximum: int | None = None):
    value = scalar(get, name)
    if value is None:
        return default
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        raise RequestError(name, f"got {value}; allowed: {allowed}")
    return value


def _float(get: GetInput, name: str, default: float, ok: Callable[[float], bool], allowed: str) -> float:
    value = scalar(get, name)
    if value is None:
        return default
    value = float(value)
    if not math.isfinite(value) or not ok(value):
        raise RequestError(name, f"got {value}; allowed: {allowed}")
    return value


def _words(get: GetInput, name: str, limit: int, allowed: str) -> list[str]:
    """A STRING list (``[1, N]``); empty strings are TensorRT-LLM's padding of ragged
    lists and are dropped. Bounded before anything is decoded."""
    arr = get(name)
    if arr is None:
        return []
    arr = np.asarray(arr).reshape(-1)
    if arr.size > 4 * limit:   # before decoding anything (padding aside)
        raise RequestError(name, f"has {arr.size} entries; allowed: up to {limit} {allowed}")
    words = []
    for w in arr:
        text = as_text(w, name)
        if len(text) > MAX_STOP_WORD_CHARS:
            raise RequestError(name, f"an entry has {len(text)} characters; allowed: up to "
                                     f"{MAX_STOP_WORD_CHARS}")
        words.append(text)
    if sum(1 for w in words if w) > limit:
        raise RequestError(name, f"has {sum(1 for w in words if w)} {allowed}; allowed: up to {limit}")
    return words


def _embedding_bias(get: GetInput) -> list[tuple[str, float]]:
    words = _words(get, "embedding_bias_words", MAX_BIAS_WORDS, "words")
    weights = get("embedding_bias_weights")
    weights = [] if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
    if len(words) != len(weights):
        raise RequestError("embedding_bias_weights", f"has {len(weights)} weights for {len(words)} "
                                                     "embedding_bias_words; allowed: one weight per word")
    for w in weights:
        if not math.isfinite(w):
            raise RequestError("embedding_bias_weights", f"got {w}; allowed: finite numbers")
    return [(word, float(w)) for word, w in zip(words, weights) if word]


def _token_bias(get: GetInput, vocab_size: int | None) -> dict[int, float]:
    """``logit_bias_token_ids`` and ``logit_bias_values``: token id -> a value added to its
    logit (a repeated id gets the sum, as in the words' bias)."""
    ids, values = get("logit_bias_token_ids"), get("logit_bias_values")
    ids = [] if ids is None else np.asarray(ids).reshape(-1).tolist()
    values = [] if values is None else np.asarray(values, dtype=np.float64).reshape(-1).tolist()
    if len(ids) != len(values):
        raise RequestError("logit_bias_values", f"has {len(values)} values for {len(ids)} "
                                                "logit_bias_token_ids; allowed: one value per id")
    if len(ids) > MAX_BIAS_TOKENS:
        raise RequestError("logit_bias_token_ids", f"has {len(ids)} ids; allowed: up to {MAX_BIAS_TOKENS}")
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        top = "" if vocab_size is None else f" in [0, {vocab_size - 1}]"
        raise RequestError("logit_bias_token_ids", f"got {bad[:8]}; allowed: token ids{top}")
    bias: dict[int, float] = {}
    for token, value in zip(ids, values):
        if not math.isfinite(value):
            raise RequestError("logit_bias_values", f"got {value}; allowed: finite numbers")
        bias[int(token)] = bias.get(int(token), 0.0) + value
    return bias


def _lora(get: GetInput) -> dict:
    """``lora_name`` / ``lora_task_id`` (which adapter the engine model resolves in the
    server's registry), and TensorRT-LLM's adapter tensors that come with a task id."""
    weights, config = get("lora_weights"), get("lora_config")
    if (weights is None) != (config is None):
        raise RequestError("lora_config" if config is None else "lora_weights",
                           "lora_weights and lora_config come together (with lora_task_id)")
    if weights is not None and scalar(get, "lora_task_id") is None:
        raise RequestError("lora_task_id", "is required with lora_weights and lora_config (the adapter is "
                                           "cached under it)")
    name = scalar(get, "lora_name")
    name = None if name is None else as_text(name, "lora_name").strip() or None
    task = scalar(get, "lora_task_id")
    if name is not None and task is not None:
        raise RequestError("lora_task_id", "send lora_name or lora_task_id, not both")
    if name is not None and len(name) > 64:
        raise RequestError("lora_name", f"has {len(name)} characters; allowed: an adapter name of up to 64")
    return dict(lora_name=name, lora_task_id=None if task is None else int(task),
                lora_weights=None if weights is None else np.asarray(weights),
                lora_config=None if config is None else np.asarray(config))


def _cache_salt(get: GetInput) -> str | None:
    value = scalar(get, "cache_salt")
    if value is None:
        return None
    salt = as_text(value, "cache_salt")
    if len(salt) > MAX_STOP_WORD_CHARS:
        raise RequestError("cache_salt", f"has {len(salt)} characters; allowed: up to {MAX_STOP_WORD_CHARS}")
    return salt or None


def _guided_decoding(get: GetInput) -> GuidedDecoding | None:
    """TensorRT-LLM's ``guided_decoding_guide_type`` and ``guided_decoding_guide``; its
    compile (:func:`check_guide`) is the model's, which has the tokenizer."""
    kind = scalar(get, "guided_decoding_guide_type")
    guide = scalar(get, "guided_decoding_guide")
    kind = None if kind is None else as_text(kind, "guided_decoding_guide_type").strip()
    guide = None if guide is None else as_text(guide, "guided_decoding_guide")
    if not kind:
        if guide:
            raise RequestError("guided_decoding_guide_type", f"is required with guided_decoding_guide; "
                                                             f"allowed: {', '.join(GUIDE_TYPES)}")
        return None
    if kind not in GUIDE_TYPES:
        raise RequestError("guided_decoding_guide_type", f"got {kind!r}; allowed: {', '.join(GUIDE_TYPES)}")
    if kind != "json" and not (guide or "").strip():
        raise RequestError("guided_decoding_guide", f"is required with guided_decoding_guide_type {kind!r} "
                                                    f"(a {GUIDE_NOUNS[kind]})")
    if guide is not None and len(guide) > MAX_GUIDE_CHARS:
        raise RequestError("guided_decoding_guide", f"has {len(guide)} characters; allowed: up to "
                                                    f"{MAX_GUIDE_CHARS}")
    return GuidedDecoding(kind, "" if kind == "json" else guide)


def check_guide(req: GenerateRequest, compile_guide: Callable[[GuidedDecoding], object]) -> None:
    """Compile the request's guide (``compile_guide``, e.g. a ``GuideCompiler``'s, which
    caches) before anything is reserved: one that does not compile is refused naming
    ``guided_decoding_guide`` with xgrammar's reason."""
    if req.guided_decoding is None:
        return
    try:
        compile_guide(req.guided_decoding)
    except ValueError as e:
        raise RequestError("guided_decoding_guide",
                           str(e).removeprefix("guided_decoding_guide: ")) from None


def _prompt_log_probs(get: GetInput) -> int | None:
    value = _int(get, "num_prompt_log_probs", -1, -1,
                 f"-1 (off) or an integer in [0, {MAX_TOP_LOGPROBS}]", MAX_TOP_LOGPROBS)
    return None if value < 0 else value


def _refused(get: GetInput, name: str, why: str) -> None:
    if flag(get, name, False):
        raise RequestError(name, f"not supported: {why}; allowed: false")


# ---- the two request forms ------------------------------------------------------------
def _sampling(get: GetInput, vocab_size: int | None) -> dict:
    """The sampling inputs both forms share, validated."""
    seed = scalar(get, "seed")
    if seed is None:
        seed = scalar(get, "random_seed")
    min_tokens = scalar(get, "min_tokens")
    min_name = "min_tokens" if min_tokens is not None else "min_length"

    stop_words = [w for w in _words(get, "stop_words", MAX_STOP_WORDS, "words") if w]
    bad_words = [w for w in _words(get, "bad_words", MAX_STOP_WORDS, "words") if w]
    for w in bad_words:
        if not w.strip():
            raise RequestError("bad_words", f"got {w!r}; allowed: non-blank strings")

    vocab = "a token id >= 0" if vocab_size is None else f"a token id in [0, {vocab_size - 1}]"
    top = None if vocab_size is None else vocab_size - 1
    end_id = _int(get, "end_id", None, 0, vocab, top)
    pad_id = _int(get, "pad_id", None, 0, vocab, top)

    _int(get, "beam_width", 1, 1, "1 (Tandem has no beam search; num_return_sequences gives several "
         "samples)", 1)
    _refused(get, "return_context_logits", "Tandem returns no context logits")
    _refused(get, "return_generation_logits", "Tandem returns no generation logits")

    max_tokens = _int(get, "max_tokens", 16, 1, "an integer >= 1")
    return_log_probs = flag(get, "return_log_probs", False)
    num_top = _int(get, "num_top_log_probs", 0, 0, f"an integer in [0, {MAX_TOP_LOGPROBS}]",
                   MAX_TOP_LOGPROBS)
    if num_top and not return_log_probs:
        raise RequestError("num_top_log_probs", f"got {num_top} without return_log_probs; "
                           "allowed: 0, or with return_log_probs true")
    return dict(
        max_tokens=max_tokens,
        stream=flag(get, "stream", False),
        temperature=_float(get, "temperature", 1.0, lambda v: v >= 0.0, "a number >= 0 (0 = greedy)"),
        top_p=_float(get, "top_p", 1.0, lambda v: 0.0 < v <= 1.0, "a number in (0, 1] (1 = no nucleus filter)"),
        top_k=_int(get, "top_k", 0, 0, "an integer >= 0 (0 = no top-k filter)"),
        seed=None if seed is None else int(seed),
        stop_words=stop_words,
        bad_words=bad_words,
        end_id=end_id,
        ignore_eos=flag(get, "ignore_eos", False),
        pad_id=pad_id,
        num_return_sequences=_int(get, "num_return_sequences", 1, 1,
                                  f"an integer in [1, {MAX_RETURN_SEQUENCES}]", MAX_RETURN_SEQUENCES),
        repetition_penalty=_float(get, "repetition_penalty", 1.0, lambda v: v > 0, "a number > 0 (1 = off)"),
        presence_penalty=_float(get, "presence_penalty", 0.0, lambda v: -2 <= v <= 2,
                                "a number in [-2, 2] (0 = off)"),
        frequency_penalty=_float(get, "frequency_penalty", 0.0, lambda v: -2 <= v <= 2,
                                 "a number in [-2, 2] (0 = off)"),
        min_tokens=_int(get, min_name, 0, 0, f"an integer in [0, max_tokens={max_tokens}]", max_tokens),
        length_penalty=_float(get, "length_penalty", 1.0, lambda v: True, "a finite number"),
        embedding_bias=_embedding_bias(get),
        token_bias=_token_bias(get, vocab_size),
        return_log_probs=return_log_probs,
        num_top_log_probs=num_top,
        num_prompt_log_probs=_prompt_log_probs(get),
        return_perf_metrics=flag(get, "return_perf_metrics", False),
        cache_salt=_cache_salt(get),
        **_lora(get),
        guided_decoding=_guided_decoding(get),
    )


def parse_generate_request(get: GetInput, vocab_size: int | None = None) -> GenerateRequest:
    """Read and validate a text request; ``get(name)`` returns the array or ``None``.

    Raises :class:`RequestError` naming the first bad field. The prompt's length is
    checked once it is tokenized (:func:`check_context`).
    """
    if get("text_input") is None:
        raise RequestError("text_input", "is required (a non-empty string)")
    prompt = as_text(scalar(get, "text_input"), "text_input")
    if not prompt:
        raise RequestError("text_input", "is empty; allowed: a non-empty string")
    return GenerateRequest(prompt=prompt, **_sampling(get, vocab_size),
                           exclude_input_in_output=flag(get, "exclude_input_in_output", False))


def parse_token_request(get: GetInput, vocab_size: int, max_model_len: int) -> GenerateRequest:
    """Read and validate a token-id request (``input_ids`` and the sampling inputs),
    including the prompt's and ``max_tokens``' fit in the context.

    Raises :class:`RequestError` naming the first bad field.
    """
    ids = _token_ids(get, vocab_size, max_model_len)
    sampling = _sampling(get, vocab_size)
    check_context(len(ids), sampling["max_tokens"], max_model_len, "input_ids")
    return GenerateRequest(prompt=ids, **sampling)


def _token_ids(get: GetInput, vocab_size: int, max_model_len: int) -> list[int]:
    arr = get("input_ids")
    if arr is None:
        raise RequestError("input_ids", "is required (a non-empty list of token ids)")
    arr = np.asarray(arr)
    if arr.dtype.kind not in "iu":
        raise RequestError("input_ids", f"has type {arr.dtype}; allowed: INT32 token ids")
    if arr.ndim > 2 or (arr.ndim == 2 and arr.shape[0] != 1):
        raise RequestError("input_ids", f"expected one sequence of shape [1, n], got shape {list(arr.shape)}")
    check_context(arr.size, 1, max_model_len, "input_ids")   # before converting a huge array
    ids = arr.reshape(-1).astype(np.int64)
    if ids.size == 0:
        raise RequestError("input_ids", "is empty; allowed: a non-empty list of token ids")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise RequestError("input_ids", f"token id {int(bad[0])} is not in the vocabulary; "
                                        f"allowed: ids in [0, {vocab_size - 1}]")
    return ids.tolist()


def check_text_length(text: str, max_model_len: int, max_token_bytes: int) -> None:
    """Refuse, without tokenizing it, a text that must be longer than the context: a
    token covers at most ``max_token_bytes`` bytes of text."""
    num_bytes = len(text.encode("utf-8"))
    if num_bytes > max_model_len * max_token_bytes:
        raise RequestError("text_input", f"has {num_bytes} bytes, more than {max_model_len} tokens of "
                                         f"this model can hold; the context is {max_model_len} tokens")


def check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int, prompt_field: str) -> None:
    """The prompt must leave room for ``max_tokens`` new tokens in the context (the
    engine's rule, :func:`~tandem.backends.engine.request_limits.check_context`), the
    prompt named by its input ``prompt_field``."""
    try:
        request_limits.check_context(num_prompt_tokens, max_tokens, max_model_len)
    except request_limits.LimitError as e:
        raise as_request_error(e, prompt_field) from None


def as_request_error(e: request_limits.LimitError, prompt_field: str = "input_ids") -> RequestError:
    """A broken request limit as the input it names (the prompt as ``prompt_field``)."""
    return RequestError(prompt_field if e.field == "prompt" else e.field, e.problem)
