"""The LoRA adapters a server serves, by name, shared by its processes.

A directory holds one small JSON file per adapter (``{"name", "id", "path"}``): ``tandem
serve`` writes the ``--lora-modules`` ones at start, the OpenAI API's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` add and remove adapters at run
time, and the engine models read an adapter's entry when a request names it (the engine
loads its files into a slot once, backends/lora). A file is written whole (a temporary
file, then a rename), so a reader never sees half of one.

An adapter's ``id`` is vLLM's ``lora_int_id`` and TensorRT-LLM's ``lora_task_id``: unique
and never given again while the directory lives, so a request that names an id never
reaches another adapter that happens to take an unloaded one's place.

>>> import tempfile
>>> reg = AdapterRegistry(tempfile.mkdtemp())
>>> reg.add("sql", "/adapters/sql"), reg.add("chat", "/adapters/chat").id
(AdapterEntry(name='sql', id=1, path='/adapters/sql'), 2)
>>> _ = reg.remove("sql"); reg.add("sql", "/adapters/sql-v2").id, reg.by_id(1)
(3, None)
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_HIGH_WATER = ".last_id"


@dataclass(frozen=True, slots=True)
class AdapterEntry:
    name: str
    id: int
    path: str


class AdapterRegistry:
    def __init__(self, root: str | Path, model_config: dict | None = None, max_rank: int = 16):
        """``model_config`` (the base checkpoint's config.json) and ``max_rank`` check the
        adapters TensorRT-LLM clients send in requests (:mod:`.trtllm_lora`)."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.model_config, self.max_rank = model_config, max_rank

    def add(self, name: str, path: str, adapter_id: int | None = None) -> AdapterEntry:
        """Register adapter ``name`` at ``path`` (under ``adapter_id``: a TensorRT-LLM task
        id; default: the next id); a ValueError names what is wrong (a bad name, a name or
        id already served)."""
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"LoRA adapter name {name!r}; allowed: 1-64 letters, digits, '.', '_' or '-', "
                             "starting with a letter or digit")
        if self.get(name) is not None:
            raise ValueError(f"LoRA adapter {name!r} is already loaded; unload it first")
        if adapter_id is not None and self.by_id(adapter_id) is not None:
            raise ValueError(f"LoRA adapter id {adapter_id} is taken by {self.by_id(adapter_id).name!r}")
        entry = AdapterEntry(name, self._next_id(adapter_id), str(path))
        self._write(self._file(name), json.dumps(asdict(entry)))
        return entry

    def check(self, name: str, path: str) -> None:
        """The adapter at ``path`` fits the base model (``model_config``) within
        ``max_rank``: a ValueError names what does not (backends/lora/adapter.py)."""
        from tandem.backends.lora.adapter import load_adapter
        from tandem.backends.models.config import ModelConfig
        load_adapter(name, path, ModelConfig.from_dict(self.model_config), self.max_rank)

    def remove(self, name: str) -> AdapterEntry:
        entry = self.get(name)
        if entry is None:
            raise KeyError(f"LoRA adapter {name!r} is not loaded; loaded: {', '.join(self.names()) or 'none'}")
        self._file(name).unlink(missing_ok=True)
        return entry

    def get(self, name: str) -> AdapterEntry | None:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            return None
        try:
            return AdapterEntry(**json.loads(self._file(name).read_text()))
        except FileNotFoundError:
            return None

    def by_id(self, adapter_id: int) -> AdapterEntry | None:
        return next((e for e in self.entries() if e.id == adapter_id), None)

    def entries(self) -> list[AdapterEntry]:
        out = []
        for f in sorted(self.root.glob("*.json")):
            try:
                out.append(AdapterEntry(**json.loads(f.read_text())))
            except (FileNotFoundError, ValueError, TypeError):   # removed meanwhile, or not ours
                continue
        return out

    def names(self) -> list[str]:
        return [e.name for e in self.entries()]

    def _file(self, name: str) -> Path:
        return self.root / f"{name}.json"

    def _next_id(self, wanted: int | None = None) -> int:
        """One more than any id given so far (the high-water mark survives unloads), or
        ``wanted`` (a task id chosen by the client), which raises the mark."""
        mark = self.root / _HIGH_WATER
        last = max([int(mark.read_text() or 0) if mark.exists() else 0, *(e.id for e in self.entries())])
        given = last + 1 if wanted is None else wanted
        self._write(mark, str(max(last, given)))
        return given

    @staticmethod
    def _write(path: Path, text: str) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
