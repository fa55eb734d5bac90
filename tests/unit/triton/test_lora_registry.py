"""The adapter registry the server's processes share (backends/triton/lora_registry.py)."""
from __future__ import annotations

import pytest

from tandem.backends.triton.lora_registry import AdapterRegistry


def test_entries_are_seen_by_another_reader_of_the_directory(tmp_path):
    writer, reader = AdapterRegistry(tmp_path), AdapterRegistry(tmp_path)
    a = writer.add("sql", "/a/sql")
    assert reader.get("sql") == a and reader.by_id(a.id) == a and reader.names() == ["sql"]
    writer.remove("sql")
    assert reader.get("sql") is None and reader.entries() == []


def test_ids_are_never_given_twice(tmp_path):
    reg = AdapterRegistry(tmp_path)
    ids = [reg.add(n, f"/a/{n}").id for n in ("a", "b", "c")]
    reg.remove("c")
    reg.remove("b")
    assert AdapterRegistry(tmp_path).add("d", "/a/d").id == max(ids) + 1


@pytest.mark.parametrize("name", ["", "../x", "a/b", "-x", "x" * 65, "a b"])
def test_bad_names_are_refused(tmp_path, name):
    with pytest.raises(ValueError, match="LoRA adapter name"):
        AdapterRegistry(tmp_path).add(name, "/a")
    assert AdapterRegistry(tmp_path).get(name) is None


def test_a_name_twice_and_an_unknown_removal_say_why(tmp_path):
    reg = AdapterRegistry(tmp_path)
    reg.add("sql", "/a")
    with pytest.raises(ValueError, match="already loaded"):
        reg.add("sql", "/b")
    with pytest.raises(KeyError, match="'chat' is not loaded; loaded: sql"):
        reg.remove("chat")


def test_stray_files_are_skipped(tmp_path):
    reg = AdapterRegistry(tmp_path)
    (tmp_path / "junk.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"x": 1}')
    reg.add("ok", "/a")
    assert reg.names() == ["ok"]


def _parse(**inputs):
    import numpy as np

    from tandem.backends.triton.generate_request import parse_token_request
    arrays = {"input_ids": np.array([[5, 6]], dtype=np.int32)}
    for k, v in inputs.items():
        arrays[k] = np.array([[v.encode() if isinstance(v, str) else v]],
                             dtype=np.object_ if isinstance(v, str) else np.uint64)
    return parse_token_request(arrays.get, vocab_size=100, max_model_len=64)


def test_a_request_names_its_adapter_by_name_or_by_id(tmp_path):
    from tandem.backends.triton.lora_requests import adapter_entry
    reg = AdapterRegistry(tmp_path)
    sql = reg.add("sql", "/a/sql")
    assert adapter_entry(_parse(lora_name="sql"), reg) == sql
    assert adapter_entry(_parse(lora_task_id=sql.id), reg) == sql
    assert adapter_entry(_parse(), reg) is None and adapter_entry(_parse(), None) is None


@pytest.mark.parametrize("inputs,field,why", [
    (dict(lora_name="chat"), "lora_name", "no LoRA adapter 'chat' is loaded; loaded: sql (id 1)"),
    (dict(lora_task_id=7), "lora_task_id", "no LoRA adapter 7 is loaded"),
])
def test_an_adapter_the_server_does_not_serve_is_the_requests_error(tmp_path, inputs, field, why):
    from tandem.backends.triton.generate_request import RequestError
    from tandem.backends.triton.lora_requests import adapter_entry
    reg = AdapterRegistry(tmp_path)
    reg.add("sql", "/a/sql")
    with pytest.raises(RequestError, match=field) as e:
        adapter_entry(_parse(**inputs), reg)
    assert why in str(e.value)
    with pytest.raises(RequestError, match="serves no LoRA adapters"):
        adapter_entry(_parse(**inputs), None)


def test_tensorrt_llms_tensors_need_each_other_and_a_task_id_and_both_names_are_refused():
    import numpy as np

    from tandem.backends.triton.generate_request import RequestError, parse_token_request
    base = {"input_ids": np.array([[5, 6]], dtype=np.int32)}
    weights = {**base, "lora_weights": np.zeros((1, 2, 8), np.float16)}
    with pytest.raises(RequestError, match="lora_config: lora_weights and lora_config come together"):
        parse_token_request(weights.get, vocab_size=100, max_model_len=64)
    both = {**weights, "lora_config": np.zeros((1, 2, 3), np.int32)}
    with pytest.raises(RequestError, match="lora_task_id: is required with lora_weights"):
        parse_token_request(both.get, vocab_size=100, max_model_len=64)
    with pytest.raises(RequestError, match="lora_task_id: send lora_name or lora_task_id, not both"):
        _parse(lora_name="sql", lora_task_id=1)


def test_ids_a_client_chose_are_kept_and_never_given_twice(tmp_path):
    reg = AdapterRegistry(tmp_path)
    assert reg.add("task-7", "/a", adapter_id=7).id == 7
    assert reg.add("next", "/b").id == 8                  # above the client's id
    with pytest.raises(ValueError, match="id 7 is taken by 'task-7'"):
        reg.add("other", "/c", adapter_id=7)
