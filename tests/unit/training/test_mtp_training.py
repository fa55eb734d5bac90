"""MTP-head training: the training forward is the engine's, a tiny
run learns, the saved head serves losslessly, acceptance is measured through the engine."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tandem.backends import LLM, SamplingParams, SpeculativeConfig
from tandem.backends.kv_cache import KVPagePool
from tandem.backends.models import forward_dense, load_model
from tandem.backends.models.mtp import MTPHead, load_mtp_head
from tandem.backends.engine.proposers import MTPProposer
from tandem.backends.training.acceptance import evaluate_proposers
from tandem.backends.training.hidden_states import compute_hidden_states, train_windows
from tandem.backends.training.mtp import (MTPTrainConfig, TokenStreams, load_token_streams,
                                          train_mtp, unrolled_forward)

from ..hf_reference import prompts
from ..tiny_checkpoints import make_checkpoint_with_tokenizer

TINY = {"mtp": {"num_windows": 24, "hidden_dtype": "float32"},
        "optim": {"batch_size": 4, "seq_len": 32, "steps": 40, "lr": 3e-3, "warmup_steps": 4,
                  "weight_decay": 0.0, "log_every": 10, "eval_every": 20, "eval_windows": 4,
                  "amp": "none"}}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def target_dir(checkpoint_root):
    out = make_checkpoint_with_tokenizer(checkpoint_root)
    if not (out / "prompts.json").exists():
        (out / "prompts.json").write_text(json.dumps(
            [{"kind": kind, "path": "x.py", "line": i, "prompt": text, "reference": ""}
             for i, (kind, text) in enumerate([
                 ("function_signature", "def make_checkpoint(name, root):"),
                 ("class_header", "class Tokenizer:"),
                 ("docstring_opening", 'def f():\n    """Save a random')] * 2)]))
    return out


@pytest.fixture(scope="module")
def streams(target_dir) -> TokenStreams:
    """This repository's tiny_checkpoints.py, tokenized: text with some structure."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    ids = torch.tensor(tok.encode(Path(__file__).parents[1].joinpath("tiny_checkpoints.py").read_text()).ids)
    ids = ids.repeat(3)
    return TokenStreams(ids[: int(0.8 * len(ids))], ids[int(0.8 * len(ids)):])


def tiny_config(**mtp) -> MTPTrainConfig:
    return MTPTrainConfig.from_dict({"mtp": TINY["mtp"] | mtp, "optim": TINY["optim"]})


@pytest.fixture(scope="module")
def runs(target_dir, streams, tmp_path_factory):
    """Tiny runs with and without the norms: (summary, head dir) per use_norms."""
    root = tmp_path_factory.mktemp("mtp_runs")
    out = {}
    for use_norms in (True, False):
        work = root / f"work-{use_norms}"
        result = train_mtp(tiny_config(use_norms=use_norms), target_dir, streams, work,
                           root / f"head-{use_norms}")
        out[use_norms] = (result, root / f"head-{use_norms}")
    return out


# -- the training forward is the inference forward -------------------------------------------

@pytest.mark.parametrize("use_norms", [True, False])
@pytest.mark.parametrize("page_size,kv_layout", [(1, "HND"), (4, "NHD"), (16, "HND")])
def test_training_forward_matches_engine_proposer(target_dir, use_norms, page_size, kv_layout):
    target = load_model(target_dir)
    cfg = target.config
    torch.manual_seed(0)
    head = MTPHead(cfg, use_norms=use_norms).eval()
    tokens = torch.randint(3, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        hidden = forward_dense(target, tokens)
        step1, step2 = unrolled_forward(head, target, tokens, hidden, steps=2)
    per_seq = 32 // page_size
    pool = KVPagePool(1, 2 * per_seq, cfg.num_key_value_heads, page_size, cfg.head_dim,
                      torch.float32, kv_layout)
    proposer = MTPProposer(head, target, pool)
    seqs = [SimpleNamespace(pages=list(range(b * per_seq, (b + 1) * per_seq))) for b in range(2)]

    # step 1 (what catch_up / after_verify compute): rows 0..9 as one prefill, then decodes
    _, g = proposer._run(seqs, tokens[:, 1:11].tolist(), [0, 0], hidden[:, :10].reshape(20, -1))
    rows = [g.view(2, 10, -1)]
    for i in range(10, 22):
        _, g = proposer._run(seqs, tokens[:, i + 1:i + 2].tolist(), [i, i], hidden[:, i])
        rows.append(g.view(2, 1, -1))
    torch.testing.assert_close(torch.cat(rows, 1), step1, atol=1e-5, rtol=1e-5)

    # step 2 (what propose computes): the cache holds rows 0..i, the head reads its own g_i
    for i in (0, 7, 20):
        _, g1 = proposer._run(seqs, tokens[:, 1:i + 2].tolist(), [0, 0],
                              hidden[:, :i + 1].reshape(2 * (i + 1), -1))
        last = g1.view(2, i + 1, -1)[:, -1]
        _, g2 = proposer._run(seqs, tokens[:, i + 2:i + 3].tolist(), [i + 1, i + 1], last)
        torch.testing.assert_close(g2, step2[:, i], atol=1e-5, rtol=1e-5)


def test_hidden_states_come_from_the_engine_and_match_dense(target_dir, streams):
    target = load_model(target_dir)
    windows = train_windows(streams.train, 5, 32, seed=0)
    assert len({tuple(w) for w in windows.tolist()}) == 5      # distinct windows
    paged = compute_hidden_states(target, windows, batch_windows=2, page_size=4)
    with torch.no_grad():
        dense = forward_dense(target, windows)
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-5)


# -- a tiny run ----------------------------------------------------------------------------

@pytest.mark.parametrize("use_norms", [True, False])
def test_tiny_run_lowers_the_loss(runs, use_norms):
    result, _ = runs[use_norms]
    first, last = result["history"][0], result["history"][-1]
    assert first["step"] == 0 and last["step"] == 40
    # the random tiny target's next-token distributions are nearly flat, so its entropy
    # dominates the cross-entropy; the KL to it is what the head can lower
    assert last["kl"][0] < 0.5 * first["kl"][0]
    assert last["ce"][0] < first["ce"][0]
    assert last["top1"][0] > first["top1"][0] + 0.05
    assert result["best"]["step"] > 0


def test_resumed_run_equals_uninterrupted(target_dir, streams, tmp_path):
    cfg = tiny_config(unroll=2)
    cfg.optim.steps = 12
    train_mtp(cfg, target_dir, streams, tmp_path / "a")
    train_mtp(cfg, target_dir, streams, tmp_path / "b", max_steps=5)
    with pytest.raises(FileExistsError):
        train_mtp(cfg, target_dir, streams, tmp_path / "b")
    train_mtp(cfg, target_dir, streams, tmp_path / "b", resume=True)
    a, b = (torch.load(tmp_path / w / "state.pt", weights_only=False) for w in "ab")
    assert a["step"] == b["step"] == 12
    for k, v in a["head"].items():
        assert torch.equal(v, b["head"][k]), k


# -- the saved head in the engine ----------------------------------------------------------

@pytest.mark.parametrize("use_norms", [True, False])
def test_saved_head_is_small_and_shares_the_targets_weights(runs, target_dir, use_norms):
    _, head_dir = runs[use_norms]
    cfg = json.loads((head_dir / "config.json").read_text())
    assert cfg["use_norms"] is use_norms and cfg["torch_dtype"] == "bfloat16"
    keys = set(load_file(str(head_dir / "model.safetensors")))
    assert not any("embed_tokens" in k or "lm_head" in k for k in keys)    # never copied
    assert any("norm" in k for k in keys if not k.startswith("layer.")) is use_norms
    head = load_mtp_head(head_dir, load_model(target_dir))
    assert head.use_norms is use_norms
    assert json.loads((head_dir / "training.json").read_text())["step"] == 40


@pytest.mark.parametrize("use_norms", [True, False])
@pytest.mark.parametrize("k", [1, 3])
def test_saved_head_serves_losslessly(runs, target_dir, use_norms, k):
    _, head_dir = runs[use_norms]
    ps = prompts(384)[:4]
    plain = LLM(str(target_dir)).generate(ps, GREEDY)
    llm = LLM(str(target_dir), speculative=SpeculativeConfig("mtp", k, mtp_head=str(head_dir)))
    spec = llm.generate(ps, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.engine.spec_metrics.num_drafts > 0


def test_cli_trains_a_head_from_a_token_cache(target_dir, streams, tmp_path):
    from tandem.client.train.cli import main
    data = tmp_path / "data"
    data.mkdir()
    torch.save({"train": streams.train, "validation": streams.validation}, data / "tokens.pt")
    (tmp_path / "mtp.json").write_text(json.dumps(TINY | {"optim": TINY["optim"] | {"steps": 4}}))
    rc = main(["mtp", "--target", str(target_dir), "--data", str(data), "--out",
               str(tmp_path / "head"), "--config", str(tmp_path / "mtp.json"), "--no-norms",
               "--work-dir", str(tmp_path / "work"), "--hidden-cache", str(tmp_path / "hidden")])
    assert rc == 0
    assert json.loads((tmp_path / "head" / "config.json").read_text())["use_norms"] is False
    assert (tmp_path / "work" / "train.log").read_text().count("val ce") == 2


def test_token_cache_with_another_tokenizer_is_refused(target_dir, streams, tmp_path):
    torch.save({"train": streams.train, "validation": streams.validation}, tmp_path / "tokens.pt")
    assert torch.equal(load_token_streams(tmp_path, target_dir, tmp_path).train, streams.train)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer"):
        load_token_streams(tmp_path, target_dir, tmp_path)
    with pytest.raises(FileNotFoundError):
        load_token_streams(tmp_path / "missing", target_dir, tmp_path)


# -- validation through inference ------------------------------------------------------------

def test_acceptance_is_measured_through_the_engine(runs, target_dir):
    _, head_dir = runs[True]
    report = evaluate_proposers(target_dir, {"self": ("draft_target", target_dir),
                                             "mtp": ("mtp", head_dir)},
                                ks=(1, 2), num_prompts=6, new_tokens=12, dtype="float32")
    assert report["prompts"] == 6
    me, mtp = report["proposers"]["self"], report["proposers"]["mtp"]
    assert me["top1"]["continuation"] == 1.0 and me["top1"]["positions"] == 6 * 12
    assert me["k"][2]["mean_acceptance_length"] >= 0.98 * 3
    for k in (1, 2):
        assert mtp["k"][k]["identical_to_plain"] == 1.0
        assert mtp["k"][k]["num_drafts"] > 0
    assert 0.0 <= mtp["top1"]["continuation"] <= 1.0
    assert mtp["trained_for_this_target"] is True
