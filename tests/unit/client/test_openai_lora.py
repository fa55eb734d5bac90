"""LoRA adapters on the OpenAI API (client/openai/lora.py): /v1/models lists them with their
base as parent, the model field naming one sends the base ensemble its lora_name, and
/v1/load_lora_adapter and /v1/unload_lora_adapter check, add and remove adapters."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tandem.backends.triton.lora_registry import AdapterRegistry
from tandem.client.openai.ensemble_request import DEFAULT_DECLARED
from tandem.client.openai.lora import LoRAServing
from tandem.client.openai.triton_backend import EnsembleResponse

from .test_openai_protocol import DEMO, FakeBackend, call, steps

HIDDEN, Q, KV, LAYERS = 384, 384, 128, 6     # the demo target's shapes


def write_adapter(path, rank=4, modules=("q_proj", "v_proj"), kv=KV):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules), "bias": "none",
         "task_type": "CAUSAL_LM"}))
    out = {"q_proj": Q, "k_proj": kv, "v_proj": kv, "o_proj": HIDDEN}
    tensors = {}
    for layer in range(LAYERS):
        for m in modules:
            key = f"base_model.model.model.layers.{layer}.self_attn.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, HIDDEN)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out[m], rank)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


@pytest.fixture
def lora_app(tmp_path):
    from tandem.client.openai.app import create_app
    seen = []

    def script(arrays):
        seen.append(arrays)
        return steps(" ok")
    backend = FakeBackend(script, inputs=DEFAULT_DECLARED | {"lora_name"})
    config = json.loads((Path(DEMO) / "config.json").read_text())
    serving = LoRAServing(AdapterRegistry(tmp_path / "registry", config, max_rank=8))
    app = create_app("unused:1", ["tandem"], model_dir=DEMO, lora=serving)
    app.state.frontend.backend = backend
    return app, serving, seen


def test_an_adapter_is_loaded_listed_served_and_unloaded(lora_app, tmp_path):
    app, serving, seen = lora_app
    path = write_adapter(tmp_path / "sql")
    status, body = call(app, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(path)})
    assert status == 200, body
    status, listed = call(app, "/v1/models", method="GET")
    cards = {c["id"]: c for c in listed["data"]}
    assert cards["sql"]["parent"] == "tandem" and cards["sql"]["root"] == str(path.resolve())
    assert cards["tandem"]["parent"] is None
    status, body = call(app, "/v1/completions", {"model": "sql", "prompt": "p", "max_tokens": 2})
    assert status == 200 and body["model"] == "sql"
    assert seen[-1]["lora_name"].tolist() == [[b"sql"]]
    status, body = call(app, "/v1/completions", {"model": "tandem", "prompt": "p", "max_tokens": 2})
    assert status == 200 and "lora_name" not in seen[-1]
    status, body = call(app, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert status == 200
    status, body = call(app, "/v1/completions", {"model": "sql", "prompt": "p", "max_tokens": 2})
    assert status == 404 and body["error"]["param"] == "model"
    status, body = call(app, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert status == 404 and "'sql' is not loaded" in body["error"]["message"]


@pytest.mark.parametrize("make,why", [
    (lambda p: write_adapter(p, rank=16), "rank"),                          # above --max-lora-rank 8
    (lambda p: write_adapter(p, modules=("q_proj", "v_proj"), kv=KV * 2), "shape"),   # another base's
    (lambda p: p, "not a directory"),                                       # nothing there
])
def test_an_adapter_that_does_not_fit_is_a_400_and_not_registered(lora_app, tmp_path, make, why):
    app, serving, _ = lora_app
    path = make(tmp_path / "bad")
    status, body = call(app, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(path)})
    assert status == 400 and body["error"]["param"] == "lora_path", body
    assert why in body["error"]["message"].lower() or why in body["error"]["message"]
    assert serving.registry.names() == []


def test_a_name_twice_or_a_bad_name_is_a_400(lora_app, tmp_path):
    app, _, _ = lora_app
    path = write_adapter(tmp_path / "a")
    assert call(app, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(path)})[0] == 200
    status, body = call(app, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(path)})
    assert status == 400 and "already loaded" in body["error"]["message"]
    status, body = call(app, "/v1/load_lora_adapter", {"lora_name": "../x", "lora_path": str(path)})
    assert status == 400 and body["error"]["param"] == "lora_name"


def test_a_server_without_adapters_says_how_to_serve_them():
    from tandem.client.openai.app import create_app
    app = create_app("unused:1", ["tandem"], model_dir=DEMO)
    app.state.frontend.backend = FakeBackend(lambda a: steps("x"))
    status, body = call(app, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"})
    assert status == 400 and "--max-loras" in body["error"]["message"]
