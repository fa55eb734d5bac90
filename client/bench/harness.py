"""What the benchmarks share besides their reports (``report``), their options' types
(``args``), their repeats' statistics (``repeats``), their percentile (``stats``) and
their request client (``request_client``): a timer, the run's temp dir, the one way
they start a server, and the model and prompts the serving benchmarks send.

>>> timed(lambda: sum(range(1000)), repeats=3) < 1.0
True
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def timed(fn, repeats: int = 1) -> float:
    """Seconds one call of ``fn`` takes: the best of ``repeats`` calls."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@contextmanager
def work_dir(prefix: str, keep: bool = False) -> Iterator[Path]:
    """A fresh temp dir for a run's servers, logs and tools' files, removed however the
    run ends — an error or Ctrl-C too — unless ``keep``. Stop the servers inside the
    ``with`` (an ExitStack there), so that none still writes into the dir it removes.

    >>> with work_dir("tandem-doc-") as work:
    ...     _ = (work / "server.log").write_text("x")
    >>> work.exists()
    False
    """
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        crashed = crash_logs(path)
        if keep or crashed:
            why = f" (a process crashed: {', '.join(str(p.relative_to(path)) for p in crashed)})" if crashed else ""
            print(f"kept the run's files in {path}{why}", flush=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
            if path.exists():   # a process outside our servers still wrote there
                print(f"could not remove all of {path}", flush=True)


# what a crash leaves in a server's log: Python's fault handler (every Tandem process
# enables it), tritonserver's own crash handler, the supervisor's record of a signal
CRASH_SIGNS = ("Fatal Python error", "Signal (11) received", "Signal (6) received", "killed by SIGSEGV",
               "killed by SIGABRT", "killed by SIGBUS", "killed by SIGILL", "killed by SIGFPE")


def crash_logs(path: Path) -> list[Path]:
    """The ``*.log`` files under ``path`` that show a crash (:data:`CRASH_SIGNS`)."""
    found = []
    for log in sorted(path.rglob("*.log")):
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        if any(sign in text for sign in CRASH_SIGNS):
            found.append(log)
    return found


def start_server(stack, options, run_dir: Path, attempts: int = 1, **server_kwargs):
    """A started :class:`~tandem.client.serve.triton_server.TritonServer` for ``options``,
    its ``stop`` on ``stack`` before it starts: a start interrupted while the models load
    (Ctrl-C) still stops what it launched (``stop`` is safe on a server never started).
    A start that fails (tritonserver 2.51 now and then aborts while loading on a busy
    host) is tried again up to ``attempts`` times, each in its own ``run_dir/try<n>``.
    ``server_kwargs`` go to the server (``log_file``, ``cpus``, ...); it waits 600 s for
    readiness unless told otherwise."""
    from tandem.client.serve.options import ServerError
    from tandem.client.serve.triton_server import TritonServer

    server_kwargs.setdefault("ready_timeout_s", 600)
    for attempt in range(attempts):
        server = TritonServer(options, run_dir=run_dir / f"try{attempt}" if attempts > 1 else run_dir,
                              **server_kwargs)
        stack.callback(server.stop)
        try:
            return server.start()
        except ServerError as e:
            if attempt == attempts - 1:
                raise
            print(f"  the server did not start ({str(e).splitlines()[0]}); again", flush=True)


def long_context_copy(src: Path, dst: Path, max_len: int) -> Path:
    """``src``'s weights and tokenizer with ``max_position_embeddings`` = ``max_len``."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json":
            target = dst / f.name
            if not target.exists():
                os.symlink(f.resolve(), target)
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_position_embeddings"] = max(max_len, cfg["max_position_embeddings"])
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def prompt_texts(model_dir: Path, lengths: list[int]) -> list[str]:
    """Texts of about ``lengths`` tokens each, cut from the standard library's source."""
    import sysconfig

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for f in sorted(stdlib.glob("*.py")):
        ids += tok.encode(f.read_text(errors="replace")).ids
        if len(ids) > 3 * max(lengths) + sum(lengths):
            break
    out, pos = [], 0
    for n in lengths:
        out.append(tok.decode(ids[pos:pos + n]))
        pos = (pos + n) % max(1, len(ids) - max(lengths))
    return out
