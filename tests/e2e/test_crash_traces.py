"""A crash leaves a trace: a model process killed by SIGSEGV writes every thread's Python
stack to the server's log (crash_traces.py, enabled by every model's entry point), the
supervisor names the signal, and a server that owns its run dir keeps it after such a
death (the unit side, the benchmarks' kept work dirs: test_bench_harness_crash.py)."""
from __future__ import annotations

import shutil
import signal

import pytest

from tandem.client.generate import stream_generate
from tandem.client.serve.options import ServeOptions
from tandem.client.serve.triton_server import TritonServer

pytestmark = pytest.mark.e2e


def test_a_segfaulting_stub_leaves_its_stacks_and_the_run_dir(tmp_path):
    log_file = tmp_path / "tritonserver.log"
    server = TritonServer(ServeOptions.of(mode="colocated", max_num_seqs=2), log_file=log_file,
                          ready_timeout_s=180, exit_timeout_s=15)
    try:
        server.start()
        pid = server.kill_stub("preprocess", signal.SIGSEGV)
        server.wait_model_ready("tandem_colocated", timeout_s=120)
        text = "".join(r.text for r in stream_generate(server.grpc_url, "def f(x):", model="tandem_colocated",
                                                       max_tokens=4, temperature=0.0))
        assert text                                     # reloaded and serving
        log = log_file.read_text(errors="replace")
        assert "Fatal Python error: Segmentation fault" in log
        assert "most recent call first" in log          # the stacks of its threads
        (crash,) = server.crashes()
        assert f"'preprocess' (stub pid {pid}) killed by SIGSEGV" in crash
        run_dir = server.run_dir
        server.cleanup()
        assert run_dir.is_dir() and (run_dir / "model_repository").is_dir()   # kept for the post-mortem
    finally:
        server.stop()
        if server.run_dir is not None:
            shutil.rmtree(server.run_dir, ignore_errors=True)


def test_an_orderly_run_removes_its_run_dir(tmp_path):
    server = TritonServer(ServeOptions.of(mode="colocated", max_num_seqs=2), log_file=tmp_path / "t.log",
                          ready_timeout_s=180, exit_timeout_s=15)
    try:
        server.start()
        assert server.crashes() == []
        run_dir = server.run_dir
        server.cleanup()
        assert not run_dir.exists()
    finally:
        server.stop()
