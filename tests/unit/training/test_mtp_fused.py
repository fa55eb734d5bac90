"""The EAGLE-3-style fused MTP head (``fuse_layers``): its shapes, old checkpoints loading
unchanged, the recorded layer outputs equal HF's, and a fused head training end to end."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tandem.backends.models import load_model
from tandem.backends.models.mtp import MTPHead, load_mtp_head, save_mtp_head
from tandem.backends.training.hidden_states import compute_hidden_states, load_or_compute
from tandem.backends.training.mtp import (MTPTrainConfig, TokenStreams, chained_acceptance,
                                          load_head_weights, train_mtp,
                                          unrolled_forward)

from ..tiny_checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def target_dir(checkpoint_root):
    return make_checkpoint("llama_gqa_untied", checkpoint_root)      # 2 layers, hidden 64


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir, "float32")


@pytest.mark.parametrize("fuse", [(0, 1), (1, 0)])
def test_fused_head_maps_k_layers_to_one_hidden_row(target, fuse):
    torch.manual_seed(0)
    head = MTPHead(target.config, fuse_layers=fuse)
    h = target.config.hidden_size
    assert head.fc.weight.shape == (h, len(fuse) * h)
    features = torch.randn(2, 5, len(fuse) * h)
    assert head.fuse(features).shape == (2, 5, h)
    with pytest.raises(ValueError, match="need 2 x 64"):
        head.fuse(torch.randn(5, h))


@pytest.mark.parametrize("bad", [[0], [0, 0], [0, 2], [-1, 1]])
def test_impossible_fuse_layers_are_refused(target, bad):
    with pytest.raises(ValueError, match="fuse_layers .* is invalid"):
        MTPHead(target.config, fuse_layers=bad)


def test_a_plain_head_saves_and_loads_as_before(target, tmp_path):
    torch.manual_seed(0)
    head = MTPHead(target.config)
    assert head.fuse_layers is None and not hasattr(head, "fc")
    save_mtp_head(head, tmp_path / "plain", torch.float32)
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "fuse_layers" not in cfg
    assert set(load_file(str(tmp_path / "plain" / "model.safetensors"))) == \
        {k for k in head.state_dict() if not k.startswith(("fc.", "fuse_norms."))}
    loaded = load_mtp_head(tmp_path / "plain", target)
    assert loaded.fuse_layers is None
    for k, v in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)


def test_a_fused_head_round_trips_with_its_layers(target, tmp_path):
    torch.manual_seed(0)
    head = MTPHead(target.config, fuse_layers=[0, 1])
    save_mtp_head(head, tmp_path / "fused", torch.float32)
    assert json.loads((tmp_path / "fused" / "config.json").read_text())["fuse_layers"] == [0, 1]
    loaded = load_mtp_head(tmp_path / "fused", target)
    assert loaded.fuse_layers == (0, 1)
    torch.testing.assert_close(loaded.fc.weight, head.fc.weight)


def test_a_fused_head_starts_from_a_plain_one_with_a_fresh_fc(target, target_dir, tmp_path):
    torch.manual_seed(0)
    plain = MTPHead(target.config)
    save_mtp_head(plain, tmp_path / "plain", torch.float32)
    torch.manual_seed(1)
    fused = MTPHead(target.config, fuse_layers=[0, 1])
    fc = fused.fc.weight.clone()
    load_head_weights(fused, tmp_path / "plain", target_dir)
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(fused.state_dict()[k], v)
    torch.testing.assert_close(fused.fc.weight, fc)
    save_mtp_head(fused, tmp_path / "fused", torch.float32)
    with pytest.raises(ValueError, match="fuse_layers"):    # a fused head into a plain one
        load_head_weights(MTPHead(target.config), tmp_path / "fused", target_dir)


def test_recorded_features_are_the_layers_outputs_of_an_hf_forward(target, target_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    windows = torch.randint(3, target.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    plain = compute_hidden_states(target, windows, batch_windows=2)
    hidden, features = compute_hidden_states(target, windows, batch_windows=2, fuse_layers=(0, 1))
    h = target.config.hidden_size
    with torch.no_grad():
        ref = hf(windows, output_hidden_states=True).hidden_states
    # hidden_states[l + 1] is decoder layer l's output (HF's last entry is after the final norm)
    torch.testing.assert_close(features[..., :h], ref[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(features[..., h:], plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, plain)
    # the last layer not among them: the hidden states come separately
    hidden0, features0 = compute_hidden_states(target, windows, batch_windows=2, fuse_layers=(0,))
    torch.testing.assert_close(features0, features[..., :h])
    torch.testing.assert_close(hidden0, plain)


@pytest.mark.parametrize("fuse", [(0, 1), (1, 0)])
def test_cached_fused_states_keep_hidden_and_features(target, target_dir, tmp_path, fuse):
    windows = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    a = load_or_compute(target_dir, windows, tmp_path, "float32", target=target, fuse_layers=fuse)
    b = load_or_compute(target_dir, windows, tmp_path, "float32", target=target, fuse_layers=fuse)
    assert len(list(tmp_path.glob("fused-*.pt"))) == 1
    torch.testing.assert_close(b.hidden, a.hidden)
    torch.testing.assert_close(b.hidden, compute_hidden_states(target, windows))
    assert b.batch_features(torch.tensor([1]))[0].shape == (12, 2 * target.config.hidden_size)


def test_fused_training_forward_reads_the_fused_features(target):
    torch.manual_seed(0)
    head = MTPHead(target.config, fuse_layers=[0, 1])
    tokens = torch.randint(3, 300, (2, 10))
    hidden, features = compute_hidden_states(target, tokens, fuse_layers=(0, 1))
    steps = unrolled_forward(head, target, tokens, hidden, 2, features)
    assert [g.shape for g in steps] == [(2, 8, 64), (2, 7, 64)]
    # step 1 is the plain forward on fc(features) in place of h_i
    positions = torch.arange(8).repeat(2)
    from tandem.backends.models.llama import DenseCausalAttention
    want = head(target, tokens[:, 1:9].reshape(-1), head.fuse(features[:, :8]).reshape(16, -1),
                positions, DenseCausalAttention(2, 8)).view(2, 8, -1)
    torch.testing.assert_close(steps[0], want)
    with pytest.raises(ValueError, match="no layer features"):
        unrolled_forward(head, target, tokens, hidden, 1)


def test_chained_acceptance_stops_at_the_first_disagreement():
    a1 = torch.tensor([[True, True, False, True]])
    a2 = torch.tensor([[True, False, True]])
    a3 = torch.tensor([[False, True]])
    total, rows = chained_acceptance([a1, a2, a3], None)
    # row 0: a1 a2 accepted, a3 not -> 3; row 1: a1 only -> 2
    assert (float(total), rows) == (5.0, 2)
    total, rows = chained_acceptance([a1, a2, a3], torch.tensor([[True, False]]))
    assert (float(total), rows) == (3.0, 1)


def test_a_tiny_fused_run_learns(target_dir, tmp_path):
    g = torch.Generator().manual_seed(0)
    pattern = torch.randint(3, 300, (37,), generator=g)     # a repeating stream: learnable
    stream = pattern.repeat(40)
    cfg = MTPTrainConfig.from_dict({
        "mtp": {"num_windows": 16, "hidden_dtype": "float32", "fuse_layers": [0, 1]},
        "optim": {"batch_size": 4, "seq_len": 32, "steps": 30, "lr": 3e-3, "warmup_steps": 3,
                  "weight_decay": 0.0, "log_every": 10, "eval_every": 15, "eval_windows": 4,
                  "amp": "none"}})
    result = train_mtp(cfg, target_dir, TokenStreams(stream[:1000], stream[1000:]),
                       tmp_path / "work", tmp_path / "out")
    first, last = result["history"][0], result["history"][-1]
    assert last["top1"][0] > first["top1"][0] and last["ce"][0] < first["ce"][0]
    assert 1.0 <= last["accept"][0] <= 4.0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["fuse_layers"] == [0, 1]


def test_offline_evaluation_compares_plain_and_fused_heads_on_the_same_windows(
        target, target_dir, tmp_path):
    from tandem.backends.training.mtp_offline import evaluate_heads, format_report
    torch.manual_seed(0)
    save_mtp_head(MTPHead(target.config), tmp_path / "plain", torch.float32)
    save_mtp_head(MTPHead(target.config, fuse_layers=[0, 1]), tmp_path / "fused", torch.float32)
    windows = torch.randint(3, 300, (3, 16), generator=torch.Generator().manual_seed(2))
    sets = {"rows": (windows, torch.tensor([16, 9, 12])), "windows": (windows, None)}
    report = evaluate_heads(target_dir, {"plain": tmp_path / "plain", "fused": tmp_path / "fused"},
                            sets, tmp_path / "cache", "float32", amp="none")
    assert report["fused"]["fuse_layers"] == [0, 1] and report["plain"]["fuse_layers"] is None
    for name in ("plain", "fused"):
        for s in sets:
            assert len(report[name][s]["top1"]) == 3 and 1.0 <= report[name][s]["accept"][0] <= 4.0
    assert format_report(report).count("\n") == 2 + 4 - 1
