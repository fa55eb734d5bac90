"""Rolling model versions with Triton's repository API (`--model-control-mode explicit`):
a new version of `decode` and a reload of `kv_transfer` while the server keeps serving;
the shared decode pool outlives the version that unloads, and the stream after the
roll is the same text."""
from __future__ import annotations

import os
import shutil
import urllib.error
import urllib.request

import pytest

from tandem.client.generate import stream_generate
from tandem.client.serve.options import ServeOptions
from tandem.client.serve.triton_server import TritonServer, stub_processes

pytestmark = pytest.mark.e2e
SETTINGS = dict(max_num_seqs=8, page_size=4, max_num_batched_tokens=8, torch_threads=1)


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_checkpoint):
    run_dir = tmp_path_factory.mktemp("serve-explicit")
    srv = TritonServer(ServeOptions.of(model_dir=str(demo_checkpoint), **SETTINGS), run_dir=run_dir,
                       log_file=run_dir / "tritonserver.log", ready_timeout_s=300, exit_timeout_s=30,
                       model_control_mode="explicit")
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def _post(server, path: str) -> int:
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=b"{}", method="POST")
    try:
        return urllib.request.urlopen(req, timeout=300).status
    except urllib.error.HTTPError as e:
        return e.code


def _ready(server, model: str, version: int) -> bool:
    try:
        url = f"http://{server.http_url}/v2/models/{model}/versions/{version}/ready"
        return urllib.request.urlopen(url, timeout=10).status == 200
    except urllib.error.URLError:
        return False


def _text(server) -> str:
    rs = list(stream_generate(server.grpc_url, "def fibonacci(n):\n    ", model="tandem",
                              timeout_s=60, max_tokens=10, temperature=0.0, stream=True))
    return "".join(r.text for r in rs)


def test_a_new_decode_version_and_a_kv_transfer_reload_keep_serving(server):
    before = _text(server)
    repo = server.run_dir / "model_repository"
    shutil.copytree(repo / "decode" / "1", repo / "decode" / "2")
    assert _post(server, "/v2/repository/models/decode/load") == 200
    assert _ready(server, "decode", 2) and not _ready(server, "decode", 1)
    assert _text(server) == before
    assert _post(server, "/v2/repository/models/kv_transfer/load") == 200   # reload in place
    assert _text(server) == before
    pid = server.process.pid
    assert [f for f in os.listdir("/dev/shm") if f.startswith(f"tandem-kv-{pid}-")]


def test_zz_stop_leaves_no_process_or_pool(server):
    pid = server.process.pid
    server.stop()
    assert stub_processes(server.run_dir) == []
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"tandem-kv-{pid}-")]
