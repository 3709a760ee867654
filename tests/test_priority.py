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
