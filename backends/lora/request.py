"""A request's adapter: what the interfaces pass to the engine (torch-free)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class LoRARequest:
    """A request's adapter (vLLM's ``LoRARequest``): ``name`` identifies it (and keys its
    prefix-cache pages), ``id`` is a positive integer the caller numbers it by, ``path``
    the PEFT adapter directory.

    >>> LoRARequest("sql", 1, "adapters/sql").name
    'sql'
    """
    name: str
    id: int
    path: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"lora name {self.name!r}; allowed: a non-empty string")
        if not isinstance(self.id, int) or isinstance(self.id, bool) or self.id < 1:
            raise ValueError(f"lora {self.name!r}: id {self.id!r}; allowed: an integer >= 1")
