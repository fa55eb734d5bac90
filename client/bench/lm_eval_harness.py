"""lm-evaluation-harness (``lm_eval``, unchanged, from its own venv ``.venv-lmeval`` that
``make test`` installs) run against an OpenAI API, and what it writes read back: the
scores of each task and, per sample, the log-likelihoods or the generation it got.

Its ``local-completions`` model sends token-id prompts: for a log-likelihood request
``{"prompt": [[ids]], "max_tokens": 1, "logprobs": 1, "echo": true, "temperature": 0,
"seed": 1234}``, reading ``choices[i].logprobs.token_logprobs[ctxlen:-1]`` (summed) and
``top_logprobs[ctxlen:-1]`` (greedy where each token's value is its dict's maximum);
for ``generate_until`` ``{"prompt": [[ids]], "max_tokens", "temperature", "stop": until
+ [eos], "seed"}``. Its tokenizer is the checkpoint's, by ``tokenizer=<dir>`` (the
``auto`` backend first probes ``GET <server>/tokenizer_info``; without one it loads the
Hugging Face tokenizer), everything offline (:data:`~.lm_eval_tasks.OFFLINE_ENV`).

>>> model_args("http://127.0.0.1:9000/v1", "tandem", "/ckpt").split(",")[1:4]
['base_url=http://127.0.0.1:9000/v1/completions', 'tokenizer=/ckpt', 'tokenized_requests=True']
>>> scores({"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": "t", "sample_len": 2})
{'acc': 0.5}
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tandem.client.bench.lm_eval_tasks import OFFLINE_ENV, TASKS
from tandem.client.paths import REPO_ROOT

LMEVAL_VENV = REPO_ROOT / ".venv-lmeval"
LM_EVAL = LMEVAL_VENV / "bin" / "lm_eval"


class LmEvalError(RuntimeError):
    """lm_eval is missing, or it ended with an error."""


def model_args(base_url: str, model: str, tokenizer: Path | str) -> str:
    """``--model_args`` of ``local-completions`` for the API at ``base_url`` (``.../v1``):
    token-id prompts, one request at a time, no retry (a refused request fails the run)."""
    return (f"model={model},base_url={base_url}/completions,tokenizer={tokenizer},tokenized_requests=True,"
            "num_concurrent=1,max_retries=1")


def lm_eval_version() -> str | None:
    python = LMEVAL_VENV / "bin" / "python"
    proc = subprocess.run([str(python), "-c", "from importlib.metadata import version; print(version('lm_eval'))"],
                          capture_output=True, text=True) if python.exists() else None
    return proc.stdout.strip() if proc is not None and proc.returncode == 0 else None


def run_lm_eval(base_url: str, model: str, tokenizer: Path, tasks_dir: Path, out: Path,
                tasks: tuple[str, ...] = TASKS, timeout_s: float = 1800) -> "Evaluation":
    """``lm_eval --model local-completions`` on ``tasks`` (their YAMLs in ``tasks_dir``),
    samples logged, into ``out``; its log in ``out/lm_eval.log``."""
    if not LM_EVAL.exists():
        raise LmEvalError(f"{LM_EVAL} is missing: `make test` installs it (the Makefile's .venv-lmeval)")
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(LM_EVAL), "--model", "local-completions", "--model_args", model_args(base_url, model, tokenizer),
           "--tasks", ",".join(tasks), "--include_path", str(tasks_dir), "--output_path", str(out / "results"),
           "--log_samples"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OFFLINE_ENV, HF_HOME=str(out / "hf"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=out, env=env)
    log = out / "lm_eval.log"
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise LmEvalError(f"lm_eval exited {proc.returncode}: {refusal(proc.stdout + proc.stderr)} (log: {log})\n"
                          f"{(proc.stdout + proc.stderr)[-3000:]}")
    return Evaluation.read(out / "results", tasks)


def refusal(log: str) -> str:
    """What the server answered a request lm-eval gave up on (its warning before the
    retry), else the log's last line.

    >>> refusal('x\\nWARNING [api_models:470] API request failed with error message: {"error": 1}. Retrying...\\ny')
    '{"error": 1}'
    """
    marker = "API request failed with error message: "
    for line in log.splitlines():
        if marker in line:
            return line.split(marker, 1)[1].removesuffix(". Retrying...")
    return next((line for line in reversed(log.splitlines()) if line.strip()), "")


def scores(task_results: dict) -> dict[str, float]:
    """``{metric: value}`` of one task's entry in lm-eval's results (filter ``none``)."""
    return {key.split(",")[0]: value for key, value in task_results.items()
            if key.endswith(",none") and "_stderr" not in key}


@dataclass(slots=True)
class Evaluation:
    """What one lm_eval run wrote: ``scores[task][metric]`` and ``samples[task]`` (its
    logged samples in document order)."""
    scores: dict[str, dict[str, float]]
    samples: dict[str, list[dict]]

    @classmethod
    def read(cls, results_dir: Path, tasks: tuple[str, ...]) -> "Evaluation":
        found = sorted(results_dir.rglob("results_*.json"))
        if not found:
            raise LmEvalError(f"lm_eval wrote no results under {results_dir}")
        results = json.loads(found[-1].read_text())["results"]
        samples = {}
        for task in tasks:
            files = sorted(results_dir.rglob(f"samples_{task}_[0-9]*.jsonl"))   # the date follows
            rows = [json.loads(line) for line in files[-1].read_text().splitlines()] if files else []
            samples[task] = sorted(rows, key=lambda r: r["doc_id"])
        return cls({t: scores(results[t]) for t in tasks if t in results}, samples)

    def loglikelihoods(self, task: str) -> list[list[tuple[float, bool]]]:
        """Per document, (log-likelihood, greedy) of each request (each choice)."""
        return [[(float(ll), greedy == "True") for ll, greedy in s["filtered_resps"]] for s in self.samples[task]]

    def generations(self, task: str) -> list[str]:
        return [s["filtered_resps"][0] for s in self.samples[task]]

    def requests(self, task: str) -> list[list[tuple[str, str]]]:
        """Per document, the (context, continuation) of each request lm-eval made."""
        return [[(a["arg_0"], a["arg_1"]) for a in s["arguments"].values()] for s in self.samples[task]]
