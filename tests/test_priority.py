"""pitstop/priority.py: the services' CPU priority, set before their threads start, inherited by all."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pitstop.agent.settings import AgentSettings
from pitstop.coordinator.settings import CoordinatorSettings

pytestmark = pytest.mark.timeout(60)

PROBE = """
import os, threading
from pitstop import priority
priority.apply(int(os.environ["WANT"]), "test")
seen = []
t = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
t.start(); t.join()
print(os.getpriority(os.PRIO_PROCESS, 0), seen[0])
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs root")
def test_a_service_and_every_thread_it_starts_run_at_the_set_priority():
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, "WANT": "-7"},
                         capture_output=True, text=True, check=True).stdout.split()[-2:]
    assert out == ["-7", "-7"]


def test_the_default_is_above_the_jobs_and_bad_values_are_refused(monkeypatch):
    assert AgentSettings().nice == CoordinatorSettings().nice == -10
    monkeypatch.setenv("PITSTOP_AGENT_NICE", "-21")
    with pytest.raises(ValueError, match="nice"):
        AgentSettings()


BOOST = """
import os, threading
from pitstop import priority
os.setpriority(os.PRIO_PROCESS, 0, -5)
pol = lambda tid=0: (os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid))
out = [pol()]
a = priority.boost(); b = priority.boost()     # nested: one thread, two open boosts
out.append(pol())
a(); a()                                      # each call counts once: b still holds it
out.append(pol())
b()
out.append(pol())
with priority.critical() as ok:               # a thread it starts inherits the policy
    seen = []
    t = threading.Thread(target=lambda: seen.append(pol()))
    t.start(); t.join()
    out += [ok, pol(), seen[0]]
out.append(pol())
tid, ready, ended = [], threading.Event(), threading.Event()
def boosted():                                # ended from another thread (an event loop's timer)
    tid.append(threading.get_native_id()); global back_; back_ = priority.boost(); ready.set(); ended.wait(10)
t = threading.Thread(target=boosted); t.start(); ready.wait(10)
out.append(pol(tid[0])); back_(); out.append(pol(tid[0])); ended.set(); t.join()
print(repr(out))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="SCHED_FIFO needs CAP_SYS_NICE (root)")
def test_a_boost_nests_counts_each_end_once_and_gives_the_thread_its_own_policy_back():
    p = subprocess.run([sys.executable, "-c", BOOST], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    fifo, other = os.SCHED_FIFO, os.SCHED_OTHER
    assert eval(p.stdout.strip().splitlines()[-1]) == [
        (other, -5), (fifo, -5), (fifo, -5), (other, -5),   # the thread keeps its nice value throughout
        True, (fifo, -5), (fifo, -5), (other, -5),
        (fifo, -5), (other, -5)]


def test_without_cap_sys_nice_a_boost_is_refused_and_the_work_runs_as_it_is():
    """A service run without the capability (a container, a non-root agent) must still pause and
    resume: boost() says no, critical() runs the block at the thread's own priority."""
    probe = ("import os, resource\nfrom pitstop import priority\n"
             "resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0))\n"  # no real-time grant by rlimit either
             "b = priority.boost()\n"
             "with priority.critical() as ok:\n    print(b is None, ok, os.sched_getscheduler(0) == os.SCHED_OTHER)\n")
    drop = ["setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice"] if os.geteuid() == 0 else []
    p = subprocess.run([*drop, sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "False", "True"]
