"""The audit's low findings (docs/reliability.md, "The security audit"), each replayed: no script
from a CDN on the dashboard's origin (L2), worker ids that cannot leave a snapshot's directory and
replica ids that never collide (L3), init directories root makes without following links (L4),
and a replay that sends the operator's token to its own coordinator only, over finite figures
(L5).  Real files, a real SQLite store; the CLI in process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from pitstop import nsinit
from pitstop.agent.snapshots import Snapshots, checked, image_id
from pitstop.coordinator.api import build
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.errors import InvalidRequest
from pitstop.wire import agent_requests

pytestmark = pytest.mark.timeout(60)


def test_l2_no_page_on_the_coordinators_origin_loads_a_script_from_elsewhere(tmp_path):
    app, _ = build(CoordinatorSettings(db=tmp_path / "c.db", insecure=True))
    with TestClient(app) as c:
        for path in ("/docs", "/redoc"):
            assert c.get(path).status_code == 404, path
        assert c.get("/openapi.json").status_code == 200
        page = c.get("/dashboard").text
        assert "cdn" not in page.lower() and "//" not in "".join(
            ln for ln in page.splitlines() if "<script" in ln and "src=" in ln)


@pytest.mark.parametrize("bad", ["..", "../x", "j/0", ".hidden.0", "j.0/..", "j"])
def test_l3_a_worker_id_never_names_a_path_outside_its_snapshot(bad):
    with pytest.raises(InvalidRequest):
        checked("job", bad)
    with pytest.raises(Exception, match="validation error"):
        agent_requests.CheckFilesRequest(ids=[bad])
    with pytest.raises(Exception, match="validation error"):
        agent_requests.KeepReplicaRequest(job="job", number=1, worker_id=bad)


def test_l3_jobs_named_alike_never_share_a_replica(tmp_path):
    assert image_id("a.b", 3, "a.b.0") != image_id("a_b", 3, "a_b.0")
    assert image_id("a-1", 2, "a-1.0") != image_id("a", 12, "a.0")
    for job in ("..", ".", "-x", "a/b"):
        with pytest.raises(InvalidRequest):
            checked(job)
    snaps = Snapshots.__new__(Snapshots)
    snaps.root = tmp_path / "snapshots"
    with pytest.raises(InvalidRequest):
        snaps._dir("..", 1, "own")
    with pytest.raises(InvalidRequest):
        snaps.drop("..")
    assert tmp_path.exists()


def test_l4_root_makes_an_init_directory_through_no_link(tmp_path):
    real, target = tmp_path / "real", tmp_path / "elsewhere"
    real.mkdir()
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    good = real / "init" / "pitstop-init.j.0.abc123"
    nsinit.ensure(str(good))
    assert good.is_dir() and oct(good.stat().st_mode & 0o777) == "0o700"
    bad = tmp_path / "link" / "pitstop-init.j.0.abc123"
    with pytest.raises(ValueError, match="symbolic link"):
        nsinit.ensure(str(bad))
    assert os.listdir(target) == [], "nothing made at the end of the link"
    with nsinit.pinned(str(bad)):
        assert os.listdir(target) == [], "no pin file through the link"
    (target / "pitstop-init.j.0.abc123").mkdir()
    nsinit.remove(str(bad))
    assert os.listdir(target) == ["pitstop-init.j.0.abc123"], "nothing removed through the link"
    nsinit.remove(str(good))
    assert not good.exists()


def test_l5_a_replay_reads_moves_only_from_its_own_coordinator(tmp_path, monkeypatch):
    from pitstop import cli

    trace = tmp_path / "t.csv"
    trace.write_text("time_h,host,kind,domain\n1,h1,planned,r1\n")
    monkeypatch.setenv("PITSTOP_COORDINATOR", "http://127.0.0.1:7000")
    monkeypatch.setenv("PITSTOP_TOKEN", "operator-secret")
    r = CliRunner().invoke(cli.app, ["replay", str(trace), "--hosts", "2", "--moves-from",
                                     "http://attacker.example:80", "--json"])
    assert r.exit_code != 0 and "not_the_coordinator" in r.output, r.output
    r = CliRunner().invoke(cli.app, ["replay", str(trace), "--hosts", "2", "--restart-s", "inf", "--json"])
    assert r.exit_code != 0 and "finite" in r.output, r.output
    Path(trace).write_text("time_h,host,kind,domain\ninf,h1,planned,r1\n")
    r = CliRunner().invoke(cli.app, ["replay", str(trace), "--hosts", "2", "--json"])
    assert r.exit_code != 0 and "finite" in r.output, r.output
