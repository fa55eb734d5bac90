"""``tandem generate``: one completion over Triton's gRPC streaming API.

Tandem's models are decoupled (the ensembles ``tandem``, ``tandem_tokens`` and
``tandem_colocated``, and the token-level ``llm``), so even a non-streaming request
goes over a gRPC stream (``start_stream`` / ``async_stream_infer`` / ``stop_stream``):
the server answers with one response per engine step when ``stream`` is set, or with
a single response otherwise; the last carries the final flag. A prompt is text, or a
list of token ids for the token-level models.

>>> for r in stream_generate("127.0.0.1:8001", "def f(", max_tokens=8):  # doctest: +SKIP
...     print(r.text, end="")
>>> ids = [r.output_ids for r in stream_generate("127.0.0.1:8001", [0, 412, 9],  # doctest: +SKIP
...                                              model="tandem_tokens")]
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

import numpy as np

MODEL_NAME = "tandem"


@dataclass(slots=True)
class GenerateResponse:
    text: str
    finish_reason: str          # "" until the sequence's last response
    num_input_tokens: int
    num_output_tokens: int
    final: bool
    output_ids: list[int] = field(default_factory=list)   # token-level models only
    sequence_index: int = 0     # which of num_return_sequences
    output_log_probs: list[float] = field(default_factory=list)   # with return_log_probs
    cum_log_prob: float = 0.0   # with return_log_probs: the sequence's so far
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (the first response)


class GenerateError(RuntimeError):
    """The server answered with an error (its message names the bad field)."""


def build_inputs(prompt: str | Sequence[int], *, max_tokens: int = 16, stream: bool = True,
                 temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 seed: int | None = None, stop_words: list[str] | None = None,
                 bad_words: list[str] | None = None, num_return_sequences: int | None = None,
                 repetition_penalty: float | None = None, presence_penalty: float | None = None,
                 frequency_penalty: float | None = None, min_tokens: int | None = None,
                 return_log_probs: bool | None = None, exclude_input_in_output: bool = True,
                 guided_decoding_guide_type: str | None = None, guided_decoding_guide: str | None = None,
                 return_perf_metrics: bool | None = None, lora_name: str | None = None,
                 lora_task_id: int | None = None, lora_weights: np.ndarray | None = None,
                 lora_config: np.ndarray | None = None) -> list:
    """The request tensors, each with the batch dimension (shape ``[1, ...]``): ``text_input``
    for a text prompt, ``input_ids`` for a list of token ids (``exclude_input_in_output``
    concerns text only); an option left None is not sent (the server's default)."""
    import tritonclient.grpc as grpcclient

    def tensor(name: str, value, dtype, triton_type: str):
        arr = np.array([[value]] if not isinstance(value, list) else [value], dtype=dtype)
        t = grpcclient.InferInput(name, list(arr.shape), triton_type)
        t.set_data_from_numpy(arr)
        return t

    if isinstance(prompt, str):
        inputs = [tensor("text_input", prompt.encode("utf-8"), np.object_, "BYTES"),
                  tensor("exclude_input_in_output", exclude_input_in_output, np.bool_, "BOOL")]
    else:
        inputs = [tensor("input_ids", [int(t) for t in prompt], np.int32, "INT32")]
    inputs += [tensor("max_tokens", max_tokens, np.int32, "INT32"), tensor("stream", stream, np.bool_, "BOOL")]
    optional = (("temperature", temperature, np.float32, "FP32"), ("top_p", top_p, np.float32, "FP32"),
                ("top_k", top_k, np.int32, "INT32"), ("seed", seed, np.uint64, "UINT64"),
                ("num_return_sequences", num_return_sequences, np.int32, "INT32"),
                ("repetition_penalty", repetition_penalty, np.float32, "FP32"),
                ("presence_penalty", presence_penalty, np.float32, "FP32"),
                ("frequency_penalty", frequency_penalty, np.float32, "FP32"),
                ("min_tokens", min_tokens, np.int32, "INT32"),
                ("return_log_probs", return_log_probs, np.bool_, "BOOL"),
                ("return_perf_metrics", return_perf_metrics, np.bool_, "BOOL"),
                ("guided_decoding_guide_type", _utf8(guided_decoding_guide_type), np.object_, "BYTES"),
                ("guided_decoding_guide", _utf8(guided_decoding_guide), np.object_, "BYTES"),
                ("lora_name", _utf8(lora_name), np.object_, "BYTES"),
                ("lora_task_id", lora_task_id, np.uint64, "UINT64"))
    inputs += [tensor(name, value, dtype, triton_type) for name, value, dtype, triton_type in optional
               if value is not None]
    for name, array, triton_type in (("lora_weights", lora_weights, "FP16"), ("lora_config", lora_config, "INT32")):
        if array is not None:   # TensorRT-LLM's adapter tensors: [1, N, W] and [1, N, 3]
            array = np.asarray(array, dtype=np.float16 if triton_type == "FP16" else np.int32)
            t = grpcclient.InferInput(name, list(array.shape), triton_type)
            t.set_data_from_numpy(array)
            inputs.append(t)
    for name, words in (("stop_words", stop_words), ("bad_words", bad_words)):
        if words:
            inputs.append(tensor(name, [w.encode("utf-8") for w in words], np.object_, "BYTES"))
    return inputs


def _utf8(text: str | None) -> bytes | None:
    return None if text is None else text.encode("utf-8")


def _first(result, name: str):
    arr = result.as_numpy(name)
    return None if arr is None else arr.reshape(-1)[0]


def parse_response(result) -> GenerateResponse:
    """A tritonclient gRPC result as a :class:`GenerateResponse` (any of Tandem's models:
    the ensembles' ``text_output`` has shape ``[1]``, the token-level models' ``[1, 1]``)."""
    response = result.get_response()
    final = bool(response.parameters["triton_final_response"].bool_param) \
        if "triton_final_response" in response.parameters else False
    if not response.outputs:  # the empty final response
        return GenerateResponse("", "", 0, 0, final)
    text = _first(result, "text_output")
    reason = _first(result, "finish_reason")
    ids = result.as_numpy("output_ids")
    log_probs = result.as_numpy("output_log_probs")
    return GenerateResponse(
        text=text.decode("utf-8") if isinstance(text, bytes) else str(text or ""),
        finish_reason=reason.decode("utf-8") if isinstance(reason, bytes) else str(reason or ""),
        num_input_tokens=int(_first(result, "num_input_tokens") or 0),
        num_output_tokens=int(_first(result, "num_output_tokens") or 0),
        final=final,
        output_ids=[] if ids is None else [int(t) for t in ids.reshape(-1)],
        sequence_index=int(_first(result, "sequence_index") or 0),
        output_log_probs=[] if log_probs is None else [float(x) for x in log_probs.reshape(-1)],
        cum_log_prob=float(_first(result, "cum_log_probs") or 0.0),
        num_cached_tokens=int(_first(result, "num_cached_tokens") or 0),
    )


def stream_generate(url: str, prompt: str | Sequence[int], timeout_s: float = 300.0, model: str = MODEL_NAME,
                    **params) -> Iterator[GenerateResponse]:
    """Yield the server's responses for one request to ``model`` until the final one.

    Raises :class:`GenerateError` when the server answers with an error.
    """
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    finished = False
    try:
        try:
            client.async_stream_infer(model, build_inputs(prompt, **params), enable_empty_final_response=True)
        except Exception as exc:  # the stream broke (server unreachable): its reason went to the callback
            finished = True
            try:
                _, error = results.get(timeout=5)
            except queue.Empty:
                error = exc
            raise GenerateError(f"cannot reach {url}: {error}") from None
        while True:
            try:
                result, error = results.get(timeout=timeout_s)
            except queue.Empty:
                raise GenerateError(f"no response from {url} within {timeout_s:.0f} s") from None
            if error is not None:
                finished = True  # an error response is the request's last
                raise GenerateError(error.message() if hasattr(error, "message") else str(error))
            response = parse_response(result)
            finished = response.final
            yield response
            if finished:
                return
    finally:
        # Cancel only a request that is still running: tritonserver 2.51 may
        # fail to unload the model at shutdown after a stream was cancelled
        # once its request had completed.
        client.stop_stream(cancel_requests=not finished)
        client.close()


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text from a running `tandem serve`",
                              description="Send one prompt to a Tandem ensemble over gRPC and print the text.")
    p.add_argument("prompt")
    p.add_argument("--url", default="localhost:8001", help="gRPC endpoint (default: localhost:8001)")
    p.add_argument("-m", "--model-name", default=MODEL_NAME,
                   help=f"model to call (default: {MODEL_NAME}; tandem_colocated in --mode colocated)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("--json", action="store_true", help="print one JSON object per response")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, help="0 = greedy (server default: 1.0)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--bad-word", dest="bad_words", action="append", default=[],
                   help="a word never to generate (repeatable)")
    p.add_argument("-n", "--num-return-sequences", type=int, help="independent samples of the prompt")
    p.add_argument("--repetition-penalty", type=float, help="> 0; 1 = off")
    p.add_argument("--presence-penalty", type=float, help="[-2, 2]; 0 = off")
    p.add_argument("--frequency-penalty", type=float, help="[-2, 2]; 0 = off")
    p.add_argument("--min-tokens", type=int, help="no end before this many tokens")
    p.add_argument("--logprobs", action="store_true", help="ask for log probs (shown with --json)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each response")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    params = dict(max_tokens=args.max_tokens, stream=args.stream, temperature=args.temperature,
                  top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop_words=args.stop,
                  bad_words=args.bad_words, num_return_sequences=args.num_return_sequences,
                  repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                  frequency_penalty=args.frequency_penalty, min_tokens=args.min_tokens,
                  return_log_probs=args.logprobs or None)
    several = (args.num_return_sequences or 1) > 1
    texts: dict[int, list[str]] = {}
    ends: dict[int, GenerateResponse] = {}
    last = None
    try:
        for response in stream_generate(args.url, args.prompt, timeout_s=args.timeout, model=args.model_name,
                                        **params):
            last = response
            if response.finish_reason:
                ends[response.sequence_index] = response
            if args.json:
                print(json.dumps(asdict(response)), flush=True)
            elif several:   # samples interleave: printed one after another at the end
                texts.setdefault(response.sequence_index, []).append(response.text)
            else:
                print(response.text, end="", flush=True)
    except GenerateError as exc:
        return _fail(str(exc), mid_line=last is not None and not args.json and not several)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # anything the client library raises
        return _fail(f"{args.url}: {exc}", mid_line=last is not None and not args.json and not several)
    if not args.json:
        if several:
            for i in sorted(texts):
                print(f"--- sequence {i}\n{''.join(texts[i])}")
        else:
            print()
        for i, end in sorted(ends.items()):
            print(f"[{'' if not several else f'sequence {i}: '}{end.finish_reason}: {end.num_input_tokens} "
                  f"prompt tokens, {end.num_output_tokens} generated]", file=sys.stderr)
    return 0


def _fail(message: str, mid_line: bool) -> int:
    print(("\n" if mid_line else "") + f"tandem generate: {message}", file=sys.stderr)
    return 1
