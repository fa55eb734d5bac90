"""Where a token's CPU goes between the engine and the client: CPU µs per generated token
in each process on the serving path.

A server (``tandem serve --mode disaggregated`` as a library) serves a fixed run:
``--repeats`` rounds of ``--streams`` concurrent greedy streams of exactly ``--tokens``
tokens each (``min_tokens`` = ``max_tokens``), through Triton's gRPC stream straight to
the ``tandem`` ensemble (the load generator is the gRPC client) and through the OpenAI
API (the frontend in a process of its own, fed by a plain HTTP/SSE client). Around each
round every process's CPU time (user + system, ``/proc/<pid>/stat``) is read:
tritonserver, each Python backend stub by model, the frontend and the load generator;
the difference over the tokens received is the hop's cost. A warm-up round per path
is not counted. Also reported: responses per token (coalescing shows as fewer than 1)
and output tok/s (wall time: other load on the machine moves it).

CPU time per token moves with the machine's other load too (a busy shared host
inflates it by tens of percent), so ``--compare REV[,REV2]`` measures the code of git
revision ``REV`` and this tree (or ``REV2``) side by side in one run: each in its own
server and worker process (a revision's packages from ``git archive``, put first on
``PYTHONPATH``), their rounds interleaved (A B, B A, ...), medians with min–max over
the rounds. The benchmark's own code (``client/bench``: its request client is the load
generator, a hop of the gRPC path) is this tree's in every version, so that only the
served code differs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tandem.client.bench.args import add_dtype, model_path, names, positive_int
from tandem.client.bench.harness import prompt_texts, start_server, work_dir
from tandem.client.bench.openai_load import run_closed_loop
from tandem.client.bench.report import header, write
from tandem.client.bench.request_client import RequestInput, TritonStream
from tandem.client.paths import DEMO_CHECKPOINTS

DEFAULT_OUT = Path("docs/bench/hops.json")
PATHS = ("grpc", "openai")
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_path, default=DEMO_CHECKPOINTS / "target")
    p.add_argument("--streams", type=positive_int, default=8, help="concurrent streams per round")
    p.add_argument("--tokens", type=positive_int, default=128, help="tokens per stream")
    p.add_argument("--repeats", type=positive_int, default=5, help="measured rounds per path and version")
    p.add_argument("--prompt-tokens", type=positive_int, default=32)
    p.add_argument("--paths", type=names(*PATHS), default=",".join(PATHS), help=f"comma-separated, of: {', '.join(PATHS)}")
    p.add_argument("--compare", default="", metavar="REV[,REV2]",
                   help="measure git revision REV's code against this tree's (or REV2's), rounds interleaved")
    p.add_argument("--label", default="run", help="the run's name in --out (other names there are kept)")
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


# -- the load (the one request client: a hop too) ----------------------------------------
def grpc_round(url: str, prompts: list[str], tokens: int) -> tuple[int, int]:
    """One round over one gRPC stream; returns (tokens, responses with outputs)."""
    stream = TritonStream(url, "tandem")
    try:
        for prompt in prompts:
            stream.send(RequestInput(prompt, tokens, min_tokens=tokens))
        try:
            outs = stream.wait(len(prompts), 600)
        except TimeoutError:
            raise RuntimeError("the gRPC round did not finish in 600 s") from None
    finally:
        stream.close()
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"gRPC errors: {errors[:3]}")
    return sum(o.tokens for o in outs), sum(o.responses for o in outs)


def openai_round(host: str, port: int, prompts: list[str], tokens: int) -> tuple[int, int]:
    """Every prompt streamed at once; returns (completion tokens, SSE chunks with text)."""
    outs, _ = run_closed_loop(host, port, [RequestInput(p, tokens, min_tokens=tokens) for p in prompts],
                              len(prompts))
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"OpenAI errors: {errors[:3]}")
    return sum(o.output_tokens or 0 for o in outs), sum(len(o.chunk_s) for o in outs)


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


# -- one version of the code: a worker process with its server -------------------------
class Worker:
    """Serves one version of the code: its own server and frontend, one measured round
    per command on stdin (``grpc`` / ``openai``), one JSON line of CPU deltas back."""

    def __init__(self, args):
        self.args = args

    def serve(self) -> int:
        from contextlib import ExitStack

        from tandem.client.serve.options import ServeOptions
        from tandem.client.serve.triton_server import free_port

        shim = os.environ.get(SHIM_ENV)
        if shim:
            _stubs_import_from(Path(shim))

        args = self.args
        prompts = prompt_texts(args.model, [args.prompt_tokens] * args.streams)
        with work_dir("tandem-hops-", keep=bool(os.environ.get("TANDEM_HOPS_KEEP"))) as work, ExitStack() as stack:
            options = ServeOptions.of(model_dir=str(args.model), dtype=args.dtype, mode="disaggregated",
                                      max_num_seqs=max(8, args.streams))
            server = start_server(stack, options, work / "server", attempts=2, log_file=work / "server.log")
            port = free_port()
            frontend = start_frontend(server.grpc_url, args.model, port)
            stack.callback(lambda: (frontend.stdin.close(), frontend.wait(30)))
            procs = processes(server, frontend.pid)
            rounds = {"grpc": lambda: grpc_round(server.grpc_url, prompts, args.tokens),
                      "openai": lambda: openai_round("127.0.0.1", port, prompts, args.tokens)}
            for name in args.paths:
                rounds[name]()   # warm-up: not counted
            print(json.dumps({"ready": True}), flush=True)
            for line in sys.stdin:
                name = line.strip()
                if name not in rounds:
                    break
                print(json.dumps(measure_round(rounds[name], procs)), flush=True)
        return 0


SHIM_ENV = "TANDEM_HOPS_SHIM"


def _stubs_import_from(shim: Path) -> None:
    """Make the server's stubs import ``tandem`` from ``shim`` too: they do not read
    ``PYTHONPATH``, but they put the Python backend's directory on ``sys.path``, where a
    regular package wins over the editable install's finder."""
    from tandem.client.serve.triton_server import TritonServer

    launch = TritonServer._launch

    def _launch(self):
        link = Path(self._launch_args[1]) / "python" / "tandem"
        if not link.exists():
            link.symlink_to(shim / "tandem", target_is_directory=True)
        launch(self)
    TritonServer._launch = _launch


def measure_round(round_fn, procs: dict[str, int]) -> dict:
    before = {hop: cpu_s(pid) for hop, pid in procs.items()}
    t0 = time.monotonic()
    tokens, responses = round_fn()
    wall = time.monotonic() - t0
    cpu = {hop: cpu_s(pid) - before[hop] for hop, pid in procs.items()}
    # the frontend idles through a gRPC round: not a hop of that path
    return {"tokens": tokens, "responses": responses, "wall_s": wall, "cpu_s": cpu}


def start_worker(args, pythonpath: Path | None) -> subprocess.Popen:
    """This file as a worker, importing ``tandem`` from ``pythonpath`` when given."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
        env[SHIM_ENV] = str(pythonpath)
    cmd = [sys.executable, __file__, "--worker", "--model", str(args.model), "--streams", str(args.streams),
           "--tokens", str(args.tokens), "--prompt-tokens", str(args.prompt_tokens), "--paths", str(args.paths),
           "--dtype", args.dtype]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def read_line(worker: subprocess.Popen) -> dict:
    while True:
        line = worker.stdout.readline()
        if not line:
            raise RuntimeError(f"a worker ended (exit status {worker.wait()})")
        if line.startswith("{"):
            return json.loads(line)


def revision_tree(rev: str, work: Path) -> Path:
    """A directory to put first on ``PYTHONPATH`` so that ``tandem`` is revision ``rev``'s
    (its backends, client and rdma packages and model repository, from ``git archive``)
    but for ``client/bench``, this tree's."""
    import shutil

    from tandem.client.paths import REPO_ROOT

    src = work / "rev"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", rev, "backends", "client", "rdma",
                              "model_repository"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    shutil.rmtree(src / "client" / "bench", ignore_errors=True)
    shutil.copytree(Path(__file__).parent, src / "client" / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    shim = work / "shim" / "tandem"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("")
    for pkg in ("backends", "client", "rdma"):
        (shim / pkg).symlink_to(src / pkg)
    return shim.parent


# -- the run ------------------------------------------------------------------------------
def summarize(rounds: list[dict]) -> dict:
    """Per hop: the median over the rounds of CPU µs per token, with min and max."""
    import statistics

    hops = sorted({h for r in rounds for h in r["cpu_s"]})
    per = {h: [1e6 * r["cpu_s"].get(h, 0.0) / r["tokens"] for r in rounds] for h in hops}
    tokens = sum(r["tokens"] for r in rounds)
    return {"rounds": len(rounds), "tokens": tokens,
            "cpu_us_per_token": {h: round(statistics.median(v), 1) for h, v in per.items()},
            "cpu_us_per_token_min_max": {h: [round(min(v), 1), round(max(v), 1)] for h, v in per.items()},
            "responses_per_token": round(sum(r["responses"] for r in rounds) / tokens, 3),
            "output_tok_s": round(statistics.median(r["tokens"] / r["wall_s"] for r in rounds), 1)}


ENGINE = ("stub:decode", "stub:prefill", "stub:kv_transfer", "stub:preprocess", "load generator")
# each path's hops (the frontend only on the OpenAI path; the load generator is the
# gRPC client on the gRPC path, the HTTP client on the other)
def serving_hops(path: str, cpu: dict[str, float]) -> float:
    hops = [h for h in cpu if h not in ENGINE and (path == "openai" or h != "frontend")]
    if path == "grpc":
        hops.append("load generator")
    return round(sum(cpu[h] for h in hops), 1)


def table(results: dict) -> str:
    """Rows: hops; columns: path x version."""
    cols = [(path, version) for path in results for version in results[path]]
    hops = sorted({h for path, v in cols for h in results[path][v]["cpu_us_per_token"]},
                  key=lambda h: (h != "stub:decode", h == "load generator", h))
    head = f"{'CPU µs per token':<24}" + "".join(f"{path + ' ' + v:>22}" for path, v in cols)
    lines = [head]
    for h in hops:
        if h == "frontend" and all(path == "grpc" for path, _ in cols):
            continue
        cells = []
        for path, v in cols:
            r = results[path][v]
            if h == "frontend" and path == "grpc":
                cells.append(f"{'-':>22}")
                continue
            lo, hi = r["cpu_us_per_token_min_max"][h]
            cells.append(f"{r['cpu_us_per_token'][h]:>10.1f} ({lo:.0f}-{hi:.0f})".rjust(22))
        lines.append(f"{h:<24}" + "".join(cells))
    lines.append(f"{'serving hops':<24}" + "".join(
        f"{serving_hops(path, results[path][v]['cpu_us_per_token']):>22.1f}" for path, v in cols))
    for key, what in (("responses_per_token", "responses per token"), ("output_tok_s", "output tok/s (wall)")):
        lines.append(f"{what:<24}" + "".join(f"{results[path][v][key]:>22}" for path, v in cols))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from contextlib import ExitStack

    paths = list(args.paths)   # checked while parsing (args.names)
    print(f"hops: {args.streams} streams x {args.tokens} tokens, {args.repeats} rounds per path and version, "
          f"{args.dtype}", flush=True)
    with work_dir("tandem-hops-run-") as work, ExitStack() as stack:
        revs = [r for r in args.compare.split(",") if r]
        versions = {rev: revision_tree(rev, work / f"v{i}") for i, rev in enumerate(revs)}
        if len(revs) < 2:
            versions["this tree"] = None
        workers = {}
        for name, pythonpath in versions.items():   # started together: they load side by side
            workers[name] = start_worker(args, pythonpath)
            stack.callback(lambda w=workers[name]: (w.stdin.close(), w.wait(120)))
        for name, w in workers.items():
            read_line(w)   # ready
            print(f"  {name}: ready", flush=True)
        rounds = {path: {name: [] for name in workers} for path in paths}
        for i in range(args.repeats):
            order = list(workers) if i % 2 == 0 else list(workers)[::-1]
            for path in paths:
                for name in order:
                    workers[name].stdin.write(path + "\n")
                    workers[name].stdin.flush()
                    rounds[path][name].append(read_line(workers[name]))
            print(f"  round {i + 1}/{args.repeats} done", flush=True)
    results = {path: {name: summarize(rs) for name, rs in by.items()} for path, by in rounds.items()}
    print(table(results))
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    previous[args.label] = {**header("hops", args), "streams": args.streams, "tokens": args.tokens,
                            "results": results}
    write(previous, args.out)
    return 0


if __name__ == "__main__":   # a worker (start_worker)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--worker", action="store_true")
    sys.exit(Worker(parser.parse_args()).serve())
