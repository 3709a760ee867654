"""The operator REST API (versioned, OpenAPI at /openapi.json) and the agents' heartbeat endpoint.

Operators authenticate with PITSTOP_TOKEN, agents with PITSTOP_CLUSTER_TOKEN;
nothing under /v1 is served without one or the other.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import httpx
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pitstop import __version__, tls
from pitstop.coordinator import lifecycle
from pitstop.coordinator.driver import Driver
from pitstop.coordinator.fanout import in_parallel
from pitstop.coordinator.filecheck import check_files
from pitstop.coordinator.health_policy import AutoEvacuator
from pitstop.coordinator.planner import plan, unmovable_workers
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.store import LIVE, Store
from pitstop.errors import Conflict, FailedPrecondition, Forbidden, NotFound, PitstopError, Unprocessable
from pitstop.httpapi import install_error_handlers, require_token, token_matches
from pitstop.wire.agent_client import AgentClient
from pitstop.wire.beats import BeatFastPath
from pitstop.wire.coordinator_requests import Beat, EvacuateRequest, Heartbeat, SetRoleRequest

PLAN_SYNC_TIMEOUT_S = 3.0  # each agent's worker list, asked in parallel while a request waits to be planned
POST_COPY_CHECK_TIMEOUT_S = 5.0  # the source's post-copy support, asked before anything pauses


ROLES = ("active", "spare", "draining", "drained")


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ops = Counter("pitstop_coordinator_operations_total", "Evacuations by result", ["result"], registry=r)
        self.phase = Histogram("pitstop_coordinator_phase_duration_seconds", "Evacuation phase durations",
                               ["phase"], registry=r, buckets=(.01, .05, .1, .25, .5, 1, 2, 5, 10, 30, 60, 120))
        self.bytes = Counter("pitstop_coordinator_transferred_bytes_total", "Image bytes moved by evacuations",
                             registry=r)
        self.heartbeats = Counter("pitstop_coordinator_heartbeats_total", "Agent heartbeats received, by kind "
                                  "(full report, beat over HTTP, beat over UDP)", ["kind"], registry=r)
        self.hosts = Gauge("pitstop_coordinator_hosts", "Known hosts by role", ["role"], registry=r)
        self.downtime = Histogram("pitstop_coordinator_evacuation_downtime_seconds",
                                  "Pause an evacuation's jobs saw, from the first rank's pause to the last one's "
                                  "resume (succeeded evacuations)", registry=r,
                                  buckets=(.1, .25, .5, 1, 2, 5, 10, 20, 30, 60, 120, 300))
        self.in_flight = Gauge("pitstop_coordinator_operations_in_flight", "Evacuations not done yet", registry=r)
        self.degraded = Gauge("pitstop_coordinator_hosts_degraded", "Hosts whose GPU health readings are degraded",
                              registry=r)
        Gauge("pitstop_build_info", "pitstop's version (always 1)", ["version", "service"],
              registry=r).labels(__version__, "coordinator").set(1)

    def result(self, result: str, nbytes: int, downtime_s: float | None = None) -> None:
        self.ops.labels(result).inc()
        self.bytes.inc(nbytes)
        if downtime_s is not None:
            self.downtime.observe(downtime_s)


def operation_view(op: dict[str, Any] | None) -> dict[str, Any]:
    """An operation in the AIP-151 shape (None: an operation just read back that is gone, which
    only the retention's pruning between two reads can cause)."""
    if op is None:
        raise NotFound("the operation is no longer recorded", action="list operations with `pitstop ops`")
    md = dict(op["metadata"])
    md.update({"phase": op["phase"], "cancel_requested": op["cancel_requested"], "result": op["result"],
               "create_time": op["created"], "update_time": op["updated"]})
    out: dict[str, Any] = {"name": f"operations/{op['id']}", "done": op["done"], "metadata": md}
    if op["error"]:
        out["error"] = op["error"]
    elif op["response"]:
        out["response"] = op["response"]
    return out


def sync_workers(store: Store, settings: CoordinatorSettings, node: str) -> None:
    """Ask the agents what they run right now: heartbeats may lag a job that just started, and
    the plan (and the consistent cut) must know every rank of the affected jobs.  Each host
    that has heartbeated recently is asked, in parallel, with a short deadline; an agent that
    does not answer is planned with what its heartbeats said.  (For very large fleets this
    should narrow to the hosts of the affected jobs.)"""
    hosts = [h for h in store.hosts() if h["name"] == node or h["age_s"] <= settings.heartbeat_timeout_s]

    def one(h: dict) -> None:
        try:
            with AgentClient(h["url"], settings.cluster_token, timeout=PLAN_SYNC_TIMEOUT_S) as a:
                store.sync_workers(h["name"], a.workers())
        except (PitstopError, httpx.HTTPError, httpx.InvalidURL, ValueError):
            pass  # planned with what its heartbeats said

    in_parallel(one, hosts)


def build(settings: CoordinatorSettings, store: Store | None = None) -> tuple[BeatFastPath, Driver]:
    """The coordinator's ASGI app (the FastAPI app, at `.app`, behind the beats' fast path) and driver."""
    store = store or Store(settings.db)
    metrics = Metrics()
    driver = Driver(store, settings, on_phase=lambda p, s: metrics.phase.labels(p).observe(s),
                    on_result=metrics.result)
    app = FastAPI(title="pitstop coordinator", version=__version__,
                  description="Evacuate GPU hosts without stopping the training jobs on them.")
    install_error_handlers(app)
    policy = settings.health_policy()

    def beat_seen(name: str, generation: str) -> bool:
        """A beat noted in memory; a node that reports again is asked to finish earlier moves' cleanup."""
        if not store.beat(name, generation):
            return False
        driver.node_seen(name)
        return True

    def start_evacuation(node: str, to: str | None, reason: str,
                         idempotency: tuple[str, str] | None = None, post_copy: bool | None = None,
                         pre_copy: bool | None = None, requested_by: str = "the coordinator") -> str:
        sync_workers(store, settings, node)
        p = plan(store, node, to, driver.busy_hosts(), settings.heartbeat_timeout_s)
        if post_copy:
            check_post_copy(p.node)
        return driver.start(p, reason, idempotency, post_copy=post_copy, pre_copy=pre_copy,
                            requested_by=requested_by)

    def validate_evacuation(node: str, body: EvacuateRequest) -> dict[str, Any]:
        """Every check an evacuation makes before anything pauses, and the plan it would follow."""
        sync_workers(store, settings, node)
        p = plan(store, node, body.to, driver.busy_hosts(), settings.heartbeat_timeout_s)
        if body.post_copy:
            check_post_copy(p.node)
        ids = [w["id"] for w in p.leaving]
        t = min(30.0, settings.step_timeout_s)  # an answer now, not a move's patience
        with AgentClient(p.node["url"], settings.cluster_token, timeout=t) as src, \
                AgentClient(p.dest["url"], settings.cluster_token, timeout=t) as dst:
            files = check_files(src, dst, ids)
        err = files.error(p.dest["name"])
        if err:
            raise err
        return {"validate_only": True, "node": node, "destination": p.dest["name"], "workers": ids,
                "jobs": p.jobs, "peers": [w["id"] for w in p.peers],
                "files": {"checked": [w for w in ids if w not in files.unchecked], "unchecked": files.unchecked}}

    def check_post_copy(host: dict[str, Any]) -> None:
        """Refuse post-copy the source cannot serve before anything pauses, not mid-move."""
        try:
            with AgentClient(host["url"], settings.cluster_token, timeout=POST_COPY_CHECK_TIMEOUT_S) as a:
                support = a.info().get("post_copy") or {}
        except (PitstopError, httpx.HTTPError, ValueError) as e:
            raise FailedPrecondition(f"cannot ask {host['name']}'s agent whether it can serve post-copy: "
                                     f"{getattr(e, 'message', None) or e}", code="post_copy_unconfirmed",
                                     action="check that the agent runs and is reachable, or evacuate "
                                            "without post-copy") from None
        if "unavailable" not in support:
            raise FailedPrecondition(f"{host['name']}'s agent is too old to serve post-copy",
                                     code="post_copy_unavailable",
                                     action="upgrade it, or evacuate without post-copy")
        if support["unavailable"]:
            raise FailedPrecondition(f"{host['name']} cannot serve post-copy: {support['unavailable']}",
                                     code="post_copy_unavailable",
                                     action="evacuate without post-copy (the images travel whole)")

    auto = AutoEvacuator(start=lambda node, reason: start_evacuation(node, None, reason,
                                                                     requested_by="the coordinator's health policy"),
                         busy=driver.busy_hosts,
                         has_workers=lambda node: any(w["state"] in LIVE for w in store.workers(host=node)),
                         retry_s=settings.health_retry_s)

    def operator(request: Request) -> None:
        """Reads: the operator token or the read-only token.  Mutations: the operator token only.
        Who asked is kept for the operation's record (requested_by): the certificate's name under
        mutual TLS, and the token that opened the door."""
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

    async def cluster(request: Request) -> None:  # async: no thread hop on the hottest path (beats)
        tls.require_role(request.scope, ("agent",))
        require_token(request, settings.cluster_token, "cluster", "PITSTOP_CLUSTER_TOKEN")

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.get("/metrics")
    def prom() -> Response:
        hs = store.hosts()
        roles = dict.fromkeys(ROLES, 0)  # a role with no host left reads 0, so "no spare left" can alert
        for h in hs:
            roles[h["role"]] = roles.get(h["role"], 0) + 1
        for role, n in roles.items():
            metrics.hosts.labels(role).set(n)
        metrics.degraded.set(sum(1 for h in hs if (h.get("health") or {}).get("degraded")))
        metrics.in_flight.set(len(store.ops(running_only=True)))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    agents = APIRouter(prefix="/v1", dependencies=[Depends(cluster)], tags=["agents"])

    @agents.post("/agents:heartbeat")
    def heartbeat(hb: Heartbeat) -> dict:
        reasons = policy.evaluate(hb.gpu_health)
        store.heartbeat({**hb.model_dump(), "health": {"degraded": bool(reasons), "reasons": reasons}})
        driver.node_seen(hb.name)
        metrics.heartbeats.labels("full").inc()
        if settings.auto_evacuate:
            auto.verdict(hb.name, reasons)
        return {"ok": True, "beat_udp_port": settings.host_port()[1] if settings.beat_udp else None}

    @agents.post("/agents:beat", responses={409: {"description": "no full report of this generation: send one"}})
    async def beat(b: Beat) -> dict:
        """Runs on the event loop and touches only memory (Store.beat): 10,000 agents send one a second."""
        if not beat_seen(b.name, b.generation):
            raise Conflict(f"no full report of generation {b.generation} from {b.name}", code="resync",
                           action="send a full report (POST /v1/agents:heartbeat), then beat again")
        metrics.heartbeats.labels("beat").inc()
        if b.gpu_health is not None:
            reasons = policy.evaluate(b.gpu_health)
            store.set_health(b.name, b.gpu_health, {"degraded": bool(reasons), "reasons": reasons})
            if settings.auto_evacuate:
                auto.verdict(b.name, reasons)
        return {"ok": True}

    ops = APIRouter(prefix="/v1", dependencies=[Depends(operator)], tags=["operators"])

    @ops.get("/hosts")
    def hosts() -> list[dict]:
        hs = store.hosts()
        for h in hs:
            if h["name"] in auto.status:
                h["auto_evacuation"] = auto.status[h["name"]]
        return hs

    @ops.post("/hosts/{name}:uncordon")
    def uncordon_host(name: str) -> dict:
        """Return an evacuated (drained) host to service: spare if its agent offers itself, else active."""
        return lifecycle.uncordon(store, name, driver.busy_hosts())

    @ops.post("/hosts/{name}:setRole")
    def set_host_role(name: str, body: SetRoleRequest) -> dict:
        return lifecycle.set_role(store, name, body.role, driver.busy_hosts())

    @ops.delete("/hosts/{name}")
    def remove_host(name: str) -> dict:
        """Forget a host whose agent is gone and that runs nothing."""
        return lifecycle.remove(store, name, driver.busy_hosts(), settings.heartbeat_timeout_s)

    @ops.get("/jobs")
    def jobs() -> list[dict]:
        by: dict[str, list] = {}
        for w in store.workers():
            by.setdefault(w["job"], []).append(w)
        return [{"job": j, "workers": ws, "hosts": sorted({w["host"] for w in ws}),
                 "state": "running" if any(w["state"] in ("running", "paused", "capturing", "stopped")
                                           for w in ws) else "finished",
                 "movable": not unmovable_workers(ws)} for j, ws in sorted(by.items())]

    @ops.get("/operations")
    def operations(node: str | None = Query(None, max_length=253, description="only those of this host"),
                   done: bool | None = Query(None, description="true: finished ones only; false: running ones"),
                   before: float | None = Query(None, description="a page: created before this time (the "
                                                "oldest `created` of the previous page)"),
                   limit: int | None = Query(None, ge=1, le=1000, description="at most this many, the newest")
                   ) -> list[dict]:
        return [operation_view(o) for o in store.ops(node=node, done=done, before=before, limit=limit)]

    @ops.get("/operations/{op_id}")
    def operation(op_id: str) -> dict:
        op = store.op(op_id.removeprefix("operations/"))
        if op is None:
            raise NotFound(f"no operation {op_id!r}", action="list operations with `pitstop ops`")
        return operation_view(op)

    @ops.post("/nodes/{node}:evacuate", status_code=202)
    def evacuate(node: str, request: Request, body: EvacuateRequest | None = None,
                 idempotency_key: str | None = Header(None, max_length=200)) -> JSONResponse:
        body = body or EvacuateRequest()
        if body.validate_only:
            return JSONResponse(validate_evacuation(node, body))
        fields = body.model_dump()
        del fields["validate_only"]
        for f in ("post_copy", "pre_copy"):  # unset as before the field existed: a retry across an upgrade matches
            if fields[f] is None:
                del fields[f]
        digest = hashlib.sha256(json.dumps({"node": node, **fields}, sort_keys=True).encode()).hexdigest()
        if idempotency_key:
            seen = store.idempotent(idempotency_key)
            if seen:
                if seen[0] != digest:
                    raise Unprocessable("this Idempotency-Key was used with a different request",
                                        code="idempotency_key_reused",
                                        action="use a new key for a new request", details={"operation": seen[1]})
                return JSONResponse(operation_view(store.op(seen[1])), status_code=202)
        op_id = start_evacuation(node, body.to, body.reason, (idempotency_key, digest) if idempotency_key else None,
                                 post_copy=body.post_copy, pre_copy=body.pre_copy,
                                 requested_by=getattr(request.state, "requested_by", "") or "unknown")
        return JSONResponse(operation_view(store.op(op_id)), status_code=202)

    @ops.post("/operations/{op_id}:cancel")
    def cancel(op_id: str) -> dict:
        op = store.op(op_id.removeprefix("operations/"))
        if op is None:
            raise NotFound(f"no operation {op_id!r}", action="list operations with `pitstop ops`")
        if op["done"]:
            raise Conflict(f"operation {op['id']} is already done ({op['result']})", action="nothing to cancel")
        if op["metadata"].get("committed"):
            raise Conflict(f"operation {op['id']} is past its commit point", code="past_commit_point",
                           action="it will finish; evacuate the destination to move the workers again")
        store.request_cancel(op["id"])
        return operation_view(store.op(op["id"]))

    app.include_router(agents)
    app.include_router(ops)
    return BeatFastPath(app, beat=beat_seen, token=settings.cluster_token,
                        count=metrics.heartbeats.labels("beat").inc,
                        count_udp=metrics.heartbeats.labels("beat_udp").inc), driver
