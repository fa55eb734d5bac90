"""Self-distillation data (tandem train distill-data) and training on it: the rows are the
target's own continuations through the engine, padding never reaches a loss, the draft
and the MTP head train on the rows."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.backends import LLM, SamplingParams
from tandem.backends.models import load_model
from tandem.backends.models.mtp import MTPHead, save_mtp_head
from tandem.backends.training.data import on_distill_rows
from tandem.backends.training.distill import (DistillDataConfig, build_distill_data,
                                              cycle_temperatures, load_distill_rows, pack_rows,
                                              window_prompts)
from tandem.backends.training.hidden_states import HiddenStates
from tandem.backends.training.mtp import (MTPConfig, MTPTrainConfig, TokenStreams, label_mask,
                                          load_head_weights, mtp_loss, train_mtp)

from ..tiny_checkpoints import make_checkpoint, make_checkpoint_with_tokenizer


@pytest.fixture(scope="module")
def target_dir(checkpoint_root):
    return make_checkpoint_with_tokenizer(checkpoint_root)


@pytest.fixture(scope="module")
def streams(target_dir) -> TokenStreams:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    ids = torch.tensor(tok.encode(Path(__file__).parents[1].joinpath("tiny_checkpoints.py").read_text()).ids)
    return TokenStreams(ids[: int(0.8 * len(ids))], ids[int(0.8 * len(ids)):])


TINY_DISTILL = {"num_prompts": 12, "val_prompts": 4, "min_prompt_tokens": 4,
                "max_prompt_tokens": 12, "new_tokens": 8, "temperatures": [0.0, 0.9],
                "header_fraction": 0.0, "batch": 5, "dtype": "float32"}


@pytest.fixture(scope="module")
def distill_dir(target_dir, streams, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill") / "rows"
    build_distill_data(target_dir, streams.train, streams.validation, out,
                       DistillDataConfig.from_dict(TINY_DISTILL))
    return out


# -- pure parts ------------------------------------------------------------------------------

def test_pack_rows_pads_right_and_keeps_lengths():
    rows = pack_rows([[5, 6, 7], [8]], [[9], [10, 11]], [0.0, 0.8], pad_id=2, width=5)
    assert rows.windows.tolist() == [[5, 6, 7, 9, 2], [8, 10, 11, 2, 2]]
    assert rows.lengths.tolist() == [4, 3] and rows.prompt_lens.tolist() == [3, 1]
    assert rows.temperatures.tolist() == pytest.approx([0.0, 0.8])
    assert rows.stream().tolist() == [5, 6, 7, 9, 8, 10, 11]
    with pytest.raises(ValueError, match="width 3"):
        pack_rows([[5, 6, 7]], [[9]], [0.0], pad_id=2, width=3)
    with pytest.raises(ValueError, match="2 prompts, 1 continuations"):
        pack_rows([[5], [6]], [[9]], [0.0, 0.0], pad_id=2)


@pytest.mark.parametrize("lo,hi", [(1, 1), (3, 9), (16, 16)])
def test_window_prompts_are_slices_of_the_stream(lo, hi):
    stream = torch.arange(100, 400)
    prompts = window_prompts(stream, 50, lo, hi, seed=3)
    assert len(prompts) == 50 and prompts == window_prompts(stream, 50, lo, hi, seed=3)
    for p in prompts:
        assert lo <= len(p) <= hi
        assert p == list(range(p[0], p[0] + len(p)))       # contiguous in the stream
    assert window_prompts(stream, 50, lo, hi, seed=4) != prompts
    with pytest.raises(ValueError, match="more"):
        window_prompts(torch.arange(8), 2, 1, 8, seed=0)


def test_temperatures_are_cycled_over_rows():
    assert cycle_temperatures(5, [0.0, 0.0, 0.7]) == [0.0, 0.0, 0.7, 0.0, 0.0]


@pytest.mark.parametrize("bad", [{"min_prompt_tokens": 9, "max_prompt_tokens": 8},
                                 {"temperatures": []}, {"temperatures": [-1.0]},
                                 {"header_fraction": 1.5}, {"new_tokens": 0}, {"num_rows": 3}])
def test_distill_config_refuses_bad_values(bad):
    with pytest.raises(ValueError):
        DistillDataConfig.from_dict(bad)


def test_distill_steps_follow_the_fraction_and_the_step_alone():
    picks = [on_distill_rows(0, s, 0.75) for s in range(400)]
    assert picks == [on_distill_rows(0, s, 0.75) for s in range(400)]
    assert 0.65 < sum(picks) / 400 < 0.85
    assert all(on_distill_rows(0, s, 1.0) for s in range(50))
    assert not any(on_distill_rows(0, s, 0.0) for s in range(50))


def test_label_mask_stops_before_the_padding():
    lengths = torch.tensor([3, 5, 9])
    for p in (1, 2, 3):
        m = label_mask(lengths, rows=6, p=p)
        for b, n in enumerate(lengths.tolist()):
            assert m[b].tolist() == [i + p + 1 < n for i in range(6)]
    assert label_mask(None, 6, 1) is None


def test_hidden_state_batches_are_cut_after_the_longest_row():
    tokens = torch.arange(40).view(4, 10)
    hs = HiddenStates(tokens, torch.randn(4, 10, 3), torch.tensor([10, 4, 6, 3]))
    tok, hid, lengths = hs.batch(torch.tensor([1, 3, 2]))
    assert tok.shape == (3, 6) and hid.shape == (3, 6, 3) and lengths.tolist() == [4, 3, 6]
    assert HiddenStates(tokens, torch.randn(4, 10, 3)).batch(torch.tensor([0]))[2] is None


@pytest.mark.parametrize("unroll", [1, 2])
def test_padding_does_not_reach_the_mtp_loss(target_dir, unroll):
    target = load_model(target_dir)
    torch.manual_seed(0)
    head = MTPHead(target.config)
    cfg = MTPConfig(unroll=unroll)
    tokens = torch.randint(3, target.config.vocab_size, (2, 16))
    hidden = torch.randn(2, 16, target.config.hidden_size)
    lengths = torch.tensor([16, 9])
    a = mtp_loss(head, target, tokens, hidden, cfg, "none", lengths)
    tokens2, hidden2 = tokens.clone(), hidden.clone()
    tokens2[1, 9:], hidden2[1, 9:] = 2, 0.0          # other padding
    b = mtp_loss(head, target, tokens2, hidden2, cfg, "none", lengths)
    torch.testing.assert_close(a.loss, b.loss)
    assert a.top1 == b.top1 and a.kl == pytest.approx(b.kl)
    # without the mask the padding counts
    c = mtp_loss(head, target, tokens2, hidden2, cfg, "none")
    assert not torch.allclose(c.loss, b.loss)
    # full lengths are the unmasked loss
    full = mtp_loss(head, target, tokens, hidden, cfg, "none", torch.tensor([16, 16]))
    torch.testing.assert_close(full.loss, mtp_loss(head, target, tokens, hidden, cfg, "none").loss)


# -- the data through the engine -------------------------------------------------------------

def test_rows_are_the_targets_own_continuations(distill_dir, target_dir):
    rows = load_distill_rows(distill_dir, target_dir)
    train, val = rows["train"], rows["validation"]
    assert len(train) == 12 and len(val) == 4 and train.windows.shape[1] == 12 + 8
    assert (train.lengths == train.prompt_lens + 8).all()
    llm = LLM(str(target_dir), dtype="float32")
    greedy = [i for i in range(len(train)) if train.temperatures[i] == 0]
    assert len(greedy) == 6
    prompts = [train.windows[i, :train.prompt_lens[i]].tolist() for i in greedy]
    want = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0,
                                                                      ignore_eos=True))]
    got = [train.windows[i, train.prompt_lens[i]:train.lengths[i]].tolist() for i in greedy]
    assert got == want
    streams = torch.load(distill_dir / "tokens.pt")
    assert streams["train"].tolist() == train.stream().tolist()
    meta = json.loads((distill_dir / "distill.json").read_text())
    assert meta["rows"] == {"train": 12, "validation": 4}
    assert (distill_dir / "tokenizer.json").read_bytes() == (target_dir / "tokenizer.json").read_bytes()


def test_rows_of_another_target_are_refused(distill_dir, checkpoint_root):
    other = make_checkpoint("llama3_rope_tied", checkpoint_root)
    with pytest.raises(ValueError, match="regenerate"):
        load_distill_rows(distill_dir, other)
    with pytest.raises(FileNotFoundError, match="distill-data"):
        load_distill_rows(distill_dir.parent / "nothing")


def test_mtp_head_trains_on_the_rows_from_a_given_head(distill_dir, target_dir, streams, tmp_path):
    rows = load_distill_rows(distill_dir, target_dir)
    target = load_model(target_dir)
    torch.manual_seed(1)
    init = MTPHead(target.config)
    save_mtp_head(init, tmp_path / "init", torch.float32)
    cfg = MTPTrainConfig.from_dict({
        "mtp": {"num_windows": 8, "hidden_dtype": "float32", "distill_fraction": 0.5},
        "optim": {"batch_size": 4, "seq_len": 16, "steps": 6, "lr": 1e-3, "warmup_steps": 1,
                  "log_every": 3, "eval_every": 3, "eval_windows": 4, "amp": "none"},
        "init_from": str(tmp_path / "init")})
    result = train_mtp(cfg, target_dir, streams, tmp_path / "w", tmp_path / "out", distill=rows)
    assert result["step"] == 6 and (tmp_path / "out" / "model.safetensors").is_file()
    # validation ran on the rows' validation split, and training started at the given head
    assert result["train_tokens"] == 8 * 16 + int(rows["train"].lengths.sum())
    head = MTPHead(target.config)
    load_head_weights(head, tmp_path / "init", target_dir)
    for (k, a), b in zip(head.state_dict().items(), init.state_dict().values()):
        torch.testing.assert_close(a, b, msg=k)
    with pytest.raises(ValueError, match="use_norms"):
        load_head_weights(MTPHead(target.config, use_norms=False), tmp_path / "init", target_dir)


def test_draft_trains_on_the_rows(distill_dir, target_dir, tmp_path):
    from tandem.backends.training.lm import LMTrainConfig, train_lm
    # the tokenizer of the rows is the target's; the corpus is this tests directory
    root = tmp_path / "src"
    root.mkdir()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        (root / f.name).write_text(f.read_text())
    cfg = LMTrainConfig.from_dict({
        "model": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "num_key_value_heads": 1},
        "data": {"tokenizer": str(target_dir), "root": str(root), "val_fraction": 0.5,
                 "distill_data": str(distill_dir), "distill_fraction": 1.0},
        "optim": {"batch_size": 2, "seq_len": 16, "steps": 4, "warmup_steps": 1, "eval_every": 2,
                  "eval_windows": 2, "amp": "none"}})
    result = train_lm(cfg, tmp_path / "w", max_steps=4)
    assert result["step"] == 4
    assert all("val_loss_distill" in h for h in result["history"])
    bad = LMTrainConfig.from_dict(cfg.to_dict() | {"data": cfg.to_dict()["data"] |
                                                   {"distill_data": str(tmp_path)}})
    with pytest.raises(FileNotFoundError, match="distill_data"):
        train_lm(bad, tmp_path / "w2", max_steps=1)


@pytest.mark.parametrize("name", ["distill.json", "mtp_selfdistill.json", "mtp_selfdistill_2.json",
                                  "mtp_selfdistill_unroll.json"])
def test_shipped_self_distillation_configs_parse(name):
    path = Path(__file__).resolve().parents[3] / "configs" / name
    d = json.loads(path.read_text())
    if name == "distill.json":
        cfg = DistillDataConfig.from_dict(d)
        assert cfg.width <= 512 and cfg.num_prompts > 0
    else:
        cfg = MTPTrainConfig.from_dict(d)
        assert 0 < cfg.mtp.distill_fraction <= 1
