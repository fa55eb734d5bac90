"""Each server's engine alone, offline: what ``tandem bench peers`` divides its served
throughput by (the **kept fraction**: served tok/s over the same engine's offline tok/s
on the same prompts, lengths and batch).

Tandem's ``LLM`` and vLLM's ``LLM`` each run in a process of their own (vLLM from its
venv), with each one's defaults for threads (vLLM's CPU environment as its server gets
it), the prompts already rendered through the model's chat template, greedy, exactly
``max_tokens`` tokens per sequence (``min_tokens`` and ``ignore_eos``). For every batch
size the batch's prompts go in one ``generate`` call after a warm-up call of the same
shape; tok/s = batch x max_tokens over the call's wall time (its prefills included, as
a served level's wall time includes them).

>>> kept({"1": 20.0, "4": 60.0}, {"1": 25.0, "4": 100.0})
{'1': 0.8, '4': 0.6}
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# run by the engine's own interpreter: argv[1] is a JSON job, one JSON line is printed
_TANDEM = r"""
import json, sys, time
job = json.loads(sys.argv[1])
from tandem.backends import LLM, SamplingParams
llm = LLM(job["model"], dtype=job["dtype"], max_num_seqs=max(job["batches"]))
params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
out = {}
for b in job["batches"]:
    prompts = job["prompts"][:b]
    llm.generate(prompts, params)                     # warm-up: same shapes, caches, compiles
    fresh = job["prompts"][b:2 * b]                   # unseen prompts: no prefix-cache hit
    t0 = time.perf_counter()
    res = llm.generate(fresh, params)
    wall = time.perf_counter() - t0
    out[str(b)] = sum(len(r.token_ids) for r in res) / wall
print(json.dumps(out), flush=True)
"""

_VLLM = r"""
import json, sys, time
job = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
llm = LLM(job["model"], dtype=job["dtype"], max_num_seqs=max(job["batches"]), seed=0)
params = SamplingParams(max_tokens=job["max_tokens"], min_tokens=job["max_tokens"], temperature=0.0,
                        ignore_eos=True)
out = {}
for b in job["batches"]:
    llm.generate(job["prompts"][:b], params, use_tqdm=False)
    fresh = job["prompts"][b:2 * b]
    t0 = time.perf_counter()
    res = llm.generate(fresh, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    out[str(b)] = sum(len(r.outputs[0].token_ids) for r in res) / wall
print("OFFLINE " + json.dumps(out), flush=True)
"""


class OfflineError(RuntimeError):
    """An engine's offline run failed."""


def run_offline(engine: str, python: Path, env: dict, model: Path, dtype: str, prompts: list[str],
                max_tokens: int, batches: list[int], timeout_s: float = 3600) -> dict[str, float]:
    """``{batch: tok/s}`` of ``engine`` (``tandem`` or ``vllm``) run by ``python``;
    ``prompts`` must hold 2 x the largest batch (a warm-up batch and a fresh one)."""
    if len(prompts) < 2 * max(batches):
        raise ValueError(f"{len(prompts)} prompts; the offline run needs {2 * max(batches)}")
    job = json.dumps({"model": str(model), "dtype": dtype, "prompts": prompts, "max_tokens": max_tokens,
                      "batches": sorted(batches)})
    code = _TANDEM if engine == "tandem" else _VLLM
    proc = subprocess.run([str(python), "-c", code, job], capture_output=True, text=True, env=env,
                          timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{") or ln.startswith("OFFLINE ")]
    if proc.returncode != 0 or not lines:
        raise OfflineError(f"{engine} offline run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {b: round(v, 2) for b, v in json.loads(lines[-1].removeprefix("OFFLINE ")).items()}


def kept(served: dict[str, float | None], offline: dict[str, float]) -> dict[str, float | None]:
    """Served tok/s over offline tok/s, per level."""
    return {c: (round(v / offline[c], 3) if v is not None and offline.get(c) else None)
            for c, v in served.items()}


def tandem_python() -> Path:
    return Path(sys.executable)
