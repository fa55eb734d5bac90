"""``tandem perf``: Triton's ``perf_analyzer`` against a streaming (decoupled) LLM model.

The ``perf_analyzer`` binary comes with the tritonclient wheel but links two
libraries the wheel lacks (``libb64.so.0d``, ``libcudart.so.12``, even on CPU);
``scripts/install_perf_analyzer_deps.sh`` puts them in ``.cache/perf_analyzer/lib``
and :func:`analyzer_env` puts that folder on ``LD_LIBRARY_PATH``.

Each concurrency level is one perf_analyzer run over gRPC with ``--streaming``,
fed a JSON of prompts (:func:`write_input_data`), and read back from its CSV
(``-f --verbose-csv``), its profile export (per-request send and response
timestamps) and its stdout into a :class:`PerfPoint`. One run per level, not one
``--concurrency-range``: ``--request-count`` only works with a single level, and a
list such as 1,2,4,8 is no arithmetic range.

Two things perf_analyzer 2.51 does not say plainly, measured here:

- for a decoupled model it prints "using the first response for measuring
  latency", yet its latencies are request sent -> *final* response (they equal the
  profile export's last-response times); :attr:`PerfPoint.first_response` is the
  time to the first streamed response (TTFT), computed from the profile export;
- with ``--request-count`` it measures over whole seconds, so a run shorter than a
  second reports fewer requests/s than it served.

>>> points = profile(PerfOptions(url="127.0.0.1:8001", concurrency=(1, 2)), Path("out"))  # doctest: +SKIP
>>> points[0].throughput_per_s, points[0].first_response.p50_ms                          # doctest: +SKIP
(35.5, 3.6)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.client.bench.stats import percentile
from tandem.client.paths import CACHE

LIB_DIR = CACHE / "perf_analyzer" / "lib"
INSTALL_HINT = ("run `bash scripts/install_perf_analyzer_deps.sh` (links the copies nvidia-pytriton bundles "
                "into .cache/perf_analyzer/lib; --download fetches libb64-0d with apt-get download and "
                "nvidia-cuda-runtime-cu12 with pip), or install them system-wide: "
                "`apt-get install libb64-0d` and `pip install nvidia-cuda-runtime-cu12`")
DEFAULT_PROMPTS = ("def fibonacci(n):", "class Stack:", "import numpy as np\n", "for i in range(")
MEASUREMENT_MODES = ("count_windows", "time_windows")


class PerfAnalyzerUnavailable(RuntimeError):
    """The perf_analyzer binary is missing or cannot load its libraries."""


class PerfAnalyzerError(RuntimeError):
    """perf_analyzer ran and failed (a request error, an unknown model, a time-out)."""


def find_binary() -> Path:
    """The perf_analyzer beside this interpreter (the venv's), else the one on PATH."""
    beside = Path(sys.executable).parent / "perf_analyzer"
    found = beside if beside.exists() else shutil.which("perf_analyzer")
    if not found:
        raise PerfAnalyzerUnavailable("no perf_analyzer binary: it comes with `pip install tritonclient[all]==2.51.0`")
    return Path(found)


def analyzer_env(lib_dir: Path = LIB_DIR, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment with ``lib_dir`` first on LD_LIBRARY_PATH (when it exists)."""
    env = dict(os.environ if base is None else base)
    paths = [str(lib_dir)] if lib_dir.is_dir() else []
    if env.get("LD_LIBRARY_PATH"):
        paths.append(env["LD_LIBRARY_PATH"])
    if paths:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(paths)
    return env


def check(binary: Path | None = None, env: dict[str, str] | None = None) -> str:
    """perf_analyzer's version line; :class:`PerfAnalyzerUnavailable` naming what is missing."""
    binary = binary or find_binary()
    proc = subprocess.run([str(binary), "--version"], env=env or analyzer_env(), capture_output=True,
                          text=True, timeout=30)
    if proc.returncode != 0:
        missing = re.findall(r"error while loading shared libraries: ([^:]+):", proc.stderr)
        what = f"cannot load {', '.join(missing)}" if missing else f"exited {proc.returncode}: {proc.stderr.strip()}"
        raise PerfAnalyzerUnavailable(f"{binary} {what}; {INSTALL_HINT}")
    return (proc.stdout or proc.stderr).strip()  # 2.51 prints its version on stderr


@dataclass(slots=True)
class PerfOptions:
    """One perf_analyzer sweep: where, what to send, and how to measure."""

    url: str = "127.0.0.1:8001"          # gRPC host:port (--streaming is gRPC only)
    model: str = "tandem"
    concurrency: tuple[int, ...] = (1,)
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    max_tokens: int = 64
    temperature: float = 0.0
    request_count: int = 0               # > 0: exactly this many requests per level, no stability windows
    measurement_mode: str = "count_windows"
    measurement_request_count: int = 20  # count_windows: requests per window (LLM requests are long)
    measurement_interval_ms: int = 5000  # time_windows: window length
    stability_percentage: float = 10.0
    max_trials: int = 10
    timeout_s: float = 600.0             # per concurrency level


def write_input_data(path: Path, prompts: tuple[str, ...], max_tokens: int, temperature: float) -> Path:
    """perf_analyzer's ``--input-data`` JSON: one entry per prompt, used round-robin.

    Every input has dims [1] and the model has max_batch_size 1, so perf_analyzer
    derives the shape [1, 1] itself (its ``-b`` is 1); no ``--shape`` is needed.
    """
    if not prompts:
        raise ValueError("prompts: got none; allowed: one or more strings")
    data = [{"text_input": [p], "max_tokens": [max_tokens], "stream": [True], "temperature": [temperature]}
            for p in prompts]
    path.write_text(json.dumps({"data": data}, indent=1))
    return path


def build_command(binary: Path, options: PerfOptions, concurrency: int, input_data: Path,
                  csv_path: Path, export_path: Path) -> list[str]:
    """The perf_analyzer command line for one concurrency level."""
    cmd = [str(binary), "-m", options.model, "-u", options.url, "-i", "grpc", "--streaming",
           "--input-data", str(input_data), "--concurrency-range", str(concurrency),
           "-f", str(csv_path), "--verbose-csv", "--profile-export-file", str(export_path)]
    if options.request_count > 0:
        return cmd + ["--request-count", str(options.request_count)]
    if options.measurement_mode not in MEASUREMENT_MODES:
        raise ValueError(f"measurement_mode: got {options.measurement_mode!r}; allowed: {', '.join(MEASUREMENT_MODES)}")
    cmd += ["--measurement-mode", options.measurement_mode,
            "--stability-percentage", f"{options.stability_percentage:g}", "--max-trials", str(options.max_trials)]
    if options.measurement_mode == "count_windows":
        return cmd + ["--measurement-request-count", str(options.measurement_request_count)]
    return cmd + ["--measurement-interval", str(options.measurement_interval_ms)]


@dataclass(slots=True, frozen=True)
class LatencyStats:
    avg_ms: float
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float

    @classmethod
    def from_samples_us(cls, samples: list[float]) -> "LatencyStats":
        """The benchmarks' percentiles (:func:`~.stats.percentile`), so that a TTFT from
        here compares with every other benchmark's; perf_analyzer's own latencies (the
        CSV's) are nearest-rank, its definition."""
        if not samples:
            return cls(math.nan, math.nan, math.nan, math.nan, math.nan)
        s = sorted(samples)
        return cls(sum(s) / len(s) / 1e3, *(percentile(s, p) / 1e3 for p in (50, 90, 95, 99)))


@dataclass(slots=True)
class PerfPoint:
    """perf_analyzer's measurement at one concurrency level."""

    concurrency: int
    request_count: int                 # requests in the measurement (its "Request count")
    throughput_per_s: float            # requests/s ("Inferences/Second")
    response_throughput_per_s: float   # streamed responses/s (one per engine step, several tokens with speculation)
    latency: LatencyStats              # request sent -> final response (perf_analyzer's figures)
    first_response: LatencyStats       # request sent -> first response (TTFT), from the profile export
    responses_per_request: float
    output_tokens_per_request: float   # the final response's num_output_tokens, averaged
    unfinished_requests: int           # measured requests whose last response had no finish_reason


def _measured_requests(experiment: dict) -> list[dict]:
    """The requests perf_analyzer's figures cover: those whose last response lands in
    the last three (stable) windows, or in the one window of a --request-count run."""
    bounds = experiment["window_boundaries"]
    lo, hi = bounds[max(0, len(bounds) - 4)], bounds[-1]
    return [r for r in experiment["requests"]
            if r["response_timestamps"] and lo <= r["response_timestamps"][-1] <= hi]


def parse_point(concurrency: int, stdout: str, csv_path: Path, export_path: Path) -> PerfPoint:
    """A :class:`PerfPoint` from one run's stdout, CSV and profile export."""
    with csv_path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("Concurrency", "").strip() == str(concurrency)]
    if len(rows) != 1:
        raise PerfAnalyzerError(f"{csv_path}: expected one row for concurrency {concurrency}, got {len(rows)}")
    row = rows[0]
    m = re.search(r"Client:\s*\n\s*Request count: (\d+)", stdout)
    if not m:
        raise PerfAnalyzerError(f"no 'Request count' in perf_analyzer's output:\n{stdout[-2000:]}")

    experiments = json.loads(export_path.read_text())["experiments"]
    exp = next((e for e in experiments if e["experiment"]["value"] == concurrency), None)
    if exp is None:
        raise PerfAnalyzerError(f"{export_path}: no experiment at concurrency {concurrency}")
    requests = _measured_requests(exp)
    first_us = [(r["response_timestamps"][0] - r["timestamp"]) / 1e3 for r in requests]
    n_responses = [len(r["response_timestamps"]) for r in requests]
    finals = [(r.get("response_outputs") or [{}])[-1] for r in requests]
    unfinished = sum(1 for f in finals if not f.get("finish_reason"))
    return PerfPoint(
        concurrency=concurrency,
        request_count=int(m.group(1)),
        throughput_per_s=float(row["Inferences/Second"]),
        response_throughput_per_s=float(row.get("Response Throughput") or "nan"),
        latency=LatencyStats(*(float(row[k]) / 1e3 for k in ("Avg latency", "p50 latency", "p90 latency",
                                                             "p95 latency", "p99 latency"))),
        first_response=LatencyStats.from_samples_us(first_us),
        responses_per_request=sum(n_responses) / len(n_responses) if n_responses else 0.0,
        output_tokens_per_request=(sum(int(f.get("num_output_tokens", 0)) for f in finals) / len(finals)
                                   if finals else 0.0),
        unfinished_requests=unfinished,
    )


def _error_lines(output: str) -> str:
    # perf_analyzer follows an argument error with its whole usage text: keep the error lines
    lines = [ln.strip() for ln in output.splitlines()
             if re.match(r"\s*(error|failed|thread \[\d+\] had error)", ln, re.IGNORECASE)]
    return "\n".join(lines[:8]) or output[-2000:]


def run_point(options: PerfOptions, concurrency: int, out_dir: Path, input_data: Path,
              binary: Path, env: dict[str, str], on_command=None) -> PerfPoint:
    """Run perf_analyzer at one level; its CSV, profile export and log stay in ``out_dir``.
    ``on_command(cmd)`` sees the command line before it runs (the CLI prints it)."""
    csv_path, export_path, log_path = (out_dir / f"c{concurrency}{ext}" for ext in (".csv", ".profile.json", ".log"))
    cmd = build_command(binary, options, concurrency, input_data, csv_path, export_path)
    if on_command:
        on_command(cmd)
    # perf_analyzer 2.51 once exited 0 with an empty profile export (a CI run): once more
    for _ in range(2):
        export_path.unlink(missing_ok=True)   # perf_analyzer refuses to overwrite a profile export
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=options.timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise PerfAnalyzerError(f"perf_analyzer at concurrency {concurrency} ran over {options.timeout_s:g} s: "
                                    f"{shlex.join(cmd)}") from exc
        log_path.write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise PerfAnalyzerError(f"perf_analyzer at concurrency {concurrency} exited {proc.returncode}:\n"
                                    f"{_error_lines(proc.stdout + proc.stderr)}\n(full log: {log_path})")
        if export_path.exists() and export_path.stat().st_size:
            return parse_point(concurrency, proc.stdout, csv_path, export_path)
    raise PerfAnalyzerError(f"perf_analyzer at concurrency {concurrency} exited 0 twice without writing its "
                            f"profile export {export_path} (full log: {log_path})")


def profile(options: PerfOptions, out_dir: Path, on_command=None) -> list[PerfPoint]:
    """One :class:`PerfPoint` per concurrency level, in order (files in ``out_dir``)."""
    binary = find_binary()
    env = analyzer_env()
    check(binary, env)
    out_dir.mkdir(parents=True, exist_ok=True)
    input_data = write_input_data(out_dir / "input_data.json", options.prompts, options.max_tokens,
                                  options.temperature)
    return [run_point(options, c, out_dir, input_data, binary, env, on_command) for c in options.concurrency]


# ---- CLI -----------------------------------------------------------------

def add_parser(subparsers) -> None:
    p = subparsers.add_parser("perf", help="load-test a streaming model with Triton's perf_analyzer",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="127.0.0.1:8001", help="tritonserver gRPC host:port")
    p.add_argument("--model", default="tandem")
    p.add_argument("--concurrency", default="1,2,4", help="comma-separated levels, one perf_analyzer run each")
    p.add_argument("--prompt", action="append", dest="prompts", help="a prompt (repeatable; default: 4 code prompts)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--request-count", type=int, default=0,
                   help="exactly N requests per level, no stability windows (0: windows)")
    p.add_argument("--measurement-mode", default="count_windows", choices=MEASUREMENT_MODES)
    p.add_argument("--measurement-request-count", type=int, default=20, help="count_windows: requests per window")
    p.add_argument("--measurement-interval", type=int, default=5000, help="time_windows window in ms")
    p.add_argument("--stability-percentage", type=float, default=10.0)
    p.add_argument("--max-trials", type=int, default=10)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per level")
    p.add_argument("--out", type=Path, default=Path("bench_results/perf"),
                   help="folder for perf_analyzer's CSV, profile exports, logs and results.json")
    p.set_defaults(func=run)


def _print_table(points: list[PerfPoint]) -> None:
    print(f"{'conc':>4} {'requests':>8} {'req/s':>7} {'resp/s':>8} {'resp/req':>8} {'tok/req':>7} "
          f"{'first p50':>9} {'first p99':>9} {'lat avg':>8} {'lat p50':>8} {'lat p90':>8} {'lat p99':>8}  (ms)")
    for p in points:
        f, lat = p.first_response, p.latency
        print(f"{p.concurrency:>4} {p.request_count:>8} {p.throughput_per_s:>7.2f} {p.response_throughput_per_s:>8.1f} "
              f"{p.responses_per_request:>8.1f} {p.output_tokens_per_request:>7.1f} {f.p50_ms:>9.1f} {f.p99_ms:>9.1f} "
              f"{lat.avg_ms:>8.1f} {lat.p50_ms:>8.1f} {lat.p90_ms:>8.1f} {lat.p99_ms:>8.1f}")


def run(args: argparse.Namespace) -> int:
    try:
        levels = tuple(int(c) for c in args.concurrency.split(",") if c.strip())
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        print(f"error: --concurrency: got {args.concurrency!r}; allowed: integers >= 1, e.g. 1,2,4", file=sys.stderr)
        return 2
    options = PerfOptions(
        url=args.url, model=args.model, concurrency=levels,
        prompts=tuple(args.prompts) if args.prompts else DEFAULT_PROMPTS,
        max_tokens=args.max_tokens, temperature=args.temperature, request_count=args.request_count,
        measurement_mode=args.measurement_mode, measurement_request_count=args.measurement_request_count,
        measurement_interval_ms=args.measurement_interval, stability_percentage=args.stability_percentage,
        max_trials=args.max_trials, timeout_s=args.timeout)
    try:
        points = profile(options, args.out, on_command=lambda cmd: print("$", shlex.join(cmd), flush=True))
    except (PerfAnalyzerUnavailable, PerfAnalyzerError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _print_table(points)
    results = args.out / "results.json"
    results.write_text(json.dumps({"options": asdict(options), "points": [asdict(p) for p in points]}, indent=1))
    print(f"wrote {results}")
    return 0
