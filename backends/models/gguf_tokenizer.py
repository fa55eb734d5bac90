"""The tokenizer a GGUF file describes (``tokenizer.ggml.*``), as a ``tokenizers`` object
and the ``tokenizer_config.json`` that goes with it.

Built as transformers' GGUF loader builds it (``integrations/gguf/gguf_tokenizer_mapping.py``),
so the ids are the same: ``gpt2`` files are byte-level BPE with the file's merges, ``llama``
files SentencePiece-style BPE with byte fallback (merges from the file, else recovered from
the scores). Tokens the file marks CONTROL are special, USER_DEFINED ones are added whole,
and bos/eos/unk/pad are special too.

>>> tok, config = gguf_tokenizer(metadata)  # doctest: +SKIP
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

CONTROL, USER_DEFINED = 3, 4          # llama.cpp's token types
TOKENIZER_TYPES = ("gpt2", "llama")   # tokenizer.ggml.model values built here

# tokenizer.ggml.pre -> the split regex its merges were learned with (transformers'
# table, the entries a Llama-architecture file can carry); any other: GPT-2's
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx",
                     "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}
SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
               "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
# special as well where the vocabulary has them (transformers' GPT2/Llama tokenizer defaults)
CONVENTIONAL_SPECIALS = {"gpt2": ("<|endoftext|>",), "llama": ("<unk>", "<s>", "</s>")}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE spells tokens in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_level(meta: dict) -> Tokenizer:
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # a token written in plain text (not the byte alphabet) is respelled byte by byte
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(meta, vocab), dropout=None,
                               continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: dict) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(meta, vocab), fuse_unk=True,
                               byte_fallback=True, dropout=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(content=" ", left=1)])
    return tok


def _merges(meta: dict, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The file's merges, else the ones its vocabulary and scores imply (SentencePiece files
    often store none): every split of a token into two tokens, best score first."""
    if "tokenizer.ggml.merges" in meta:
        return [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    scores = dict(zip(meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.scores") or ()))
    merges = []
    for token, score in scores.items():
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def gguf_tokenizer(meta: dict) -> tuple[Tokenizer, dict]:
    """The tokenizer and its ``tokenizer_config.json`` (special tokens, ``add_bos_token``,
    ``chat_template``) from a GGUF's metadata (``{key: value}``)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_TYPES:
        raise ValueError(f"GGUF tokenizer.ggml.model {kind!r} is not supported; "
                         f"allowed: {', '.join(TOKENIZER_TYPES)}")
    tokens = meta["tokenizer.ggml.tokens"]
    tok = _byte_level(meta) if kind == "gpt2" else _sentencepiece(meta)
    types = meta.get("tokenizer.ggml.token_type") or ()
    alphabet = set(byte_alphabet().values()) if kind == "gpt2" else None
    # a byte-level "control" token outside the byte alphabet is a llama.cpp mislabel
    # (transformers skips it too: adding it would grow the vocabulary)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, types)
                            if k == CONTROL and (alphabet is None or set(t) <= alphabet)])
    vocab = tok.get_vocab()
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab])
    config = {name: tokens[meta[f"tokenizer.ggml.{key}"]] if f"tokenizer.ggml.{key}" in meta else None
              for name, key in SPECIAL_IDS.items()}
    added = {str(a) for a in tok.get_added_tokens_decoder().values()}
    named = [*(t for t in CONVENTIONAL_SPECIALS[kind] if t in vocab), *filter(None, config.values())]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t in dict.fromkeys(named) if t not in added])
    # older SentencePiece files have no flag, and llama.cpp adds BOS to them
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) and config["bos_token"] is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and config["eos_token"] is not None
    tok.post_processor = _template(config, add_bos, add_eos, tok)
    config |= {"add_bos_token": add_bos, "add_eos_token": add_eos,
               "tokenizer_class": "PreTrainedTokenizerFast"}
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tok, config


def _template(config: dict, add_bos: bool, add_eos: bool, tok: Tokenizer):
    bos, eos = config["bos_token"], config["eos_token"]
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    special = [(t, tok.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
