"""Each setting is declared once, in its dataclass, and ``tandem serve``'s options are
generated from those declarations: a field added there is an option (and a
``TANDEM_*`` variable) without another line, and no option restates a field."""
from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from tandem.backends.triton.settings import EngineSettings, flag_of
from tandem.client.cli import build_parser
from tandem.client.serve import flags
from tandem.client.serve.cli import SETTINGS
from tandem.client.serve.env_defaults import env_var
from tandem.client.serve.options import ServeOptions
from tandem.client.serve.triton_server import TritonServer

COMMAND_ONLY = {"--openai-port", "--drain-timeout", "--api-key", "--tool-call-parser"}   # the serve command's own, not a setting's


def serve_actions() -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser("serve")._actions if isinstance(a, argparse._SubParsersAction))
    return {o: a for a in sub.choices["serve"]._actions for o in a.option_strings if o.startswith("--")}


def test_every_serve_option_is_a_settings_field_or_the_commands_own():
    actions = serve_actions()
    generated = flags.dests(*SETTINGS)
    assert set(actions) - {"--help"} == set(generated) | COMMAND_ONLY
    for option, dest in generated.items():
        assert actions[option].dest == dest


def test_no_field_is_written_twice():
    names = [f.name for cls in SETTINGS for f in fields(cls) if f.name != "options"]
    assert len(names) == len(set(names))
    assert not {f.name for f in fields(ServeOptions)} & {f.name for f in fields(EngineSettings)}


@pytest.mark.parametrize("cls", SETTINGS, ids=lambda c: c.__name__)
def test_an_option_defaults_to_its_field(cls):
    actions = serve_actions()
    for f in flags.flag_fields(cls):
        assert actions[flag_of(f).flag].default == flags.default_of(f), f.name


def test_parsed_options_become_the_settings_again():
    args = build_parser("serve").parse_args(
        ["serve", "--model", "/m", "--threads", "3", "--spec", "ngram", "--k", "4", "--compile", "all",
         "--enforce-eager", "--mode", "both", "--ensemble-name", "ensemble", "--grpc-port", "9001", "--no-supervise"])
    engine = flags.from_args(EngineSettings, args)
    assert (engine.model_dir, engine.torch_threads, engine.spec_method, engine.num_speculative_tokens,
            engine.compile, engine.enforce_eager) == ("/m", 3, "ngram", 4, "all", True)
    options = flags.from_args(ServeOptions, args, engine=engine)
    assert (options.mode, options.ensemble_name, options.engine) == ("both", "ensemble", engine)
    server = flags.from_args(TritonServer, args, options=options)
    assert (server.grpc_port, server.http_port, server.supervise) == (9001, 8000, False)


def test_a_flagged_field_reads_its_variable(monkeypatch):
    """A field given a flag is configurable from the environment with no other change."""
    field = next(f for f in fields(EngineSettings) if f.name == "max_num_seqs")
    monkeypatch.setenv(env_var(flag_of(field).flag), "7")
    args = build_parser("serve").parse_args(["serve"])
    assert flags.from_args(EngineSettings, args).max_num_seqs == 7


def test_serve_options_of_splits_flat_values_and_refuses_unknown_ones():
    options = ServeOptions.of(mode="colocated", page_size=32, torch_threads=1)
    assert (options.mode, options.engine.page_size, options.engine.torch_threads) == ("colocated", 32, 1)
    with pytest.raises(TypeError, match="pagesize"):
        ServeOptions.of(pagesize=32)
