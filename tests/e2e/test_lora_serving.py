"""LoRA adapters served end to end: `tandem serve --mode both --max-loras 2 --lora-modules
a=DIR --spec auto`, as a user starts it (the demo's MTP head and n-grams draft from the base, the
target verifies with the adapter). Each adapter's greedy text, through the OpenAI API (the model
field names it) and through the gRPC ensembles (``lora_name``, ``lora_task_id``), on the
disaggregated path (a short prompt prefilled by decode, a long one by the prefill process,
its KV computed under the adapter there) and the colocated one, equals the offline
engine's with the same adapter; the base model's text is untouched beside them. An
adapter loaded at run time serves at once and is gone once unloaded; an unknown one is
an error naming it."""
from __future__ import annotations

import json
import urllib.request

import pytest

from tandem.client.generate import GenerateError, stream_generate
from tandem.client.serve.triton_server import free_ports

from .servers import serve_command
from .triton_calls import post, post_json

pytestmark = pytest.mark.e2e
openai = pytest.importorskip("openai")
pytest.importorskip("peft")
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(demo_checkpoint, tmp_path_factory):
    from ..unit.lora.adapters import ATTENTION, make_adapter
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_adapter(demo_checkpoint, root / "a", seed=1, std=0.3),
            "b": make_adapter(demo_checkpoint, root / "b", targets=ATTENTION, r=8, seed=2, std=0.3)}


@pytest.fixture(scope="module")
def served(demo_checkpoint, adapters, tmp_path_factory):
    run = tmp_path_factory.mktemp("serve-lora")
    http, grpc, metrics, api = free_ports(4)
    with serve_command(
            "--model", str(demo_checkpoint), "--mode", "both", "--threads", "1", "--dtype", "float32",
            "--enforce-eager", "--spec", "auto", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"a={adapters['a']}",
            "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
            "--openai-port", str(api), "--run-dir", str(run / "run"), "--log-file", str(run / "server.log"),
            "--ready-timeout", "300", ready_timeout_s=360) as cmd:
        yield f"127.0.0.1:{grpc}", f"http://127.0.0.1:{api}/v1"


@pytest.fixture(scope="module")
def reference(demo_checkpoint, adapters):
    """The offline engine's greedy token ids with adapter ``name`` (None: the base)."""
    import torch

    from tandem.backends import LLM, SamplingParams
    from tandem.backends.lora import LoRARequest
    torch.set_num_threads(1)
    llm = LLM(str(demo_checkpoint), dtype="float32", max_loras=2, max_lora_rank=8)
    ids = {"a": 1, "b": 2}
    cache = {}

    def greedy(prompt: list[int], name: str | None) -> str:
        key = (tuple(prompt), name)
        if key not in cache:
            lora = None if name is None else LoRARequest(name, ids[name], str(adapters[name]))
            out = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                               lora=lora)[0]
            cache[key] = out.text
        return cache[key]
    return greedy


@pytest.fixture(scope="module")
def prompts(demo_checkpoint):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(demo_checkpoint / "tokenizer.json"))
    short = tok.encode("def fibonacci(n):\n    ").ids
    long = tok.encode("class Stack:\n    def push(self, item):\n        self.items.append(item)\n" * 14).ids[:300]
    assert len(long) > 256 >= len(short)     # conditional routing: decode prefills short, the prefill side long
    return {"short": short, "long": long}


def completion(base_url: str, model: str, prompt: list[int]) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].text


def grpc_text(url: str, model: str, prompt, **params) -> str:
    return "".join(r.text for r in stream_generate(url, prompt, model=model, max_tokens=MAX_TOKENS,
                                                   temperature=0.0, stream=True, timeout_s=120, **params))


def test_models_lists_the_adapter_with_its_base(served):
    _, base_url = served
    with urllib.request.urlopen(base_url + "/models") as r:
        cards = {c["id"]: c for c in json.loads(r.read())["data"]}
    assert cards["a"]["parent"] == "tandem" and cards["tandem"]["parent"] is None


@pytest.mark.parametrize("length", ["short", "long"])
def test_the_adapters_text_through_the_openai_api_is_the_offline_engines(served, reference, prompts, length):
    _, base_url = served
    p = prompts[length]
    want_a, want_base = reference(p, "a"), reference(p, None)
    assert want_a != want_base                       # the adapter does change the text
    assert completion(base_url, "a", p) == want_a
    assert completion(base_url, "tandem", p) == want_base


def test_the_gRPC_ensembles_take_the_adapter_by_name_and_by_task_id(served, reference, prompts, demo_checkpoint):
    url, _ = served
    p = prompts["short"]
    want = reference(p, "a")
    assert grpc_text(url, "tandem_tokens", p, lora_name="a") == want
    assert grpc_text(url, "tandem_tokens", p, lora_task_id=1) == want
    from tokenizers import Tokenizer
    text = Tokenizer.from_file(str(demo_checkpoint / "tokenizer.json")).decode(p)
    # the colocated path (llm) and the disaggregated text ensemble, from text
    assert grpc_text(url, "tandem_colocated", text, lora_name="a") == grpc_text(url, "tandem", text, lora_name="a")
    with pytest.raises(GenerateError, match="no LoRA adapter 'zzz' is loaded; loaded: a"):
        grpc_text(url, "tandem", text, lora_name="zzz")


def test_an_adapter_loaded_at_run_time_serves_at_once_and_goes_when_unloaded(served, reference, prompts, adapters):
    _, base_url = served
    p = prompts["long"]
    status, body = post(base_url + "/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])})
    assert status == 200 and body == "Success: LoRA adapter 'b' added successfully.", body
    assert completion(base_url, "b", p) == reference(p, "b")
    assert completion(base_url, "a", p) == reference(p, "a")       # both adapters in the slots
    status, body = post(base_url + "/unload_lora_adapter", {"lora_name": "b"})
    assert status == 200, body
    with pytest.raises(openai.NotFoundError):
        completion(base_url, "b", p)
    # the name again, from other files: the engines' idle old adapter gives way to the new one
    status, body = post(base_url + "/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["a"])})
    assert status == 200, body
    assert completion(base_url, "b", p) == reference(p, "a")
    status, body = post_json(base_url + "/load_lora_adapter", {"lora_name": "c", "lora_path": "/nonexistent"})
    assert status == 400 and body["error"]["param"] == "lora_path"


def test_a_tensorrt_llm_client_sends_its_adapter_with_the_first_request(served, reference, prompts, adapters):
    """lora_task_id with lora_weights / lora_config (fp16, the layout hf_lora_convert.py
    writes) on the first request; the task id alone after, as TensorRT-LLM caches it."""
    from ..unit.triton.test_trtllm_lora import trtllm_tensors
    url, _ = served
    weights, config = trtllm_tensors(adapters["b"])
    p = prompts["short"]
    want = reference(p, "b")

    def run(with_tensors: bool) -> str:
        tensors = dict(lora_weights=weights, lora_config=config) if with_tensors else {}
        return grpc_text(url, "tandem_tokens", p, lora_task_id=77, **tensors)

    assert run(with_tensors=True) == want
    assert run(with_tensors=False) == want
