"""A chat model's self-distillation data (tandem train distill-data --chat-prompts) and its
MTP head: chat questions from topics x templates and stdlib docstrings, held out by topic;
the dense generator (CUDA without FlashInfer) continues prompts as the engine does; the dense
hidden states equal the engine's paged ones; a head with a narrower MLP saves, loads into the
engine and drafts losslessly."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tandem.backends import LLM, SamplingParams
from tandem.backends.models import load_model
from tandem.backends.models.mtp import MTPHead, load_mtp_head, save_mtp_head
from tandem.backends.speculative import SpeculativeConfig
from tandem.backends.training.chat_prompts import (ChatPromptConfig, ChatQuestion, chat_messages,
                                                   split_topics, stdlib_questions, topic_questions)
from tandem.backends.training.corpus import Document, load_prompts
from tandem.backends.training.dense_generate import generate_dense, pick_tokens
from tandem.backends.training.distill import DistillDataConfig, continue_and_write, load_distill_rows
from tandem.backends.training.hidden_states import compute_hidden_states, pick_forward

from ..tiny_checkpoints import make_checkpoint_with_tokenizer

PROMPTS = [[5, 9, 14, 3, 77, 8], [40], [12, 13, 14], [100, 101, 102, 103, 104, 105, 106, 107, 108]]


@pytest.fixture(scope="module")
def target_dir(checkpoint_root):
    return make_checkpoint_with_tokenizer(checkpoint_root)


def engine_greedy(target_dir, prompts, new_tokens):
    llm = LLM(str(target_dir), dtype="float32", max_num_seqs=len(prompts), enforce_eager=True)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


# -- chat questions ------------------------------------------------------------------------

def test_topics_are_held_out_whole():
    topics = [f"topic number {i}" for i in range(200)]
    qs = topic_questions(topics, ["Explain {topic}.", "Why does {topic} matter?"])
    assert len(qs) == 400 and qs[1].text == "Why does topic number 0 matter?"
    train, held = split_topics(qs, held_out_fraction=0.2)
    assert 10 < len({q.source for q in held}) < 70        # about a fifth of the topics
    assert not {q.source for q in train} & {q.source for q in held}
    assert split_topics(qs, 0.2) == (train, held)          # stable across runs


def test_stdlib_questions_quote_the_first_docstring_line():
    doc = Document("pkg/mod.py", '"""A module for tides.\n\nMore."""\n'
                                 'def ebb(x):\n    """Lower the water.\n\n    Details."""\n'
                                 'def _hidden():\n    """Private."""\n'
                                 'class Moon:\n    """Pulls."""\n'
                                 'def undocumented():\n    pass\n')
    qs = stdlib_questions([doc], ["About {module}: {summary}?", "What does {name} do ({kind})?"])
    assert [q.text for q in qs] == ["About pkg.mod: A module for tides?",
                                    "What does pkg.mod.ebb do (function)?",
                                    "What does pkg.mod.Moon do (class)?"]
    assert [q.source for q in qs] == ["pkg/mod.py:1", "pkg/mod.py:4", "pkg/mod.py:10"]
    assert stdlib_questions([Document("bad.py", "def (:")], ["{name}"]) == []


@pytest.mark.parametrize("bad, match", [({"topics": [], "templates": ["{topic}"]}, "needs topics"),
                                        ({"topics": ["a"], "templates": ["no slot"]}, "without"),
                                        ({"topics": ["a"], "templates": ["{topic}"], "colour": 1}, "colour")])
def test_chat_prompt_config_refuses_what_it_cannot_use(tmp_path, bad, match):
    (tmp_path / "c.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=match):
        ChatPromptConfig.from_file(tmp_path / "c.json")


def test_the_shipped_chat_prompts_config_loads():
    cfg = ChatPromptConfig.from_file("configs/chat_prompts.json")
    assert len(cfg.topics) * len(cfg.templates) > 3000 and cfg.licence
    assert chat_messages(ChatQuestion("topic", "t", "Hi?")) == [{"role": "user", "content": "Hi?"}]


# -- the dense generator ----------------------------------------------------------------------

def test_dense_greedy_equals_the_engines(target_dir):
    """Left padding, per-row positions and the masked dense KV cache give the engine's tokens."""
    model = load_model(target_dir, "float32")
    want = engine_greedy(target_dir, PROMPTS, 10)
    assert generate_dense(model, PROMPTS, [0.0] * len(PROMPTS), 10, batch=3) == want
    assert generate_dense(model, PROMPTS, [0.0] * len(PROMPTS), 10, batch=1) == want


def test_a_row_stops_at_eos_and_the_others_go_on(target_dir):
    model = load_model(target_dir, "float32")
    full = generate_dense(model, PROMPTS, [0.0] * 4, 8)
    eos = full[0][2]        # row 0's third token
    out = generate_dense(model, PROMPTS, [0.0] * 4, 8, eos_id=eos)
    assert out[0] == full[0][:full[0].index(eos) + 1]       # EOS kept, nothing after it
    for got, ref in zip(out[1:], full[1:]):
        assert got == (ref[:ref.index(eos) + 1] if eos in ref else ref)


def test_pick_tokens_is_argmax_at_zero_and_draws_elsewhere():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0], [-50.0, -50.0, 50.0]])
    g = torch.Generator().manual_seed(0)
    draws = [pick_tokens(logits, torch.tensor([0.0, 100.0, 1.0]), g).tolist() for _ in range(200)]
    assert all(d[0] == 1 and d[2] == 2 for d in draws)      # greedy; a near one-hot draw
    assert len({d[1] for d in draws}) == 3                  # T=100: nearly uniform


def test_dense_hidden_states_equal_the_engines_paged_ones(target_dir):
    model = load_model(target_dir, "float32")
    windows = torch.randint(3, 300, (5, 40), generator=torch.Generator().manual_seed(1))
    paged = compute_hidden_states(model, windows, batch_windows=2)
    dense = compute_hidden_states(model, windows, forward="dense")
    torch.testing.assert_close(dense, paged, rtol=1e-4, atol=1e-4)
    assert pick_forward("auto", "cpu") == "paged"
    with pytest.raises(ValueError, match="allowed: auto, paged, dense"):
        pick_forward("fast", "cpu")


# -- rows, and a head on them ---------------------------------------------------------------------

@pytest.mark.parametrize("generator", ["engine", "dense"])
def test_chat_rows_end_at_eos_and_load(target_dir, tmp_path, generator):
    cfg = DistillDataConfig.from_dict({"num_prompts": 4, "val_prompts": 2, "min_prompt_tokens": 1,
                                       "max_prompt_tokens": 12, "new_tokens": 6,
                                       "temperatures": [0.0], "batch": 3, "dtype": "float32",
                                       "stop_at_eos": True, "generator": generator})
    out = tmp_path / "rows"
    summary = continue_and_write(target_dir, {"train": PROMPTS, "validation": PROMPTS[:2]}, out, cfg)
    rows = load_distill_rows(out, target_dir)
    assert summary["generator"] == ("engine" if generator == "engine" else "dense")
    assert len(rows["train"]) == 4 and rows["train"].prompt_lens.tolist() == list(map(len, PROMPTS))
    want = engine_greedy(target_dir, PROMPTS, 6)
    for i, ref in enumerate(want):   # the tiny tokenizer's EOS is </s> (id 2)
        cont = rows["train"].windows[i, len(PROMPTS[i]):int(rows["train"].lengths[i])].tolist()
        assert cont == (ref[:ref.index(2) + 1] if 2 in ref else ref)
    assert summary["generated_tokens"]["train"] == int((rows["train"].lengths
                                                        - rows["train"].prompt_lens).sum())


def test_chat_prompts_render_with_the_template_and_hold_out_topics(target_dir, tmp_path):
    from tandem.client.train.distill import chat_prompts
    target = tmp_path / "target"
    shutil.copytree(target_dir, target)
    (target / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<a>"}))
    (tmp_path / "c.json").write_text(json.dumps({
        "topics": [f"thing {i}" for i in range(40)], "templates": ["Explain {topic}.", "Why {topic}?"],
        "stdlib_fraction": 0.0, "held_out_fraction": 0.25}))
    cfg = DistillDataConfig.from_dict({"num_prompts": 30, "val_prompts": 4, "min_prompt_tokens": 1,
                                       "max_prompt_tokens": 64})
    train, val, records, counts = chat_prompts(target, str(tmp_path / "c.json"), cfg, eval_prompts=5)
    assert len(train) == 30 and len(val) == 4 and len(records) == 5
    assert records[0].prompt.startswith("<user>") and records[0].prompt.endswith("<a>")
    held = {r.path for r in records}
    assert counts["topic_questions"]["held_out"] > 0 and held
    assert all(f"Explain {t}." not in str(train) for t in held)   # token ids, not text: sanity
    from tandem.backends.training.corpus import save_prompts
    save_prompts(records, tmp_path / "prompts.json")
    assert load_prompts(tmp_path / "prompts.json")[0].reference.startswith(("Explain", "Why"))


def test_a_narrow_mlp_head_saves_loads_and_drafts_losslessly(target_dir, tmp_path):
    target = load_model(target_dir, "float32")
    torch.manual_seed(0)
    head = MTPHead(target.config, intermediate_size=48)
    save_mtp_head(head, tmp_path / "head", torch.float32)
    saved = json.loads((tmp_path / "head" / "config.json").read_text())
    assert saved["intermediate_size"] == 48
    loaded = load_mtp_head(tmp_path / "head", target)
    assert loaded.layer.mlp.gate_up_proj.weight.shape == (2 * 48, target.config.hidden_size)
    llm = LLM(str(target_dir), dtype="float32", max_num_seqs=4, enforce_eager=True,
              speculative=SpeculativeConfig("mtp", 2, mtp_head=str(tmp_path / "head")))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == engine_greedy(target_dir, PROMPTS, 10)
    # the default width writes no intermediate_size (old heads load as before)
    save_mtp_head(MTPHead(target.config), tmp_path / "plain", torch.float32)
    assert "intermediate_size" not in json.loads((tmp_path / "plain" / "config.json").read_text())
