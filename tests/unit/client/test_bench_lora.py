"""``tandem bench lora``'s pure parts: each phase's models, the mix/base ratio per repeat
and its median, the running streams' worst gap across an adapter load, the goals."""
import pytest

from tandem.client.bench import lora
from tandem.client.bench.lora_workload import (adapter_names, counters, grown, mix_over_base, model_cycle,
                                               phase_models, phase_order, ratios, stall, worst_gap)


def test_the_mix_cycles_every_adapter_then_the_base():
    models = phase_models("mix", adapter_names(4), "tandem", 12)
    assert models[:5] == ["a0", "a1", "a2", "a3", "tandem"]
    assert models[5:10] == models[:5] and models[10:] == ["a0", "a1"]
    # at any concurrency every adapter and the base share the batch
    assert set(models[:5]) == {"a0", "a1", "a2", "a3", "tandem"}


def test_the_base_phase_names_the_base_only():
    assert phase_models("base", adapter_names(4), "tandem_colocated", 3) == ["tandem_colocated"] * 3
    with pytest.raises(ValueError, match="allowed: base, mix"):
        phase_models("other", ["a0"], "tandem", 1)


@pytest.mark.parametrize("n", [0, 1, 7])
def test_model_cycle_length(n):
    assert len(model_cycle(["a0"], "tandem", n)) == n


def test_phases_alternate_their_order_between_repeats():
    assert phase_order(0) == ["base", "mix"] and phase_order(1) == ["mix", "base"] and phase_order(2) == phase_order(0)


def test_mix_over_base_is_taken_per_repeat_then_its_median():
    runs = {"base": [{"output_tok_s": 100.0}, {"output_tok_s": 50.0}, {"output_tok_s": 80.0}],
            "mix": [{"output_tok_s": 70.0}, {"output_tok_s": 45.0}, {"output_tok_s": 64.0}]}
    r = mix_over_base(runs)
    assert r["runs"] == [0.7, 0.9, 0.8]
    assert (r["median"], r["min"], r["max"]) == (0.8, 0.7, 0.9)


def test_a_failed_repeat_has_no_ratio_and_does_not_count():
    r = ratios([{"output_tok_s": 60.0}, {"output_tok_s": None}], [{"output_tok_s": 100.0}, {"output_tok_s": 90.0}],
               "output_tok_s")
    assert r["runs"] == [0.6, None] and r["median"] == 0.6


def test_worst_gap_counts_gaps_that_overlap_the_window():
    streams = [[0.0, 0.1, 0.2, 0.5, 0.6], [0.05, 0.15, 0.25]]
    assert worst_gap(streams, 0.3, 0.35) == pytest.approx(0.3)     # 0.2 -> 0.5 spans it
    assert worst_gap(streams, 0.0, 0.12) == pytest.approx(0.1)
    assert worst_gap(streams, 1.0, 2.0) is None


def test_stall_in_steps_against_the_window_before():
    # steps of 10 ms, then a 40 ms gap across the load at 0.105..0.125
    stream = [i * 0.01 for i in range(11)] + [0.14, 0.15, 0.16]
    s = stall([stream, [0.0, 0.01, 0.02]], t_load=0.105, t_done=0.125)
    assert s["median_itl_ms"] == pytest.approx(10.0)
    assert s["worst_gap_ms"] == pytest.approx(40.0) and s["worst_gap_steps"] == pytest.approx(4.0)
    assert s["control_worst_gap_steps"] == pytest.approx(1.0) and s["extra_steps"] == pytest.approx(3.0)


def test_engine_counters_grow_per_model():
    text = ('tandem_lora_loads_total{model="decode",version="1"} 5\n'
            'tandem_lora_loads_total{model="prefill",version="1"} 1\n'
            'tandem_lora_evictions_total{model="decode",version="1"} 9\n')
    after = counters(text.replace("} 5", "} 6"), "tandem_lora_loads_total")
    assert grown(counters(text, "tandem_lora_loads_total"), after) == {"decode": 1}


def _report(tandem_mix, vllm_mix, trials, vllm_runs=True):
    def phase(values):
        return [{"output_tok_s": v, "errors": 0, "requests": 8} for v in values]
    return {"runs": {"tandem": {"base": phase([100.0] * 3), "mix": phase(tandem_mix)},
                     "vllm": {"base": phase([120.0] * 3), "mix": phase(vllm_mix)}},
            "servers": ["tandem", "vllm"], "failed_to_start": {}, "warm_up_errors": {"tandem": [], "vllm": []},
            "versions": {"vllm": "0.32.0"}, "vllm_lora_runs": vllm_runs, "load_trials": {"tandem": trials}}


def test_goals_met_and_missed():
    trials = [{"failed": 0, "load_status": 200, "added_steps": 0.5}, {"failed": 0, "load_status": 200,
                                                                      "added_steps": -2.0}]
    g = lora.goals(_report([85.0, 82.0, 90.0], [80.0, 90.0, 70.0], trials))
    assert g["Tandem mix / base output tok/s"]["met"] is True
    assert g["Tandem mix / vLLM-CPU mix output tok/s"]["ratio"]["runs"] == [1.062, 0.911, 1.286]
    assert g["run-time load: failed requests"]["met"] is True
    stall_goal = "run-time load: streams' worst gap, new adapter − adapter in a slot, in median steps"
    assert g[stall_goal]["met"] is True
    bad = [{"failed": 1, "load_status": 200, "added_steps": 1.5}]
    g = lora.goals(_report([70.0, 75.0, 90.0], [80.0] * 3, bad, vllm_runs=False))
    assert g["Tandem mix / base output tok/s"]["met"] is False
    assert "Tandem mix / vLLM-CPU mix output tok/s" not in g       # no comparison where vLLM's LoRA did not run
    assert g["run-time load: failed requests"]["met"] is False
    assert g[stall_goal]["met"] is False


def test_vllm_status_says_what_it_said_when_lora_fails():
    r = _report([1.0] * 3, [1.0] * 3, [])
    assert lora.vllm_lora_status(r)[0] is True
    r["failed_to_start"] = {"vllm": "ValueError: LoRA is not supported on CPU"}
    ok, line = lora.vllm_lora_status(r)
    assert not ok and line.startswith("vLLM-CPU: LoRA does not run on CPU") and "not supported on CPU" in line
    r = _report([1.0] * 3, [1.0] * 3, [])
    for x in r["runs"]["vllm"]["mix"]:
        x.update(errors=8, first_error="HTTP 400: punica failed")
    ok, line = lora.vllm_lora_status(r)
    assert not ok and "punica failed" in line


def test_a_load_is_judged_against_the_same_requests_to_an_adapter_in_a_slot():
    load = {"worst_gap_ms": 260.0, "median_itl_ms": 100.0}
    assert lora.added_steps(load, {"worst_gap_ms": 200.0}) == 0.6
    assert lora.added_steps(load, {"worst_gap_ms": None}) is None
