"""A short chaos soak (``tandem bench chaos``, as a user runs it, with fewer requests):
the default path -- prefix caching, ``--spec auto``, greedy, seeded and guided requests,
shared system prompts and chats -- under transfer faults, cancellations, a killed prefill
and decode, a stopped decode, a kv_transfer rolled to a new version and a flooded KV
pool. Every completed response equals a fault-free, caching-off server's answer to the
same request; nothing hangs, every failure says why, nothing is left held."""
from __future__ import annotations

import json

import pytest

from tandem.client.cli import main

pytestmark = pytest.mark.e2e

SCHEDULE = "kill:prefill:2,stop:decode:5,roll:kv_transfer:8,flood::11,kill:decode:14"


def test_every_completed_response_equals_the_fault_free_servers(tmp_path, capsys):
    out = tmp_path / "chaos.json"
    code = main(["bench", "chaos", "--requests", "120", "--concurrency", "6", "--schedule", SCHEDULE,
                 "--flood-requests", "16", "--out", str(out)])
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert report["faults_not_run"] == [], printed
    assert {f["fault"] for f in report["faults"]} >= {"kill:prefill", "stop:decode", "roll:kv_transfer", "flood",
                                                      "kill:decode", "transfer_fail", "cancel"}
    assert all(f["ended_s"] is not None for f in report["faults"] if f["began_s"] > 0), report["faults"]
    assert report["differences"] == [] and report["reference_failed"] == [], printed
    s = report["summary"]
    assert s["hung"] == 0 and s["failed_unclear"] == 0, s["errors"]
    # descriptors: compared within one tritonserver process (None: the decode kill restarted it)
    assert report["leaked_pages"] == {} and report["shm_leaked"] == [] and report["fds_gained"] in ([], None), printed
    # the comparison covered what it claims to: each kind of request, chats served from the cache
    assert {k for k, by in report["by_kind"].items() if by.get("ok")} >= {"greedy", "seeded", "guided", "flood"}
    assert report["cached_requests"] > 0 and report["prefix_cache"]["corrupt_pages"] == 0
    assert report["prefix_cache"]["disagreeing_pages"] == 0
    assert code == (0 if report["goals_met"] else 1)   # the speed goals are the bench's, not the test's
