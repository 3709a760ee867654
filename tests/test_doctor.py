"""`pitstop doctor`: the real command on this host, and how its verdict follows the checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
