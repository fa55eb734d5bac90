"""LoRA adapters on Triton's metrics port: adapters in the slots, loads, evictions and
requests per adapter, counted as increments of the engine pool's totals."""
import sys
import types

from tandem.backends.lora.pool import LoRAStats

from .fakes import metric, stand_in_pb_utils


def test_adapters_loads_evictions_and_requests_per_adapter(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stand_in_pb_utils())
    monkeypatch.delitem(sys.modules, "tandem.backends.triton.metrics", raising=False)
    from tandem.backends.triton.metrics import EngineMetrics
    m = EngineMetrics("llm", "1")
    engine = types.SimpleNamespace(spec_metrics=None, kv_pages=(30, 2),
                                   lora=LoRAStats({"sql": 1}, {"sql": 3}, loads=1, evictions=0, max_loras=2))
    m.poll_engine(engine)
    engine.lora = LoRAStats({"sql": 0, "chat": 2}, {"sql": 4, "chat": 2}, loads=3, evictions=1, max_loras=2)
    m.poll_engine(engine)
    assert metric("tandem_lora_adapters_loaded") == 2 and metric("tandem_lora_slots") == 2
    assert metric("tandem_lora_loads_total") == 3 and metric("tandem_lora_evictions_total") == 1
    assert metric("tandem_lora_requests_total", adapter="sql") == 4
    assert metric("tandem_lora_requests_total", adapter="chat") == 2
