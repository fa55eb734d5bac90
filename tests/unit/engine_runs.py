"""Running requests on an offline engine step by step, for tests that need each
request's sequence and its final output (not just ``LLM.generate``'s results)."""
from __future__ import annotations


def run_all(llm, prompts, params) -> tuple[list, dict]:
    """Add ``prompts`` (one ``SamplingParams`` each) and step until none is left:
    (their sequences, request id -> final ``RequestOutput``)."""
    seqs = [llm.engine.make_sequence(p, sp) for p, sp in zip(prompts, params)]
    for s in seqs:
        llm.engine.add(s)
    finals = {}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            if out.finished:
                finals[out.request_id] = out
    return seqs, finals
