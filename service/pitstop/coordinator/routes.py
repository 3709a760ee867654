"""The coordinator's routes, declared once: the operators' REST API (versioned, OpenAPI at
/openapi.json), the agents' heartbeat endpoints, /healthz and /metrics.

Operators authenticate with PITSTOP_TOKEN (or the read-only token for reads), agents with
PITSTOP_CLUSTER_TOKEN; nothing under /v1 is served without one or the other.  Every route
reaches the process's `Coordinator` (service.py) through the app's state.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pitstop import tls
from pitstop.coordinator import ledger, lifecycle
from pitstop.coordinator.planner import unmovable_workers
from pitstop.coordinator.service import ROLES, Coordinator, CoordinatorDep, operation_view
from pitstop.coordinator.snapshots import MIN_EVERY_S, interval
from pitstop.coordinator.store import LIVE
from pitstop.errors import Conflict, Forbidden, NotFound, Unavailable, Unprocessable
from pitstop.httpapi import bearer, require_token, token_matches
from pitstop.wire.auth import handle_token_ok
from pitstop.wire.coordinator_requests import (
    Beat,
    ClaimRequest,
    CordonRequest,
    EvacuateRequest,
    Heartbeat,
    SetRoleRequest,
    SignalJobRequest,
    SnapshotPolicyRequest,
)
from pitstop.wire.store_rows import StoredWorker


def operator(request: Request, c: CoordinatorDep) -> None:
    """Reads: the operator token or the read-only token.  Mutations: the operator token only.
    Who asked is kept for the operation's record (requested_by): the certificate's name under
    mutual TLS, and the token that opened the door."""
    settings = c.settings
    tls.require_role(request.scope, ("operator",))
    name = request.scope.get(tls.PEER_NAME)
    who = [f"certificate {name}"] if name else []
    request.state.requested_by = ", ".join(who + ["insecure mode"]) if settings.operator_token is None else ""
    if settings.operator_token is None:
        return  # insecure development mode
    if request.method in ("GET", "HEAD") and token_matches(request, settings.read_token):
        return
    if request.method not in ("GET", "HEAD") and token_matches(request, settings.read_token):
        raise Forbidden("this token may only read", code="read_only_token",
                        action="use the operator token (PITSTOP_TOKEN) for evacuations and cancels")
    require_token(request, settings.operator_token, "operator", "PITSTOP_TOKEN")
    request.state.requested_by = ", ".join(who + ["the operator token (PITSTOP_TOKEN)"])


def full_operator(request: Request, c: CoordinatorDep) -> None:
    """A read that only the operator token may make: a job's output is the tenant's own data (its
    lines may carry credentials), not cluster state for dashboards and monitoring."""
    if c.settings.operator_token is not None and token_matches(request, c.settings.read_token):
        raise Forbidden("the read-only token may not read a job's output", code="read_only_token",
                        action="use the operator token (PITSTOP_TOKEN): output is the job owner's data")


async def cluster(request: Request, c: CoordinatorDep) -> None:  # async: no thread hop on the hottest path (beats)
    tls.require_role(request.scope, ("agent",))
    require_token(request, c.settings.cluster_token, "cluster", "PITSTOP_CLUSTER_TOKEN")


def worker_handle(request: Request, wid: str, c: CoordinatorDep) -> None:
    """The handle routes: the worker's own handle token (wire/auth.handle_token), which its launcher
    got when it registered, opens them for that worker alone."""
    if not handle_token_ok(c.settings.cluster_token, wid, bearer(request)):
        raise Forbidden(f"this token is not the handle of worker {wid}", code="not_this_handle",
                        action="a launcher follows only the rank it started, with the handle its agent gave it")


open_routes = APIRouter()
"""What a load balancer or Prometheus reaches without a token."""


@open_routes.get("/healthz")
def healthz(c: CoordinatorDep) -> dict:
    """ok, and whether this coordinator leads or stands by (a load balancer in front of several
    sends writes to the one whose role is `leader`)."""
    return {"ok": True, "role": leader(c)["role"]}


@open_routes.get("/v1/leader")
def leader(c: CoordinatorDep) -> dict:
    """Which coordinator leads, in which term, since when (unix time), as this one knows it; and
    this one's own URL and role (leader, standby).  Open: the agents, `pitstop doctor` and the CLI
    ask it to find the leader among the URLs they were given."""
    if c.lead is None:
        return {"leader": None, "term": None, "since": None, "this": None, "role": "leader"}
    return c.lead.view()


@open_routes.get("/metrics")
def prom(c: CoordinatorDep) -> Response:
    hs = c.store.hosts()
    roles = dict.fromkeys(ROLES, 0)  # a role with no host left reads 0, so "no spare left" can alert
    for h in hs:
        roles[h.role] = roles.get(h.role, 0) + 1
    m = c.metrics
    cordoned = dict.fromkeys(roles, 0)
    for h in hs:
        if h.cordoned:
            cordoned[h.role] += 1
    for role, n in roles.items():
        m.hosts.labels(role).set(n)
        m.cordoned.labels(role).set(cordoned[role])
    m.degraded.set(sum(1 for h in hs if (h.health or {}).get("degraded")))
    m.in_flight.set(len(c.store.ops(running_only=True)))
    m.leadership(c.lead.view() if c.lead is not None else None)
    m.protection(jobs(c), c.snapshots.paused_total)
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)


agents = APIRouter(prefix="/v1", dependencies=[Depends(cluster)], tags=["agents"])


@agents.post("/agents:heartbeat")
def heartbeat(c: CoordinatorDep, hb: Heartbeat) -> dict:
    if c.lead is not None and hb.coordinator_term is not None and c.lead.term is not None \
            and hb.coordinator_term > c.lead.term:
        c.lead.raise_above(hb.coordinator_term)  # this database holds less than an agent has seen (a new one)
    reasons = c.policy.evaluate(hb.gpu_health)
    c.store.heartbeat({**hb.model_dump(exclude={"coordinator_term"}),
                       "health": {"degraded": bool(reasons), "reasons": reasons}})
    c.driver.node_seen(hb.name)
    c.metrics.heartbeats.labels("full").inc()
    c.health_verdict(hb.name, reasons)
    # jobs recovered elsewhere while this host was away: their workers here end (coordinator/recovery.py)
    fences = [{"job": f.job, "epoch": f.epoch} for f in c.store.fences(host=hb.name, unacked=True)]
    return {"ok": True, "beat_udp_port": c.settings.host_port()[1] if c.settings.beat_udp else None,
            "fences": fences, **_term(c)}


def _term(c: "Coordinator") -> dict:
    """The leader's term and URL, in its answers to the agents: each agent refuses, from then on, the
    calls of any older term (agent/terms.py)."""
    if c.lead is None or c.lead.term is None:
        return {}
    return {"term": c.lead.term, "leader": c.lead.me}


@agents.post("/agents:beat", responses={409: {"description": "no full report of this generation: send one"}})
async def beat(c: CoordinatorDep, b: Beat) -> dict:
    """Runs on the event loop and touches only memory (Store.beat): 10,000 agents send one a second."""
    seen = c.beat_seen(b.name, b.generation)
    if seen is None:
        raise Unavailable("this coordinator is stopping", code="stopping",
                          action="beat again in a moment: a restarted coordinator or a standby takes over")
    if not seen:
        raise Conflict(f"no full report of generation {b.generation} from {b.name}", code="resync",
                       action="send a full report (POST /v1/agents:heartbeat), then beat again")
    c.metrics.heartbeats.labels("beat").inc()
    if b.gpu_health is not None:
        reasons = c.policy.evaluate(b.gpu_health)
        c.store.set_health(b.name, b.gpu_health, {"degraded": bool(reasons), "reasons": reasons})
        c.health_verdict(b.name, reasons)
    return {"ok": True}


@agents.post("/agents:claim", responses={409: {"description": "another live host runs this rank"}})
def claim(c: CoordinatorDep, body: ClaimRequest) -> dict:
    """An agent about to register a rank: refused if another live host runs it already."""
    return c.claim(body.host, body.job, body.rank, body.owner_uid, body.privileged)


operators = APIRouter(prefix="/v1", dependencies=[Depends(operator)], tags=["operators"])


@operators.get("/hosts")
def hosts(c: CoordinatorDep) -> list[dict]:
    """Every host: role, since when and why (`role_since`, `role_why`: the evacuation's reason, its
    operation and who asked), `cordoned`, `live_workers`, inventory, health, and whether it is heard
    from (`silent`: not within the failure deadline; its jobs with snapshots are recovered elsewhere)."""
    live = Counter(w.host for w in c.store.workers() if w.state in LIVE)
    return [h.public() | ({"auto_evacuation": c.auto.status[h.name]} if h.name in c.auto.status else {})
            | {"silent": h.age_s > c.settings.failure_deadline_s, "live_workers": live[h.name]}
            for h in c.store.hosts()]


@operators.post("/hosts/{name}:cordon")
def cordon_host(c: CoordinatorDep, name: str, request: Request, body: CordonRequest | None = None) -> dict:
    """Keep a host out of the spare pool, moving nothing: never the destination of an evacuation or
    a recovery until `:uncordon`.  Its workers keep running and can still be evacuated from it."""
    return lifecycle.cordon(c.store, name, (body or CordonRequest()).reason, _who(request))


def _who(request: Request) -> str:
    """Who asked, as `operator` found it: kept with a host's cordon and role change."""
    return getattr(request.state, "requested_by", "") or "unknown"


@operators.post("/hosts/{name}:uncordon")
def uncordon_host(c: CoordinatorDep, name: str, request: Request) -> dict:
    """Let a cordoned host back into the spare pool; return an evacuated (drained) host to service:
    spare if its agent offers itself, else active."""
    return lifecycle.uncordon(c.store, name, c.driver.busy_hosts(), _who(request))


@operators.post("/hosts/{name}:setRole")
def set_host_role(c: CoordinatorDep, name: str, body: SetRoleRequest, request: Request) -> dict:
    return lifecycle.set_role(c.store, name, body.role, c.driver.busy_hosts(), _who(request))


@operators.delete("/hosts/{name}")
def remove_host(c: CoordinatorDep, name: str) -> dict:
    """Forget a host whose agent is gone and that runs nothing."""
    return lifecycle.remove(c.store, name, c.driver.busy_hosts(), c.settings.heartbeat_timeout_s)


@operators.get("/jobs")
def jobs(c: CoordinatorDep) -> list[dict]:
    by: dict[str, list[StoredWorker]] = {}
    for w in c.store.workers():
        by.setdefault(w.job, []).append(w)
    return [{"job": j, "workers": [w.public() for w in ws], "hosts": sorted({w.host for w in ws}),
             "state": job_state(ws), "movable": not unmovable_workers(ws),
             "protection": c.snapshots.protection(j, interval(c.store, j, ws)) if job_state(ws) == "running" else None}
            for j, ws in sorted(by.items())]


def job_state(ws: list[StoredWorker]) -> str:
    """running while a rank is live; finished when every rank ended and one exited 0; stopped when
    an end was asked for (`pitstop stop|kill`, a forwarded signal); failed otherwise."""
    if any(w.state in ("running", "paused", "capturing", "stopped") for w in ws):
        return "running"
    if any(w.end_asked for w in ws):
        return "stopped"
    if any(w.state == "exited" and w.exit_code == 0 for w in ws):
        return "finished"
    return "failed"


@operators.get("/jobs/{job}/snapshots")
def job_snapshots(c: CoordinatorDep, job: str) -> dict:
    """The job's snapshot schedule, its snapshots (the committed one counts), the last failure."""
    ws = c.store.workers(job=job)
    if not ws:
        raise NotFound(f"no job {job!r}", action="list jobs with `pitstop jobs`")
    asked = interval(c.store, job, ws)
    return {"job": job, "every_s": asked, "set_by_api": c.store.snapshot_policy(job),
            "effective_every_s": c.snapshots.effective(job, asked), "stretched": c.snapshots.stretched.get(job),
            "paused_s_total": round(c.snapshots.paused_total.get(job, 0.0), 3),
            "paused_share": c.snapshots.lost_share(job), "protection": c.snapshots.protection(job, asked),
            "snapshots": [s.public() for s in c.store.snapshots(job)], "last_error": c.snapshots.errors.get(job),
            "kept": c.snapshots.kept.get(job),
            "fences": [f.public() for f in c.store.fences() if f.job == job]}


@operators.delete("/jobs/{job}/snapshots")
def drop_job_snapshots(c: CoordinatorDep, job: str) -> dict:
    """Drop every snapshot of a job, on every host (`pitstop snapshots JOB --drop`): the job can no
    longer be recovered from one until its next snapshot commits."""
    if c.recoveries.running(job):
        raise Conflict(f"job {job} is being recovered from its snapshot", code="recovery_running",
                       action="wait for the recovery to end")
    if not c.store.snapshots(job):
        raise NotFound(f"job {job!r} has no snapshot", action="list them with `pitstop snapshots JOB`")
    c.snapshots.drop_everywhere(job, "an operator dropped them")
    c.snapshots.kept.pop(job, None)
    return {"job": job, "dropped": True}


@operators.put("/jobs/{job}/snapshots")
def set_job_snapshots(c: CoordinatorDep, job: str, body: SnapshotPolicyRequest) -> dict:
    """Set a running job's snapshot interval (0: off; null: back to its launchers' value)."""
    if not c.store.workers(job=job):
        raise NotFound(f"no job {job!r}", action="list jobs with `pitstop jobs`")
    if body.every_s and body.every_s < MIN_EVERY_S:
        raise Unprocessable(f"every_s {body.every_s:g} is below {MIN_EVERY_S:g} s: every snapshot pauses the job",
                            action=f"give 0 (off) or at least {MIN_EVERY_S:g}")
    c.store.set_snapshot_policy(job, body.every_s)
    return job_snapshots(c, job)


@operators.post("/jobs/{job}/snapshots:take")
def take_snapshot(c: CoordinatorDep, job: str) -> dict:
    """Take one snapshot of the job now (waits for it); its record, committed, or the error."""
    if not c.store.workers(job=job):
        raise NotFound(f"no job {job!r}", action="list jobs with `pitstop jobs`")
    return c.snapshots.take(job)


@operators.post("/jobs/{job}:recover", status_code=202)
def recover_job(c: CoordinatorDep, job: str, node: str | None = Query(None, max_length=253)) -> dict:
    """Recover the job from its last complete snapshot (an operation, as an evacuation is)."""
    return operation_view(c.store.op(c.recoveries.start(job, node, requested_by="an operator")))


@operators.post("/jobs/{job}:signal")
def signal_job(c: CoordinatorDep, job: str, body: SignalJobRequest) -> dict:
    """Send a signal to every rank of a job, wherever each runs now (`pitstop stop|kill JOB`)."""
    return c.signal_job(job, body.signal)


@operators.get("/workers/{wid}/output", dependencies=[Depends(full_operator)])
def worker_output(c: CoordinatorDep, wid: str,
                  stream: str = Query("stdout", pattern="^(stdout|stderr)$"),
                  offset: int = Query(0, ge=0)) -> Response:
    """A worker's output from `offset`, wherever it runs (`pitstop attach`); its state and, once
    it ended, its exit code in the X-Pitstop-* headers."""
    data, headers = c.worker_output(wid, stream, offset)
    return Response(data, media_type="application/octet-stream",
                    headers={k: v for k, v in headers.items() if k.lower().startswith("x-pitstop")})


handles = APIRouter(prefix="/v1", tags=["handles"])
"""What a rank's own launcher may do through the coordinator once its agent is gone: follow the
rank (output, state, exit status) and pass it a signal.  Nothing else, and that worker only."""


@handles.get("/workers/{wid}/handle/output", dependencies=[Depends(worker_handle)])
def handle_output(c: CoordinatorDep, wid: str, stream: str = Query("stdout", pattern="^(stdout|stderr)$"),
                  offset: int = Query(0, ge=0)) -> Response:
    data, headers = c.worker_output(wid, stream, offset)
    return Response(data, media_type="application/octet-stream",
                    headers={k: v for k, v in headers.items() if k.lower().startswith("x-pitstop")})


@handles.post("/workers/{wid}/handle:signal", dependencies=[Depends(worker_handle)])
def handle_signal(c: CoordinatorDep, wid: str, signal: int = Query(..., ge=1, le=64)) -> dict:
    """A signal the launcher received, passed to its rank wherever it runs now."""
    return c.signal_worker(wid, signal)


@operators.get("/operations")
def operations(c: CoordinatorDep,
               node: str | None = Query(None, max_length=253, description="only those of this host"),
               done: bool | None = Query(None, description="true: finished ones only; false: running ones"),
               before: float | None = Query(None, description="a page: created before this time (the "
                                            "oldest `created` of the previous page)"),
               limit: int | None = Query(None, ge=1, le=1000, description="at most this many, the newest")
               ) -> list[dict]:
    return [operation_view(o) for o in c.store.ops(node=node, done=done, before=before, limit=limit)]


@operators.get("/moves")
def moves(c: CoordinatorDep,
          node: str | None = Query(None, max_length=253, description="only moves from or to this host"),
          result: str | None = Query(None, pattern="^(succeeded|failed|cancelled)$"),
          before: float | None = Query(None, description="a page: created before this time"),
          limit: int = Query(100, ge=1, le=1000, description="at most this many, the newest")) -> list[dict]:
    """The ledger: every finished move and recovery, newest first (coordinator/ledger.py)."""
    ops = c.store.ops(node=node, done=True, before=before, limit=limit if result is None else 1000)
    out = [ledger.entry(o) for o in ops if (result is None or o.result == result)]
    return out[:limit]


@operators.get("/operations/{op_id}")
def operation(c: CoordinatorDep, op_id: str) -> dict:
    op = c.store.op(op_id.removeprefix("operations/"))
    if op is None:
        raise NotFound(f"no operation {op_id!r}", action="list operations with `pitstop ops`")
    return operation_view(op)


@operators.post("/nodes/{node}:evacuate", status_code=202)
def evacuate(c: CoordinatorDep, node: str, request: Request, body: EvacuateRequest | None = None,
             idempotency_key: str | None = Header(None, max_length=200)) -> JSONResponse:
    body = body or EvacuateRequest()
    if body.validate_only:
        return JSONResponse(c.validate_evacuation(node, body))
    fields = body.model_dump()
    del fields["validate_only"]
    for f in ("post_copy", "pre_copy"):  # unset as before the field existed: a retry across an upgrade matches
        if fields[f] is None:
            del fields[f]
    digest = hashlib.sha256(json.dumps({"node": node, **fields}, sort_keys=True).encode()).hexdigest()
    if idempotency_key:
        seen = c.store.idempotent(idempotency_key)
        if seen:
            if seen[0] != digest:
                raise Unprocessable("this Idempotency-Key was used with a different request",
                                    code="idempotency_key_reused",
                                    action="use a new key for a new request", details={"operation": seen[1]})
            return JSONResponse(operation_view(c.store.op(seen[1])), status_code=202)
    op_id = c.start_evacuation(node, body.to, body.reason, (idempotency_key, digest) if idempotency_key else None,
                               post_copy=body.post_copy, pre_copy=body.pre_copy,
                               requested_by=getattr(request.state, "requested_by", "") or "unknown")
    return JSONResponse(operation_view(c.store.op(op_id)), status_code=202)


@operators.post("/operations/{op_id}:cancel")
def cancel(c: CoordinatorDep, op_id: str) -> dict:
    op = c.store.op(op_id.removeprefix("operations/"))
    if op is None:
        raise NotFound(f"no operation {op_id!r}", action="list operations with `pitstop ops`")
    if op.done:
        raise Conflict(f"operation {op.id} is already done ({op.result})", action="nothing to cancel")
    if op.metadata.get("committed"):
        raise Conflict(f"operation {op.id} is past its commit point", code="past_commit_point",
                       action="it will finish; evacuate the destination to move the workers again")
    c.store.request_cancel(op.id)
    return operation_view(c.store.op(op.id))
