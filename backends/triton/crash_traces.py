"""Python stacks in the server's log when a model process crashes.

Every Triton stub calls :func:`enable` when its model module loads: a fatal signal
(SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) then writes every thread's Python stack to
the stub's stderr, which tritonserver passes to its log (``--log-file`` or the terminal),
before the process dies; ``kill -USR1 <stub pid>`` dumps the stacks of a live stub that
seems stuck, without stopping it.
"""
from __future__ import annotations

import faulthandler
import signal
import sys


def enable() -> None:
    """Idempotent: a second call re-registers the same handlers."""
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
