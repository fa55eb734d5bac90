"""Rolling model versions with Triton's repository API (`--model-control-mode explicit`):
a new version of `decode` and a reload of `kv_transfer` while the server keeps serving;
the shared decode pool outlives the version that unloads, and the stream after the
roll is the same text. When the module is done with the server, its fixture stops it
and checks that no process or pool is left."""
from __future__ import annotations

import os
import shutil

import pytest

from tandem.client.generate import stream_generate
from tandem.client.serve.triton_server import stub_processes

from .triton_calls import load_model, version_ready

pytestmark = pytest.mark.e2e
SETTINGS = dict(max_num_seqs=8, page_size=4, max_num_batched_tokens=8, torch_threads=1)


@pytest.fixture(scope="module")
def server(serve):
    with serve("serve-explicit", 300, model_control_mode="explicit", **SETTINGS) as srv:
        yield srv
        stop_leaves_no_process_or_pool(srv)


def stop_leaves_no_process_or_pool(server):
    """The teardown check of ``server``, after every test of the module that used it."""
    pid = server.process.pid
    server.stop()
    assert stub_processes(server.run_dir) == []
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"tandem-kv-{pid}-")]


def _text(server) -> str:
    rs = list(stream_generate(server.grpc_url, "def fibonacci(n):\n    ", model="tandem",
                              timeout_s=60, max_tokens=10, temperature=0.0, stream=True))
    return "".join(r.text for r in rs)


def test_a_new_decode_version_and_a_kv_transfer_reload_keep_serving(server):
    before = _text(server)
    repo = server.run_dir / "model_repository"
    shutil.copytree(repo / "decode" / "1", repo / "decode" / "2")
    assert load_model(server, "decode", 300) == 200
    assert version_ready(server, "decode", 2) and not version_ready(server, "decode", 1)
    assert _text(server) == before
    assert load_model(server, "kv_transfer", 300) == 200   # reload in place
    assert _text(server) == before
    pid = server.process.pid
    assert [f for f in os.listdir("/dev/shm") if f.startswith(f"tandem-kv-{pid}-")]
