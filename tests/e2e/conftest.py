"""Fixtures of the e2e modules: ``serve`` starts the servers a module needs, with its
own options; ``offline_llm`` and ``greedy_reference`` are the offline engine whose
greedy text a server's must equal."""
from __future__ import annotations

import pytest

from .servers import served


@pytest.fixture(scope="session")
def serve(tmp_path_factory, demo_checkpoint):
    """``serve(name, ready_timeout_s=180, exit_timeout_s=30, model_control_mode="explicit",
    **options)``: :func:`~tests.e2e.servers.served` in a fresh run dir ``name``; the demo
    checkpoint on one torch thread unless ``options`` say otherwise. A module's fixture
    holds its server in a ``with``::

        with serve("serve", mode="colocated") as srv:
            yield srv
    """
    def serve_(name: str, ready_timeout_s: float = 180, exit_timeout_s: int = 30, **options):
        options = {"model_dir": str(demo_checkpoint), "torch_threads": 1, **options}
        return served(tmp_path_factory.mktemp(name), ready_timeout_s, exit_timeout_s, **options)
    return serve_


@pytest.fixture(scope="module")
def offline_llm(demo_checkpoint):
    """``offline_llm(**settings)``: the offline engine (``LLM``) of the demo checkpoint
    with these engine settings, on one torch thread."""
    import torch

    from tandem.backends.engine.llm import LLM
    torch.set_num_threads(1)
    return lambda **settings: LLM(str(demo_checkpoint), **settings)


class Greedy:
    """``greedy(prompt, max_tokens=None)``: ``LLM.generate``'s greedy completion (its
    ``RequestOutput``) of a prompt, text or token ids, computed once."""

    def __init__(self, llm, max_tokens: int):
        self.llm, self.max_tokens, self._done = llm, max_tokens, {}

    def __call__(self, prompt, max_tokens: int | None = None):
        from tandem.backends.engine.params import SamplingParams
        n = self.max_tokens if max_tokens is None else max_tokens
        key = (tuple(prompt) if isinstance(prompt, list) else prompt, n)
        if key not in self._done:
            self._done[key] = self.llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0))[0]
        return self._done[key]


@pytest.fixture(scope="module")
def greedy_reference(offline_llm):
    """``greedy_reference(max_tokens, **settings)``: a :class:`Greedy` of
    ``offline_llm(**settings)``, ``max_tokens`` unless a call says otherwise."""
    return lambda max_tokens, **settings: Greedy(offline_llm(**settings), max_tokens)
