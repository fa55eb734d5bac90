"""What `tandem serve` prepares before tritonserver starts: backend dir, env, repository, demo model."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path

import pytest

from tandem.client import cli
from tandem.client.demo_checkpoint import CHECKPOINT_FILES, make_demo_checkpoint
from tandem.backends.triton.generate_request import INPUT_NAMES, OUTPUT_NAMES, TOKEN_INPUT_NAMES, TOKEN_OUTPUT_NAMES
from tandem.client.repository import MODEL_REPOSITORY, render_repository
from tandem.client.serve_options import ENSEMBLES, MODES, ServeOptions, ServerError
from tandem.client.triton_env import TritonNotFound, find_triton, prepare_backend_dir, server_env


def test_backend_dir_has_library_stub_and_utils(tmp_path):
    layout = find_triton()
    backends = prepare_backend_dir(layout, tmp_path)
    python_dir = backends / "python"
    assert (python_dir / "libtriton_python.so").exists()
    stub = python_dir / "triton_python_backend_stub"
    assert stub.is_file() and os.access(stub, os.X_OK)
    assert stub.read_bytes() == layout.stub.read_bytes()
    assert prepare_backend_dir(layout, tmp_path) == backends  # idempotent


def test_missing_stub_version_names_the_shipped_ones():
    with pytest.raises(TritonNotFound, match=r"no Python backend stub for Python 2\.7.*3\.11"):
        find_triton("2.7")


def test_server_env_puts_venv_and_bundled_libs_first():
    layout = find_triton()
    env = server_env(layout, {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/lib", "PYTHONHOME": "/x"})
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    libs = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert libs[0] == str(layout.libs_dir) and libs[-1] == "/opt/lib"
    assert "PYTHONHOME" not in env


def test_rendered_repository_has_no_placeholders_left(tmp_path):
    values = ServeOptions(model_dir=str(tmp_path), page_size=32, kv_layout="NHD").template_values()
    repo = render_repository(tmp_path / "repo", values)
    config = (repo / "llm" / "config.pbtxt").read_text()
    assert "${" not in config
    assert re.search(r'key: "page_size" value: \{ string_value: "32" \}', config)
    assert re.search(r'key: "kv_layout" value: \{ string_value: "NHD" \}', config)
    assert (repo / "llm" / "1" / "model.py").is_file()


@pytest.mark.parametrize("mode,ensembles", [("disaggregated", ("tandem", "tandem_tokens")),
                                            ("colocated", ("tandem_colocated",)),
                                            ("both", ("tandem", "tandem_tokens", "tandem_colocated"))])
def test_mode_selects_the_models(tmp_path, mode, ensembles):
    options = ServeOptions(model_dir=str(tmp_path), mode=mode)
    repo = render_repository(tmp_path / "repo", options.template_values(), models=options.models)
    assert sorted(p.name for p in repo.iterdir()) == sorted(options.models)
    assert options.ensembles == ensembles
    for name in options.models:
        assert "${" not in (repo / name / "config.pbtxt").read_text()
    # every step of a served ensemble is served too
    for name in ensembles:
        assert {step.model_name for step in _config(name).ensemble_scheduling.step} <= set(options.models)


def test_disaggregated_is_the_default_mode():
    assert ServeOptions(model_dir=".").mode == "disaggregated"
    assert cli.build_parser().parse_args(["serve"]).mode == "disaggregated"
    assert set(MODES["both"]) == set(MODES["colocated"]) | set(MODES["disaggregated"])


def test_unknown_mode_is_refused():
    with pytest.raises(ServerError, match="mode='split'; allowed: disaggregated, colocated, both"):
        ServeOptions(model_dir=".", mode="split").models


def _config(name: str):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse((MODEL_REPOSITORY / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


@pytest.mark.parametrize("name,inputs,outputs", [
    ("tandem", INPUT_NAMES, OUTPUT_NAMES),
    ("tandem_colocated", INPUT_NAMES, OUTPUT_NAMES),
    ("tandem_tokens", TOKEN_INPUT_NAMES, TOKEN_OUTPUT_NAMES),
    ("llm", (*TOKEN_INPUT_NAMES, "prompt_echo"), (*TOKEN_OUTPUT_NAMES, "cancel_token", "prompt_echo")),
])
def test_interfaces_are_the_conventional_ones(name, inputs, outputs):
    cfg = _config(name)
    assert [i.name for i in cfg.input] == list(inputs)
    assert [i.name for i in cfg.input if not i.optional] == [inputs[0]]   # text_input / input_ids
    assert [o.name for o in cfg.output] == list(outputs)


def test_decode_takes_what_llm_takes_and_answers_alike():
    llm, decode = _config("llm"), _config("decode")
    assert [i.name for i in decode.input] == [i.name for i in llm.input] + ["kv_descriptor", "prefill_ack"]
    assert [(o.name, o.data_type) for o in decode.output] == [(o.name, o.data_type) for o in llm.output]
    assert decode.model_transaction_policy.decoupled and llm.model_transaction_policy.decoupled


@pytest.mark.parametrize("name", sorted(ENSEMBLES))
def test_ensemble_steps_match_their_models(name):
    """Every mapped tensor exists in its step's config, with the type the producer gives it,
    and every required step input is fed."""
    ens = _config(name)
    types = {i.name: i.data_type for i in ens.input}
    for step in ens.ensemble_scheduling.step:
        model = _config(step.model_name)
        ins = {i.name: i for i in model.input}
        outs = {o.name: o.data_type for o in model.output}
        for key, tensor in step.input_map.items():
            assert key in ins, f"{name}: {step.model_name} has no input {key!r}"
            assert types[tensor] == ins[key].data_type, f"{name}: {tensor} -> {step.model_name}.{key}"
        assert {i for i, spec in ins.items() if not spec.optional} <= set(step.input_map), step.model_name
        for key, tensor in step.output_map.items():
            assert key in outs, f"{name}: {step.model_name} has no output {key!r}"
            types[tensor] = outs[key]
    assert {o.name: o.data_type for o in ens.output} == {o.name: types[o.name] for o in ens.output}


def test_every_placeholder_has_a_serve_option():
    placeholders = {m for p in MODEL_REPOSITORY.glob("*/config.pbtxt")
                    for m in re.findall(r"\$\{(\w+)\}", p.read_text())}
    assert placeholders and placeholders <= set(ServeOptions(model_dir=".").template_values())


def test_unknown_placeholder_is_reported(tmp_path):
    src = tmp_path / "src"
    (src / "m").mkdir(parents=True)
    (src / "m" / "config.pbtxt").write_text('name: "${nope}"')
    with pytest.raises(ServerError, match=r"m/config.pbtxt: no value for placeholder \$\{nope\}"):
        render_repository(tmp_path / "dst", {}, src=src)


def test_demo_checkpoint_is_deterministic_and_loads(tmp_path, demo_checkpoint):
    again = make_demo_checkpoint(tmp_path / "again")
    for name in CHECKPOINT_FILES:
        digest = lambda d: hashlib.sha256((d / name).read_bytes()).hexdigest()
        assert digest(demo_checkpoint) == digest(again), name
    config = json.loads((demo_checkpoint / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (128, 2, 2)

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(demo_checkpoint / "tokenizer.json"))
    assert config["vocab_size"] == tok.get_vocab_size() == 2000
    ids = tok.encode("def f(x):\n    return x").ids
    assert ids[0] == config["bos_token_id"] == tok.token_to_id("<s>")
    assert tok.token_to_id("</s>") == config["eos_token_id"]
    assert tok.decode(ids) == "def f(x):\n    return x"

    from tandem.backends.models.loader import load_model
    model = load_model(demo_checkpoint)
    assert model.config.vocab_size == 2000


def test_cli_registers_the_subcommands():
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--page-size", "32", "--kv-layout", "NHD"])
    assert (args.page_size, args.kv_layout, args.dtype, args.host, args.grpc_port) == (32, "NHD", "float32",
                                                                                       "127.0.0.1", 8001)
    args = parser.parse_args(["generate", "hi", "--stream", "--max-tokens", "5"])
    assert (args.prompt, args.stream, args.max_tokens, args.url) == ("hi", True, 5, "localhost:8001")
    assert args.model_name == "tandem"
    assert parser.parse_args(["generate", "hi", "--model-name", "tandem_colocated"]).model_name == "tandem_colocated"
    assert callable(parser.parse_args(["make-demo-checkpoint"]).func)
    # only the chosen command's module is needed to run it
    assert cli.build_parser("generate").parse_args(["generate", "x"]).command == "generate"
