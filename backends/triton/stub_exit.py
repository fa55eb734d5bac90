"""A model whose engine stopped for good (its thread died, a tensor-parallel rank died)
can serve nothing more: its stub exits, so ``tandem serve`` sees a dead model, reports
the server not ready and reloads it. A stub left running would answer every request
with an error while Triton reports it ready."""
from __future__ import annotations

import os
import threading

import triton_python_backend_utils as pb_utils

ENGINE_DIED_EXIT = 70     # EX_SOFTWARE: the stub's exit status when its engine died
EXIT_GRACE_S = 0.5        # a moment for the final responses to leave through the stub's IPC


def exit_stub(model: str, exc: BaseException) -> None:
    """Log why and end this stub's process shortly (any thread)."""
    pb_utils.Logger.log_error(f"[{model}] the engine stopped; exiting the stub so the model is reloaded: {exc!r}")
    threading.Timer(EXIT_GRACE_S, os._exit, (ENGINE_DIED_EXIT,)).start()
