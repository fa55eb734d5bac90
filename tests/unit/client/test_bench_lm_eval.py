"""``tandem bench lm-eval`` without servers: the local tasks it writes, lm-eval's output
read back, and the comparison of two servers' evaluations."""
from __future__ import annotations

import json

import pytest

from tandem.client.bench.lm_eval import compare, markdown
from tandem.client.bench.lm_eval_harness import Evaluation
from tandem.client.bench.lm_eval_tasks import GEN, LL, MC, TASKS, write_tasks


def test_the_tasks_read_their_data_from_local_files_only(tmp_path):
    write_tasks(tmp_path)
    for task in TASKS:
        config = json.loads((tmp_path / f"{task}.yaml").read_text())
        data = config["dataset_kwargs"]["data_files"]["test"]
        assert config["task"] == task and config["dataset_path"] == "json" and data == str(tmp_path / f"{task}.jsonl")
        assert len((tmp_path / f"{task}.jsonl").read_text().splitlines()) >= 16
    assert write_tasks(tmp_path / "again") and all(
        (tmp_path / f"{t}.jsonl").read_text() == (tmp_path / "again" / f"{t}.jsonl").read_text() for t in TASKS)


def lm_eval_output(dest, scores: dict, lls: dict[str, list[list[float]]], gens: list[str]) -> None:
    """What lm_eval --output_path --log_samples writes, reduced to what is read."""
    model = dest / "tandem"
    model.mkdir(parents=True)
    (model / "results_2026-12-05T00-00-00.json").write_text(json.dumps({"results": {
        t: {"alias": t, **{f"{m},none": v for m, v in s.items()}, **{f"{m}_stderr,none": 0.1 for m in s}}
        for t, s in scores.items()}}))
    for task, docs in lls.items():
        rows = [{"doc_id": i, "arguments": {f"gen_args_{j}": {"arg_0": "ctx", "arg_1": f" {j}"} for j in range(len(d))},
                 "filtered_resps": [[str(v), str(v > -1)] for v in d]} for i, d in enumerate(docs)]
        (model / f"samples_{task}_2026-12-05T00-00-00.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = [{"doc_id": i, "filtered_resps": [g]} for i, g in enumerate(gens)]
    (model / f"samples_{GEN}_2026-12-05T00-00-00.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def evaluations(tmp_path):
    def make(name, acc=0.5, gens=(" 7", " 8"), ll=-0.5):
        scores = {MC: {"acc": acc, "acc_norm": 0.25}, LL: {"perplexity": 3.0, "acc": 0.5}, GEN: {"exact_match": 0.5}}
        lm_eval_output(tmp_path / name, scores, {MC: [[ll, -2.0], [-1.0, -3.0]], LL: [[-0.25], [-4.0]]}, list(gens))
        return Evaluation.read(tmp_path / name, TASKS)
    return make


def test_lm_evals_output_is_read_back(evaluations):
    ev = evaluations("a")
    assert ev.scores[MC] == {"acc": 0.5, "acc_norm": 0.25}
    assert ev.loglikelihoods(MC) == [[(-0.5, True), (-2.0, False)], [(-1.0, False), (-3.0, False)]]
    assert ev.requests(LL) == [[("ctx", " 0")], [("ctx", " 0")]] and ev.generations(GEN) == [" 7", " 8"]


def test_equal_evaluations_compare_equal(evaluations):
    cmp = compare({"tandem": evaluations("t"), "vllm": evaluations("v")})
    assert all(row["equal_to_4"] for metrics in cmp["scores"].values() for row in metrics.values())
    assert cmp["generations"]["identical"] and cmp["loglikelihoods"][MC] == {
        "requests": 4, "max_abs_diff": 0.0, "greedy_differs": 0}


def test_a_score_a_generation_and_a_greedy_flag_that_differ_are_named(evaluations):
    cmp = compare({"tandem": evaluations("t", acc=0.5001, gens=(" 7", " 9"), ll=-1.5),
                   "vllm": evaluations("v")})
    assert not cmp["scores"][MC]["acc"]["equal_to_4"] and cmp["scores"][MC]["acc_norm"]["equal_to_4"]
    assert cmp["generations"]["differing"] == [{"doc": 1, "tandem": " 9", "vllm": " 8"}]
    assert cmp["loglikelihoods"][MC] == {"requests": 4, "max_abs_diff": 1.0, "greedy_differs": 1}
    table = markdown({"failed": {}, "comparison": cmp})
    assert "| tandem_mc | acc | 0.5001 | 0.5000 | NO |" in table and "1 differ" in table
