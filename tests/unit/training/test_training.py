"""Training pipeline: corpus, tokenizer, a tiny LM run, HF export parity."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from tandem.backends.models import ModelConfig, LlamaForCausalLM, forward_dense, load_model
from tandem.backends.models.loader import hf_to_tandem
from tandem.backends.training.corpus import (
    PROMPT_KINDS, build_corpus, extract_prompts, held_out_prompts, is_validation, list_sources,
    stdlib_root, Document)
from tandem.backends.training.hf_export import tandem_to_hf
from tandem.backends.training.lm import LMTrainConfig, train_lm
from tandem.backends.training.loop import OptimConfig, lr_at
from tandem.backends.training.tokenizer import (
    BOS, EOS, encode_documents, load_tokenizer, save_tokenizer, train_tokenizer)

TINY = {
    "model": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2},
    "data": {"vocab_size": 400, "val_fraction": 0.25},
    "optim": {"batch_size": 4, "seq_len": 64, "steps": 40, "lr": 3e-3, "warmup_steps": 4,
              "log_every": 10, "eval_every": 10, "eval_windows": 8, "amp": "none"},
}


@pytest.fixture(scope="module")
def small_root(tmp_path_factory):
    """A corpus root holding 24 small stdlib modules (train and validation both non-empty)."""
    root = tmp_path_factory.mktemp("stdlib")
    src = stdlib_root()
    picked = [p for p in list_sources(src) if "/" not in p and (src / p).stat().st_size < 12_000]
    for rel in picked[:24]:
        shutil.copy(src / rel, root / rel)
    return root


@pytest.fixture(scope="module")
def tiny_run(small_root, tmp_path_factory):
    work = tmp_path_factory.mktemp("work")
    cfg = LMTrainConfig.from_dict(TINY | {"data": TINY["data"] | {"root": str(small_root)}})
    torch.set_num_threads(1)
    result = train_lm(cfg, work / "run", out_dir=work / "out")
    return cfg, work, result


# --- corpus -------------------------------------------------------------------------

def test_corpus_is_deterministic_and_excludes_tests():
    a, b = build_corpus(), build_corpus()
    assert a.manifest() == b.manifest()
    paths = [d.path for d in a.train + a.validation]
    assert [d.path for d in a.train] == sorted(d.path for d in a.train)
    assert not set(d.path for d in a.train) & set(d.path for d in a.validation)
    for p in paths:
        parts = p.split("/")[:-1]
        assert not {"test", "tests", "site-packages", "idlelib"} & set(parts), p
    assert 0.02 < len(a.validation) / len(paths) < 0.1


def test_split_depends_only_on_the_path():
    assert is_validation("json/decoder.py", 0.05) == is_validation("json/decoder.py", 0.05)
    assert all(not is_validation(f"m{i}.py", 0.0) for i in range(100))
    assert all(is_validation(f"m{i}.py", 1.0) for i in range(100))


def test_held_out_prompts_come_from_validation_files():
    corpus = build_corpus()
    prompts = held_out_prompts(corpus, per_kind=16)
    assert prompts == held_out_prompts(build_corpus(), per_kind=16)
    val_paths = {d.path for d in corpus.validation}
    assert {p.kind for p in prompts} == set(PROMPT_KINDS)
    assert all(p.path in val_paths for p in prompts)


def test_extract_prompts_headers():
    src = ('import os\n\nclass A(Base):\n    """Doc of A."""\n\n'
           '    def f(self,\n          x):  # two lines\n        """Return x twice."""\n'
           '        return x * 2\n')
    prompts = {p.kind: p for p in extract_prompts(Document("m.py", src))}
    assert prompts["class_header"].prompt.endswith("class A(Base):")
    assert prompts["function_signature"].prompt.endswith("          x):  # two lines")
    assert prompts["docstring_opening"].prompt.endswith('        """Return x twice."""')
    assert prompts["function_signature"].reference.startswith('\n        """Return')


# --- tokenizer ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_tokenizer(small_root):
    return train_tokenizer(build_corpus(small_root, 0.25).train, vocab_size=400)


SOURCES = [
    "def f(x):\n    return x + 1\n",
    "class A:\n\tpass\n\n\n# tabs, unicode: é ü → λ 🐍\n",
    "PATTERN = r'(?P<s>\\d+)'  # a literal <s> and </s> in source\n",
    "",
    "    \n  \r\n trailing   \n",
]


@pytest.mark.parametrize("text", SOURCES)
def test_tokenizer_round_trips_python_source(small_tokenizer, text):
    (ids,) = encode_documents(small_tokenizer, [text])
    bos, eos = small_tokenizer.token_to_id(BOS), small_tokenizer.token_to_id(EOS)
    assert ids[0] == bos and ids[-1] == eos
    assert bos not in ids[1:-1] and eos not in ids[1:-1]
    assert small_tokenizer.decode(ids[1:-1], skip_special_tokens=False) == text


def test_tokenizer_files_load_in_transformers(small_tokenizer, tmp_path):
    transformers = pytest.importorskip("transformers")
    save_tokenizer(small_tokenizer, tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = SOURCES[0]
    assert hf(text).input_ids == load_tokenizer(tmp_path).encode(text).ids
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == ("<s>", "</s>", "<pad>")
    assert hf.decode(hf(text).input_ids, skip_special_tokens=True) == text


def test_tokenizer_training_is_deterministic(small_root):
    docs = build_corpus(small_root, 0.25).train
    a, b = train_tokenizer(docs, 400), train_tokenizer(docs, 400)
    assert a.to_str() == b.to_str()


# --- training -----------------------------------------------------------------------

def test_lr_schedule():
    o = OptimConfig(lr=1.0, warmup_steps=10, steps=110, min_lr_ratio=0.1)
    assert lr_at(0, o) == pytest.approx(0.1)
    assert lr_at(9, o) == pytest.approx(1.0)
    assert lr_at(60, o) == pytest.approx(0.55)
    assert lr_at(110, o) == pytest.approx(0.1)


def test_tiny_training_run_lowers_loss(tiny_run):
    cfg, work, result = tiny_run
    history = result["history"]
    assert result["step"] == cfg.optim.steps
    assert history[-1]["val_loss"] < history[0]["val_loss"] - 0.3
    assert result["val_loss_full"] < math.log(400) - 0.5  # uniform guessing = ln(vocab)
    summary = json.loads((work / "out" / "training.json").read_text())
    assert summary["step"] == cfg.optim.steps
    best = json.loads((work / "run" / "best" / "training.json").read_text())
    assert best["step"] == result["best_val_step"]


def test_resume_reproduces_an_uninterrupted_run(small_root, tmp_path):
    d = TINY | {"data": TINY["data"] | {"root": str(small_root)},
                "optim": TINY["optim"] | {"steps": 12, "eval_every": 6}}
    cfg = LMTrainConfig.from_dict(d)
    torch.set_num_threads(1)
    train_lm(cfg, tmp_path / "a", max_steps=5)
    with pytest.raises(FileExistsError):
        train_lm(cfg, tmp_path / "a")
    resumed = train_lm(cfg, tmp_path / "a", resume=True)
    straight = train_lm(cfg, tmp_path / "b")
    assert resumed["step"] == straight["step"] == 12
    a = torch.load(tmp_path / "a" / "state.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "b" / "state.pt", weights_only=False)["model"]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


@pytest.mark.parametrize("tied,kv_heads", [(False, 2), (True, 4), (False, 1)])
def test_hf_key_mapping_round_trips(tied, kv_heads):
    cfg = ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": kv_heads,
        "tie_word_embeddings": tied})
    model = LlamaForCausalLM(cfg)
    sd = model.state_dict()
    hf = tandem_to_hf(sd, cfg)
    assert "model.layers.1.self_attn.k_proj.weight" in hf and "model.layers.0.mlp.up_proj.weight" in hf
    assert ("lm_head.weight" in hf) != tied
    back = hf_to_tandem(hf, cfg)
    expected = {k: v for k, v in sd.items() if not (tied and k == "lm_head.weight")}
    assert back.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(back[k], expected[k], rtol=0, atol=0)


def _greedy(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        logits = model.compute_logits(forward_dense(model, ids))
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_loads_in_engine_and_transformers_with_same_greedy_output(tiny_run, dtype):
    transformers = pytest.importorskip("transformers")
    _, work, _ = tiny_run
    out = work / "out"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt = torch.tensor([tok("def main(argv):\n    ").input_ids])
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=dtype).eval()
    ours = load_model(out, dtype)
    # bf16: models.layers.RMSNorm uses F.rms_norm (weight applied before rounding) where
    # HF rounds, then multiplies; logits then differ by about one bf16 ulp
    atol = 1e-4 if dtype == torch.float32 else 0.05
    with torch.no_grad():
        torch.testing.assert_close(ours.compute_logits(forward_dense(ours, prompt)),
                                   hf(prompt).logits.float(), rtol=0, atol=atol)
        # bf16 without KV cache: HF's incremental decode rounds differently from a full
        # recompute and flips near-tied tokens; our loop recomputes, so HF must as well
        expected = hf.generate(prompt, max_new_tokens=16, do_sample=False,
                               eos_token_id=None, pad_token_id=tok.pad_token_id,
                               use_cache=dtype == torch.float32)
        got = _greedy(ours, prompt, 16)
    assert got.tolist() == expected.tolist()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "prompts.json", "config.json", "model.safetensors"):
        assert (out / name).is_file(), name


# --- CLI ----------------------------------------------------------------------------

def test_train_cli_parses_and_reports_config_errors(tmp_path, capsys):
    import argparse

    from tandem.client.train import cli as train_cli

    parser = argparse.ArgumentParser(prog="tandem")
    train_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train", "lm", "--config", "configs/target.json", "--out", "o",
                              "--resume", "--max-steps", "5"])
    assert (args.func, args.resume, args.max_steps, args.threads) == (train_cli.run_lm, True, 5, 1)

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": {}, "optim": {"learning_rate": 1}}))
    assert train_cli.main(["lm", "--config", str(bad), "--out", str(tmp_path / "o"),
                           "--work-dir", str(tmp_path / "w")]) == 2
    assert "unknown OptimConfig keys ['learning_rate']" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["target.json", "draft.json", "draft_distill.json",
                                  "draft_selfdistill.json"])
def test_shipped_configs_parse(name):
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "configs" / name
    cfg = LMTrainConfig.from_file(path)
    assert cfg.optim.seq_len >= 256 and cfg.model["num_hidden_layers"] >= 1


def test_init_from_starts_at_the_given_checkpoint(tiny_run, small_root, tmp_path):
    cfg, work, result = tiny_run
    d = cfg.to_dict() | {"init_from": str(work / "out")}
    d["optim"] = d["optim"] | {"steps": 2, "eval_every": 1, "lr": 1e-9, "warmup_steps": 1}
    cont = train_lm(LMTrainConfig.from_dict(d), tmp_path / "c", max_steps=1)
    # the bf16 export differs from the fp32 weights by rounding only
    assert cont["history"][0]["val_loss"] == pytest.approx(result["history"][-1]["val_loss"], abs=0.05)
    d["model"] = d["model"] | {"intermediate_size": 96}
    with pytest.raises(ValueError, match="init_from"):
        train_lm(LMTrainConfig.from_dict(d), tmp_path / "d", max_steps=1)


def test_sample_parse_check_looks_at_the_header_block():
    from tandem.backends.training.samples import header_block, parses_as_python

    prompt = "x = 1\n\nclass A:\n    def f(self,\n          y):"
    good = "\n        return y\n\n    def g(self):\n        retu"
    assert header_block(prompt, good) == "def f(self,\n      y):\n    return y\n\n"
    assert parses_as_python(header_block(prompt, good))
    assert not parses_as_python(header_block(prompt, "\n        return y)]\n    x = 2\n"))
    assert parses_as_python(header_block(prompt, '\n        """Ret'))


def test_distillation_loss_mixes_ce_and_kl():
    from tandem.backends.training.lm import DistillConfig, lm_loss

    cfg = ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": 40, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 1, "num_attention_heads": 2})
    torch.manual_seed(0)
    student, teacher = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg)
    batch = torch.randint(0, 40, (2, 9))
    ce = lm_loss(student, batch, "none")
    same = lm_loss(student, batch, "none", student, DistillConfig("-", alpha=0.25))
    torch.testing.assert_close(same, 0.75 * ce)        # KL(p || p) = 0
    other = lm_loss(student, batch, "none", teacher, DistillConfig("-", alpha=0.25))
    assert other > same
