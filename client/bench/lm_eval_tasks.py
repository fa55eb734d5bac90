"""The local tasks lm-evaluation-harness runs against an OpenAI API in ``tandem bench
lm-eval`` and tests/e2e/test_lm_eval.py: their data (JSON lines) and task YAMLs written
into a directory for ``lm_eval --include_path``, with nothing from a hub (the ``json``
dataset builder on local files). The content is generated, the same on every call:

- ``tandem_mc`` (``multiple_choice``, acc and acc_norm): sums with 4 choices and
  "which is larger" with 2;
- ``tandem_ll`` (``loglikelihood``, perplexity and acc, the greedy match): the next
  number of an arithmetic sequence;
- ``tandem_gen`` (``generate_until`` ``"\\n"``, 16 tokens at most, exact_match): few-shot
  sums.

>>> [d["choices"] for d in multiple_choice_docs()][:1]
[['31', '28', '30', '29']]
>>> loglikelihood_docs()[0]
{'context': 'Count on: 2, 4, 6, 8,', 'target': ' 10'}
>>> sorted(TASKS)
['tandem_gen', 'tandem_ll', 'tandem_mc']
"""
from __future__ import annotations

import json
import random
from pathlib import Path

MC, LL, GEN = "tandem_mc", "tandem_ll", "tandem_gen"
TASKS = (MC, LL, GEN)
MAX_GEN_TOKS = 16
UNTIL = ["\n"]
# the environment lm_eval runs in: the tokenizer and the data from local files only
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}


def multiple_choice_docs(n: int = 32, seed: int = 0) -> list[dict]:
    """Half sums (4 choices: the sum and three neighbours), half "which is larger" (2)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        if i % 2 == 0:
            choices = [str(a + b + d) for d in (0, 1, -1, 2)]
            rng.shuffle(choices)
            docs.append({"question": f"What is {a} plus {b}?", "choices": choices,
                         "label": choices.index(str(a + b))})
        else:
            b = b + 1 if a == b else b
            choices = [str(a), str(b)]
            docs.append({"question": f"Which number is larger, {a} or {b}?", "choices": choices,
                         "label": choices.index(str(max(a, b)))})
    return docs


def loglikelihood_docs(n: int = 20) -> list[dict]:
    """Four terms of ``start, start + step, ...``; the target is the fifth."""
    docs = []
    for i in range(n):
        start, step = 2 + i % 5, 2 + i // 5
        terms = [start + k * step for k in range(5)]
        docs.append({"context": "Count on: " + ", ".join(map(str, terms[:4])) + ",", "target": f" {terms[4]}"})
    return docs


def generation_docs(n: int = 16, seed: int = 1) -> list[dict]:
    """Two worked sums, then one to answer on the line."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        a, b, c, d, e, f = (rng.randint(1, 30) for _ in range(6))
        docs.append({"prompt": f"Q: {a} + {b} = ?\nA: {a + b}\nQ: {c} + {d} = ?\nA: {c + d}\nQ: {e} + {f} = ?\nA:",
                     "answer": str(e + f)})
    return docs


def local(task: str, data: Path) -> dict:
    """What every task's config says: its name, its data (JSON lines, no hub)."""
    return {"task": task, "dataset_path": "json", "dataset_name": None,
            "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test", "metadata": {"version": 1.0}}


MEAN = {"aggregation": "mean", "higher_is_better": True}


def multiple_choice_config(task: str, data: Path) -> dict:
    return {**local(task, data), "output_type": "multiple_choice", "doc_to_text": "Question: {{question}}\nAnswer:",
            "doc_to_choice": "choices", "doc_to_target": "label",
            "metric_list": [{"metric": "acc", **MEAN}, {"metric": "acc_norm", **MEAN}]}


def loglikelihood_config(task: str, data: Path) -> dict:
    """``target`` as written is the continuation (a space included): a loglikelihood
    task puts no delimiter before it."""
    return {**local(task, data), "output_type": "loglikelihood", "doc_to_text": "context", "doc_to_target": "target",
            "metric_list": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                            {"metric": "acc", **MEAN}]}


def generation_config(task: str, data: Path) -> dict:
    return {**local(task, data), "output_type": "generate_until", "doc_to_text": "prompt", "doc_to_target": "answer",
            "generation_kwargs": {"until": UNTIL, "max_gen_toks": MAX_GEN_TOKS, "do_sample": False,
                                  "temperature": 0.0},
            # the answer follows "A:" after a space the model writes
            "metric_list": [{"metric": "exact_match", **MEAN, "regexes_to_ignore": [" "]}]}


KINDS = {MC: (multiple_choice_config, multiple_choice_docs), LL: (loglikelihood_config, loglikelihood_docs),
         GEN: (generation_config, generation_docs)}


def write_task(dest: Path, task: str, kind: str, docs: list[dict]) -> None:
    """A task named ``task`` like ``kind`` (one of :data:`TASKS`) on ``docs``: its data
    and its YAML (JSON, which YAML reads) in ``dest``."""
    config, _ = KINDS[kind]
    dest.mkdir(parents=True, exist_ok=True)
    data = dest / f"{task}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (dest / f"{task}.yaml").write_text(json.dumps(config(task, data), indent=1) + "\n")


def write_tasks(dest: Path) -> Path:
    """The tasks of :data:`TASKS` in ``dest``: the directory to give ``lm_eval
    --include_path``."""
    for task, (_, docs) in KINDS.items():
        write_task(dest, task, task, docs())
    return dest
