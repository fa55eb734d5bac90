"""PEFT adapters read and checked against the base model, and the pool of adapter slots:
each error names the adapter and what is wrong; slots load, are held, evicted LRU."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.backends.lora import LoRAPool, LoRARequest, load_adapter
from tandem.backends.lora.pool import GROUPS
from tandem.backends.models import ModelConfig

from ..tiny_checkpoints import make_checkpoint
from .adapters import make_adapter


@pytest.fixture(scope="module")
def base(checkpoint_root):
    return make_checkpoint("llama_gqa_untied", checkpoint_root)


@pytest.fixture(scope="module")
def cfg(base):
    return ModelConfig.from_dir(base)


@pytest.fixture(scope="module")
def good(base, checkpoint_root):
    return make_adapter(base, checkpoint_root / "lora_good", r=4, alpha=8)


def edited(good, tmp_path, config=None, tensors=None):
    """A copy of ``good`` with its config updated by ``config`` and its tensors by ``tensors``
    (a function of the tensor dict)."""
    out = tmp_path / "edited"
    shutil.copytree(good, out)
    if config:
        c = json.loads((out / "adapter_config.json").read_text())
        c.update(config)
        (out / "adapter_config.json").write_text(json.dumps(c))
    if tensors:
        t = load_file(str(out / "adapter_model.safetensors"))
        save_file(tensors(t), str(out / "adapter_model.safetensors"))
    return out


def test_reads_rank_scaling_and_every_adapted_layer(good, cfg):
    a = load_adapter("good", good, cfg, max_rank=16)
    assert (a.rank, a.scaling) == (4, 2.0)
    assert len(a.weights) == 7 * cfg.num_hidden_layers
    A, B = a.weights[(1, "k_proj")]
    assert A.shape == (4, cfg.hidden_size) and B.shape == (cfg.kv_size, 4)


def test_rslora_scales_by_the_square_root_of_the_rank(good, cfg, tmp_path):
    a = load_adapter("rs", edited(good, tmp_path, {"use_rslora": True}), cfg, max_rank=16)
    assert a.scaling == pytest.approx(8 / math.sqrt(4))


def drop_key(part):
    return lambda t: {k: v for k, v in t.items() if part not in k}


def rename(old, new):
    return lambda t: {k.replace(old, new): v for k, v in t.items()}


def reshape_first(t):
    k = next(k for k in t if k.endswith("q_proj.lora_A.weight"))
    return {**t, k: torch.zeros(4, 7)}


BAD = {
    "rank above max": ({}, None, 2, "rank 4 is above max_lora_rank=2"),
    "bias": ({"bias": "all"}, None, 16, "bias='all' is not supported"),
    "dora": ({"use_dora": True}, None, 16, "use_dora=True is not supported"),
    "fan_in_fan_out": ({"fan_in_fan_out": True}, None, 16, "fan_in_fan_out=True is not supported"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, None, 16, "modules_to_save"),
    "rank_pattern": ({"rank_pattern": {"q_proj": 8}}, None, 16, "rank_pattern"),
    "unknown target": ({"target_modules": ["q_proj", "lm_head"]}, None, 16,
                       "target module(s) ['lm_head'] are not in this model"),
    "regex targets": ({"target_modules": ".*proj"}, None, 16, "allowed: a list of"),
    "not lora": ({"peft_type": "IA3"}, None, 16, "peft_type 'IA3'"),
    "shape does not fit": ({}, reshape_first, 16, "has shape (4, 7)"),
    "module the model lacks": ({}, rename("self_attn.q_proj", "self_attn.qkv_proj"), 16,
                               "target module self_attn.qkv_proj is not in this model"),
    "layer past the model": ({}, rename("layers.1.", "layers.9."), 16, "layer 9 is past the model's 2 layers"),
    "A without B": ({}, drop_key("layers.0.mlp.up_proj.lora_B"), 16, "not both A and B"),
    "embedding adapter": ({}, lambda t: {**t, "base_model.model.model.embed_tokens.lora_embedding_A":
                                         torch.zeros(4, 384)}, 16, "adapts no layer"),
}


@pytest.mark.parametrize("case", BAD)
def test_unsupported_or_unfitting_adapters_are_refused_by_name(good, cfg, tmp_path, case):
    config, tensors, max_rank, why = BAD[case]
    path = edited(good, tmp_path, config, tensors)
    with pytest.raises(ValueError, match="LoRA adapter 'mine'") as e:
        load_adapter("mine", path, cfg, max_rank=max_rank)
    assert why in str(e.value)


def test_missing_or_corrupt_files_are_clear_errors(good, cfg, tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        load_adapter("x", tmp_path / "nowhere", cfg, 16)
    path = edited(good, tmp_path)
    (path / "adapter_model.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="cannot read .*adapter_model.safetensors"):
        load_adapter("x", path, cfg, 16)


def test_an_adapter_for_another_base_does_not_fit(checkpoint_root, cfg):
    other = make_checkpoint("qwen3", checkpoint_root)     # head_dim 32: other q/k/v widths
    path = make_adapter(other, checkpoint_root / "lora_qwen3", targets=("q_proj",), r=2)
    with pytest.raises(ValueError, match="LoRA adapter 'q3'.*q_proj.*needs"):
        load_adapter("q3", path, cfg, 16)


def test_request_fields_are_checked():
    with pytest.raises(ValueError, match="id 0"):
        LoRARequest("a", 0, ".")
    with pytest.raises(ValueError, match="non-empty"):
        LoRARequest("", 1, ".")


# -- the pool ----------------------------------------------------------------------------

def test_slots_hold_the_scaled_product_and_slot_zero_stays_empty(good, cfg):
    pool = LoRAPool(cfg, max_loras=2, max_rank=8)
    slot = pool.acquire(LoRARequest("good", 1, str(good)))
    assert slot == 1
    a = load_adapter("good", good, cfg, 8)
    A, B = pool.weights(1, "qkv")
    # the fused q/k/v delta is [dq | dk | dv] with d = scaling * B_m A_m, each a rank-4 block
    fused = A[slot] @ B[slot]
    cols = [cfg.q_size, cfg.kv_size, cfg.kv_size]
    for m, part in zip(GROUPS["qkv"], fused.split(cols, dim=1)):
        Am, Bm = a.weights[(1, m)]
        torch.testing.assert_close(part, a.scaling * (Bm @ Am).T)
    for g in GROUPS:
        for layer in range(cfg.num_hidden_layers):
            assert not pool.A[g][layer][0].any() and not pool.B[g][layer][0].any()


def test_full_pool_evicts_the_least_recently_released_and_refuses_when_all_are_held(
        base, cfg, checkpoint_root):
    paths = [make_adapter(base, checkpoint_root / f"lora_pool_{i}", targets=("v_proj",), r=2, seed=i)
             for i in range(3)]
    reqs = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    pool = LoRAPool(cfg, max_loras=2, max_rank=4)
    s0, s1 = pool.acquire(reqs[0]), pool.acquire(reqs[1])
    assert pool.acquire(reqs[0]) == s0          # loaded: the same slot, held twice
    with pytest.raises(ValueError, match=r"LoRA adapter 'a2': all 2 adapter slots are held .*a0, a1"):
        pool.acquire(reqs[2])
    pool.release(s1)
    pool.release(s0)
    pool.release(s0)                            # a1 released first: the LRU one
    assert pool.acquire(reqs[2]) == s1 and pool.evictions == 1
    assert pool.by_name == {"a0": s0, "a2": s1}
    # an evicted slot is rewritten: it now holds a2's v_proj only
    a2 = load_adapter("a2", paths[2], cfg, 4)
    A, B = pool.weights(0, "qkv")
    Av, Bv = a2.weights[(0, "v_proj")]
    torch.testing.assert_close((A[s1] @ B[s1])[:, -cfg.kv_size:], a2.scaling * (Bv @ Av).T)
    assert not (A[s1] @ B[s1])[:, :-cfg.kv_size].any()
    assert pool.groups(s1) == {"qkv"}
    assert pool.width(s1, "qkv") == 3 * 2 and pool.width(s1, "gate_up") == 2 * 2
    stats = pool.stats()
    assert stats.loaded == {"a0": 0, "a2": 1} and stats.requests == {"a0": 2, "a1": 1, "a2": 1}
    assert (stats.loads, stats.evictions, stats.max_loras) == (3, 1, 2)


def test_a_bad_adapter_evicts_nothing_and_one_name_is_one_adapter(base, good, cfg, checkpoint_root):
    pool = LoRAPool(cfg, max_loras=1, max_rank=2)
    pool.release(pool.acquire(LoRARequest("small", 1, str(make_adapter(
        base, checkpoint_root / "lora_pool_0", targets=("v_proj",), r=2)))))
    with pytest.raises(ValueError, match="rank 4 is above"):
        pool.acquire(LoRARequest("big", 2, str(good)))
    assert pool.by_name == {"small": 1} and pool.evictions == 0
    # the name loaded again from other files (unloaded and reloaded through the API): an
    # idle old adapter is replaced once the new one has loaded; a bad new one changes nothing
    with pytest.raises(ValueError, match="rank 4 is above"):
        pool.acquire(LoRARequest("small", 3, str(good)))
    assert pool.slots[1].path == str(checkpoint_root / "lora_pool_0")
    other = make_adapter(base, checkpoint_root / "lora_pool_1", targets=("q_proj",), r=2, seed=5)
    held = pool.acquire(LoRARequest("small", 3, str(other)))
    assert pool.slots[held].path == str(other) and pool.slots[held].groups == frozenset({"qkv"})
    # held by a running request, it stays: one name, one adapter at a time
    with pytest.raises(ValueError, match="one name, one adapter"):
        pool.acquire(LoRARequest("small", 1, str(checkpoint_root / "lora_pool_0")))


def test_preload_and_unload(good, cfg):
    pool = LoRAPool(cfg, max_loras=1, max_rank=4)
    lora = LoRARequest("good", 1, str(good))
    slot = pool.preload(lora)
    assert pool.stats().loaded == {"good": 0} and pool.stats().requests == {"good": 0}
    held = pool.acquire(lora)
    assert held == slot and pool.loads == 1          # preloaded: no second read
    with pytest.raises(ValueError, match="held by 1 running request"):
        pool.unload("good")
    pool.release(held)
    assert pool.unload("good") and not pool.unload("good")
    assert pool.stats().loaded == {} and not pool.idle
    assert pool.acquire(lora) == 1 and pool.loads == 2    # loads afresh into the freed slot
