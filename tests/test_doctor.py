"""`pitstop doctor`: the real command on this host, and how its verdict follows the checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pitstop.agent import exitkeeper
from pitstop.doctor import Check, ready

pytestmark = pytest.mark.timeout(120)


def test_doctor_on_this_host_says_ready_and_why():
    p = subprocess.run([sys.executable, "-m", "pitstop.cli", "doctor", "--json"], capture_output=True, text=True)
    got = json.loads(p.stdout)
    checks = {c["name"]: c for c in got["checks"]}
    assert got["ready"] and p.returncode == 0 and not got["reasons"], got
    for name in ("privileges", "criu", "criu check", "pycriu", "network lock", "worker /proc fix-up", "worker init"):
        assert checks[name]["ok"] is True, checks[name]
    assert checks["incremental dump after a pre-copy"]["ok"] is True, checks["incremental dump after a pre-copy"]
    assert checks["restore fill by UFFDIO_COPY"]["ok"] is True, checks["restore fill by UFFDIO_COPY"]
    kept = checks["exit status after an agent restart"]
    assert kept["ok"] is exitkeeper.supported() and not kept["required"], kept


def test_only_a_failed_required_check_blocks_and_is_named():
    checks = [Check("criu", True, "4.2"), Check("huge-page image tmpfs", False, "no", required=False),
              Check("privileges", False, "uid 1000: CRIU needs root")]
    assert ready(checks) == (False, ["privileges: uid 1000: CRIU needs root"])
    assert ready(checks[:2]) == (True, [])


def test_a_missing_proc_fix_up_is_named_with_its_remedy(monkeypatch, tmp_path):
    monkeypatch.setenv("PITSTOP_PROCSELF", str(tmp_path / "absent.so"))
    from pitstop.doctor import _procself

    c = _procself("/usr/bin/unshare")
    assert c.ok is False and c.required and "error 304" in c.detail and "make native" in c.detail


def test_a_missing_worker_init_is_named_with_its_remedy_and_blocks_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("PITSTOP_INIT", str(tmp_path / "absent"))
    from pitstop.doctor import _worker_init

    c = _worker_init()
    assert c.ok is False and not c.required and "take turns" in c.detail and "make native" in c.detail


def test_a_leftover_criu_lock_table_is_named_with_its_remedy_and_blocks_nothing():
    """A CRIU lock table nobody lifted (another CRIU user's, or from an agent whose state was
    wiped) slows every later dump inside the pause; doctor names it, and leaves it alone."""
    from pitstop.criu import runtime
    from pitstop.doctor import _lock_tables_left

    rt = runtime.locate()
    if not rt.nft or os.geteuid() != 0:
        pytest.skip("needs nft and root")
    name = f"CRIU-doctortest{os.getpid()}"
    subprocess.run([rt.nft, "add", "table", "inet", name], check=True, capture_output=True, timeout=30)
    try:
        c = _lock_tables_left(rt)
        assert c.ok is False and not c.required and f"inet {name}" in c.detail and "nft delete table" in c.detail, c
        assert ready([c]) == (True, [])
        listed = subprocess.run([rt.nft, "list", "tables"], capture_output=True, text=True, timeout=30).stdout
        assert name in listed  # named, not removed: it may belong to a dump under way
    finally:
        subprocess.run([rt.nft, "delete", "table", "inet", name], capture_output=True, timeout=30)
    after = _lock_tables_left(rt)
    assert name not in after.detail


def test_an_agent_unit_that_runs_a_pitstop_that_is_not_there_is_named_with_the_drop_in(tmp_path):
    """The unit names /usr/local/bin/pitstop; pitstop installed in a virtual environment is not there,
    and the agent would fail at every start with systemd's status 203/EXEC.  Doctor says so, and how
    to point the unit at this pitstop; a drop-in that does is honoured."""
    from pitstop.doctor import UNIT, agent_unit

    assert agent_unit(tmp_path).ok is None  # not installed: nothing to say
    units = tmp_path / "etc/systemd/system"
    units.mkdir(parents=True)
    shipped = (Path(__file__).resolve().parent.parent / "systemd" / UNIT).read_text()
    missing = tmp_path / "nowhere" / "pitstop"
    (units / UNIT).write_text(shipped.replace("/usr/local/bin/pitstop", str(missing)))
    c = agent_unit(tmp_path)
    assert c.ok is False and not c.required, c
    assert f"runs {missing}, which does not exist" in c.detail and "systemctl edit pitstop-agent.service" in c.detail
    assert "ExecStart= (empty" in c.detail
    venv = tmp_path / "venv" / "bin" / "pitstop"
    venv.parent.mkdir(parents=True)
    venv.write_text("#!/bin/sh\n")
    venv.chmod(0o755)
    (units / f"{UNIT}.d").mkdir()
    (units / f"{UNIT}.d" / "override.conf").write_text(f"[Service]\nExecStart=\nExecStart={venv} agent --name %H\n")
    c = agent_unit(tmp_path)
    assert c.ok is True and str(venv) in c.detail, c


def test_a_host_without_criu_is_told_a_command_it_has(tmp_path):
    """Before: "run `make criu`", a target of the source checkout that a host installed from a wheel
    does not have.  The advice names `pitstop provision-criu`, which the wheel carries."""
    env = {k: v for k, v in os.environ.items() if k not in ("PITSTOP_CRIU", "PITSTOP_PYCRIU", "PITSTOP_NFT")}
    env.update(PITSTOP_CRIU_PREFIX=str(tmp_path / "none"), PITSTOP_CRIU_CARRIED_PREFIX=str(tmp_path / "none-carried"),
               PITSTOP_FORCE_PRIVATE_CRIU="1")
    p = subprocess.run([sys.executable, "-m", "pitstop.cli", "doctor", "--json"], env=env, capture_output=True,
                       text=True, timeout=120)
    got = json.loads(p.stdout)
    criu = next(c for c in got["checks"] if c["name"] == "criu")
    assert p.returncode == 1 and not got["ready"] and criu["ok"] is False, got
    assert "pitstop provision-criu" in criu["detail"] and "make" not in criu["detail"], criu
