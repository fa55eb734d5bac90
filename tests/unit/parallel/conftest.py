"""The engines a test starts at some tensor-parallel size, closed (their ranks stopped)
after it."""
from __future__ import annotations

import pytest

from tandem.backends import LLM


@pytest.fixture
def engines():
    """``engines(model_dir, **kw)``: an fp32 :class:`LLM`, its ranks stopped after the test."""
    made = []

    def make(model_dir, **kw) -> LLM:
        llm = LLM(model_dir, dtype="float32", **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.engine.close()
