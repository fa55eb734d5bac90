"""The real default model end to end: ``tandem serve --model smollm2-135m-instruct --spec
auto`` (SmolLM2-135M-Instruct from the GGUF that ``make install`` installs, converted once
into the cache) answers chat completions through the OpenAI API with its ChatML template,
and the greedy answer is HF transformers' own (fp32) on the same GGUF, token for token.
``--spec auto`` drafts with the MTP head trained for it (checkpoints/smollm2/mtp), not the
demo's, which does not fit (lossless: the text is still transformers')."""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from tandem.backends.models.model_path import packaged_model
from tandem.client.serve.triton_server import free_ports

from .servers import serve_command

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
QUESTIONS = ["Write a Python function that reverses a string.", "What is the capital of France?"]
MAX_TOKENS = 48
ADAPTERS = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2"


@pytest.fixture(scope="module")
def gguf_file():
    try:
        return packaged_model(MODEL)
    except FileNotFoundError as e:
        pytest.fail(f"{e} (make install installs it)")


@pytest.fixture(scope="module")
def hf_answers(gguf_file):
    """transformers' greedy answers (fp32) from the GGUF itself, through its chat template."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    torch.set_num_threads(1)
    kw = dict(gguf_file=gguf_file.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, torch_dtype=torch.float32, **kw)
    answers = {}
    for q in QUESTIONS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        answers[q] = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return answers


@pytest.fixture(scope="module")
def api(gguf_file, tmp_path_factory):
    run = tmp_path_factory.mktemp("real-model")
    http, grpc, metrics, port = free_ports(4)
    with serve_command(
            "--model", MODEL, "--spec", "auto", "--threads", "1", "--dtype", "float32", "--enforce-eager",
            "--max-num-seqs", "4", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules",
            f"shout={ADAPTERS / 'lora-shout'},json-answer={ADAPTERS / 'lora-json-answer'}",
            "--http-port", str(http), "--grpc-port", str(grpc),
            "--metrics-port", str(metrics), "--openai-port", str(port), "--run-dir", str(run / "run"),
            "--log-file", str(run / "server.log"), "--ready-timeout", "600", ready_timeout_s=900) as cmd:
        yield f"http://127.0.0.1:{port}/v1", cmd.output, run / "run"


def _chat(base_url: str, question: str, model: str = "tandem") -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": question}],
            "max_tokens": MAX_TOKENS, "temperature": 0}
    req = urllib.request.Request(f"{base_url}/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def test_the_greedy_chat_answer_is_transformers_own(api, hf_answers):
    base_url, output, _ = api
    for q in QUESTIONS:
        out = _chat(base_url, q)
        choice = out["choices"][0]
        assert choice["message"]["content"] == hf_answers[q], q
        assert choice["finish_reason"] in ("stop", "length")
    assert "reverse" in hf_answers[QUESTIONS[0]] and "Paris" in hf_answers[QUESTIONS[1]]   # a real model


def test_the_shipped_adapters_answer_in_their_style_beside_the_base(api, hf_answers):
    """checkpoints/smollm2/lora-shout and lora-json-answer, served with the base model
    (--lora-modules): the model field picks the style; the base's answer is unchanged."""
    base_url, _, _ = api
    q = QUESTIONS[1]
    shout = _chat(base_url, q, "shout")["choices"][0]["message"]["content"]
    letters = [c for c in shout if c.isalpha()]
    assert letters and all(c.isupper() for c in letters), shout
    answer = _chat(base_url, q, "json-answer")["choices"][0]["message"]["content"]
    assert answer.startswith('{"answer": "'), answer
    assert _chat(base_url, q)["choices"][0]["message"]["content"] == hf_answers[q]


def test_auto_drafts_with_the_head_trained_for_this_model(api):
    _, output, run_dir = api
    config = (run_dir / "model_repository" / "decode" / "config.pbtxt").read_text()
    head = re.search(r'key: "mtp_head" value: \{ string_value: "([^"]*)" \}', config).group(1)
    assert head.endswith("checkpoints/smollm2/mtp"), head
    assert not any("drafting by prompt lookup only" in line for line in output), "".join(output)


@pytest.fixture(scope="module")
def chat_prompts(gguf_file):
    """(the GGUF's tokenizer, each question's chat-templated token ids)."""
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    return tokenizer, [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                     return_dict=True)["input_ids"] for q in QUESTIONS]


def greedy_outputs(prompts, lora=None, **engine):
    """The offline engine's greedy outputs (fp32), its ranks stopped after."""
    from tandem.backends import LLM, SamplingParams
    llm = LLM(MODEL, dtype="float32", max_num_seqs=2, **engine)
    try:
        return llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), lora=lora), llm
    finally:
        llm.engine.close()


@pytest.mark.parametrize("spec", [None, "mtp"])
def test_three_ranks_answer_as_transformers(chat_prompts, hf_answers, spec):
    """The offline engine split over 3 tensor-parallel ranks (SmolLM2's 9 heads and 3 KV
    heads do not split over 2), fp32: the same greedy answers as transformers, also
    drafting with the MTP head trained for the model (on the leader rank)."""
    from tandem.backends import SpeculativeConfig
    tokenizer, ids = chat_prompts
    speculative = SpeculativeConfig("mtp", 3, mtp_head=str(ADAPTERS / "mtp")) if spec else None
    outs, llm = greedy_outputs(ids, tensor_parallel_size=3, speculative=speculative)
    for q, out in zip(QUESTIONS, outs):
        assert tokenizer.decode(out.token_ids, skip_special_tokens=True) == hf_answers[q], q
    if spec:
        assert llm.engine.spec_metrics.num_accepted_tokens > 0, "the head's drafts were verified and taken"


def test_three_ranks_apply_a_shipped_adapter_as_one_rank_does(chat_prompts):
    """checkpoints/smollm2/lora-shout, each rank holding its share: the one-rank engine's
    tokens (which test_engine_lora checks against PEFT), in capitals."""
    from tandem.backends.lora import LoRARequest
    tokenizer, ids = chat_prompts
    shout = LoRARequest("shout", 1, str(ADAPTERS / "lora-shout"))
    split, _ = greedy_outputs(ids, lora=shout, tensor_parallel_size=3, max_loras=1, max_lora_rank=8)
    whole, _ = greedy_outputs(ids, lora=shout, max_loras=1, max_lora_rank=8)
    assert [o.token_ids for o in split] == [o.token_ids for o in whole]
    letters = [c for c in tokenizer.decode(split[1].token_ids, skip_special_tokens=True) if c.isalpha()]
    assert letters and all(c.isupper() for c in letters)


def varied_corpus(n: int = 10_500) -> list[str]:
    """``n`` non-empty lines: Python source from the standard library (code), the
    sentences of its documentation topics (prose), and words of many scripts, emoji,
    symbols, digits and the model's special tokens, shuffled together (Unicode)."""
    import random
    import sysconfig
    from pathlib import Path

    from pydoc_data.topics import topics
    rng = random.Random(11)
    code = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        code += [line for line in f.read_text(errors="replace").splitlines() if line.strip()]
        if len(code) >= n // 2:
            break
    prose = [s.strip() for t in topics.values() for s in t.split(". ") if len(s.split()) > 3][: n // 4]
    words = ("naïve café Ελληνικά русский язык 中文字符 日本語の文 한국어 العربية हिन्दी עברית ไทย 🙂 👩‍💻 🇫🇷 ∑∫√ ½ "
             "“quotes” — … © ™ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 <|im_end|> <|im_start|>user <|endoftext|> 12345 3.14159 \t  x²").split(" ")
    unicode = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 14))) + rng.choice(["", " ", "\n", "  !"])
               for _ in range(n - len(code[: n // 2]) - len(prose))]
    lines = code[: n // 2] + prose + unicode
    rng.shuffle(lines)
    return lines


def test_the_tokenizer_gives_transformers_ids_on_varied_text(gguf_file):
    """The tokenizer built from the GGUF's tokenizer.ggml.* (the converted directory's)
    encodes like transformers' own GGUF tokenizer, id for id, on 10,500 lines."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from tandem.backends.models.model_path import resolve_model_path
    ours = Tokenizer.from_file(str(resolve_model_path(MODEL) / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    lines = varied_corpus()
    assert len(lines) >= 10_000
    want = theirs(lines)["input_ids"]
    got = [e.ids for e in ours.encode_batch(lines)]
    mismatched = [(line, g, w) for line, g, w in zip(lines, got, want) if g != w]
    assert not mismatched, f"{len(mismatched)} of {len(lines)} lines differ; first: {mismatched[0]}"
