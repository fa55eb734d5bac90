"""TensorRT-LLM's adapter tensors (lora_weights, lora_config) as a PEFT adapter
(backends/triton/trtllm_lora.py): what a TensorRT-LLM client sends with its first request
runs, through the engine, exactly as the PEFT adapter it was converted from."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tandem.backends import LLM, SamplingParams
from tandem.backends.lora import LoRARequest
from tandem.backends.triton.generate_request import RequestError, parse_token_request
from tandem.backends.triton.lora_registry import AdapterRegistry
from tandem.backends.triton.lora_requests import adapter_entry
from tandem.backends.triton.trtllm_lora import AdapterTensorsError, peft_tensors

from ..lora.adapters import make_adapter
from ..tiny_checkpoints import make_checkpoint

MODULE_IDS = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "up_proj": 5, "down_proj": 6, "gate_proj": 7}


def trtllm_tensors(adapter_dir) -> tuple[np.ndarray, np.ndarray]:
    """A PEFT adapter as TensorRT-LLM's hf_lora_convert.py writes it: per module and layer
    one row, A flattened then B (scaled by alpha / r) flattened, padded to the widest; fp16."""
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    rows, config = [], []
    for key in sorted(k for k in tensors if k.endswith("lora_A.weight")):
        parts = key.split(".")
        layer, module = int(parts[4]), parts[6]
        a, b = tensors[key], tensors[key.replace("lora_A", "lora_B")] * scale
        rows.append(torch.cat([a.flatten(), b.flatten()]))
        config.append([MODULE_IDS[module], layer, a.shape[0]])
    width = max(len(r) for r in rows)
    weights = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])
    return weights.half().numpy()[None], np.array([config], dtype=np.int32)


@pytest.fixture(scope="module")
def base(checkpoint_root):
    return make_checkpoint("llama_gqa_untied", checkpoint_root)


def request(task_id, weights=None, config=None):
    arrays = {"input_ids": np.array([[5, 6, 7]], dtype=np.int32),
              "lora_task_id": np.array([[task_id]], dtype=np.uint64)}
    if weights is not None:
        arrays |= {"lora_weights": weights, "lora_config": config}
    return parse_token_request(arrays.get, vocab_size=400, max_model_len=64)


def test_the_first_request_writes_the_adapter_and_later_ones_find_it(base, checkpoint_root, tmp_path):
    peft = make_adapter(base, checkpoint_root / "trtllm_src", r=4, alpha=8, seed=3, std=0.05)
    weights, config = trtllm_tensors(peft)
    reg = AdapterRegistry(tmp_path / "reg", json.loads((base / "config.json").read_text()), max_rank=8)
    with pytest.raises(RequestError, match="no LoRA adapter 11 is loaded"):
        adapter_entry(request(11), reg)                     # a task id never sent with its tensors
    entry = adapter_entry(request(11, weights, config), reg)
    assert (entry.name, entry.id) == ("task-11", 11)
    assert adapter_entry(request(11), reg) == entry       # cached: the task id alone
    llm = LLM(base, dtype="float32", max_loras=2, max_lora_rank=8)
    prompts = [[5, 17, 99, 3, 250], [7, 7, 41]]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompts, greedy, lora=LoRARequest("src", 1, str(peft)))]
    got = [o.token_ids for o in llm.generate(prompts, greedy, lora=LoRARequest(entry.name, entry.id, entry.path))]
    assert got == want
    assert want != [o.token_ids for o in llm.generate(prompts, greedy)]     # the adapter changes the text


def test_a_combined_qkv_row_is_q_k_and_v_sharing_one_a(base):
    cfg = json.loads((base / "config.json").read_text())
    h = cfg["hidden_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, h)), rng.standard_normal((q + 2 * kv, 2))
    rank, tensors = peft_tensors(np.concatenate([a.ravel(), b.ravel()])[None], np.array([[0, 1, 2]]), cfg, 8)
    key = "base_model.model.model.layers.1.self_attn"
    assert rank == 2
    for m in ("q_proj", "k_proj", "v_proj"):
        np.testing.assert_allclose(tensors[f"{key}.{m}.lora_A.weight"], a, rtol=1e-6)
    np.testing.assert_allclose(tensors[f"{key}.k_proj.lora_B.weight"], b[q:q + kv], rtol=1e-6)


@pytest.mark.parametrize("config,field,why", [
    ([[9, 0, 2]], "lora_config", "module id 9"),            # cross attention: nothing here
    ([[1, 99, 2]], "lora_config", "layer 99"),
    ([[1, 0, 32]], "lora_config", "allowed: 1..8"),          # above --max-lora-rank
    ([[1, 0, 2], [1, 0, 2]], "lora_config", "twice"),
    ([[1, 0, 4]], "lora_weights", "needs"),                  # the row is too short for rank 4
])
def test_tensors_that_do_not_fit_are_refused_naming_the_row(base, config, field, why):
    cfg = json.loads((base / "config.json").read_text())
    weights = np.zeros((len(config), 2 * cfg["hidden_size"] * 2 + 8))
    if why == "needs":
        weights = weights[:, :10]
    with pytest.raises(AdapterTensorsError) as e:
        peft_tensors(weights, np.array(config), cfg, 8)
    assert e.value.field == field and why in e.value.why
