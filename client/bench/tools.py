"""``tandem bench tools``: do tool calls with ``tool_choice`` "required" or a named function
always parse and validate against their schemas, with and without speculation?

Per ``--spec`` mode a server (``tandem serve`` in-process: tritonserver and the OpenAI
API) gets ``--requests`` chat requests at temperature 1 through the ``openai`` package,
as its users send them: over four tools whose schemas differ (strings with maxLength and
enums, bounded integers, an array of enums, a nested object with a boolean), mixing
``required`` (parallel calls allowed, and ``parallel_tool_calls: false``) and each tool
named, half of them streamed (the calls put together from the deltas). Each answer that
ended by itself is checked: its finish reason (``tool_calls``; ``stop`` for a named
function), every call's name, its arguments parsed as JSON and validated against its
tool's schema (``jsonschema``), one call where one is allowed. An answer cut by the
context (``length``) is counted apart, as ``tandem bench guided`` counts it.
"""
from __future__ import annotations

import argparse
import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from tandem.client.bench.args import add_dtype, model_path, names, positive_int
from tandem.client.bench.harness import start_server, work_dir
from tandem.client.bench.report import git_state, header, save_figure, write
from tandem.client.bench.stats import percentile
from tandem.client.paths import DEMO_CHECKPOINTS

DEFAULT_OUT = Path("docs/bench/tools.json")
SPEC_MODES = ("none", "auto", "mtp", "draft_target", "ngram")


def _fn(name: str, description: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


TOOLS = [
    _fn("get_weather", "The weather in a city", {
        "type": "object", "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["c", "f"]}}}),
    _fn("add", "a + b", {
        "type": "object", "required": ["a", "b"],
        "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                       "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}}),
    _fn("search", "Search the documentation", {
        "type": "object", "required": ["query"],
        "properties": {"query": {"type": "string", "maxLength": 16},
                       "limit": {"type": "integer", "minimum": 1, "maximum": 20},
                       "sections": {"type": "array", "maxItems": 3,
                                    "items": {"type": "string", "enum": ["api", "guide", "faq"]}}}}),
    _fn("set_alarm", "Set an alarm", {
        "type": "object", "required": ["time", "repeat"],
        "properties": {"time": {"type": "object", "required": ["hour", "minute"],
                                "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                               "minute": {"type": "integer", "minimum": 0, "maximum": 59}}},
                       "repeat": {"type": "boolean"}, "label": {"type": "string", "maxLength": 10}}}),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = ["What is the weather in Oslo?", "Add 2 and 40.", "Find the guide about streams.",
             "Wake me at 7:30 every day.", "Is it raining in Lima, and what is 3 + 4?", "Search the FAQ for keys."]
# request kinds, in turn: required (parallel calls allowed), required with parallel_tool_calls false, each tool named
KINDS = ("required", "required_single", *(f"named:{name}" for name in SCHEMAS))


@dataclass(slots=True, frozen=True)
class ToolRequest:
    index: int
    kind: str
    stream: bool
    question: str

    def body(self, model: str, seed: int) -> dict:
        """The ``chat.completions.create`` arguments.

        >>> ToolRequest(7, "named:add", True, "x").body("tandem", 0)["tool_choice"]
        {'type': 'function', 'function': {'name': 'add'}}
        """
        body = {"model": model, "messages": [{"role": "user", "content": self.question}], "tools": TOOLS,
                "temperature": 1.0, "seed": seed + self.index, "stream": self.stream}
        if self.kind.startswith("named:"):
            body["tool_choice"] = {"type": "function", "function": {"name": self.kind.split(":", 1)[1]}}
        else:
            body["tool_choice"] = "required"
            if self.kind == "required_single":
                body["parallel_tool_calls"] = False
        return body


def requests(n: int) -> list[ToolRequest]:
    """``n`` requests cycling through :data:`KINDS`, every other round streamed.

    >>> [(r.kind, r.stream) for r in requests(8)][5:]
    [('named:set_alarm', False), ('required', True), ('required_single', True)]
    """
    return [ToolRequest(i, KINDS[i % len(KINDS)], (i // len(KINDS)) % 2 == 1, QUESTIONS[i % len(QUESTIONS)])
            for i in range(n)]


def check(req: ToolRequest, finish_reason: str | None, calls: list[tuple[str, str]]) -> str:
    """``"valid"``, ``"cut"`` (ended by the context: not judged) or why the answer is wrong.

    >>> check(ToolRequest(0, "named:add", False, "x"), "stop", [("add", '{"a": 1, "b": 2}')])
    'valid'
    >>> check(ToolRequest(0, "required", False, "x"), "tool_calls", [("add", '{"a": 1}')])
    "add: 'b' is a required property"
    """
    import jsonschema

    if finish_reason == "length":
        return "cut"
    named = req.kind.split(":", 1)[1] if req.kind.startswith("named:") else None
    want = "stop" if named else "tool_calls"
    if finish_reason != want:
        return f"finish_reason {finish_reason!r}, not {want!r}"
    if not calls or (len(calls) > 1 and req.kind != "required"):
        return f"{len(calls)} calls"
    for name, arguments in calls:
        if name not in SCHEMAS or (named and name != named):
            return f"called {name!r}"
        try:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        except ValueError as e:
            return f"{name}: arguments not JSON ({e})"
        except jsonschema.ValidationError as e:
            return f"{name}: {e.message}"
    return "valid"


def send(client, req: ToolRequest, model: str, seed: int) -> dict:
    """One request: its finish reason, calls (from the deltas when streamed), seconds, tokens."""
    t0 = time.perf_counter()
    try:
        if req.stream:
            reason, parts = None, {}
            for chunk in client.chat.completions.create(**req.body(model, seed)):
                choice = chunk.choices[0]
                reason = choice.finish_reason or reason
                for d in choice.delta.tool_calls or []:
                    name, args = parts.get(d.index, ("", ""))
                    parts[d.index] = (name + (d.function.name or ""), args + (d.function.arguments or ""))
            calls, tokens = [parts[i] for i in sorted(parts)], None
        else:
            r = client.chat.completions.create(**req.body(model, seed))
            reason = r.choices[0].finish_reason
            calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]
            tokens = r.usage.completion_tokens
    except Exception as e:  # noqa: BLE001 - an error is a result here
        return {"index": req.index, "kind": req.kind, "stream": req.stream, "outcome": f"error: {e}"[:300],
                "seconds": time.perf_counter() - t0}
    return {"index": req.index, "kind": req.kind, "stream": req.stream, "finish_reason": reason, "calls": calls,
            "outcome": check(req, reason, calls), "seconds": time.perf_counter() - t0, "tokens": tokens}


def spec_counters(metrics_url: str) -> dict[str, float]:
    """The server's speculation counters (summed over their labels): drafted and accepted tokens."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for name in ("tandem_spec_draft_tokens_total", "tandem_spec_accepted_tokens_total"):
        out[name] = sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return out


def summary(spec: str, results: list[dict], counters: dict) -> dict:
    ended = [r for r in results if r["outcome"] != "cut"]
    valid = [r for r in ended if r["outcome"] == "valid"]
    kinds = {k: {"samples": sum(r["kind"] == k for r in results), "ended": sum(r["kind"] == k for r in ended),
                 "valid": sum(r["kind"] == k for r in valid)} for k in KINDS}
    parallel = [len(r["calls"]) for r in valid if r["kind"] == "required"]
    return {"spec": spec, "samples": len(results), "ended": len(ended), "valid": len(valid),
            "cut_by_context": len(results) - len(ended), "streamed": sum(r["stream"] for r in results),
            "calls": sum(len(r.get("calls") or []) for r in valid),
            "required_with_several_calls": sum(n > 1 for n in parallel),
            "seconds_p50": percentile([r["seconds"] for r in results], 50),
            "draft_tokens": counters.get("tandem_spec_draft_tokens_total"),
            "accepted_tokens": counters.get("tandem_spec_accepted_tokens_total"),
            "kinds": kinds, "failures": [r for r in ended if r["outcome"] != "valid"][:20],
            "examples": [r["calls"] for r in valid[:3]]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_path, default=DEMO_CHECKPOINTS / "target")
    add_dtype(p)
    p.add_argument("--spec", type=names(*SPEC_MODES), default="none,auto",
                   help="the servers' --spec, one server each (default: none,auto)")
    p.add_argument("--requests", type=positive_int, default=240, help="requests per server (default: 240)")
    p.add_argument("--concurrency", type=positive_int, default=8)
    p.add_argument("--seed", type=int, default=0, help="request i is sampled with seed + i")
    p.add_argument("--keep-work", action="store_true", help="keep the servers' logs (a temp dir)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


def run_mode(args, spec: str, work: Path) -> dict:
    import openai

    from tandem.client.openai.frontend import OpenAIFrontend
    from tandem.client.serve.options import ServeOptions
    from tandem.client.serve.triton_server import free_port

    options = ServeOptions.of(model_dir=str(args.model), dtype=args.dtype, spec_method=spec,
                              max_num_seqs=max(8, args.concurrency))
    with ExitStack() as stack:
        print(f"--spec {spec}: starting tritonserver and the OpenAI API", flush=True)
        server = start_server(stack, options, work / spec, log_file=work / f"{spec}.log")
        api = stack.enter_context(OpenAIFrontend(server.grpc_url, ["tandem"], args.model, port=free_port()))
        client = openai.OpenAI(base_url=api.base_url, api_key="unused", max_retries=0, timeout=300)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda r: send(client, r, "tandem", args.seed), requests(args.requests)))
        row = summary(spec, results, spec_counters(server.metrics_url))
        row["wall_s"] = time.perf_counter() - t0
    print(f"--spec {spec}: {row['valid']}/{row['ended']} valid, {row['cut_by_context']} cut by the context, "
          f"{row['calls']} calls in {row['wall_s']:.0f} s", flush=True)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| --spec | valid / ended | cut by context | calls | required with >1 call | drafted → accepted tokens "
             "| request p50 (s) |", "|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        spec = "—" if not r["draft_tokens"] else f"{r['draft_tokens']:.0f} → {r['accepted_tokens']:.0f}"
        lines.append(f"| {r['spec']} | **{r['valid']} / {r['ended']}** | {r['cut_by_context']} of {r['samples']} | "
                     f"{r['calls']} | {r['required_with_several_calls']} | {spec} | {r['seconds_p50']:.2f} |")
    kinds = ["", "| kind | " + " | ".join(f"--spec {r['spec']}: valid / ended" for r in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    for k in KINDS:
        kinds.append(f"| {k} | " + " | ".join(f"{r['kinds'][k]['valid']} / {r['kinds'][k]['ended']}" for r in rows)
                     + " |")
    return "\n".join(lines + kinds)


def draw(report: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.8 / max(1, len(rows))
    for j, r in enumerate(rows):
        xs = [i + j * width for i in range(len(KINDS))]
        ended = [r["kinds"][k]["ended"] for k in KINDS]
        valid = [r["kinds"][k]["valid"] for k in KINDS]
        ax.bar(xs, ended, width, color="lightgray", edgecolor="gray")
        ax.bar(xs, valid, width, label=f"--spec {r['spec']}: valid")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(KINDS))], [k.replace("named:", "") for k in KINDS],
                  fontsize=7)
    ax.set_ylabel("answers (gray: ended)")
    ax.set_ylim(0, 1.3 * max(r["kinds"][k]["ended"] for r in rows for k in KINDS))
    ax.set_title("tool calls that parse and validate, temperature 1", fontsize=9)
    ax.legend(fontsize=7, ncol=len(rows), loc="upper center")
    return save_figure(fig, path, report)


def run(args) -> int:
    try:
        import jsonschema  # noqa: F401
        import openai  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"tandem bench tools needs the openai and jsonschema packages (.[test]): {e}") from None
    report = {**header("tools", args), "commit": git_state(), "tools": TOOLS, "kinds": list(KINDS)}
    with work_dir("tandem-bench-tools-", keep=args.keep_work) as work:
        report["results"] = [run_mode(args, spec, work) for spec in args.spec]
    write(report, args.out)
    print(table(report["results"]))
    print(f"wrote {args.out}, {draw(report, args.out.with_suffix('.png'))}")
    return 0 if all(r["valid"] == r["ended"] for r in report["results"]) else 1
