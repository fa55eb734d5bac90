"""Adaptive speculation's choices on Triton's metrics port: steps by (k, reason), draft
and accepted tokens by proposer, counted as increments of the engine's totals."""
import sys
import types

from tandem.backends.speculative.metrics import SpecDecodeMetrics

from .fakes import metric, stand_in_pb_utils


def test_steps_by_k_and_reason_and_tokens_by_method(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stand_in_pb_utils())
    monkeypatch.delitem(sys.modules, "tandem.backends.triton.metrics", raising=False)
    from tandem.backends.triton.metrics import EngineMetrics
    m = EngineMetrics("llm", "1")
    spec = SpecDecodeMetrics(3)
    engine = types.SimpleNamespace(spec_metrics=spec, kv_pages=(30, 2))
    spec.record_choice(3, "speculate")
    spec.record_choice(0, "plain_faster")
    spec.record(2, 3, "ngram")
    m.poll_engine(engine)
    spec.record_choice(3, "speculate")
    spec.record(1, 2, "mtp")
    m.poll_engine(engine)
    assert metric("tandem_spec_steps_total", k="3", reason="speculate") == 2
    assert metric("tandem_spec_steps_total", k="0", reason="plain_faster") == 1
    assert metric("tandem_spec_method_draft_tokens_total", method="ngram") == 3
    assert metric("tandem_spec_method_accepted_tokens_total", method="mtp") == 1
    assert metric("tandem_spec_draft_tokens_total") == 5 and metric("tandem_spec_accepted_tokens_total") == 3
