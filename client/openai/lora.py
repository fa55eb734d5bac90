"""LoRA adapters on the OpenAI API, as vLLM serves them: a request's ``model`` names an
adapter (``/v1/models`` lists each with its base model as ``parent``), and
``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) and
``POST /v1/unload_lora_adapter`` (``{"lora_name"}``) add and remove adapters at run time.

The adapters live in the server's registry (backends/triton/lora_registry.py), which the
engine models read when a request names one (the ensemble's ``lora_name`` input). An
adapter is checked here before it is registered (its config, rank and every weight's
shape against the base model: backends/lora/adapter.py), so a bad one is a 400 at load
time and never reaches a running batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tandem.backends.triton.lora_registry import AdapterEntry, AdapterRegistry

from .protocol import OpenAIError, invalid


@dataclass
class LoRAServing:
    """The adapters of a server that serves them (``--max-loras`` >= 1): its registry,
    which knows the base model and the largest rank."""
    registry: AdapterRegistry

    def check(self, name: str, path: str) -> None:
        """The adapter at ``path`` fits the base model (a 400 naming what does not)."""
        if not Path(path).is_dir():
            raise invalid("lora_path", f"{path!r} is not a directory (a PEFT adapter: adapter_config.json and "
                                       "adapter_model.safetensors)")
        try:
            self.registry.check(name, path)
        except (ValueError, OSError) as exc:
            raise invalid("lora_path", str(exc)) from None

    def load(self, name: str, path: str) -> AdapterEntry:
        if self.registry.get(name) is not None:
            raise invalid("lora_name", f"LoRA adapter {name!r} is already loaded; unload it first")
        self.check(name, path)
        try:
            return self.registry.add(name, str(Path(path).resolve()))
        except ValueError as exc:
            raise invalid("lora_name", str(exc)) from None

    def unload(self, name: str) -> AdapterEntry:
        try:
            return self.registry.remove(name)
        except KeyError as exc:
            raise OpenAIError(404, exc.args[0], param="lora_name", code="lora_not_found") from None

    def adapter(self, model: str) -> AdapterEntry | None:
        return self.registry.get(model)
