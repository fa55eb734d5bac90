"""Fault injection for tests and benchmarks: off unless configured, and then only a
few attribute checks per transfer (none per operation).

One string configures it, from the ``TANDEM_FAULTS`` environment variable or the
``faults`` model parameter (``tandem serve`` passes either)::

    TANDEM_FAULTS="transfer_fail=0.05@mid_layers,prefill_delay_ms=200,drop_sender=0.01,seed=7"

- ``transfer_fail=P[@POINT]`` — the receiver (kv_transfer) fails a fraction ``P`` of
  its reservations at ``POINT``: ``before_first_layer`` (when the sender opens the
  transfer, before any KV lands), ``mid_layers`` (once half the operations completed;
  the default) or ``at_counter`` (when the last operation completes, instead of READY).
  The decoder then ends the request with "a fault was injected (TANDEM_FAULTS)".
- ``prefill_delay_ms=MS[@P]`` — the prefill service holds a fraction ``P`` (default
  all) of its jobs ``MS`` milliseconds before it starts them.
- ``drop_sender=P`` — the sender abandons a fraction ``P`` of its transfers half-way,
  silently, as a killed prefill would: the receiver times the reservation out.
- ``seed=N`` — seeds the random choices (reproducible runs).

>>> f = Faults.parse("transfer_fail=0.5@at_counter,prefill_delay_ms=200,seed=3")
>>> f.transfer_fail, f.transfer_fail_at, f.prefill_delay_ms, f.prefill_delay_p
(0.5, 'at_counter', 200, 1.0)
>>> Faults.parse("") is None
True
>>> Faults.parse("transfer_fail=2")
Traceback (most recent call last):
...
ValueError: TANDEM_FAULTS: transfer_fail=2: the fraction must be in 0..1
"""
from __future__ import annotations

import os
import random
import threading
from dataclasses import dataclass, field

ENV = "TANDEM_FAULTS"
POINTS = ("before_first_layer", "mid_layers", "at_counter")


@dataclass(frozen=True, slots=True)
class Faults:
    transfer_fail: float = 0.0
    transfer_fail_at: str = "mid_layers"
    prefill_delay_ms: int = 0
    prefill_delay_p: float = 1.0
    drop_sender: float = 0.0
    seed: int | None = None
    _rng: random.Random = field(default=None, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_rng", random.Random(self.seed))

    @classmethod
    def parse(cls, text: str | None) -> "Faults | None":
        """The faults ``text`` names; None when it names none."""
        values: dict = {}
        for item in (x.strip() for x in (text or "").split(",")):
            if not item:
                continue
            name, sep, raw = item.partition("=")
            value, _, qualifier = raw.partition("@")
            try:
                if not sep or not value:
                    raise ValueError("expected name=value")
                if name == "transfer_fail":
                    values["transfer_fail"] = _fraction(value)
                    if qualifier:
                        if qualifier not in POINTS:
                            raise ValueError(f"the point must be one of {', '.join(POINTS)}")
                        values["transfer_fail_at"] = qualifier
                elif name == "prefill_delay_ms":
                    values["prefill_delay_ms"] = int(value)
                    if values["prefill_delay_ms"] < 0:
                        raise ValueError("the delay must be >= 0")
                    if qualifier:
                        values["prefill_delay_p"] = _fraction(qualifier)
                elif name == "drop_sender":
                    values["drop_sender"] = _fraction(value)
                elif name == "seed":
                    values["seed"] = int(value)
                else:
                    raise ValueError("unknown fault; allowed: transfer_fail, prefill_delay_ms, "
                                     "drop_sender, seed")
            except ValueError as e:
                raise ValueError(f"{ENV}: {item}: {e}") from None
        return cls(**values) if values else None

    @classmethod
    def configured(cls, text: str | None = None) -> "Faults | None":
        """``text`` (a model parameter) if given, else the environment's ``TANDEM_FAULTS``."""
        return cls.parse(text if text else os.environ.get(ENV, ""))

    def _chance(self, p: float) -> bool:
        if p <= 0.0:
            return False
        with self._lock:
            return self._rng.random() < p

    def transfer_fail_op(self, num_ops: int) -> int | None:
        """For a new reservation of ``num_ops`` operations: the completed-operation count
        at which to fail it (0: when the sender opens it), or None to let it be."""
        if not self._chance(self.transfer_fail):
            return None
        return {"before_first_layer": 0, "mid_layers": max(1, num_ops // 2),
                "at_counter": num_ops}[self.transfer_fail_at]

    def prefill_delay_s(self) -> float:
        """How long to hold a new prefill job."""
        if self.prefill_delay_ms and self._chance(self.prefill_delay_p):
            return self.prefill_delay_ms / 1000.0
        return 0.0

    def drop_after(self, num_ops: int) -> int | None:
        """For a new transfer of ``num_ops`` operations from this sender: after how many
        sends it silently stops, or None."""
        return max(1, num_ops // 2) if self._chance(self.drop_sender) else None


def _fraction(text: str) -> float:
    p = float(text)
    if not 0.0 <= p <= 1.0:
        raise ValueError("the fraction must be in 0..1")
    return p
