"""Soak: 50 back-to-back migrations of one job's rank across three hosts, then the job must
finish bitwise equal to an uninterrupted run, with nothing left behind and no growth in the
agents' memory or open files."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from pitstop.wire.coordinator_client import CoordinatorClient

from ..helpers import assert_same_as_reference, ddp_cmd, reference_hashes, wait_for_step
from ..test_coordinator_e2e import _wait_jobs, _wait_op

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]
MOVES = int(os.environ.get("PITSTOP_SOAK_MOVES", "50"))
STEPS = max(1500, MOVES * 30)  # enough steps left for every move


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _empties(d: Path, within_s: float = 10.0) -> bool:
    """The node's commit, the operation's last step, sets its images aside (`.trash-*`) and a
    thread of its agent deletes them just after (agent/reclaim.py): empty within a few seconds."""
    end = time.monotonic() + within_s
    while d.exists() and any(d.iterdir()):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {ln.split()[0] for ln in out.splitlines() if ln.strip()}


def test_fifty_migrations_leave_nothing_behind(cluster, tmp_path, record):
    cluster.start_coordinator()
    hosts = ["host-b", "host-c", "host-d"]
    for name in ["host-a", *hosts]:
        cluster.start_agent(name)
    cc = CoordinatorClient(cluster.coordinator_url, cluster.operator_token)
    out = tmp_path / "out"
    ranks = cluster.start_job("soak", ddp_cmd(out, steps=STEPS), 2, {0: "host-a", 1: "host-b"})
    _wait_jobs(cc, "soak", 2)
    wait_for_step(ranks[1].log, 10)
    ns0 = _netns()
    agents = {h: cluster.agents[h].proc.pid for h in hosts}
    samples: list[dict[str, tuple[int, int]]] = []
    downtimes = []
    where = "host-b"
    t0 = time.monotonic()
    for i in range(MOVES):
        to = hosts[(hosts.index(where) + 1) % 3]
        op = _wait_op(cc, cc.evacuate(where, to=to)["name"], timeout=180)
        assert op["metadata"]["result"] == "succeeded", (i, op.get("error"))
        downtimes.append(op["metadata"]["downtime_s"])
        for h in hosts:  # nothing left in any image directory once a move is committed
            assert _empties(cluster.agents[h].image_dir), (i, h, [p.name for p in cluster.agents[h].image_dir.iterdir()])
        samples.append({h: (_rss_kib(p), _fds(p)) for h, p in agents.items()})
        cc.uncordon(where)  # the evacuated host back in service, as an operator returns it; else no destination
        where = to
        step = int(ranks[0].log.read_text().rsplit("step ", 1)[1].split()[0])
        wait_for_step(ranks[0].log, min(step + 3, STEPS))
    soak_s = time.monotonic() - t0
    if os.environ.get("PITSTOP_SOAK_TRACE"):  # the whole RSS trajectory, to tell a leak from a plateau
        Path(os.environ["PITSTOP_SOAK_TRACE"]).write_text(
            "\n".join(" ".join(f"{h}={s[h][0]}" for h in hosts) for s in samples) + "\n")
    assert [r.proc.wait(600) for r in ranks] == [0, 0]
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=STEPS))
    assert _netns() == ns0
    first, last = samples[min(4, len(samples) - 1)], samples[-1]
    growth = {h: ((last[h][0] - first[h][0]) // 1024, last[h][1] - first[h][1]) for h in hosts}
    for h, (mib, fds) in growth.items():
        assert mib < 40 and fds <= 4, f"{h} grew by {mib} MiB RSS and {fds} open files over {MOVES} moves"
    record(f"soak: {MOVES} migrations back to back across 3 hosts",
           "all succeeded; job finished bitwise equal; no image, namespace or lock table left",
           f"{soak_s:.0f} s; downtime median {sorted(downtimes)[len(downtimes) // 2]:.2f} s, max "
           f"{max(downtimes):.2f} s; agent growth (MiB RSS, fds) after the 5th move: {growth}")
