"""The KV control plane on a real tritonserver (`tandem serve`, disaggregated): the
internal models are reachable by any client of the Triton port, so descriptors sent
straight to ``decode`` and ``prefill`` are hostile — another request's slot and
generation without its secret, an out-of-range slot, a huge page size. Each is
refused, alone, and the request whose reservation they name completes with its
exact text. A small pool under 4x the long prompts it fits, with random cancels,
aborts no batch: every request ends with its text, UNAVAILABLE (pool full, retry
later), invalid-argument (can never fit) or cancelled, and the pool's counters come
back to idle."""
from __future__ import annotations

import dataclasses
import queue
import random
import secrets
import threading
import time

import numpy as np
import pytest

from tandem.client.generate import build_inputs, parse_response

from .triton_calls import busy_pages, eventually, first_answer, metric, pages_back, settled, tensors

pytestmark = pytest.mark.e2e
PAGE_SIZE, MAX_TOKENS = 4, 24
PRESSURE_TOKENS = 64     # long enough that running sequences hold most of the pool
LONG = "# " + "the quick brown fox jumps over the lazy dog " * 6
VICTIM = "def fibonacci(n):\n    if n < 2:\n        return n\n"


@pytest.fixture(scope="module")
def tokenizer(demo_checkpoint):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(demo_checkpoint / "tokenizer.json"))


@pytest.fixture(scope="module")
def long_pages(tokenizer) -> int:
    """KV pages one long request needs, prompt and output."""
    return -(-(len(tokenizer.encode(LONG).ids) + MAX_TOKENS) // PAGE_SIZE)


@pytest.fixture(scope="module")
def server(serve, long_pages):
    # about 2.5 long requests fit; each holds its reservation until decode claims it
    with serve("serve-kv-control", 300, max_num_seqs=8, page_size=PAGE_SIZE, max_num_batched_tokens=16,
               num_pages=int(2.5 * long_pages), disagg_policy="remote") as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(greedy_reference):
    return greedy_reference(MAX_TOKENS, page_size=PAGE_SIZE)


# -- calling the internal models by hand ------------------------------------------------------
def _ids(tokenizer, text) -> list[int]:
    return tokenizer.encode(text).ids


def _kv_transfer(server, ids) -> bytes:
    """What the ensemble's kv_transfer step returns: a fresh reservation's descriptor
    (whose job kv_transfer has handed to the prefill model)."""
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        result = client.infer("kv_transfer", tensors(
            input_ids=np.array([ids], dtype=np.int32),
            max_tokens=np.array([[MAX_TOKENS]], dtype=np.int32)))
        return result.as_numpy("kv_descriptor").tobytes()
    finally:
        client.close()


def _prefill(server, ids, desc: bytes):
    """``prefill`` by hand: (accepted, error message)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.infer("prefill", tensors(input_ids=np.array([ids], dtype=np.int32),
                                        kv_descriptor=np.frombuffer(desc, np.uint8)[None]))
        return True, ""
    except InferenceServerException as e:
        return False, e.message()
    finally:
        client.close()


def _decode_inputs(ids, desc: bytes):
    return tensors(input_ids=np.array([ids], dtype=np.int32),
                   max_tokens=np.array([[MAX_TOKENS]], dtype=np.int32),
                   temperature=np.array([[0.0]], dtype=np.float32),
                   stream=np.array([[True]], dtype=np.bool_),
                   kv_descriptor=np.frombuffer(desc, np.uint8)[None])


def _decode(server, ids, desc: bytes) -> tuple[list[int], str | None]:
    """``decode`` by hand, streamed to the end: (output ids, error message)."""
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    out = []
    try:
        client.async_stream_infer("decode", _decode_inputs(ids, desc),
                                  enable_empty_final_response=True)
        while True:
            result, error = answers.get(timeout=120)
            if error is not None:
                return out, error.message()
            r = parse_response(result)
            out += list(r.output_ids)
            if r.final:
                return out, None
    finally:
        client.stop_stream()
        client.close()


def _forgeries(desc: bytes) -> dict[str, bytes]:
    from tandem.rdma import DestinationDescriptor, ModelSpec, ShardScheme
    d = DestinationDescriptor.from_bytes(desc)
    huge = ModelSpec("target", 1, 2, 1, 1 << 20, "uint8", "NHD")
    return {
        "its slot and generation, a guessed secret":
            dataclasses.replace(d, secret=secrets.token_bytes(16), _plan=None).to_bytes(),
        "a slot out of range": dataclasses.replace(d, slot=1 << 30, _plan=None).to_bytes(),
        "a huge page size": DestinationDescriptor(d.worker_address, d.slot, d.generation, 1, (0,),
                                                  (huge,), ShardScheme(1), ShardScheme(2),
                                                  secret=d.secret).to_bytes(),
    }


def test_forged_descriptors_are_refused_and_the_victim_completes(server, tokenizer, reference):
    ids = _ids(tokenizer, VICTIM)
    victim = _kv_transfer(server, ids)
    for why, forged in _forgeries(victim).items():
        result, error = first_answer(server.grpc_url, "decode", _decode_inputs(ids, forged))
        assert error is not None, f"decode accepted a descriptor with {why}"
        assert "kv_descriptor" in error.message(), error.message()
        accepted, message = _prefill(server, ids, forged)
        if why == "its slot and generation, a guessed secret" or why == "a slot out of range":
            # it fits this prefill's pools; the receiver refuses it when it opens the
            # transfer, and only that transfer (and its prefill) ends
            assert accepted, message
        else:
            assert not accepted and "kv_descriptor" in message, message
    assert server.is_ready()
    # the victim's own descriptor (its KV sent by the prefill kv_transfer handed it to)
    # still carries it through decode
    tokens, error = _decode(server, ids, victim)
    assert error is None and tokens == reference(ids).token_ids


def test_a_request_that_can_never_fit_the_pool_is_refused_up_front(server, tokenizer):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    client = grpcclient.InferenceServerClient(server.grpc_url)
    ids = _ids(tokenizer, LONG)
    try:
        with pytest.raises(InferenceServerException) as e:
            client.infer("kv_transfer", tensors(input_ids=np.array([ids], dtype=np.int32),
                                                max_tokens=np.array([[1500]], dtype=np.int32)))
    finally:
        client.close()
    assert "KV pages" in e.value.message() and "max_tokens" in e.value.message()
    assert "INVALID_ARG" in str(e.value.status())


def test_a_cancelled_request_gives_its_reservation_up_and_a_late_prefill_is_refused(
        server, tokenizer):
    """A client of ``decode`` cancels right after it began waiting for the prompt's KV
    (which kv_transfer's hand-off may have delivered by then): the reservation is given
    up at once, its pages come back, and a prefill that comes later for it is refused by
    the receiver. (The cancel while the KV is still in flight, with the prefill side told
    to stop: tests/disagg/test_kv_control.py.)"""
    import tritonclient.grpc as grpcclient
    idle = settled(lambda: _pool_pages(server))
    ids = _ids(tokenizer, LONG)
    desc = _kv_transfer(server, ids)

    def reserved():
        assert _pool_pages(server) != idle                   # pages reserved
    eventually(reserved)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: None)
    client.async_stream_infer("decode", _decode_inputs(ids, desc), enable_empty_final_response=True)
    client.stop_stream(cancel_requests=True)
    client.close()
    pages_back(server, idle, *POOL_MODELS, failing="the cancelled request's reservation was not freed")
    from tandem.rdma import DestinationDescriptor
    d = DestinationDescriptor.from_bytes(desc)
    assert _prefill(server, ids, desc) == (True, "")         # too late: refused when it opens
    refused = f"reservation {d.slot}/{d.generation} is not live here"
    deadline = time.monotonic() + 60
    while refused not in server.log_file.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the late prefill was not refused"
        time.sleep(0.2)
    assert settled(lambda: _pool_pages(server)) == idle


# -- the pool under pressure ------------------------------------------------------------------
POOL_MODELS = ("decode", "kv_transfer")


def _pool_pages(server) -> tuple[float, ...]:
    return busy_pages(server, *POOL_MODELS)


def _one(server, prompt, cancel_after: int | None, results: list, refusals: list, i: int) -> None:
    """Stream one request; retry while the pool is full (as a client told 'retry
    later' would), cancel after ``cancel_after`` responses if given."""
    import tritonclient.grpc as grpcclient
    for attempt in range(6):
        client = grpcclient.InferenceServerClient(server.grpc_url)
        answers: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer("tandem", build_inputs(prompt, max_tokens=PRESSURE_TOKENS,
                                                         temperature=0.0, stream=True),
                                  enable_empty_final_response=True)
        text, n, outcome = "", 0, None
        while outcome is None:
            result, error = answers.get(timeout=180)
            if error is not None:
                outcome = ("error", str(error.status()), error.message())
                break
            r = parse_response(result)
            text, n = text + r.text, n + 1
            if r.final:
                outcome = ("ok", r.finish_reason, text)
            elif cancel_after is not None and n >= cancel_after:
                client.stop_stream(cancel_requests=True)
                outcome = ("cancelled", "", text)
        client.stop_stream()
        client.close()
        # a stream error carries the message only (kv_transfer answers UNAVAILABLE)
        if outcome[0] == "error" and "retry later" in outcome[2]:
            refusals.append(outcome[2])
            if attempt < 5:
                time.sleep(0.5 + random.random())
                continue
        results[i] = outcome
        return


def test_a_small_pool_under_four_times_its_load_aborts_no_batch(server, reference):
    idle = settled(lambda: _pool_pages(server))
    prompts = [f"# request {i}\n{LONG}" for i in range(10)]
    cancels = [None, 2, None, None, 1, None, 5, None, None, 3]   # cancelled mid-stream
    results: list = [None] * len(prompts)
    refusals: list = []
    threads = [threading.Thread(target=_one, args=(server, p, c, results, refusals, i))
               for i, (p, c) in enumerate(zip(prompts, cancels))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    kinds = {"ok": 0, "cancelled": 0, "unavailable": 0}
    for (p, cancel), res in zip(zip(prompts, cancels), results):
        assert res is not None, "a request never ended"
        if res[0] == "ok":
            # the engine's exact text: no batch aborted, no page written twice
            assert res[2] == reference(p, PRESSURE_TOKENS).text
            kinds["ok"] += 1
        elif res[0] == "cancelled":
            assert cancel is not None
            kinds["cancelled"] += 1
        else:
            # the only refusal a request that fits may get: the pool is full, retry later
            assert "KV pool is full" in res[2] and "retry later" in res[2], res
            kinds["unavailable"] += 1
    print("outcomes:", kinds, "pool-full answers:", len(refusals))
    assert kinds["ok"] >= 2 and refusals, (kinds, refusals)   # it was over-subscribed
    # every page and reservation comes back (reservations of cancelled requests too)
    pages_back(server, idle, *POOL_MODELS, failing="pool not idle")
    assert metric(server, "tandem_requests_finished_total", "decode", reason="error") == 0
    assert server.is_ready()
