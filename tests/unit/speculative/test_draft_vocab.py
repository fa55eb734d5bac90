"""Proposers over a frequent-token subset of the vocabulary (FR-Spec): still lossless,
drafts only from the subset, acceptance as the subset's coverage allows."""
from __future__ import annotations

import shutil

import pytest
import torch

from tandem.backends import LLM, SamplingParams, SpeculativeConfig
from tandem.backends.engine.proposers import DraftVocab
from tandem.backends.speculative.draft_vocab import (FREQUENCIES_FILE, load_frequent_ids,
                                                     rank_by_frequency, save_frequencies)

from ..hf_reference import NEW_TOKENS, hf_greedy, prompts

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
VOCAB = 384


def with_frequencies(src, dst, stream: list[int]):
    """A copy of checkpoint ``src`` whose token_frequencies.json counts ``stream``."""
    if not dst.exists():
        shutil.copytree(src, dst)
    ids, counts = rank_by_frequency(torch.tensor(stream), VOCAB)
    save_frequencies(dst / FREQUENCIES_FILE, ids, counts, "test")
    return dst


def record_drafts(monkeypatch) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    greedy = DraftVocab.greedy

    def spy(self, logits, drafts, process):
        token = greedy(self, logits, drafts, process)
        seen.append(token.clone())
        return token
    monkeypatch.setattr(DraftVocab, "greedy", spy)
    return seen


def test_self_speculation_over_the_output_tokens_accepts_everything(target_dir, tmp_path):  # noqa: F811
    ref = hf_greedy(str(target_dir))
    used = sorted({t for seq in ref for t in seq})
    draft = with_frequencies(target_dir, tmp_path / "draft", [t for seq in ref for t in seq])
    spec = SpeculativeConfig("draft_target", 3, draft_model=str(draft), draft_vocab_size=len(used))
    llm = LLM(target_dir, speculative=spec)
    assert [tuple(o.token_ids) for o in llm.generate(prompts(VOCAB), GREEDY)] == list(ref)
    assert llm.engine.spec_metrics.acceptance_rate >= 0.98
    assert llm.engine.proposer.vocab.ids.tolist() == used


@pytest.mark.parametrize("method", ["draft_target", "mtp"])
def test_a_small_subset_stays_lossless_and_drafts_only_from_it(target_dir, random_mtp_dir,  # noqa: F811
                                                               tmp_path, monkeypatch, method):
    ref = hf_greedy(str(target_dir))
    stream = [t for seq in ref for t in seq]
    src = target_dir if method == "draft_target" else random_mtp_dir
    proposer = with_frequencies(src, tmp_path / method, stream)
    key = "draft_model" if method == "draft_target" else "mtp_head"
    size = 8
    spec = SpeculativeConfig(method, 3, draft_vocab_size=size, **{key: str(proposer)})
    seen = record_drafts(monkeypatch)
    llm = LLM(target_dir, speculative=spec)
    assert [tuple(o.token_ids) for o in llm.generate(prompts(VOCAB), GREEDY)] == list(ref)
    subset = set(load_frequent_ids(proposer, size, VOCAB).tolist())
    drafted = {t for tokens in seen for t in tokens.tolist()}
    assert seen and drafted <= subset
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages


def test_subset_errors_name_the_file_and_the_setting(target_dir, tmp_path):  # noqa: F811
    spec = SpeculativeConfig("draft_target", 2, draft_model=str(target_dir), draft_vocab_size=16)
    with pytest.raises(FileNotFoundError, match=f"draft_vocab_size=16 needs .*{FREQUENCIES_FILE}"):
        LLM(target_dir, speculative=spec)
    draft = with_frequencies(target_dir, tmp_path / "d", [1, 2, 3])
    with pytest.raises(ValueError, match="draft_vocab_size=999"):
        load_frequent_ids(draft, 999, VOCAB)
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="draft_vocab_size"):
            SpeculativeConfig("mtp", 2, mtp_head="x", draft_vocab_size=bad).validate()
    with pytest.raises(ValueError, match="draft_vocab_size"):
        SpeculativeConfig("ngram", 2, draft_vocab_size=64).validate()
