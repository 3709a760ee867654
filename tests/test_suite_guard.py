"""The suite's own guards (tests/conftest.py): one run per machine at a time, and its leak
checks leave alone what other live local clusters (a bench, the demo) hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pitstop.dev import devleases
from pitstop.proc import proctree

from .conftest import _foreign_paths

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)


@pytest.mark.slow
def test_a_second_run_of_the_suite_stops_at_once_and_says_why():
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_planner.py"],
                       cwd=ROOT, capture_output=True, text=True, timeout=100)
    out = p.stdout + p.stderr
    assert p.returncode == 3, out[-2000:]
    assert "another run of pitstop's test suite is under way" in out, out[-2000:]
    # who holds it, so the user can find it: this run's controller (with parallel workers, their parent)
    holder = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
    assert f"pid {holder}" in out, out[-2000:]
    assert "passed" not in out  # nothing ran


def _lease(name: str, pid: int, **what) -> Path:
    d = devleases.registry()
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    f = d / f"{name}.json"
    f.write_text(json.dumps({"pid": pid, "start": proctree.start_time(pid), **what}))
    return f


def test_what_other_live_clusters_hold_is_not_taken_for_this_runs_leftovers(tmp_path):
    other = subprocess.Popen(["sleep", "60"])
    files: list[Path] = []
    try:
        theirs = tmp_path / "theirs"
        files.append(_lease("guard-test-live", other.pid, paths=[str(theirs)], netns_prefix="pst-guardtest-"))
        files.append(_lease("guard-test-ours", os.getpid(), paths=[str(tmp_path / "ours")]))
        dead = subprocess.Popen(["true"])
        dead.wait()
        files.append(_lease("guard-test-dead", dead.pid, paths=[str(tmp_path / "dead")]))
        got = _foreign_paths()
        assert f"{theirs}/" in got and "/run/netns/pst-guardtest-" in got
        assert not any(p.startswith((f"{tmp_path}/ours", f"{tmp_path}/dead")) for p in got)
    finally:
        for f in files:
            f.unlink(missing_ok=True)
        other.kill()
        other.wait()
