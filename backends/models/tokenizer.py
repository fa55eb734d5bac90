"""Tokenizer and generation settings that travel with a HF checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The checkpoint's ``tokenizer.json``, or None when it has none (token-id prompts only)."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise ValueError(f"{path}: cannot load tokenizer ({e})") from e


def max_token_bytes(tokenizer: Tokenizer) -> int:
    """An upper bound on the bytes of text one token covers (4 per character of its
    longest vocabulary entry), so a text can be known too long before it is tokenized."""
    return 4 * max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` (what HF ``generate`` stops on), if present."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
