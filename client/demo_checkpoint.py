"""A tiny, untrained Llama checkpoint so the server has a model out of the box.

The trained demo model lives in ``checkpoints/demo/target``; until it exists
(or in CI, where nothing is trained) ``tandem serve`` falls back to this one:
a byte-level BPE tokenizer trained on a few Python standard-library files and
a randomly initialised 2-layer Llama in Hugging Face format. Everything is
seeded, so two runs write identical files.

>>> path = ensure_demo_checkpoint()        # doctest: +SKIP
>>> sorted(p.name for p in path.iterdir())  # doctest: +SKIP
['config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json']
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
import tempfile
from pathlib import Path

from tandem.client.paths import CACHE, DEMO_CHECKPOINTS

BOS, EOS = "<s>", "</s>"
TRAINED_DEMO = DEMO_CHECKPOINTS / "target"
DEFAULT_OUT = CACHE / "demo-untrained"
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# A few standard-library modules as tokenizer training text; all ship with CPython.
CORPUS_FILES = ("os.py", "argparse.py", "textwrap.py", "json/encoder.py", "collections/__init__.py")

LLAMA_SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=256)


def corpus_paths() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = [stdlib / name for name in CORPUS_FILES if (stdlib / name).is_file()]
    if not paths:
        raise FileNotFoundError(f"no training text: none of {CORPUS_FILES} found under {stdlib}")
    return paths


def train_tokenizer(files: list[Path], vocab_size: int = 2000):
    """Byte-level BPE with ``<s>``/``</s>``; encoding prepends ``<s>`` like Llama's tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(f) for f in files], trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def llama_config(vocab_size: int, bos_id: int, eos_id: int) -> dict:
    heads = LLAMA_SHAPE["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **LLAMA_SHAPE,
        "head_dim": LLAMA_SHAPE["hidden_size"] // heads,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def random_llama_weights(cfg: dict, seed: int = 0) -> dict:
    """HF-named tensors, N(0, 0.02) projections and unit norms, from a seeded generator."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = cfg["head_dim"]
    q_out = cfg["num_attention_heads"] * head_dim
    kv_out = cfg["num_key_value_heads"] * head_dim

    def normal(*shape: int) -> "torch.Tensor":
        return torch.randn(*shape, generator=gen) * 0.02

    w = {"model.embed_tokens.weight": normal(vocab, hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(q_out, hidden)
        w[p + "self_attn.k_proj.weight"] = normal(kv_out, hidden)
        w[p + "self_attn.v_proj.weight"] = normal(kv_out, hidden)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, q_out)
        w[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    w["model.norm.weight"] = torch.ones(hidden)
    w["lm_head.weight"] = normal(vocab, hidden)
    return {k: v.contiguous() for k, v in w.items()}


def make_demo_checkpoint(out: str | Path = DEFAULT_OUT, vocab_size: int = 2000, seed: int = 0) -> Path:
    """Write the checkpoint to ``out`` atomically (a finished directory or none)."""
    from safetensors.torch import save_file

    out = Path(out)
    tok = train_tokenizer(corpus_paths(), vocab_size)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    cfg = llama_config(tok.get_vocab_size(), bos_id, eos_id)

    out.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and rename, so a crash or a concurrent caller
    # never sees a half-written checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": cfg["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
    save_file(random_llama_weights(cfg, seed), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    try:
        os.rename(tmp, out)
    except OSError:  # out exists (another process won the race, or a stale dir)
        if is_complete(out):
            _rmtree(tmp)
        else:
            _rmtree(out)
            os.rename(tmp, out)
    return out


def is_complete(path: Path) -> bool:
    return all((Path(path) / f).is_file() for f in CHECKPOINT_FILES)


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def ensure_demo_checkpoint(out: str | Path = DEFAULT_OUT) -> Path:
    """The untrained demo checkpoint at ``out``, created on first use."""
    out = Path(out)
    return out if is_complete(out) else make_demo_checkpoint(out)


def default_model_dir() -> Path:
    """``checkpoints/demo/target`` when trained, else the untrained demo checkpoint."""
    if (TRAINED_DEMO / "config.json").is_file():
        return TRAINED_DEMO
    return ensure_demo_checkpoint()


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-demo-checkpoint",
        help="write a tiny random-weight Llama checkpoint (tokenizer trained on stdlib source)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    p.add_argument("--vocab-size", type=int, default=2000, help="BPE vocabulary size (default: 2000)")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default: 0)")
    p.add_argument("--force", action="store_true", help="rewrite the checkpoint if it exists")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if is_complete(args.out) and not args.force:
        print(f"{args.out}: checkpoint exists (use --force to rewrite)")
        return 0
    if args.force and args.out.exists():
        _rmtree(args.out)
    path = make_demo_checkpoint(args.out, vocab_size=args.vocab_size, seed=args.seed)
    print(path)
    return 0
