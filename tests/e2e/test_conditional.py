"""Conditional disaggregation on a real tritonserver (``tandem serve`` with its default
``--disagg-policy conditional``, the local-prompt threshold lowered for the demo's short
prompts): kv_transfer sends a short prompt to decode's own batch (no reservation, no
transfer) and a long one to the prefill process (KV over UCX into reserved pages). The
``tandem_disagg_requests_total{path, reason}`` metric says which; either way the greedy
text equals the colocated engine's (``tandem_colocated`` on the same server, and the
offline engine), with and without speculation, and a cancelled stream gives its pages
back."""
from __future__ import annotations

import queue

import pytest

from tandem.client.generate import build_inputs, parse_response, stream_generate

from .triton_calls import busy_pages, eventually, metric, metric_reaches, pages_back, settled

pytestmark = pytest.mark.e2e
DISAGG, COLOCATED = "tandem", "tandem_colocated"
LOCAL_PROMPT_TOKENS = 12
POLICY = f"conditional:local_prompt_tokens={LOCAL_PROMPT_TOKENS}"
SHORT = "def f(x):"
LONG = "# " + "the quick brown fox jumps over the lazy dog " * 3
SETTINGS = dict(max_num_seqs=8, page_size=4, max_num_batched_tokens=8)


def _serve(serve, name, **options):
    return serve(name, 300, mode="both", disagg_policy=POLICY, **SETTINGS, **options)


@pytest.fixture(scope="module")
def server(serve):
    with _serve(serve, "serve-conditional") as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(greedy_reference):
    greedy = greedy_reference(12, **SETTINGS)
    lengths = {p: len(greedy.llm.engine.tokenize(p)) for p in (SHORT, LONG)}
    assert lengths[SHORT] <= LOCAL_PROMPT_TOKENS < lengths[LONG], lengths
    return {p: greedy(p).text for p in (SHORT, LONG)}


def _text(srv, model, prompt):
    rs = list(stream_generate(srv.grpc_url, prompt, model=model, timeout_s=60, max_tokens=12,
                              temperature=0.0, stream=True))
    assert rs[-1].final and rs[-1].finish_reason in ("stop", "length")
    return "".join(r.text for r in rs)


def _routed(srv) -> dict[tuple[str, str], float]:
    return {(path, reason): metric(srv, "tandem_disagg_requests_total", "kv_transfer",
                                   path=path, reason=reason)
            for path, reason in (("local", "short_prompt"), ("remote", "long_prompt"))}


@pytest.mark.parametrize("prompt, route", [(SHORT, ("local", "short_prompt")),
                                           (LONG, ("remote", "long_prompt"))])
def test_each_prompt_takes_its_path_and_decodes_the_colocated_text(server, reference, prompt, route):
    before = _routed(server)
    received = metric(server, "tandem_kv_received_bytes_total", "kv_transfer")
    assert _text(server, DISAGG, prompt) == reference[prompt]
    assert _text(server, COLOCATED, prompt) == reference[prompt]
    after = _routed(server)
    assert {k: after[k] - before[k] for k in after} == {k: float(k == route) for k in after}

    def moved():
        return metric(server, "tandem_kv_received_bytes_total", "kv_transfer") - received

    def remote_moved():
        assert moved() > 0
    if route[0] == "remote":
        eventually(remote_moved)
    else:
        assert settled(moved) == 0     # the local path transfers nothing


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["local", "remote"])
def test_a_cancelled_stream_frees_its_pages_on_either_path(server, reference, prompt):
    import tritonclient.grpc as grpcclient

    aborted_before = metric(server, "tandem_requests_finished_total", "decode", reason="abort")
    idle_pages = settled(lambda: busy_pages(server, "decode"))
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(DISAGG, build_inputs(prompt, max_tokens=1900, min_tokens=1900, stream=True),
                              enable_empty_final_response=True)
    for _ in range(2):
        result, error = results.get(timeout=60)
        assert error is None and not parse_response(result).final, error and error.message()
    client.stop_stream(cancel_requests=True)
    client.close()
    metric_reaches(server, "tandem_requests_finished_total", "decode", aborted_before + 1, reason="abort",
                   failing="decode did not abort the cancelled request")
    pages_back(server, idle_pages, "decode", failing="the cancelled request's pages were not freed")
    assert metric(server, "tandem_requests_in_engine", "decode") == 0
    assert _text(server, DISAGG, prompt) == reference[prompt]


@pytest.fixture(scope="module", params=["mtp", "draft_target", "ngram"])
def spec_server(request, serve, demo_checkpoint, random_mtp_head):
    method = request.param
    extra = {"mtp": {"mtp_head": str(random_mtp_head)},
             "draft_target": {"draft_model": str(demo_checkpoint)}, "ngram": {}}[method]
    with _serve(serve, f"serve-conditional-{method}", spec_method=method, num_speculative_tokens=3,
                **extra) as srv:
        yield method, srv


def test_speculation_is_lossless_on_both_paths(spec_server, reference):
    method, srv = spec_server
    before = _routed(srv)
    for prompt in (SHORT, LONG):
        assert _text(srv, DISAGG, prompt) == reference[prompt], prompt
        assert _text(srv, COLOCATED, prompt) == reference[prompt], prompt
    after = _routed(srv)
    assert all(after[k] - before[k] == 1 for k in after), (before, after)

    def drafted():
        assert metric(srv, "tandem_spec_drafts_total", "decode") > 0
        if method == "draft_target":   # the model drafting for itself: a wrong draft KV would show
            assert metric(srv, "tandem_spec_acceptance_rate", "decode") == 1.0
    eventually(drafted)
