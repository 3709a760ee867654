"""The agent's door for peers and the coordinator (TCP): pause and resume, the shim's
control blocks, pre-copies, captures, image streams and restores.  Every route under /v1 needs
the cluster token (PITSTOP_CLUSTER_TOKEN) and, under mutual TLS, an agent's or the coordinator's
certificate; /healthz and /metrics are open.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from pitstop import priority, shimctl, tls
from pitstop.agent import containers
from pitstop.agent.agent import Agent, AgentDep
from pitstop.agent.state import LIVE_STATES, Worker, WorkerState
from pitstop.errors import Conflict, FailedPrecondition, InvalidRequest, PitstopError, TransferFailed
from pitstop.httpapi import require_token
from pitstop.proc import files, proctree
from pitstop.transfer.stream import overdue, receive_into
from pitstop.wire import agent_requests
from pitstop.wire.agent_client import TERM_HEADER


async def auth(request: Request, agent: AgentDep) -> None:
    """The coordinator's routes: with mutual TLS, a coordinator's certificate only.  An agent's
    certificate reaches another agent only where agents call each other (`from_peers`): so a GPU
    host's certificate, stolen with its host, cannot fence, stop or restore another host's ranks."""
    tls.require_role(request.scope, ("coordinator",))
    require_token(request, agent.s.cluster_token, "cluster", "PITSTOP_CLUSTER_TOKEN")
    _fenced(request, agent)


async def from_peers(request: Request, agent: AgentDep) -> None:
    """Routes agents call on each other (images sent and verified, a replica kept, a moved rank's
    signal passed on, a moved rank's output followed) and the coordinator too."""
    tls.require_role(request.scope, ("agent", "coordinator"))
    require_token(request, agent.s.cluster_token, "cluster", "PITSTOP_CLUSTER_TOKEN")
    _fenced(request, agent)


def _fenced(request: Request, agent: Agent) -> None:
    """A coordinator's call carries its term: refused where it is older than one this agent has seen
    (agent/terms.py).  After the token: an unauthenticated request learns nothing of the terms."""
    raw = request.headers.get(TERM_HEADER)
    if raw is None:
        return  # another agent's call, or an older coordinator's
    try:
        term = int(raw)
    except ValueError:
        raise InvalidRequest(f"{TERM_HEADER} {raw[:40]!r} is not a number", action="send the lease's term") from None
    agent.admit_term(term)


open_router = APIRouter()
"""The two routes a load balancer or Prometheus reaches without the token."""


@open_router.get("/healthz")
def healthz(agent: AgentDep) -> dict:
    # The socket path is public knowledge: its file mode guards it.
    return {"ok": True, "name": agent.s.name, "socket": str(agent.s.sock)}


@open_router.get("/metrics")
def metrics(agent: AgentDep) -> Response:
    return Response(generate_latest(agent.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _signal_trees(agent: Agent, ws: list[Worker], signal: Callable[[list[int]], None], state: WorkerState,
                  deadline_s: float | None = None) -> None:
    """Signal every process of the workers' trees, then record their new state in one write (a
    pause with its deadline, if it has one)."""
    signal([p for w in ws for p in proctree.tree(w.root_pid)])
    now = time.time()
    with agent.state.lock:
        for w in ws:
            w.state = state
            if state == "paused":
                w.paused_at = now
                w.pause_until = now + deadline_s if deadline_s else None
            else:
                w.running_since = now
                w.pause_until = None
        agent.state.save()


class _Boosted(JSONResponse):
    """An answer whose handler may have run with the event loop's thread on SCHED_FIFO
    (priority.boost); the thread's own policy comes back once the answer is sent, or could not be."""

    def __init__(self, content: Any, back: Callable[[], None] | None) -> None:
        super().__init__(content)
        self.back = back

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.back:
                self.back()


def _signalled(work: Callable[[], list[Worker]]) -> Response:
    """Stop or continue ranks, and answer, with this (the event loop's) thread on SCHED_FIFO.

    The job waits on these few milliseconds, and the ranks compete for them: each SIGCONT wakes
    a rank's threads, which preempted the agent's nice -10 threads on a host with more busy
    threads than cores (7 ranks, 49 threads, 2 cores: 4-50 ms of kill() calls and 10-38 ms
    more before the answer reached the coordinator, docs/benchmarks.md).  The work runs here
    rather than in the thread pool so that one thread, boosted once, does it and sends the
    answer.  It is bounded: reads of /proc, kill(), one state write.  A boost that the answer
    somehow never ends is ended by the loop a second later.  Without CAP_SYS_NICE (no boost)
    the same work runs at the agent's own priority."""
    back = priority.boost()
    if back:
        asyncio.get_running_loop().call_later(1.0, back)
    try:
        return _Boosted([w.model_dump(mode="json") for w in work()], back)
    except BaseException:
        if back:
            back()
        raise


def _shim_views(w: Worker, trail: bool = False) -> list[dict]:
    """The NCCL shim's control blocks in the worker's processes; none once it no longer runs."""
    return [b.view(trail=trail) for b in shimctl.blocks(w.root_pid)] if w.state in LIVE_STATES else []


router = APIRouter(prefix="/v1", dependencies=[Depends(auth)])
peers = APIRouter(prefix="/v1", dependencies=[Depends(from_peers)])


@router.get("/workers")
def workers(agent: AgentDep) -> list[Worker]:
    return [agent.refresh(w) for w in list(agent.state.workers.values())]


@router.get("/workers/{wid}/files")
def worker_files(agent: AgentDep, wid: str) -> dict:
    """The paths a restore of this worker needs (proc/files.py): a spare checks them before
    anything pauses (POST /v1/files:check)."""
    w = agent.refresh(agent.state.worker(wid))
    if w.state not in ("running", "paused"):
        raise Conflict(f"worker {wid} is {w.state}; only a running or paused worker's files are listed",
                       action="check the worker's state")
    if w.container is not None:  # its files are the image's and its mounts': the container's needs say them
        if w.container.get("unmovable"):
            raise FailedPrecondition(f"worker {wid} runs in container {w.container.get('name') or w.container['id'][:12]}, "
                                     f"which cannot move: {w.container['unmovable']}. Nothing was paused",
                                     code="container_cannot_move",
                                     action="run the container with runc (`podman run --runtime runc`) under podman, "
                                            "or leave this job where it runs")
        return {"files": [], "container": w.container}
    return {"files": [f.as_dict() for f in files.used_files(proctree.tree(w.root_pid))]}


@router.post("/coordinator:term", responses={409: {"description": "an agent has seen a newer term"}})
def coordinator_term(agent: AgentDep, req: agent_requests.TermRequest) -> dict[str, Any]:
    """A coordinator that took the lease announces its term before it acts: from then on this agent
    refuses every call of an older term (agent/terms.py).  The term this agent has seen, after."""
    agent.admit_term(req.term, req.leader)
    return agent.terms.view()


@router.post("/files:check")
def check_files(agent: AgentDep, req: agent_requests.FilesCheckRequest) -> dict:
    """What this host lacks of the paths a worker's restore would need: each with why."""
    lack = files.lacking([files.UsedFile(f.path, f.kind, f.size) for f in req.files])
    if req.container is not None:
        lack += containers.lacking(agent.s, req.container)
    return {"lacking": lack}


@router.post("/workers/{wid}:pause")
def pause(agent: AgentDep, wid: str) -> Worker:
    """Stop a worker's whole tree (SIGSTOP) while a peer of its job moves."""
    w = agent.refresh(agent.state.worker(wid))
    if w.state == "paused":
        return w
    if w.state != "running":
        raise Conflict(f"worker {wid} is {w.state}; only a running worker can be paused",
                       action="check the worker's state")
    proctree.stop(proctree.tree(w.root_pid))
    agent.state.update_worker(w, state="paused", paused_at=time.time())
    return w


@router.post("/workers:batchPause", response_model=list[Worker])
async def batch_pause(agent: AgentDep, req: agent_requests.WorkersRequest) -> Response:
    """Stop several workers' trees in one call, one state write: a coordinator pausing the
    peers of an 8-rank job spent 0.09-0.17 s on 7 calls to one agent on 2 cores.
    All or nothing: one worker that cannot be paused (unknown, not running) fails the call
    before any is stopped.  Answered from the event loop with its thread boosted
    (_signalled), like the resume."""
    def work() -> list[Worker]:
        ws = [agent.refresh(agent.state.worker(wid), needs=False) for wid in dict.fromkeys(req.ids)]
        bad = [f"{w.id} is {w.state}" for w in ws if w.state not in ("running", "paused")]
        if bad:
            raise Conflict("only running workers can be paused: " + "; ".join(bad) + "; nothing was paused",
                           action="check the workers' states")
        _signal_trees(agent, [w for w in ws if w.state == "running"], proctree.stop, "paused", req.pause_deadline_s)
        return ws
    return _signalled(work)


@router.post("/workers:batchResume", response_model=list[Worker])
async def batch_resume(agent: AgentDep, req: agent_requests.WorkersRequest) -> Response:
    """Resume several workers; idempotent, and unknown ids fail the call before any resumes.  A
    worker a snapshot is dumping is resumed once its dump ends (Snapshots.wait_dumps)."""
    await asyncio.to_thread(agent.snapshots.wait_dumps, req.ids, agent.s.dump_timeout_s)

    def work() -> list[Worker]:
        ws = [agent.state.worker(wid) for wid in dict.fromkeys(req.ids)]
        _signal_trees(agent, [w for w in ws if w.state == "paused"], proctree.resume, "running")
        return ws
    return _signalled(work)


@router.post("/workers/{wid}:resume")
def resume(agent: AgentDep, wid: str) -> Worker:
    w = agent.state.worker(wid)
    if w.state == "paused":
        proctree.resume(proctree.tree(w.root_pid))
        agent.state.update_worker(w, state="running", running_since=time.time(), pause_until=None)
    return w


@peers.post("/workers/{wid}:signal")
def signal_worker(agent: AgentDep, wid: str, req: agent_requests.SignalRequest) -> dict:
    """A signal for a worker, from the coordinator (`pitstop stop|kill JOB`) or from the agent it
    moved away from (its launcher's): delivered here, or passed on to where it moved next."""
    return agent.handles.signal(wid, req.signal)


@router.post("/workers/{wid}:discard")
def discard_worker(agent: AgentDep, wid: str) -> Worker:
    """Kill a copy this agent restored (a move being rolled back); refuses original workers."""
    w = agent.state.worker(wid)
    if not w.restored:
        raise Conflict(f"worker {wid} was launched here, not restored; refusing to kill it",
                       action="only restored copies can be discarded")
    if w.state in ("running", "paused", "capturing", "stopped"):
        agent.state.update_worker(w, state="lost", reason="its move was rolled back; this copy was stopped "
                                                          "(the source runs the rank)")
        proctree.discard_copy(w.root_pid)
    return w


@router.get("/workers:batchGetShim")
def batch_shim_blocks(agent: AgentDep, ids: list[str] = Query(min_length=1, max_length=4096),
                      trail: bool = False) -> dict:
    """The shim's control blocks of several workers in one call: the coordinator reads every
    rank's before each pause, and 8 ranks read one by one cost 0.04-0.10 s of it.  trail: with
    the last operations' signatures (1 KiB a block), read once before a move."""
    ws = {wid: agent.state.worker(wid) for wid in dict.fromkeys(ids)}  # an unknown id: 404, nothing read
    return {"blocks": {wid: _shim_views(w, trail) for wid, w in ws.items()}}


@router.get("/workers/{wid}/shim")
def shim_blocks(agent: AgentDep, wid: str) -> dict:
    """The NCCL shim's control blocks in this worker's processes (empty: no NCCL)."""
    return {"blocks": _shim_views(agent.state.worker(wid))}


@router.post("/workers/{wid}/shim")
def shim_op(agent: AgentDep, wid: str, req: agent_requests.ShimOp) -> dict:
    w = agent.state.worker(wid)
    if w.state not in LIVE_STATES:
        raise Conflict(f"worker {wid} is {w.state}", action="only live workers have a shim to talk to")
    return {"blocks": shimctl.apply(w.root_pid, req.model_dump())}


@router.post("/precopies")
def precopy(agent: AgentDep, req: agent_requests.PreCopyRequest) -> dict:
    """Blocking: it returns when the worker's memory is at the destination (or why not)."""
    return agent.precopies.run(req.worker_id, req.dest_url, req.image_id, post_copy=req.post_copy)


@router.get("/precopies")
def precopies(agent: AgentDep) -> dict:
    """Pre-copies under way: bytes sent so far of about how many (the coordinator's progress)."""
    with agent.state.lock:
        return {"precopies": [dict(p) for p in agent.precopies.under_way.values()]}


@router.delete("/precopies/{image_id}")
def stop_precopy(agent: AgentDep, image_id: str) -> dict:
    """Stop a pre-copy under way: the coordinator gave up waiting for it (stalled, past its
    deadline, or the evacuation was cancelled), and it must not compete with the move."""
    return agent.precopies.stop(image_id)


@router.post("/captures", status_code=202)
def capture(agent: AgentDep, req: agent_requests.CaptureRequest) -> dict:
    return agent.source.start(req.worker_id, req.dest_url, req.image_id, req.keep_peers,
                              post_copy=req.post_copy).model_dump()


@router.get("/captures")
def captures(agent: AgentDep) -> list[dict]:
    return [c.model_dump() for c in agent.state.captures.values()]


@router.get("/captures/{cid}")
async def get_capture(agent: AgentDep, cid: str, wait: float = 0.0) -> dict:
    c = agent.state.capture(cid)
    if wait > 0 and c.state == "dumping":
        c = await run_in_threadpool(agent.source.wait, cid, min(wait, 60.0))
    return c.model_dump()


@router.post("/captures/{cid}:release")
def release(agent: AgentDep, cid: str) -> dict:
    return agent.source.release(cid).model_dump()


@router.post("/captures/{cid}:commit")
def commit(agent: AgentDep, cid: str, req: agent_requests.CommitRequest) -> dict:
    return agent.source.commit(cid, req.moved_to).model_dump()


@router.post("/captures/{cid}:rollback")
def rollback(agent: AgentDep, cid: str) -> dict:
    return agent.source.rollback(cid).model_dump()


@peers.put("/images/{image_id}")
async def receive(agent: AgentDep, image_id: str, request: Request) -> dict:
    """The image stream as an HTTP body (agents without a data port; transfer/dataport.py).
    The whole body must arrive by the slot's deadline: uvicorn itself never times out a
    body that trickles in, and a slot holds its share of the image directory meanwhile."""
    slot = agent.dest.open_slot(image_id)
    try:
        try:
            async with asyncio.timeout(max(0.0, slot.deadline - time.monotonic())) as limit:
                await receive_into(slot.receiver, request.stream())
        except OSError as e:  # ENOSPC above all: say where and how much
            if isinstance(e, TimeoutError) and limit.expired():
                raise overdue(image_id, slot.deadline - slot.started, slot.receiver.received) from None
            raise agent.storage_error(slot, e) from None
        if not slot.receiver.complete:
            raise TransferFailed(f"image stream {image_id} ended before its manifest "
                                 f"({slot.receiver.received} bytes received)", http_status=400,
                                 action="the copy is discarded; the source keeps its images")
    except BaseException:
        agent.dest.fail_slot(slot)
        raise
    return agent.finish_slot(slot)


@peers.get("/images/{image_id}")
def image(agent: AgentDep, image_id: str) -> dict:
    s = agent.dest.slot(image_id)
    return {"image_id": image_id, "state": s.state, "bytes_received": s.receiver.received,
            "bytes_total": s.receiver.manifest.total_bytes if s.receiver.manifest else None}


@peers.delete("/images/{image_id}")
def discard(agent: AgentDep, image_id: str) -> dict:
    agent.dest.discard(image_id)
    return {"image_id": image_id, "discarded": True}


@peers.post("/images/{image_id}:verify")
def verify(agent: AgentDep, image_id: str) -> dict:
    m, secs = agent.dest.verify_image(image_id)
    agent.metrics.phase.labels("verify").observe(secs)
    return {"image_id": image_id, "verified": True, "files": len(m.files), "bytes": m.total_bytes,
            "seconds": secs}


@router.post("/images/{image_id}:restore")
def restore(agent: AgentDep, image_id: str) -> dict:
    try:
        w, phases = agent.dest.restore_image(image_id)
    except PitstopError:
        agent.metrics.restores.labels("failed").inc()
        raise
    agent.metrics.restores.labels("ok").inc()
    agent.metrics.phases(phases)
    if w.container is not None:  # its launcher came with it: its end ends the worker here (agent/handles.py)
        agent.handles.watch(w)
    return {"worker": w.model_dump(), "phases": phases}
