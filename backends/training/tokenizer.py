"""Byte-level BPE tokenizer trained on the corpus, saved in Hugging Face layout.

``tokenizer.json`` carries a post-processor that prepends ``<s>``, so
``Tokenizer.encode(text)`` and ``AutoTokenizer(text)`` both start with BOS;
training documents are ``<s> + text + </s>``.

>>> tok = train_tokenizer(corpus.train, vocab_size=4096)   # doctest: +SKIP
>>> save_tokenizer(tok, "checkpoints/demo/target", model_max_length=512)  # doctest: +SKIP
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .corpus import Document

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (BOS, EOS, PAD)      # ids 0, 1, 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def train_tokenizer(docs: Iterable[Document], vocab_size: int = 4096) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((d.text for d in docs), trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)])
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    return {"bos": tok.token_to_id(BOS), "eos": tok.token_to_id(EOS), "pad": tok.token_to_id(PAD)}


def encode_documents(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """``<s>`` + text + ``</s>`` per document.

    A literal ``<s>`` inside source text (lib2to3 and zoneinfo have some) is encoded
    as plain text here, so documents round-trip exactly; the flag is not saved
    with the tokenizer, so at serving time special-token strings in a prompt still
    map to their ids, as with Hugging Face Llama tokenizers.
    """
    eos = tok.token_to_id(EOS)
    previous = tok.encode_special_tokens
    tok.encode_special_tokens = True
    try:
        return [e.ids + [eos] for e in tok.encode_batch(texts)]
    finally:
        tok.encode_special_tokens = previous


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int = 512) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n")


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer: no tokenizer.json in {model_dir}")
    return Tokenizer.from_file(str(path))
