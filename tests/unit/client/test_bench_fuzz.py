"""``tandem bench fuzz``' pure parts: what counts as a clean answer, and that the drawn
inputs are what the interfaces get (JSON with NaN as Python sends it, gRPC tensors of
every dtype and shape the strategy names)."""
from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from tandem.client.bench.fuzz import CLEAN, FAILED, classify_http, grpc_tensors
from tandem.client.bench.fuzz_inputs import encode, grpc_request, openai_body, triton_generate_body


def test_only_answers_that_name_their_error_are_clean():
    assert classify_http(200, b"{}") == (CLEAN, "200")
    assert classify_http(422, b'{"error": {"message": "temperature: ..."}}')[0] == CLEAN
    assert classify_http(400, b"<html>bad</html>")[0] == FAILED       # a 4xx that says nothing
    assert classify_http(503, b'{"error": "x"}')[0] == FAILED
    assert classify_http(None, b"", "timed out")[0] == FAILED


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_bodies_are_json_objects_of_the_interfaces_fields(data):
    body = data.draw(st.one_of(openai_body("completions"), openai_body("chat"), triton_generate_body(True)))
    decoded = json.loads(encode(body))
    assert isinstance(decoded, dict) and ({"prompt", "messages", "text_input"} & decoded.keys())


@settings(max_examples=60, deadline=None)
@given(grpc_request)
def test_grpc_tensors_take_the_dtype_and_shape_drawn(spec):
    try:
        tensors = grpc_tensors(spec)
    except Exception:          # the client refuses some shapes itself; the runner counts those clean
        return
    for t, (name, dtype, shape, _) in zip(tensors, spec):
        assert t.name() == name and t.datatype() == dtype and list(t.shape()) == list(shape)
