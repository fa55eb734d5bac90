"""What `tandem serve` prepares before tritonserver starts (backend dir, env, repository,
demo model, the fault-injection spec), and how its supervisor tells a dead stub from an
unloaded one and what it does about it (a stand-in tritonserver with stand-in stubs)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.client import cli
from tandem.client.demo_checkpoint import CHECKPOINT_FILES, make_demo_checkpoint
from tandem.backends.triton.generate_request import INPUT_NAMES, INPUTS, TOKEN_INPUT_NAMES
from tandem.backends.triton.response_arrays import ENGINE_OUTPUT_NAMES, OUTPUT_NAMES, TOKEN_OUTPUT_NAMES
from tandem.client.serve.repository import MODEL_REPOSITORY, render_repository
from tandem.client.serve.options import DIRECT, ENSEMBLES, MODES, ServeOptions, ServerError
from tandem.client.serve.stubs import describe_exit, find_stubs, proc_state
from tandem.client.serve.supervisor import RELOAD, RESTART, Recovery, Supervisor, SupervisorStatus, choose_action
from tandem.client.serve.triton_env import TritonNotFound, find_triton, prepare_backend_dir, server_env
from tandem.client.serve.triton_server import remove_orphan_segments


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
    values = ServeOptions.of(model_dir=str(tmp_path), page_size=32, kv_layout="NHD").template_values()
    repo = render_repository(tmp_path / "repo", values)
    config = (repo / "llm" / "config.pbtxt").read_text()
    assert "${" not in config
    assert re.search(r'key: "page_size" value: \{ string_value: "32" \}', config)
    assert re.search(r'key: "kv_layout" value: \{ string_value: "NHD" \}', config)
    assert (repo / "llm" / "1" / "model.py").is_file()


@pytest.mark.parametrize("mode,ensembles", [
    ("disaggregated", ("tandem", "tandem_tokens", "tandem_direct")),
    ("colocated", ("tandem_colocated", "tandem_colocated_direct")),
    ("both", ("tandem", "tandem_tokens", "tandem_direct", "tandem_colocated", "tandem_colocated_direct"))])
def test_mode_selects_the_models(tmp_path, mode, ensembles):
    options = ServeOptions.of(model_dir=str(tmp_path), mode=mode)
    repo = render_repository(tmp_path / "repo", options.template_values(), models=options.models)
    assert sorted(p.name for p in repo.iterdir()) == sorted(options.models)
    assert options.ensembles == ensembles
    for name in options.models:
        assert "${" not in (repo / name / "config.pbtxt").read_text()
    # every step of a served ensemble is served too, and so is the cancel model of a direct one
    for name in ensembles:
        assert {step.model_name for step in _config(name).ensemble_scheduling.step} <= set(options.models)
        assert name not in DIRECT.values() or "cancel" in options.models
    assert {DIRECT[e] for e in ensembles if e in DIRECT} <= set(ensembles)


def test_a_direct_ensemble_is_its_twin_without_postprocess():
    """Same inputs, same steps up to the engine model, whose outputs it returns as they are."""
    for full, direct in DIRECT.items():
        f, d = _config(full), _config(direct)
        assert [(i.name, i.data_type, i.optional) for i in d.input] == [(i.name, i.data_type, i.optional) for i in f.input]
        f_steps, d_steps = f.ensemble_scheduling.step, d.ensemble_scheduling.step
        assert [s.model_name for s in d_steps] == [s.model_name for s in f_steps][:-1]
        assert f_steps[-1].model_name == "postprocess"
        assert all(dict(a.input_map) == dict(b.input_map) for a, b in zip(d_steps, f_steps))
        assert dict(d_steps[-1].output_map) == {o.name: o.name for o in d.output}
        assert "cancel_token" in dict(d_steps[-1].output_map)


@pytest.mark.parametrize("mode,target", [("disaggregated", "tandem"), ("colocated", "tandem_colocated"),
                                         ("both", "tandem")])
def test_ensemble_name_serves_the_text_ensemble_under_a_second_name(tmp_path, mode, target):
    options = ServeOptions.of(model_dir=str(tmp_path), mode=mode, ensemble_name="ensemble")
    assert options.aliases == {"ensemble": target} and "ensemble" in options.ensembles
    repo = render_repository(tmp_path / "repo", options.template_values(), models=options.models,
                             aliases=options.aliases)
    alias, original = _parse(repo / "ensemble" / "config.pbtxt"), _parse(repo / target / "config.pbtxt")
    assert (alias.name, original.name) == ("ensemble", target)
    original.name = "ensemble"
    assert alias == original                       # the same steps behind both names
    assert (repo / "ensemble" / "1").is_dir()
    assert sorted(p.name for p in repo.iterdir()) == sorted(options.models)
    assert cli.build_parser().parse_args(["serve", "--ensemble-name", "ensemble"]).ensemble_name == "ensemble"


@pytest.mark.parametrize("mode,name,problem", [
    ("prefill", "ensemble", "--mode prefill serves none"),
    ("disaggregated", "decode", "is the name of one of Tandem's models"),
    ("colocated", "tandem", "is the name of one of Tandem's models"),
    ("disaggregated", "../x", "allowed: letters, digits"),
    ("disaggregated", "-x", "allowed: letters, digits"),
])
def test_a_bad_ensemble_name_is_refused(mode, name, problem):
    with pytest.raises(ServerError, match=re.escape(problem)):
        ServeOptions.of(model_dir=".", mode=mode, ensemble_name=name).models


def test_disaggregated_is_the_default_mode():
    assert ServeOptions.of(model_dir=".").mode == "disaggregated"
    assert cli.build_parser().parse_args(["serve"]).mode == "disaggregated"
    assert set(MODES["both"]) == set(MODES["colocated"]) | set(MODES["disaggregated"])


def test_unknown_mode_is_refused():
    with pytest.raises(ServerError, match="mode='split'; allowed: disaggregated, colocated, both"):
        ServeOptions.of(model_dir=".", mode="split").models


def _parse(path: Path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def _config(name: str):
    return _parse(MODEL_REPOSITORY / name / "config.pbtxt")


def _settings(path: Path):
    """The EngineSettings a model reads from its rendered config.pbtxt (as Triton hands it over)."""
    from tandem.backends.triton.settings import EngineSettings
    params = dict(re.findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}', path.read_text()))
    return EngineSettings.from_model_config({"parameters": {k: {"string_value": v} for k, v in params.items()}})


@pytest.mark.parametrize("name,inputs,outputs", [
    ("tandem", INPUT_NAMES, OUTPUT_NAMES),
    ("tandem_colocated", INPUT_NAMES, OUTPUT_NAMES),
    ("tandem_tokens", TOKEN_INPUT_NAMES, TOKEN_OUTPUT_NAMES),
    ("llm", (*TOKEN_INPUT_NAMES, "stop", "prompt_echo"), (*ENGINE_OUTPUT_NAMES, "cancel_token", "prompt_echo")),
    ("preprocess", INPUT_NAMES, ("input_ids", "prompt_echo")),
    ("kv_transfer", TOKEN_INPUT_NAMES, ("kv_descriptor",)),
])
def test_interfaces_are_the_conventional_ones(name, inputs, outputs):
    from tritonclient.grpc import model_config_pb2

    cfg = _config(name)
    assert [i.name for i in cfg.input] == list(inputs)
    # the prompt (text_input / input_ids) too is optional to Triton, so that a request
    # without it reaches the first step, which refuses it by name (llm is no ensemble:
    # Triton's own check names it); every other input is optional anyway
    assert [i.name for i in cfg.input if not i.optional] == ([inputs[0]] if name == "llm" else [])
    assert [o.name for o in cfg.output] == list(outputs)
    for i in cfg.input:       # the TensorRT-LLM ensemble's types and dims
        if i.name in INPUTS:
            assert (model_config_pb2.DataType.Name(i.data_type), list(i.dims)) == tuple(INPUTS[i.name]), i.name


# the TensorRT-LLM text ensemble's interface (tensorrtllm_backend v0.14.0's
# all_models/inflight_batcher_llm/ensemble/config.pbtxt, and TensorRT-LLM's newer one)
TENSORRT_LLM_INPUTS = {
    "text_input": "TYPE_STRING", "max_tokens": "TYPE_INT32", "num_return_sequences": "TYPE_INT32",
    "bad_words": "TYPE_STRING", "stop_words": "TYPE_STRING", "end_id": "TYPE_INT32", "pad_id": "TYPE_INT32",
    "top_k": "TYPE_INT32", "top_p": "TYPE_FP32", "temperature": "TYPE_FP32", "length_penalty": "TYPE_FP32",
    "repetition_penalty": "TYPE_FP32", "min_length": "TYPE_INT32", "presence_penalty": "TYPE_FP32",
    "frequency_penalty": "TYPE_FP32", "random_seed": "TYPE_UINT64", "return_log_probs": "TYPE_BOOL",
    "return_context_logits": "TYPE_BOOL", "return_generation_logits": "TYPE_BOOL", "beam_width": "TYPE_INT32",
    "stream": "TYPE_BOOL", "embedding_bias_words": "TYPE_STRING", "embedding_bias_weights": "TYPE_FP32",
    # newer
    "exclude_input_in_output": "TYPE_BOOL", "min_tokens": "TYPE_INT32", "seed": "TYPE_UINT64",
    "return_num_input_tokens": "TYPE_BOOL", "return_num_output_tokens": "TYPE_BOOL",
}
TENSORRT_LLM_OUTPUTS = {"text_output": "TYPE_STRING", "cum_log_probs": "TYPE_FP32", "output_log_probs": "TYPE_FP32",
                        "context_logits": "TYPE_FP32", "generation_logits": "TYPE_FP32", "batch_index": "TYPE_INT32",
                        "sequence_index": "TYPE_INT32"}


@pytest.mark.parametrize("name", ["tandem", "tandem_colocated"])
def test_text_ensembles_declare_the_tensorrt_llm_interface(name):
    from tritonclient.grpc import model_config_pb2

    cfg = _config(name)
    type_name = model_config_pb2.DataType.Name
    inputs = {i.name: type_name(i.data_type) for i in cfg.input}
    outputs = {o.name: (type_name(o.data_type), list(o.dims)) for o in cfg.output}
    assert {k: inputs.get(k) for k in TENSORRT_LLM_INPUTS} == TENSORRT_LLM_INPUTS
    assert {k: outputs.get(k, (None,))[0] for k in TENSORRT_LLM_OUTPUTS} == TENSORRT_LLM_OUTPUTS
    assert outputs["text_output"][1] == [-1]       # one string per row, as its postprocessing


def test_decode_takes_what_llm_takes_and_answers_alike():
    llm, decode = _config("llm"), _config("decode")
    assert [i.name for i in decode.input] == [i.name for i in llm.input] + ["kv_descriptor"]
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
    assert placeholders and placeholders <= set(ServeOptions.of(model_dir=".").template_values())


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
    assert (args.page_size, args.kv_layout, args.dtype, args.host, args.grpc_port) == (32, "NHD", "auto",
                                                                                    "127.0.0.1", 8001)
    args = parser.parse_args(["generate", "hi", "--stream", "--max-tokens", "5"])
    assert (args.prompt, args.stream, args.max_tokens, args.url) == ("hi", True, 5, "localhost:8001")
    assert args.model_name == "tandem"
    assert parser.parse_args(["generate", "hi", "--model-name", "tandem_colocated"]).model_name == "tandem_colocated"
    assert callable(parser.parse_args(["make-demo-checkpoint"]).func)
    # only the chosen command's module is needed to run it
    assert cli.build_parser("generate").parse_args(["generate", "x"]).command == "generate"


# ---- fault injection ----------------------------------------------------------------
FAULT_MODELS = ("kv_transfer", "prefill", "decode", "llm")


def test_faults_reach_the_engine_models_and_nothing_else(tmp_path):
    spec = "transfer_fail=0.05@mid_layers,seed=1"
    options = ServeOptions.of(model_dir=str(tmp_path), mode="both", faults=spec)
    repo = render_repository(tmp_path / "repo", options.template_values(), models=options.models)
    for name in options.models:
        has = f'key: "faults" value: {{ string_value: "{spec}" }}' in (repo / name / "config.pbtxt").read_text()
        assert has == (name in FAULT_MODELS), name
    off = render_repository(tmp_path / "off", ServeOptions.of(model_dir=str(tmp_path)).template_values())
    assert 'key: "faults" value: { string_value: "" }' in (off / "decode" / "config.pbtxt").read_text()


@pytest.mark.parametrize("spec", ['a"b', "a\\b", "a\nb"])
def test_a_faults_spec_that_would_break_the_config_is_refused(tmp_path, spec):
    with pytest.raises(ServerError, match="--faults .*quotes, backslashes and line breaks are not allowed"):
        ServeOptions.of(model_dir=str(tmp_path), faults=spec).template_values()


def test_serve_cli_supervises_with_the_repository_api_by_default():
    args = cli.build_parser().parse_args(["serve"])
    assert (args.model_control_mode, args.supervise, args.faults) == ("explicit", True, "")
    args = cli.build_parser().parse_args(["serve", "--no-supervise", "--faults", "drop_sender=0.1",
                                          "--model-control-mode", "none"])
    assert (args.model_control_mode, args.supervise, args.faults) == ("none", False, "drop_sender=0.1")


# ---- stubs, exits and what the supervisor does ---------------------------------------


@pytest.mark.parametrize("decoupled,status,can_reload,action", [
    (False, signal.SIGKILL, True, RELOAD),        # prefill, kv_transfer: the failed requests already ended
    (False, signal.SIGSEGV, True, RELOAD),
    (True, signal.SIGKILL, True, RESTART),        # decode, llm: their open streams would hang forever
    (True, None, True, RESTART),                  # unknown: assume the worst
    (True, 70 << 8, True, RELOAD),                # the engine's own exit ended its streams first
    (False, signal.SIGKILL, False, RESTART),      # --model-control-mode none: no repository API
])
def test_choose_action(decoupled, status, can_reload, action):
    assert choose_action(decoupled, status, can_reload) == action


def test_a_dead_child_is_a_zombie_with_its_exit_status_until_reaped():
    killed = subprocess.Popen(["sleep", "60"])
    exited = subprocess.Popen([sys.executable, "-c", "import os; os._exit(70)"])
    killed.send_signal(signal.SIGKILL)
    try:
        for proc, words in ((killed, "killed by SIGKILL"), (exited, "exited with status 70")):
            deadline = time.monotonic() + 10
            while proc_state(proc.pid).state != "Z" and time.monotonic() < deadline:
                time.sleep(0.01)
            state = proc_state(proc.pid)
            assert (state.state, state.ppid, describe_exit(state.exit_status)) == ("Z", os.getpid(), words)
    finally:
        killed.wait(), exited.wait()
    assert proc_state(killed.pid) is None   # reaped: gone


def test_orphan_segments_of_dead_launchers_are_removed(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    names = [f"tandem_{dead.pid}_0123abcd_region", f"tandem-kv-{dead.pid}-decode.ctl",          # orphans
             f"tandem_{os.getpid()}_0123abcd_region", f"tandem-kv-{os.getpid()}-decode.ctl",  # alive
             "tkv-other-1.ctl", f"tandem_{dead.pid}_notours"]                                 # not ours
    for n in names:
        (tmp_path / n).write_bytes(b"")
    assert sorted(remove_orphan_segments(tmp_path)) == sorted(names[:2])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])


def test_supervisor_status_counts_completed_recoveries():
    recs = (Recovery("prefill", 1, "killed by SIGKILL", RELOAD, 0.0, 2.5, True),
            Recovery("decode", 2, "killed by SIGKILL", RESTART, 1.0, 4.0, True),
            Recovery("prefill", 3, "killed by SIGKILL", RELOAD, 2.0, None, None))
    status = SupervisorStatus(recs, recovering=True, failed="")
    assert (status.reloads, status.restarts, status.reload_seconds) == (1, 1, [2.5])
    assert status.as_dict()["recoveries"][1]["action"] == RESTART


FAKE_SERVER = """
import signal, subprocess, sys, time
stub, repo = sys.argv[1], sys.argv[2]
children = [subprocess.Popen([stub, f"{repo}/{m}/1/model.py", f"tandem_1_0123abcd_{m}", "1", "1", "1", "x", "1",
                              f"{m}_0_0", "DEFAULT"]) for m in ("prefill", "kv_transfer", "decode")]
def unload(*_):   # an orderly unload: Triton stops the stub and reaps it
    children[0].terminate(); children[0].wait()
signal.signal(signal.SIGUSR1, unload)
while True:
    time.sleep(1)
"""


class FakeServer:
    """What the supervisor uses of a TritonServer, around a stand-in tritonserver whose
    children look like stubs (``triton_python_backend_stub <repo>/<model>/1/model.py ...``)."""

    def __init__(self, tmp_path, model_control_mode="explicit"):
        stub = tmp_path / "triton_python_backend_stub"
        stub.symlink_to(sys.executable)       # runs model.py, which sleeps
        for m in ("prefill", "kv_transfer", "decode"):
            (tmp_path / "repo" / m / "1").mkdir(parents=True)
            (tmp_path / "repo" / m / "1" / "model.py").write_text("import time\ntime.sleep(600)\n")
        self.args = [sys.executable, "-c", FAKE_SERVER, str(stub), str(tmp_path / "repo")]
        self.process = subprocess.Popen(self.args, start_new_session=True)
        self.log_file = tmp_path / "tritonserver.log"
        self.log_file.write_text('Signal (6) received.\n')     # an earlier launch's: not this one's
        self.model_control_mode = model_control_mode
        self.ready_timeout_s = 5.0
        self.calls: list[tuple] = []
        self.http, self.options = self, self
        self.models = ("prefill", "kv_transfer", "decode", "tandem")
        self.load_s = 0.0
        deadline = time.monotonic() + 20
        while len(find_stubs(self.process.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)

    def model_config(self, model):
        if model == "tandem":   # prefill is no step of it: kv_transfer hands prefill its jobs
            return {"platform": "ensemble",
                    "ensemble_scheduling": {"step": [{"model_name": "kv_transfer"}, {"model_name": "decode"}]}}
        return {"model_transaction_policy": {"decoupled": model == "decode"}}

    def unload(self, model):
        self.calls.append(("unload", model))

    def load(self, model, timeout_s, config=None):
        # a load in place carries the model's config, marked so that Triton loads it again
        self.calls.append(("load", model) if config is None else
                          ("load in place", model, "tandem_reload" in config.get("parameters", {})))
        time.sleep(self.load_s)

    def wait_ready(self, abort=None):
        self.calls.append(("wait_ready",))

    def relaunch(self, abort=None):
        self.calls.append(("relaunch",))
        self.kill()
        self.process = subprocess.Popen(self.args, start_new_session=True)

    def remove_shm_region(self, name):
        self.calls.append(("remove_shm_region", name))

    def kill(self):
        """The stand-in and its stubs (its process group: orphans included). Only while
        it is not reaped: a reaped pid may name someone else's process group by now."""
        if self.process.returncode is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()


@pytest.fixture
def fake(tmp_path):
    server = FakeServer(tmp_path)
    supervisor = Supervisor(server, poll_s=0.02, rescan_s=0.05).start()
    yield server, supervisor
    supervisor.request_stop()
    supervisor.join(5)
    server.kill()


def _wait(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_supervisor_finds_the_stubs_of_its_server(fake):
    server, _ = fake
    stubs = sorted(find_stubs(server.process.pid), key=lambda s: s.model)
    assert [(s.model, s.version, s.instance, s.shm_region) for s in stubs] == [
        ("decode", "1", "decode_0_0", "tandem_1_0123abcd_decode"),
        ("kv_transfer", "1", "kv_transfer_0_0", "tandem_1_0123abcd_kv_transfer"),
        ("prefill", "1", "prefill_0_0", "tandem_1_0123abcd_prefill")]


def test_a_killed_stub_is_reloaded_and_its_region_removed(fake):
    server, supervisor = fake
    stub = next(s for s in find_stubs(server.process.pid) if s.model == "prefill")
    os.kill(stub.pid, signal.SIGKILL)
    assert supervisor.wait_noticed(stub.pid)
    assert _wait(lambda: supervisor.status().reloads == 1)
    # no ensemble depends on prefill: reloaded in place (the server stays ready)
    assert server.calls == [("load in place", "prefill", True), ("wait_ready",),
                            ("remove_shm_region", "tandem_1_0123abcd_prefill")]
    rec = supervisor.status().recoveries[0]
    assert (rec.model, rec.pid, rec.cause, rec.action, rec.ok) == ("prefill", stub.pid, "killed by SIGKILL",
                                                                   RELOAD, True)
    server.calls.clear()
    stub = next(s for s in find_stubs(server.process.pid) if s.model == "kv_transfer")
    os.kill(stub.pid, signal.SIGKILL)                 # a step of "tandem": unloaded first
    assert _wait(lambda: supervisor.status().reloads == 2)
    assert server.calls == [("unload", "kv_transfer"), ("load", "kv_transfer"), ("wait_ready",),
                            ("remove_shm_region", "tandem_1_0123abcd_kv_transfer")]


def test_a_stub_that_dies_during_another_reload_is_reloaded_too(fake):
    server, supervisor = fake
    server.load_s = 0.5
    stubs = {s.model: s for s in find_stubs(server.process.pid)}
    os.kill(stubs["prefill"].pid, signal.SIGKILL)
    assert supervisor.wait_noticed(stubs["prefill"].pid)
    os.kill(stubs["kv_transfer"].pid, signal.SIGKILL)     # while prefill loads
    assert _wait(lambda: supervisor.status().reloads == 2)
    assert [r.model for r in supervisor.status().recoveries] == ["prefill", "kv_transfer"]


def test_a_killed_decoupled_stub_restarts_the_server(fake):
    server, supervisor = fake
    stub = next(s for s in find_stubs(server.process.pid) if s.model == "decode")
    os.kill(stub.pid, signal.SIGKILL)
    assert _wait(lambda: supervisor.status().restarts == 1)
    assert server.calls[0] == ("relaunch",)
    assert _wait(lambda: len(find_stubs(server.process.pid)) == 3)   # the new server's stubs are watched


def test_a_dead_server_is_restarted(fake):
    server, supervisor = fake
    pid = server.process.pid
    server.kill()   # with its stubs, which the supervisor may see die first
    assert _wait(lambda: supervisor.status().restarts == 1)
    assert server.process.pid != pid and ("relaunch",) in server.calls
    assert supervisor.status().recoveries[-1].action == RESTART
    assert _wait(lambda: len(find_stubs(server.process.pid)) == 3)


def test_a_crash_in_the_server_log_restarts_it(fake):
    server, supervisor = fake
    with open(server.log_file, "a") as f:
        f.write('I1130 server.cc:305] "Waiting for in-flight requests to complete."\nSignal (15) received.\n')
    time.sleep(0.3)
    assert supervisor.status().recoveries == ()             # a shutdown signal is no crash
    with open(server.log_file, "a") as f:
        f.write("malloc_consolidate(): unaligned fastbin chunk detected\nSignal (6) received.\n")
    assert _wait(lambda: supervisor.status().restarts == 1)
    assert supervisor.status().recoveries[0].cause == "tritonserver crashed ('Signal (6) received' in its log)"


def test_an_orderly_unload_is_not_a_death(fake):
    server, supervisor = fake
    server.process.send_signal(signal.SIGUSR1)      # the stand-in reaps its prefill stub
    assert _wait(lambda: len(find_stubs(server.process.pid)) == 2)
    time.sleep(0.3)
    assert supervisor.status().recoveries == () and server.calls == []


def test_without_the_repository_api_a_dead_stub_restarts_the_server(tmp_path):
    server = FakeServer(tmp_path, model_control_mode="none")
    supervisor = Supervisor(server, poll_s=0.02).start()
    try:
        os.kill(next(s.pid for s in find_stubs(server.process.pid) if s.model == "prefill"), signal.SIGKILL)
        assert _wait(lambda: supervisor.status().restarts == 1)
    finally:
        supervisor.request_stop()
        supervisor.join(5)
        server.kill()


def test_decode_speed_options_reach_the_engine_config(tmp_path, demo_checkpoint):
    """--compile, --compile-cache-dir, --enforce-eager and --draft-vocab-size land in
    decode's and llm's EngineConfig (and nowhere they would be ignored silently)."""
    from tandem.backends.triton.settings import EngineSettings
    options = ServeOptions.of(model_dir=str(demo_checkpoint), mode="both", spec_method="mtp",
                           mtp_head=str(demo_checkpoint), compile="all", enforce_eager=True,
                           compile_cache_dir=str(tmp_path / "ic"), draft_vocab_size=64)
    repo = render_repository(tmp_path / "repo", options.template_values(), models=options.models)
    for name in ("decode", "llm"):
        config = _settings(repo / name / "config.pbtxt").engine_config()
        assert (config.compile, config.enforce_eager) == ("all", True), name
        assert config.compile_cache_dir == str(tmp_path / "ic"), name
        assert config.speculative.draft_vocab_size == 64, name
    off = ServeOptions(EngineSettings(model_dir=str(demo_checkpoint))).template_values()   # the defaults
    assert (off["compile"], off["enforce_eager"], off["draft_vocab_size"]) == ("auto", "0", "0")
    assert EngineSettings.from_model_config({"parameters": {"model_dir": {"string_value": "m"}}}) \
        .engine_config().compile_cache_dir is None


@pytest.mark.parametrize("name", sorted(p.parent.name for p in MODEL_REPOSITORY.glob("*/config.pbtxt")))
def test_every_model_config_parses(name):
    """Triton refuses a model whose config.pbtxt does not parse (a missing comma in a list
    takes the model, and the server's readiness, down): parse each as Triton does."""
    cfg = _config(name)
    assert cfg.name == name


@pytest.mark.parametrize("options,problem", [
    (dict(mode="colocated", prefill_tensor_parallel_size=2), "--prefill-tp with --mode colocated"),
    (dict(mode="colocated", decode_tensor_parallel_size=2), "--decode-tp with --mode colocated"),
    (dict(mode="prefill", decode_tensor_parallel_size=2), "--decode-tp with --mode prefill: a prefill server runs "
                                                          "no decode engine"),
    (dict(mode="disaggregated", decode_tensor_parallel_size=-1), "--decode-tp -1; allowed: an integer >= 1"),
    (dict(mode="colocated", tensor_parallel_size=0), "--tp 0; allowed: an integer >= 1"),
])
def test_a_tensor_parallel_split_the_server_cannot_run_is_refused(tmp_path, options, problem):
    with pytest.raises(ServerError, match=re.escape(problem)):
        ServeOptions.of(model_dir=str(tmp_path), **options).template_values()


@pytest.mark.parametrize("mode,models", [("colocated", ("llm",)),
                                         ("disaggregated", ("decode", "kv_transfer", "prefill"))])
def test_the_engines_get_their_tensor_parallel_size(tmp_path, mode, models):
    options = ServeOptions.of(model_dir=str(tmp_path), mode=mode, tensor_parallel_size=2, spec_method="ngram")
    repo = render_repository(tmp_path / "repo", options.template_values(), models=options.models)
    for m in models:
        assert 'key: "tensor_parallel_size" value: { string_value: "2" }' in (repo / m / "config.pbtxt").read_text()


@pytest.mark.parametrize("flags,prefill,decode", [(dict(tensor_parallel_size=2), 2, 2),
                                                  (dict(prefill_tensor_parallel_size=2), 2, 1),
                                                  (dict(tensor_parallel_size=2, decode_tensor_parallel_size=1), 2, 1),
                                                  (dict(decode_tensor_parallel_size=2), 1, 2)])
def test_prefill_and_decode_get_their_own_split(tmp_path, demo_checkpoint, flags, prefill, decode):
    """--tp splits both roles, --prefill-tp / --decode-tp one each: every model of a
    disaggregated server reads the same split (kv_transfer plans transfers between them)."""
    options = ServeOptions.of(model_dir=str(demo_checkpoint), mode="disaggregated", spec_method="ngram", **flags)
    repo = render_repository(tmp_path / "repo", options.template_values(), models=options.models)
    for m in ("decode", "kv_transfer", "prefill"):
        s = _settings(repo / m / "config.pbtxt")
        assert (s.prefill_tp, s.decode_tp) == (prefill, decode), m
