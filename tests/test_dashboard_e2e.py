"""The coordinator's dashboard in a real headless Chromium (Debian's, installed by
scripts/provision-chromium.sh if missing), against a live coordinator and agents: it refuses
without a token, shows hosts and jobs with the read token, and shows a running evacuation's phase
as it happens and each rank's phases once it is done.  A screenshot is kept: under pytest's base
temporary directory (screenshots/), and where PITSTOP_KEEP_SCREENSHOT names a file."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from pitstop.wire.coordinator_client import CoordinatorClient

from .helpers import ddp_cmd, let_finish, wait_for_step

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
READ_TOKEN = "dashboard-read-token"
SLOW_PRE_COPY = {"PITSTOP_ENABLE_FAULTS": "1", "PITSTOP_FAULTS": "precopy:before_read=sleep:4"}


@pytest.fixture(scope="module")
def chromium() -> str:
    out = subprocess.run([str(ROOT / "scripts" / "provision-chromium.sh")], capture_output=True, text=True,
                         timeout=900, check=True).stdout.strip().splitlines()
    return out[-1]


def _browser(chromium: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={profile}", "--virtual-time-budget=2500", *args],
                          capture_output=True, text=True, timeout=60)


def _dom(chromium: str, profile: Path, url: str) -> str:
    p = _browser(chromium, profile, "--dump-dom", url)
    assert p.returncode == 0 and "<html" in p.stdout, p.stderr[-2000:]
    return p.stdout


def test_the_dashboard_shows_an_evacuation_as_it_happens(cluster, chromium, tmp_path, tmp_path_factory):
    cluster.start_coordinator(env={"PITSTOP_READ_TOKEN": READ_TOKEN})
    with cluster.starting():
        cluster.start_agent("host-a")
        cluster.start_agent("host-b", env=SLOW_PRE_COPY)
        cluster.start_agent("spare-1", spare=True)
    cc = CoordinatorClient(cluster.coordinator_url, cluster.operator_token)
    out = tmp_path / "out"
    # paced until let_finish: the job must run through every look below (each a browser's page load)
    ranks = cluster.start_job("train", ddp_cmd(out, steps=1500), 1, {0: "host-b"})
    wait_for_step(ranks[0].log, 5)
    page = cluster.coordinator_url + "/dashboard"
    profile = tmp_path / "profile"

    # no token: the page holds no data and says why
    dom = _dom(chromium, profile, page)
    assert "refused:" in dom and "PITSTOP_READ_TOKEN" in dom and "host-b" not in dom, dom[-3000:]
    # the read token: hosts (a cordoned one says so) and jobs
    cc.cordon("host-a", "fan noise")
    dom = _dom(chromium, profile, page + "#token=" + READ_TOKEN)
    assert "host-a" in dom and "spare-1" in dom and "0@host-b: running" in dom, dom[-3000:]
    assert re.search(r"active, cordoned for \d+ s: fan noise", dom), dom[-3000:]
    assert re.search(r"this coordinator \(http://[0-9.:]+\) leads, term \d+ since ", dom), dom[-3000:]

    # an evacuation: its phase while it runs, every rank's phases once it is done
    op = cc.evacuate("host-b", reason="PSU swap")
    seen_running: set[str] = set()
    end = time.monotonic() + 120
    while time.monotonic() < end:
        dom = _dom(chromium, profile, page + "#token=" + READ_TOKEN)
        running = re.findall(r'data-op="%s" data-phase="([a-z_]+)" data-done="false"' % op["name"], dom)
        seen_running |= set(running)
        if re.search(r'data-op="%s" data-phase="[a-z_]*" data-done="true"' % op["name"], dom):
            break
    else:
        raise AssertionError(f"the dashboard never showed {op['name']} done: {dom[-3000:]}")
    assert "precopy" in seen_running, seen_running  # held there 4 s by the source's fault
    assert "succeeded" in dom and "host-b → spare-1" in dom, dom[-3000:]
    assert 'data-phase="capture: dump"' in dom and re.search(r'data-phase="restore: [a-z_]+"', dom), dom[-3000:]
    assert "0@spare-1: running" in dom
    # the host out of service: since when and why, with its operation; live workers per host
    assert re.search(r"drained for \d+ s: PSU swap \(%s\)</td><td>[^<]*</td><td>0</td>" % op["name"], dom), dom[-3000:]
    assert re.search(r"<td>spare-1</td><td>active</td><td>[^<]*</td><td>1</td>", dom), dom[-3000:]
    # the ledger's word on the job after the move, once written (a gloo job: why it is not measured)
    end = time.monotonic() + 30
    while 'data-after="false"' not in dom and time.monotonic() < end:
        dom = _dom(chromium, profile, page + "#token=" + READ_TOKEN)
    assert "the job after it: not measured" in dom and "gloo" in dom, dom[-3000:]

    shot = tmp_path / "dashboard.png"
    p = _browser(chromium, profile, "--window-size=1100,760", f"--screenshot={shot}", page + "#token=" + READ_TOKEN)
    assert p.returncode == 0 and shot.stat().st_size > 10_000, p.stderr[-2000:]
    kept = tmp_path_factory.getbasetemp() / "screenshots"
    kept.mkdir(exist_ok=True)
    shutil.copy(shot, kept / "dashboard.png")
    if os.environ.get("PITSTOP_KEEP_SCREENSHOT"):
        shutil.copy(shot, os.environ["PITSTOP_KEEP_SCREENSHOT"])
    let_finish(out)
    assert ranks[0].proc.wait(120) == 0
