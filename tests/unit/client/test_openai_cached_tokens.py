"""The OpenAI API's cached prompt tokens and cache_salt."""
import pytest

from tandem.client.openai.app import _usage
from tandem.client.openai.ensemble_request import DEFAULT_DECLARED, ensemble_inputs
from tandem.client.openai.protocol import CompletionRequest, OpenAIError
from tandem.client.openai.responses import Choice
from tandem.client.openai.triton_backend import EnsembleResponse


def test_usage_reports_the_cached_prompt_tokens_when_the_ensemble_does():
    """``usage.prompt_tokens_details.cached_tokens`` (OpenAI's) from ``num_cached_tokens``;
    a ``cache_salt`` goes to the ensemble."""
    c = Choice(0)
    c.add(EnsembleResponse("x", "length", 40, 1, num_cached_tokens=32))
    assert _usage([c], 1).model_dump() == {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41,
                                           "prompt_tokens_details": {"cached_tokens": 32}}
    assert "prompt_tokens_details" not in _usage([Choice(0)], 1).model_dump()
    req = CompletionRequest(model="tandem", prompt="x", cache_salt="tenant-a")
    arrays = ensemble_inputs(req, "x", DEFAULT_DECLARED | {"cache_salt"}, index=0, max_tokens=4)
    assert arrays["cache_salt"].tolist() == [[b"tenant-a"]]
    with pytest.raises(OpenAIError, match="cache_salt"):
        ensemble_inputs(req, "x", DEFAULT_DECLARED, index=0, max_tokens=4)
