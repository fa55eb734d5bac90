"""Reply tensors (backends/triton/response_arrays.py): the engine model's and the
ensemble's, shaped as TensorRT-LLM shapes them."""

from __future__ import annotations

import numpy as np

from tandem.backends.triton.perf_outputs import PERF_OUTPUT_NAMES
from tandem.backends.triton.response_arrays import SequenceReply, engine_arrays, ensemble_arrays


def NO_LOGPROBS(_n):
    return {"output_top_token_ids": (1, 0, 0), "output_top_log_probs": (1, 0, 0), "prompt_token_ids": (1, 0),
            "prompt_log_probs": (1, 0), "prompt_top_token_ids": (1, 0, 0), "prompt_top_log_probs": (1, 0, 0)}


def test_engine_replies_have_a_batch_dimension():
    r = SequenceReply([4, 5], "hé", "stop", 3, 2, sequence_index=1, log_probs=[-0.5, -1.0], cum_log_prob=-1.5)
    a = engine_arrays(r)
    assert {k: v.shape for k, v in a.items()} == {
        "output_ids": (1, 2), "text_output": (1, 1), "finish_reason": (1, 1), "num_input_tokens": (1, 1),
        "num_output_tokens": (1, 1), "cum_log_probs": (1, 1), "output_log_probs": (1, 1, 2),
        **NO_LOGPROBS(2), "sequence_index": (1, 1), **{n: (1, 1) for n in PERF_OUTPUT_NAMES}}
    assert a["text_output"][0, 0].decode() == "hé" and a["num_input_tokens"].dtype == np.uint32
    assert a["output_ids"].dtype == np.int32 and a["output_ids"].tolist() == [[4, 5]]
    assert engine_arrays(SequenceReply([], "", "abort", 3, 0))["output_ids"].shape == (1, 0)


def test_ensemble_responses_are_shaped_as_tensorrt_llm_shapes_them():
    """text_output is one string per row, as TensorRT-LLM's postprocessing returns it:
    its clients read ``as_numpy("text_output")[0].decode()``; the rest as its
    tensorrt_llm model answers ([batch, beam, ...])."""
    r = SequenceReply([4], " x", None, 3, 1, sequence_index=2, log_probs=[-0.25], cum_log_prob=-0.25)
    a = ensemble_arrays(r)
    assert a["text_output"].shape == (1,) and a["text_output"][0].decode() == " x"
    assert {k: v.shape for k, v in a.items() if k != "text_output"} == {
        "finish_reason": (1, 1), "num_input_tokens": (1, 1), "num_output_tokens": (1, 1),
        "cum_log_probs": (1, 1), "output_log_probs": (1, 1, 1), **NO_LOGPROBS(1), "context_logits": (1, 0, 0),
        "generation_logits": (1, 1, 0, 0), "batch_index": (1, 1), "sequence_index": (1, 1),
        **{n: (1, 1) for n in PERF_OUTPUT_NAMES}}
    assert int(a["sequence_index"][0][0]) == 2 and int(a["batch_index"][0][0]) == 0
    assert "output_ids" not in a and ensemble_arrays(r, with_ids=True)["output_ids"].tolist() == [[4]]


def test_alternatives_and_prompt_log_probs_go_there_and_back():
    """What the engine model sends is what postprocess reads: the alternatives per token,
    the prompt's log probabilities with NaN and padding at position 0, dropped again."""
    import math

    from tandem.backends.triton.response_arrays import PromptReply, logprobs_from
    prompt = PromptReply([5, 6, 7], [math.nan, -1.5, -0.25], [[], [6, 2], [7, 9]],
                         [[], [-1.5, -2.0], [-0.25, -3.0]])
    r = SequenceReply([8], " y", None, 3, 1, log_probs=[-0.1], top_ids=[[8, 1]], top_log_probs=[[-0.1, -2.5]],
                      prompt=prompt)
    a = engine_arrays(r)
    assert a["prompt_top_token_ids"].tolist() == [[[-1, -1], [6, 2], [7, 9]]]
    assert a["output_top_token_ids"].shape == (1, 1, 2) and a["prompt_log_probs"].shape == (1, 3)
    top_ids, top_values, back = logprobs_from(a.get)
    assert top_ids == [[8, 1]] and top_values == [[-0.10000000149011612, -2.5]]
    assert back.token_ids == [5, 6, 7] and math.isnan(back.log_probs[0]) and back.log_probs[1:] == [-1.5, -0.25]
    assert back.top_ids == prompt.top_ids and back.top_log_probs == prompt.top_log_probs
    none = logprobs_from(engine_arrays(SequenceReply([8], "", None, 3, 1)).get)
    assert none == ([], [], None)
    k0 = PromptReply([5, 6], [math.nan, -1.0], [[], []], [[], []])
    assert logprobs_from(engine_arrays(SequenceReply([8], "", None, 2, 1, prompt=k0)).get)[2] .top_ids == [[], []]
