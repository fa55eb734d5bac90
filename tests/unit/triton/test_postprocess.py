"""Postprocess's outputs (backends/triton/postprocess.py): the prompt echo, log probs,
the sequence index and token ids passed on."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.backends.triton.generate_request import RequestError, parse_generate_request, parse_token_request
from tandem.backends.triton.response_arrays import OUTPUT_NAMES, TOKEN_OUTPUT_NAMES

from .fakes import CONTEXT, VOCAB
from .model_calls import arrays


def reply(**extra):
    """An engine reply as postprocess receives it."""
    return arrays(text_output=" b", finish_reason="", num_input_tokens=3, num_output_tokens=1, **extra)


@pytest.mark.parametrize("stream,exclude,echo", [
    (None, None, "a ="),        # the defaults: not streaming, prompt included (TensorRT-LLM)
    (False, False, "a ="),
    (False, True, ""),
    (True, False, ""),          # streaming never repeats the prompt
    (True, True, ""),
])
def test_the_prompt_is_echoed_only_in_a_whole_non_streaming_text(stream, exclude, echo):
    from tandem.backends.triton.postprocess import prompt_echo

    flags = {k: v for k, v in (("stream", stream), ("exclude_input_in_output", exclude)) if v is not None}
    assert prompt_echo(parse_generate_request(arrays(text_input="a =", **flags).get)) == echo
    assert prompt_echo(parse_token_request(arrays(input_ids=[1], **flags).get, VOCAB, CONTEXT)) == ""


def test_postprocess_puts_the_relayed_echo_first():
    from tandem.backends.triton.postprocess import ensemble_outputs

    out = ensemble_outputs(reply(prompt_echo="a =").get)
    assert out["text_output"][0].decode() == "a = b"
    assert set(out) == set(OUTPUT_NAMES)
    assert (out["finish_reason"][0, 0], int(out["num_output_tokens"][0, 0])) == (b"", 1)
    assert ensemble_outputs(reply(prompt_echo="").get)["text_output"][0] == b" b"


def test_postprocess_passes_log_probs_and_the_sequence_index_on():
    from tandem.backends.triton.postprocess import ensemble_outputs

    out = ensemble_outputs(reply(sequence_index=1, cum_log_probs=-0.75, output_log_probs=[-0.25, -0.5]).get)
    assert int(out["sequence_index"][0, 0]) == 1 and float(out["cum_log_probs"][0, 0]) == -0.75
    assert out["output_log_probs"].tolist() == [[[-0.25, -0.5]]]


def test_postprocess_passes_token_ids_on_and_needs_no_echo():
    from tandem.backends.triton.postprocess import ensemble_outputs

    out = ensemble_outputs(reply().get)   # tandem_tokens: no echo
    assert out["text_output"][0] == b" b" and "output_ids" not in out
    out = ensemble_outputs({**reply(), "output_ids": np.array([[7, 8]], dtype=np.int32)}.get)
    assert out["output_ids"].tolist() == [[7, 8]] and set(out) == set(TOKEN_OUTPUT_NAMES)
    with pytest.raises(RequestError, match="^text_output: is required"):
        ensemble_outputs({}.get)
