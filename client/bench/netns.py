"""Two network namespaces joined by a veth pair: two "hosts" on one machine, with a real
network link between them (their own addresses, routes and TCP stacks; ``ip link set
... down`` cuts it). What ``tandem bench transfer --paths veth`` and the multi-host test
run prefill and decode across. Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and
iproute2's ``ip``.

The namespaces share everything else — the filesystem, ``/dev/shm``, pids — so UCX
still sees one host: across them it would pick shared memory or CMA unless its
transports are limited to ``tcp`` (``--kv-transports tcp``).

>>> pair = VethPair.create("doc")                      # doctest: +SKIP
>>> subprocess.run(pair.exec("b", "true")).returncode  # doctest: +SKIP
0
>>> pair.remove()                                      # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
SUBNET = "10.231.0"          # each pair has its own namespaces: the addresses never collide
_count = itertools.count()


def netns_problem() -> str:
    """Why namespaces cannot be made here ("" when they can): not root, no ``ip``, or the
    kernel refuses (a container without CAP_SYS_ADMIN)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    name = f"tandem-probe-{os.getpid()}-{next(_count)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ""


@dataclass(slots=True)
class VethPair:
    """Namespaces ``ns["a"]``, ``ns["b"]``; interfaces ``iface[side]`` with ``addr[side]``
    (``SUBNET.1`` on a, ``.2`` on b, /24); ``lo`` up in both."""

    ns: dict
    iface: dict
    addr: dict

    @classmethod
    def create(cls, tag: str = "tandem") -> "VethPair":
        remove_stale(tag)
        n = f"{os.getpid()}-{next(_count)}"
        short = n.replace("-", "x")[-10:]
        pair = cls(ns={s: f"{tag}-{n}-{s}" for s in "ab"},
                   iface={s: f"tv{short}{s}" for s in "ab"},
                   addr={"a": f"{SUBNET}.1", "b": f"{SUBNET}.2"})
        try:
            for s in "ab":
                _ip("netns", "add", pair.ns[s])
            _ip("link", "add", pair.iface["a"], "type", "veth", "peer", "name", pair.iface["b"])
            for s in "ab":
                _ip("link", "set", pair.iface[s], "netns", pair.ns[s])
                _ip("-n", pair.ns[s], "addr", "add", f"{pair.addr[s]}/24", "dev", pair.iface[s])
                _ip("-n", pair.ns[s], "link", "set", "lo", "up")
                _ip("-n", pair.ns[s], "link", "set", pair.iface[s], "up")
        except BaseException:
            pair.remove()
            raise
        return pair

    def exec(self, side: str, *cmd: str) -> list[str]:
        """The command line that runs ``cmd`` in namespace ``side``."""
        return ["ip", "netns", "exec", self.ns[side], *cmd]

    def set_link(self, side: str, up: bool) -> None:
        """Bring ``side``'s end of the link up or down (the other end loses its carrier)."""
        _ip("-n", self.ns[side], "link", "set", self.iface[side], "up" if up else "down")

    def limit_rate(self, side: str, rate: str | None) -> None:
        """Shape what ``side`` sends to ``rate`` (tc's syntax, e.g. ``4mbit``); None: unshaped."""
        base = ["tc", "qdisc", "del" if rate is None else "replace", "dev", self.iface[side], "root"]
        extra = [] if rate is None else ["tbf", "rate", rate, "burst", "16kb", "latency", "1s"]
        subprocess.run(self.exec(side, *base, *extra), check=rate is not None, capture_output=True)

    def pids(self, side: str) -> set[int]:
        out = subprocess.run(["ip", "netns", "pids", self.ns[side]], capture_output=True, text=True)
        return {int(p) for p in out.stdout.split()}

    @contextlib.contextmanager
    def entered(self, side: str):
        """Run the body in namespace ``side`` (this thread only: the network namespace is
        per thread; sockets the body opens stay in it)."""
        back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            _setns(f"/run/netns/{self.ns[side]}")
            yield self
        finally:
            _setns_fd(back)
            os.close(back)

    def call(self, side: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on a fresh thread inside namespace ``side``."""
        out: dict = {}

        def run():
            try:
                with self.entered(side):
                    out["value"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                out["error"] = e
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    def remove(self, grace_s: float = 5.0) -> None:
        """Kill what still runs in the namespaces (SIGTERM, then SIGKILL), then delete
        them (which deletes the veth pair)."""
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
            left = set().union(*(self.pids(s) for s in "ab"))
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while left and time.monotonic() < deadline:
                time.sleep(0.1)
                left = set().union(*(self.pids(s) for s in "ab"))
            if not left:
                break
        for s in "ab":
            subprocess.run(["ip", "netns", "del", self.ns[s]], capture_output=True)


def remove_stale(tag: str) -> list[str]:
    """Delete the namespaces ``tag`` pairs of processes that are gone left behind (a run
    killed before its cleanup), with whatever still runs in them."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    removed = []
    for name in (line.split()[0] for line in out.splitlines() if line.strip()):
        m = re.fullmatch(rf"{re.escape(tag)}-(\d+)-\d+-[ab]", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
            for pid in pids.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    return removed


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _setns_fd(fd)
    finally:
        os.close(fd)


def _setns_fd(fd: int) -> None:
    if hasattr(os, "setns"):          # Python 3.12+
        os.setns(fd, CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")
