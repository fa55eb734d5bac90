"""KV transfer between two processes over UCX against a plain memcpy, side by side.

The receiver (kv_transfer) is a child process with a :class:`KVReceiver` on a shared
decode pool; this process is prefill (a :class:`KVSender` on its own pool) and the
decoder (it watches the counter in shared memory, claims and frees the pages).
Shapes default to Llama-3-8B's KV: 32 layers, 8 KV heads, head dim 128, bf16.

Reported:

- GB/s of whole transfers (every layer ready at once) for each page size and run
  cap (``--run-pages 1`` is one operation per page and layer), next to a memcpy of the
  same number of bytes between two buffers of this process;
- operations per page, HND vs NHD, for several prefill -> decode TP pairs;
- time from the last layer's compute to counter completion, streaming layer by layer
  while compute runs, against sending only after the last layer.

``--paths`` names the paths the KV takes: ``shm`` (one host, both processes in this
network namespace: UCX picks shared memory / CMA), ``veth`` (the receiver and the
sender in two network namespaces joined by a veth pair, UCX held to TCP on the veth
interfaces: what prefill and decode on two hosts do over a network link; needs root,
see :mod:`tandem.client.bench.netns`). Each path gets its own rows.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from tandem.client.bench.args import add_dtype, ArgumentTypeError, names, non_negative_float, positive_int, positive_ints
from tandem.client.bench.harness import timed
from tandem.client.bench.report import command, save_figure

DEFAULT_OUT = Path("docs/bench/transfer.json")
SHARD_PAIRS = [((1, 1), (1, 1)), ((2, 1), (1, 1)), ((1, 1), (2, 1)), ((2, 1), (4, 1)),
               ((8, 1), (2, 1)), ((4, 4), (8, 8))]
PATHS = {"shm": "one host: shared memory / CMA", "veth": "two network namespaces: TCP over veth"}
# the ops-per-page table splits the KV heads evenly over each side's ranks per replica set
KV_HEADS_MULTIPLE = math.lcm(*(tp // sets for pair in SHARD_PAIRS for tp, sets in pair))


def kv_heads(text: str) -> int:
    """``--kv-heads``' type: a multiple of :data:`KV_HEADS_MULTIPLE`."""
    n = positive_int(text)
    if n % KV_HEADS_MULTIPLE:
        raise ArgumentTypeError(f"must be a multiple of {KV_HEADS_MULTIPLE} (the ops-per-page table "
                                f"splits the heads over up to {KV_HEADS_MULTIPLE} ranks), got {text!r}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=positive_int, default=2048, help="prompt tokens per transfer")
    p.add_argument("--page-sizes", type=positive_ints, default="16,64")
    p.add_argument("--run-pages", type=positive_ints, default="1,4,16,64",
                   help="max pages per operation (runs of consecutive pages); 1 = per page")
    p.add_argument("--layers", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=kv_heads, default=8)
    p.add_argument("--head-dim", type=positive_int, default=128)
    add_dtype(p)
    p.add_argument("--repeats", type=positive_int, default=5, help="transfers per configuration")
    p.add_argument("--layer-ms", type=non_negative_float, default=3.0,
                   help="simulated compute per layer for the streaming measurement")
    p.add_argument("--paths", type=names(*PATHS), default="shm",
                   help="shm: two processes on one host (UCX's choice: shared memory / CMA); veth: "
                        "the two in separate network namespaces over a veth pair, TCP only (root); "
                        "comma separated (default: %(default)s)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)


# -- the receiver process ----------------------------------------------------------------
def _receiver_main(conn, ucx: dict | None = None) -> None:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    from tandem.rdma import KVReceiver, ReceiverConfig, SharedKVPool
    pool = rx = None
    while True:
        cmd, *args = conn.recv()
        if cmd == "open":
            if rx is not None:
                rx.close()
                pool.close(release=False)
            pool = SharedKVPool.open(args[0])
            rx = KVReceiver(pool, ReceiverConfig(timeout_s=60, **(ucx or {})))
            conn.send(rx.address)
        elif cmd == "reserve":
            conn.send(rx.reserve(args[0], max_run_pages=args[1], seed=0).to_bytes())
        elif cmd == "trace":
            t = rx.trace(*args)
            conn.send((t.ready_at, dict(t.layer_done_at)))
        elif cmd == "stats":
            conn.send(rx.stats)
        else:
            if rx is not None:
                rx.close()
                pool.close(release=False)
            conn.send(None)
            return


def _child(prefix: list[str], entry: str):
    """A Python child running ``entry(fd)`` behind ``prefix`` (``ip netns exec NS``: its
    own network namespace, and a /sys that lists that namespace's interfaces, which is
    where UCX looks for them), and the :class:`Connection` to it."""
    from multiprocessing.connection import Connection
    ours, theirs = socket.socketpair()
    code = f"from tandem.client.bench.transfer import {entry}; {entry}({theirs.fileno()})"
    proc = subprocess.Popen([*prefix, sys.executable, "-c", code], pass_fds=(theirs.fileno(),))
    theirs.close()
    return Connection(ours.detach()), proc


def _receiver_child(fd: int) -> None:
    from multiprocessing.connection import Connection
    conn = Connection(fd)
    _receiver_main(conn, conn.recv())


class _Receiver:
    def __init__(self, prefix: list[str] = (), ucx: dict | None = None):
        self.conn, self.proc = _child(list(prefix), "_receiver_child")
        self.conn.send(ucx or {})

    def __call__(self, *cmd):
        self.conn.send(cmd)
        return self.conn.recv()

    def close(self):
        self("quit")
        self.proc.wait(10)


# -- measurements ------------------------------------------------------------------------
def memcpy_gbps(nbytes: int, repeats: int) -> float:
    src = np.frombuffer(np.random.default_rng(1).bytes(nbytes), dtype=np.uint8)
    dst = np.ones(nbytes, dtype=np.uint8)   # touched, like the pre-faulted pool
    return nbytes / timed(lambda: np.copyto(dst, src), repeats) / 1e9


def _transfer(sender, rx, pool, tokens, run_pages, src_pages, layer_s=0.0, after=False):
    """One request: reserve, stream every layer, wait for the counter; returns
    (seconds from the first layer send to READY, ready_at - last layer computed, desc)."""
    from tandem.rdma import DestinationDescriptor
    d = DestinationDescriptor.from_bytes(rx("reserve", tokens, run_pages))
    t = sender.begin(d, src_pages[:len(d.page_ids)])
    spec = d.models[0]
    step = sender.step(spec.name, {t: tokens})
    t0 = time.monotonic()
    if after:   # no streaming: compute every layer, then report them all
        time.sleep(layer_s * spec.num_layers)
    for layer in range(spec.num_layers):
        if layer_s and not after:
            time.sleep(layer_s)
        step.layer_done(layer)
    while not pool.poll(d.slot, d.generation).ready:
        time.sleep(0.0002)
    t_ready = time.monotonic()
    t.wait(30)
    ready_at, _ = rx("trace", d.slot, d.generation)
    pool.free(pool.claim(d.slot, d.generation))
    last = step.computed_at[-1]
    return t_ready - t0, (ready_at or t_ready) - last, d, t



def run(args) -> int:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    paths = args.paths
    if "veth" in paths:
        from tandem.client.bench.netns import netns_problem
        problem = netns_problem()
        if problem:
            raise SystemExit(f"--paths veth: no network namespaces here: {problem}")
    results = {"throughput": [], "ops_per_page": [], "streaming": []}
    for path in paths:
        if path == "veth":
            _veth_path(args, results)
            continue
        rx = _Receiver()
        try:
            _measure_path(path, args, results, rx, {})
        finally:
            rx.close()
    _ops_per_page(args, results)
    report = _report(results, args)
    print(report)
    results["meta"] = {
        "command": command("transfer", args),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
        "shape": {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                  "dtype": args.dtype, "tokens": args.tokens},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    md = args.out.with_suffix(".md")
    meta = results["meta"]
    md.write_text(f"`{meta['command']}`\n\n{meta['date']}, {meta['cpus']} CPUs, load average "
                  f"{meta['loadavg'][0]:.2f} (a shared host: other jobs ran meanwhile)\n\n"
                  + report)
    print(f"wrote {args.out}, {md} and {plot(results, args.out)}")
    return 0


def _veth_path(args, results: dict) -> None:
    """The measurement across a fresh veth pair: this side (sender and decoder) in a
    child in namespace a, the receiver in namespace b, UCX on TCP only."""
    from tandem.client.bench.netns import VethPair
    pair = VethPair.create("tandem-bench")
    try:
        conn, proc = _child(pair.exec("a"), "_veth_child")
        conn.send((args, pair.exec("b"), pair.iface))
        for key, rows in conn.recv().items():
            results[key] += rows
        proc.wait(30)
    finally:
        pair.remove()


def _veth_child(fd: int) -> None:
    from multiprocessing.connection import Connection
    conn = Connection(fd)
    args, rx_prefix, iface = conn.recv()
    results = {"throughput": [], "streaming": []}
    rx = _Receiver(rx_prefix, dict(net_devices=iface["b"], transports="tcp"))
    try:
        _measure_path("veth", args, results, rx, dict(net_devices=iface["a"], transports="tcp"))
    finally:
        rx.close()
    conn.send(results)


def _measure_path(path: str, args, results: dict, rx: _Receiver, ucx: dict) -> None:
    """Throughput and streaming rows of one path: ``rx`` receives, this process sends
    (UCX settings ``ucx``) and plays the decoder (it polls the counters)."""
    from tandem.rdma import KVSender, ModelSpec, PoolSpec, SenderConfig, SharedKVPool, SourcePool
    page_sizes, run_pages = args.page_sizes, args.run_pages
    for ps in page_sizes:
        spec = ModelSpec("target", args.layers, args.kv_heads, args.head_dim, ps, args.dtype)
        pages = -(-args.tokens // ps)
        nbytes = spec.pool_bytes(args.kv_heads, pages)
        name = f"tandem-bench-transfer-{os.getpid()}-{ps}"
        SharedKVPool.unlink_stale(name)
        pool = SharedKVPool.create(PoolSpec(name, (spec,), pages + 8))
        src = np.frombuffer(np.random.default_rng(0).bytes(nbytes), dtype=np.uint8).copy()
        sender = KVSender({"target": SourcePool(spec, args.kv_heads, pages, src)},
                          config=SenderConfig(timeout_s=60, **ucx))
        try:
            rx("open", name)
            src_pages = list(range(pages))
            _transfer(sender, rx, pool, args.tokens, 1, src_pages)   # connect, warm up
            mc = memcpy_gbps(nbytes, args.repeats)
            for rp in run_pages:
                times = []
                for _ in range(args.repeats):
                    dt, _, d, t = _transfer(sender, rx, pool, args.tokens, rp, src_pages)
                    times.append(dt)
                best, med = min(times), statistics.median(times)
                results["throughput"].append({
                    "path": path, "page_size": ps, "run_pages": rp, "bytes": nbytes,
                    "ops": d.expected_ops, "op_bytes": nbytes // d.expected_ops,
                    "best_gbps": nbytes / best / 1e9, "median_gbps": nbytes / med / 1e9,
                    "memcpy_gbps": mc, "ratio_best": (nbytes / best / 1e9) / mc,
                    "ratio_median": (nbytes / med / 1e9) / mc})
            if ps == page_sizes[0]:
                rp = max(run_pages)
                for after in (False, True):
                    tails = [_transfer(sender, rx, pool, args.tokens, rp, src_pages,
                                       args.layer_ms / 1e3, after)[1]
                             for _ in range(max(1, args.repeats // 2))]
                    results["streaming"].append({
                        "path": path, "mode": "after last layer" if after else "layer by layer",
                        "page_size": ps, "run_pages": rp, "layer_ms": args.layer_ms,
                        "tail_ms_median": 1e3 * statistics.median(tails),
                        "tail_ms_best": 1e3 * min(tails)})
        finally:
            sender.close()
            pool.close(release=False)
            pool.unlink()


def _ops_per_page(args, results: dict) -> None:
    from tandem.rdma import ModelSpec, ShardScheme, ops_per_page
    for ps in args.page_sizes:
        for layout in ("HND", "NHD"):
            spec = ModelSpec("target", args.layers, args.kv_heads, args.head_dim, ps,
                             args.dtype, layout)
            for s, d in SHARD_PAIRS:
                results["ops_per_page"].append({
                    "page_size": ps, "layout": layout, "prefill": s, "decode": d,
                    "ops_per_page_layer": ops_per_page(spec, ShardScheme(*s), ShardScheme(*d))})


def plot(results: dict, out: Path) -> Path:
    """GB/s against operation size, next to memcpy, per page size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.8))
    paths = list(dict.fromkeys(r.get("path", "shm") for r in results["throughput"]))
    for ps in sorted({r["page_size"] for r in results["throughput"]}):
        for path in paths:
            rs = sorted((r for r in results["throughput"] if r["page_size"] == ps
                         and r.get("path", "shm") == path), key=lambda r: r["op_bytes"])
            kib = [r["op_bytes"] / 1024 for r in rs]
            ax.plot(kib, [r["median_gbps"] for r in rs], "o-" if path == "shm" else "s:",
                    label=f"UCX {path}, page {ps} (median)")
        ax.plot(kib, [r["memcpy_gbps"] for r in rs], "--", label=f"memcpy, page {ps}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per operation (KiB)"); ax.set_ylabel("GB/s"); ax.legend(fontsize=7)
    meta = results["meta"]
    report = {"date": meta["date"], "command": meta["command"],
              "machine": f"{meta.get('cpus')} CPUs, load average {meta['loadavg'][0]:.2f}"}
    return save_figure(fig, out.with_suffix(".png"), report)


def _report(results, args) -> str:
    """The result tables, as markdown."""
    paths = list(dict.fromkeys(r.get("path", "shm") for r in results["throughput"]))
    out = [f"KV transfer, {args.tokens} tokens x {args.layers} layers x {args.kv_heads} KV heads "
           f"x head dim {args.head_dim} ({args.dtype}), two processes, UCX; paths: "
           + "; ".join(f"{p} = {PATHS[p]}" for p in paths),
           "",
           "| path | page size | pages/op | ops | bytes/op | UCX GB/s best | median | memcpy GB/s "
           "| best/memcpy | median/memcpy |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["throughput"]:
        out.append(f"| {r.get('path', 'shm')} | {r['page_size']} | {r['run_pages']} | {r['ops']} "
                   f"| {r['op_bytes'] >> 10} KiB | {r['best_gbps']:.2f} | {r['median_gbps']:.2f} "
                   f"| {r['memcpy_gbps']:.2f} | {r['ratio_best']:.0%} | {r['ratio_median']:.0%} |")
    out += ["", "Operations per page and layer, all ranks together (contiguous messages):", "",
            "| page size | prefill TP (replica sets) -> decode TP (replica sets) | HND | NHD |",
            "|---:|---|---:|---:|"]
    rows = results["ops_per_page"]
    fmt = lambda s: f"{s[0]}" + (f" ({s[1]})" if s[1] > 1 else "")
    for r in rows:
        if r["layout"] != "HND":
            continue
        nhd = next(x for x in rows if x["layout"] == "NHD" and x["page_size"] == r["page_size"]
                   and x["prefill"] == r["prefill"] and x["decode"] == r["decode"])
        out.append(f"| {r['page_size']} | {fmt(r['prefill'])} -> {fmt(r['decode'])} "
                   f"| {r['ops_per_page_layer']:g} | {nhd['ops_per_page_layer']:g} |")
    out += ["", "Whole pages travel as one operation (and runs of pages coalesce); a head range "
            "of a page is one K and one V piece in HND, but 2 x page_size pieces in NHD, where "
            "heads interleave within each token (with strided writes it would be one per head).",
            "", f"Last layer computed -> counter complete ({args.layer_ms} ms compute per layer):",
            "", "| path | mode | page size | pages/op | median ms | best ms |",
            "|---|---|---:|---:|---:|---:|"]
    for r in results["streaming"]:
        out.append(f"| {r.get('path', 'shm')} | {r['mode']} | {r['page_size']} | {r['run_pages']} "
                   f"| {r['tail_ms_median']:.2f} | {r['tail_ms_best']:.2f} |")
    return "\n".join(out) + "\n"
