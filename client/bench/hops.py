"""Where a token's CPU goes between the engine and the client: CPU µs per generated token
in each process on the serving path.

One server (``tandem serve --mode disaggregated`` as a library) serves a fixed run:
``--rounds`` rounds of ``--streams`` concurrent greedy streams of exactly ``--tokens``
tokens each (``min_tokens`` = ``max_tokens``), first through Triton's gRPC stream straight
to the ``tandem`` ensemble (this process is the gRPC client), then through the OpenAI API
(the frontend in a process of its own, fed by a plain HTTP/SSE client here). Before and
after each path's run, every process's CPU time (user + system, ``/proc/<pid>/stat``) is
read: tritonserver, each Python backend stub by model, the frontend and the load
generator; the difference over the tokens received is the hop's cost. A warm-up round
before each path is not counted. Also reported: responses per token (coalescing shows
as fewer than 1) and the run's output tok/s (wall time: other load on the machine moves
it, CPU time much less).

``--label`` names the run in ``--out`` (other labels already there are kept), so a
"before" and an "after" run of the same command sit side by side.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tandem.client.bench.args import add_dtype, positive_int
from tandem.client.bench.harness import prompt_texts, start_server, work_dir
from tandem.client.bench.report import header, write
from tandem.client.paths import DEMO_CHECKPOINTS

DEFAULT_OUT = Path("docs/bench/hops.json")
PATHS = ("grpc", "openai")
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=DEMO_CHECKPOINTS / "target")
    p.add_argument("--streams", type=positive_int, default=8, help="concurrent streams per round")
    p.add_argument("--tokens", type=positive_int, default=128, help="tokens per stream")
    p.add_argument("--rounds", type=positive_int, default=3, help="measured rounds per path")
    p.add_argument("--prompt-tokens", type=positive_int, default=32)
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of: {', '.join(PATHS)}")
    p.add_argument("--label", default="run", help="the run's name in --out (e.g. before, after)")
    add_dtype(p)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


# -- CPU time per process -----------------------------------------------------------------
def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * TICK_S   # utime, stime (fields 14, 15)


def processes(server, frontend_pid: int | None) -> dict[str, int]:
    """``{hop: pid}`` of the serving path's processes."""
    procs = {"tritonserver": server.process.pid}
    for stub in server.stubs():
        procs[f"stub:{stub.model}"] = stub.pid
    if frontend_pid is not None:
        procs["frontend"] = frontend_pid
    procs["load generator"] = os.getpid()
    return procs


# -- the load -----------------------------------------------------------------------------
def grpc_round(url: str, prompts: list[str], tokens: int) -> tuple[int, int]:
    """One round over one gRPC stream; returns (tokens, responses with outputs)."""
    import tritonclient.grpc as grpcclient

    from tandem.client.generate import build_inputs, parse_response

    done = threading.Event()
    lock = threading.Lock()
    state = {"open": len(prompts), "tokens": 0, "responses": 0, "errors": []}

    def on_response(result, error):
        with lock:
            if error is not None:
                state["errors"].append(str(error))
                state["open"] -= 1
            else:
                r = parse_response(result)
                if result.get_response().outputs:
                    state["responses"] += 1
                if r.final:
                    state["open"] -= 1
                    state["tokens"] += r.num_output_tokens
            if state["open"] <= 0:
                done.set()

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=on_response)
    try:
        for i, prompt in enumerate(prompts):
            client.async_stream_infer("tandem", build_inputs(prompt, max_tokens=tokens, min_tokens=tokens,
                                                             stream=True, temperature=0.0),
                                      request_id=str(i), enable_empty_final_response=True)
        if not done.wait(600):
            raise RuntimeError("the gRPC round did not finish in 600 s")
    finally:
        client.stop_stream()
        client.close()
    if state["errors"]:
        raise RuntimeError(f"gRPC errors: {state['errors'][:3]}")
    return state["tokens"], state["responses"]


def openai_stream(host: str, port: int, prompt: str, tokens: int) -> tuple[int, int]:
    """One streamed completion; returns (completion tokens, SSE chunks with text)."""
    body = json.dumps({"model": "tandem", "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens,
                       "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        chunks, usage = 0, 0
        for line in resp:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            if any(c.get("text") for c in event.get("choices", [])):
                chunks += 1
        return usage, chunks
    finally:
        conn.close()


def openai_round(host: str, port: int, prompts: list[str], tokens: int) -> tuple[int, int]:
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            results[i] = openai_stream(host, port, prompts[i], tokens)
        except Exception as exc:   # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if isinstance(r, Exception)]
    if errors:
        raise RuntimeError(f"OpenAI errors: {errors[:3]}")
    return sum(r[0] for r in results), sum(r[1] for r in results)


def start_frontend(grpc_url: str, model_dir: Path, port: int) -> subprocess.Popen:
    """The OpenAI frontend in a process of its own (its CPU apart from the load's); it
    stops when its stdin closes."""
    code = ("import sys; from tandem.client.openai.frontend import OpenAIFrontend\n"
            f"api = OpenAIFrontend({grpc_url!r}, ['tandem'], {str(model_dir)!r}, port={port}).start()\n"
            "print('ready', flush=True); sys.stdin.read(); api.stop()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError("the OpenAI frontend did not start")
    return proc


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- one path -----------------------------------------------------------------------------
def measure(name: str, round_fn, procs: dict[str, int], rounds: int) -> dict:
    round_fn()   # warm-up: not counted
    before = {hop: cpu_s(pid) for hop, pid in procs.items()}
    t0 = time.monotonic()
    tokens = responses = 0
    for _ in range(rounds):
        n, r = round_fn()
        tokens, responses = tokens + n, responses + r
    wall = time.monotonic() - t0
    cpu = {hop: cpu_s(pid) - before[hop] for hop, pid in procs.items()}
    us = {hop: round(1e6 * s / tokens, 1) for hop, s in cpu.items()}
    serving = [h for h in us if h not in ("stub:decode", "stub:prefill", "stub:kv_transfer", "load generator")]
    return {"path": name, "tokens": tokens, "responses": responses,
            "responses_per_token": round(responses / tokens, 3), "wall_s": round(wall, 2),
            "output_tok_s": round(tokens / wall, 1), "cpu_us_per_token": us,
            "serving_hops_us_per_token": round(sum(us[h] for h in serving), 1)}


def table(results: list[dict]) -> str:
    hops = sorted({h for r in results for h in r["cpu_us_per_token"]},
                  key=lambda h: (h != "stub:decode", h.startswith("load"), h))
    lines = [f"{'CPU µs per token':<26}" + "".join(f"{r['path']:>12}" for r in results)]
    for h in hops:
        lines.append(f"{h:<26}" + "".join(f"{r['cpu_us_per_token'].get(h, 0.0):>12.1f}" for r in results))
    for key, what in (("serving_hops_us_per_token", "serving hops (no engine)"),
                      ("responses_per_token", "responses per token"), ("output_tok_s", "output tok/s (wall)")):
        lines.append(f"{what:<26}" + "".join(f"{r[key]:>12}" for r in results))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from contextlib import ExitStack

    from tandem.client.serve.options import ServeOptions

    paths = [p for p in args.paths.split(",") if p]
    unknown = set(paths) - set(PATHS)
    if unknown:
        print(f"--paths: {', '.join(sorted(unknown))}; allowed: {', '.join(PATHS)}", file=sys.stderr)
        return 2
    prompts = prompt_texts(args.model, [args.prompt_tokens] * args.streams)
    print(f"hops: {args.streams} streams x {args.tokens} tokens, {args.rounds} rounds, {args.dtype}", flush=True)
    results = []
    with work_dir("tandem-hops-") as work, ExitStack() as stack:
        options = ServeOptions.of(model_dir=str(args.model), dtype=args.dtype, mode="disaggregated",
                                  max_num_seqs=max(8, args.streams))
        server = start_server(stack, options, work / "server", attempts=2, log_file=work / "server.log")
        if "grpc" in paths:
            procs = processes(server, None)
            results.append(measure("grpc", lambda: grpc_round(server.grpc_url, prompts, args.tokens),
                                   procs, args.rounds))
        if "openai" in paths:
            port = free_port()
            frontend = start_frontend(server.grpc_url, args.model, port)
            stack.callback(lambda: (frontend.stdin.close(), frontend.wait(30)))
            procs = processes(server, frontend.pid)
            results.append(measure("openai", lambda: openai_round("127.0.0.1", port, prompts, args.tokens),
                                   procs, args.rounds))
    print(table(results))
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    previous[args.label] = {**header("hops", args), "results": results}
    write(previous, args.out)
    return 0
