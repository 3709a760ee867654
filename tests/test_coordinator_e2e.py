"""End to end through the coordinator's REST API and the `pitstop` CLI, all real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from pitstop.agent import exitkeeper
from pitstop.dev.devcluster import pitstop_cmd
from pitstop.errors import PitstopError
from pitstop.proc import proctree
from pitstop.wire.coordinator_client import CoordinatorClient

from .helpers import (
    WORKLOADS,
    assert_same_as_reference,
    ddp_cmd,
    let_finish,
    reference_hashes,
    step_times,
    until,
    wait_for_step,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
SLEEPER = [sys.executable, str(WORKLOADS / "sleeper.py"), "120"]


def _cluster(cluster, spare=True):
    cluster.start_coordinator()
    with cluster.starting():
        cluster.start_agent("host-a")
        cluster.start_agent("host-b")
        if spare:
            cluster.start_agent("spare-1", spare=True)
    return CoordinatorClient(cluster.coordinator_url, cluster.operator_token)


def _wait_jobs(cc, job, n, timeout=30):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        js = [j for j in cc.jobs() if j["job"] == job]
        if js and len([w for w in js[0]["workers"] if w["state"] == "running"]) == n:
            return js[0]
        time.sleep(0.1)
    raise TimeoutError(f"job {job} never showed {n} running workers: {cc.jobs()}")


def _wait_op(cc, name, timeout=240, until=lambda o: o["done"]):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        o = cc.op(name)
        if until(o):
            return o
        time.sleep(0.05)
    raise TimeoutError(f"{name} did not get there: {cc.op(name)}")


def _cli(cluster, *args, timeout=300):
    return subprocess.run([*pitstop_cmd(), *args], env=cluster.env(), capture_output=True, text=True,
                          timeout=timeout)


def test_demo_scenario_through_the_cli(cluster, tmp_path):
    cc = _cluster(cluster)
    out = tmp_path / "out"
    ranks = cluster.start_job("train", ddp_cmd(out, steps=120), 4,
                              {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"})
    _wait_jobs(cc, "train", 4)
    wait_for_step(ranks[2].log, 10)
    # Each rank's tree has pitstop's init at its root, working in a directory of its own (so the
    # two dumps on host-b start at once: nsinit.py), while the training works where it started.
    roots = {w.id: w.root_pid for a in ("host-a", "host-b") for w in cluster.agents[a].client().workers()}
    dirs = {wid: os.readlink(f"/proc/{pid}/cwd") for wid, pid in roots.items()}
    assert len(set(dirs.values())) == 4 and all(os.path.dirname(d) == str(cluster.root / "init") for d in dirs.values())
    assert os.readlink(f"/proc/{proctree.children(roots['train.2'])[0]}/cwd") == os.getcwd()
    p = _cli(cluster, "evacuate", "host-b", "--wait", "--json", "--idempotency-key", "k-1")
    assert p.returncode == 0, p.stderr
    op = json.loads(p.stdout)
    # AIP-151 shape.
    assert op["name"].startswith("operations/op-") and op["done"] is True and "error" not in op
    md = op["metadata"]
    assert md["node"] == "host-b" and md["destination"] == "spare-1" and md["result"] == "succeeded"
    assert set(md["phases"]) >= {"pause", "capture", "verify", "release", "restore", "commit", "resume"}
    # the ranks' memory went ahead while they trained; in the pause only what changed since (about 10 MB)
    assert md["pre_copy_bytes"] > 100_000_000 and md["bytes_total"] > 1_000_000
    assert md["bytes_done"] == md["bytes_total"]
    assert md["downtime_s"] > 0 and op["response"]["workers"] == ["train.2", "train.3"]
    # the pause round alone (first pause to every peer stopped) within the phase, which also holds
    # the shim check made while the job trained
    assert 0 < md["pause_round_s"] <= md["phases"]["pause"] + 0.01 and md["pause_round_s"] < md["downtime_s"]
    assert {c["type"] for c in md["conditions"] if c["status"] == "True"} >= {"Quiesced", "Restored", "Committed",
                                                                               "Succeeded"}
    # the pause each rank saw, as its agents timed it (gloo: SIGSTOP for the peers, the capture and
    # the restore for the leaving ranks, which stop after the peers and run again before them)
    entry = until(lambda: next((m for m in cc.moves() if m["operation"] == op["name"] and m["after_move"]), None),
                  what="the move's entry in the ledger")
    pauses = entry["rank_pause_s"]
    assert sorted(pauses) == [f"train.{r}" for r in range(4)], entry
    assert all(0 < p <= md["downtime_s"] + 0.05 for p in pauses.values()), (pauses, md["downtime_s"])
    assert max(pauses["train.2"], pauses["train.3"]) < min(pauses["train.0"], pauses["train.1"]), pauses
    # Retried with the same key and body: the same operation, no second evacuation.
    again = cc.evacuate("host-b", idempotency_key="k-1")
    assert again["name"] == op["name"]
    with pytest.raises(PitstopError) as e:  # same key, other body
        cc.evacuate("host-b", to="host-a", idempotency_key="k-1")
    assert e.value.http_status == 422 and "Idempotency-Key" in e.value.message
    moved = {w.id: w.root_pid for w in cluster.agents["spare-1"].client().workers()}
    assert {wid: os.readlink(f"/proc/{pid}/cwd") for wid, pid in moved.items()} == \
        {wid: dirs[wid] for wid in ("train.2", "train.3")}  # made again on the spare, the same for CRIU
    let_finish(out)
    assert [r.proc.wait(180) for r in ranks] == [0, 0, 0, 0]
    assert_same_as_reference(out, reference_hashes(tmp_path, 4, steps=120))
    assert not any((cluster.root / "init").iterdir())  # every init removed its directory at the end
    hosts = {h["name"]: h for h in cc.hosts()}
    assert hosts["spare-1"]["role"] == "active" and hosts["host-b"]["role"] == "drained"
    assert len(cc.ops()) == 1
    # Human output of the CLI, and Prometheus metrics on both kinds of service.
    p = _cli(cluster, "ops", op["name"])
    assert p.returncode == 0 and "downtime" in p.stdout and "capture" in p.stdout
    env = {k: v for k, v in cluster.env().items() if k != "PITSTOP_COORDINATOR"}  # the URL as an option instead
    p = subprocess.run([*pitstop_cmd(), "hosts", "--json", "--coordinator", cluster.coordinator_url], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and {h["name"] for h in json.loads(p.stdout)} >= {"host-a", "host-b", "spare-1"}
    m = httpx.get(cluster.coordinator_url + "/metrics").text
    assert 'pitstop_coordinator_operations_total{result="succeeded"} 1.0' in m
    assert "pitstop_coordinator_phase_duration_seconds_count{phase=\"capture\"} 1.0" in m
    assert "pitstop_coordinator_transferred_bytes_total" in m
    m = httpx.get(cluster.agents["spare-1"].url + "/metrics").text
    assert 'pitstop_agent_restores_total{result="ok"} 2.0' in m and "pitstop_agent_received_bytes_total" in m


def test_refusals_change_nothing(cluster, tmp_path):
    cc = _cluster(cluster, spare=False)
    cluster.start_job("idle", SLEEPER, 2, {0: "host-a", 1: "host-b"})
    _wait_jobs(cc, "idle", 2)
    # No spare at all: refused with the reason; nothing paused, no operation.
    with pytest.raises(PitstopError) as e:
        cc.evacuate("host-b")
    assert e.value.http_status == 412 and "no compatible spare" in e.value.message and "--spare" in e.value.action
    # Unknown hosts; a host to itself.
    with pytest.raises(PitstopError) as e:
        cc.evacuate("nope")
    assert e.value.http_status == 404
    with pytest.raises(PitstopError) as e:
        cc.evacuate("host-b", to="host-b")
    assert e.value.http_status == 400
    # Unauthenticated or wrongly authenticated mutations, and agents' endpoint with the operator token.
    url = cluster.coordinator_url
    assert httpx.post(f"{url}/v1/nodes/host-b:evacuate", json={"to": "host-a"}).status_code == 401
    assert httpx.post(f"{url}/v1/nodes/host-b:evacuate", json={"to": "host-a"},
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(f"{url}/v1/agents:heartbeat", json={"name": "evil", "url": "http://x"},
                      headers={"Authorization": f"Bearer {cluster.operator_token}"}).status_code == 401
    assert httpx.get(f"{url}/v1/hosts").status_code == 401
    assert cc.ops() == [] and "evil" not in {h["name"] for h in cc.hosts()}
    js = _wait_jobs(cc, "idle", 2)
    assert all(w["state"] == "running" for w in js["workers"])
    # The CLI says what is wrong and exits non-zero.
    p = _cli(cluster, "evacuate", "host-b", "--wait")
    assert p.returncode == 1 and "no compatible spare" in p.stderr and "what to do" in p.stderr


def _evacuating_a_training_job(cluster, tmp_path):
    """A 2-rank job (150 steps, 300 MB a rank) training on host-a and host-b, and the evacuation of
    host-b just started: the client, the job's output directory, its ranks, the operation."""
    cc = _cluster(cluster)
    out = tmp_path / "out"
    ranks = cluster.start_job("train", ddp_cmd(out, steps=150, state_mb=300), 2, {0: "host-a", 1: "host-b"})
    _wait_jobs(cc, "train", 2)
    wait_for_step(ranks[1].log, 5)
    return cc, out, ranks, cc.evacuate("host-b")


def test_concurrent_evacuation_is_409_and_cancel_rolls_back(cluster, tmp_path):
    cc, out, ranks, op = _evacuating_a_training_job(cluster, tmp_path)
    with pytest.raises(PitstopError) as e:
        cc.evacuate("host-b")
    assert e.value.http_status == 409 and op["name"].split("/")[1] in e.value.message
    cc.cancel(op["name"])
    o = _wait_op(cc, op["name"])
    assert o["metadata"]["result"] == "cancelled" and o["error"]["status"] == "CANCELLED"
    assert "keeps running on host-b" in o["error"]["details"][0]["action"]
    let_finish(out)
    assert [r.proc.wait(240) for r in ranks] == [0, 0]
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=150, state_mb=300))
    a = cluster.agents["host-b"].client()
    # Resumed in place, or (when the cancel came after the source was released) restored there
    # from its own images: either way it ran to its end on host-b.
    assert a.worker("train.1").state == "exited"
    assert not any(cluster.agents["spare-1"].image_dir.iterdir())
    with pytest.raises(PitstopError) as e:
        cc.cancel(op["name"])
    assert e.value.http_status == 409


def test_coordinator_killed_mid_operation_rolls_back_on_restart(cluster, tmp_path):
    cc, out, ranks, op = _evacuating_a_training_job(cluster, tmp_path)
    _wait_op(cc, op["name"], until=lambda o: o["metadata"]["phase"] == "capture")
    port = int(cluster.coordinator_url.rsplit(":", 1)[1])
    os.killpg(cluster.coordinator_proc.pid, signal.SIGKILL)
    cluster.coordinator_proc.wait(10)
    time.sleep(1)
    cluster.start_coordinator(port=port)
    o = _wait_op(cc, op["name"])
    assert o["metadata"]["result"] == "failed"
    assert o["error"]["details"][0]["reason"] == "coordinator_restarted"
    assert not o["error"]["details"][0].get("metadata", {}).get("rollback_problems")
    let_finish(out)
    assert [r.proc.wait(240) for r in ranks] == [0, 0]
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=150, state_mb=300))


def test_read_only_token_reads_but_never_mutates(cluster, monkeypatch):
    monkeypatch.setenv("PITSTOP_READ_TOKEN", "reader-token")
    cluster.start_coordinator()
    url = cluster.coordinator_url
    ro = {"Authorization": "Bearer reader-token"}
    assert httpx.get(f"{url}/v1/hosts", headers=ro).status_code == 200
    assert httpx.get(f"{url}/v1/operations", headers=ro).status_code == 200
    r = httpx.post(f"{url}/v1/nodes/any:evacuate", json={}, headers=ro)
    assert r.status_code == 403 and r.json()["error"]["code"] == "read_only_token"
    assert "PITSTOP_TOKEN" in r.json()["error"]["action"]
    assert httpx.post(f"{url}/v1/operations/op-x:cancel", headers=ro).status_code == 403
    assert httpx.get(f"{url}/v1/hosts", headers={"Authorization": "Bearer nope"}).status_code == 401
    op = {"Authorization": f"Bearer {cluster.operator_token}"}
    assert httpx.post(f"{url}/v1/nodes/any:evacuate", json={}, headers=op).status_code == 404  # passes auth


def _held_past_the_commit_point(cluster, tmp_path, monkeypatch, hold_s: int):
    """A 2-rank job on host-a and host-b; host-b evacuated, its operation held `hold_s` seconds
    by a fault just past the commit point: (client, ranks, output dir, operation) once it is there."""
    monkeypatch.setenv("PITSTOP_ENABLE_FAULTS", "1")
    monkeypatch.setenv("PITSTOP_FAULTS", f"after_commit_point=sleep:{hold_s}")
    cc = _cluster(cluster)
    monkeypatch.delenv("PITSTOP_FAULTS")  # the coordinator's only
    out = tmp_path / "out"
    ranks = cluster.start_job("train", ddp_cmd(out, steps=150), 2, {0: "host-a", 1: "host-b"})
    _wait_jobs(cc, "train", 2)
    wait_for_step(ranks[1].log, 5)
    op = cc.evacuate("host-b")
    _wait_op(cc, op["name"], until=lambda o: o["metadata"]["phase"] == "commit")
    return cc, ranks, out, op


def test_coordinator_killed_after_the_commit_point_finishes_on_restart(cluster, tmp_path, monkeypatch):
    """Past the commit point a restarted coordinator moves forward: the workers stay on the spare."""
    cc, ranks, out, op = _held_past_the_commit_point(cluster, tmp_path, monkeypatch, 30)
    port = int(cluster.coordinator_url.rsplit(":", 1)[1])
    os.killpg(cluster.coordinator_proc.pid, signal.SIGKILL)   # held by the fault, past the commit point
    cluster.coordinator_proc.wait(10)
    cluster.start_coordinator(port=port)                       # no fault this time
    o = _wait_op(cc, op["name"])
    assert o["metadata"]["result"] == "succeeded" and o["metadata"]["committed"], o.get("error")
    let_finish(out)
    assert [r.proc.wait(240) for r in ranks] == [0, 0]
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=150))
    assert cluster.agents["spare-1"].client().worker("train.1").exit_code == 0


def test_a_node_whose_agent_dies_past_the_commit_point_holds_up_nobody(cluster, tmp_path, monkeypatch):
    """The node being evacuated may be the failing one.  Once its workers run on the spare, the
    peers resume without asking it; what it must free (images, CRIU's network lock) is asked
    again when its agent reports.  (Before, the node's commit came before the resume: an agent
    gone at that moment held every peer paused, and after five retries left them so.)"""
    monkeypatch.setenv("PITSTOP_COORDINATOR_SOURCE_CLEANUP_DEADLINE_S", "2")
    monkeypatch.setenv("PITSTOP_COORDINATOR_SOURCE_CLEANUP_RETRY_S", "0.5")
    cc, ranks, out, op = _held_past_the_commit_point(cluster, tmp_path, monkeypatch, 3)  # a window to kill in
    node = cluster.agents["host-b"]
    port = int(node.url.rsplit(":", 1)[1])
    cluster.stop_agent("host-b", signal.SIGKILL)
    node.proc.wait(10)
    o = _wait_op(cc, op["name"], timeout=60)
    md = o["metadata"]
    assert md["result"] == "succeeded" and md["committed"], o.get("error")
    assert md["downtime_s"] < 3 + 10, md["phases"]  # the fault's 3 s, not the retries of a dead node
    assert o["response"]["source_cleanup_pending"] == ["train.1"], o["response"]
    cond = {c["type"]: c for c in md["conditions"]}
    assert cond["SourceCleaned"]["status"] == "False" and cond["SourceCleaned"]["reason"] == "NodeUnreachable"
    assert "host-b" in cond["SourceCleaned"]["message"] and "train.1" in cond["SourceCleaned"]["message"]
    seen = len(step_times(ranks[0].log))
    wait_for_step(ranks[0].log, seen + 5)  # the job goes on while the node's agent is down
    assert node.proc.poll() is not None
    cid = md["workers"]["train.1"]["capture_id"]
    back = cluster.start_agent("host-b", port=port)  # back: its first report brings the cleanup
    assert back.client().get_capture(cid).state in ("released", "committed")
    o = _wait_op(cc, op["name"], timeout=60, until=lambda o: not o["metadata"].get("source_cleanup_pending"))
    assert "source_cleanup_pending" not in o["response"], o["response"]
    assert {c["type"]: c["status"] for c in o["metadata"]["conditions"]}["SourceCleaned"] == "True"
    assert back.client().get_capture(cid).state == "committed"
    assert back.client().worker("train.1").state == "moved"
    let_finish(out)
    assert [r.proc.wait(240) for r in ranks] == [0, 0]  # rank 1's launcher follows its worker to the end
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=150))


def test_a_restored_worker_outlives_a_restart_of_its_agent(cluster, tmp_path):
    """Its stdio goes through pumps of its own (not the agent's threads, whose pipe ends died with
    the agent: the job's next print failed with EPIPE); the restarted agent adopts it."""
    ranks, out, spare, port = _one_rank_moved_to_the_spare(cluster, tmp_path)
    cluster.stop_agent("spare-1")
    steps = len(step_times(ranks[0].log))
    time.sleep(1.0)
    cluster.start_agent("spare-1", spare=True, port=port)
    w = next(w for w in spare.client().workers() if w.id == "train.0")
    assert w.state == "running" and w.restored, w
    _ends_with_its_status(cluster, ranks[0], out, tmp_path, steps)


def _one_rank_moved_to_the_spare(cluster, tmp_path):
    """A 1-rank job of 120 steps on host-b, evacuated to spare-1: (ranks, out, spare, its port)."""
    cc = _cluster(cluster)
    out = tmp_path / "out"
    ranks = cluster.start_job("train", ddp_cmd(out, steps=120), 1, {0: "host-b"})
    _wait_jobs(cc, "train", 1)
    wait_for_step(ranks[0].log, 10)
    op = _wait_op(cc, cc.evacuate("host-b")["name"])
    assert op["metadata"]["result"] == "succeeded", op
    spare = cluster.agents["spare-1"]
    return ranks, out, spare, int(spare.url.rsplit(":", 1)[1])


def _ends_with_its_status(cluster, rank, out, tmp_path, steps_before: int) -> None:
    """The adopted worker's exit status is read through its keeper (agent/exitkeeper.py): the
    agent that restarted is not its parent.  On a kernel that cannot tell a non-parent
    (before Linux 6.15) it is reported unknown, and `pitstop run` exits 255 saying so."""
    known = exitkeeper.supported()
    let_finish(out)
    assert rank.proc.wait(180) == (0 if known else 255)
    log = rank.log.read_text(errors="replace")
    assert len(step_times(rank.log)) == 120 > steps_before and "done rank=0 steps=120" in log, log[-1500:]
    assert ("exit status is unknown" in log) != known
    assert_same_as_reference(out, reference_hashes(tmp_path, 1, steps=120))
    w = next(w for w in cluster.agents["spare-1"].client().workers() if w.id == "train.0")
    if known:
        assert w.state == "exited" and w.exit_code == 0 and not w.reason, w
    else:
        assert w.state == "exited" and w.exit_code is None and "restarting" in w.reason, w


def test_a_restored_worker_that_ends_while_no_agent_runs_keeps_its_status(cluster, tmp_path):
    """Its agent is down from before the worker ends until after: only the keeper held its pidfd."""
    ranks, out, spare, port = _one_rank_moved_to_the_spare(cluster, tmp_path)
    w = next(w for w in spare.client().workers() if w.id == "train.0")
    cluster.stop_agent("spare-1")
    steps = len(step_times(ranks[0].log))
    let_finish(out)
    deadline = time.monotonic() + 180
    while proctree.is_running(w.root_pid, w.start_time):
        assert time.monotonic() < deadline, "the worker did not finish"
        time.sleep(0.2)
    cluster.start_agent("spare-1", spare=True, port=port)
    _ends_with_its_status(cluster, ranks[0], out, tmp_path, steps)


def test_a_restore_that_outlives_its_call_is_stopped_by_the_rollback(cluster, tmp_path):
    """The coordinator gave up on a restore (its call's deadline) and rolled back: the source
    runs rank 1 again.  The destination's restore had not registered its worker when the
    rollback looked, and did so just after: the rollback's discard must stop that copy, or the
    rank runs twice."""
    cluster.start_coordinator(env={"PITSTOP_COORDINATOR_STEP_TIMEOUT_S": "3"})
    with cluster.starting():
        cluster.start_agent("host-a")
        cluster.start_agent("host-b")
        spare = cluster.start_agent("spare-1", spare=True, env={"PITSTOP_ENABLE_FAULTS": "1",
                                                                "PITSTOP_FAULTS": "restore:before_register=sleep:6"})
    cc = CoordinatorClient(cluster.coordinator_url, cluster.operator_token)
    out = tmp_path / "out"
    ranks = cluster.start_job("train", ddp_cmd(out, steps=150), 2, {0: "host-a", 1: "host-b"})
    _wait_jobs(cc, "train", 2)
    wait_for_step(ranks[1].log, 5)
    op = _wait_op(cc, cc.evacuate("host-b")["name"])
    assert op["metadata"]["result"] == "failed", op
    w = spare.client().worker("train.1")  # registered after the rollback looked ...
    assert w.state == "lost" and "rolled back" in w.reason, w
    assert not proctree.exists(w.root_pid)  # ... and stopped by its discard
    let_finish(out)
    assert [r.proc.wait(240) for r in ranks] == [0, 0]
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=150))


def test_a_spare_without_the_jobs_files_is_refused_before_anything_pauses(cluster, tmp_path):
    """The spare sees its own file system: here a tmpfs over the job's directory, in a mount
    namespace of its agent's (gone with the agent).  CRIU's restore there would fail after the
    pause; the check before the pause names what is missing, and the job never stops."""
    files = tmp_path / "job-files"
    files.mkdir()
    cluster.start_coordinator()
    with cluster.starting():
        cluster.start_agent("host-a")
        cluster.start_agent("spare-1", spare=True, wrap=[
            "unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount -t tmpfs none "$0" && exec "$@"',
            str(files)])
    cc = CoordinatorClient(cluster.coordinator_url, cluster.operator_token)
    # The job keeps a log open in its directory, as jobs do.
    ranks = cluster.start_job("f", ["sh", "-c", 'exec 3>>"$0/train.log"; exec "$@"', str(files), *SLEEPER], 1,
                              {0: "host-a"})
    before = _wait_jobs(cc, "f", 1)["workers"][0]
    # Asked first as a dry run (validate_only): the same refusal, and no operation.
    with pytest.raises(PitstopError) as e:
        cc.evacuate("host-a", validate_only=True)
    assert e.value.http_status == 412 and e.value.code == "destination_lacks_files", e.value
    assert f"{files}/train.log (missing)" in e.value.message and cc.ops() == []
    p = _cli(cluster, "evacuate", "host-a", "--dry-run")
    assert p.returncode == 1 and "train.log (missing)" in p.stderr and "same paths on spare-1" in p.stderr, p.stderr
    assert cc.ops() == []
    op = _wait_op(cc, cc.evacuate("host-a")["name"])
    err = op["error"]
    assert err["details"][0]["reason"] == "destination_lacks_files", err
    assert f"{files}/train.log (missing)" in err["message"] and "Nothing was paused" in err["message"], err
    assert "same paths on spare-1" in err["details"][0]["action"]
    assert "pause" not in op["metadata"]["phases"] and not op["metadata"].get("first_pause"), op["metadata"]
    after = _wait_jobs(cc, "f", 1)["workers"][0]
    assert (after["host"], after["state"]) == ("host-a", "running") and after["id"] == before["id"]
    assert proctree.exists(cluster.agents["host-a"].client().worker("f.0").root_pid)
    assert ranks[0].proc.poll() is None
    # The same job on a spare that has its files moves: the dry run says so first.
    with cluster.starting():
        cluster.start_agent("spare-2", spare=True)
    v = cc.evacuate("host-a", to="spare-2", validate_only=True)
    assert (v["destination"], v["workers"], v["jobs"], v["files"]) == \
        ("spare-2", ["f.0"], ["f"], {"checked": ["f.0"], "unchecked": []}), v
    p = _cli(cluster, "evacuate", "host-a", "--to", "spare-2", "--dry-run")
    assert p.returncode == 0 and "1 worker(s) of f would move to spare-2" in p.stdout, p.stdout + p.stderr
    assert "spare-2 has every file" in p.stdout and len(cc.ops()) == 1  # only the refused one
    op = _wait_op(cc, cc.evacuate("host-a", to="spare-2")["name"])
    assert op["metadata"]["result"] == "succeeded", op
