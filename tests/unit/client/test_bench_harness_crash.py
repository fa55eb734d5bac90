"""A benchmark's work dir is kept when a server in it crashed (the log names it), and
removed otherwise."""
from __future__ import annotations

from tandem.client.bench import harness


def test_the_work_dir_is_kept_when_a_log_shows_a_crash(capsys):
    with harness.work_dir("tandem-test-") as work:
        (work / "a").mkdir()
        (work / "a" / "triton.log").write_text("...\nFatal Python error: Segmentation fault\n")
        (work / "b.log").write_text("all well\n")
    assert work.is_dir() and "a/triton.log" in capsys.readouterr().out
    assert harness.crash_logs(work) == [work / "a" / "triton.log"]
    import shutil
    shutil.rmtree(work)


def test_supervisor_records_of_a_crash_count_too(tmp_path):
    (tmp_path / "serve.log").write_text("model 'decode' (stub pid 7) killed by SIGSEGV; restarting tritonserver\n")
    assert harness.crash_logs(tmp_path) == [tmp_path / "serve.log"]
    with harness.work_dir("tandem-test-") as work:
        (work / "x.log").write_text("model 'prefill' (stub pid 9) killed by SIGKILL; reloading the model\n")
    assert not work.exists()       # a kill by hand (tests, chaos) is not a crash
