"""Speculative decoding through the server: greedy text of the disaggregated ensemble
``tandem`` and of ``tandem_colocated`` equals ``LLM.generate`` without speculation, for
MTP (a random head: most drafts rejected), draft-target (the model drafting for
itself: every draft accepted, so a wrong draft KV on the disaggregated path would show
as rejections in the acceptance metric) and ngram (prompt lookup: no proposer KV)."""
from __future__ import annotations

import pytest

from tandem.client.generate import stream_generate

from .triton_calls import eventually, metric

pytestmark = pytest.mark.e2e
SETTINGS = dict(max_num_seqs=8, page_size=4, max_num_batched_tokens=8, torch_threads=1)
PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\nclass Path:", "x"]


@pytest.fixture(scope="module")
def reference(greedy_reference):
    greedy = greedy_reference(12, page_size=4)
    return {p: greedy(p).text for p in PROMPTS}


@pytest.fixture(scope="module", params=["mtp", "draft_target", "ngram"])
def server(request, serve, demo_checkpoint, random_mtp_head):
    method = request.param
    extra = {"mtp": {"mtp_head": str(random_mtp_head)}, "draft_target": {"draft_model": str(demo_checkpoint)},
             "ngram": {}}[method]
    with serve(f"serve-spec-{method}", 300, mode="both", spec_method=method, num_speculative_tokens=3,
               disagg_policy="remote", **extra, **SETTINGS) as srv:
        yield method, srv


def _text(srv, model, prompt):
    rs = list(stream_generate(srv.grpc_url, prompt, model=model, timeout_s=60, max_tokens=12,
                              temperature=0.0, stream=True))
    assert rs[-1].final
    return "".join(r.text for r in rs)


def test_greedy_text_with_speculation_equals_plain_decoding(server, reference):
    method, srv = server
    for prompt in PROMPTS:
        assert _text(srv, "tandem", prompt) == reference[prompt]
        assert _text(srv, "tandem_colocated", prompt) == reference[prompt]

    def drafted():
        for model in ("decode", "llm"):
            assert metric(srv, "tandem_spec_drafts_total", model) > 0
            if method == "draft_target":
                # every draft accepted (the draft KV arrived intact); adaptive k (the server's
                # default) may verify fewer than 3 drafts a step, so at most 1 + 3 per round
                assert metric(srv, "tandem_spec_acceptance_rate", model) == 1.0
                assert 1.0 < metric(srv, "tandem_spec_mean_acceptance_length", model) <= 4.0
    eventually(drafted)
