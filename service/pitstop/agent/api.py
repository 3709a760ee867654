"""The agent's HTTP APIs.

Two listeners, two audiences:
- TCP, for peers and the coordinator: every request but /healthz needs the
  cluster token (PITSTOP_CLUSTER_TOKEN).
- a Unix socket, for `pitstop run` on this host: registration and output.
  Its file mode (0660, root) is the access check.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from typing import Any, Callable

import httpx
from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.concurrency import run_in_threadpool

from pitstop import __version__, nsinit, priority, safepath, shimctl, tls
from pitstop.agent import imagefs, peercred, reclaim
from pitstop.agent.capturing import SourceSide
from pitstop.agent.peercred import caller_uid, privileged
from pitstop.agent.receiving import DestinationSide, Slot
from pitstop.agent.settings import AgentSettings
from pitstop.agent.state import LIVE_STATES, AgentState, Capture, Worker, WorkerState
from pitstop.criu import runtime
from pitstop.errors import Conflict, FailedPrecondition, Forbidden, PitstopError, TransferFailed
from pitstop.httpapi import install_error_handlers, require_token
from pitstop.network import workerns
from pitstop.proc import caps, files, proctree
from pitstop.transfer.stream import overdue, receive_into
from pitstop.wire import agent_requests
from pitstop.wire.auth import bearer

FOLLOW_OUTPUT_TIMEOUT_S = 10.0  # a moved worker's output, fetched from the agent it moved to

UNMOVABLE_EVERY_S = 5.0  # how often a running worker's shim blocks are read for calls it could not track

COUNT_SUFFIXES = ("_bytes", "_threads", "_rounds", "_processes")
"""Phase entries that count something rather than time it (capturing.py, receiving.py)."""


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.captures = Counter("pitstop_agent_captures_total", "Captures by result", ["result"], registry=r)
        self.restores = Counter("pitstop_agent_restores_total", "Restores by result", ["result"], registry=r)
        self.phase = Histogram("pitstop_agent_phase_duration_seconds", "Duration of capture/restore phases",
                               ["phase"], registry=r, buckets=(.01, .05, .1, .25, .5, 1, 2, 5, 10, 30, 60, 120))
        self.sent = Counter("pitstop_agent_sent_bytes_total", "Image bytes sent to peers", registry=r)
        self.received = Counter("pitstop_agent_received_bytes_total", "Image bytes received", registry=r)
        Gauge("pitstop_build_info", "pitstop's version (always 1)", ["version", "service"],
              registry=r).labels(__version__, "agent").set(1)

    def phases(self, phases: dict[str, float]) -> None:
        """Durations only: a capture's phases also carry counts (bytes, threads, rounds, processes)."""
        for k, v in phases.items():
            if not k.endswith(COUNT_SUFFIXES):
                self.phase.labels(k).observe(v)


class Agent:
    """Everything one agent process holds; shared by both listeners."""

    def __init__(self, settings: AgentSettings) -> None:
        self.s = settings
        # before anything is read from or written to them: nobody else may be able to change them
        safepath.private_dir(settings.state_dir, mode=0o755, what="the agent's state directory")
        safepath.private_dir(settings.images, what="the agent's image directory")
        self.state = AgentState(settings.state_dir)
        self.dest = DestinationSide(settings, self.state)
        self.state.on_forget = self.dest.forget_output
        self.source = SourceSide(settings, self.state, self.dest)
        self.metrics = Metrics()
        self.source.on_finished = self._count_capture
        reclaim.sweep(settings.images)
        self.source.reconcile()
        self.dest.remove_stale_slots()
        self.image_fs = imagefs.prepare(settings.images, enabled=settings.image_mount, size=settings.image_mount_size)
        self.dest.adopt()
        self.started = time.time()
        self.data_port: int | None = None  # set by the server once transfer/dataport.py listens
        self.net_owners: dict[str, int] = {}  # worker id -> uid that prepared its network (local socket)
        self._unmovable_looked: dict[str, float] = {}  # worker id -> when its shim blocks were last read

    def _count_capture(self, c: Capture) -> None:
        """Called once per capture, when its dump and stream are over (sent, dumped or failed)."""
        self.metrics.captures.labels("failed" if c.state == "failed" else "ok").inc()
        self.metrics.sent.inc(c.bytes_sent)
        self.metrics.phases(c.phases)

    def storage_error(self, slot: Slot, e: OSError) -> TransferFailed:
        """A write of a received image failed (ENOSPC above all): say where and how much."""
        free = shutil.disk_usage(self.s.images).free
        return TransferFailed(
            f"cannot store image {slot.image_id} on {self.s.name}: {e.strerror} in {self.s.images} "
            f"after {slot.receiver.received} bytes ({free // 2**20} MiB free there now)",
            code="destination_storage", http_status=507,
            action="the copy is discarded and the source resumed; free space in the "
                   "destination's image directory or pick another spare")

    def finish_slot(self, slot: Slot) -> dict:
        slot.state = "complete"
        slot.finished = time.monotonic()
        rx = slot.receiver
        self.metrics.received.inc(rx.received)
        m = rx.manifest
        return {"image_id": slot.image_id, "bytes": rx.received, "files": len(m.files) if m else 0,
                "seconds": slot.finished - slot.started}

    def info(self) -> dict:
        try:
            rt = runtime.locate()
            criu = {"path": rt.binary, "version": rt.version_str}
        except PitstopError as e:
            criu = {"error": e.message}
        return {"name": self.s.name, "url": self.s.url, "spare": self.s.spare, "version": __version__,
                "data_port": self.data_port, "cap_bnd": f"{caps.bounding_set():x}",
                "post_copy": self.source.post_copy_support(), "image_fs": self.image_fs.describe(),
                "criu": criu, "workers": len([w for w in self.state.workers.values()
                                              if w.state in LIVE_STATES])}

    def refresh(self, w: Worker, needs: bool = True) -> Worker:
        """needs: also read what capabilities its tree holds (every process's status): for
        listings, not for a pause, whose time the job waits on."""
        if w.state == "running" and not w.restored and (
                not proctree.is_running(w.root_pid, w.start_time)):
            self.state.update_worker(w, state="exited" if w.exit_code is not None else "lost")
            self.drop_net(w)
        if w.state == "running" and needs:
            try:
                w.caps = f"{caps.needs(w.root_pid):x}"
            except OSError:
                pass  # it is exiting; the next listing says so
            self._look_for_unmovable(w)
        return w

    def _look_for_unmovable(self, w: Worker) -> None:
        """Whether the worker's NCCL shim saw communicators it did not create: once said it stays
        said (the shim's count only grows), and the blocks are read at most every few seconds, not
        at every beat (each look reads every process's memory map)."""
        now = time.monotonic()
        if w.unmovable or now - self._unmovable_looked.get(w.id, -UNMOVABLE_EVERY_S) < UNMOVABLE_EVERY_S:
            return
        self._unmovable_looked[w.id] = now
        w.unmovable = shimctl.unmovable(w.root_pid)

    def drop_net(self, w: Worker) -> None:
        """A worker that ended takes its address with it."""
        wn = workerns.from_dict(w.net)
        if wn and w.state in ("exited", "lost"):
            workerns.destroy(wn)


def _signal_trees(agent: Agent, ws: list[Worker], signal: Callable[[list[int]], None], state: WorkerState) -> None:
    """Signal every process of the workers' trees, then record their new state in one write."""
    signal([p for w in ws for p in proctree.tree(w.root_pid)])
    with agent.state.lock:
        for w in ws:
            w.state = state
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


def _shim_views(w: Worker) -> list[dict]:
    """The NCCL shim's control blocks in the worker's processes; none once it no longer runs."""
    return [b.view() for b in shimctl.blocks(w.root_pid)] if w.state in LIVE_STATES else []


def _reads(agent: Agent) -> APIRouter:
    """What both of the agent's doors answer alike: its info, one worker, a worker's output.  The
    peer door adds the cluster token in front; the local door (the Unix socket, whose file mode and
    SO_PEERCRED guard it) serves them to `pitstop run` as they are."""
    r = APIRouter()

    @r.get("/info")
    def info() -> dict:
        return agent.info()

    @r.get("/workers/{wid}")
    def worker(wid: str) -> Worker:
        return agent.refresh(agent.state.worker(wid))

    @r.get("/workers/{wid}/output")
    async def output(wid: str, stream: str = "stdout", offset: int = 0) -> Response:
        return await _output(agent, wid, stream, offset)

    return r


def peer_app(agent: Agent) -> FastAPI:
    app = FastAPI(title="pitstop agent", version=__version__)
    install_error_handlers(app)

    def auth(request: Request) -> None:
        tls.require_role(request.scope, ("agent", "coordinator"))
        require_token(request, agent.s.cluster_token, "cluster", "PITSTOP_CLUSTER_TOKEN")

    @app.get("/healthz")
    def healthz() -> dict:
        # The socket path is public knowledge: its file mode guards it.
        return {"ok": True, "name": agent.s.name, "socket": str(agent.s.sock)}

    app.include_router(_reads(agent), prefix="/v1", dependencies=[Depends(auth)])
    r = APIRouter(prefix="/v1", dependencies=[Depends(auth)])

    @r.get("/workers")
    def workers() -> list[Worker]:
        return [agent.refresh(w) for w in list(agent.state.workers.values())]

    @r.get("/workers/{wid}/files")
    def worker_files(wid: str) -> dict:
        """The paths a restore of this worker needs (proc/files.py): a spare checks them before
        anything pauses (POST /v1/files:check)."""
        w = agent.refresh(agent.state.worker(wid))
        if w.state not in ("running", "paused"):
            raise Conflict(f"worker {wid} is {w.state}; only a running or paused worker's files are listed",
                           action="check the worker's state")
        return {"files": [f.as_dict() for f in files.used_files(proctree.tree(w.root_pid))]}

    @r.post("/files:check")
    def check_files(req: agent_requests.FilesCheckRequest) -> dict:
        """What this host lacks of the paths a worker's restore would need: each with why."""
        return {"lacking": files.lacking([files.UsedFile(f.path, f.kind, f.size) for f in req.files])}

    @r.post("/workers/{wid}:pause")
    def pause(wid: str) -> Worker:
        """Stop a worker's whole tree (SIGSTOP) while a peer of its job moves."""
        w = agent.refresh(agent.state.worker(wid))
        if w.state == "paused":
            return w
        if w.state != "running":
            raise Conflict(f"worker {wid} is {w.state}; only a running worker can be paused",
                           action="check the worker's state")
        proctree.stop(proctree.tree(w.root_pid))
        agent.state.update_worker(w, state="paused")
        return w

    @r.post("/workers:batchPause", response_model=list[Worker])
    async def batch_pause(req: agent_requests.WorkersRequest) -> Response:
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
            _signal_trees(agent, [w for w in ws if w.state == "running"], proctree.stop, "paused")
            return ws
        return _signalled(work)

    @r.post("/workers:batchResume", response_model=list[Worker])
    async def batch_resume(req: agent_requests.WorkersRequest) -> Response:
        """Resume several workers; idempotent, and unknown ids fail the call before any resumes."""
        def work() -> list[Worker]:
            ws = [agent.state.worker(wid) for wid in dict.fromkeys(req.ids)]
            _signal_trees(agent, [w for w in ws if w.state == "paused"], proctree.resume, "running")
            return ws
        return _signalled(work)

    @r.post("/workers/{wid}:resume")
    def resume(wid: str) -> Worker:
        w = agent.state.worker(wid)
        if w.state == "paused":
            proctree.resume(proctree.tree(w.root_pid))
            agent.state.update_worker(w, state="running")
        return w

    @r.post("/workers/{wid}:discard")
    def discard_worker(wid: str) -> Worker:
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

    @r.get("/workers:batchGetShim")
    def batch_shim_blocks(ids: list[str] = Query(min_length=1, max_length=4096)) -> dict:
        """The shim's control blocks of several workers in one call: the coordinator reads every
        rank's before each pause, and 8 ranks read one by one cost 0.04-0.10 s of it."""
        ws = {wid: agent.state.worker(wid) for wid in dict.fromkeys(ids)}  # an unknown id: 404, nothing read
        return {"blocks": {wid: _shim_views(w) for wid, w in ws.items()}}

    @r.get("/workers/{wid}/shim")
    def shim_blocks(wid: str) -> dict:
        """The NCCL shim's control blocks in this worker's processes (empty: no NCCL)."""
        return {"blocks": _shim_views(agent.state.worker(wid))}

    @r.post("/workers/{wid}/shim")
    def shim_op(wid: str, req: agent_requests.ShimOp) -> dict:
        w = agent.state.worker(wid)
        if w.state not in LIVE_STATES:
            raise Conflict(f"worker {wid} is {w.state}", action="only live workers have a shim to talk to")
        bs = shimctl.blocks(w.root_pid)
        for b in bs:
            if req.op == "quiesce":
                shimctl.quiesce(b, req.gen)
            elif req.op == "targets":
                shimctl.set_targets(b, req.targets)
            elif req.op == "command":
                shimctl.command(b, req.command, req.ids)
        return {"blocks": len(bs)}

    @r.post("/precopies")
    def precopy(req: agent_requests.PreCopyRequest) -> dict:
        """Blocking: it returns when the worker's memory is at the destination (or why not)."""
        return agent.source.precopy(req.worker_id, req.dest_url, req.image_id, post_copy=req.post_copy)

    @r.get("/precopies")
    def precopies() -> dict:
        """Pre-copies under way: bytes sent so far of about how many (the coordinator's progress)."""
        with agent.state.lock:
            return {"precopies": [dict(p) for p in agent.source.precopies.values()]}

    @r.delete("/precopies/{image_id}")
    def stop_precopy(image_id: str) -> dict:
        """Stop a pre-copy under way: the coordinator gave up waiting for it (stalled, past its
        deadline, or the evacuation was cancelled), and it must not compete with the move."""
        return agent.source.stop_precopy(image_id)

    @r.post("/captures", status_code=202)
    def capture(req: agent_requests.CaptureRequest) -> dict:
        return agent.source.start(req.worker_id, req.dest_url, req.image_id, req.keep_peers,
                                  post_copy=req.post_copy).model_dump()

    @r.get("/captures")
    def captures() -> list[dict]:
        return [c.model_dump() for c in agent.state.captures.values()]

    @r.get("/captures/{cid}")
    async def get_capture(cid: str, wait: float = 0.0) -> dict:
        c = agent.state.capture(cid)
        if wait > 0 and c.state == "dumping":
            c = await run_in_threadpool(agent.source.wait, cid, min(wait, 60.0))
        return c.model_dump()

    @r.post("/captures/{cid}:release")
    def release(cid: str) -> dict:
        return agent.source.release(cid).model_dump()

    @r.post("/captures/{cid}:commit")
    def commit(cid: str, req: agent_requests.CommitRequest) -> dict:
        return agent.source.commit(cid, req.moved_to).model_dump()

    @r.post("/captures/{cid}:rollback")
    def rollback(cid: str) -> dict:
        return agent.source.rollback(cid).model_dump()

    @r.put("/images/{image_id}")
    async def receive(image_id: str, request: Request) -> dict:
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

    @r.get("/images/{image_id}")
    def image(image_id: str) -> dict:
        s = agent.dest.slot(image_id)
        return {"image_id": image_id, "state": s.state, "bytes_received": s.receiver.received,
                "bytes_total": s.receiver.manifest.total_bytes if s.receiver.manifest else None}

    @r.delete("/images/{image_id}")
    def discard(image_id: str) -> dict:
        agent.dest.discard(image_id)
        return {"image_id": image_id, "discarded": True}

    @r.post("/images/{image_id}:verify")
    def verify(image_id: str) -> dict:
        m, secs = agent.dest.verify_image(image_id)
        agent.metrics.phase.labels("verify").observe(secs)
        return {"image_id": image_id, "verified": True, "files": len(m.files), "bytes": m.total_bytes,
                "seconds": secs}

    @r.post("/images/{image_id}:restore")
    def restore(image_id: str) -> dict:
        try:
            w, phases = agent.dest.restore_image(image_id)
        except PitstopError:
            agent.metrics.restores.labels("failed").inc()
            raise
        agent.metrics.restores.labels("ok").inc()
        agent.metrics.phases(phases)
        return {"worker": w.model_dump(), "phases": phases}

    app.include_router(r)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(agent.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _output(agent: Agent, wid: str, stream: str, offset: int) -> Response:
    """Output of a worker from `offset`; follows the worker to wherever it moved."""
    if stream not in ("stdout", "stderr"):
        raise FailedPrecondition(f"unknown stream {stream!r}", action="use stdout or stderr")
    w = agent.refresh(agent.state.worker(wid))
    agent.state.read(wid)
    if w.state == "moved" and w.moved_to:
        headers = bearer(agent.s.cluster_token)
        try:
            async with httpx.AsyncClient(timeout=FOLLOW_OUTPUT_TIMEOUT_S, verify=tls.client_context()) as c:
                r = await c.get(f"{w.moved_to['url'].rstrip('/')}/v1/workers/{wid}/output",
                                params={"stream": stream, "offset": offset}, headers=headers)
        except httpx.HTTPError as e:
            return Response(b"", headers={"X-Pitstop-State": "unreachable", "X-Pitstop-Error": repr(e)[:200]})
        return Response(r.content, status_code=r.status_code,
                        headers={k: v for k, v in r.headers.items() if k.lower().startswith("x-pitstop")})
    data = agent.dest.read_output(wid, stream, offset) if w.restored else b""
    headers = {"X-Pitstop-State": w.state, "X-Pitstop-Agent": agent.s.name}
    if w.exit_code is not None:
        headers["X-Pitstop-Exit-Code"] = str(w.exit_code)
    return Response(data, media_type="application/octet-stream", headers=headers)


def local_app(agent: Agent) -> FastAPI:
    app = FastAPI(title="pitstop agent (local)", version=__version__)
    install_error_handlers(app)

    def own(request: Request, what: str, owner: int | None) -> int:
        """The caller's uid, refused unless it is `owner`'s (root and the agent's user act for all)."""
        uid = caller_uid(request.scope)
        if not privileged(uid) and owner is not None and owner != uid:
            raise Forbidden(f"uid {uid} may not act on {what}: it belongs to uid {owner}", code="not_your_worker",
                            action="act only on your own workers, or ask root")
        return uid

    @app.post("/v1/workers", status_code=201)
    def register(req: agent_requests.RegisterRequest, request: Request) -> Worker:
        pid = req.pid
        if not proctree.exists(pid):
            raise FailedPrecondition(f"pid {pid} does not exist", code="no_such_process",
                                     action="register the worker's tree root while it runs")
        uid = caller_uid(request.scope)
        uids = peercred.process_uids(pid)
        if not privileged(uid) and uids != {uid}:
            raise Forbidden(f"uid {uid} may not register pid {pid}: it runs as uid {sorted(uids)}",
                            code="not_your_process",
                            action="register only processes you started (`pitstop run` does), or run as root")
        nsp = proctree.ns_pids(pid)
        if len(nsp) < 2 or nsp[-1] != 1 or proctree.session_id(pid) != pid:
            raise FailedPrecondition(
                f"pid {pid} is not the init of its own PID namespace and session",
                code="not_capturable", action="start the worker with `pitstop run`")
        wid = f"{req.job}.{req.rank}"
        with agent.state.lock:
            old = agent.state.workers.get(wid)
            if old and old.state in LIVE_STATES and proctree.exists(old.root_pid):
                raise Conflict(f"worker {wid} is already registered (pid {old.root_pid})",
                               action="each rank of a job registers once")
            if req.address:
                own(request, f"the network of {wid}", agent.net_owners.get(wid))
            net = None
            if req.address:
                wn = workerns.spec(wid, req.address)
                if not workerns.exists(wn) or workerns.netns_inode(pid) != workerns.path_inode(wn):
                    raise FailedPrecondition(f"pid {pid} does not run in the network prepared for {req.address}",
                                             code="network_mismatch",
                                             action="prepare it with POST /v1/networks and start the worker in it "
                                                    "(`pitstop run --address` does both)")
                net = wn.to_dict()
            w = Worker(id=wid, job=req.job, rank=req.rank, root_pid=pid, start_time=proctree.start_time(pid) or 0,
                       net=net, init_dir=nsinit.owned_dir(pid), owner_uid=uid)
            agent.state.workers[wid] = w
            agent.state.save()
        return w

    @app.post("/v1/workers/{wid}:exited")
    def exited(wid: str, req: agent_requests.ExitedRequest, request: Request) -> Worker:
        w = agent.state.worker(wid)
        own(request, f"worker {wid}", w.owner_uid)
        if w.state in ("running", "lost"):
            agent.state.update_worker(w, state="exited", exit_code=req.code)
            agent.drop_net(w)
        return w

    @app.post("/v1/networks", status_code=201)
    def prepare_network(req: agent_requests.NetworkRequest, request: Request) -> dict:
        """A network namespace with the worker's own address, for `pitstop run --address` to start it in."""
        wid = f"{req.job}.{req.rank}"
        wn = workerns.spec(wid, req.address)
        workerns.check_on_link(wn, agent.s.worker_link)
        with agent.state.lock:
            uid = own(request, f"the network of {wid}", agent.net_owners.get(wid))
            for o in agent.state.workers.values():
                if o.net and o.state in LIVE_STATES and (o.net["address"].split("/")[0] == wn.ip or o.id == wid):
                    raise Conflict(f"{wn.ip} or {wid} is already in use by worker {o.id} here",
                                   action="give each worker its own address")
            if workerns.exists(wn):  # left by a launch that never registered
                workerns.destroy(wn)
            workerns.create(wn, agent.s.worker_link, locked=False, nft=None)
            agent.net_owners[wid] = uid
        return wn.to_dict() | {"path": wn.path}

    @app.delete("/v1/networks/{wid}")
    def drop_network(wid: str, request: Request) -> dict:
        w = agent.state.workers.get(wid)
        own(request, f"the network of {wid}", w.owner_uid if w else agent.net_owners.get(wid))
        if w and w.state in LIVE_STATES:
            raise Conflict(f"worker {wid} still runs in it", action="stop the worker first")
        wn = workerns.WorkerNet("", "", workerns.netns_name(wid))
        workerns.destroy(wn)
        return {"deleted": wn.netns}

    app.include_router(_reads(agent), prefix="/v1")
    return app

