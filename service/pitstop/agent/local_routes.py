"""The agent's door for `pitstop run` on its own host (a Unix socket): registration, exit,
and a worker's own network.  The socket's file mode (0660, root) admits the caller; SO_PEERCRED
says who it is, and a caller acts only on what is its own (root and the agent's user act for all).
"""

from __future__ import annotations

import time

import structlog
from fastapi import APIRouter, Request

from pitstop import nsinit
from pitstop.agent import containers, peercred
from pitstop.agent.agent import Agent, AgentDep
from pitstop.agent.peercred import caller_pid, caller_uid, privileged
from pitstop.agent.state import LIVE_STATES, Worker
from pitstop.agent.timeouts import CLAIM_TIMEOUT_S
from pitstop.errors import Conflict, FailedPrecondition, Forbidden, NotFound, PitstopError
from pitstop.network import workerns
from pitstop.proc import proctree
from pitstop.wire import agent_requests
from pitstop.wire.auth import handle_token
from pitstop.wire.coordinator_client import CoordinatorClient

log = structlog.get_logger("pitstop.agent.local_routes")



def own(request: Request, what: str, owner: int | None) -> int:
    """The caller's uid, refused unless it is `owner`'s (root and the agent's user act for all)."""
    return peercred.own(request.scope, what, owner)


router = APIRouter(prefix="/v1")


@router.post("/workers", status_code=201)
def register(agent: AgentDep, req: agent_requests.RegisterRequest, request: Request) -> dict:
    """Register a `pitstop run` root as a worker.  The answer is the worker and its handle (the
    coordinator and a token for this worker alone, wire/auth.handle_token), with which the launcher
    follows the rank through the coordinator when this agent is gone."""
    w = _register(agent, req, request)
    return {**w.model_dump(mode="json"),
            "handle": {"coordinator": agent.s.coordinator, "token": handle_token(agent.s.cluster_token, w.id)}}


def _register(agent: Agent, req: agent_requests.RegisterRequest, request: Request) -> Worker:
    # in a container, the container is the worker (agent/containers.py): its init, found here
    pid, found = containers.registrant(caller_pid(request.scope), req.pid, req.container)
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
    if not privileged(uid):  # a job is its first rank's user's: nobody else adds ranks to it here
        other = next((w for w in agent.state.workers.values() if w.job == req.job and w.state in LIVE_STATES
                      and w.owner_uid is not None and w.owner_uid != uid), None)
        if other is not None:
            raise _not_your_job(uid, req.job, other.owner_uid)
    claim_rank(agent, req.job, req.rank, uid)  # before the lock: a network call must not hold up pauses
    container = containers.describe(agent.s, found, pid, caller_pid(request.scope)) if found else None
    init_dir = nsinit.owned_dir(pid)
    if init_dir is None and nsinit.is_init(pid):
        log.warning("a worker's init does not work in a directory of its own: a restore on another host "
                    "needs the directory it works in to exist there", worker=f"{req.job}.{req.rank}", pid=pid)
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
                   net=net, init_dir=init_dir, owner_uid=uid, world=req.world, slurm_job=req.slurm_job,
                   launcher=_launcher(request), snapshot_every_s=req.snapshot_every_s, container=container)
        agent.state.workers[wid] = w
        agent.state.save()
    agent.handles.watch(w)
    return w


def _not_your_job(uid: int, job: str, owner: int | None) -> Forbidden:
    return Forbidden(f"uid {uid} may not add ranks to job {job}: its ranks belong to uid {owner}", code="not_your_job",
                     action="give your job a name of its own (`pitstop run --job`), or ask root")


def claim_rank(agent: Agent, job: str, rank: int, uid: int) -> None:
    """Refuse a rank that another host runs already, as the coordinator knows it: this host alone
    cannot see it, and a job with two rank 0s can neither train nor be moved; and a rank of a job
    another user's ranks run, on any host.  A coordinator that does not answer in time refuses
    nothing to root (agents never depend on it); another user's registration it could not check
    is refused, since only the coordinator knows whose the job is elsewhere."""
    if not agent.s.coordinator:
        return
    try:
        with CoordinatorClient(agent.s.coordinator, agent.s.cluster_token, timeout=CLAIM_TIMEOUT_S,
                               follow_s=CLAIM_TIMEOUT_S) as c:
            c.claim(agent.s.name, job, rank, owner_uid=uid, privileged=privileged(uid))
    except PitstopError as e:
        if e.code == "duplicate_rank":
            raise Conflict(e.message, code=e.code, action=e.action) from None
        if e.code == "not_your_job":
            raise Forbidden(e.message, code=e.code, action=e.action) from None
        if not privileged(uid):
            raise FailedPrecondition(f"the coordinator could not be asked whether job {job} is yours: {e.message}",
                                     code="coordinator_unreachable",
                                     action="start the rank again once the coordinator answers") from None
        log.warning("the coordinator could not be asked whether another host runs this rank; registered anyway",
                    job=job, rank=rank, error=e.message)


def _launcher(request: Request) -> dict[str, int] | None:
    """The process that registered the worker (`pitstop run`), as the kernel names it: its end
    ends the worker while the worker runs here (agent/handles.py)."""
    pid = caller_pid(request.scope)
    start = proctree.start_time(pid) if pid else None
    return {"pid": pid, "start": start} if pid and start is not None else None


@router.post("/workers/{wid}:signal")
def signal_worker(agent: AgentDep, wid: str, req: agent_requests.SignalRequest, request: Request) -> dict:
    """A signal from the worker's launcher, delivered wherever the worker runs now."""
    own(request, f"worker {wid}", agent.state.worker(wid).owner_uid)
    return agent.handles.signal(wid, req.signal)


@router.post("/workers/{wid}:hold")
def hold_worker(agent: AgentDep, wid: str, request: Request) -> Worker:
    """The caller takes the place of the worker's launcher on this host (`pitstop hold`)."""
    own(request, f"worker {wid}", agent.state.worker(wid).owner_uid)
    return agent.handles.hold(wid, _launcher(request))


@router.post("/workers/{wid}:exited")
def exited(agent: AgentDep, wid: str, req: agent_requests.ExitedRequest, request: Request) -> Worker:
    w = agent.state.worker(wid)
    own(request, f"worker {wid}", w.owner_uid)
    if w.state in ("running", "paused", "lost"):  # paused: killed while stopped (`pitstop kill` in a snapshot)
        agent.state.update_worker(w, state="exited", exit_code=req.code, ended_at=req.at or time.time(),
                                  end_asked=req.asked or w.end_asked, pause_until=None)
        agent.drop_net(w)
    return w


@router.post("/networks", status_code=201)
def prepare_network(agent: AgentDep, req: agent_requests.NetworkRequest, request: Request) -> dict:
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


@router.delete("/networks/{wid}")
def drop_network(agent: AgentDep, wid: str, request: Request) -> dict:
    """A network a launch prepared and no longer needs.  `wid` names one worker exactly (the
    namespace's name is derived from the whole id, workerns.netns_name); one that nobody here is
    known to own is only root's to remove."""
    w = agent.state.workers.get(wid)
    owner = w.owner_uid if w else agent.net_owners.get(wid)
    if owner is None and not privileged(caller_uid(request.scope)):
        raise NotFound(f"no network of worker {wid} was prepared here by you", code="no_such_network",
                       action="name a worker whose network you prepared (job.rank)")
    own(request, f"the network of {wid}", owner)
    if w and w.state in LIVE_STATES:
        raise Conflict(f"worker {wid} still runs in it", action="stop the worker first")
    wn = workerns.from_dict(w.net) if w and w.net else None
    wn = wn or workerns.WorkerNet("", "", workerns.netns_name(wid))
    workerns.destroy(wn)
    agent.net_owners.pop(wid, None)
    return {"deleted": wn.netns}
