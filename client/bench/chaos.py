"""``tandem bench chaos``: the default serving path under every fault the code knows,
each completed response checked against a fault-free server.

N requests at concurrency C go through the disaggregated ensemble with prefix caching
on and ``--spec auto``: greedy, seeded-sampled and guided requests, shared system
prompts and multi-turn chats (chaos_workload.py). Meanwhile:

- all the time: KV transfers failed mid-layer, senders that give up half-way, prefill
  jobs held back (the server's ``--faults``), cancellations at random points;
- on a schedule (``--schedule``): stubs SIGKILLed, stubs SIGSTOPped and resumed,
  models rolled to a new version under load, the KV pool flooded with long prompts.

Then a second server (no faults, prefix caching off) answers every distinct completed
request once, and each completed response must equal its answer: a difference is a
wrong answer a user got, reported with the request, its cache hits and the faults
around it. Also checked: no stream hung, every failure says why, no KV page,
reservation, shm file or descriptor left behind, the right text again soon after
each fault. Prints a table, writes JSON and a plot over time.
"""
from __future__ import annotations

import argparse
import itertools
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path

from tandem.client.bench.args import ArgumentTypeError, fraction, non_negative_float, positive_float, positive_int
from tandem.client.bench.chaos_workload import (DEFAULT_SCHEDULE, ChaosRequest, FaultRecord, completed_keys,
                                                differences, kinds, make_plan, parse_schedule, schedule)
from tandem.client.bench.harness import start_server, work_dir
from tandem.client.bench.report import header, save_figure, write
from tandem.client.bench.soak import CACHE_SERIES, cache_counters, outcome_bars, run_request, wait_idle
from tandem.client.bench.soak_workload import Outcome, summarize, timeline
from tandem.client.paths import DEMO_CHECKPOINTS

# decode's counters the report gives: the prefix cache's, and the transfers that failed
COUNTERS = {**CACHE_SERIES, "recompared_pages": "tandem_prefix_cache_recompared_pages_total",
            "disagreeing_pages": "tandem_prefix_cache_disagreeing_pages_total",
            "transfer_failures": "tandem_kv_transfer_failures_total",
            "transfers_recomputed": "tandem_kv_transfer_recomputed_total"}
PROBE = ChaosRequest(-1, "def fibonacci(n):\n    ", 8, {"temperature": 0.0}, "greedy", None)
# the flood's prompts: long, and each its own (no shared pages to fall back on)
FLOOD_LINE = "    total_{i}_{j} = compute(values[{j}], weights[{i}]) + offset_{j}\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=positive_int, default=2500)
    p.add_argument("--concurrency", type=positive_int, default=8)
    p.add_argument("--cancel-frac", type=fraction, default=0.2, help="requests cancelled at a random point")
    p.add_argument("--seeded-frac", type=fraction, default=0.2, help="requests sampled with a seed")
    p.add_argument("--guided-frac", type=fraction, default=0.1,
                   help="requests with a guide (JSON schema, regex, any JSON), greedy or seeded")
    p.add_argument("--extreme-frac", type=fraction, default=0.02, help="requests with extreme sampling values")
    p.add_argument("--chat-frac", type=fraction, default=0.3, help="requests that are later turns of a chat")
    p.add_argument("--transfer-faults", type=transfer_faults, default="transfer_fail=0.05@mid_layers,drop_sender=0.01,"
                                                "prefill_delay_ms=300@0.05",
                   help="the server's --faults, all run long (TANDEM_FAULTS' syntax; '' for none)")
    p.add_argument("--schedule", type=schedule, default=DEFAULT_SCHEDULE,
                   help="ACTION:MODEL:SECONDS after the start, comma-separated; actions: kill (SIGKILL the "
                        "model's stub), stop (SIGSTOP, SIGCONT --stop-s later), roll (a new version under "
                        "load), flood (no model: --flood-requests long prompts at once)")
    p.add_argument("--stop-s", type=positive_float, default=0.5,
                   help="how long a stopped stub stays stopped (at 1 s or more Triton's health check "
                        "declares it dead: docs/FAILURES.md)")
    p.add_argument("--flood-requests", type=positive_int, default=24)
    p.add_argument("--flood-tokens", type=positive_int, default=400, help="prompt tokens of each flood request")
    p.add_argument("--num-pages", type=positive_int, default=384,
                   help="the decode KV pool (small enough that the flood fills it)")
    p.add_argument("--disagg-policy", default="remote", choices=("remote", "conditional"),
                   help="remote: every prompt's KV crosses the transfer path, where the transfer faults strike")
    p.add_argument("--spec", default="auto", help="the server's --spec")
    p.add_argument("--kv-audit", type=fraction, default=1.0, help="the server's --kv-audit")
    p.add_argument("--kv-audit-recompute", type=fraction, default=0.05,
                   help="the server's --kv-audit-recompute (hits declined, recomputed and compared)")
    p.add_argument("--deadline-s", type=positive_float, default=120.0,
                   help="a request with no final response by then counts as hung")
    p.add_argument("--max-seconds", type=positive_float, default=1800.0, help="stop sending new requests after this")
    p.add_argument("--backoff-s", type=non_negative_float, default=0.5,
                   help="a worker whose request failed waits this long before its next")
    p.add_argument("--recovery-timeout-s", type=positive_float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=str(DEMO_CHECKPOINTS / "target"))
    p.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"),
                   help="both servers' (float32: a token's choice does not flip with the batch's shape)")
    p.add_argument("--keep-work", action="store_true", help="keep both servers' run dirs and logs")
    p.add_argument("--out", type=Path, default=Path("docs/bench/chaos.json"))


def transfer_faults(text: str) -> str:
    """``--transfer-faults``' type: ``text`` as written, once TANDEM_FAULTS' parser takes it."""
    from tandem.rdma.faults import Faults
    try:
        Faults.parse(text)
    except ValueError as exc:
        raise ArgumentTypeError(str(exc)) from None
    return text


def run(args: argparse.Namespace) -> int:
    report = header("chaos", args)
    plan = make_plan(args.requests, args.seed, args.cancel_frac, args.seeded_frac, args.guided_frac,
                     args.extreme_frac, args.chat_frac)
    flood = flood_plan(args.model_dir, args.flood_requests, args.flood_tokens, first_index=len(plan))
    plan += flood
    with work_dir("tandem-chaos-", keep=args.keep_work) as run_dir:
        with ExitStack() as stack:
            server = start_server(stack, server_options(args, faults=args.transfer_faults, caching=True),
                                  run_dir / "chaos", log_file=run_dir / "chaos.log", model_control_mode="explicit",
                                  ready_timeout_s=600, exit_timeout_s=60)
            chaos = _chaos(args, server, plan, flood)
        print(f"  chaos done in {chaos['elapsed_s']:.0f} s; asking the reference server", flush=True)
        with ExitStack() as stack:
            ref_server = start_server(stack, server_options(args, faults="", caching=False), run_dir / "reference",
                                      log_file=run_dir / "reference.log", ready_timeout_s=600, exit_timeout_s=60)
            reference, ref_failed = replay(ref_server.grpc_url, completed_keys(plan, chaos["outcomes"]),
                                           args.concurrency, args.deadline_s)
    outcomes: list[Outcome] = chaos["outcomes"]
    diffs = differences(plan, outcomes, reference, chaos["faults"], {o.index: o.cached_tokens for o in outcomes},
                        chaos["start"])
    summary = summarize(outcomes)
    kills = [f for f in chaos["faults"] if f.fault.startswith("kill:")]
    slowest = max((f.ended_s - f.began_s for f in chaos["faults"] if f.ended_s is not None), default=0.0)
    # descriptors are compared within one tritonserver process (None: it was restarted)
    fds_gained = None if chaos["fds_before"] is None else _gained(chaos["fds_before"], chaos["fds_after"])
    leaked = {k: v for k, v in chaos["pages_after"].items() if k.endswith(("/reserved", "/in_use")) and v}
    goals = {
        "no_difference": not diffs and not ref_failed,
        "none_hung": summary.hung == 0,
        "failures_clear": summary.failed_unclear == 0,
        "no_bad_page": not chaos["cache"]["corrupt_pages"] and not chaos["cache"]["disagreeing_pages"],
        "nothing_leaked": not leaked and not chaos["shm_leaked"] and not fds_gained,
        "recovered_within_15s": all(f.ended_s is not None and f.ended_s - f.began_s <= 15.0 for f in kills),
        "fault_kinds_at_least_10": len(fault_kinds(chaos["faults"])) >= 10,
        "every_fault_ran": not chaos["not_run"],
    }
    report.update({
        "settings": {k: getattr(args, k) for k in (
            "requests", "concurrency", "cancel_frac", "seeded_frac", "guided_frac", "extreme_frac", "chat_frac",
            "transfer_faults", "schedule", "stop_s", "flood_requests", "flood_tokens", "num_pages",
            "disagg_policy", "spec", "kv_audit", "kv_audit_recompute", "deadline_s", "seed", "dtype")},
        "elapsed_s": round(chaos["elapsed_s"], 1),
        "summary": summary.as_dict(), "by_kind": kinds(plan, outcomes),
        "compared": sum(o.status == "ok" for o in outcomes), "distinct_compared": len(reference),
        "reference_failed": ref_failed,
        "differences": [asdict(d) for d in diffs],
        "cached_requests": sum(o.status == "ok" and o.cached_tokens > 0 for o in outcomes),
        "prefix_cache": chaos["cache"],
        "faults": [asdict(f) for f in chaos["faults"]], "fault_kinds": fault_kinds(chaos["faults"]),
        "faults_not_run": chaos["not_run"], "old_versions_unloaded": chaos["drains"],
        "slowest_recovery_s": round(slowest, 2),
        "pages_before": chaos["pages_before"], "pages_after": chaos["pages_after"], "leaked_pages": leaked,
        "shm_leaked": chaos["shm_leaked"],
        "fds_before": None if chaos["fds_before"] is None else len(chaos["fds_before"]),
        "fds_after": len(chaos["fds_after"]), "fds_gained": fds_gained,
        "server_crashes": chaos["crashes"],
        "goals": goals, "goals_met": all(goals.values()),
        "timeline_5s": timeline(outcomes, chaos["start"], 5.0),
    })
    _print(report)
    write(report, args.out)
    _plot(report, args.out.with_suffix(".png"))
    return 0 if report["goals_met"] else 1


def server_options(args: argparse.Namespace, faults: str, caching: bool):
    from tandem.client.serve.options import ServeOptions
    return ServeOptions.of(model_dir=args.model_dir, dtype=args.dtype, torch_threads=1, mode="disaggregated",
                           faults=faults, disagg_policy=args.disagg_policy, spec_method=args.spec,
                           num_pages=args.num_pages, prefix_caching="on" if caching else "off",
                           kv_audit=args.kv_audit if caching else 0.0,
                           kv_audit_recompute=args.kv_audit_recompute if caching else 0.0)


def flood_plan(model_dir: str, n: int, tokens: int, first_index: int) -> list[ChaosRequest]:
    """``n`` greedy requests of ``tokens`` prompt tokens each, no two sharing a page."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for i in range(n):
        text, j = f"def flood_{i}(values, weights):\n", 0
        while len(tok(text)["input_ids"]) < tokens:
            text += FLOOD_LINE.format(i=i, j=j)
            j += 1
        ids = tok(text)["input_ids"][:tokens]
        out.append(ChaosRequest(first_index + i, tok.decode(ids, skip_special_tokens=True), 48,
                                {"temperature": 0.0}, "flood", None))
    return out


def fault_kinds(faults: list[FaultRecord]) -> list[str]:
    return sorted({f.fault for f in faults})


# -- the chaos run -----------------------------------------------------------------------------

def _chaos(args: argparse.Namespace, server, plan: list[ChaosRequest], flood: list[ChaosRequest]) -> dict:
    """The requests and the faults against ``server``: outcomes, fault records, what was
    held before and after."""
    probe_want = run_request(server.grpc_url, PROBE, 60.0)
    if probe_want.status != "ok":
        raise RuntimeError(f"the server does not answer a probe: {probe_want.error}")
    pages_before = wait_idle(server.metrics_url)
    shm_before = set(server.owned_segments())
    first_pid = server.process.pid
    fds_before = _fds(first_pid)
    regular = [r for r in plan if r.kind != "flood"]
    sent = itertools.count()
    schedule_done = threading.Event()
    lock = threading.Lock()
    outcomes: list[Outcome] = []
    faults: list[FaultRecord] = []
    start = time.monotonic()
    # the faults that run all the time
    for name in filter(None, (x.split("=")[0].strip() for x in args.transfer_faults.split(","))):
        faults.append(FaultRecord(name, 0.0, None))
    if args.cancel_frac:
        faults.append(FaultRecord("cancel", 0.0, None))

    flooding: list[Future] = []
    not_run: list[str] = []
    drains: list[dict] = []   # rolled models' old versions: how long they took to unload

    def record(o: Outcome) -> None:
        with lock:
            outcomes.append(o)

    def worker() -> None:
        while time.monotonic() - start < args.max_seconds:
            with lock:
                i = next(sent)
                if i >= len(regular) and schedule_done.is_set():
                    return
                req = regular[i % len(regular)]
                if i >= len(regular):   # the plan again, until every fault has run
                    req = replace(req, index=len(plan))
                    plan.append(req)
            o = run_request(server.grpc_url, req, args.deadline_s)
            record(o)
            if o.status == "failed":
                time.sleep(args.backoff_s)

    def recovered(began: float, misses: dict[str, int]) -> float | None:
        """Seconds (since the start) when a probe returned the right text again; why the
        probes before it missed, in ``misses``."""
        while time.monotonic() - began < args.recovery_timeout_s:
            o = run_request(server.grpc_url, PROBE, 10.0)
            if o.status == "ok" and o.text == probe_want.text:
                return o.ended_at - start
            why = "wrong text" if o.status == "ok" else f"{o.status}: {(o.error or '')[:100]}"
            misses[why] = misses.get(why, 0) + 1
            time.sleep(0.25)
        return None

    def injector() -> None:
        try:
            for f in parse_schedule(args.schedule):
                time.sleep(max(0.0, start + f.at_s - time.monotonic()))
                if time.monotonic() - start > args.max_seconds:
                    not_run.append(f"{f}: --max-seconds passed")
                    continue
                began = time.monotonic()
                name = f"{f.action}:{f.model}" if f.model else f.action
                try:
                    detail = _inject(server, f.action, f.model, args, flood, record, flooding, drains)
                except Exception as exc:   # a fault that could not be injected is reported, not fatal
                    not_run.append(f"{f}: {exc}")
                    continue
                misses: dict[str, int] = {}
                ended = recovered(began, misses)
                faults.append(FaultRecord(name, round(began - start, 2), None if ended is None else round(ended, 2),
                                          misses))
                print(f"  {name} at {began - start:.1f} s ({detail}): right text again "
                      f"{'never' if ended is None else f'{ended - (began - start):.2f} s later'}", flush=True)
        finally:
            schedule_done.set()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.concurrency)]
    injecting = threading.Thread(target=injector, daemon=True)
    for t in [*threads, injecting]:
        t.start()
    for t in threads:
        t.join()
    injecting.join(timeout=args.recovery_timeout_s + 60)
    wait(flooding, timeout=args.deadline_s)
    elapsed = time.monotonic() - start
    pages_after = wait_idle(server.metrics_url)
    # descriptors of connections just closed go a moment later
    pid = server.process.pid
    if pid != first_pid:   # restarted: the new process has no idle baseline to compare with
        fds_before = None
    settle = time.monotonic() + 15.0
    while _gained(fds_before or [], fds_after := _fds(pid)) and fds_before is not None \
            and time.monotonic() < settle:
        time.sleep(0.5)
    return {"outcomes": outcomes, "faults": faults, "start": start, "elapsed_s": elapsed,
            "pages_before": pages_before, "pages_after": pages_after,
            "cache": cache_counters(server.metrics_url, COUNTERS),
            "shm_leaked": sorted(set(server.owned_segments()) - shm_before - _live_segments(server)),
            "fds_before": fds_before, "fds_after": fds_after, "crashes": server.crashes(),
            "not_run": not_run, "drains": drains}


def _inject(server, action: str, model: str, args: argparse.Namespace, flood: list[ChaosRequest],
            record, flooding: list[Future], drains: list[dict]) -> str:
    if action == "kill":
        return f"pid {server.kill_stub(model)}"
    if action == "stop":
        return f"pid {server.pause_stub(model, args.stop_s)} stopped {args.stop_s:g} s"
    if action == "roll":
        version = server.roll_version(model)
        threading.Thread(target=_watch_unload, args=(server, model, version, drains), daemon=True).start()
        return f"version {version}"
    # flood: every long prompt at once, each on its own stream; their outcomes count
    pool = ThreadPoolExecutor(len(flood))
    flooding += [pool.submit(lambda r=req: record(run_request(server.grpc_url, r, args.deadline_s)))
                 for req in flood]
    pool.shutdown(wait=False)
    return f"{len(flood)} prompts of {args.flood_tokens} tokens"


def _watch_unload(server, model: str, version: int, drains: list[dict], timeout_s: float = 120.0) -> None:
    """How long the rolled model's old version took to drain and unload (Triton waits for
    its in-flight requests): a version that never goes holds requests it never ends."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        try:
            unloading = "UNLOADING" in server.http.states().get(model, set())
        except Exception:   # the server restarts
            unloading = True
        if not unloading:
            seconds = round(time.monotonic() - began, 1)
            drains.append({"model": model, "version": version - 1, "unloaded_after_s": seconds})
            return
        time.sleep(0.5)
    drains.append({"model": model, "version": version - 1, "unloaded_after_s": None})


def _fds(pid: int) -> list[str]:
    """What tritonserver's descriptors point at (sockets and pipes by kind: their
    inode numbers change with every connection)."""
    out = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if ":[" in target:              # socket:[inode], pipe:[inode]: by kind
                target = target.split(":[")[0]
            elif target.startswith("/dev/shm/"):   # a stub's region: named per launch
                target = "/dev/shm/" + ("tandem_* (a stub's region)" if target.startswith("/dev/shm/tandem_")
                                        else target.rsplit("/", 1)[1])
            out.append(target)
    except OSError:
        pass
    return sorted(out)


def _gained(before: list[str], after: list[str]) -> list[str]:
    return sorted((Counter(after) - Counter(before)).elements())


def _live_segments(server) -> set[str]:
    """The segments a live stub or the KV pool still maps (a restarted stub's are new)."""
    live = set()
    for stub in server.stubs():
        try:
            maps = Path(f"/proc/{stub.pid}/maps").read_text()
        except OSError:
            continue
        live |= {seg for seg in server.owned_segments() if f"/dev/shm/{seg}" in maps}
    return live


# -- the reference ------------------------------------------------------------------------------

def replay(url: str, requests: dict[str, ChaosRequest], concurrency: int,
           deadline_s: float) -> tuple[dict[str, str], list[str]]:
    """Each request once, uncancelled, on the reference server: ({key: text}, failures)."""
    texts, failed = {}, []

    def one(key: str, req: ChaosRequest) -> None:
        o = run_request(url, replace(req, cancel_after=None), deadline_s)
        if o.status == "ok":
            texts[key] = o.text
        else:
            failed.append(f"request {req.index}: {o.status} {o.error or ''}".strip())

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda kv: one(*kv), list(requests.items())))
    return texts, failed


# -- the report ---------------------------------------------------------------------------------

def _print(report: dict) -> None:
    s = report["summary"]
    print(f"\nchaos: {s['requests']} requests in {report['elapsed_s']} s, {len(report['fault_kinds'])} fault kinds")
    print(f"{'kind':<10}" + "".join(f"{k:>11}" for k in ("ok", "cancelled", "failed", "hung")))
    for kind, by in report["by_kind"].items():
        print(f"{kind:<10}" + "".join(f"{by.get(k, 0):>11}" for k in ("ok", "cancelled", "failed", "hung")))
    print(f"compared with the reference: {report['compared']} completed ({report['distinct_compared']} distinct), "
          f"{len(report['differences'])} differ; reference failures {len(report['reference_failed'])}")
    print(f"completed requests served from the prefix cache: {report['cached_requests']}; "
          f"pages audited {report['prefix_cache']['audited_pages']:.0f}, "
          f"changed {report['prefix_cache']['corrupt_pages']:.0f}; pages recomputed and compared "
          f"{report['prefix_cache']['recompared_pages']:.0f}, disagreeing "
          f"{report['prefix_cache']['disagreeing_pages']:.0f}; KV transfers failed "
          f"{report['prefix_cache']['transfer_failures']:.0f}, of which decode recomputed "
          f"{report['prefix_cache']['transfers_recomputed']:.0f}")
    print(f"failed without a clear reason: {s['failed_unclear']}; leaked pages {report['leaked_pages'] or 0}, "
          f"shm {report['shm_leaked'] or 0}, tritonserver fds {report['fds_before']} -> {report['fds_after']} "
          f"(gained: {_gained_text(report['fds_gained'])})")
    print(f"{'fault':<28}{'at s':>8}{'right again s':>15}")
    for f in report["faults"]:
        again = "-" if f["ended_s"] is None else f"{f['ended_s'] - f['began_s']:.2f}"
        print(f"{f['fault']:<28}{f['began_s']:>8.1f}{again:>15}  "
              + "; ".join(f"{n}x {why}" for why, n in f.get("misses", {}).items()))
    for d in report["old_versions_unloaded"]:
        print(f"  rolled {d['model']}: version {d['version']} unloaded after "
              f"{'(still loaded)' if d['unloaded_after_s'] is None else d['unloaded_after_s']} s")
    for line in report["faults_not_run"]:
        print(f"  NOT RUN {line}")
    for d in report["differences"][:10]:
        print(f"  DIFFERS request {d['request']} ({d['kind']}, chat {d['chat']}, "
              f"cached tokens {d['cached_tokens']}, faults {d['faults_around']}): {d['got']!r} != {d['want']!r}")
    for msg, n in list(s["errors"].items())[:8]:
        print(f"  {n:>5}  {msg}")
    print("goals: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in report["goals"].items()))


def _gained_text(gained: list[str] | None) -> str:
    return "not compared: tritonserver was restarted" if gained is None else str(gained or "none")


def _plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 3.8))
    top = outcome_bars(ax, report["timeline_5s"])
    for i, f in enumerate(f for f in report["faults"] if f["began_s"] > 0):
        ax.axvline(f["began_s"], color="tab:purple", ls="--", lw=0.8)
        ax.text(f["began_s"], top * (1 - 0.08 * (i % 4)), f" {f['fault']}", color="tab:purple", fontsize=6,
                va="top")
    ax.legend(fontsize=7, ncol=4, loc="lower right")
    ax.set_title(f"chaos: {len(report['differences'])} of {report['compared']} completed responses differ "
                 "from a fault-free server's", fontsize=9)
    save_figure(fig, path, report)
