"""``--admin-key``: when the server is locked, the key it makes, the keys it refuses and
the flags tritonserver gets (the lock itself against a real server: e2e/test_admin_key.py)."""
from __future__ import annotations

import stat

import pytest

from tandem.client.serve.admin_key import AdminKeyError, needs_key, resolve_key, restricted_api_args
from tandem.client.serve.triton_http import TritonHTTP


@pytest.mark.parametrize("host, locked", [("127.0.0.1", False), ("::1", False), ("localhost", False),
                                          ("0.0.0.0", True), ("10.1.2.3", True), ("node-7", True)])
def test_only_loopback_binds_go_without_a_key(host, locked):
    assert needs_key(host) is locked


def test_beyond_loopback_a_key_is_made_and_kept_private(tmp_path):
    key, path = resolve_key("", "0.0.0.0", tmp_path)
    assert len(key) >= 16 and path.read_text().strip() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert resolve_key("", "127.0.0.1", tmp_path) == ("", None)
    assert resolve_key("a" * 20, "0.0.0.0", tmp_path) == ("a" * 20, None)


@pytest.mark.parametrize("key, why", [("short", "at least 16"), ("x" * 16 + ":=,", "not allowed")])
def test_keys_triton_cannot_carry_are_refused(key, why):
    with pytest.raises(AdminKeyError, match=why):
        resolve_key(key, "127.0.0.1", None)


def test_the_flags_restrict_the_control_apis_on_both_protocols():
    http, grpc = restricted_api_args("k" * 16)
    assert http.split("=", 1)[1] == grpc.split("=", 1)[1] == \
        "model-repository,shared-memory,logging,trace:admin-key=" + "k" * 16
    assert http.startswith("--http-restricted-api=") and grpc.startswith("--grpc-restricted-protocol=")
    assert restricted_api_args("") == []
    assert "k" * 16 not in repr(TritonHTTP("h:1", "k" * 16))
