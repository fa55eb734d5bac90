"""Data for a LoRA adapter whose effect a reader sees at once (``tandem train lora-data``).

Chat questions (:mod:`.chat_prompts`' topics x templates, topics held out whole) are
answered by the base model itself, greedy, through the engine; each answer is cut to its
leading whole sentences within ``max_answer_tokens`` (an answer with no sentence end in
that span is dropped). A *style* then rewrites the answer, and the adapter learns to
answer in that style:

- ``shout``: the answer in UPPERCASE;
- ``json-answer``: the answer as a JSON object, ``{"answer": "..."}``.

Each style has a check that tells whether a generated answer is in the style, which
measures the adapter on held-out questions (with and without it).

>>> STYLES["shout"].apply("Tides rise twice a day.")
'TIDES RISE TWICE A DAY.'
>>> STYLES["json-answer"].apply('Say "hi".')
'{"answer": "Say \\\\"hi\\\\"."}'
>>> STYLES["shout"].check("TIDES RISE TWICE A DAY."), STYLES["json-answer"].check('{"answer": "x"}')
(True, True)
>>> leading_sentences("One. Two three. Four", lambda s: len(s.split()) <= 3)
'One. Two three.'
>>> leading_sentences("Terms:\\n1. Tide: water. 2. Moon", lambda s: True)
'Terms:\\n1. Tide: water.'
"""
from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tandem.train")
ANSWERS_FILE = "answers.json"
# a sentence ends at . ! or ? after a non-digit (not a list's "2.") and before a space or the end
SENTENCE_END = re.compile(r"(?<=[^\d\s][.!?])(?:\s+|$)")


def is_shouting(text: str) -> bool:
    """At least 10 letters, 90% or more of them uppercase."""
    letters = [c for c in text if c.isalpha()]
    return len(letters) >= 10 and sum(c.isupper() for c in letters) >= 0.9 * len(letters)


def is_json_answer(text: str) -> bool:
    """A JSON object with a non-empty string ``answer`` (and nothing else)."""
    try:
        d = json.loads(text)
    except ValueError:
        return False
    return isinstance(d, dict) and list(d) == ["answer"] and isinstance(d["answer"], str) \
        and bool(d["answer"].strip())


@dataclass(slots=True, frozen=True)
class Style:
    apply: Callable[[str], str]
    check: Callable[[str], bool]
    description: str


STYLES = {
    "shout": Style(str.upper, is_shouting, "the base model's answer in UPPERCASE"),
    "json-answer": Style(lambda a: json.dumps({"answer": a}, ensure_ascii=False), is_json_answer,
                         'the base model\'s answer as {"answer": "..."}'),
}


def style(name: str) -> Style:
    if name not in STYLES:
        raise ValueError(f"unknown LoRA style {name!r}; allowed: {', '.join(STYLES)}")
    return STYLES[name]


def leading_sentences(text: str, fits: Callable[[str], bool]) -> str:
    """The longest run of ``text``'s leading whole sentences that ``fits`` ("" if none)."""
    ends = [m.start() for m in SENTENCE_END.finditer(text.strip())]
    best = ""
    for end in ends:
        candidate = text.strip()[:end]
        if not fits(candidate):
            break
        best = candidate
    return best


@dataclass(slots=True)
class AnswerRow:
    question: str       # the user's message
    topic: str
    prompt: str         # rendered with the model's chat template
    answer: str         # the base model's answer, cut to whole sentences

    def to_dict(self) -> dict:
        return {"question": self.question, "topic": self.topic, "prompt": self.prompt,
                "answer": self.answer}


def pick_questions(chat_prompts: str | Path, n_train: int, n_held: int, seed: int):
    """(training, held-out) :class:`~.chat_prompts.ChatQuestion` lists from the topic
    questions of a ``--chat-prompts`` file; held-out ones are on held-out topics."""
    from .chat_prompts import ChatPromptConfig, sample_questions, split_topics, topic_questions
    pc = ChatPromptConfig.from_file(chat_prompts)
    train, held = split_topics(topic_questions(pc.topics, pc.templates), pc.held_out_fraction)
    return sample_questions(train, n_train, seed), sample_questions(held, n_held, seed + 1), pc


def answer_questions(target_dir: Path, questions: dict[str, list[tuple]], max_answer_tokens: int,
                     batch: int = 64, dtype: str = "bfloat16") -> dict[str, list[AnswerRow]]:
    """The base model's greedy answers (the engine, ``max_answer_tokens`` at most, ending
    at EOS) to each split's (question, prompt rendered with the chat template) pairs, cut
    to whole sentences; rows without one dropped."""
    from ..engine.llm import LLM
    from ..engine.params import SamplingParams
    from ..models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(target_dir)
    llm = LLM(str(target_dir), dtype=dtype, device="cpu", max_num_seqs=batch,
              max_num_batched_tokens=2048, enforce_eager=True, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=max_answer_tokens, temperature=0.0)
    fits = lambda s: len(tokenizer.encode(s).ids) <= max_answer_tokens   # noqa: E731
    out = {}
    for split, pairs in questions.items():
        ids = [tokenizer.encode(prompt).ids for _, prompt in pairs]
        t0, texts = time.monotonic(), []
        for a in range(0, len(ids), batch):
            texts += [tokenizer.decode(o.token_ids, skip_special_tokens=True)
                      for o in llm.generate(ids[a:a + batch], [params] * len(ids[a:a + batch]))]
            log.info("lora-data %s: %d/%d answered (%.0f s)", split, len(texts), len(ids),
                     time.monotonic() - t0)
        rows = [AnswerRow(q.text, q.source, p, leading_sentences(t, fits))
                for (q, p), t in zip(pairs, texts)]
        out[split] = [r for r in rows if r.answer]
    return out


def save_answers(rows: dict[str, list[AnswerRow]], out_dir: Path, summary: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    d = {"summary": summary} | {k: [r.to_dict() for r in v] for k, v in rows.items()}
    (out_dir / ANSWERS_FILE).write_text(json.dumps(d, indent=1, ensure_ascii=False) + "\n")
    return out_dir / ANSWERS_FILE


def load_answers(path: str | Path) -> tuple[dict[str, list[AnswerRow]], dict]:
    p = Path(path)
    p = p / ANSWERS_FILE if p.is_dir() else p
    if not p.is_file():
        raise FileNotFoundError(f"--data {path}: no {ANSWERS_FILE}; make one with "
                                "`tandem train lora-data --target ... --out DIR`")
    d = json.loads(p.read_text())
    return {k: [AnswerRow(**r) for r in d[k]] for k in ("train", "held_out")}, d["summary"]


def encode_rows(rows: list[AnswerRow], tokenizer, style_name: str, eos_id: int
                ) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, styled answer ids + EOS) per row: what the adapter is trained on."""
    apply = style(style_name).apply
    return [(tokenizer.encode(r.prompt).ids, tokenizer.encode(apply(r.answer)).ids + [eos_id])
            for r in rows]
