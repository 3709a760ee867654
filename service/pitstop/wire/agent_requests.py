"""What the agent's API takes: the requests its peers, the coordinator and `pitstop run` send.

One home for the models both sides use: the agent validates with them (agent/peer_routes.py, local_routes.py) and the
clients build their bodies from them (wire/agent_client.py), so a field renamed on one side is a
failure in a test, not a 422 in production.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError

from pitstop.errors import InvalidRequest
from pitstop.proc import files


def body(model: type[BaseModel], **fields: Any) -> dict[str, Any]:
    """A request body built and checked as the agent will check it: a bad value is refused in the
    caller's process, in the agent's own words (httpapi.py), before anything is sent."""
    try:
        return model(**fields).model_dump(mode="json")
    except ValidationError as e:
        problems = [f"{'.'.join(str(x) for x in err.get('loc', ()))}: {err.get('msg')}" for err in e.errors()]
        raise InvalidRequest("invalid request: " + "; ".join(problems), action="fix the request and send it again",
                             details={"problems": problems}) from None


JOB_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
"""A job's name: it names directories on every host (a job's snapshots), so never `.` or `..`."""
WORKER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*\.[0-9]+$"
"""A worker's id: its job's name, a dot, its rank."""
JOB_NAME_MAX = 128
JobName = Annotated[str, Field(min_length=1, max_length=JOB_NAME_MAX, pattern=JOB_PATTERN)]
WorkerId = Annotated[str, Field(min_length=3, max_length=200, pattern=WORKER_PATTERN)]
WorkerIds = Annotated[list[WorkerId], Field(min_length=1, max_length=4096)]

MIN_SNAPSHOT_EVERY_S = 5.0  # a snapshot pauses the whole job: more often than this is a stall, not a safeguard
MAX_SNAPSHOT_EVERY_S = 7 * 86400.0


class SnapshotRequest(BaseModel):
    job: JobName
    number: int = Field(ge=1, le=2**62)
    ids: WorkerIds = Field(description="the job's workers on this agent")
    buddy_url: str | None = Field(None, description="the agent that keeps a replica of this host's parts")
    cut: bool = Field(False, description="the job is parked at the NCCL shim's cut, its communicators destroyed: "
                                         "workers without an address of their own may be taken too")
    whole: bool = Field(False, description="dump every part whole, none as a delta: the buddy is new and holds "
                                           "none of the parts a delta would be against")


class SnapshotWorkersRequest(BaseModel):
    ids: WorkerIds = Field(description="the job's workers on this agent")
    locked: bool = True
    cut: bool = False


class KeepReplicaRequest(BaseModel):
    job: JobName
    number: int = Field(ge=1, le=2**62)
    worker_id: WorkerId


class SendReplicasRequest(BaseModel):
    ids: WorkerIds
    dest_url: str = Field(min_length=8, max_length=2048, description="the spare that restores them")


class CheckFilesRequest(BaseModel):
    ids: WorkerIds
    side: Literal["own", "replica"] = "own"


class TermRequest(BaseModel):
    """A coordinator that took the lease, announcing its term (coordinator/leadership.py)."""

    term: int = Field(ge=1, le=2**62, description="the lease's term: only grows")
    leader: str = Field("", max_length=2048, description="the URL of the coordinator that leads in it")


class FenceRequest(BaseModel):
    job: JobName
    epoch: int = Field(ge=1, le=2**62, description="the recovery that fenced this host's workers of the job")
    reason: str = Field("", max_length=1000)


class CaptureRequest(BaseModel):
    worker_id: str
    dest_url: str | None = Field(None, description="peer agent to stream the images to, while dumping")
    image_id: str | None = None
    keep_peers: list[str] | None = Field(None, description="addresses of the job's workers: the worker's "
                                         "connections to any other address are reset at the destination")
    post_copy: bool | None = Field(None, description="send only the pages a restore must place; the "
                                   "destination fetches the rest after the job resumes.  Not given: no "
                                   "(the coordinator decides each move's and always says)")


class PreCopyRequest(BaseModel):
    worker_id: str
    dest_url: str = Field(..., description="the peer agent the move will go to")
    image_id: str = Field(..., description="the image id the move's capture will use")
    post_copy: bool | None = Field(None, description="what the move will ask; with network post-copy "
                                   "nothing is pre-copied")


class ShimOp(BaseModel):
    op: Literal["quiesce", "targets", "command"]
    gen: int = Field(0, ge=0, le=2**31 - 1)
    targets: dict[str, dict[str, Any]] = Field(default_factory=dict)
    command: Literal["destroy", "genids", "rebuild", "resume", "release", "trim", "prebuild", "makeids"] = "release"
    ids: dict[str, str] = Field(default_factory=dict, description="rebuild, prebuild: each communicator's new unique "
                                "id by its key; makeids: the communicators to make fresh ids for, each key with "
                                "the rank of the member that makes it")


class CommitRequest(BaseModel):
    moved_to: dict[str, str] = Field(default_factory=dict)


class RegisterRequest(BaseModel):
    job: JobName
    rank: int = Field(ge=0, le=10_000_000)
    pid: int = Field(ge=1, le=2**22, description="the worker's root; with `container`, the caller itself, as its "
                                               "container numbers it")
    address: str | None = Field(None, description="the worker's own address, prepared with POST /v1/networks")
    container: bool = Field(False, description="the caller is `pitstop run` inside a container: the worker is the "
                                               "container (launcher/incontainer.py)")
    world: int | None = Field(None, ge=1, le=10_000_000, description="the job's number of ranks, where known")
    slurm_job: str | None = Field(None, max_length=64, pattern=r"^[0-9]+(_[0-9]+)?(\+[0-9]+)?$",
                                  description="the Slurm job whose task started it (SLURM_JOB_ID)")
    snapshot_every_s: float | None = Field(None, ge=MIN_SNAPSHOT_EVERY_S, le=MAX_SNAPSHOT_EVERY_S,
                                           description="`pitstop run --snapshot-every`: the job's snapshot interval, "
                                                       "seconds (the smallest any rank gives wins)")


class SignalRequest(BaseModel):
    signal: int = Field(ge=1, le=64, description="the signal's number (15: SIGTERM, 9: SIGKILL)")


class NetworkRequest(BaseModel):
    job: JobName
    rank: int = Field(ge=0, le=10_000_000)
    address: str = Field(min_length=9, max_length=18, description="A.B.C.D/P inside the uplink's subnet")


class WorkersRequest(BaseModel):
    ids: list[str] = Field(min_length=1, max_length=4096, description="worker ids on this agent")
    pause_deadline_s: float | None = Field(None, gt=0, le=7 * 86400.0, description="a pause: the agent resumes "
                                           "the workers by itself once it has lasted this long and nobody "
                                           "resumed them (the coordinator that paused them is gone)")


class ExitedRequest(BaseModel):
    code: int
    at: float | None = Field(None, description="when the rank ended (the launcher's wall clock)")
    asked: bool = Field(False, description="it ended on a signal someone sent it (its launcher forwarded "
                                           "one): an end asked for, never taken for a failure")


class UsedFileModel(BaseModel):
    path: str = Field(min_length=2, max_length=4096, pattern=r"^/[^\x00]*$", description="an absolute path")
    kind: Literal["mapped", "open", "dir"]
    size: int | None = Field(None, ge=0, description="bytes, for a mapped file")


class FilesCheckRequest(BaseModel):
    files: list[UsedFileModel] = Field(max_length=files.MAX_FILES,
                                       description="paths a worker's restore needs (GET /v1/workers/{id}/files)")
    container: dict[str, Any] | None = Field(None, description="the worker's container, as its agent records it: "
                                                               "its image, runtime, mounts and devices are checked")
