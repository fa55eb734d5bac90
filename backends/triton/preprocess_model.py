"""The ``preprocess`` model: validate a text request and tokenize its prompt.

Every check that needs no engine happens here, before kv_transfer reserves pages:
the request's fields (:func:`parse_generate_request`) and the prompt's length
against the context (:func:`check_context`). Outputs: ``input_ids`` (INT32 [1, n]) and
``prompt_echo`` (STRING [1, 1]), the text postprocess puts before the generated text,
which the engine model relays (:mod:`.postprocess` says why).
"""
from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from .disagg_common import INPUT_IDS
from .generate_request import RequestError, check_context, check_text_length, parse_generate_request
from .inputs import input_getter
from .per_request import PerRequestModel, error_response
from .postprocess import PROMPT_ECHO, prompt_echo
from .response_arrays import string_array
from .settings import EngineSettings, model_limits


class TritonPythonModel(PerRequestModel):
    def initialize(self, args: dict) -> None:
        from tandem.backends.models.tokenizer import load_tokenizer, max_token_bytes

        s = EngineSettings.from_model_config(json.loads(args["model_config"]))
        self.tokenizer = load_tokenizer(s.model_dir)
        if self.tokenizer is None:
            raise pb_utils.TritonModelException(f"model_dir {s.model_dir} has no tokenizer.json")
        self.vocab_size, self.max_model_len = model_limits(s.model_dir)
        self.max_token_bytes = max_token_bytes(self.tokenizer)

    def respond(self, request):
        get = input_getter(request)
        try:
            parsed = parse_generate_request(get, vocab_size=self.vocab_size)
            check_text_length(parsed.prompt, self.max_model_len, self.max_token_bytes)
            ids = self.tokenizer.encode(parsed.prompt).ids
            if not ids:
                raise RequestError("text_input", "has no tokens; allowed: a non-empty string")
            check_context(len(ids), parsed.max_tokens, self.max_model_len, "text_input")
        except RequestError as e:
            return error_response(str(e))
        ids = np.asarray(ids, dtype=np.int32).reshape(1, -1)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor(INPUT_IDS, ids), pb_utils.Tensor(PROMPT_ECHO, string_array(prompt_echo(parsed)))])
