"""The agent's snapshot routes (peers and the coordinator, TCP, cluster token): take a job's
snapshot here, keep a peer's replica, list and drop them, and the steps of a recovery (stop the
job's workers, restore them from a snapshot, send replicas to a spare, fence a returning host).
The work is agent/snapshots.py's; these only check and answer."""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import APIRouter, Depends

from pitstop.agent.agent import AgentDep
from pitstop.agent.peer_routes import auth
from pitstop.agent.snapshots import files_of
from pitstop.errors import PitstopError
from pitstop.network import workerns
from pitstop.proc import written_files
from pitstop.transfer.manifest import Manifest
from pitstop.wire import agent_requests

router = APIRouter(prefix="/v1", dependencies=[Depends(auth)])


@router.post("/snapshots:check")
def check(agent: AgentDep, req: agent_requests.SnapshotRequest) -> dict[str, Any]:
    """Whether these workers can be snapshotted, asked before the job pauses."""
    agent.snapshots.check(req.job, req.ids, cut=req.cut)
    return {"ok": True}


@router.post("/snapshots/{job}:lockNetwork")
def lock_network(agent: AgentDep, job: str, req: agent_requests.SnapshotWorkersRequest) -> dict[str, Any]:
    agent.snapshots.lock_net(job, req.ids, req.locked, cut=req.cut)
    return {"job": job, "locked": req.locked}


@router.post("/snapshots")
def take(agent: AgentDep, req: agent_requests.SnapshotRequest) -> dict[str, Any]:
    return agent.snapshots.take(req.job, req.number, req.ids, req.buddy_url, cut=req.cut)


@router.get("/snapshots")
def listing(agent: AgentDep, job: str | None = None) -> list[dict[str, Any]]:
    return agent.snapshots.listing(job)


@router.delete("/snapshots/{job}")
def drop(agent: AgentDep, job: str, keep: int | None = None) -> dict[str, Any]:
    return {"job": job, "dropped": agent.snapshots.drop(job, keep)}


@router.post("/images/{image_id}:keepReplica")
def keep_replica(agent: AgentDep, image_id: str, req: agent_requests.KeepReplicaRequest) -> dict[str, Any]:
    return agent.snapshots.keep_replica(image_id, req.job, req.number, req.worker_id)


@router.post("/snapshots/{job}/{number}:restore")
def restore_own(agent: AgentDep, job: str, number: int, req: agent_requests.WorkersRequest) -> dict[str, Any]:
    return agent.snapshots.restore_own(job, number, req.ids)


@router.post("/snapshots/{job}/{number}:checkFiles")
def check_files(agent: AgentDep, job: str, number: int, req: agent_requests.CheckFilesRequest) -> dict[str, Any]:
    """Whether the files these parts' workers write can be cut back to the snapshot; 412 saying
    which cannot.  Asked by a recovery before it stops anything."""
    return agent.snapshots.check_files(job, number, req.ids, req.side)


@router.post("/snapshots/{job}/{number}:sendReplicas")
def send_replicas(agent: AgentDep, job: str, number: int, req: agent_requests.SendReplicasRequest) -> dict[str, Any]:
    return agent.snapshots.send_replicas(job, number, req.ids, req.dest_url, req.prefix)


@router.post("/images/{image_id}:restorePaused")
def restore_sent(agent: AgentDep, image_id: str) -> dict[str, Any]:
    """A replica sent here by its keeper: restored as a move's image is, then held paused with the
    rest of the job until the coordinator resumes it."""
    d = agent.dest.slot(image_id).directory
    m = Manifest.read(d)
    cut = written_files.cut_back(files_of(d))  # refused before the restore where a file cannot be matched
    net = workerns.from_dict(m.net)
    mine = agent.state.workers.get(str(m.worker.get("id")))
    # Its namespace's name is taken on this machine by a copy this agent does not run: its old
    # host's, alive but cut off, on a machine shared by several agents (a testbed).
    netns = f"{net.netns[:40]}-{secrets.token_hex(3)}" if net and workerns.exists(net) and not (
        mine and mine.net and mine.net.get("netns") == net.netns) else None
    try:
        w, phases = agent.dest.restore_image(image_id, netns=netns)
    except PitstopError:
        agent.metrics.restores.labels("failed").inc()
        raise
    agent.metrics.restores.labels("ok").inc()
    every = m.worker.get("snapshot_every_s")
    if every:
        agent.state.update_worker(w, snapshot_every_s=float(every))
    agent.snapshots.paused(w)
    return {"worker": w.model_dump(), "phases": phases, "files_cut_back": cut}


@router.post("/jobs/{job}:stopWorkers")
def stop_workers(agent: AgentDep, job: str, req: agent_requests.WorkersRequest) -> dict[str, Any]:
    return {"job": job, "stopped": agent.snapshots.stop(job, req.ids, "stopped for a rollback to a snapshot")}


@router.post("/jobs/{job}:fence")
def fence(agent: AgentDep, job: str, req: agent_requests.FenceRequest) -> dict[str, Any]:
    """The job recovered elsewhere while this host was away: its workers here end before anything
    else, and the epoch is kept so that they are never reported live again."""
    return agent.snapshots.fence(job, req.epoch, req.reason)
