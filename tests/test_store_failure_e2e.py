"""The coordinator's database fills up in the middle of an evacuation, for real: its SQLite file
on a small tmpfs, filled during the capture phase.  Before the fix the save raised, the
rollback raised at its own first save, the operation's thread died, and the paused peer rank
stayed SIGSTOPped (the spare busy, a cancel accepted and ignored) until the coordinator was
restarted.  Now: the move is undone on the agents at once, the API answers 503 with what to do
while the database is full, and the operation is recorded as failed once space is back."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pitstop.proc import proctree
from pitstop.wire.coordinator_client import CoordinatorClient

from .helpers import assert_same_as_reference, ddp_cmd, let_finish, reference_hashes, step_times, until, wait_for_step
from .test_coordinator_e2e import _wait_jobs, _wait_op

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
HOLD_S = 8  # the source agent waits this long before its dump: the window to fill the database in


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "16m") -> Iterator[Path]:
    """A tmpfs of `size` at `path`, unmounted (lazily: the coordinator may still hold its files)
    whatever happens."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(db: Path) -> Path:
    """Make the file system under `db` full, as a disk fills: SQLite's next write fails with
    "database or disk is full".  Its write-ahead log is first checkpointed and truncated, so that
    the next write must grow a file (one that overwrote a log it had already grown would need
    no new space).  The file that takes the space; remove it to give the space back."""
    with contextlib.closing(sqlite3.connect(str(db), timeout=10)) as c:
        for _ in range(50):
            busy, _, _ = c.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if not busy:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("could not checkpoint the coordinator's database")
    filler = db.parent / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for chunk in (b"\0" * (1 << 20), b"\0" * 4096):
            try:
                while True:
                    os.write(fd, chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)
    return filler


def _cancel(cluster, op_name: str) -> httpx.Response:
    return httpx.post(f"{cluster.coordinator_url}/v1/{op_name}:cancel", timeout=30,
                      headers={"Authorization": f"Bearer {cluster.operator_token}"})


def _stopped(pid: int) -> bool:
    return proctree.state(pid) in ("T", "t")


def test_a_database_that_fills_mid_capture_leaves_no_rank_stopped(cluster, tmp_path):
    with small_tmpfs(tmp_path / "db") as fs:
        cluster.coordinator_db = fs / "coordinator.db"
        cluster.start_coordinator(env={"PITSTOP_COORDINATOR_WATCHDOG_S": "1"})
        with cluster.starting():
            cluster.start_agent("host-a")
            cluster.start_agent("host-b", env={"PITSTOP_ENABLE_FAULTS": "1",
                                               "PITSTOP_FAULTS": f"capture:before_dump=sleep:{HOLD_S}"})
            cluster.start_agent("spare-1", spare=True)
        cc = CoordinatorClient(cluster.coordinator_url, cluster.operator_token)
        out = tmp_path / "out"
        ranks = cluster.start_job("train", ddp_cmd(out, steps=150), 2, {0: "host-a", 1: "host-b"})
        _wait_jobs(cc, "train", 2)
        wait_for_step(ranks[1].log, 5)
        op = cc.evacuate("host-b")
        _wait_op(cc, op["name"], timeout=120, until=lambda o: o["metadata"]["phase"] == "capture")
        peer = cluster.agents["host-a"].client()
        assert peer.worker("train.0").state == "paused"
        peer_pid = peer.worker("train.0").root_pid
        assert _stopped(peer_pid)
        filler = fill(cluster.coordinator_db)
        try:
            # Full: the API says so, as JSON with what to do, not a plain-text 500 ...
            r = _cancel(cluster, op["name"])
            assert r.status_code == 503 and r.headers["content-type"] == "application/json", (r.status_code, r.text)
            err = r.json()["error"]
            assert err["code"] == "database_unavailable" and "database or disk is full" in err["message"], err
            assert str(cluster.coordinator_db) in err["message"] and "free space" in err["action"], err
            # ... and the move is undone on the agents all the same: no rank left stopped.
            until(lambda: peer.worker("train.0").state == "running" and not _stopped(peer_pid), timeout=60,
                  what="the paused peer resumed while the database is full")
            source = cluster.agents["host-b"].client().worker("train.1")
            assert source.state == "running" and not _stopped(source.root_pid), source
            copies = [w for w in cluster.agents["spare-1"].client().workers() if w.id == "train.1"]
            assert all(w.state not in ("running", "paused") for w in copies), copies
            seen = len(step_times(ranks[0].log))
            wait_for_step(ranks[0].log, seen + 3)  # the job trains on, where it was
            assert not cc.op(op["name"])["done"]  # its record waits for space; reads still answer
            assert _cancel(cluster, op["name"]).status_code == 503
        finally:
            filler.unlink()
        # Space again: the watchdog writes the operation's end without any restart.
        o = _wait_op(cc, op["name"], timeout=60)
        assert o["metadata"]["result"] == "failed" and o["metadata"]["phase"] == "done", o
        d = o["error"]["details"][0]
        assert d["reason"] == "database_unavailable" and "database or disk is full" in o["error"]["message"], d
        assert not d["metadata"]["rollback_problems"] and "keeps running on host-b" in d["action"], d
        assert {c["type"]: c["status"] for c in o["metadata"]["conditions"]}["RolledBack"] == "True"
        assert _cancel(cluster, op["name"]).status_code == 409  # done: nothing to cancel
        assert cc.evacuate("host-b", validate_only=True)["destination"] == "spare-1"  # the spare is free
        let_finish(out)
        assert [rk.proc.wait(240) for rk in ranks] == [0, 0]
        assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=150))
        assert not any(cluster.agents["spare-1"].image_dir.iterdir())
        os.killpg(cluster.coordinator_proc.pid, signal.SIGTERM)  # before its file system goes
        cluster.coordinator_proc.wait(30)
