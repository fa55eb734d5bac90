"""Supervision of a running tritonserver: a dead stub's model is reloaded, a dead
server restarted, and readiness stays truthful meanwhile.

Triton 2.51 never restarts a Python-backend stub by itself. After a stub dies, the
requests it was executing fail with ``Stub process '<instance>' is not healthy.``, so
does every later one, and the server keeps answering ready. :class:`Supervisor` (a
thread beside the server, started by :class:`~tandem.client.serve.triton_server.TritonServer`)
closes that gap:

- **Detection.** Every ``poll_s`` it looks at the stubs it knows (children of
  tritonserver, :mod:`.stubs`) and at tritonserver itself. Triton reaps a stub only
  when it unloads the instance, so a stub that became a zombie died on its own
  (SIGKILL, a crash, or the model's own exit when its engine died); one that vanished
  was unloaded in order (a version roll) and is left alone.
- **Reload** (the repository API: unload, then load, then wait until the server is
  ready). Unloading first is what makes readiness truthful: with
  ``--strict-readiness`` (Triton's default) the server is ready only while every
  model is READY or deliberately unloaded, and a model stays UNLOADING until the
  load replaces it, then LOADING until it is back. A reload in place (load alone)
  would keep the dead instance READY in the meantime. The ensembles built on the
  model go with it and come back with it. The dead stub's shared-memory region goes
  once the model is back. A model that is no step of a served ensemble (``prefill``:
  kv_transfer hands it jobs, and prefills in decode while it cannot take them) is
  reloaded in place (load alone): every ensemble still runs requests meanwhile, so the
  server stays ready. A reload runs in a thread of its own: under load the unload
  waits for the old instance's in-flight requests (measured: 70–100 s for
  ``postprocess`` at concurrency 8), and a death that needs a restart meanwhile is
  handled at once (the restart happens on the supervisor's thread; a reload it
  overtook counts as done).
- **Restart** of tritonserver on the same ports, when a reload cannot help:
  tritonserver itself died (it can: a stub killed while it holds a shared IPC mutex
  makes the server's monitor thread abort on ``boost::interprocess::lock_exception``)
  or its log file shows it crashing (``Signal (6) received``: its crash handler can
  hang instead of exiting), a reload failed ``reload_attempts`` times, the repository API is closed
  (``--model-control-mode none``), or the stub of a **decoupled** model (``decode``,
  ``llm``) was killed by a signal. The streams such a stub had open belong to response
  factories that died with it: Triton 2.51 never ends them, not even after a reload,
  so only closing their connections does (clients see UNAVAILABLE). A decoupled model
  that *exits* by itself (the engine's own exit, status 70) has ended its streams
  first, and is reloaded.

>>> choose_action(decoupled=False, exit_status=9, can_reload=True)     # prefill, SIGKILL
'reload'
>>> choose_action(decoupled=True, exit_status=9, can_reload=True)      # decode, SIGKILL
'restart'
>>> choose_action(decoupled=True, exit_status=70 << 8, can_reload=True)  # its engine died
'reload'
"""
from __future__ import annotations

import logging
import re
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.client.serve.options import ServerError
from tandem.client.serve.stubs import Stub, describe_exit, died_of_signal, find_stubs, proc_state

log = logging.getLogger("tandem.serve")

RELOAD, RESTART = "reload", "restart"
# tritonserver's crash handler prints this; SIGINT/SIGTERM are a shutdown, not a crash
_SIGNAL_LINE = re.compile(rb"Signal \((\d+)\) received")
_SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def unavailable(states: dict[str, set[str]], served) -> list[str]:
    """The served models with no version READY or LOADING (unloaded, unloading for good,
    or failed); a model the index does not list is not counted.

    >>> unavailable({"decode": {"UNAVAILABLE"}, "llm": {"READY", "UNLOADING"}, "x": {"LOADING"}},
    ...             ["decode", "llm", "x", "other"])
    ['decode']
    """
    return [m for m in served if m in states and not states[m] & {"READY", "LOADING"}]


def choose_action(decoupled: bool, exit_status: int | None, can_reload: bool) -> str:
    """What brings a dead stub's model back: ``"reload"`` it, or ``"restart"`` the server."""
    if not can_reload or (decoupled and died_of_signal(exit_status)):
        return RESTART
    return RELOAD


@dataclass(slots=True)
class Recovery:
    """One death and what was done about it."""

    model: str                   # the dead stub's model; "" when tritonserver itself died
    pid: int                     # the process that died
    cause: str                   # e.g. "killed by SIGKILL", "exited with status 70"
    action: str                  # "reload" | "restart"
    noticed_at: float            # time.time() when the supervisor saw the death
    seconds: float | None = None  # from then until the server answered ready again
    ok: bool | None = None       # None while in progress
    error: str = ""


@dataclass(frozen=True, slots=True)
class SupervisorStatus:
    recoveries: tuple[Recovery, ...]
    recovering: bool             # a reload or restart is under way: not ready
    failed: str                  # why it gave up ("" while it supervises)

    @property
    def reloads(self) -> int:
        return sum(1 for r in self.recoveries if r.action == RELOAD and r.ok)

    @property
    def restarts(self) -> int:
        return sum(1 for r in self.recoveries if r.action == RESTART and r.ok)

    @property
    def reload_seconds(self) -> list[float]:
        return [r.seconds for r in self.recoveries if r.action == RELOAD and r.ok]

    def as_dict(self) -> dict:
        return {"reloads": self.reloads, "restarts": self.restarts, "recovering": self.recovering,
                "failed": self.failed, "recoveries": [asdict(r) for r in self.recoveries]}


@dataclass(eq=False)
class Supervisor:
    """Watches ``server`` (a started TritonServer) from a thread; see the module doc."""

    server: object
    poll_s: float = 0.2
    rescan_s: float = 1.0            # how often new stubs (after a load) are looked for
    reload_attempts: int = 3
    max_recoveries: int = 5          # one model dying more often within window_s: a crash loop,
    window_s: float = 60.0           # give up (tandem serve exits 1: let the orchestrator decide)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _watched: dict = field(default_factory=dict, init=False)      # pid -> Stub
    _noticed: set = field(default_factory=set, init=False)        # pids seen dead
    _decoupled: dict = field(default_factory=dict, init=False)    # model -> bool
    _steps: set = field(default_factory=set, init=False)          # the served ensembles' steps
    _recoveries: list = field(default_factory=list, init=False)
    _recovering: bool = field(default=False, init=False)
    # reloads run in threads of their own (a reload waits for the old instance to drain,
    # a minute and more under load) so that a death needing a restart is handled at once;
    # a restart happens on this object's own thread only (see _run)
    _reloading: dict = field(default_factory=dict, init=False)    # model -> its reload thread
    _generation: int = field(default=0, init=False)               # restarts so far
    _restart_wanted: tuple | None = field(default=None, init=False)   # (rec, error, covered) of a failed reload
    _again: dict = field(default_factory=dict, init=False)        # model -> deaths during its reload
    _failed: str = field(default="", init=False)
    _paused: bool = field(default=False, init=False)   # draining: models go on purpose
    _holding: bool = field(default=False, init=False)  # not ready: an operator unloaded a model
    _last_scan: float = field(default=0.0, init=False)
    _log_offset: int = field(default=0, init=False)

    # ---- control -------------------------------------------------------------
    def start(self) -> "Supervisor":
        log_file = getattr(self.server, "log_file", None)
        self._log_offset = Path(log_file).stat().st_size if log_file and Path(log_file).exists() else 0
        self._decoupled, self._steps = self._read_configs()
        self._rescan()
        self._thread = threading.Thread(target=self._run, name="tandem-supervisor", daemon=True)
        self._thread.start()
        return self

    def request_stop(self) -> None:
        self._stop.set()

    def pause(self) -> None:
        """Watch no more, but keep the thread (a server it relaunched dies with it)."""
        self._paused = True

    def join(self, timeout_s: float | None = None) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def status(self) -> SupervisorStatus:
        with self._lock:
            return SupervisorStatus(tuple(Recovery(**asdict(r)) for r in self._recoveries),
                                    self._recovering or bool(self._reloading), self._failed)

    def watch(self, stub: Stub) -> None:
        """Watch ``stub`` now (before the next rescan would find it)."""
        with self._lock:
            self._watched[stub.pid] = stub

    def wait_noticed(self, pid: int, timeout_s: float = 10.0) -> bool:
        """Block until the death of ``pid`` was noticed (the recovery has begun)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if pid in self._noticed:
                    return True
            time.sleep(0.02)
        return False

    # ---- the loop --------------------------------------------------------------
    def _run(self) -> None:
        # This thread must outlive any tritonserver it relaunched: the server's parent-death
        # signal (PR_SET_PDEATHSIG, process_group.die_with_parent) fires when the thread
        # that started it exits. So it idles after giving up, until stop().
        while not self._stop.wait(self.poll_s):
            if self._failed or self._paused:
                continue
            try:
                self._tick()
            except Exception as exc:  # the watcher must never die silently
                log.exception("supervisor: %s", exc)

    def _tick(self) -> None:
        proc = self.server.process
        if proc is None:
            return
        with self._lock:
            wanted, self._restart_wanted = self._restart_wanted, None
        if wanted is not None:   # a reload failed: a restart brings the model back
            rec, error, covered = wanted
            log.error("reloading %r failed (%s); restarting tritonserver", rec.model, error)
            with self._lock:
                rec.action = RESTART
            self._restart_for(rec, [], covered, f"model {rec.model!r} (stub pid {rec.pid})", time.monotonic())
            return
        if proc.poll() is not None:
            self._recover(Recovery("", proc.pid, f"tritonserver exited with code {proc.returncode}",
                                   RESTART, time.time()), [])
            return
        crash = self._crash_in_log()
        if crash:   # its crash handler may hang instead of exiting (a corrupted heap)
            self._recover(Recovery("", proc.pid, f"tritonserver crashed ({crash!r} in its log)",
                                   RESTART, time.time()), [])
            return
        dead: list[tuple[Stub, int]] = []
        with self._lock:
            for pid, stub in list(self._watched.items()):
                state = proc_state(pid)
                if state is None or state.ppid != proc.pid:
                    del self._watched[pid]        # reaped by Triton: an orderly unload
                elif state.state == "Z":
                    del self._watched[pid]
                    if state.exit_status != 0:   # 0: an orderly unload, before Triton reaped it
                        dead.append((stub, state.exit_status))
        if dead:
            self._on_dead(dead)
        elif time.monotonic() - self._last_scan >= self.rescan_s:
            self._rescan()
            if not self._reloading:   # a model reloading is unloaded on purpose, for a moment
                self._check_unloaded()

    # ---- a model unloaded through the repository API ----------------------------------
    def _check_unloaded(self) -> None:
        """A served model that is UNAVAILABLE (unloaded through Triton's repository API, or
        failed to load) while no stub died: Triton would keep answering ready and fail
        every request. With the API open to anyone (no admin key) it is reloaded; with
        a key, only an operator could have unloaded it: the server answers not ready
        (a marker model that fails to load) until the model is loaded again."""
        from tandem.client.serve.triton_server import UNLOADED_MODEL
        states = self._states()
        if states is None:
            return
        served = self.server.options.models
        gone = unavailable(states, served)
        if not gone:
            if self._holding and all("READY" in states.get(m, {"READY"}) for m in served):
                log.warning("every served model is loaded again: ready")
                self.server.release_not_ready(UNLOADED_MODEL)
                self._holding = False
            return
        if self.server.http.admin_key:
            if not self._holding:
                log.warning("%s unloaded through the repository API (with the admin key): not ready until "
                            "loaded again", ", ".join(repr(m) for m in gone))
                self.server.hold_not_ready(UNLOADED_MODEL)
                self._holding = True
            return
        log.warning("%s unloaded through the repository API, which is open (no --admin-key): reloading",
                    ", ".join(repr(m) for m in gone))
        ensembles = set(self.server.options.ensembles)
        for model in sorted(gone, key=lambda m: m in ensembles):   # the steps before the ensembles
            if unavailable(self._states() or {}, [model]):
                try:
                    self.server.http.load(model, timeout_s=self.server.ready_timeout_s)
                except ServerError as exc:
                    log.warning("reloading %r: %s", model, exc)

    def _states(self) -> dict[str, set[str]] | None:
        """The repository's model states; None while the server does not answer."""
        try:
            return self.server.http.states()
        except ServerError:
            return None

    def _on_dead(self, dead: list[tuple[Stub, int]]) -> None:
        can_reload = self.server.model_control_mode == "explicit"
        actions = {stub.model: choose_action(self._decoupled.get(stub.model, True), status, can_reload)
                   for stub, status in dead}
        now = time.time()
        recoveries = [(Recovery(stub.model, stub.pid, describe_exit(status), actions[stub.model], now), stub)
                      for stub, status in dead]
        if RESTART in actions.values():
            # one restart brings every model back (and removes the old server's regions);
            # each death is recorded
            first = next(r for r, _ in recoveries if r.action == RESTART)
            self._recover(first, [], also=[r for r, _ in recoveries if r is not first])
            return
        for model in dict.fromkeys(stub.model for stub, _ in dead):   # one reload per model
            mine = [(r, s) for r, s in recoveries if s.model == model]
            self._recover(mine[0][0], [s for _, s in mine], also=[r for r, _ in mine[1:]])

    # ---- recovery --------------------------------------------------------------
    def _recover(self, rec: Recovery, stubs: list[Stub], also: list[Recovery] = ()) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            self._noticed.update([rec.pid, *(r.pid for r in also)])
            self._recoveries.extend([rec, *also])
            self._recovering = True
            recent = [r for r in self._recoveries
                      if r.model == rec.model and r.noticed_at > rec.noticed_at - self.window_s]
        what = f"model {rec.model!r} (stub pid {rec.pid})" if rec.model else f"tritonserver (pid {rec.pid})"
        log.warning("%s %s; %s", what, rec.cause,
                    "reloading the model" if rec.action == RELOAD else "restarting tritonserver")
        t0 = time.monotonic()
        if len(recent) > self.max_recoveries:
            self._give_up(rec, also, what, ServerError(f"{len(recent)} deaths within {self.window_s:.0f} s: "
                                                       "a crash loop"))
            self._rescan()
            with self._lock:
                self._recovering = False
        elif rec.action == RELOAD:
            try:
                self._start_reload(rec, stubs, also, what, t0)
            finally:
                self._rescan()
                with self._lock:
                    self._recovering = False
        else:
            self._restart_for(rec, stubs, also, what, t0)

    def _restart_for(self, rec: Recovery, stubs: list[Stub], also: list[Recovery], what: str, t0: float) -> None:
        """Restart tritonserver to recover from ``rec`` (and ``also``); on this object's
        own thread only (see _run)."""
        try:
            self._restart()
            self._recovered(rec, stubs, also, what, t0)
        except ServerError as exc:
            self._give_up(rec, also, what, exc)
        finally:
            self._rescan()
            with self._lock:
                self._recovering = False

    def _start_reload(self, rec: Recovery, stubs: list[Stub], also: list[Recovery], what: str, t0: float) -> None:
        """Reload ``rec.model`` in a thread of its own (one per model: a death while it
        reloads makes that thread reload once more before it ends)."""
        with self._lock:
            running = self._reloading.get(rec.model)
            if running is not None and running.is_alive():
                self._again.setdefault(rec.model, []).append((rec, stubs, also))
                return
            generation = self._generation

        def reload() -> None:
            try:
                self._reload(rec.model)
                while True:   # deaths while it reloaded: the instance it loaded may be the dead one
                    with self._lock:
                        more = self._again.pop(rec.model, [])
                        if not more:   # done: a later death starts a reload of its own
                            self._reloading.pop(rec.model, None)
                            break
                    self._reload(rec.model)
                    for r, s, a in more:
                        self._recovered(r, s, a, what, t0)
                self._recovered(rec, stubs, also, what, t0)
            except ServerError as exc:
                with self._lock:   # the deaths it had still to cover share its outcome
                    covered = [*also, *(r for r2, _, a in self._again.pop(rec.model, []) for r in (r2, *a))]
                if self._generation != generation:    # a restart meanwhile brought it back
                    self._recovered(rec, stubs, covered, what, t0)
                elif self._stop.is_set():
                    self._give_up(rec, covered, what, exc)
                else:
                    with self._lock:   # still recovering until the loop has restarted the server
                        rec.error, self._recovering = str(exc), True
                        self._restart_wanted = (rec, exc, covered)
            finally:
                with self._lock:
                    self._reloading.pop(rec.model, None)
                self._last_scan = 0.0   # look for its new stubs at the next tick

        thread = threading.Thread(target=reload, name=f"tandem-reload-{rec.model}", daemon=True)
        with self._lock:
            self._reloading[rec.model] = thread
        thread.start()

    def _recovered(self, rec: Recovery, stubs: list[Stub], also: list[Recovery], what: str, t0: float) -> None:
        for stub in stubs:
            self.server.remove_shm_region(stub.shm_region)
        seconds = time.monotonic() - t0
        with self._lock:
            for r in (rec, *also):
                r.seconds, r.ok = round(seconds, 3), True
        log.warning("%s: serving again after %.1f s (%s)", what, seconds, rec.action)

    def _give_up(self, rec: Recovery, also: list[Recovery], what: str, exc: Exception) -> None:
        with self._lock:
            for r in (rec, *also):
                r.ok, r.error = False, str(exc)
        if not self._stop.is_set():
            with self._lock:
                self._failed = f"could not recover from the death of {what}: {exc}"
            log.error("%s", self._failed)

    def _reload(self, model: str) -> None:
        api = self.server.http
        config = None
        if not self._steps or model in self._steps:   # (not known: as a step)
            try:
                api.unload(model)        # readiness drops now (the model is UNLOADING)
            except ServerError as exc:   # already unloading or gone: the load below decides
                log.info("unloading %r: %s", model, exc)
        else:
            # in place: the dead instance is replaced once the new one is READY. Its own
            # config goes with the load, marked with this reload: Triton does nothing for a
            # load of a loaded model whose files and config did not change
            config = api.model_config(model)
            config.setdefault("parameters", {})["tandem_reload"] = {"string_value": str(time.time_ns())}
        error = None
        for attempt in range(self.reload_attempts):
            if self._stop.is_set():
                raise ServerError("stopping")
            try:
                api.load(model, timeout_s=self.server.ready_timeout_s, config=config)
                break
            except ServerError as exc:
                error = exc
                log.warning("loading %r failed (attempt %d of %d): %s", model, attempt + 1,
                            self.reload_attempts, exc)
                self._stop.wait(min(8.0, 2.0 ** attempt))
        else:
            raise error
        self.server.wait_ready(abort=self._stop)

    def _restart(self) -> None:
        with self._lock:   # every stub dies with the server: their deaths are seen to
            self._noticed.update(self._watched)
            self._generation += 1
        self.server.relaunch(abort=self._stop)
        decoupled, steps = self._read_configs()
        if decoupled:
            self._decoupled, self._steps = decoupled, steps

    # ---- what it watches ---------------------------------------------------------
    def _crash_in_log(self) -> str:
        """A fatal-signal line tritonserver wrote to its log file since the last look."""
        log_file = getattr(self.server, "log_file", None)
        if not log_file:
            return ""
        try:
            with open(log_file, "rb") as f:
                f.seek(self._log_offset)
                data = f.read(1 << 20)
        except OSError:
            return ""
        data = data[:data.rfind(b"\n") + 1]       # whole lines only
        self._log_offset += len(data)
        for m in _SIGNAL_LINE.finditer(data):
            if int(m.group(1)) not in _SHUTDOWN_SIGNALS:
                return m.group(0).decode()
        return ""

    def _rescan(self) -> None:
        proc = self.server.process
        self._last_scan = time.monotonic()
        if proc is None or proc.poll() is not None:
            return
        stubs = find_stubs(proc.pid)
        with self._lock:
            # a stub that died meanwhile (a zombie: no command line) stays watched until seen
            kept = {pid: s for pid, s in self._watched.items() if pid not in self._noticed
                    and (state := proc_state(pid)) is not None and state.ppid == proc.pid}
            self._watched = {**kept, **{s.pid: s for s in stubs}}

    def _read_configs(self) -> tuple[dict[str, bool], set[str]]:
        """``{model: decoupled}`` of the served Python models (unknown: decoupled) and the
        models that are a step of a served ensemble, from Triton's model configs."""
        decoupled, steps = {}, set()
        for model in self.server.options.models:
            try:
                cfg = self.server.http.model_config(model)
            except Exception:   # an ensemble that failed, a model not loaded
                continue
            if cfg.get("platform") == "ensemble":
                steps |= {step.get("model_name") for step in cfg.get("ensemble_scheduling", {}).get("step", [])}
            else:
                decoupled[model] = bool(cfg.get("model_transaction_policy", {}).get("decoupled", False))
        return decoupled, steps
