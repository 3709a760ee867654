"""What the coordinator's API takes: operators' requests and the agents' heartbeats.

The agents build their reports from these models (agent/heartbeat.py) and the coordinator
validates with them (coordinator/routes.py): one definition of the contract.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pitstop.wire.agent_requests import JOB_PATTERN


class SetRoleRequest(BaseModel):
    role: Literal["active", "spare"] = Field(description="spare: takes evacuated workers; active: runs jobs")


class CordonRequest(BaseModel):
    reason: str = Field("operator request", max_length=500, description="why the host is kept out of the spare pool")


class ClaimRequest(BaseModel):
    """An agent about to register a rank asks whether another host runs it already."""
    host: str = Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    job: str = Field(min_length=1, max_length=128, pattern=JOB_PATTERN)
    rank: int = Field(ge=0, le=10_000_000)
    owner_uid: int | None = Field(None, ge=0, le=2**32 - 1, description="the uid registering the rank (the "
                                  "job's owner once it is its first)")
    privileged: bool = Field(False, description="the caller is root or the agent's own user, who may add to any job")


class SignalJobRequest(BaseModel):
    signal: int = Field(ge=1, le=64, description="the signal's number (15: SIGTERM, 9: SIGKILL)")


class EvacuateRequest(BaseModel):
    to: str | None = Field(None, description="host to move the workers to; default: a compatible spare")
    reason: str = Field("operator request", max_length=500)
    post_copy: bool | None = Field(
        None, description="network post-copy: only the pages a restore must place travel before the job "
        "resumes; the rest follow from the node afterwards, and the operation (and the node, `draining`) "
        "stays open until they have.  Shortest pause; the node must stay up until the operation is done. "
        "Default: the coordinator's PITSTOP_COORDINATOR_POST_COPY (off)")
    pre_copy: bool | None = Field(
        None, description="pre-copy: the leaving workers' memory is sent while the job still runs, and only "
        "what changed travels during the pause.  Skipped for a move with network post-copy; a pre-copy "
        "that fails only makes the move send everything.  Default: PITSTOP_COORDINATOR_PRE_COPY")
    validate_only: bool = Field(
        False, description="check the request as far as can be without moving anything (AIP-163): the "
        "host, the spare it would get, post-copy support, and whether that spare has every file the "
        "leaving workers use; answers 200 with the plan, or the refusal the request would get.  Creates "
        "no operation and pauses nothing")


class WorkerReport(BaseModel):
    """One worker as its agent reports it; fields beyond these are kept as they come."""

    model_config = ConfigDict(extra="allow")
    id: str = Field(min_length=1, max_length=200)
    job: str = Field(min_length=1, max_length=128)
    rank: int = Field(ge=0, le=10_000_000)
    state: str = Field(min_length=1, max_length=32)
    caps: str | None = Field(None, pattern=r"^[0-9a-f]{1,16}$",
                             description="capabilities a restore must grant it (hex; proc/caps.py)")
    unmovable: str | None = Field(None, max_length=1000,
                                  description="why it cannot be moved, as its NCCL shim knows; None: movable")
    slurm_job: str | None = Field(None, max_length=64, description="the Slurm job whose task started it")
    snapshot_every_s: float | None = Field(None, ge=0, le=7 * 86400.0,
                                           description="the snapshot interval its launcher asked for (seconds)")
    owner_uid: int | None = Field(None, ge=0, le=2**32 - 1, description="the user whose rank it is (who registered it)")
    peer_lost: str | None = Field(None, max_length=1000,
                                  description="its NCCL shim holds a communicator error back after a peer's failure, "
                                              "for the job's recovery (or held it, and gave it to the program)")


class SnapshotPolicyRequest(BaseModel):
    every_s: float | None = Field(..., ge=0, le=7 * 86400.0,
                                  description="seconds between the job's snapshots; 0: none; null: as its ranks' "
                                              "`pitstop run --snapshot-every` asked")


class Heartbeat(BaseModel):
    name: str = Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    url: str = Field(max_length=2048, pattern=r"^https?://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?/?$",
                     description="how peers and the coordinator reach this agent: http(s)://HOST:PORT")
    spare: bool = False
    slurm_node: str | None = Field(None, max_length=253, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                                   description="the Slurm node this host is (`pitstop agent --slurm-node`)")
    failure_domain: str | None = Field(None, max_length=253, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
                                       description="what this host fails together with (`pitstop agent "
                                                   "--failure-domain`): snapshot replicas are kept outside it")
    socket: str | None = Field(None, max_length=4096, pattern=r"^/",
                               description="the agent's local socket on its host: what a process there, such as "
                                           "`pitstop hold` started by the Slurm watcher, is given as --agent")
    workers: list[WorkerReport] = Field(default_factory=list)
    gpus: list[dict[str, Any]] = Field(default_factory=list)
    gpu_model: str | None = None
    gpu_count: int = Field(0, ge=0, le=4096)
    gpu_note: str = ""
    driver: str | None = None
    cap_bnd: str | None = Field(None, pattern=r"^[0-9a-f]{1,16}$",
                                description="the agent's capability bounding set (hex): what it can give a "
                                            "restored worker")
    gpu_health: list[dict[str, Any]] = Field(default_factory=list, description="NVML readings, one per GPU")
    coordinator_term: int | None = Field(None, ge=0, le=2**62, description="the highest coordinator term this "
                                         "agent has seen: a leader whose database holds less (a new or restored "
                                         "database) moves its lease above it")
    generation: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9._-]+$",
                                   description="names this report; later beats that carry it mean 'nothing "
                                               "changed but GPU health' (POST /v1/agents:beat)")


class Beat(BaseModel):
    """Between full reports: 'alive, and what I reported as `generation` still holds'."""

    name: str = Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    generation: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    gpu_health: list[dict[str, Any]] | None = Field(
        None, max_length=4096, description="present only when a reading changed enough to matter")
