"""lm-evaluation-harness (``lm_eval`` 0.4.13, unchanged, from its own venv that ``make
test`` installs) scores the served model through the OpenAI API with its
``local-completions`` model: token-id prompts, ``echo`` with ``logprobs`` for the
log-likelihoods, ``stop`` for the generations. The tasks are local
(:mod:`tandem.client.bench.lm_eval_tasks`, written here; no hub): a multiple-choice task,
a log-likelihood task and a ``generate_until`` task.

Every request is answered (``max_retries=1``: a refused one fails the run), and the
scores are those of the checkpoint itself: each request's log-likelihood equals HF
transformers' (fp32) to 1e-4 and is greedy exactly where transformers' argmax is, so
acc, acc_norm and perplexity are transformers'; each generation is the engine's greedy
completion cut at the stop."""
from __future__ import annotations

import math

import pytest

from tandem.client.bench.lm_eval_harness import run_lm_eval
from tandem.client.bench.lm_eval_tasks import (GEN, LL, MAX_GEN_TOKS, MC, UNTIL, generation_docs, loglikelihood_docs,
                                               multiple_choice_docs, write_task, write_tasks)
from tandem.client.openai.frontend import start_for
from tandem.client.serve.triton_server import free_port

pytestmark = pytest.mark.e2e
LOGPROB_TOL = 1e-4
# a loglikelihood task whose continuations are, every other one, the model's own greedy
# tokens (an untrained model is greedy on none of the shared tasks' continuations)
LL_GREEDY = "tandem_ll_greedy"


@pytest.fixture(scope="module")
def api(serve):
    with serve("lm-eval", max_num_seqs=4) as server:
        frontend = start_for(server, free_port())
        try:
            yield frontend
        finally:
            frontend.stop()


@pytest.fixture(scope="module")
def evaluate(api, demo_checkpoint, hf, tmp_path_factory):
    """``evaluate(*tasks)``: lm_eval on those tasks against the API, run once."""
    work = tmp_path_factory.mktemp("lm-eval")
    tasks_dir, done = write_tasks(work / "tasks"), {}
    write_task(tasks_dir, LL_GREEDY, LL, greedy_docs(hf))

    def evaluate_(*tasks):
        if tasks not in done:
            done[tasks] = run_lm_eval(api.base_url, "tandem", demo_checkpoint, tasks_dir,
                                      work / "-".join(tasks), tasks)
        return done[tasks]
    return evaluate_


class HF:
    """transformers (fp32) on the checkpoint, scoring as lm-eval defines it."""

    def __init__(self, checkpoint):
        import torch
        import transformers
        torch.set_num_threads(1)
        self.torch = torch
        self.tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def score(self, context: str, continuation: str) -> tuple[float, bool]:
        """(log-likelihood, greedy) of ``continuation`` after ``context``, encoded as
        lm-eval encodes a pair: trailing spaces go to the continuation, the whole is
        encoded and the context's tokens cut off its front."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        ctx = self.encode(context)
        cont = self.encode(context + continuation)[len(ctx):]
        with self.torch.inference_mode():
            logits = self.model(self.torch.tensor([ctx + cont])).logits[0]
        logp = logits.float().log_softmax(-1)[len(ctx) - 1:-1]
        target = self.torch.tensor(cont)
        return float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())

    def next_token(self, context: str, rank: int) -> str | None:
        """The text of the ``rank``-th likeliest token after ``context`` (0: the greedy
        one), None when it would not encode back to that token after the context."""
        ids = self.encode(context)
        with self.torch.inference_mode():
            token = int(self.model(self.torch.tensor([ids])).logits[0, -1].topk(rank + 1).indices[rank])
        text = self.tok.decode([token])
        return text if self.encode(context + text) == ids + [token] else None


@pytest.fixture(scope="module")
def hf(demo_checkpoint):
    pytest.importorskip("transformers")
    return HF(demo_checkpoint)


def greedy_docs(hf: HF, n: int = 12) -> list[dict]:
    """The multiple-choice questions continued by the model's greedy token (even
    documents) or its runner-up (odd ones)."""
    docs = []
    for d in multiple_choice_docs():
        context = f"Question: {d['question']}\nAnswer:"
        target = hf.next_token(context, rank=len(docs) % 2)
        if target is not None and len(docs) < n:
            docs.append({"context": context, "target": target})
    return docs


def hf_scores(evaluation, task, score) -> list[list[tuple[float, bool]]]:
    return [[score(ctx, cont) for ctx, cont in doc] for doc in evaluation.requests(task)]


def assert_loglikelihoods_equal(got, want, task):
    for doc, (g_doc, w_doc) in enumerate(zip(got, want, strict=True)):
        for i, ((g, g_greedy), (w, w_greedy)) in enumerate(zip(g_doc, w_doc, strict=True)):
            assert g == pytest.approx(w, abs=LOGPROB_TOL), f"{task} doc {doc} request {i}: {g} != HF {w}"
            assert g_greedy == w_greedy, f"{task} doc {doc} request {i}: greedy {g_greedy}, HF {w_greedy}"


def argmax(values):
    return max(range(len(values)), key=lambda i: (values[i], -i))   # the first of a tie, as numpy's


def test_multiple_choice_scores_are_transformers_own(evaluate, hf):
    ev = evaluate(MC, LL, LL_GREEDY)
    assert [s["doc"] for s in ev.samples[MC]] == multiple_choice_docs()     # every document scored
    want = hf_scores(ev, MC, hf.score)
    assert_loglikelihoods_equal(ev.loglikelihoods(MC), want, MC)
    docs = [s["doc"] for s in ev.samples[MC]]
    acc = sum(argmax([ll for ll, _ in w]) == d["label"] for w, d in zip(want, docs)) / len(docs)
    acc_norm = sum(argmax([ll / len(c) for (ll, _), c in zip(w, d["choices"])]) == d["label"]
                   for w, d in zip(want, docs)) / len(docs)
    assert ev.scores[MC] == pytest.approx({"acc": acc, "acc_norm": acc_norm}, abs=1e-4)


@pytest.mark.parametrize("task", [LL, LL_GREEDY])
def test_loglikelihood_scores_are_transformers_own(evaluate, hf, task):
    ev = evaluate(MC, LL, LL_GREEDY)
    if task == LL:
        assert [s["doc"] for s in ev.samples[LL]] == loglikelihood_docs()
    want = hf_scores(ev, task, hf.score)
    if task == LL_GREEDY:      # so the greedy flags are tested both ways
        assert 0 < sum(w[0][1] for w in want) < len(want), want
    assert_loglikelihoods_equal(ev.loglikelihoods(task), want, task)
    lls = [w[0][0] for w in want]
    acc = sum(w[0][1] for w in want) / len(want)
    assert ev.scores[task]["acc"] == pytest.approx(acc, abs=1e-4)
    assert ev.scores[task]["perplexity"] == pytest.approx(math.exp(-sum(lls) / len(lls)), rel=1e-4)


def test_generations_are_the_engines_greedy_completions(evaluate, hf, greedy_reference):
    ev = evaluate(GEN)
    assert [s["doc"] for s in ev.samples[GEN]] == generation_docs()
    greedy = greedy_reference(MAX_GEN_TOKS)
    got = ev.generations(GEN)
    want = [greedy(hf.encode(s["doc"]["prompt"])).text.split(UNTIL[0])[0] for s in ev.samples[GEN]]
    assert got == want
    docs = [s["doc"] for s in ev.samples[GEN]]
    exact = sum(g.replace(" ", "") == d["answer"] for g, d in zip(got, docs)) / len(docs)
    assert ev.scores[GEN]["exact_match"] == pytest.approx(exact, abs=1e-4)
