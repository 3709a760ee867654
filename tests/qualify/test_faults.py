"""The fault-injection matrix (zdtm-style): one small workload with an invariant, run under
each fault injected at a precise point.  The invariant: the job finishes with final
parameters bitwise equal to an uninterrupted run (it kept running on its source, or it was
moved), unless the fault itself kills a rank; and every refused or failed operation says
what happened and what to do.  Run with `make qualify` (not part of `make test`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest

from bench.common import first_divergent_step
from pitstop.errors import PitstopError
from pitstop.proc import proctree
from pitstop.wire.coordinator_client import CoordinatorClient

from ..helpers import assert_same_as_reference, ddp_cmd, reference_hashes, wait_for_step
from ..test_coordinator_e2e import _wait_jobs, _wait_op
from ..test_store_failure_e2e import fill, small_tmpfs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
STEPS = 160


def _faults(spec: str) -> dict[str, str]:
    return {"PITSTOP_ENABLE_FAULTS": "1", "PITSTOP_FAULTS": spec}


class World:
    def __init__(self, cluster, tmp_path, *, coord: str = "", agents: dict[str, str] | None = None,
                 spare: bool = True, spare_images=None, coord_env: dict[str, str] | None = None) -> None:
        self.c, self.tmp = cluster, tmp_path
        self.port = None
        cluster.start_coordinator(env={**(_faults(coord) if coord else {}), **(coord_env or {})} or None)
        self.port = int(cluster.coordinator_url.rsplit(":", 1)[1])
        agents = agents or {}
        for name in ("host-a", "host-b", *(["spare-1"] if spare else [])):
            cluster.start_agent(name, spare=name.startswith("spare"),
                                env=_faults(agents[name]) if name in agents else None,
                                image_dir=spare_images if name == "spare-1" else None)
        self.cc = CoordinatorClient(cluster.coordinator_url, cluster.operator_token)
        self.out = tmp_path / "out"
        # --trace-params: a digest of the parameters after every step, so that a wrong final state
        # says at which step the ranks parted (the README's open correctness issue)
        self.ranks = cluster.start_job("train", ddp_cmd(self.out, steps=STEPS) + ["--trace-params"], 2,
                                       {0: "host-a", 1: "host-b"})
        _wait_jobs(self.cc, "train", 2)
        wait_for_step(self.ranks[1].log, 10)

    def evacuate(self, **kw):
        return self.cc.evacuate("host-b", **kw)

    def until_phase(self, op, phase):
        return _wait_op(self.cc, op["name"], timeout=120, until=lambda o: o["metadata"]["phase"] == phase)

    def restart_coordinator(self):
        os.killpg(self.c.coordinator_proc.pid, signal.SIGKILL)
        self.c.coordinator_proc.wait(10)
        self.c.start_coordinator(port=self.port)

    def kill_agent(self, name):
        os.killpg(self.c.agents[name].proc.pid, signal.SIGKILL)
        self.c.agents[name].proc.wait(10)

    def restart_agent(self, name):
        a = self.c.agents[name]
        self.kill_agent(name)
        self.c.start_agent(name, spare=name.startswith("spare"), port=int(a.url.rsplit(":", 1)[1]))

    def finished_intact(self) -> str:
        codes = [r.proc.wait(240) for r in self.ranks]
        assert codes == [0, 0], {r.rank: r.log.read_text(errors="replace")[-1200:] for r in self.ranks}
        try:
            assert_same_as_reference(self.out, reference_hashes(self.tmp, 2, steps=STEPS))
        except AssertionError as e:
            step = first_divergent_step([r.log for r in self.ranks])
            raise AssertionError(f"{e}; the ranks' parameters first differ after step {step} "
                                 f"(None: never during the run)") from None
        job = next(j for j in self.cc.jobs() if j["job"] == "train")
        hosts = {w["rank"]: w["host"] for w in job["workers"]}
        return f"job finished bitwise equal, rank 1 on {hosts[1]}"


def _failed(op) -> str:
    assert op["metadata"]["result"] == "failed", op
    err = op["error"]
    assert err.get("message") and err.get("details"), err
    d = err["details"][0]
    assert not (d.get("metadata") or {}).get("rollback_problems"), d
    return f"op failed: {err['message'][:160]}"


def test_transfer_cut_halfway(cluster, tmp_path, record):
    w = World(cluster, tmp_path, agents={"host-b": "transfer:cut_after=20000000"})
    op = _wait_op(w.cc, w.evacuate()["name"])
    msg = _failed(op)
    assert "transfer" in op["error"]["message"] or "cut" in op["error"]["message"]
    record("transfer cut after 20 MB", "rolled back; " + w.finished_intact(), msg)


def test_destination_agent_killed_mid_restore(cluster, tmp_path, record):
    w = World(cluster, tmp_path, agents={"spare-1": "restore:before_criu=sleep:8"})
    op = w.until_phase(w.evacuate(), "restore")
    time.sleep(1)
    w.kill_agent("spare-1")
    op = _wait_op(w.cc, op["name"])
    msg = _failed(op)  # no rollback problem: the job is whole on host-b
    assert "spare-1 could not be cleaned up" in op["error"]["message"], op["error"]
    assert "removes the images of this move when it starts" in op["error"]["details"][0]["action"], op["error"]
    record("destination agent killed mid-restore", "rolled back; " + w.finished_intact(),
           msg + " ... " + op["error"]["message"].split("; rolled back, ")[-1][:120])


def test_restore_finishing_after_the_coordinator_gave_up(cluster, tmp_path, record):
    w = World(cluster, tmp_path, agents={"spare-1": "restore:before_register=sleep:6"},
              coord_env={"PITSTOP_COORDINATOR_STEP_TIMEOUT_S": "3"})
    op = _wait_op(w.cc, w.evacuate()["name"])
    msg = _failed(op)
    copy = cluster.agents["spare-1"].client().worker("train.1")
    assert copy.state == "lost" and not proctree.exists(copy.root_pid), copy
    record("a restore finishing after the coordinator gave up on it (registered after the rollback looked)",
           "its copy stopped silently by the rollback's discard; " + w.finished_intact(),
           msg + " ... copy: " + (copy.reason or "")[:100])


def test_source_stops_serving_mid_fill(cluster, tmp_path, record):
    w = World(cluster, tmp_path, agents={"host-b": "postcopy:stop_after_pages=2000,postcopy:faults_from=commit,"
                                                   "postcopy:after_reply=sleep:0.01"})
    op = _wait_op(w.cc, w.evacuate(post_copy=True)["name"])
    assert op["metadata"]["result"] == "failed" and op["metadata"]["committed"], op
    assert op["error"]["details"][0]["reason"] == "fill_failed", op["error"]
    copy = cluster.agents["spare-1"].client().worker("train.1")
    assert copy.state == "lost" and not proctree.exists(copy.root_pid), copy
    log = cluster.agents["spare-1"].log.read_text(errors="replace")
    assert "code=-11" not in log and "code=-7" not in log  # killed, never ran on zeros
    w.ranks[0].proc.terminate()  # the job's own recovery from here
    record("network post-copy: the source stops serving mid-fill (after the commit)",
           "op failed (fill_failed) after the commit; the moved rank killed before any page read as zero; "
           "the job's own recovery takes over", op["error"]["message"][:200])


def test_corrupt_image_at_destination(cluster, tmp_path, record):
    w = World(cluster, tmp_path, agents={"spare-1": "image:corrupt=1"})
    op = _wait_op(w.cc, w.evacuate()["name"])
    msg = _failed(op)
    assert "differs from the manifest" in op["error"]["message"] or "manifest" in op["error"]["message"]
    record("image corrupted at rest on the destination", "refused before restore; " + w.finished_intact(), msg)


def test_destination_disk_full(cluster, tmp_path, record):
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)], check=True)
    try:
        w = World(cluster, tmp_path, spare_images=mnt)
        op = _wait_op(w.cc, w.evacuate()["name"])
        msg = _failed(op)
        # refused before a byte is written where the size is known ahead, else ENOSPC mid-write
        assert "not enough space" in op["error"]["message"] or "No space left" in op["error"]["message"], op["error"]
        record("destination disk full (48 MiB tmpfs)", "rolled back; " + w.finished_intact(), msg)
        cluster.stop_agent("spare-1")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_coordinator_database_full_during_the_capture(cluster, tmp_path, record):
    """The coordinator's SQLite file system fills while a rank is being captured: the move is
    undone on the agents at once, the API answers 503 while full, the record follows the space."""
    with small_tmpfs(tmp_path / "db") as fs:
        cluster.coordinator_db = fs / "coordinator.db"
        w = World(cluster, tmp_path, agents={"host-b": "capture:before_dump=sleep:8"},
                  coord_env={"PITSTOP_COORDINATOR_WATCHDOG_S": "1"})
        op = w.until_phase(w.evacuate(), "capture")
        peer = cluster.agents["host-a"].client()
        filler = fill(cluster.coordinator_db)
        try:
            r = httpx.post(f"{cluster.coordinator_url}/v1/{op['name']}:cancel",
                           headers={"Authorization": f"Bearer {cluster.operator_token}"}, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "database_unavailable", r.text
            end = time.monotonic() + 60
            while peer.worker("train.0").state != "running":
                assert time.monotonic() < end, "the paused peer was not resumed while the database was full"
                time.sleep(0.2)
        finally:
            filler.unlink()
        op = _wait_op(w.cc, op["name"], timeout=60)
        msg = _failed(op)
        assert op["error"]["details"][0]["reason"] == "database_unavailable", op["error"]
        record("coordinator's database full during the capture (16 MiB tmpfs)",
               "rolled back while full (peer resumed), API 503 while full, recorded once space was back; "
               + w.finished_intact(),
               f"{msg} ... API: {r.json()['error']['action'][:80]}")
        os.killpg(cluster.coordinator_proc.pid, signal.SIGTERM)  # before its file system goes
        cluster.coordinator_proc.wait(30)


def test_worker_dies_during_the_freeze(cluster, tmp_path, record):
    w = World(cluster, tmp_path, agents={"host-b": "capture:before_dump=sleep:4"})
    op = w.until_phase(w.evacuate(), "capture")
    pid = cluster.agents["host-b"].client().worker("train.1").root_pid
    os.kill(pid, signal.SIGKILL)
    op = _wait_op(w.cc, op["name"])
    assert op["metadata"]["result"] == "failed" and op["error"]["message"]
    assert "ROLLBACK INCOMPLETE" not in op["error"]["message"], op["error"]["message"]
    # The fault killed a rank: the job cannot finish.  pitstop's part is that the surviving rank
    # is not left stopped.  Whether it then notices its dead peer is gloo's business: mostly it
    # raises at once, but about one run in fifteen it waits in the allreduce for gloo's own
    # timeout (30 min by default), running, with no connection to the peer left (seen with
    # py-spy and ss, 2026-11-29).
    survivor = cluster.agents["host-a"].client().worker("train.0")
    assert survivor.state == "running", survivor
    assert proctree.state(survivor.root_pid) not in ("T", "t"), "the surviving rank was left stopped"
    try:
        code0 = w.ranks[0].proc.wait(30)
        how = f"exited on its own (code {code0}): gloo saw its dead peer"
    except subprocess.TimeoutExpired:
        how = "still running, waiting in gloo for its dead peer (gloo's own timeout ends it)"
        proctree.kill_and_wait(survivor.root_pid)  # the test ends it; its launcher then exits
        w.ranks[0].proc.wait(30)
    record("a worker dies during the freeze", "op failed; the surviving rank was resumed and " + how,
           f"op failed: {op['error']['message'][:160]}")


@pytest.mark.parametrize("phase", ["precopy", "pause", "capture", "verify", "release", "restore", "commit", "resume"])
def test_coordinator_restarted_in_each_phase(cluster, tmp_path, record, phase):
    w = World(cluster, tmp_path, coord=f"phase:{phase}=sleep:6")
    op = w.until_phase(w.evacuate(), phase)
    w.restart_coordinator()
    op = _wait_op(w.cc, op["name"])
    before_commit = phase not in ("commit", "resume")
    want = "failed" if before_commit else "succeeded"
    assert op["metadata"]["result"] == want, op.get("error")
    how = "rolled back on restart" if before_commit else "finished on restart (past the commit point)"
    record(f"coordinator restarted in phase {phase}", f"{how}; " + w.finished_intact(),
           (op.get("error") or {}).get("message", "succeeded")[:160])


def test_source_agent_restarted_during_capture(cluster, tmp_path, record):
    w = World(cluster, tmp_path, agents={"host-b": "capture:before_dump=sleep:6"})
    op = w.until_phase(w.evacuate(), "capture")
    time.sleep(1)
    w.restart_agent("host-b")
    op = _wait_op(w.cc, op["name"])
    assert op["metadata"]["result"] == "failed"
    caps = cluster.agents["host-b"].client().captures()
    assert caps and caps[-1].state == "failed" and caps[-1].error["code"] == "agent_restarted"
    record("source agent restarted during the capture (the host comes back mid-move)",
           "op failed, worker resumed by the restarted agent; " + w.finished_intact(),
           f"op: {op['error']['message'][:100]}; agent: {caps[-1].error['message'][:100]}")


def test_source_agent_restarted_during_the_pre_copy(cluster, tmp_path, record):
    """The pre-copy's call breaks with the agent, which is still starting when the coordinator
    checks on it: the operation ends before anything pauses."""
    w = World(cluster, tmp_path, agents={"host-b": "precopy:before_read=sleep:6"})
    op = w.until_phase(w.evacuate(), "precopy")
    time.sleep(1)
    w.restart_agent("host-b")
    op = _wait_op(w.cc, op["name"])
    msg = _failed(op)
    assert "nothing was paused" in op["error"]["message"] and not op["metadata"]["paused"]
    spare = cluster.agents["spare-1"]
    assert not any(p.name.startswith("in-") for p in spare.image_dir.iterdir())
    record("source agent restarted during the pre-copy", "op failed before the pause; " + w.finished_intact(),
           msg)


def test_replacement_dies_right_after_commit(cluster, tmp_path, record):
    w = World(cluster, tmp_path, coord="phase:resume=sleep:4")
    op = w.until_phase(w.evacuate(), "resume")
    wk = cluster.agents["spare-1"].client().worker("train.1")
    os.kill(wk.root_pid, signal.SIGKILL)
    op = _wait_op(w.cc, op["name"])
    assert op["metadata"]["result"] == "succeeded"
    cond = {c["type"]: c for c in op["metadata"]["conditions"]}["ReplacementsRunning"]
    assert cond["status"] == "False" and "train.1" in cond["message"] and "restart the job" in cond["message"]
    # Rank 0 now fails or blocks in gloo until its own timeout: the job's recovery, not pitstop's.
    w.ranks[0].proc.terminate()
    record("the replacement dies right after the commit", "op succeeded with condition "
           "ReplacementsRunning=False; the job's own recovery takes over", cond["message"][:200])


def test_concurrent_evacuations_of_one_node(cluster, tmp_path, record):
    w = World(cluster, tmp_path, coord="phase:capture=sleep:3")
    op = w.evacuate()
    with pytest.raises(PitstopError) as e:
        w.evacuate()
    assert e.value.http_status == 409 and op["name"].split("/")[1] in e.value.message
    op = _wait_op(w.cc, op["name"])
    assert op["metadata"]["result"] == "succeeded"
    record("a second evacuation of the same node", "409, first one finishes; " + w.finished_intact(),
           e.value.message[:160])


def test_no_compatible_spare(cluster, tmp_path, record):
    w = World(cluster, tmp_path, spare=False)
    with pytest.raises(PitstopError) as e:
        w.evacuate()
    assert e.value.http_status == 412 and e.value.code == "no_compatible_spare" and e.value.action
    assert w.cc.ops() == []
    record("no compatible spare", "412, nothing paused or changed; " + w.finished_intact(),
           f"{e.value.message[:100]} -> {e.value.action[:80]}")


def test_wrong_or_missing_tokens(cluster, tmp_path, record):
    w = World(cluster, tmp_path)
    url = cluster.coordinator_url
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{url}/v1/nodes/host-b:evacuate", json={}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["action"]
    agent = cluster.agents["host-b"].url
    r = httpx.post(f"{agent}/v1/captures", json={"worker_id": "train.1"}, headers={"Authorization": "Bearer x"})
    assert r.status_code == 401
    assert w.cc.ops() == [] and cluster.agents["host-b"].client().captures() == []
    record("wrong or missing tokens (operator API, agent API)", "401, nothing changed; " + w.finished_intact(),
           r.json()["error"]["message"][:160])


def test_rank_that_never_reaches_the_cut(cluster, tmp_path, record):
    from ..test_shim_e2e import _evacuate as nccl_evacuate
    from ..test_shim_e2e import _start, reference

    cc, ranks, out = _start(cluster, tmp_path, "nccl_dp.py",
                            extra=("--stall-rank", "1", "--stall-at", "40", "--stall-seconds", "8"),
                            coord_env={"PITSTOP_COORDINATOR_CUT_DEADLINE_S": "2"})
    wait_for_step(ranks[1].log, 40)
    op = nccl_evacuate(cc, "host-b")
    assert op["metadata"]["result"] == "failed" and op["error"]["details"][0]["reason"] == "cut_failed"
    assert [r.proc.wait(180) for r in ranks] == [0] * 4
    assert [(out / f"rank{r}.sha256").read_text().strip() for r in range(4)] == reference("nccl_dp.py")
    record("a rank never reaches the consistent cut (NCCL job)", "cut deadline, released, job finished "
           "bitwise equal on its hosts", op["error"]["message"][:160])


def test_pid_clash_on_the_destination(cluster, tmp_path, record):
    """The spare already runs a worker whose PIDs, inside its namespace, are the very ones the
    arriving worker uses (every worker is PID 1 of its own namespace)."""
    import sys

    from ..helpers import WORKLOADS

    w = World(cluster, tmp_path)
    other = cluster.start_job("other", [sys.executable, str(WORKLOADS / "sleeper.py"), "120"], 1, {0: "spare-1"})
    _wait_jobs(w.cc, "other", 1)
    op = _wait_op(w.cc, w.evacuate()["name"])
    assert op["metadata"]["result"] == "succeeded", op.get("error")
    spare = cluster.agents["spare-1"].client()
    ours, theirs = spare.worker("train.1"), spare.worker("other.0")
    assert ours.state == "running" and theirs.state == "running" and ours.root_pid != theirs.root_pid
    outcome = w.finished_intact()
    other[0].proc.terminate()
    record("PID clash on the destination (another worker there with the same in-namespace PIDs)",
           "no clash: each restore gets a fresh PID namespace; " + outcome,
           f"pid 1 of both namespaces; host pids {ours.root_pid} and {theirs.root_pid}")


@pytest.mark.parametrize("phase", ["capture", "restore", "rewire"])
def test_coordinator_restarted_during_an_nccl_moves_early_rewire(cluster, tmp_path, record, phase):
    """An NCCL job's move, its ranks that stay re-creating their communicators from the capture
    on (the early rewire, coordinator/cut.py), the coordinator killed in `phase`: the restarted
    one rolls the move back from the operation's record, the sources joining the rebuild the
    ranks that stay began (or all re-created in place where restored ranks had the ids), and
    the job finishes bitwise equal to an uninterrupted run on its own hosts."""
    from ..helpers import let_finish, pace_file
    from ..test_shim_e2e import _start, reference

    pace_file(tmp_path / "out").write_text("0.05\n")  # until let_finish: the move must find it running
    # capture: the leaving ranks' dumps held, so that the coordinator dies with the rebuild begun;
    # later phases: the coordinator held as it enters them
    held = {"agent_env": {"host-b": _faults("capture:before_dump=sleep:6")}} if phase == "capture" else \
        {"coord_env": _faults(f"phase:{phase}=sleep:6")}
    cc, ranks, out = _start(cluster, tmp_path, "nccl_tp_dp.py", **held)
    wait_for_step(ranks[3].log, 20)
    op = _wait_op(cc, cc.evacuate("host-b")["name"], timeout=120,
                  until=lambda o: o["metadata"]["phase"] == phase and (phase != "capture" or
                                                                        (o["metadata"].get("cut") or {}).get("early_ids")))
    port = int(cluster.coordinator_url.rsplit(":", 1)[1])
    os.killpg(cluster.coordinator_proc.pid, signal.SIGKILL)
    cluster.coordinator_proc.wait(10)
    cluster.start_coordinator(port=port)
    cc = CoordinatorClient(cluster.coordinator_url, cluster.operator_token)
    op = _wait_op(cc, op["name"])
    cut = op["metadata"].get("cut") or {}
    assert op["metadata"]["result"] == "failed", op.get("error")
    assert not (op["error"]["details"][0].get("metadata") or {}).get("rollback_problems"), op["error"]
    let_finish(out)
    assert [r.proc.wait(240) for r in ranks] == [0] * 4
    assert [(out / f"rank{r}.sha256").read_text().strip() for r in range(4)] == reference("nccl_tp_dp.py")
    where = {w["id"]: w["host"] for j in cc.jobs() for w in j["workers"]}
    assert where["nccl.2"] == where["nccl.3"] == "host-b", where
    assert cut.get("early_ids"), cut  # the ranks that stay had begun their rebuild with recorded ids
    record(f"coordinator restarted in phase {phase} of an NCCL move, the early rewire begun",
           "rolled back on restart, the sources joining the rebuild begun; job finished bitwise equal on its hosts",
           op["error"]["message"][:160])
