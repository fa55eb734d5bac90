"""``tandem bench``'s options are checked when the command line is parsed: a bad value
ends the command with exit 2 and a message naming the option, before any model loads or
server starts; and a benchmark's temp dir goes however the run ends. No server here."""
from __future__ import annotations

import argparse
import shlex
from contextlib import ExitStack
from pathlib import Path

import pytest

from tandem.client.bench.registry import BENCHMARKS
from tandem.client.bench.harness import start_server, work_dir
from tandem.client.bench.report import command
from tandem.client.cli import build_parser, main


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser("bench")


def bench_parsers(parser) -> dict[str, argparse.ArgumentParser]:
    bench = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    return next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices


def refused(parser, capsys, argv: list[str]) -> str:
    """stderr of parsing ``tandem bench ARGV``, which must exit 2."""
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["bench", *argv])
    assert exc.value.code == 2
    return capsys.readouterr().err


BAD = [  # (argv, the message's words besides the option)
    # what the outside tester found
    (["soak", "--requests", "0"], "integer >= 1, got '0'"),
    (["soak", "--concurrency", "-1"], "integer >= 1, got '-1'"),
    (["soak", "--cancel-frac", "1.5"], "in [0, 1], got '1.5'"),
    (["load", "--concurrency", "0"], "integer >= 1, got '0'"),
    (["serving", "--rates", "-1"], "number >= 0, got '-1'"),
    (["scaling", "--decoders", "0"], "integer >= 1, got '0'"),
    (["engine", "--repeats", "0"], "integer >= 1, got '0'"),
    (["load", "--modes", "bogus"], "'bogus' is not one of colocated, disaggregated, conditional"),
    (["engine", "--batch-sizes", "0"], "integer >= 1, got '0'"),
    # and their kin in every benchmark
    (["engine", "--new-tokens", "1"], "integer >= 2, got '1'"),
    (["engine", "--threads", "0"], "integer >= 1"),
    (["spec", "--ks", "1,0"], "got '0' (in '1,0')"),
    (["spec", "--draft-vocab-sizes", "1024,x"], "integer >= 1, got 'x'"),
    (["spec", "--repeats", "0"], "integer >= 1"),
    (["transfer", "--paths", "shm,foo"], "'foo' is not one of shm, veth"),
    (["transfer", "--run-pages", "0"], "integer >= 1"),
    (["transfer", "--layer-ms", "-1"], "number >= 0"),
    (["transfer", "--kv-heads", "2"], "must be a multiple of 8"),
    (["serving", "--rates", "0.1,nan"], "number >= 0, got 'nan'"),
    (["serving", "--duration", "0"], "number > 0, got '0'"),
    (["serving", "--long-tokens", "2048,1024"], "LO must not exceed HI"),
    (["serving", "--long-tokens", "1024"], "LO,HI"),
    (["serving", "--modes", "colocated,colocated"], "listed twice"),
    (["serving", "--cores", "0"], "integer in [1,"),
    (["scaling", "--prefill-cpus", "100000"], "CPU 100000 is not one this process may run on"),
    (["scaling", "--duration", "inf"], "number > 0, got 'inf'"),
    (["load", "--modes", ""], "at least one value"),
    (["load", "--repeats", "0"], "integer >= 1"),
    (["load", "--threads", "-1"], "integer >= 0"),
    (["spec-serving", "--methods", "none,bogus"], "'bogus' is not one of none, draft_target, mtp, ngram"),
    (["spec-serving", "--methods", "mtp"], "must include none"),
    (["spec-serving", "--concurrency", "0"], "integer >= 1"),
    (["profile", "--k", "0"], "integer >= 1"),
    (["compile", "--steps", "0"], "integer >= 1"),
    (["soak", "--fault-frac", "-0.1"], "in [0, 1]"),
    (["soak", "--fault-point", "nowhere"], "invalid choice: 'nowhere'"),
    (["soak", "--kill", "prefill"], "must be MODEL:SECONDS"),
    (["soak", "--kill", "prefill:soon"], "the seconds must be a number >= 0"),
    (["soak", "--deadline-s", "0"], "number > 0"),
    (["soak", "--backoff-s", "-1"], "number >= 0"),
    (["genai-perf", "--targets", "triton,grpc"], "'grpc' is not one of triton, completions, chat"),
    (["genai-perf", "--measurement-interval", "0"], "integer >= 1"),
]


@pytest.mark.parametrize("argv,words", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_value_exits_2_naming_the_option(parser, capsys, argv, words):
    err = refused(parser, capsys, argv)
    assert f"tandem bench {argv[0]}: error: argument {argv[1]}: " in err
    assert words in err
    assert "Traceback" not in err


def test_the_benchmark_does_not_run(monkeypatch, capsys):
    """Through ``tandem``'s entry point: argparse exits before the benchmark's ``run``."""
    from tandem.client.bench import soak as bench_soak

    def run(args):
        raise AssertionError("the soak ran with --requests 0")
    monkeypatch.setattr(bench_soak, "run", run)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "soak", "--requests", "0"])
    assert exc.value.code == 2
    assert "argument --requests" in capsys.readouterr().err


GOOD = [
    (["soak", "--cancel-frac", "0", "--fault-frac", "1", "--kill", ""], dict(cancel_frac=0.0, fault_frac=1.0)),
    (["serving", "--rates", "0, 0.5", "--long-tokens", "8,8"], dict(rates=[0.0, 0.5], long_tokens=[8, 8])),
    (["load", "--modes", "conditional,colocated", "--threads", "0"],
     dict(modes=["conditional", "colocated"], threads=0)),
    (["spec", "--draft-vocab-sizes", ""], dict(draft_vocab_sizes=[])),
    (["scaling", "--decode-cpus", ""], dict(decode_cpus=[])),
    (["transfer", "--paths", "shm,veth"], dict(paths=["shm", "veth"])),
]


@pytest.mark.parametrize("argv,want", GOOD, ids=[" ".join(a) for a, _ in GOOD])
def test_values_at_the_bounds_are_accepted(parser, argv, want):
    args = parser.parse_args(["bench", *argv])
    assert {k: getattr(args, k) for k in want} == want


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_the_reported_command_reproduces_the_run(parser, name):
    """Lists print as written (``1,8``), flags only when set, empty values quoted."""
    args = parser.parse_args(["bench", name])
    line = command(name, args)
    again = parser.parse_args(shlex.split(line)[1:])
    assert {k: v for k, v in vars(again).items() if k != "func"} == \
           {k: v for k, v in vars(args).items() if k != "func"}


UNCHECKED = {"--seed"}   # any integer seeds


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_every_numeric_or_list_option_is_checked(parser, name):
    """A new option with a bare int/float type, or a comma list parsed in ``run``, fails here."""
    for action in bench_parsers(parser)[name]._actions:
        option = max(action.option_strings, key=len, default="")
        if option in UNCHECKED or action.choices is not None:
            continue
        assert action.type not in (int, float), f"{name} {option}: a bare {action.type.__name__}"
        if isinstance(action.default, str) and "," in action.default:
            assert action.type is not None, f"{name} {option}: a comma list parsed after the command line"


# -- the temp dir -------------------------------------------------------------------------

@pytest.mark.parametrize("raised", [None, RuntimeError, KeyboardInterrupt])
def test_the_work_dir_goes_however_the_run_ends(tmp_path, monkeypatch, raised):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)   # read TMPDIR again
    seen = []
    with pytest.raises(raised) if raised else ExitStack():
        with work_dir("tandem-bench-test-") as work:
            seen.append(work)
            (work / "run" / "model_repository").mkdir(parents=True)
            (work / "server.log").write_text("log")
            if raised:
                raise raised
    assert seen[0].parent == tmp_path and not seen[0].exists()
    assert list(tmp_path.iterdir()) == []


def test_keep_work_keeps_it(tmp_path, capsys):
    with work_dir("tandem-bench-test-", keep=True) as work:
        (work / "server.log").write_text("log")
    try:
        assert (work / "server.log").read_text() == "log"
        assert str(work) in capsys.readouterr().out
    finally:
        import shutil
        shutil.rmtree(work)


class FakeServer:
    """Stands in for TritonServer: records when it is stopped and whether the work dir
    was still there."""

    def __init__(self, work: Path, fail_start: type[BaseException] | None = None):
        self.work, self.fail_start, self.stops = work, fail_start, []

    def start(self):
        if self.fail_start:
            raise self.fail_start
        return self

    def stop(self):
        self.stops.append(self.work.exists())


@pytest.fixture
def fake_servers(monkeypatch):
    """``TritonServer`` replaced by :class:`FakeServer`s (each given ``fail_start`` in
    turn from the list the fixture returns); the servers made, in order."""
    from tandem.client.serve import triton_server
    made, failures = [], []

    def fake(options, run_dir, **kwargs):
        made.append(FakeServer(run_dir, fail_start=failures.pop(0) if failures else None))
        return made[-1]
    monkeypatch.setattr(triton_server, "TritonServer", fake)
    return made, failures


def test_servers_stop_before_the_work_dir_goes_on_ctrl_c(fake_servers):
    made, _ = fake_servers
    with pytest.raises(KeyboardInterrupt):
        with work_dir("tandem-bench-test-") as work, ExitStack() as stack:
            (work / "run").mkdir()
            start_server(stack, None, work / "run")
            raise KeyboardInterrupt
    assert made[0].stops == [True]      # stopped once, while its run dir still existed
    assert not work.exists()


def test_a_start_interrupted_still_stops_the_server(fake_servers):
    """Ctrl-C while the models load: ``stop`` runs (it kills what ``start`` launched)."""
    made, failures = fake_servers
    failures.append(KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        with work_dir("tandem-bench-test-") as work, ExitStack() as stack:
            (work / "run" / "try0").mkdir(parents=True)
            start_server(stack, None, work / "run", attempts=2)   # no retry after Ctrl-C
    assert len(made) == 1 and made[0].stops == [True]
    assert not work.exists()


def test_a_failed_start_is_tried_again_in_a_run_dir_of_its_own(fake_servers, tmp_path):
    from tandem.client.serve.options import ServerError
    made, failures = fake_servers
    failures.append(ServerError("tritonserver exited while loading"))
    with ExitStack() as stack:
        server = start_server(stack, None, tmp_path, attempts=2)
        assert server is made[1]
    assert [m.work for m in made] == [tmp_path / "try0", tmp_path / "try1"]
    assert [len(m.stops) for m in made] == [1, 1]   # both stopped with the stack
