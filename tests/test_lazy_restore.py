"""Post-copy restore from the local copy (memory/lazy_pages.py), end to end and real.

Invariant as everywhere: the moved job ends bit for bit as an uninterrupted run.  And the
risk the mode carries: if the lazy-pages daemon dies before the worker's memory is all in
place, the worker is stopped (never left to read zeros) and says why.
"""

from __future__ import annotations

import pytest

from pitstop.migration.move import move_worker
from pitstop.proc import proctree

from .helpers import assert_job_ends_intact, ddp_cmd, until, wait_for_step

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.mark.parametrize("workers", [2], ids=["with DataLoader children"])
def test_lazy_restore_moves_rank_bitwise_equal(cluster, tmp_path, workers):
    """With DataLoader children: the tree holds the one-process case (its root) and adds the
    children's copy-on-write pages (a one-process case cost the suite 19 s more, covering less)."""
    with cluster.starting():
        a = cluster.start_agent("a")
        b = cluster.start_agent("b", spare=True, env={"PITSTOP_AGENT_LAZY_RESTORE": "1"})
    out = tmp_path / "out"
    kw = dict(steps=80, state_mb=64, workers=workers)
    ranks = cluster.start_job("j", ddp_cmd(out, **kw), 2, {0: "a", 1: "a"})
    for r in range(2):
        cluster.wait_registered("a", f"j.{r}")
    wait_for_step(ranks[1].log, 8)
    before = proctree.tree(a.client().worker("j.1").root_pid)
    rep = move_worker(a.client(), b.client(), "j.1", dest_name="b", peers=[(a.client(), "j.0")])
    assert len(proctree.tree(rep.restored_pid)) == len(before)
    # The fill ends by itself, and then the images go.
    until(lambda: "memory filled" in b.log.read_text(errors="replace"))
    until(lambda: not any(b.image_dir.iterdir()))
    assert_job_ends_intact(out, ranks, tmp_path, 80, **kw)
    assert b.client().worker("j.1").state == "exited"


def test_fill_daemon_dies_worker_is_stopped_and_says_why(cluster, tmp_path):
    with cluster.starting():
        a = cluster.start_agent("a")
        b = cluster.start_agent("b", spare=True, env={"PITSTOP_AGENT_LAZY_RESTORE": "1", "PITSTOP_ENABLE_FAULTS": "1",
                                                      "PITSTOP_FAULTS": "restore:kill_fill=1"})
    out = tmp_path / "out"
    ranks = cluster.start_job("j", ddp_cmd(out, steps=400, state_mb=64), 2, {0: "a", 1: "a"})
    for r in range(2):
        cluster.wait_registered("a", f"j.{r}")
    wait_for_step(ranks[1].log, 5)
    rep = move_worker(a.client(), b.client(), "j.1", dest_name="b", peers=[(a.client(), "j.0")])
    until(lambda: b.client().worker("j.1").state == "lost")
    w = b.client().worker("j.1")
    assert "lazy-pages daemon stopped with signal 9" in w.reason, w
    assert not proctree.exists(rep.restored_pid)
    until(lambda: not any(b.image_dir.iterdir()))
    for r in ranks:  # the job's own recovery would take over; here the test ends it
        r.proc.kill()
        r.proc.wait(30)


def test_agent_refuses_lazy_restore_where_the_kernel_cannot(monkeypatch, tmp_path):
    from pitstop.agent import server
    from pitstop.agent.settings import AgentSettings
    from pitstop.errors import FailedPrecondition

    s = AgentSettings(name="x", state_dir=tmp_path, lazy_restore=True, insecure=True)
    monkeypatch.setattr(server.lazy_pages, "supported",
                        lambda rt=None: (False, "Error (criu/uffd.c:290): uffd: Feature not supported"))
    with pytest.raises(FailedPrecondition) as e:
        server.check_lazy_restore(s)
    assert "uffd: Feature not supported" in e.value.message and "PITSTOP_AGENT_LAZY_RESTORE" in e.value.action
    server.check_lazy_restore(AgentSettings(name="x", state_dir=tmp_path, insecure=True))  # off: no check
    monkeypatch.setattr(server.lazy_pages, "supported", lambda rt=None: (True, "Looks good."))
    server.check_lazy_restore(s)


def test_the_ledgers_pause_of_a_lazy_restore_lasts_until_the_fill_ends(cluster, tmp_path):
    """Through the coordinator, the spare restoring lazily from its own copy: the operation is done at
    the resume, while the moved ranks' memory still fills.  Before: the ledger (and the dashboard)
    gave the downtime as the job's pause; it is the pause until the fill's end (a gloo job shows no
    step), and the job's own longest gap between two steps is no longer than that."""
    from .test_remote_post_copy import _coordinated, _follow, _the_pause_is_the_jobs

    cc, out, kw, ranks = _coordinated(cluster, tmp_path, 1, 100, spare_env={"PITSTOP_AGENT_LAZY_RESTORE": "1"})
    op, _ = _follow(cc, cc.evacuate("host-b")["name"])
    assert op["metadata"]["result"] == "succeeded", op
    assert "fill_start" in op["metadata"]["workers"]["j.1"]["restore_phases"], op["metadata"]["workers"]
    _the_pause_is_the_jobs(cc, op, ranks[1:])
    assert_job_ends_intact(out, ranks, tmp_path, 100, **kw)
