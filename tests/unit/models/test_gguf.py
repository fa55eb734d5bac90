"""GGUF loading: tiny random Llamas written with ``gguf.GGUFWriter`` as llama.cpp writes them
(q/k permuted for ggml's rope, tensors in several quant types, a byte-level BPE tokenizer),
converted to an HF directory and checked against gguf's own dequantization and against
transformers reading the same file (weights, greedy output, tokenizer ids)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from tandem.backends import LLM, SamplingParams
from tandem.backends.models import gguf as gguf_mod
from tandem.backends.models.gguf import convert_gguf, hf_name, unpermute_rope
from tandem.backends.models.model_path import MARKER, resolve_model_path

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 256, 2, 4, 2, 384
HEAD_DIM = HIDDEN // HEADS
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
# each layer's tensors in other types; ffn_down's rows (256 wide) take the K-quants
TYPES = {
    0: {"attn_q": T.F32, "attn_k": T.Q4_1, "attn_v": T.Q8_0, "attn_output": T.F16,
        "ffn_gate": T.BF16, "ffn_up": T.Q4_0, "ffn_down": T.Q4_K},
    1: {"attn_q": T.Q8_0, "attn_k": T.F32, "attn_v": T.Q4_0, "attn_output": T.Q4_1,
        "ffn_gate": T.F16, "ffn_up": T.Q8_0, "ffn_down": T.Q6_K},
}
# byte offset of the fp16 super-block scale(s) that random K-quant blocks need valid
K_SCALES = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k permutation (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def k_quant_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random K-quant blocks with small valid scales (gguf-py cannot quantize K types)."""
    n, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // n * size), dtype=np.uint8)
    blocks = raw.reshape(rows, cols // n, size)
    for off in K_SCALES[qtype]:
        blocks[..., off:off + 2] = np.frombuffer(np.float16(2e-5).tobytes(), np.uint8)
    return raw


def hf_weights(tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = {"model.embed_tokens.weight": rng.normal(0, 0.3, (VOCAB, HIDDEN)),
         "model.norm.weight": 1 + rng.normal(0, 0.1, HIDDEN)}
    if not tied:
        w["lm_head.weight"] = rng.normal(0, 0.1, (VOCAB, HIDDEN))
    shapes = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
              "v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "o_proj": (HIDDEN, HIDDEN),
              "gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}
    for i in range(LAYERS):
        for proj, shape in shapes.items():
            mod = "self_attn" if proj[0] in "qkvo" else "mlp"
            w[f"model.layers.{i}.{mod}.{proj}.weight"] = rng.normal(0, 0.15, shape)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[f"model.layers.{i}.{norm}.weight"] = 1 + rng.normal(0, 0.1, HIDDEN)
    return {k: v.astype(np.float32) for k, v in w.items()}


def gguf_name(hf: str) -> str:
    table = {v: k for k, v in {**gguf_mod.GLOBAL_TENSORS, **gguf_mod.LAYER_TENSORS}.items()}
    stem, _, kind = hf.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, i, rest = stem.split(".", 3)
        return f"blk.{i}.{table[rest]}.{kind}"
    return f"{table[stem]}.{kind}"


def _trained(pre_tokenizer, vocab_size: int, specials: list[str]) -> list[str]:
    """The tokens, in id order, of a BPE trained on this file."""
    from tokenizers import Tokenizer, models, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=getattr(pre_tokenizer, "alphabet", lambda: [])())
    tok.train_from_iterator([Path(__file__).read_text()] * 4, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])], merges


def byte_level_vocab() -> dict:
    """A byte-level BPE (its specials CONTROL, ``<think>`` USER_DEFINED), as a GGUF stores it."""
    from tokenizers import pre_tokenizers
    tokens, merges = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False), VOCAB, SPECIALS)
    assert len(tokens) == VOCAB
    return {"model": "gpt2", "tokens": tokens, "merges": merges, "add_bos": False,
            "types": [3 if t in SPECIALS[:3] else 4 if t == "<think>" else 1 for t in tokens],
            "bos": tokens.index("<|im_start|>"), "eos": tokens.index("<|im_end|>")}


def sentencepiece_vocab() -> dict:
    """A SentencePiece-style vocabulary as llama.cpp stores one: <unk>, <s>, </s>, the 256
    byte tokens, then pieces with falling scores and no merges (they follow from the scores)."""
    from tokenizers import pre_tokenizers
    learned, _ = _trained(pre_tokenizers.Metaspace(), 2000, [])
    pieces = [t for t in learned if not t.startswith("<0x")][:VOCAB - 259]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    return {"model": "llama", "tokens": tokens, "types": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
            "scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))], "bos": 1, "eos": 2}


def write_gguf(path: Path, weights: dict[str, np.ndarray], vocab, types=TYPES, arch: str = "llama",
               extra_tensor: tuple | None = None, rng_seed: int = 0, embd=T.Q8_0, output=T.F16) -> Path:
    rng = np.random.default_rng(rng_seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_tokenizer_model(vocab["model"])
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    if "add_bos" in vocab:
        w.add_add_bos_token(vocab["add_bos"])
    w.add_chat_template(CHATML)
    for name, x in weights.items():
        g = gguf_name(name)
        if ".attn_q." in g or ".attn_k." in g:
            x = permute_rope(x, HEADS if ".attn_q." in g else KV_HEADS)
        leaf = g.split(".")[-2]
        qtype = types[int(g.split(".")[1])][leaf] if g.startswith("blk.") and leaf in types[0] else (
            embd if g.startswith("token_embd") else output if g.startswith("output.") else T.F32)
        if qtype in K_SCALES:
            w.add_tensor(g, k_quant_blocks(*x.shape, qtype, rng), raw_dtype=qtype)
        elif qtype == T.F16:
            w.add_tensor(g, x.astype(np.float16))
        elif qtype == T.F32:
            w.add_tensor(g, x)
        else:
            w.add_tensor(g, quantize(x, qtype), raw_dtype=qtype)
    if extra_tensor is not None:
        w.add_tensor(*extra_tensor[:2], raw_dtype=extra_tensor[2])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def vocab():
    return byte_level_vocab()


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path_factory, monkeypatch):
    """Conversions of ``LLM(x.gguf)`` go to a temporary cache, never the user's."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "tandem_cache"))


@pytest.fixture(scope="module", params=["untied", "tied"])
def gguf_file(request, vocab, tmp_path_factory):
    tied = request.param == "tied"
    types = {0: TYPES[0], 1: {**TYPES[1], "ffn_down": T.Q5_K}} if tied else TYPES
    d = tmp_path_factory.mktemp(f"gguf_{request.param}")
    return write_gguf(d / f"tiny-{request.param}.gguf", hf_weights(tied), vocab, types)


@pytest.fixture(scope="module")
def converted(gguf_file, tmp_path_factory):
    return convert_gguf(gguf_file, tmp_path_factory.mktemp("converted") / "hf")


def test_config_comes_from_the_llama_metadata(gguf_file, converted):
    cfg = json.loads((converted / "config.json").read_text())
    tied = "tied" in gguf_file.name and "untied" not in gguf_file.name
    assert cfg | {"torch_dtype": None} == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "max_position_embeddings": 256, "tie_word_embeddings": tied, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": None}
    assert cfg["torch_dtype"] == "float32"
    gen = json.loads((converted / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2]
    tok_cfg = json.loads((converted / "tokenizer_config.json").read_text())
    assert (tok_cfg["chat_template"], tok_cfg["bos_token"], tok_cfg["eos_token"]) == (
        CHATML, "<|im_start|>", "<|im_end|>")
    assert tok_cfg["add_bos_token"] is False


def test_tensors_are_gguf_dequantization_unpermuted(gguf_file, converted):
    reader = gguf.GGUFReader(str(gguf_file))
    ours = load_file(str(converted / "model.safetensors"))
    assert set(ours) == {hf_name(t.name) for t in reader.tensors}
    for t in reader.tensors:
        want = dequantize(t.data, t.tensor_type).astype(np.float32)
        if ".attn_q." in t.name or ".attn_k." in t.name:
            want = unpermute_rope(want, HEADS if ".attn_q." in t.name else KV_HEADS)
        got = ours[hf_name(t.name)]
        # float types keep their dtype, quantized ones are fp32
        assert got.dtype == {T.F16: torch.float16, T.BF16: torch.bfloat16}.get(t.tensor_type, torch.float32)
        np.testing.assert_array_equal(got.float().numpy(), want, err_msg=t.name)


def test_unpermute_inverts_llama_cpp_permute(gguf_file, converted):
    """Against the source weights: exact where stored F32, close where Q8_0 (both roles)."""
    tied = "untied" not in gguf_file.name
    src, ours = hf_weights(tied), load_file(str(converted / "model.safetensors"))
    for name, tol in (("model.layers.0.self_attn.q_proj.weight", 0),
                      ("model.layers.1.self_attn.k_proj.weight", 0),
                      ("model.layers.1.self_attn.q_proj.weight", 0.01)):
        np.testing.assert_allclose(ours[name].numpy(), src[name], atol=tol, err_msg=name)


@pytest.fixture(scope="module")
def hf_from_gguf(gguf_file):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                dtype=torch.float32).eval()


def test_weights_equal_transformers_gguf_loader(hf_from_gguf, converted):
    ours = load_file(str(converted / "model.safetensors"))
    theirs = hf_from_gguf.state_dict()
    for name, t in ours.items():
        torch.testing.assert_close(t.float(), theirs[name], rtol=0, atol=0, msg=name)


def test_greedy_equals_transformers_on_the_gguf_and_on_the_converted_dir(gguf_file, converted, hf_from_gguf):
    from transformers import AutoModelForCausalLM
    hf_dir = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    llm = LLM(str(gguf_file), dtype="float32", enforce_eager=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, VOCAB, (n,), generator=g).tolist() for n in (3, 11, 24)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for p, out in zip(prompts, outs):
        ids = torch.tensor([p])
        for ref_model in (hf_from_gguf, hf_dir):
            ref_model.generation_config.eos_token_id = None   # as ignore_eos: all 16 tokens
            ref = ref_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=16, pad_token_id=0)
            assert out.token_ids == ref[0, len(p):].tolist()
    assert len({tuple(o.token_ids) for o in outs}) > 1   # not one echo for every prompt


def varied_lines(n: int = 300) -> list[str]:
    rng = np.random.default_rng(7)
    source = [l for l in Path(__file__).read_text().splitlines() if l.strip()]
    words = ("the model reads a file naïve café Ελληνικά русский 中文 日本語 🙂 👩‍💻 ∑ ½ “q” — "
             "<|im_end|> <|im_start|>user <think> <|endoftext|> 12345 \t").split(" ")
    lines = source[: n // 2]
    while len(lines) < n:
        lines.append(" ".join(rng.choice(words, rng.integers(1, 12))) + rng.choice(["", " ", "\n", "  !"]))
    return lines


def transformers_ids(gguf_file: Path, lines: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)(lines)["input_ids"]


def test_tokenizer_ids_equal_transformers_gguf_tokenizer(gguf_file, converted):
    from tokenizers import Tokenizer
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    lines = varied_lines()
    assert [e.ids for e in ours.encode_batch(lines)] == transformers_ids(gguf_file, lines)
    assert ours.encode("<think>").ids == [ours.token_to_id("<think>")]   # USER_DEFINED: whole
    assert ours.get_vocab_size() == VOCAB


def test_sentencepiece_tokenizer_ids_equal_transformers(tmp_path):
    path = write_gguf(tmp_path / "spm.gguf", hf_weights(True), sentencepiece_vocab())
    out = convert_gguf(path, tmp_path / "hf")
    from tokenizers import Tokenizer
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    lines = varied_lines()
    ids = [e.ids for e in ours.encode_batch(lines)]
    assert ids == transformers_ids(path, lines)
    assert all(i[0] == 1 for i in ids)          # SentencePiece files without the flag: BOS added
    # a character the vocabulary lacks (written as chr(): this file is the training text)
    assert ours.encode(chr(0x20AA)).tokens[1:] == ["▁", "<0xE2>", "<0x82>", "<0xAA>"]   # byte fallback
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True


def test_greedy_text_from_the_gguf_equals_the_hf_directory_of_the_same_weights(vocab, tmp_path):
    """Every tensor stored F32: the GGUF path and an HF checkpoint directory of the source
    weights (safetensors, the converted config and tokenizer) give the same greedy text."""
    from safetensors.torch import save_file
    weights = hf_weights(tied=False, seed=3)
    f32 = {i: dict.fromkeys(TYPES[0], T.F32) for i in range(LAYERS)}
    path = write_gguf(tmp_path / "f32.gguf", weights, vocab, f32, embd=T.F32, output=T.F32)
    hf_dir = convert_gguf(path, tmp_path / "hf")
    save_file({k: torch.from_numpy(v) for k, v in weights.items()}, str(hf_dir / "model.safetensors"))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["hello world", "def f(x):\n    return", "Ünïcödé ✓ text"]
    from_gguf = LLM(str(path), dtype="float32", enforce_eager=True).generate(prompts, params)
    from_dir = LLM(str(hf_dir), dtype="float32", enforce_eager=True).generate(prompts, params)
    assert [(o.token_ids, o.text) for o in from_gguf] == [(o.token_ids, o.text) for o in from_dir]
    assert len({tuple(o.token_ids) for o in from_dir}) > 1


def test_chat_prompt_through_the_engine(gguf_file):
    llm = LLM(str(gguf_file), dtype="float32", enforce_eager=True)
    out = llm.generate("<|im_start|>user\nhi<|im_end|>\n", SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert out.prompt_token_ids[0] == 1 and 2 in out.prompt_token_ids   # specials whole, no BOS added


# ---- the cache ---------------------------------------------------------------

def test_resolve_converts_once_and_redoes_a_torn_conversion(vocab, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "models").mkdir()
    src = write_gguf(tmp_path / "models" / "m.gguf", hf_weights(True), vocab)
    calls = []
    real = gguf_mod.convert_gguf
    monkeypatch.setattr(gguf_mod, "convert_gguf", lambda *a: calls.append(a) or real(*a))
    out = resolve_model_path(src)
    assert out.parent == tmp_path / "cache" / "gguf" and (out / MARKER).is_file()
    assert resolve_model_path(src) == out and resolve_model_path(src.parent) == out
    assert len(calls) == 1                                   # cached: not converted again
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(src.read_bytes())
    assert resolve_model_path(copy) == out and len(calls) == 1   # keyed by content, not name
    (out / MARKER).unlink()
    (out / "model.safetensors").write_bytes(b"torn")
    assert resolve_model_path(src) == out and len(calls) == 2
    assert load_file(str(out / "model.safetensors"))          # redone, whole
    assert not list(out.parent.glob("*.tmp-*"))


def test_hf_directories_and_other_paths_pass_through(tmp_path, vocab):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "hf" / "stray.gguf").write_bytes(b"")
    assert resolve_model_path(tmp_path / "hf") == tmp_path / "hf"
    assert resolve_model_path(tmp_path / "missing") == tmp_path / "missing"
    two = tmp_path / "two"
    two.mkdir()
    for n in ("a.gguf", "b.gguf"):
        (two / n).write_bytes(b"")
    with pytest.raises(ValueError, match="2 GGUF files .*a.gguf, b.gguf"):
        resolve_model_path(two)
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        resolve_model_path(tmp_path / "missing.gguf")


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="x.gguf: not a readable GGUF file"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out")


# ---- refusals ----------------------------------------------------------------

def test_a_non_llama_architecture_is_refused(vocab, tmp_path):
    path = write_gguf(tmp_path / "g.gguf", hf_weights(True), vocab, arch="gemma2")
    with pytest.raises(ValueError, match="architecture 'gemma2' is not supported; allowed: llama"):
        convert_gguf(path, tmp_path / "out")


def test_an_unsupported_quant_type_is_refused_naming_the_tensor(vocab, tmp_path):
    n, size = gguf.GGML_QUANT_SIZES[T.Q8_K]
    extra = ("blk.0.ffn_extra.weight", np.zeros((4, size), np.uint8), T.Q8_K)
    path = write_gguf(tmp_path / "q.gguf", hf_weights(True), vocab, extra_tensor=extra)
    with pytest.raises(ValueError, match=r"'blk.0.ffn_extra.weight' has type Q8_K.*allowed: F32, F16, .*Q4_K"):
        convert_gguf(path, tmp_path / "out")


def test_an_unknown_tensor_is_refused(vocab, tmp_path):
    extra = ("blk.0.attn_qkv.weight", np.zeros((4, 64), np.float32), None)
    path = write_gguf(tmp_path / "u.gguf", hf_weights(True), vocab, extra_tensor=extra)
    with pytest.raises(ValueError, match="'blk.0.attn_qkv.weight' is not part of a Llama model"):
        convert_gguf(path, tmp_path / "out")


def test_llama3_rope_freqs_become_llama3_scaling():
    freqs = gguf_mod.llama3_factors(500000.0, 64, 8.0, 1.0, 4.0, 8192)
    meta = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 1,
            "llama.feed_forward_length": 8, "llama.block_count": 1, "llama.vocab_size": 10,
            "llama.rope.freq_base": 500000.0}
    cfg = gguf_mod.llama_config(meta, {"output.weight"}, freqs)
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_mod.llama_config(meta, set(), freqs * 1.5)
