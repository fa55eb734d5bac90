"""Chat questions for a chat model's self-distillation data (``tandem train distill-data
--chat-prompts``): what a user asks, before the model's chat template renders it.

Two sources, both available offline:

- **topics x templates** (``configs/chat_prompts.json``, written for this project): every
  template (``"Explain {topic} in simple terms."``) filled with every topic. A topic is
  held out as a whole (a hash of its name), so held-out questions are about topics the
  head never saw.
- **the Python standard library's docstrings** (the corpus of :mod:`.corpus`, PSF
  licence): questions about a module, a function or a class, quoting the first line of
  its docstring. The corpus's own file split decides: training files give training
  questions, validation files held-out ones.

>>> qs = topic_questions(["tides"], ["Explain {topic}.", "Why do {topic} matter?"])
>>> [q.text for q in qs]
['Explain tides.', 'Why do tides matter?']
>>> split_topics(qs, held_out_fraction=0.0)[1]
[]
"""
from __future__ import annotations

import ast
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from .corpus import Document, is_validation
from .loop import config_section

CONFIG_NAME = "chat prompts config"
MAX_SUMMARY_CHARS = 160


@dataclass(slots=True, frozen=True)
class ChatQuestion:
    kind: str       # "topic" or "stdlib"
    source: str     # the topic, or path:line of the documented definition
    text: str       # the user's message


@dataclass(slots=True)
class ChatPromptConfig:
    """The JSON of ``--chat-prompts``: the seeds and how many questions of each source."""
    topics: list[str] = field(default_factory=list)
    templates: list[str] = field(default_factory=list)      # each holds "{topic}"
    stdlib_templates: list[str] = field(default_factory=list)  # {module} {name} {kind} {summary}
    stdlib_fraction: float = 0.35       # share of training questions from the stdlib
    held_out_fraction: float = 0.1      # share of topics held out
    system: str | None = None           # a system message; None: the template's default
    licence: str = ""

    @classmethod
    def from_file(cls, path: str | Path) -> "ChatPromptConfig":
        d = json.loads(Path(path).read_text())
        cfg = config_section(cls, {k: v for k, v in d.items() if k != "comment"}, CONFIG_NAME)
        if not cfg.topics or not cfg.templates:
            raise ValueError(f"{CONFIG_NAME} {path}: needs topics and templates")
        bad = [t for t in cfg.templates if "{topic}" not in t]
        if bad:
            raise ValueError(f"{CONFIG_NAME} {path}: templates without {{topic}}: {bad[:3]}")
        if not 0.0 <= cfg.stdlib_fraction <= 1.0 or not 0.0 <= cfg.held_out_fraction < 1.0:
            raise ValueError(f"{CONFIG_NAME} {path}: stdlib_fraction must be in [0, 1] and "
                             "held_out_fraction in [0, 1)")
        return cfg


def topic_questions(topics: list[str], templates: list[str]) -> list[ChatQuestion]:
    """Every template filled with every topic."""
    return [ChatQuestion("topic", t, tpl.format(topic=t)) for t in topics for tpl in templates]


def split_topics(questions: list[ChatQuestion], held_out_fraction: float
                 ) -> tuple[list[ChatQuestion], list[ChatQuestion]]:
    """(training, held-out) questions: a topic is held out when the hash of its name
    falls under ``held_out_fraction`` (:func:`.corpus.is_validation`'s rule)."""
    train, held = [], []
    for q in questions:
        (held if is_validation(q.source, held_out_fraction) else train).append(q)
    return train, held


def documented(doc: Document) -> list[tuple[str, str, int, str]]:
    """(kind, name, line, summary) of a file's module docstring and its public top-level
    functions and classes that have one; summary: the docstring's first line."""
    try:
        tree = ast.parse(doc.text)
    except (SyntaxError, ValueError):
        return []
    module = doc.path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    out = []
    text = ast.get_docstring(tree)
    if text and text.strip():
        out.append(("module", module, 1, text.strip().splitlines()[0]))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and not node.name.startswith("_"):
            text = ast.get_docstring(node)
            if text and text.strip():
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                out.append((kind, f"{module}.{node.name}", node.lineno, text.strip().splitlines()[0]))
    return out


def stdlib_questions(docs: list[Document], templates: list[str]) -> list[ChatQuestion]:
    """One question per documented definition of ``docs`` (:func:`documented`), its
    template chosen by a hash of the definition's name (stable across runs)."""
    out = []
    for doc in docs:
        for kind, name, line, summary in documented(doc):
            summary = summary.strip().rstrip(".")[:MAX_SUMMARY_CHARS]
            module = name if kind == "module" else name.rsplit(".", 1)[0]
            usable = [t for t in templates if kind == "module" or "{name}" in t]
            if kind == "module":
                usable = [t for t in templates if "{name}" not in t] or usable
            tpl = usable[sum(name.encode()) % len(usable)]
            out.append(ChatQuestion("stdlib", f"{doc.path}:{line}",
                                    tpl.format(module=module, name=name, kind=kind, summary=summary)))
    return out


def sample_questions(questions: list, n: int, seed: int) -> list:
    """``n`` questions (or any items) drawn without replacement (all of them, shuffled,
    when fewer)."""
    picked = list(questions)
    random.Random(seed).shuffle(picked)
    return picked[:n]


def chat_messages(question: ChatQuestion, system: str | None = None) -> list[dict]:
    """The messages a chat template renders for a question.

    >>> chat_messages(ChatQuestion("topic", "tides", "Explain tides."), "Be brief.")
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Explain tides.'}]
    """
    user = [{"role": "user", "content": question.text}]
    return ([{"role": "system", "content": system}] if system else []) + user
