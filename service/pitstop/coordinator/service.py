"""The coordinator process: its store, driver, metrics and health policy, and the decisions the
operator API asks of them (plan and start an evacuation, or only validate one).

One `Coordinator` per process, built by coordinator/api.py and reached by every route through
the app's state (`CoordinatorDep`), so that routes are declared once, at module level
(coordinator/routes.py), and the decisions live here rather than in closures around them.
"""

from __future__ import annotations

import threading
from typing import Annotated, Any

import httpx
from fastapi import Depends, Request
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pitstop import __version__
from pitstop.coordinator import takeover
from pitstop.coordinator.database import open_store
from pitstop.coordinator.driver import Driver
from pitstop.coordinator.fanout import in_parallel
from pitstop.coordinator.filecheck import check_files
from pitstop.coordinator.health_policy import AutoEvacuator
from pitstop.coordinator.leadership import Leadership
from pitstop.coordinator.operations import Operations
from pitstop.coordinator.planner import plan
from pitstop.coordinator.recovery import Recoveries
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.snapshots import Snapshots
from pitstop.coordinator.store import LIVE, BaseStore, JobOwner
from pitstop.coordinator.timeouts import (
    ATTACH_OUTPUT_TIMEOUT_S,
    PLAN_SYNC_TIMEOUT_S,
    POST_COPY_CHECK_TIMEOUT_S,
    SIGNAL_TIMEOUT_S,
)
from pitstop.errors import Conflict, FailedPrecondition, Forbidden, NotFound, PitstopError
from pitstop.wire.agent_client import AgentClient, Fence
from pitstop.wire.coordinator_requests import EvacuateRequest
from pitstop.wire.evacuation import AfterMove
from pitstop.wire.store_rows import StoredHost, StoredOp, StoredWorker

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
        self.cordoned = Gauge("pitstop_coordinator_hosts_cordoned", "Cordoned hosts (out of the spare pool) by role",
                              ["role"], registry=r)
        self.downtime = Histogram("pitstop_coordinator_evacuation_downtime_seconds",
                                  "Pause an evacuation's jobs saw, from the first rank's pause to the last one's "
                                  "resume (succeeded evacuations)", registry=r,
                                  buckets=(.1, .25, .5, 1, 2, 5, 10, 20, 30, 60, 120, 300))
        self.first_collectives = Histogram(
            "pitstop_coordinator_move_first_collectives_seconds",
            "From a move's last resume until every rank's first collective after it had returned "
            "(jobs whose collectives the NCCL shim counts)", registry=r,
            buckets=(.01, .025, .05, .1, .25, .5, 1, 2, 5, 10, 30))
        self.back_to_speed = Histogram(
            "pitstop_coordinator_move_back_to_speed_seconds",
            "From a move's last resume until the job's collective rate was back to 90 % of its rate before",
            registry=r, buckets=(.1, .25, .5, 1, 2, 5, 10, 30, 60))
        self.first_step = Histogram(
            "pitstop_coordinator_move_first_step_seconds",
            "From a move's last resume until every rank had done a whole step's work (its operations per "
            "step, from the NCCL shim's trail of them, and one more)", registry=r,
            buckets=(.05, .1, .25, .5, 1, 2, 5, 10, 30, 60))
        self.step_time_ratio = Histogram(
            "pitstop_coordinator_move_step_time_ratio",
            "A job's step time after a move over its step time before (its collective rate before over after)",
            registry=r, buckets=(.5, .8, .9, .95, 1.0, 1.05, 1.1, 1.25, 1.5, 2, 4))
        self.in_flight = Gauge("pitstop_coordinator_operations_in_flight", "Evacuations not done yet", registry=r)
        self.leader = Gauge("pitstop_coordinator_leader", "1 while this coordinator leads, 0 while it stands by "
                            "(coordinator/leadership.py)", registry=r)
        self.term = Gauge("pitstop_coordinator_term", "The lease's term as this coordinator last read it", registry=r)
        self.leader_since = Gauge("pitstop_coordinator_leader_since_seconds", "When the coordinator that leads took "
                                  "the lease (unix time)", registry=r)
        self.term_changes = Counter("pitstop_coordinator_term_changes_total", "New terms this coordinator has seen "
                                    "(its own included): each is a change of leader", registry=r)
        self._term_changes_counted = 0
        self.degraded = Gauge("pitstop_coordinator_hosts_degraded", "Hosts whose GPU health readings are degraded",
                              registry=r)
        Gauge("pitstop_build_info", "pitstop's version (always 1)", ["version", "service"],
              registry=r).labels(__version__, "coordinator").set(1)
        self.protected = Gauge("pitstop_job_protected", "1 where a running job that asked for snapshots has a "
                               "recent committed one (it would be recovered from it), else 0", ["pitstop_job"], registry=r)
        self.snapshot_age = Gauge("pitstop_job_snapshot_age_seconds", "Age of a running job's newest committed "
                                  "snapshot", ["pitstop_job"], registry=r)
        self.snapshot_paused = Gauge("pitstop_job_snapshot_paused_seconds", "Seconds a job's snapshots paused it "
                                     "since this coordinator began", ["pitstop_job"], registry=r)
        self.recoveries = Counter("pitstop_coordinator_recoveries_total", "Recoveries of jobs from their snapshots, "
                                  "by result", ["result"], registry=r)
        self.recovery_detection = Histogram(
            "pitstop_coordinator_recovery_detection_seconds", "From a host's failure (its last beat, or its ranks' "
            "first end) until the coordinator began recovering its jobs", registry=r,
            buckets=(1, 2, 5, 10, 15, 20, 30, 60, 120, 300))
        self.recovery_pause = Histogram(
            "pitstop_coordinator_recovery_pause_seconds", "A recovered job's pause, from its survivors' stop to every "
            "rank's resume (succeeded recoveries)", registry=r, buckets=(.25, .5, 1, 2, 5, 10, 20, 30, 60, 120, 300))
        self.recovery_redone = Histogram(
            "pitstop_coordinator_recovery_work_redone_seconds", "The work a recovered job does again: its time "
            "since the snapshot it was rolled back to", registry=r, buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600))

    def leadership(self, view: dict[str, Any] | None) -> None:
        """The leadership gauges, from Leadership.view() (None: a coordinator that leads alone)."""
        if view is None:
            self.leader.set(1)
            return
        self.leader.set(1 if view["role"] == "leader" else 0)
        if view.get("term") is not None:
            self.term.set(view["term"])
        if view.get("since") is not None:
            self.leader_since.set(view["since"])
        new = view.get("term_changes", 0) - self._term_changes_counted
        if new > 0:
            self.term_changes.inc(new)
            self._term_changes_counted += new

    def recovered(self, md: dict[str, Any]) -> None:
        """A recovery ended: its result, and for one that succeeded its pause and work redone."""
        self.recoveries.labels(md.get("result") or "failed").inc()
        if md.get("detected_after_s") is not None:
            self.recovery_detection.observe(md["detected_after_s"])
        if md.get("result") == "succeeded":
            if md.get("pause_s") is not None:
                self.recovery_pause.observe(md["pause_s"])
            if md.get("lost_s") is not None:
                self.recovery_redone.observe(md["lost_s"])

    def protection(self, jobs: list[dict[str, Any]], paused: dict[str, float]) -> None:
        """The jobs' protection gauges, as of now (a job no longer running leaves them)."""
        for g in (self.protected, self.snapshot_age, self.snapshot_paused):
            g.clear()
        for j in jobs:
            p = j.get("protection")
            if not p:
                continue
            self.protected.labels(j["job"]).set(1 if p["protected"] else 0)
            if p["age_s"] is not None:
                self.snapshot_age.labels(j["job"]).set(p["age_s"])
            self.snapshot_paused.labels(j["job"]).set(paused.get(j["job"], 0.0))

    def after_move(self, a: AfterMove) -> None:
        if a.first_collectives_s is not None:
            self.first_collectives.observe(a.first_collectives_s)
        if a.back_to_speed_s is not None:
            self.back_to_speed.observe(a.back_to_speed_s)
        if a.first_step_s is not None:
            self.first_step.observe(a.first_step_s)
        if a.step_time_ratio is not None:
            self.step_time_ratio.observe(a.step_time_ratio)

    def result(self, result: str, nbytes: int, downtime_s: float | None = None) -> None:
        self.ops.labels(result).inc()
        self.bytes.inc(nbytes)
        if downtime_s is not None:
            self.downtime.observe(downtime_s)


def operation_view(op: StoredOp | None) -> dict[str, Any]:
    """An operation in the AIP-151 shape (None: an operation just read back that is gone, which
    only the retention's pruning between two reads can cause)."""
    if op is None:
        raise NotFound("the operation is no longer recorded", action="list operations with `pitstop ops`")
    md = dict(op.metadata)
    md.update({"phase": op.phase, "cancel_requested": op.cancel_requested, "result": op.result,
               "create_time": op.created, "update_time": op.updated})
    out: dict[str, Any] = {"name": f"operations/{op.id}", "done": op.done, "metadata": md}
    if op.error:
        out["error"] = op.error
    elif op.response:
        out["response"] = op.response
    return out


def sync_workers(store: BaseStore, settings: CoordinatorSettings, node: str, fence: Fence | None = None) -> None:
    """Ask the agents what they run right now: heartbeats may lag a job that just started, and
    the plan (and the consistent cut) must know every rank of the affected jobs.  Each host
    that has heartbeated recently is asked, in parallel, with a short deadline; an agent that
    does not answer is planned with what its heartbeats said.  (For very large fleets this
    should narrow to the hosts of the affected jobs.)"""
    hosts = [h for h in store.hosts() if h.name == node or h.age_s <= settings.heartbeat_timeout_s]

    def one(h: StoredHost) -> None:
        try:
            with AgentClient(h.url, settings.cluster_token, timeout=PLAN_SYNC_TIMEOUT_S, fence=fence) as a:
                store.sync_workers(h.name, [w.model_dump(mode="json") for w in a.workers()])
        except (PitstopError, httpx.HTTPError, httpx.InvalidURL, ValueError):
            pass  # planned with what its heartbeats said

    in_parallel(one, hosts)


class Coordinator:
    """Everything one coordinator process holds; shared by every route."""

    def __init__(self, settings: CoordinatorSettings, store: BaseStore | None = None,
                 lead: Leadership | None = None) -> None:
        """lead: this coordinator's side of the lease (server.py); None: a coordinator that always
        acts, with no other beside it (in-process tests)."""
        self.settings = settings
        self.store = store or open_store(settings.db)
        self.lead = lead
        # Set once this process's takeover (its reconcile) has run: until then the duties (the
        # watchdog, the snapshot schedule, failure detection) stand still, or a new leader's
        # watchdog would run a recovery the reconcile is about to run too (two runs of one
        # recovery racing for its spare), and a host silent while nobody led would be declared
        # failed before the takeover excuses that time.
        self._taken_over = threading.Event()
        self.fence: Fence | None = lead  # every call to an agent carries the lease's term
        self.metrics = Metrics()
        # one framework runs, watches and reconciles the evacuations and the recoveries (operations.py)
        self.operations = Operations(self.store, settings)
        self.driver = Driver(self.store, settings, on_phase=lambda p, s: self.metrics.phase.labels(p).observe(s),
                             on_result=self.metrics.result, on_after_move=self.metrics.after_move, fence=lead,
                             operations=self.operations)
        self.snapshots = Snapshots(self.store, settings, self.driver.busy_hosts, fence=lead)
        self.recoveries = Recoveries(self.store, settings, self.snapshots, self.driver.busy_hosts,
                                     on_done=self.metrics.recovered, fence=lead, operations=self.operations)
        self.policy = settings.health_policy()
        self.auto = AutoEvacuator(
            start=lambda node, reason: self.start_evacuation(node, None, reason,
                                                             requested_by="the coordinator's health policy"),
            busy=self.driver.busy_hosts,
            has_workers=lambda node: any(w.state in LIVE for w in self.store.workers(host=node)),
            retry_s=settings.health_retry_s)

    def leading(self) -> bool:
        """Whether this coordinator acts (a standby only reads: coordinator/leadership.py)."""
        return self.lead is None or self.lead.leading()

    def on_duty(self) -> bool:
        """Whether the leader's background duties run now: it leads and its takeover is done."""
        return self.leading() and (self.lead is None or self._taken_over.is_set())

    def take_over(self, term: int, gap_s: float) -> list[str]:
        """This coordinator took the lease (at its start, or a standby when the leader was lost):
        every operation in flight resumed through the path a restarted coordinator takes.
        gap_s: how long no coordinator led (the last one's last renewal until now); hosts are not
        held silent for that time (coordinator/takeover.py)."""
        try:
            return takeover.take_over(self, term, gap_s)
        finally:  # even a takeover that failed half way: the watchdog then adopts what it left
            self._taken_over.set()

    def beat_seen(self, name: str, generation: str) -> bool | None:
        """A beat noted in memory (contact, whatever its generation); a node that reports again is
        asked to finish earlier moves' cleanup.  False: ask it for a full report (or, on a
        standby, send it to the leader).  None: this coordinator is stopping, and says nothing: a
        "send a full report" from it would bring every agent's full report to the next leader
        (or to itself, restarted), which has the last one already."""
        if self.lead is not None and self.lead.stopping():
            return None
        if not self.leading() or not self.store.beat(name, generation):
            return False
        self.driver.node_seen(name)
        return True

    def start_evacuation(self, node: str, to: str | None, reason: str,
                         idempotency: tuple[str, str] | None = None, post_copy: bool | None = None,
                         pre_copy: bool | None = None, requested_by: str = "the coordinator") -> str:
        s = self.settings
        sync_workers(self.store, s, node, self.fence)
        p = plan(self.store, node, to, self.driver.busy_hosts(), s.heartbeat_timeout_s)
        if post_copy:
            self.check_post_copy(p.node)
        return self.driver.start(p, reason, idempotency, post_copy=post_copy, pre_copy=pre_copy,
                                 requested_by=requested_by)

    def validate_evacuation(self, node: str, body: EvacuateRequest) -> dict[str, Any]:
        """Every check an evacuation makes before anything pauses, and the plan it would follow."""
        s = self.settings
        sync_workers(self.store, s, node, self.fence)
        p = plan(self.store, node, body.to, self.driver.busy_hosts(), s.heartbeat_timeout_s)
        if body.post_copy:
            self.check_post_copy(p.node)
        ids = [w.id for w in p.leaving]
        t = min(30.0, s.step_timeout_s)  # an answer now, not a move's patience
        with AgentClient(p.node.url, s.cluster_token, timeout=t, fence=self.fence) as src, \
                AgentClient(p.dest.url, s.cluster_token, timeout=t, fence=self.fence) as dst:
            files = check_files(src, dst, ids)
        err = files.error(p.dest.name)
        if err:
            raise err
        return {"validate_only": True, "node": node, "destination": p.dest.name, "workers": ids,
                "jobs": p.jobs, "peers": [w.id for w in p.peers],
                "files": {"checked": [w for w in ids if w not in files.unchecked], "unchecked": files.unchecked}}

    def check_post_copy(self, host: StoredHost) -> None:
        """Refuse post-copy the source cannot serve before anything pauses, not mid-move."""
        try:
            with AgentClient(host.url, self.settings.cluster_token, timeout=POST_COPY_CHECK_TIMEOUT_S,
                             fence=self.fence) as a:
                support = a.info().get("post_copy") or {}
        except (PitstopError, httpx.HTTPError, ValueError) as e:
            raise FailedPrecondition(f"cannot ask {host.name}'s agent whether it can serve post-copy: "
                                     f"{getattr(e, 'message', None) or e}", code="post_copy_unconfirmed",
                                     action="check that the agent runs and is reachable, or evacuate "
                                            "without post-copy") from None
        if "unavailable" not in support:
            raise FailedPrecondition(f"{host.name}'s agent is too old to serve post-copy",
                                     code="post_copy_unavailable",
                                     action="upgrade it, or evacuate without post-copy")
        if support["unavailable"]:
            raise FailedPrecondition(f"{host.name} cannot serve post-copy: {support['unavailable']}",
                                     code="post_copy_unavailable",
                                     action="evacuate without post-copy (the images travel whole)")

    def signal_job(self, job: str, sig: int) -> dict[str, Any]:
        """A signal for every rank of a job (`pitstop stop|kill JOB`), delivered by the agent each
        rank runs under now: what each agent said, per rank.  The agents are asked what they run
        first, so a rank that just moved or started is not missed."""
        sync_workers(self.store, self.settings, "", self.fence)
        ws = [w for w in self.store.workers(job=job) if w.state in LIVE]
        if not ws:
            raise NotFound(f"job {job!r} has no running ranks", code="no_such_job",
                           action="list jobs and their ranks with `pitstop jobs`")
        urls = {h.name: h.url for h in self.store.hosts()}
        results: list[dict[str, Any]] = []
        in_parallel(lambda w: results.append(self._signal(w, sig, urls)), ws)
        return {"job": job, "signal": sig, "workers": sorted(results, key=lambda r: r["worker"])}

    def signal_worker(self, wid: str, sig: int) -> dict[str, Any]:
        """A signal for one rank (its launcher's, passed through its handle), where it runs now."""
        job = wid.rpartition(".")[0]
        sync_workers(self.store, self.settings, "", self.fence)
        w = next((x for x in self.store.workers(job=job) if x.id == wid), None)
        if w is None or w.state not in LIVE:
            raise NotFound(f"worker {wid} does not run", code="no_such_worker",
                           action="it ended; its launcher reports its exit status")
        return self._signal(w, sig, {h.name: h.url for h in self.store.hosts()})

    def _signal(self, w: StoredWorker, sig: int, urls: dict[str, str]) -> dict[str, Any]:
        r: dict[str, Any] = {"worker": w.id, "host": w.host, "delivered": False}
        try:
            with AgentClient(urls[w.host], self.settings.cluster_token, timeout=SIGNAL_TIMEOUT_S,
                             fence=self.fence) as a:
                r["delivered"] = bool(a.signal(w.id, sig).get("delivered"))
        except PitstopError as e:
            r.update(error=e.message, code=e.code)
        except (httpx.HTTPError, KeyError, ValueError) as e:
            r.update(error=f"cannot reach {w.host}'s agent: {e!r}", code="unavailable")
        return r

    def claim(self, host: str, job: str, rank: int, owner_uid: int | None = None,
              privileged: bool = False) -> dict[str, Any]:
        """Refuse a rank that another live host runs already (every srun task registering as
        rank 0, a launcher started twice), or a rank of a job whose ranks are another user's
        (owner_uid: who registers it; privileged: root, who acts for anyone); else record it on `host`."""
        wid = f"{job}.{rank}"
        got = self.store.claim_worker(host, wid, job, rank, self.settings.heartbeat_timeout_s, owner_uid, privileged)
        if isinstance(got, JobOwner):
            raise Forbidden(f"uid {owner_uid} may not add rank {rank} to job {job}: its ranks belong to uid {got.uid}",
                            code="not_your_job", action="give your job a name of its own (--job), or ask root")
        if got:
            raise Conflict(f"rank {rank} of job {job} already runs on {got} (worker {wid})",
                           code="duplicate_rank",
                           action="give each process of the job its own rank: --rank N, or RANK (torchrun), or "
                                  "SLURM_PROCID (srun) reaching `pitstop run`; or use another job id")
        return {"worker": wid, "host": host}

    def worker_output(self, wid: str, stream: str, offset: int) -> tuple[bytes, dict[str, str]]:
        """A worker's output from `offset` and its state (exit code once it ended), from the agent
        of the host it runs on now or ran on last: the job's handle for whoever no longer has its
        launcher (`pitstop attach`)."""
        job = wid.rpartition(".")[0]
        w = next((x for x in self.store.workers(job=job) if x.id == wid), None)
        if w is None:
            raise NotFound(f"no worker {wid!r} is known", code="no_such_worker",
                           action="list jobs and their ranks with `pitstop jobs` (a worker is JOB.RANK)")
        h = self.store.host(w.host)
        if h is None:
            return b"", {"x-pitstop-state": "unreachable", "x-pitstop-error": f"host {w.host} is not known"}
        try:
            with AgentClient(h.url, self.settings.cluster_token, timeout=ATTACH_OUTPUT_TIMEOUT_S, fence=self.fence) as a:
                return a.output(wid, stream, offset)
        except PitstopError as e:
            return b"", {"x-pitstop-state": "unreachable", "x-pitstop-error": e.message[:200]}

    def health_verdict(self, name: str, reasons: list[str]) -> None:
        """What the health policy concluded of a host's readings, acted on when auto-evacuation is on."""
        if self.settings.auto_evacuate:
            self.auto.verdict(name, reasons)


async def current(request: Request) -> Coordinator:
    """The coordinator behind the app that received the request (async: resolved on the event
    loop, without a hop to the thread pool on the beats' path)."""
    c: Coordinator = request.app.state.coordinator
    return c


CoordinatorDep = Annotated[Coordinator, Depends(current)]
