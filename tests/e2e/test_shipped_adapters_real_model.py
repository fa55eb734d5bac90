"""The LoRA adapters shipped for the real default model (checkpoints/smollm2/lora-*) on
SmolLM2-135M-Instruct itself (the GGUF `make install` installs, converted once into the
cache): the engine's batched LoRA, one batch mixing the base and both adapters, gives the
greedy tokens of the training wrapper that made them (fp32), and the styles show."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
torch = pytest.importorskip("torch")

from tandem.backends.models.model_path import packaged_model, resolve_model_path  # noqa: E402

MODEL = "smollm2-135m-instruct"
ADAPTERS = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2"
NAMES = ("shout", "json-answer")
QUESTIONS = ["Why do tides matter?", "Explain photosynthesis in simple terms."]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir():
    try:
        packaged_model(MODEL)
    except FileNotFoundError as e:
        pytest.fail(f"{e} (make install installs it)")
    return resolve_model_path(MODEL)


@pytest.fixture(scope="module")
def prompts(model_dir):
    from tandem.backends.models.tokenizer import load_tokenizer
    from tandem.client.openai.chat_template import ChatTemplate
    template, tok = ChatTemplate.for_checkpoint(model_dir), load_tokenizer(model_dir)
    return [tok.encode(template.render([{"role": "user", "content": q}])).ids for q in QUESTIONS]


def wrapper_greedy(model_dir, prompts, adapter: str | None) -> list[list[int]]:
    from tandem.backends.models import load_model
    from tandem.backends.training.dense_generate import generate_dense
    from tandem.backends.training.lora import load_adapter
    model = load_model(model_dir, "float32")
    if adapter:
        load_adapter(model, ADAPTERS / f"lora-{adapter}")
    with torch.no_grad():
        return generate_dense(model, prompts, [0.0] * len(prompts), NEW_TOKENS, 2, 0, 8, 2)


def test_the_engine_serves_the_shipped_adapters_as_they_were_trained(model_dir, prompts):
    from tandem.backends.engine.llm import LLM
    from tandem.backends.engine.params import SamplingParams
    from tandem.backends.lora import LoRARequest
    torch.set_num_threads(1)
    requests = {None: None} | {n: LoRARequest(n, i + 1, str(ADAPTERS / f"lora-{n}"))
                               for i, n in enumerate(NAMES)}
    llm = LLM(str(model_dir), dtype="float32", max_loras=2, max_lora_rank=8, enforce_eager=True)
    rows = [(p, name) for p in range(len(prompts)) for name in requests]
    out = llm.generate([prompts[p] for p, _ in rows],
                       [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)] * len(rows),
                       lora=[requests[name] for _, name in rows])
    served = {(p, name): o.token_ids for (p, name), o in zip(rows, out)}
    for name in requests:
        for p, tokens in enumerate(wrapper_greedy(model_dir, prompts, name)):
            assert served[(p, name)] == tokens, (name, QUESTIONS[p])
    text = {key: llm.tokenizer.decode(t, skip_special_tokens=True) for key, t in served.items()}
    for p in range(len(prompts)):
        assert text[(p, "shout")] == text[(p, "shout")].upper() != text[(p, None)].upper()
        assert text[(p, "json-answer")].startswith('{"answer": "')
        assert not text[(p, None)].startswith("{")
    assert json.loads((ADAPTERS / "lora-shout" / "adapter_config.json").read_text())["r"] == 4
