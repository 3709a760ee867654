"""The agent's snapshot routes (peers and the coordinator, TCP, cluster token): take a job's
snapshot here, keep a peer's replica, list and drop them, and the steps of a recovery (stop the
job's workers, restore them from a snapshot, send replicas to a spare, fence a returning host).
The work is agent/snapshots.py's; these only check and answer."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from pitstop.agent.agent import AgentDep
from pitstop.agent.peer_routes import auth, from_peers
from pitstop.wire import agent_requests

router = APIRouter(prefix="/v1", dependencies=[Depends(auth)])
peers = APIRouter(prefix="/v1", dependencies=[Depends(from_peers)])


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
    return agent.snapshots.take(req.job, req.number, req.ids, req.buddy_url, cut=req.cut, whole=req.whole)


@router.get("/snapshots")
def listing(agent: AgentDep, job: str | None = None) -> list[dict[str, Any]]:
    return agent.snapshots.listing(job)


@router.delete("/snapshots/{job}")
def drop(agent: AgentDep, job: str, keep: int | None = None) -> dict[str, Any]:
    return {"job": job, "dropped": agent.snapshots.drop(job, keep)}


@peers.post("/images/{image_id}:keepReplica")
def keep_replica(agent: AgentDep, image_id: str, req: agent_requests.KeepReplicaRequest) -> dict[str, Any]:
    return agent.snapshots.keep_replica(image_id, req.job, req.number, req.worker_id)


@router.post("/snapshots/{job}/{number}:restore")
def restore(agent: AgentDep, job: str, number: int, req: agent_requests.CheckFilesRequest) -> dict[str, Any]:
    """Roll the job's workers back to the snapshot here: from this host's own parts (survivors) or
    from the replicas kept here (a spare taking a lost host's ranks); they stay stopped until the
    coordinator resumes the whole job."""
    return agent.snapshots.restore(job, number, req.ids, req.side)


@router.post("/snapshots/{job}/{number}:checkFiles")
def check_files(agent: AgentDep, job: str, number: int, req: agent_requests.CheckFilesRequest) -> dict[str, Any]:
    """Whether the files these parts' workers write can be cut back to the snapshot; 412 saying
    which cannot.  Asked by a recovery before it stops anything."""
    return agent.snapshots.check_files(job, number, req.ids, req.side)


@router.post("/snapshots/{job}/{number}:sendReplicas")
def send_replicas(agent: AgentDep, job: str, number: int, req: agent_requests.SendReplicasRequest) -> dict[str, Any]:
    return agent.snapshots.send_replicas(job, number, req.ids, req.dest_url)


@router.post("/jobs/{job}:stopWorkers")
def stop_workers(agent: AgentDep, job: str, req: agent_requests.WorkersRequest) -> dict[str, Any]:
    return {"job": job, "stopped": agent.snapshots.stop(job, req.ids, "stopped for a rollback to a snapshot")}


@router.post("/jobs/{job}:fence")
def fence(agent: AgentDep, job: str, req: agent_requests.FenceRequest) -> dict[str, Any]:
    """The job recovered elsewhere while this host was away: its workers here end before anything
    else, and the epoch is kept so that they are never reported live again."""
    return agent.fencing.fence(job, req.epoch, req.reason)
