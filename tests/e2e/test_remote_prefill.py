"""Remote prefill: one prefill server (`tandem serve --mode prefill`) feeds two decode
servers (`--prefill-endpoints`); each decode server's kv_transfer hands its jobs to it
(the decode servers run no prefill model), and the KV travels over UCX from the prefill
server into the decode server's pages. A prefill server that is down, hung or draining
costs no request: kv_transfer gives the reservation back and decode prefills the prompt
(``prefill_down``), the greedy text unchanged."""
from __future__ import annotations

import time
from contextlib import ExitStack

import pytest

from tandem.client.generate import stream_generate
from tandem.client.serve.triton_server import free_port, stub_processes

from .servers import served
from .triton_calls import eventually, metric

pytestmark = pytest.mark.e2e
SETTINGS = dict(max_num_seqs=8, page_size=4, max_num_batched_tokens=8, torch_threads=1)
PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\nclass Path:"]


def _served(run_dir, **options):
    """A server of these options and SETTINGS in ``run_dir``, for one test."""
    return served(run_dir, 300, **options, **SETTINGS)


@pytest.fixture(scope="module")
def servers(serve):
    with ExitStack() as stack:
        prefill = stack.enter_context(serve("prefill-server", 300, mode="prefill", **SETTINGS))
        decoders = [stack.enter_context(serve(f"decode-server-{i}", 300, prefill_endpoints=prefill.grpc_url,
                                              disagg_policy="remote", **SETTINGS))
                    for i in range(2)]
        yield prefill, decoders


@pytest.fixture(scope="module")
def reference(greedy_reference):
    greedy = greedy_reference(10, page_size=4, max_num_batched_tokens=8)
    return {p: greedy(p).text for p in PROMPTS}


def _text(srv, prompt):
    rs = list(stream_generate(srv.grpc_url, prompt, model="tandem", timeout_s=60, max_tokens=10,
                              temperature=0.0, stream=True))
    return "".join(r.text for r in rs)


def test_one_prefill_server_feeds_two_decode_servers(servers, reference):
    prefill, decoders = servers
    for srv in decoders:
        for p in PROMPTS:
            assert _text(srv, p) == reference[p]
    # the prefill server ran the prefills; the decode servers' kv_transfer handed them over
    assert f"[kv_transfer] prefilling on {prefill.grpc_url}" in (decoders[0].run_dir / "tritonserver.log").read_text()
    assert "prefill" not in [s.model for s in decoders[0].stubs()]

    def received():
        for srv in decoders:
            assert metric(srv, "tandem_kv_received_bytes_total", "kv_transfer") > 0
    eventually(received)


def _prefilled_here(srv) -> float:
    return metric(srv, "tandem_disagg_requests_total", "kv_transfer", path="local", reason="prefill_down")


def test_a_hung_prefill_server_is_skipped_then_used_again_when_it_answers(servers, reference):
    """SIGSTOP: the prefill server accepts connections and answers nothing. The job
    waiting for its ack gives its reservation back after the ack timeout and decode
    prefills it; the next ones skip the endpoint at once and are prefilled by decode too
    (same text); the decode server stays ready; once the prefill server answers again,
    it is used again."""
    import os
    import signal
    prefill, decoders = servers
    srv = decoders[0]
    here0 = _prefilled_here(srv)
    os.kill(prefill.process.pid, signal.SIGSTOP)
    try:
        assert _text(srv, PROMPTS[0]) == reference[PROMPTS[0]]
        assert _text(srv, PROMPTS[1]) == reference[PROMPTS[1]]
        assert srv.is_ready()
        eventually(lambda: _assert_at_least(_prefilled_here(srv), here0 + 2))
    finally:
        os.kill(prefill.process.pid, signal.SIGCONT)
    received = metric(srv, "tandem_kv_received_bytes_total", "kv_transfer")
    fresh = iter(f"# {i}\n{PROMPTS[0]}" for i in range(10_000))

    def used_again():   # a new prompt's KV comes from the prefill server again
        _text(srv, next(fresh))
        assert metric(srv, "tandem_kv_received_bytes_total", "kv_transfer") > received
    eventually(used_again, timeout_s=60)

    def freed():   # the reservations given back, and none left
        assert metric(srv, "tandem_kv_pages", "kv_transfer", state="reserved") == 0, \
            "a reservation was never freed"
    eventually(freed)


def _assert_at_least(value: float, want: float) -> None:
    assert value >= want, (value, want)


def test_an_unreachable_prefill_server_costs_no_request_and_leaks_nothing(tmp_path, demo_checkpoint,
                                                                         reference):
    dead = f"127.0.0.1:{free_port()}"
    with _served(tmp_path, model_dir=str(demo_checkpoint), prefill_endpoints=dead, disagg_policy="remote") as srv:
        for p in PROMPTS:
            assert _text(srv, p) == reference[p]             # prefilled by decode
        assert f"no prefill server took the job: {dead}" in (tmp_path / "tritonserver.log").read_text()

        def given_back():   # the reservation made for the job went back at once
            assert metric(srv, "tandem_kv_pages", "kv_transfer", state="reserved") == 0, \
                "the reservation was never given back"
            assert _prefilled_here(srv) == len(PROMPTS)
        eventually(given_back)
        assert srv.is_ready()
    assert stub_processes(tmp_path) == []


def test_while_no_prefill_server_takes_jobs_conditional_routing_prefills_here(tmp_path, demo_checkpoint,
                                                                              reference):
    """Every prefill server down: the job that finds it out is prefilled by decode, and
    for a while after it the decode server routes "long" prompts to itself at once
    (here every prompt of more than 4 tokens is long), reserving nothing."""
    dead = f"127.0.0.1:{free_port()}"
    with _served(tmp_path, model_dir=str(demo_checkpoint), prefill_endpoints=dead,
                 disagg_policy="conditional:local_prompt_tokens=4") as srv:
        assert _text(srv, PROMPTS[0]) == reference[PROMPTS[0]]
        # the next one, at once (well within LOCAL_WHILE_DOWN_S): routed here from the start
        assert _text(srv, PROMPTS[1]) == reference[PROMPTS[1]]

        def prefilled_here():
            assert _prefilled_here(srv) == 2
            assert metric(srv, "tandem_kv_reservations_total", "kv_transfer") == 1   # the first only
        eventually(prefilled_here)


def test_a_draining_prefill_server_finishes_the_jobs_it_took(tmp_path, demo_checkpoint, reference):
    """SIGTERM to a prefill pod (`tandem serve` calls drain): the jobs it accepted still
    stream their KV to the decoders that reserved pages for them; new jobs are refused
    (and prefilled by the decoder); the server then stops. Each job is held 4 s before it starts
    (fault injection), so one is surely in flight when the drain begins."""
    import concurrent.futures
    ckpt = str(demo_checkpoint)
    with _served(tmp_path / "prefill", model_dir=ckpt, mode="prefill", faults="prefill_delay_ms=4000") as prefill, \
            _served(tmp_path / "decode", model_dir=ckpt, prefill_endpoints=prefill.grpc_url,
                    disagg_policy="remote") as decode:
        assert _text(decode, PROMPTS[1]) == reference[PROMPTS[1]]       # warm
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            taken = metric(prefill, "nv_inference_request_success", "prefill")
            answer = pool.submit(_text, decode, PROMPTS[0])
            deadline = time.monotonic() + 30
            while metric(prefill, "nv_inference_request_success", "prefill") == taken:   # accepted
                assert time.monotonic() < deadline and not answer.done(), "the job never reached prefill"
                time.sleep(0.05)
            drained = pool.submit(prefill.drain, 60)
            deadline = time.monotonic() + 10
            while prefill.is_ready():
                assert time.monotonic() < deadline, "the draining prefill server still reads ready"
                time.sleep(0.05)
            assert answer.result(timeout=60) == reference[PROMPTS[0]]     # the job in flight finished
            assert drained.result(timeout=60) is True
        # the prefill server is gone: decode prefills the next prompt itself
        assert _text(decode, PROMPTS[1]) == reference[PROMPTS[1]]
        assert _prefilled_here(decode) == 1
        log = (prefill.run_dir / "tritonserver.log").read_text()
        assert "[prefill] KV transfer failed" not in log and "still in flight" not in log
    assert stub_processes(tmp_path / "prefill") == []
