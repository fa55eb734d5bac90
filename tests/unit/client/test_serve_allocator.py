"""``tandem serve --malloc``: which library is preloaded, and the errors when a host lacks it."""
from __future__ import annotations

import pytest

from tandem.client.serve.allocator import AllocatorNotFound, find_allocator, preload_env
from tandem.client.serve.options import ServerError
from tandem.client.serve.triton_server import TritonServer


def test_the_first_library_found_is_preloaded_before_the_callers(tmp_path):
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    lib = find_allocator("tcmalloc", [tmp_path])
    assert lib == str(tmp_path / "libtcmalloc_minimal.so.4")
    assert preload_env({"LD_PRELOAD": "/other.so"}, lib)["LD_PRELOAD"] == f"{lib}:/other.so"
    assert find_allocator("system", [tmp_path]) is None


def test_a_missing_allocator_names_its_package(tmp_path):
    with pytest.raises(AllocatorNotFound, match="apt-get install libjemalloc2"):
        find_allocator("jemalloc", [tmp_path])
    with pytest.raises(AllocatorNotFound, match="allowed: system, jemalloc, tcmalloc"):
        find_allocator("mimalloc", [tmp_path])


def test_the_server_refuses_to_start_without_it(tmp_path, monkeypatch):
    monkeypatch.setattr("tandem.client.serve.allocator._lib_dirs", lambda: [tmp_path])
    server = TritonServer(run_dir=tmp_path / "run", malloc="jemalloc")
    with pytest.raises(ServerError, match="--malloc jemalloc"):
        server.start()
