"""How the adapter tests call a Triton model: its config and initialize() arguments,
request tensors typed as the configs declare them, and what the model sent back."""

from __future__ import annotations

import json
import time
import uuid

import numpy as np

from tandem.backends.triton.generate_request import INPUTS

from .fakes import FINAL, Request


def model_config(model_dir="/ckpt", decoupled=True, **params):
    params = {"model_dir": model_dir, "torch_threads": "1", "cancel_poll_ms": "5", **params}
    return {"name": "llm", "model_transaction_policy": {"decoupled": decoupled},
            "parameters": {k: {"string_value": str(v)} for k, v in params.items()}}


def model_args(model_dir):
    # a fresh instance name: each model binds its own cancel socket
    return {"model_config": json.dumps(model_config(str(model_dir))), "model_name": "llm", "model_version": "1",
            "model_instance_name": f"llm_{uuid.uuid4().hex[:8]}"}


NUMPY_TYPES = {"TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_UINT64": np.uint64, "TYPE_BOOL": np.bool_}


TYPES = {name: NUMPY_TYPES[t] for name, (t, _) in INPUTS.items() if t in NUMPY_TYPES}


def arrays(**extra):
    """Request tensors with the batch dimension, typed as the configs declare them."""
    out = {}
    for k, v in extra.items():
        if k in ("stop_words", "bad_words", "embedding_bias_words"):
            out[k] = np.array([[w.encode() for w in v]], dtype=object)
        elif k == "embedding_bias_weights":
            out[k] = np.array([list(v)], dtype=np.float32)
        elif k == "input_ids":
            out[k] = np.array([list(v)], dtype=np.int32).reshape(1, len(v))
        elif k == "stop":
            out[k] = np.array([[v]], dtype=np.bool_)
        elif k in ("text_input", "text_output", "finish_reason", "cancel_token", "prompt_echo", "lora_name"):
            out[k] = np.array([[v if isinstance(v, bytes) else v.encode()]], dtype=object)
        elif k in ("num_input_tokens", "num_output_tokens"):
            out[k] = np.array([[v]], dtype=np.uint32)
        elif k == "sequence_index":
            out[k] = np.array([[v]], dtype=np.int32)
        elif k == "cum_log_probs":
            out[k] = np.array([[v]], dtype=np.float32)
        elif k == "output_log_probs":
            out[k] = np.array(v, dtype=np.float32).reshape(1, 1, -1)
        else:
            out[k] = np.array([[v]], dtype=TYPES[k])
    return out


def token_request(ids=(5, 6, 7), request_id: str = "", **extra):
    return Request(request_id, **arrays(input_ids=ids, **extra))


def streaming_one_token(model, engine, **extra):
    """A streamed request of 50 tokens executed on ``model`` whose first token (" a") the
    fake ``engine`` has produced: ``(request, on_output)``."""
    import types
    request = token_request(stream=True, max_tokens=50, **extra)
    model.execute([request])
    _, _, on_output = engine.submitted[-1]
    on_output(types.SimpleNamespace(request_id="req-0", new_token_ids=[1], new_text=" a", finished=False,
                                    finish_reason=None, num_prompt_tokens=3, num_output_tokens=1))
    return request, on_output


def outputs(sender):
    return [(r.outputs, flags) for r, flags in sender.sent if r is not None and r.error is None]


def texts(sender):
    return [o["text_output"].reshape(-1)[0].decode() for o, _ in outputs(sender)]


def the_error(sender):
    # replies leave on the model's sender thread (reply_pump): wait for the final one
    wait_for(lambda: sender.final, timeout=10.0)
    (response, flags), = sender.sent
    assert flags & FINAL
    return response.error


def wait_for(condition, timeout=2.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)
