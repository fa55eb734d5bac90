"""``tandem serve`` refuses a setting tritonserver or the engine would refuse only after
starting (or would ignore) as its options are parsed: exit status 2, nothing launched, a
message naming the option (and TANDEM_<OPTION> when the value came from there). A
TANDEM_* variable that is no option's is a warning naming the closest option."""
from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import pytest

from tandem.client.serve import cli as serve
from tandem.client.cli import build_parser, main
from tandem.client.serve.env_defaults import OTHER_VARIABLES, env_var, unknown_variables

ROOT = Path(__file__).resolve().parents[3]


def serve_parser(environ: dict[str, str]) -> argparse.ArgumentParser:
    """``tandem serve``'s parser, reading TANDEM_* from ``environ``."""
    top = build_parser("serve")
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    sub.environ = environ
    return sub


def refused(argv: list[str], capsys, environ: dict[str, str] | None = None) -> str:
    """The error ``tandem serve argv`` ends with as it parses (exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        serve_parser(environ or {}).parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    return err.splitlines()[-1].removeprefix("tandem serve: error: ")


def accepted(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    return serve_parser(environ or {}).parse_args(argv)


@pytest.fixture
def draft(tmp_path) -> Path:
    """A proposer checkpoint directory with a vocabulary of 100 tokens."""
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps({"vocab_size": 100}))
    return tmp_path / "draft"


# ---- nothing starts ---------------------------------------------------------------------
def test_a_refused_setting_launches_nothing(monkeypatch, capsys):
    for var in [v for v in os.environ if v.startswith("TANDEM_")]:
        monkeypatch.delenv(var)

    def launch(*_a, **_k):
        raise AssertionError("tritonserver was set up for a refused setting")
    monkeypatch.setattr(serve, "TritonServer", launch)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--http-port", "70000"])
    assert exc.value.code == 2
    assert "--http-port 70000: allowed: 1..65535" in capsys.readouterr().err


# ---- ports ------------------------------------------------------------------------------
@pytest.mark.parametrize("option", serve.TRITON_PORTS)
@pytest.mark.parametrize("port", [0, -5, 65536, 70000])
def test_a_triton_port_is_1_to_65535(option, port, capsys):
    assert refused([option, str(port)], capsys) == f"{option} {port}: allowed: 1..65535"


@pytest.mark.parametrize("option", serve.TRITON_PORTS)
def test_the_port_bounds_are_accepted(option):
    assert getattr(accepted([option, "65535"]), option[2:].replace("-", "_")) == 65535
    assert getattr(accepted([option, "1"]), option[2:].replace("-", "_")) == 1


@pytest.mark.parametrize("port", [-1, 65536])
def test_the_openai_port_is_0_to_65535(port, capsys):
    assert refused(["--openai-port", str(port)], capsys) == f"--openai-port {port}: allowed: 1..65535, or 0 (off)"


def test_openai_port_0_is_off():
    assert accepted(["--openai-port", "0"]).openai_port == 0


def test_a_port_from_the_environment_names_the_variable(capsys):
    assert refused([], capsys, {"TANDEM_HTTP_PORT": "70000"}) == \
        "TANDEM_HTTP_PORT='70000' (the default of --http-port): allowed: 1..65535"
    # the command line wins, and is what the message names
    assert refused(["--http-port", "-5"], capsys, {"TANDEM_HTTP_PORT": "8000"}) == "--http-port -5: allowed: 1..65535"


@pytest.mark.parametrize("argv,error", [
    (["--http-port", "8001"], "--http-port 8001 and --grpc-port 8001: the same port"),
    (["--grpc-port", "8000"], "--http-port 8000 and --grpc-port 8000: the same port"),
    (["--metrics-port", "8000"], "--http-port 8000 and --metrics-port 8000: the same port"),
    (["--openai-port", "8002"], "--metrics-port 8002 and --openai-port 8002: the same port"),
])
def test_two_servers_on_one_port_are_refused_naming_both(argv, error, capsys):
    assert refused(argv, capsys).startswith(error)


def test_the_same_port_from_the_environment_names_the_variable(capsys):
    assert refused([], capsys, {"TANDEM_GRPC_PORT": "8000"}).startswith(
        "--http-port 8000 and TANDEM_GRPC_PORT='8000' (the default of --grpc-port): the same port")


def test_an_openai_port_that_is_off_or_not_served_takes_no_port():
    # --mode prefill serves no text ensemble: no OpenAI API, its port is free for Triton
    assert accepted(["--mode", "prefill", "--openai-port", "8000"]).openai_port == 8000
    assert accepted(["--openai-port", "0", "--http-port", "9000"]).http_port == 9000


# ---- speculation ------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, -1, 17, 100])
def test_k_outside_the_engines_bounds_is_refused(k, capsys):
    assert refused(["--spec", "ngram", "--k", str(k)], capsys) == f"--k {k}: allowed: 1..16"


@pytest.mark.parametrize("k", [1, 16])
def test_k_within_the_engines_bounds_is_accepted(k):
    assert accepted(["--spec", "ngram", "--k", str(k)]).num_speculative_tokens == k


def test_k_from_the_environment_names_the_variable(capsys):
    assert refused([], capsys, {"TANDEM_SPEC": "ngram", "TANDEM_K": "17"}) == \
        "TANDEM_K='17' (the default of --k): allowed: 1..16"


@pytest.mark.parametrize("make,found", [
    (lambda tmp: tmp / "nope", "not a directory"),
    (lambda tmp: tmp, "no config.json in it"),
    (lambda tmp: (tmp / "file").write_text("x") and tmp / "file", "not a directory"),
])
def test_draft_target_needs_a_draft_checkpoint(make, found, tmp_path, capsys):
    path = make(tmp_path)
    assert refused(["--spec", "draft_target", "--draft-model", str(path)], capsys) == (
        f"--draft-model {str(path)!r}: {found}; allowed: a checkpoint directory (config.json, model.safetensors)")


def test_a_draft_checkpoint_from_the_environment_names_the_variable(tmp_path, capsys):
    env = {"TANDEM_SPEC": "draft_target", "TANDEM_DRAFT_MODEL": str(tmp_path / "nope")}
    assert refused([], capsys, env).startswith(
        f"TANDEM_DRAFT_MODEL={str(tmp_path / 'nope')!r} (the default of --draft-model): not a directory")


def test_mtp_needs_an_mtp_head_checkpoint(tmp_path, capsys):
    assert refused(["--spec", "mtp", "--mtp-head", str(tmp_path)], capsys).startswith(
        f"--mtp-head {str(tmp_path)!r}: no config.json in it")


def test_a_proposer_checkpoint_is_accepted(draft):
    assert accepted(["--spec", "draft_target", "--draft-model", str(draft)]).draft_model == str(draft)
    assert accepted(["--spec", "mtp", "--mtp-head", str(draft)]).mtp_head == str(draft)


@pytest.mark.parametrize("spec,option", [("draft_target", "--draft-model"), ("mtp", "--mtp-head")])
def test_draft_vocab_size_is_at_most_the_vocabulary(spec, option, draft, capsys):
    argv = ["--spec", spec, option, str(draft)]
    assert refused([*argv, "--draft-vocab-size", "101"], capsys) == (
        f"--draft-vocab-size 101: more than the model's vocabulary (100 tokens, {draft / 'config.json'}); "
        "allowed: 1..100, or 0 (all)")
    assert accepted([*argv, "--draft-vocab-size", "100"]).draft_vocab_size == 100


def test_draft_vocab_size_from_the_environment_names_the_variable(draft, capsys):
    env = {"TANDEM_SPEC": "draft_target", "TANDEM_DRAFT_MODEL": str(draft), "TANDEM_DRAFT_VOCAB_SIZE": "4096"}
    assert refused([], capsys, env).startswith(
        "TANDEM_DRAFT_VOCAB_SIZE='4096' (the default of --draft-vocab-size): more than the model's vocabulary")


@pytest.mark.parametrize("faults,error", [
    ("bogus", "bogus: expected name=value"),
    ("transfer_fail=2", "transfer_fail=2: the fraction must be in 0..1"),
    ("transfer_fail=0.1@nowhere", "the point must be one of"),
    ("nothing=1", "unknown fault"),
])
def test_faults_that_do_not_parse_are_refused(faults, error, capsys):
    message = refused(["--faults", faults], capsys)
    assert message.startswith(f"--faults {faults!r}: ") and error in message


def test_faults_from_the_environment_name_the_variable(capsys):
    assert refused([], capsys, {"TANDEM_FAULTS": "seed=x"}).startswith(
        "TANDEM_FAULTS='seed=x' (the default of --faults): seed=x")


def test_faults_that_parse_are_accepted():
    assert accepted(["--faults", "transfer_fail=0.05@mid_layers,seed=1"]).faults == "transfer_fail=0.05@mid_layers,seed=1"


# ---- options that would do nothing --------------------------------------------------------
@pytest.mark.parametrize("argv,error", [
    (["--k", "4"], "--k 4: needs --spec draft_target, mtp, ngram or auto; with --spec none it does nothing"),
    (["--draft-model", "d"], "--draft-model 'd': needs --spec draft_target or auto; with --spec none it does nothing"),
    (["--spec", "mtp", "--draft-model", "d"], "--draft-model 'd': needs --spec draft_target or auto; with --spec mtp"),
    (["--spec", "ngram", "--draft-model", "d"], "--draft-model 'd': needs --spec draft_target or auto; with --spec ngram"),
    (["--spec", "draft_target", "--mtp-head", "h"], "--mtp-head 'h': needs --spec mtp or auto; with --spec draft_target"),
    (["--draft-vocab-size", "8"], "--draft-vocab-size 8: needs --spec draft_target, mtp or auto; with --spec none"),
    (["--spec", "ngram", "--draft-vocab-size", "8"], "--draft-vocab-size 8: needs --spec draft_target, mtp or auto"),
])
def test_an_option_its_spec_does_not_read_is_refused(argv, error, capsys):
    assert refused(argv, capsys).startswith(error)


def test_an_unused_option_from_the_environment_names_the_variable(capsys):
    assert refused([], capsys, {"TANDEM_K": "5"}).startswith(
        "TANDEM_K='5' (the default of --k): needs --spec draft_target, mtp, ngram or auto")


def test_defaults_are_not_settings_a_user_made():
    # the declared default (or the same value from the environment) is no setting of the user's
    assert accepted([], {"TANDEM_K": "3"}).num_speculative_tokens == 3
    assert accepted(["--spec", "none", "--draft-vocab-size", "0"]).draft_vocab_size == 0
    assert accepted(["--spec", "mtp", "--k", "5"]).num_speculative_tokens == 5


# ---- the checks that were there before, now with the same status and names -----------------
@pytest.mark.parametrize("argv,error", [
    (["--page-size", "0"], "--page-size 0: must be >= 1"),
    (["--max-num-seqs", "0"], "--max-num-seqs 0: must be >= 1"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens 0: must be >= 1"),
    (["--num-pages", "-1"], "--num-pages -1: must be >= 0 (0 = automatic)"),
    (["--threads", "-1"], "--threads -1: must be >= 0 (0 = automatic)"),
    (["--spec", "mtp", "--draft-vocab-size", "-1"], "--draft-vocab-size -1: must be >= 0 (0 = all tokens)"),
    (["--drain-timeout", "-1"], "--drain-timeout -1.0: must be >= 0 (0 = stop at once)"),
])
def test_sizes_out_of_range_are_refused(argv, error, capsys):
    assert refused(argv, capsys) == error


# ---- TANDEM_* variables that are no option's ------------------------------------------------
def test_a_misspelt_variable_is_a_warning_naming_the_closest_option(capsys):
    args = accepted([], {"TANDEM_GRPC_PROT": "9001"})
    assert args.grpc_port == 8001   # a warning, not an error, and not a setting
    assert ("tandem serve: warning: TANDEM_GRPC_PROT is no option of tandem serve and is ignored; "
            "did you mean TANDEM_GRPC_PORT (--grpc-port)?") in capsys.readouterr().err


def test_a_variable_close_to_no_option_still_warns():
    [warning] = unknown_variables(serve_parser({}), {"TANDEM_XYZZY": "1"})
    assert warning.startswith("TANDEM_XYZZY is no option of tandem serve and is ignored; ")
    assert "did you mean" not in warning


def test_options_and_the_other_variables_are_not_warned_about():
    parser = serve_parser({})
    environ = {var: "1" for var in OTHER_VARIABLES} | {"TANDEM_GRPC_PORT": "9001", "TANDEM_NO_SUPERVISE": "1",
                                                        "OTHER_GRPC_PROT": "1"}
    assert unknown_variables(parser, environ) == []


def test_every_variable_the_code_reads_is_an_option_or_an_other_variable():
    """A TANDEM_* variable read for another purpose (grep the code) must be in
    OTHER_VARIABLES, or setting it would warn."""
    parser = serve_parser({})
    options = {env_var(o) for a in parser._actions for o in a.option_strings if o.startswith("--")}
    read = set()
    for folder in ("backends", "client", "rdma", "docker", "model_repository"):
        for path in (ROOT / folder).rglob("*"):
            # env_defaults.py: its docstring's example of a misspelt variable
            if path.is_file() and "__pycache__" not in path.parts and path.name != "env_defaults.py":
                read |= set(re.findall(r"\bTANDEM_[A-Z][A-Z0-9_]*", path.read_text(errors="ignore")))
    assert read - options - OTHER_VARIABLES == set()
    assert OTHER_VARIABLES <= read   # no stale names either


# ---- prefill endpoints ------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["127.0.0.1:9101", "localhost:9101", "p:1,127.0.0.1:9101"])
def test_this_servers_own_grpc_address_is_no_prefill_endpoint(endpoint, capsys):
    """It would forward its jobs to itself and stall every request (seen from outside)."""
    error = refused(["--grpc-port", "9101", "--prefill-endpoints", endpoint], capsys)
    assert error.startswith("--prefill-endpoints") and "own gRPC address" in error


def test_another_servers_address_is_a_prefill_endpoint():
    assert accepted(["--grpc-port", "9101", "--prefill-endpoints", "127.0.0.1:9201"]).prefill_endpoints
