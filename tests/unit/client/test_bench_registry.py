"""A benchmark stopped with SIGTERM (``kill``, ``timeout``) still stops its servers."""
import os
import signal
from contextlib import ExitStack

import pytest

from tandem.client.bench.registry import stopping_servers_on_sigterm


def test_sigterm_unwinds_the_benchmark_so_its_servers_stop():
    stopped = []

    def run(args):
        with ExitStack() as stack:
            stack.callback(stopped.append, "server")     # what start_server registers
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("not reached: the signal ends the run")

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        stopping_servers_on_sigterm(run)(None)
    assert exc.value.code == 128 + signal.SIGTERM and stopped == ["server"]
    assert signal.getsignal(signal.SIGTERM) is before    # the handler is the run's only


def test_a_run_that_ends_returns_its_code():
    assert stopping_servers_on_sigterm(lambda args: 3)(None) == 3
