"""Prefill and decode on two "hosts": network namespaces joined by a veth pair, each with
its own address, routes and TCP stack (client/bench/netns.py). A prefill server (``--mode
prefill``) runs in one, a decode server in the other (``--prefill-endpoints`` at the
prefill namespace's address), both started by the containers' entrypoint
(docker/entrypoint.sh) with their settings in the environment. The job travels over
gRPC and the KV over UCX across the link, with UCX held to TCP on the veth interfaces
(``--kv-interface``, ``--kv-transports tcp``): the namespaces share /dev/shm, and UCX
would otherwise pick shared memory or CMA between them.

Checked: the transports UCX chose for every endpoint (its own log) and the TCP
connections between the two addresses (``ss``); greedy text over the link equals the
single-host engine's; the link cut mid-transfer fails the transfer at its timeout, decode
then prefills the prompt itself and answers with the single-host text (the ``recompute``
policy), and every page comes back (once the receives still posted are given up); with
the link up again the same processes serve on.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.client.bench.netns import VethPair, netns_problem

from .triton_calls import eventually, metric_in
from .triton_calls import http_get as _get, post as _post   # noqa: F401 - test_images.py takes them from here

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
HTTP, GRPC, METRICS = 8000, 8001, 8002      # fresh namespaces: every port is free
PAGE_SIZE, BATCHED = 16, 64
TRANSFER_TIMEOUT_S = 10                     # kv_transfer_timeout_s (backends/triton/settings.py)
# a failed reservation's receives still in flight are given up this much later, and only
# then are its pages freed (ReceiverConfig.drain_timeout_s, rdma/receiver.py)
RECEIVE_DRAIN_S = 10
PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\nclass Path:"]
LONG = "# " + "the quick brown fox jumps over the lazy dog " * 40    # ~900 tokens
SHAPED_RATE = "1mbit"                       # the KV of LONG takes seconds over the link
SHM_TRANSPORTS = ("posix", "sysv", "cma", "xpmem", "knem", "self", "cuda_ipc")


@pytest.fixture(scope="module")
def link():
    problem = netns_problem()
    if problem:
        pytest.skip(f"no network namespaces here: {problem}")
    pair = VethPair.create("tandem-mh")
    try:
        yield pair
    finally:
        pair.remove()


def _serve(pair: VethPair, side: str, run_dir: Path, **settings) -> subprocess.Popen:
    """Start ``tandem serve`` in namespace ``side`` through the entrypoint, every setting
    as ``TANDEM_<OPTION>``; UCX logs (info: the transports of each endpoint) per process."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(UCX_LOG_LEVEL="info", UCX_LOG_FILE=str(run_dir / "ucx.%p.log"),
               UCX_WARN_UNUSED_ENV_VARS="n")
    settings = dict(host=pair.addr[side], http_port=HTTP, grpc_port=GRPC, metrics_port=METRICS,
                    openai_port=0, threads=1, dtype="float32", enforce_eager=1, page_size=PAGE_SIZE, max_num_batched_tokens=BATCHED,
                    kv_interface=pair.iface[side], kv_transports="tcp", run_dir=run_dir,
                    log_file=run_dir / "tritonserver.log") | settings
    env.update({f"TANDEM_{k.upper()}": str(v) for k, v in settings.items()})
    out = open(run_dir / "serve.out", "ab")
    return subprocess.Popen(pair.exec(side, str(ENTRYPOINT)), env=env, cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)


class Server:
    def __init__(self, pair: VethPair, side: str, run_dir: Path, proc: subprocess.Popen):
        self.pair, self.side, self.run_dir, self.proc = pair, side, run_dir, proc
        self.url = f"http://{pair.addr[side]}:{HTTP}"

    def wait_ready(self, timeout_s: float = 400) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"tandem serve in {self.side} exited ({self.proc.returncode}):\n"
                                     f"{self.log_tail()}")
            if self.pair.call(self.side, _get, f"{self.url}/v2/health/ready", 2)[0] == 200:
                return
            time.sleep(1)
        raise AssertionError(f"not ready within {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return "".join((self.run_dir / f).read_text(errors="replace")[-3000:]
                       for f in ("serve.out", "tritonserver.log") if (self.run_dir / f).exists())

    def metric(self, name: str, model: str, **labels) -> float:
        """Summed over incarnations (see tests/e2e/triton_calls.py)."""
        status, text = self.pair.call(self.side, _get, f"http://{self.pair.addr[self.side]}:{METRICS}/metrics")
        assert status == 200, text
        return metric_in(text, name, model, **labels)

    def generate(self, prompt: str, max_tokens: int = 10, timeout: float = 120) -> tuple[int, dict]:
        body = {"text_input": prompt, "max_tokens": max_tokens, "temperature": 0}
        status, text = self.pair.call(self.side, _post, f"{self.url}/v2/models/tandem/generate",
                                      body, timeout)
        return status, json.loads(text) if text.startswith("{") else {"error": text}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def servers(link, demo_checkpoint, tmp_path_factory):
    """(prefill server in namespace a, decode server in namespace b, their pids at start)."""
    assert ENTRYPOINT.is_file(), f"{ENTRYPOINT} is missing: the servers start through it"
    started = []
    try:
        prefill = Server(link, "a", d := tmp_path_factory.mktemp("prefill-ns"),
                         _serve(link, "a", d, mode="prefill", model=demo_checkpoint))
        started.append(prefill)
        decode = Server(link, "b", d := tmp_path_factory.mktemp("decode-ns"),
                        _serve(link, "b", d, mode="disaggregated", model=demo_checkpoint,
                               prefill_endpoints=f"{link.addr['a']}:{GRPC}", disagg_policy="remote"))
        started.append(decode)
        for srv in started:
            srv.wait_ready()
        yield prefill, decode, {s: link.pids(s) for s in "ab"}
    finally:
        for srv in reversed(started):
            srv.stop()


@pytest.fixture(scope="module")
def reference(greedy_reference):
    """Greedy text of the engine on one host, in this process."""
    greedy = greedy_reference(10, page_size=PAGE_SIZE, max_num_batched_tokens=BATCHED)
    return {p: greedy(p).text for p in (*PROMPTS, LONG)}


def test_greedy_text_over_the_link_equals_single_host(servers, link, reference):
    _, decode, _ = servers
    for p in PROMPTS:
        status, out = decode.generate(p)
        assert status == 200, out
        assert out["text_output"] == p + reference[p]     # generate echoes the prompt

    def counted():
        assert decode.metric("tandem_kv_received_bytes_total", "kv_transfer") > 0
        assert decode.metric("tandem_disagg_requests_total", "kv_transfer", path="remote") >= len(PROMPTS)
    eventually(counted)
    # UCX's connections (not gRPC's, which has the prefill server's port on one end) join
    # the two addresses; the Python stubs (prefill, kv_transfer) opened them
    for side in "ab":
        ucx = [c for c in _tcp_between(link, side) if GRPC not in c[:2]]
        assert ucx and all(proc.startswith("triton_python") for _, _, proc in ucx), ucx


def _ucx_lanes(run_dir: Path) -> list[str]:
    """Every transport/device UCX chose for an endpoint configuration, from its info log
    (``... ucp_worker.c ... inter-node cfg#0 tag(tcp/eth0) ...``)."""
    lanes = []
    for log in run_dir.glob("ucx.*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if "cfg#" in line:
                for group in re.findall(r"\w+\(([^)]*)\)", line.split("cfg#", 1)[1]):
                    lanes += group.split()
    return lanes


def _tcp_between(pair: VethPair, side: str) -> list[tuple[int, int, str]]:
    """(local port, peer port, process) of the established TCP connections from this
    side's address to the other side's."""
    other = "b" if side == "a" else "a"
    out = subprocess.run(pair.exec(side, "ss", "-tnpH", "state", "established"),
                         capture_output=True, text=True, check=True).stdout
    conns = []
    for line in out.splitlines():
        m = re.search(rf"{re.escape(pair.addr[side])}:(\d+)\s+{re.escape(pair.addr[other])}:(\d+)"
                      r"(?:.*users:\(\(\"([^\"]+)\")?", line)
        if m:
            conns.append((int(m.group(1)), int(m.group(2)), m.group(3) or ""))
    return conns


def test_link_down_mid_transfer_is_recomputed_by_decode_and_returns_pages(servers, link, demo_checkpoint,
                                                                          reference):
    prefill, decode, _ = servers
    from tokenizers import Tokenizer
    n_tokens = len(Tokenizer.from_file(str(demo_checkpoint / "tokenizer.json")).encode(LONG).ids)
    cfg = json.loads((demo_checkpoint / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_bytes = (n_tokens - 1) * cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 4

    def pages():
        return {s: decode.metric("tandem_kv_pages", "kv_transfer", state=s)
                for s in ("free", "reserved", "in_use")}

    # the gauge is refreshed by a poll: an earlier test's last pages may still read as in
    # use here, so the baseline is the pool's size, not the free count of the moment
    num_pages = sum(pages().values())
    got0 = decode.metric("tandem_kv_received_bytes_total", "kv_transfer")
    failed0 = decode.metric("tandem_kv_transfer_failures_total", "decode")
    recomputed0 = decode.metric("tandem_kv_transfer_recomputed_total", "decode")
    link.limit_rate("a", SHAPED_RATE)          # prefill -> decode: the KV takes seconds
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        request = pool.submit(decode.generate, LONG, 10, 120)
        deadline = time.monotonic() + 60
        while decode.metric("tandem_kv_received_bytes_total", "kv_transfer") == got0:
            assert not request.done(), request.result()
            assert time.monotonic() < deadline, "no KV arrived"
            time.sleep(0.1)
        link.set_link("a", False)              # cut mid-transfer
        down_at = time.monotonic()
        status, out = request.result(timeout=90)
        failed_after = time.monotonic() - down_at
    finally:
        link.limit_rate("a", None)
        link.set_link("a", True)
        pool.shutdown()
    got = decode.metric("tandem_kv_received_bytes_total", "kv_transfer") - got0
    print(f"link down after {got} of {kv_bytes} KV bytes; the request, prefilled again by decode, "
          f"ended {failed_after:.1f} s later: {status}")
    assert status == 200, out
    assert out["text_output"] == LONG + reference[LONG]   # the transfer's failure cost time, not the answer
    assert 0 < got < kv_bytes                   # it was cut mid-transfer
    # every page comes back: the failed reservation's, nothing reserved or in use

    def pages_back():
        now = pages()
        assert now == {"free": num_pages, "reserved": 0, "in_use": 0}, \
            f"pages never came back: {now} of {num_pages}"
    eventually(pages_back, timeout_s=RECEIVE_DRAIN_S + 20)
    assert decode.metric("tandem_kv_transfer_failures_total", "decode") == failed0 + 1
    assert decode.metric("tandem_kv_transfer_recomputed_total", "decode") == recomputed0 + 1
    # and the prefill server gave its side up (and with it its own pages): when UCX's
    # keepalive reports the decode worker lost, or after kv_transfer_timeout_s + 5 s
    # without progress
    deadline = time.monotonic() + 30
    while "[prefill] KV transfer failed" not in (prefill.run_dir / "tritonserver.log").read_text():
        assert time.monotonic() < deadline, "the prefill server never gave the transfer up"
        time.sleep(0.5)


def test_serving_resumes_after_the_link_is_back_without_restarts(servers, link, reference):
    prefill, decode, pids = servers
    link.set_link("a", True)
    started, errors = time.monotonic(), []
    while True:   # TCP retransmits what the cut link held back, then the next request goes through
        status, out = decode.generate(PROMPTS[0])
        if status == 200:
            break
        errors.append(out.get("error"))
        assert time.monotonic() - started < 60, errors
    print(f"served again {time.monotonic() - started:.1f} s after the link came up "
          f"({len(errors)} failed first: {errors})")
    assert out["text_output"] == PROMPTS[0] + reference[PROMPTS[0]]
    status, out = decode.generate(PROMPTS[1])
    assert status == 200 and out["text_output"] == PROMPTS[1] + reference[PROMPTS[1]], out
    # the long prompt again: many pages, the cut transfer's among them (freed while its
    # receives were still posted; nothing of it may land in them now)
    status, out = decode.generate(LONG)
    assert status == 200 and out["text_output"] == LONG + reference[LONG], out
    assert prefill.proc.poll() is None and decode.proc.poll() is None
    assert {s: link.pids(s) for s in "ab"} == pids     # no process restarted or reloaded


def test_ucx_chose_tcp_on_the_veth_for_every_endpoint(servers, link):
    """Over the whole run (the link cut and restored included): from UCX's own log,
    read once the servers stopped (UCX writes its log file buffered)."""
    for srv in servers[:2]:
        srv.stop()
    for srv in servers[:2]:
        lanes = _ucx_lanes(srv.run_dir)
        assert lanes, f"no UCX endpoint configuration logged in {srv.run_dir}"
        assert not [x for x in lanes if x.split("/")[0] in SHM_TRANSPORTS], lanes
        assert set(lanes) == {f"tcp/{link.iface[srv.side]}"}, lanes
