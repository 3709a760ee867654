"""End to end, real: a worker's stdout and stderr, launched by `pitstop run` into one file
(`>log 2>&1`) and moved to another host mid-run, keep the order a plain run gives them; launched
into two files, each keeps its own lines.  Before: the launcher relayed the two streams through
two pipes and two threads, and a burst of stdout landed ahead of the stderr written between its
lines (launcher/stdio.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pitstop.dev.devcluster import pitstop_cmd
from pitstop.migration.move import move_worker
from pitstop.proc import proctree

from .helpers import WORKLOADS, until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WORKER = [sys.executable, str(WORKLOADS / "interleave.py"), "--steps", "40", "--burst", "20"]


def _worker_lines(text: str) -> list[str]:
    """The worker's own lines, without the launcher's (`pitstop run: ...`)."""
    return [ln for ln in text.splitlines() if ln.startswith(("out ", "err "))]


def _fds_of_tree(root: int) -> set[tuple[str, str]]:
    """(fd 1, fd 2) of every process of the tree whose fd 1 is a pipe."""
    out = set()
    for pid in proctree.tree(root):
        try:
            one, two = os.readlink(f"/proc/{pid}/fd/1"), os.readlink(f"/proc/{pid}/fd/2")
        except OSError:
            continue
        if one.startswith("pipe:"):
            out.add((one, two))
    return out


def test_stdout_and_stderr_keep_their_order_across_a_move(cluster, tmp_path):
    with cluster.starting():
        a = cluster.start_agent("a")
        b = cluster.start_agent("b", spare=True)
    with open(tmp_path / "plain.log", "wb") as f:  # the order a plain run gives them
        subprocess.run([*WORKER, "--step-sleep", "0"], stdout=f, stderr=subprocess.STDOUT, check=True, timeout=120)
    plain = _worker_lines((tmp_path / "plain.log").read_text())
    assert len(plain) == 40 * 20 * 2 and plain[:3] == ["out 0.0", "err 0.0", "out 0.1"]

    pace = tmp_path / "pace"
    run = [*pitstop_cmd(), "run", "--agent", a.url]
    work = [*WORKER, "--pace-file", str(pace)]
    merged_log = tmp_path / "merged.log"
    merged = subprocess.Popen([*run, "--job", "merged", "--", *work], env=cluster.env(),
                              stdout=open(merged_log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    split = subprocess.Popen([*run, "--job", "split", "--", *work], env=cluster.env(),
                             stdout=open(tmp_path / "split.out", "wb"), stderr=open(tmp_path / "split.err", "wb"),
                             start_new_session=True)
    try:
        for wid in ("merged.0", "split.0"):
            cluster.wait_registered("a", wid)
        # one pipe for both streams where the launcher's are one file, two where they are two
        roots = {wid: a.client().worker(wid).root_pid for wid in ("merged.0", "split.0")}
        assert {o == t for o, t in _fds_of_tree(roots["merged.0"])} == {True}
        assert {o == t for o, t in _fds_of_tree(roots["split.0"])} == {False}
        until(lambda: "out 4.0" in merged_log.read_text(), timeout=60, what="the worker's fifth step")
        for wid in ("merged.0", "split.0"):
            rep = move_worker(a.client(), b.client(), wid, dest_name="b")
            assert rep.restored_pid
        # restored as they were: one pipe at fds 1 and 2, or two
        moved = {wid: b.client().worker(wid).root_pid for wid in ("merged.0", "split.0")}
        assert {o == t for o, t in _fds_of_tree(moved["merged.0"])} == {True}
        assert {o == t for o, t in _fds_of_tree(moved["split.0"])} == {False}
        assert "out 39.0" not in merged_log.read_text(), "the worker ended before it moved"
        pace.write_text("0\n")
        assert merged.wait(120) == 0 and split.wait(120) == 0
    finally:
        for p in (merged, split):
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(20)
    text = merged_log.read_text()
    assert _worker_lines(text) == plain, text[:2000]
    assert _worker_lines((tmp_path / "split.out").read_text()) == [ln for ln in plain if ln.startswith("out ")]
    assert _worker_lines((tmp_path / "split.err").read_text()) == [ln for ln in plain if ln.startswith("err ")]
