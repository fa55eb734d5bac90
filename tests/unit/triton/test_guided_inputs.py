"""TensorRT-LLM's guided decoding inputs: parsed and checked by name, compiled before
anything is reserved, and carried to the engine's SamplingParams."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tandem.backends.engine.params import GuidedDecoding
from tandem.backends.triton.generate_request import (RequestError, check_guide, parse_generate_request,
                                                     parse_token_request)

DEMO = Path(__file__).resolve().parents[3] / "checkpoints" / "demo" / "target"


def text(value: str) -> np.ndarray:
    return np.array([[value.encode()]], dtype=object)


def request(**inputs):
    arrays = {"text_input": text("x"), **{k: text(v) for k, v in inputs.items()}}
    return parse_generate_request(arrays.get)


@pytest.mark.parametrize("kind,guide", [("json", None), ("json_schema", '{"type": "object"}'),
                                        ("regex", "[0-9]+"), ("ebnf_grammar", 'root ::= "a"')])
def test_each_guide_type_reaches_the_sampling_params(kind, guide):
    inputs = {"guided_decoding_guide_type": kind, **({"guided_decoding_guide": guide} if guide else {})}
    req = request(**inputs)
    assert req.guided_decoding == GuidedDecoding(kind, guide or "")
    assert req.sampling_params(1).guided_decoding == GuidedDecoding(kind, guide or "")
    ids = parse_token_request({"input_ids": np.array([[5, 9]], dtype=np.int32),
                               **{k: text(v) for k, v in inputs.items()}}.get, 100, 64)
    assert ids.guided_decoding == req.guided_decoding


def test_no_guide_type_is_no_guide():
    assert request().guided_decoding is None
    assert request(guided_decoding_guide_type="").guided_decoding is None


@pytest.mark.parametrize("inputs,field,says", [
    (dict(guided_decoding_guide_type="yaml"), "guided_decoding_guide_type", "allowed: json, json_schema"),
    (dict(guided_decoding_guide="[0-9]"), "guided_decoding_guide_type", "is required"),
    (dict(guided_decoding_guide_type="regex"), "guided_decoding_guide", "regular expression"),
    (dict(guided_decoding_guide_type="json_schema", guided_decoding_guide=" "), "guided_decoding_guide",
     "JSON schema"),
])
def test_bad_guide_inputs_are_refused_by_name(inputs, field, says):
    with pytest.raises(RequestError) as e:
        request(**inputs)
    assert e.value.field == field and says in str(e.value)


def test_a_guide_that_does_not_compile_is_refused_with_xgrammars_reason():
    pytest.importorskip("xgrammar")
    from tandem.backends.engine.guided import GuideCompiler
    from tandem.backends.models.tokenizer import load_tokenizer

    compiler = GuideCompiler(load_tokenizer(DEMO), 4096, [1])
    check_guide(request(guided_decoding_guide_type="regex", guided_decoding_guide="[0-9]+"),
                compiler.compile)
    with pytest.raises(RequestError) as e:
        check_guide(request(guided_decoding_guide_type="json_schema",
                            guided_decoding_guide='{"type": "nonsense"}'), compiler.compile)
    assert e.value.field == "guided_decoding_guide"
    assert str(e.value) == ('guided_decoding_guide: the json_schema guide does not compile: '
                            'Unsupported type "nonsense"')
