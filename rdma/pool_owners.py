"""The processes attached to a shared pool, and whether they still live.

Each attached process registers as an owner: its pid plus the process's start time,
so a reused pid is not mistaken for the dead process. Owner ids are 1-based: 0 means
"no owner" in the page and slot arrays. What a dead owner held is returned by the
pool (:meth:`~.shared_pool.SharedKVPool.reclaim_dead`); this module only tells who.
"""
from __future__ import annotations

import os

import numpy as np

from .errors import PoolError
from .pool_layout import ControlBlock, proc_start


class Owners:
    """The owner arrays of a :class:`~.pool_layout.ControlBlock`; every method expects
    the pool's lock to be held."""

    def __init__(self, ctl: ControlBlock, max_owners: int, pool_name: str):
        self._ctl, self.max_owners, self._pool_name = ctl, max_owners, pool_name

    def register(self) -> int:
        """Register this process; returns its owner id."""
        c = self._ctl
        empty = np.flatnonzero(c.owner_pid == 0)
        if not len(empty):
            raise PoolError(f"more than {self.max_owners} processes attached to "
                            f"pool {self._pool_name!r}")
        i = int(empty[0])
        pid = os.getpid()
        c.owner_start[i] = proc_start(pid) or 0
        c.owner_pid[i] = pid
        return i + 1

    def remove(self, owner: int) -> None:
        self._ctl.owner_pid[owner - 1] = 0

    def dead(self) -> list[int]:
        """Registered owners whose process is gone."""
        c = self._ctl
        return [int(i) + 1 for i in np.flatnonzero(c.owner_pid)
                if proc_start(int(c.owner_pid[i])) != int(c.owner_start[i])]

    def num_attached(self) -> int:
        return int(np.count_nonzero(self._ctl.owner_pid))
