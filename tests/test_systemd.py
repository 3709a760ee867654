"""systemd units lint clean; agent and coordinator speak the notify protocol (readiness, watchdog)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pitstop.dev.devcluster import free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
@pytest.mark.parametrize("unit", ["pitstop-agent.service", "pitstop-coordinator.service", "pitstop-slurm-watch.service"])
def test_unit_lints_clean(unit, tmp_path):
    exe = Path(sys.executable).with_name("pitstop")
    text = (ROOT / "systemd" / unit).read_text().replace("/usr/local/bin/pitstop", str(exe))
    (tmp_path / unit).write_text(text)
    p = subprocess.run(["systemd-analyze", "verify", str(tmp_path / unit)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and not (p.stdout + p.stderr).strip(), p.stdout + p.stderr


def test_agent_unit_never_kills_workers_on_restart():
    text = (ROOT / "systemd" / "pitstop-agent.service").read_text()
    assert "KillMode=process" in text and "Type=notify" in text and "WatchdogSec=" in text


def _listen(tmp_path: Path) -> tuple[socket.socket, str]:
    path = str(tmp_path / "notify.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(0.5)
    return s, path


def _collect(s: socket.socket, seconds: float) -> list[str]:
    end, out = time.monotonic() + seconds, []
    while time.monotonic() < end:
        try:
            out.append(s.recv(4096).decode())
        except socket.timeout:
            pass
    return out


@pytest.mark.parametrize("service", ["agent", "coordinator"])
@pytest.mark.slow
def test_ready_and_watchdog(service, tmp_path):
    s, path = _listen(tmp_path)
    port = free_port()
    env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="400000", PITSTOP_CLUSTER_TOKEN="t", PITSTOP_TOKEN="o")
    env.pop("WATCHDOG_PID", None)
    if service == "agent":
        cmd = ["agent", "--name", "n", "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "st"),
               "--image-dir", str(tmp_path / "img")]
    else:
        cmd = ["coordinator", "--listen", f"127.0.0.1:{port}", "--db", str(tmp_path / "c.db")]
    p = subprocess.Popen([sys.executable, "-m", "pitstop.cli", *cmd], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        msgs = _collect(s, 4.0)
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(20)
        s.close()
    assert any(m.startswith("READY=1") for m in msgs), msgs
    assert sum(m == "WATCHDOG=1" for m in msgs) >= 3, msgs


def test_restored_workers_get_their_own_scope_where_systemd_runs():
    """The D-Bus call is checked here; it has not run under a real systemd (PID 1 is not systemd here)."""
    import subprocess as sp

    from pitstop.agent import scope

    calls = []

    def run(args, **kw):
        calls.append(args)
        return sp.CompletedProcess(args, 0, "o \"/org/freedesktop/systemd1/job/7\"", "")

    assert scope.place("train.1", 4242, present=lambda: False, run=run) is None and calls == []
    assert scope.place("train.1", 4242, present=lambda: True, run=run) == "pitstop-worker-train.1-4242.scope"
    a = calls[0]
    assert a[:2] == ["busctl", "call"] and "StartTransientUnit" in a
    assert a[a.index("PIDs"):a.index("PIDs") + 4] == ["PIDs", "au", "1", "4242"]
    refused = lambda args, **kw: sp.CompletedProcess(args, 1, "", "Access denied")  # noqa: E731
    assert scope.place("train.1", 4242, present=lambda: True, run=refused) is None  # logged, never raised
