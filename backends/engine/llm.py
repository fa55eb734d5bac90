"""The offline API: ``LLM(model_dir).generate(prompts, params)`` and ``.stream(...)``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence as Seq

from ..lora.request import LoRARequest
from .config import EngineConfig
from .llm_engine import LLMEngine
from .logprobs import PromptLogprobs, TopLogprobs
from .outputs import RequestOutput
from .params import SamplingParams


@dataclass(slots=True)
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None = None       # with SamplingParams.logprobs: one per token
    cumulative_logprob: float | None = None
    top_logprobs: list[TopLogprobs] | None = None       # with SamplingParams.top_logprobs
    prompt_logprobs: PromptLogprobs | None = None       # with SamplingParams.prompt_logprobs
    error: str | None = None        # with finish_reason "error": what went wrong


class LLM:
    """Batched generation on one engine.

    >>> llm = LLM("checkpoints/demo/target", dtype="bfloat16")
    >>> out = llm.generate(["def fib(n):"], SamplingParams(max_tokens=8, temperature=0))
    >>> len(out[0].token_ids), out[0].finish_reason
    (8, 'length')
    """

    def __init__(self, model_dir: str, **engine_args):
        """``engine_args``: :class:`EngineConfig`'s fields (dtype, page_size, kv_layout,
        num_pages, max_num_seqs, max_num_batched_tokens, max_model_len, device,
        speculative, max_loras, max_lora_rank), with its defaults.

        >>> from tandem.backends.lora import LoRARequest
        >>> llm = LLM("checkpoints/demo/target", max_loras=2)                  # doctest: +SKIP
        >>> llm.generate(["def f("], lora=LoRARequest("sql", 1, "adapters/sql"))  # doctest: +SKIP
        """
        self.engine = LLMEngine(EngineConfig(str(model_dir), **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora: LoRARequest | Seq[LoRARequest | None] | None = None
                 ) -> list[CompletionOutput]:
        """Complete every prompt; all requests are validated before any is queued.
        ``lora``: one adapter for every prompt, or one (or None) per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        loras = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        seqs = [self.engine.make_sequence(p, sp, lora=lr) for p, sp, lr in zip(prompts, plist, loras)]
        if len({s.request_id for s in seqs}) != len(seqs):
            raise ValueError("duplicate request ids")
        added = []
        try:
            for s in seqs:     # an adapter that fails to load (or a full pool) queues none
                self.engine.add(s)
                added.append(s)
        except Exception:
            for s in added:
                self.engine.abort(s.request_id)
            raise
        texts = {s.request_id: [] for s in seqs}
        reasons: dict[str, str] = {}
        errors: dict[str, str | None] = {}
        while len(reasons) < len(seqs):
            for out in self.engine.step():
                texts[out.request_id].append(out.new_text)
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
                    errors[out.request_id] = out.error
        return [CompletionOutput(s.prompt_ids, list(s.output_ids), "".join(texts[s.request_id]),
                                 reasons[s.request_id],
                                 None if s.logprobs is None else list(s.logprobs),
                                 None if s.logprobs is None else s.cumulative_logprob,
                                 None if s.top_logprobs is None else list(s.top_logprobs),
                                 s.prompt_logprobs, errors[s.request_id])
                for s in seqs]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               lora: LoRARequest | None = None) -> Iterator[RequestOutput]:
        """Yield token deltas of one request as they are produced; the last has
        ``finished`` set. Closing the generator early aborts the request."""
        rid = self.engine.add_request(prompt, params or SamplingParams(), lora=lora)
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id == rid:
                        done = out.finished
                        yield out
        finally:
            if not done:
                self.engine.abort(rid)
