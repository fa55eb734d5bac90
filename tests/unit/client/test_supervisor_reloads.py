"""The supervisor's reloads run beside its loop (client/serve/supervisor.py): a reload that
waits for the old instance to drain (a minute and more under load) holds back neither a
restart that another death needs nor the supervisor's view of it. Against a stand-in for
the server, so that a reload can be held for as long as the test likes."""
from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

from tandem.client.serve.stubs import Stub
from tandem.client.serve.supervisor import RELOAD, RESTART, Supervisor


class HeldServer:
    """What the supervisor calls on a server; ``load`` blocks until ``release`` is set."""

    def __init__(self):
        self.release = threading.Event()
        self.loading = threading.Event()
        self.relaunches = 0
        self.process = SimpleNamespace(pid=os.getpid(), poll=lambda: None)
        self.options = SimpleNamespace(models=("postprocess", "decode", "tandem"), ensembles=("tandem",))
        self.ready_timeout_s, self.model_control_mode, self.log_file = 60, "explicit", None
        self.http = SimpleNamespace(load=self._load, unload=lambda model: None, admin_key="",
                                    model_config=self._config, states=lambda: {})

    def _load(self, model, timeout_s=None, config=None):
        self.loading.set()
        assert self.release.wait(30), "the test never released the reload"

    @staticmethod
    def _config(model):
        if model == "tandem":
            return {"platform": "ensemble", "ensemble_scheduling": {"step": [{"model_name": "postprocess"},
                                                                             {"model_name": "decode"}]}}
        return {"model_transaction_policy": {"decoupled": model == "decode"}}

    def relaunch(self, abort=None):
        self.relaunches += 1

    def wait_ready(self, timeout_s=None, abort=None):
        pass

    def remove_shm_region(self, name):
        pass


def stub(model: str, pid: int) -> Stub:
    return Stub(pid=pid, model=model, version="1", instance=f"{model}_0_0", shm_region=f"tandem_{pid}")


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_a_restart_is_not_held_back_by_a_reload_that_waits():
    server = HeldServer()
    sup = Supervisor(server)
    sup._decoupled, sup._steps = sup._read_configs()
    sup._on_dead([(stub("postprocess", 101), 9)])          # SIGKILL of a step: reload (held)
    assert server.loading.wait(5) and sup.status().recovering
    sup._on_dead([(stub("decode", 102), 9)])               # SIGKILL of a decoupled model: restart
    assert server.relaunches == 1                          # at once, the reload still held
    by_model = {r.model: r for r in sup.status().recoveries}
    assert by_model["decode"].action == RESTART and by_model["decode"].ok
    assert by_model["postprocess"].action == RELOAD and by_model["postprocess"].ok is None
    server.release.set()
    assert wait_for(lambda: not sup.status().recovering)
    assert {r.model: r.ok for r in sup.status().recoveries} == {"postprocess": True, "decode": True}


def test_a_death_during_a_reload_is_reloaded_again():
    server = HeldServer()
    sup = Supervisor(server)
    sup._decoupled, sup._steps = sup._read_configs()
    loads = []
    held = server.http.load
    server.http.load = lambda model, **kw: (loads.append(model), held(model, **kw))
    sup._on_dead([(stub("postprocess", 201), 9)])
    assert server.loading.wait(5)
    sup._on_dead([(stub("postprocess", 202), 9)])          # the instance it loads may be the dead one
    server.release.set()
    assert wait_for(lambda: not sup.status().recovering)
    assert loads == ["postprocess", "postprocess"] and server.relaunches == 0
    assert all(r.ok for r in sup.status().recoveries) and len(sup.status().recoveries) == 2
