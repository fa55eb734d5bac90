"""Which LoRA adapter a request runs under: its ``lora_name`` or ``lora_task_id`` looked up
in the server's adapter registry (:mod:`.lora_registry`), as the engine takes it. Every
miss is the request's own error (INVALID_ARG), named before anything is reserved."""
from __future__ import annotations

from .generate_request import GenerateRequest, RequestError
from .lora_registry import AdapterEntry, AdapterRegistry


def adapter_entry(parsed: GenerateRequest, registry: AdapterRegistry | None) -> AdapterEntry | None:
    """The request's adapter in ``registry``, or None for the base model (torch-free:
    kv_transfer checks it too, before it reserves pages)."""
    if parsed.lora_name is None and parsed.lora_task_id is None:
        return None
    field = "lora_name" if parsed.lora_name is not None else "lora_task_id"
    asked = parsed.lora_name if parsed.lora_name is not None else parsed.lora_task_id
    if registry is None:
        raise RequestError(field, f"got {asked!r}, but this server serves no LoRA adapters (start it with "
                                  "--max-loras N and --lora-modules name=DIR,...)")
    entry = registry.get(parsed.lora_name) if parsed.lora_name is not None else registry.by_id(parsed.lora_task_id)
    if entry is None and parsed.lora_weights is not None:
        entry = _register_trtllm(parsed, registry)
    if entry is None:
        loaded = ", ".join(f"{e.name} (id {e.id})" for e in registry.entries()) or "none"
        raise RequestError(field, f"no LoRA adapter {asked!r} is loaded; loaded: {loaded}")
    return entry


def _register_trtllm(parsed: GenerateRequest, registry: AdapterRegistry) -> AdapterEntry:
    """A TensorRT-LLM client's adapter, sent with its first request: written once as a
    PEFT adapter under its task id (the first process to see it writes it; another that
    raced it reads the entry back)."""
    from .trtllm_lora import AdapterTensorsError, peft_tensors, write_peft_adapter
    task = parsed.lora_task_id
    try:
        rank, tensors = peft_tensors(parsed.lora_weights, parsed.lora_config, registry.model_config,
                                     registry.max_rank)
    except AdapterTensorsError as e:
        raise RequestError(e.field, e.why) from None
    path = write_peft_adapter(registry.root / "trtllm" / f"task-{task}", rank, tensors)
    try:
        return registry.add(f"task-{task}", str(path), adapter_id=task)
    except ValueError:
        entry = registry.by_id(task)
        if entry is None:
            raise
        return entry


def resolve_adapter(parsed: GenerateRequest, registry: AdapterRegistry | None):
    """The request's ``LoRARequest`` for the engine, or None for the base model."""
    entry = adapter_entry(parsed, registry)
    if entry is None:
        return None
    from tandem.backends.lora.request import LoRARequest
    return LoRARequest(entry.name, entry.id, entry.path)
