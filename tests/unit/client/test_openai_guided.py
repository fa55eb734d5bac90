"""Structured output through the OpenAI API: response_format and vLLM's extras become
the ensemble's guided decoding inputs; a malformed one is a 400 naming its field."""
from __future__ import annotations

import json

import pytest

from tandem.client.openai.ensemble_request import DEFAULT_DECLARED, GUIDE_INPUTS, ensemble_inputs, upstream_error
from tandem.client.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
DECLARED = DEFAULT_DECLARED | set(GUIDE_INPUTS)


def chat(**fields):
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


@pytest.mark.parametrize("req,want", [
    (chat(response_format={"type": "json_object"}), ("json_schema", '{"type": "object"}')),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}),
     ("json_schema", json.dumps(SCHEMA))),
    (chat(response_format={"type": "text"}), None),
    (CompletionRequest(model="m", prompt="x", guided_json=SCHEMA), ("json_schema", json.dumps(SCHEMA))),
    (CompletionRequest(model="m", prompt="x", guided_regex="[0-9]+"), ("regex", "[0-9]+")),
    (CompletionRequest(model="m", prompt="x", guided_grammar='root ::= "a"'), ("ebnf_grammar", 'root ::= "a"')),
    (CompletionRequest(model="m", prompt="x", guided_choice=["yes", 'n"o']), ("ebnf_grammar", 'root ::= "yes" | "n\\"o"')),
    (CompletionRequest(model="m", prompt="x", structured_outputs={"regex": "a+"}), ("regex", "a+")),
    (CompletionRequest(model="m", prompt="x", structured_outputs={"json_object": True}),
     ("json_schema", '{"type": "object"}')),
    (CompletionRequest(model="m", prompt="x", response_format={"type": "json_object"}),
     ("json_schema", '{"type": "object"}')),
])
def test_each_interface_becomes_the_ensembles_guide(req, want):
    req.unsupported()
    arrays = ensemble_inputs(req, "x", DECLARED, index=0, max_tokens=8)
    got = (tuple(arrays[n][0, 0].decode() for n in GUIDE_INPUTS) if GUIDE_INPUTS[0] in arrays else None)
    assert got == want


@pytest.mark.parametrize("req,param", [
    (chat(response_format={"type": "yaml"}), "response_format"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
    (chat(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex"),
    (CompletionRequest(model="m", prompt="x", structured_outputs={"structural_tag": "x"}), "structured_outputs"),
    (CompletionRequest(model="m", prompt="x", guided_choice=[]), "guided_choice"),
    (CompletionRequest(model="m", prompt="x", guided_regex=" "), "guided_regex"),
])
def test_malformed_structured_output_is_a_400_naming_the_field(req, param):
    with pytest.raises(OpenAIError) as e:
        req.unsupported()
    assert (e.value.status, e.value.param) == (400, param)


def test_an_ensemble_without_the_inputs_refuses_rather_than_ignores():
    with pytest.raises(OpenAIError) as e:
        ensemble_inputs(chat(response_format={"type": "json_object"}), "x", DEFAULT_DECLARED, index=0,
                        max_tokens=8)
    assert (e.value.status, e.value.param) == (400, "response_format")


def test_the_ensembles_compile_error_is_a_400_on_response_format():
    e = upstream_error("in ensemble 'tandem', guided_decoding_guide: the json_schema guide does not "
                       'compile: Unsupported type "nonsense"')
    assert (e.status, e.param) == (400, "response_format") and "nonsense" in e.message
