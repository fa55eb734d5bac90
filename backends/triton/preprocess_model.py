"""The ``preprocess`` model: validate a generate request and tokenize its prompt.

Every check that needs no engine happens here, before kv_transfer reserves pages:
the request's fields (:func:`parse_generate_request`) and the prompt's length
against the context. Output: ``input_ids`` (INT32 [1, n]).
"""
from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from .disagg_common import INPUT_IDS
from .generate_request import RequestError, parse_generate_request
from .settings import EngineSettings


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from tandem.backends.models.config import ModelConfig
        from tandem.backends.models.tokenizer import load_tokenizer

        s = EngineSettings.from_model_config(json.loads(args["model_config"]))
        self.tokenizer = load_tokenizer(s.model_dir)
        if self.tokenizer is None:
            raise pb_utils.TritonModelException(f"model_dir {s.model_dir} has no tokenizer.json")
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.max_model_len = ModelConfig.from_dir(s.model_dir).max_position_embeddings

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        def get(name: str):
            t = pb_utils.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()
        try:
            parsed = parse_generate_request(get, vocab_size=self.vocab_size)
            ids = self.tokenizer.encode(parsed.prompt).ids
            if not ids:
                raise RequestError("text_input", "has no tokens; allowed: a non-empty string")
            room = self.max_model_len - len(ids)
            if room < 1:
                raise RequestError("text_input", f"has {len(ids)} tokens; the context is "
                                   f"{self.max_model_len} tokens, leaving room for at least one new token")
            if parsed.max_tokens > room:
                raise RequestError("max_tokens", f"got {parsed.max_tokens}; the prompt has "
                                   f"{len(ids)} tokens of a {self.max_model_len}-token context; "
                                   f"allowed: <= {room}")
        except RequestError as e:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e)))
        ids = np.asarray(ids, dtype=np.int32).reshape(1, -1)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(INPUT_IDS, ids)])
