"""Which rank a `pitstop run` registers, and what the worker's environment says, under each
launcher: torchrun around it, torchrun inside it, srun, or nothing (launcher/run.py); and the
signal names an operator may give (proc/signals.py)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from pitstop.launcher.environment import scheduler_env
from pitstop.launcher.run import rank_and_world
from pitstop.proc import proctree, signals

from .helpers import until


@pytest.mark.parametrize(("env", "flag", "want"), [
    ({}, None, (0, None)),
    ({"RANK": "3", "WORLD_SIZE": "8"}, None, (3, 8)),                      # torchrun around pitstop run
    ({"GROUP_RANK": "1", "SLURM_PROCID": "5"}, None, (1, None)),             # one pitstop run per node's torchrun
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8"}, None, (5, 8)),              # srun pitstop run -- ...
    ({"RANK": "2", "SLURM_PROCID": "5", "SLURM_NTASKS": "8"}, None, (2, 8)),  # torchrun's own wins
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8"}, 7, (7, 8)),                 # --rank wins over all
    ({"RANK": "", "SLURM_PROCID": "1"}, None, (1, None)),                    # empty is unset
])
def test_rank_and_world(env, flag, want):
    assert rank_and_world(env, flag) == want


@pytest.mark.parametrize(("env", "says"), [
    ({"RANK": "x"}, "$RANK='x' is not a rank number"),
    ({"SLURM_PROCID": "-1"}, "is negative"),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, "rank 4 is not below the job's 4 ranks"),
])
def test_a_rank_that_cannot_be_is_refused_with_the_variable_named(env, says):
    with pytest.raises(ValueError, match=says.replace("$", r"\$")):
        rank_and_world(env)


def test_srun_variables_become_torch_ones_unless_set():
    env = scheduler_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1"})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "1")
    env = scheduler_env({"SLURM_PROCID": "3", "RANK": "0", "SLURM_NTASKS": "4"})
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "4" and "LOCAL_RANK" not in env
    assert scheduler_env({"PATH": "/bin"}) == {"PATH": "/bin"}


def test_signal_names():
    assert signals.parse("TERM") == signals.parse("sigterm") == signals.parse("15") == signal.SIGTERM
    assert signals.parse(9) == signal.SIGKILL
    for bad in ("NOPE", "0", "99"):
        with pytest.raises(ValueError):
            signals.parse(bad)


def test_a_signal_that_an_init_would_drop_becomes_a_kill_only_without_pitstops_init():
    """A worker that is its namespace's pid 1 (no pitstop init) never sees a SIGTERM it has no
    handler for: what SIGTERM does outside a namespace is then done with SIGKILL."""
    plain = subprocess.Popen(["sleep", "30"])  # no handler for anything
    try:
        until(lambda: signals.handles(plain.pid, signal.SIGTERM) is False and proctree.state(plain.pid) == "S",
              what="sleep started")
        assert signals.as_delivered(plain.pid, signal.SIGTERM, under_init=False) == signal.SIGKILL
        assert signals.as_delivered(plain.pid, signal.SIGTERM, under_init=True) == signal.SIGTERM
        assert signals.as_delivered(plain.pid, signal.SIGUSR1, under_init=False) == signal.SIGUSR1
    finally:
        plain.kill()
        plain.wait()
    # A process with a handler gets the signal as sent.  Its own handler, not Python's default one:
    # a test run started in the background inherits SIGINT ignored, and Python then installs none.
    handled = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                                "signal.signal(signal.SIGINT, lambda *a: None)\nprint('ready', flush=True)\n"
                                "time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        assert handled.stdout is not None and handled.stdout.readline() == b"ready\n"
        assert signals.handles(handled.pid, signal.SIGINT)
        assert signals.as_delivered(handled.pid, signal.SIGINT, under_init=False) == signal.SIGINT
    finally:
        handled.kill()
        handled.wait()
