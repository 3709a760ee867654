"""Recovery of a job whose host died, from its last committed snapshot (an AIP-151 operation,
`POST /v1/jobs/{job}:recover`, started by the coordinator itself when a host of a job with
snapshots goes silent).

Phases, each written to the operation before it starts:
  plan     the committed snapshot, the lost host, a spare; every part it needs must exist: the
           survivors' own copies and the lost host's replicas on live buddies.  If not, the
           operation fails saying so (the job must restart from its own checkpoint): a job is
           never resumed from a mix of snapshots.
  fence    the lost host is fenced for the job: its reports of the job's workers are ignored, and
           if its agent comes back it is told to kill them before anything else (epoch: this
           operation)
  stop     every surviving rank is ended (its launcher follows the copy restored next)
  restore  the lost host's ranks are sent from their replicas to the spare and restored there;
           every survivor is restored from its own host's copy; all of them stopped
  resume   every rank of the job continues, from the snapshot's step
Recovery is idempotent: every phase can run again from the start (a failed spare is replaced by
another one, a restarted coordinator runs the operation again).  When no spare can take the
ranks, every restored copy is ended and the operation fails saying so: nothing runs half.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import structlog

from pitstop import faults
from pitstop.coordinator import progress
from pitstop.coordinator.fanout import each_while_heard, in_parallel, while_heard
from pitstop.coordinator.planner import healthy, usable_spare
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.snapshots import Snapshots, job_cut
from pitstop.coordinator.store import BaseStore, StoreUnavailable
from pitstop.coordinator.timeouts import RECOVERY_AGENT_TIMEOUT_S, TAKEOVER_BACKOFF_MAX_S
from pitstop.errors import Conflict, FailedPrecondition, NotFound, PitstopError
from pitstop.wire.agent_client import AgentClient, Fence
from pitstop.wire.recovery_state import TYPE_URL, RecoveryState
from pitstop.wire.snapshot_record import SnapshotPart

log = structlog.get_logger("pitstop.coordinator.recovery")

CRASH_WINDOW_S = 2.0  # a host's ranks of a job that all failed within this of each other failed "at once"
CRASH_RECOVERIES_PER_HOUR = 3  # a job whose ranks keep failing so is then left to its operator
CRASH_BY = "the coordinator (ranks failed"
REPORTED_SINCE_S = 1.5  # agents report every second: a host not heard this long after a crash may be dying too
SPARE_TRIES = 2


def is_recovery(op: dict[str, Any]) -> bool:
    return op["metadata"].get("@type") == TYPE_URL


class Unrecoverable(FailedPrecondition):
    code = "unrecoverable"


@dataclass(frozen=True)
class Plan:
    """A recovery as settled in its first phase, and carried by every later one."""

    job: str
    lost: str                         # the failed host
    number: int                       # the committed snapshot everything is rolled back to
    nccl: bool                        # its ranks were parked at the NCCL cut: communicators re-created after
    parts: dict[str, SnapshotPart]  # worker -> its part's host, rank and buddy, as the snapshot's record has them
    lost_parts: dict[str, SnapshotPart]  # the failed host's workers: restored on a spare from replicas
    survivors: dict[str, list[str]]   # host -> its workers: rolled back there from its own parts
    alive: set[str]                   # hosts heard from, the failed one aside
    # an NCCL job's progress at the snapshot (per worker): operations issued, and a step's operations
    issued_at: dict[str, int]
    ops_per_step: dict[str, int]
    lost_heard: bool                  # the failed host's agent still reports (an operator's recovery)


class Recoveries:
    def __init__(self, store: BaseStore, settings: CoordinatorSettings, snapshots: Snapshots,
                 busy: Any, on_done: Callable[[dict[str, Any]], None] = lambda md: None,
                 fence: Fence | None = None) -> None:
        self.store, self.s, self.snaps, self.busy = store, settings, snapshots, busy
        self.fence = fence  # the leader's term on every call to an agent (coordinator/leadership.py)
        self.on_done = on_done  # the metrics, once a recovery's record is final
        self._local = threading.local()
        self._threads_lock = threading.Lock()
        self.threads: dict[str, threading.Thread] = {}  # recovery -> the thread of this process driving it
        self.takeovers: dict[str, tuple[int, float]] = {}  # recovery -> (times taken over, not again before)
        self.unwritten: dict[str, dict[str, Any]] = {}  # recovery -> its last record, refused by the database

    # -- detection ----------------------------------------------------------------------------
    def failed_hosts(self, job: str) -> list[str]:
        """Hosts of the job silent past the failure deadline: ones whose ranks still ran when they
        went quiet (power lost, the link cut first), and ones whose ranks ended without being asked
        to since the job's snapshot, then went quiet (the kernel, a crashing driver or the OOM
        killer took the processes first, then the host went down).  Not a job that ended: one of
        its ranks exited 0, or its end was asked for."""
        return sorted(h for h, _ in self._silent(job))

    def _silent(self, job: str) -> list[tuple[str, bool]]:
        """(host, whether its ranks had ended before it went silent) for failed_hosts."""
        hosts = {h["name"]: h for h in self.store.hosts()}
        ws = self.store.workers(job=job)
        snap = self.snaps.committed(job)
        since = max(snap.created if snap else float("inf"), self._last_recovery_end(job))
        over = any(w["state"] == "exited" and w.get("exit_code") == 0 or w.get("end_asked") for w in ws)
        out: dict[str, bool] = {}
        for w in ws:
            h = hosts.get(w["host"])
            if h is None or healthy(h, self.s.failure_deadline_s):
                continue
            if w["state"] in ("running", "paused", "capturing", "stopped"):
                out[w["host"]] = False
            elif w["state"] in ("exited", "lost") and not over and float(w.get("ended_at") or 0) >= since:
                out.setdefault(w["host"], True)
        return sorted(out.items())

    def _last_recovery_end(self, job: str) -> float:
        """When the job's last recovery ended: ends before it are what that recovery answered."""
        return max((op["updated"] for op in self.store.ops(done=True) if is_recovery(op)
                    and op["metadata"].get("job") == job), default=0.0)

    def crashed_host(self, job: str) -> tuple[str, str] | None:
        """A host still heard from on which every rank of the job failed at once since its last
        snapshot (a GPU fallen off the bus, the kernel killing them, a host that kept its agent but
        lost what ran on it): (host, why), or None.

        The ranks' peers on other hosts usually fail moments later (their collectives break), so
        the host whose ranks failed first is the one taken; the others are rolled back with the
        job as always; ends from before the job's last recovery ended never count (that recovery
        answered them).  Never a job that ended: one rank exited 0 (it finished), or an end was
        asked for (a signal its launcher forwarded, `pitstop stop|kill`).  A job whose own code
        fails looks the same; it is recovered at most CRASH_RECOVERIES_PER_HOUR times an hour,
        then left to its operator."""
        snap = self.snaps.committed(job)
        if snap is None:
            return None
        ws = self.store.workers(job=job)
        if any(w["state"] == "exited" and w.get("exit_code") == 0 or w.get("end_asked") for w in ws):
            return None
        hosts = {h["name"]: h for h in self.store.hosts()}
        fenced = {f["host"] for f in self.store.fences() if f["job"] == job}
        by_host: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for w in ws:
            by_host[w["host"]].append(w)
        found = []
        for host, on in by_host.items():
            h = hosts.get(host)
            if h is None or host in fenced or not healthy(h, self.s.failure_deadline_s):
                continue  # a silent host is failed_hosts' to find
            ends = [float(w["ended_at"]) for w in on if w["state"] in ("exited", "lost") and w.get("ended_at")]
            if not ends or len(ends) != len(on):
                continue
            first, last = min(ends), max(ends)
            if first >= snap.created and last - first <= CRASH_WINDOW_S:
                found.append((first, host))
        # ends from before the job's last recovery ended are what that recovery answered (it restored or
        # rolled back every rank), not a new failure: the hosts' reports of the restored ranks lag a beat
        since = self._last_recovery_end(job) if found else 0.0
        found = [(first, host) for first, host in found if first >= since]
        if not found:
            return None
        first, host = min(found)
        # every other host of the job reported since: one that did not may be dying itself (its ranks'
        # peers fail first then), and the silent host is the one to recover; wait for the next tick
        if any(hosts[o]["last_seen"] < first + REPORTED_SINCE_S for o in by_host if o != host and o in hosts):
            return None
        return host, (f"every rank of the job on {host} failed within {CRASH_WINDOW_S:g} s of each other, "
                      "before any other host's")

    def _recent_crash_recoveries(self, job: str) -> int:
        since = time.time() - 3600
        return sum(1 for op in self.store.ops() if is_recovery(op) and op["metadata"].get("job") == job
                   and op["created"] >= since and op["metadata"].get("requested_by", "").startswith(CRASH_BY))

    def tick(self) -> None:
        """Start a recovery for every job with a committed snapshot that lost a host (silent, or
        every rank on it failed at once); tell a fenced host that came back to end its old workers."""
        for job in self.store.snapshot_jobs():
            if self.running(job) or self.snaps.committed(job) is None:
                continue
            silent = self._silent(job)
            live = [h for h, ended_first in silent if not ended_first]
            if live:
                self._start_by_itself(job, live[0], "the coordinator (host silent past "
                                                    f"{self.s.failure_deadline_s:g} s)")
                continue
            if silent:  # its ranks ended first, then it went quiet: counted as a crash (its code may be what fails)
                if self._recent_crash_recoveries(job) < CRASH_RECOVERIES_PER_HOUR:
                    self._start_by_itself(job, silent[0][0], f"{CRASH_BY} on {silent[0][0]} without being asked to, "
                                          f"then it was silent past {self.s.failure_deadline_s:g} s)")
                continue
            crashed = self.crashed_host(job)
            if crashed is None:
                continue
            if self._recent_crash_recoveries(job) >= CRASH_RECOVERIES_PER_HOUR:
                if self.snaps.errors.get(job, "").startswith("not recovered"):
                    continue
                self.snaps.errors[job] = (f"not recovered by itself: {crashed[1]}, and the job was recovered so "
                                          f"{CRASH_RECOVERIES_PER_HOUR} times in the last hour (its own code may be what "
                                          "fails); `pitstop recover JOB --node HOST` to try again")
                log.error("a job whose ranks keep failing is left to its operator", job=job, host=crashed[0])
                continue
            self._start_by_itself(job, crashed[0], f"{CRASH_BY}: {crashed[1]})")
        self.enforce_fences()

    def _start_by_itself(self, job: str, host: str, why: str) -> None:
        try:
            self.start(job, host, requested_by=why)
        except PitstopError as e:
            log.error("could not start a recovery", job=job, host=host, error=e.message)

    def enforce_fences(self) -> None:
        """A fenced host that reports again ends the job's old workers before anything else."""
        hosts = {h["name"]: h for h in self.store.hosts()}
        for f in self.store.fences(unacked=True):
            h = hosts.get(f["host"])
            if h is None or not healthy(h, self.s.heartbeat_timeout_s):
                continue
            try:
                with AgentClient(h["url"], self.s.cluster_token, timeout=RECOVERY_AGENT_TIMEOUT_S, fence=self.fence) as c:
                    got = c.fence(f["job"], f["epoch"], "the coordinator fenced this host")
                self.store.ack_fence(f["job"], f["host"])
                log.warning("a fenced host came back; its old workers were ended", job=f["job"], host=f["host"],
                            killed=got.get("killed"))
            except PitstopError as e:
                log.warning("a fenced host came back but could not be told yet", host=f["host"], error=e.message)

    def running(self, job: str) -> str | None:
        for op in self.store.ops(running_only=True):
            if is_recovery(op) and op["metadata"].get("job") == job:
                return op["id"]
        return None

    # -- the operation ------------------------------------------------------------------------
    def start(self, job: str, lost: str | None = None, requested_by: str = "an operator") -> str:
        """Begin recovering `job` (lost: its failed host; default: the one found silent)."""
        if not self.store.workers(job=job) and not self.store.snapshots(job):  # a typo is not a job without snapshots
            raise NotFound(f"no job named {job!r}", code="no_such_job",
                           action="list jobs with `pitstop jobs` (a job's snapshots: `pitstop snapshots JOB`)")
        if self.running(job):
            raise Conflict(f"job {job} is already being recovered ({self.running(job)})", code="recovery_running",
                           action=f"follow it: pitstop ops {self.running(job)}")
        with self.snaps.lock:  # from here no snapshot of the job commits: the one read next stays the newest
            self.snaps.held.add(job)  # (held, not hold(): a start refused below leaves a snapshot under way alone)
        snap = self.snaps.committed(job)
        if snap is None:
            self.snaps.release(job)
            raise Unrecoverable(f"job {job} has no complete snapshot", action="restart the job from its own checkpoint; "
                                "start it with `pitstop run --snapshot-every SECONDS` to recover it next time")
        if lost is None:
            found = self.failed_hosts(job)
            if not found:
                self.snaps.release(job)
                raise FailedPrecondition(f"no host of job {job} is silent past {self.s.failure_deadline_s:g} s",
                                         code="nothing_lost", action="name the failed host if you know better")
            lost = found[0]
        op_id = f"recover-{uuid.uuid4().hex[:12]}"
        md = RecoveryState(job=job, node=lost, snapshot=snap.number,
                           snapshot_age_s=round(time.time() - snap.created, 3), requested_by=requested_by,
                           cause=requested_by, detected_after_s=self._detected_after(job, lost),
                           phases={}, conditions=[])
        self.store.create_op(op_id, lost, None, md.dump(), None)
        self.start_thread(op_id)
        return op_id

    def _detected_after(self, job: str, lost: str) -> float | None:
        """Seconds from the host's failure to now: from the first end of its ranks of the job that
        was not asked for, else from its last beat where it is silent; None for a live host whose
        ranks run (an operator's recovery of it)."""
        now = time.time()
        since = self._last_recovery_end(job)
        ends = [float(w["ended_at"]) for w in self.store.workers(job=job) if w["host"] == lost
                and w["state"] in ("exited", "lost") and w.get("ended_at") and float(w["ended_at"]) >= since
                and not w.get("end_asked")]
        h = self.store.host(lost)
        silent_since = h["last_seen"] if h is not None and not healthy(h, self.s.failure_deadline_s) else None
        at = min([*ends, *([silent_since] if silent_since else [])], default=None)
        return round(now - at, 3) if at is not None else None

    def start_thread(self, op_id: str, after: threading.Thread | None = None) -> None:
        def run() -> None:
            if after is not None:
                after.join()
            self._run(op_id)
        t = threading.Thread(target=run, daemon=True, name=f"op-{op_id}")
        with self._threads_lock:
            self.threads[op_id] = t
        t.start()

    def _final(self, op_id: str, md: RecoveryState, **fields: Any) -> None:
        """The operation's last record: kept in memory where the database refuses it, and written by
        the watchdog once it takes writes (the recovery is over on the agents: never run again)."""
        fields["metadata"] = md.dump()
        try:
            self.on_done({**fields["metadata"], "result": fields.get("result")})
        except Exception:  # noqa: BLE001 - a metric never fails a recovery
            log.exception("recording a recovery's metrics failed", op=op_id)
        try:
            self.store.update_op(op_id, **fields)
        except StoreUnavailable:
            with self._threads_lock:
                self.unwritten[op_id] = fields
            log.error("a recovery ended but its record could not be written; the watchdog writes it once the "
                      "database takes writes", op=op_id, result=fields.get("result"))

    def watch(self) -> list[str]:
        """The watchdog's look at recoveries (server.py, every watchdog_s): a recovery the database
        says runs and no live thread of this process drives (its thread ended on a write the
        database refused, after it may have stopped the survivors) is run again from its start, as
        a restarted coordinator does (a recovery is idempotent), backing off while it keeps
        ending so.  Until the database takes writes again it cannot be read either: the job stays
        stopped, never half restored.  The operations taken over."""
        try:
            running = [op["id"] for op in self.store.ops(running_only=True) if is_recovery(op)]
        except StoreUnavailable:
            return []
        taken = []
        now = time.monotonic()
        with self._threads_lock:
            for op_id in running:
                t = self.threads.get(op_id)
                if t is not None and t.is_alive():
                    continue
                if op_id in self.unwritten:  # over on the agents: only its record is missing
                    try:
                        self.store.update_op(op_id, **self.unwritten[op_id])
                        self.unwritten.pop(op_id)
                    except StoreUnavailable:
                        pass
                    continue
                n, due = self.takeovers.get(op_id, (0, 0.0))
                if now < due:
                    continue
                self.takeovers[op_id] = (n + 1, now + min(TAKEOVER_BACKOFF_MAX_S, self.s.watchdog_s * 2 ** (n + 1)))
                taken.append(op_id)
            for op_id in [o for o in self.takeovers if o not in running]:
                self.takeovers.pop(op_id)
        for op_id in taken:
            log.error("watchdog: a recovery's thread ended without ending it; running it again from its start",
                      op=op_id, takeover=self.takeovers[op_id][0])
            self.start_thread(op_id)
        return taken

    def reconcile(self, after: threading.Thread | None = None) -> list[str]:
        """After a coordinator restart: a recovery that was running runs again from the start (once
        `after`, the undoing of a snapshot the last coordinator left under way, has ended)."""
        out = []
        for op in self.store.ops(running_only=True):
            if is_recovery(op):
                self.start_thread(op["id"], after=after)
                out.append(op["id"])
        return out

    def _run(self, op_id: str) -> None:
        op = self.store.op(op_id)
        assert op is not None
        md = RecoveryState.load(op["metadata"])
        job = md.job
        self.snaps.hold(job)
        while job in self.snaps.pausing:  # a snapshot's pause ends first (its resume must not reach restored ranks)
            time.sleep(0.05)
        try:
            self._recover(op_id, md)
        except StoreUnavailable:
            log.error("a recovery could not record its progress; the watchdog runs it again once the database "
                      "takes writes", op=op_id, job=job)
        except PitstopError as e:
            log.error("recovery failed", op=op_id, job=job, error=e.message)
            md.result = "failed"
            self._final(op_id, md, done=True, result="failed", error=e.to_dict())
            if isinstance(e, Unrecoverable):  # not tried again by itself: the job restarts from its checkpoint
                self.snaps.drop_everywhere(job, "its recovery failed: " + e.message)
        except Exception as e:  # noqa: BLE001 - recorded, never left running
            log.exception("recovery crashed", op=op_id)
            self._final(op_id, md, done=True, result="failed",
                        error={"code": "internal", "message": repr(e), "action": "see the coordinator's log"})
        finally:
            for c in self._local.__dict__.pop("clients", {}).values():
                c.close()
            self.snaps.release(job)
            self.snaps.restart_clock(job, at=-1e18)  # the next snapshot at once: only then is the job covered again

    def _phase(self, op_id: str, md: RecoveryState, name: str, t0: float | None = None) -> float:
        now = time.monotonic()
        if t0 is not None and md.phase:
            md.phases[md.phase] = round(now - t0, 4)
        md.phase = name
        self.store.update_op(op_id, phase=name, metadata=md.dump())
        log.info("recovery phase", op=op_id, phase=name)
        faults.hit(f"recovery_phase:{name}")
        return now

    def _client(self, host: str, timeout: float | None = None) -> AgentClient:
        """The host's agent.  Without `timeout`: one client per host for this recovery's thread,
        closed when it ends (_run); with one: a client of its own, for the caller to close."""
        h = self.store.host(host)
        if h is None:
            raise NotFound(f"host {host} is unknown", action="it must heartbeat to the coordinator")
        if timeout is not None:
            return AgentClient(h["url"], self.s.cluster_token, timeout=timeout, fence=self.fence)
        cache = self._local.__dict__.setdefault("clients", {})
        if host not in cache:
            cache[host] = AgentClient(h["url"], self.s.cluster_token, timeout=self.s.step_timeout_s,
                                      fence=self.fence)
        return cache[host]

    def _recover(self, op_id: str, md: RecoveryState) -> None:
        """The phases in order, each recorded before it starts; the plan is settled once, in `plan`,
        and carried by every later phase."""
        t = self._phase(op_id, md, "plan")
        plan = self._plan(md)
        t = self._phase(op_id, md, "fence", t)
        self._fence(plan, md)
        t = self._phase(op_id, md, "stop", t)
        now, unread = self._survivor_blocks(plan)
        for k, v in progress.steps_redone(plan.nccl, plan.issued_at, plan.ops_per_step, now, unread).items():
            setattr(md, k, v)
        md.survivors = self._survivors(plan, now)
        t_pause = time.time()
        in_parallel(lambda h: self._client(h).stop_workers(plan.job, plan.survivors[h]), sorted(plan.survivors))
        t = self._phase(op_id, md, "restore", t)
        spare = self._restore_lost(op_id, md, plan)
        got = each_while_heard(lambda h: self._client(h).snapshot_restore(plan.job, plan.number, plan.survivors[h],
                                                                          timeout=self.s.step_timeout_s),
                               sorted(plan.survivors), self.snaps.heard, "the restore of its ranks")
        md.restored = {**md.restored, **{w: r for g in got for w, r in g["workers"].items()}}
        md.files = {"cut_back": [f for r in md.restored.values() for f in r.get("files_cut_back", [])]}
        t = self._phase(op_id, md, "resume", t)
        self._resume(op_id, md, plan, spare, t)
        md.pause_s = round(time.time() - t_pause, 3)
        md.destination = spare
        md.phase = "done"
        md.result = "succeeded"
        self.store.set_role(spare, "active", {"reason": f"took job {plan.job}'s lost ranks", "operation":
                                              f"operations/{op_id}", "requested_by": md.requested_by})
        md.spares_left = sum(1 for h in self.store.hosts() if usable_spare(h)
                                and healthy(h, self.s.heartbeat_timeout_s))
        if not md.spares_left:
            md.conditions.append({"type": "SpareLeft", "status": "False", "reason": "NoSpareLeft",
                                     "message": f"{spare} was the last spare: the next host to fail has none"})
            log.error("the last spare was used: the next host failure has none", job=plan.job, spare=spare)
        self._final(op_id, md, phase="done", done=True, result="succeeded",
                    response={"job": plan.job, "destination": spare, "snapshot": plan.number})
        log.info("job recovered", op=op_id, job=plan.job, lost=plan.lost, spare=spare, snapshot=plan.number,
                 pause_s=md.pause_s, lost_s=md.lost_s)

    def _plan(self, md: RecoveryState) -> Plan:
        """Everything the recovery needs, checked before anything is stopped: the snapshot still
        committed, the survivors' hosts and the lost parts' buddies alive and holding their parts,
        the files the job writes matchable.  Unrecoverable, saying why, where not."""
        job, lost, number = md.job, md.node, md.snapshot
        started = time.time()
        snap = next((s for s in self.store.snapshots(job) if s.number == number), None)
        if snap is None or snap.state != "committed":
            raise Unrecoverable(f"snapshot {number} of job {job} is no longer complete",
                                action="restart the job from its own checkpoint")
        hosts = {h["name"]: h for h in self.store.hosts()}
        alive = {n for n, h in hosts.items() if healthy(h, self.s.heartbeat_timeout_s) and n != lost}
        rec = snap.record
        parts = rec.parts
        lost_parts = {w: p for w, p in parts.items() if p.host == lost}
        kept = {w: p for w, p in parts.items() if p.host != lost}
        gone = sorted({p.host for p in kept.values() if p.host not in alive})
        if gone:
            raise Unrecoverable(f"hosts {', '.join(gone)} of job {job} are silent too: their own copies of snapshot "
                                f"{number} cannot be reached", action="restart the job from its own checkpoint")
        no_replica = sorted({p.buddy for p in lost_parts.values() if p.buddy not in alive})
        if no_replica:
            raise Unrecoverable(f"the replicas of {lost}'s ranks were on {', '.join(no_replica)}, which is silent "
                                "too: they were lost with it", action="restart the job from its own checkpoint")
        self._check_parts(job, number, kept, lost_parts)
        self._check_files(job, number, kept, lost_parts)
        survivors: dict[str, list[str]] = defaultdict(list)
        for w, p in kept.items():
            survivors[p.host].append(w)
        md.lost_ranks = sorted(p.rank for p in lost_parts.values())
        md.lost_s = round(started - snap.created, 3)  # work the job redoes: since the snapshot
        return Plan(job=job, lost=lost, number=number, nccl=rec.pause == "nccl_cut", parts=parts,
                    lost_parts=lost_parts, survivors=dict(survivors), alive=alive,
                    issued_at=rec.issued, ops_per_step=rec.ops_per_step,
                    lost_heard=lost in hosts and healthy(hosts[lost], self.s.heartbeat_timeout_s))

    def _survivor_blocks(self, plan: Plan) -> tuple[dict[str, list[dict[str, Any]]], str | None]:
        """The surviving ranks' shim blocks, read just before they are stopped (none for a job
        without the shim's communicators), and why not where they could not be read."""
        if not plan.nccl:
            return {}, None
        try:
            now: dict[str, list[dict[str, Any]]] = {}
            for got in in_parallel(lambda h: self._client(h, timeout=RECOVERY_AGENT_TIMEOUT_S).shim_blocks_many(
                    plan.survivors[h]), sorted(plan.survivors)):
                now.update(got)
        except PitstopError as e:
            return {}, e.message
        return now, None

    def _survivors(self, plan: Plan, blocks: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        """What each surviving rank was doing when the recovery stopped it: `parked` on a peer's
        failure (its NCCL shim held a communicator error back for this recovery: the call, the
        error, since when), `ended` (its collective failed and the error ended it: a job without
        the shim, or not yet covered when its peer failed), or `running` (blocked in a call, or it
        never met the failure).  Each is rolled back the same way: a live process is ended first."""
        states = {w["id"]: w["state"] for w in self.store.workers(job=plan.job)}
        out: dict[str, Any] = {}
        for ids in plan.survivors.values():
            for w in ids:
                lost = next((b["lost"] for b in blocks.get(w, []) if (b.get("lost") or {}).get("state") == "parked"),
                            None)
                if lost:
                    out[w] = {"state": "parked", "call": lost["call"], "error": lost["error"], "since": lost["since"]}
                else:
                    out[w] = {"state": "ended" if states.get(w) in ("exited", "lost") else "running"}
        return out

    def _fence(self, plan: Plan, md: RecoveryState) -> None:
        epoch = int(time.time() * 1000)
        self.store.fence(plan.job, plan.lost, epoch=epoch)
        md.fence_epoch = epoch
        # a host still heard from (an operator's recovery) is told now; a silent one when it reports again
        md.fenced_now = plan.lost_heard and self._fence_now(plan.job, plan.lost, epoch)

    def _resume(self, op_id: str, md: RecoveryState, plan: Plan, spare: str, t: float) -> None:
        """Every rank at once; an NCCL job's communicators re-created at their new addresses (its
        ranks were restored parked at the cut, communicators destroyed), as after a move."""
        where = {h: list(ids) for h, ids in plan.survivors.items()}
        where.setdefault(spare, []).extend(plan.lost_parts)
        problems = []
        for h, ids in sorted(where.items()):
            try:
                self._client(h).resume_many(ids)
            except PitstopError as e:
                problems.append(f"{h}: {e.message}")
        for w in plan.lost_parts:
            self.store.set_worker_host(w, spare, state="running")
        md.phases["resume"] = round(time.monotonic() - t, 4)
        if problems:
            raise PitstopError(f"the job was restored but some ranks could not be resumed: {'; '.join(problems)}",
                               code="resume_incomplete", action="send those ranks SIGCONT, or stop the job")
        if plan.nccl:
            t = self._phase(op_id, md, "rewire")
            hosts_of = {w: spare if w in plan.lost_parts else p.host for w, p in plan.parts.items()}
            job_cut(hosts_of, self._client, self.s.cut_deadline_s).rewire()
            md.phases["rewire"] = round(time.monotonic() - t, 4)

    def _fence_now(self, job: str, lost: str, epoch: int) -> bool:
        """A lost host whose agent still answers (an operator's recovery, a host whose beats alone
        were lost) ends the job's workers now, before any copy of them is restored; one that does
        not answer is told when it reports again (enforce_fences) and isolates them meanwhile
        by itself (agent/snapshots.py).  Whether it answered."""
        try:
            with self._client(lost, timeout=RECOVERY_AGENT_TIMEOUT_S) as c:
                c.fence(job, epoch, "fenced by the recovery that replaces its ranks")
        except PitstopError:
            return False
        self.store.ack_fence(job, lost)
        return True

    def _check_parts(self, job: str, number: int, kept: dict[str, SnapshotPart],
                     lost_parts: dict[str, SnapshotPart]) -> None:
        """Every part the recovery needs is complete where the record says, asked before anything
        is stopped: the job runs on (or stays down) as it is when one is missing."""
        need: dict[str, tuple[set[str], set[str]]] = defaultdict(lambda: (set(), set()))
        for w, p in kept.items():
            need[p.host][0].add(w)
        for w, p in lost_parts.items():
            need[p.buddy][1].add(w)

        def ask(h: str) -> str | None:
            own, replica = need[h]
            try:
                with self._client(h, timeout=RECOVERY_AGENT_TIMEOUT_S) as c:
                    have = [s for s in c.snapshots(job) if s["number"] == number]
            except PitstopError as e:
                return f"{h}: {e.message}"
            if not have:
                return f"{h} holds no part of snapshot {number}"
            missing = sorted(own - set(have[0]["own"])) + sorted(replica - set(have[0]["replica"]))
            return f"{h} lacks {', '.join(missing)}" if missing else None

        problems = [p for p in in_parallel(ask, sorted(need)) if p]
        if problems:
            raise Unrecoverable(f"snapshot {number} of job {job} is not whole: {'; '.join(problems)}",
                                action="restart the job from its own checkpoint")

    def _check_files(self, job: str, number: int, kept: dict[str, SnapshotPart],
                     lost_parts: dict[str, SnapshotPart]) -> None:
        """The files the job writes can be cut back to the snapshot (proc/written_files.py): asked of
        each survivor's host, and of the buddies for the lost ranks, before anything is stopped."""
        asks: list[tuple[str, str, list[str]]] = []
        for side, key, parts in (("own", "host", kept), ("replica", "buddy", lost_parts)):
            by: dict[str, list[str]] = defaultdict(list)
            for w, p in parts.items():
                by[p.host if key == "host" else p.buddy].append(w)
            asks += [(h, side, ids) for h, ids in sorted(by.items())]

        def ask(a: tuple[str, str, list[str]]) -> str | None:
            try:
                with self._client(a[0], timeout=RECOVERY_AGENT_TIMEOUT_S) as c:
                    c.snapshot_check_files(job, number, a[2], a[1], timeout=RECOVERY_AGENT_TIMEOUT_S)
            except PitstopError as e:
                return f"{a[0]}: {e.message}"
            return None

        problems = [p for p in in_parallel(ask, asks) if p]
        if problems:
            raise Unrecoverable(f"job {job} cannot be rolled back to snapshot {number}: {'; '.join(problems)}",
                                action="restart the job from its own checkpoint")

    def _restore_lost(self, op_id: str, md: RecoveryState, plan: Plan) -> str:
        """The lost host's ranks on a spare; another spare if one fails.  Where none can take
        them, everything restored so far is ended and the recovery fails (nothing runs half)."""
        tried: list[str] = []
        last: PitstopError | None = None
        earlier = md.destination  # where an earlier run of this recovery (a coordinator since lost) sent them
        for _ in range(SPARE_TRIES):
            spare = self._spare(plan.alive - set(tried) - set(plan.survivors), op_id)
            if spare is None:
                break
            tried.append(spare)
            self.store.clear_fence(plan.job, spare)  # a host fenced for the job earlier takes its ranks now
            if spare == earlier:  # the copies that run restored there are ended first, as the survivors' are
                self._discard(spare, plan.job, list(plan.lost_parts))
            md.destination = spare
            self.store.update_op(op_id, dest=spare, metadata=md.dump())
            try:
                self._to_spare(plan.job, plan.number, plan.lost_parts, spare, op_id, md)
                return spare
            except PitstopError as e:
                last = e
                md.spares_failed.append({"spare": spare, "error": e.message})
                self.store.update_op(op_id, metadata=md.dump())
                log.warning("a spare could not take the lost ranks; trying another", op=op_id, spare=spare,
                            error=e.message)
                if not self._discard(spare, plan.job, list(plan.lost_parts)):
                    # unreachable (it died in the restore): whatever it restored is ended if it comes back
                    self.store.fence(plan.job, spare, epoch=md.fence_epoch or 0)
                    md.spares_failed[-1]["fenced"] = True
        for h, ids in plan.survivors.items():  # stopped above: they must not stay half-restored either
            self._discard(h, plan.job, ids)
        raise Unrecoverable(f"no spare could take the lost ranks of job {plan.job} (tried: {', '.join(tried) or 'none'})"
                            + (f": {last.message}" if last else ""),
                            action="the job's ranks were ended; restart it from its own checkpoint")

    def _spare(self, candidates: set[str], op_id: str) -> str | None:
        """The first usable spare of `candidates` that no other operation holds (this recovery's own
        record names the spare an earlier run of it chose: that one stays a candidate)."""
        busy = {h: o for h, o in self.busy().items() if o != op_id}
        hosts = [h for h in self.store.hosts() if h["name"] in candidates and h["name"] not in busy]
        spares = sorted(h["name"] for h in hosts if usable_spare(h))
        return spares[0] if spares else None

    def _to_spare(self, job: str, number: int, lost_parts: dict[str, SnapshotPart], spare: str, op_id: str,
                  md: RecoveryState) -> None:
        """The lost ranks' replicas onto the spare (already there where it was their buddy), kept
        there as replicas, then restored from them."""
        spare_url = self.store.host(spare)["url"]  # type: ignore[index]
        by_buddy: dict[str, list[str]] = defaultdict(list)
        for w, p in lost_parts.items():
            if p.buddy != spare:
                by_buddy[p.buddy].append(w)
        sent = in_parallel(lambda b: while_heard(
            lambda: self._client(b).send_replicas(job, number, by_buddy[b], spare_url, timeout=self.s.capture_deadline_s),
            (b, spare), self.snaps.heard, f"sending replicas to {spare}"), sorted(by_buddy))
        md.replicas_sent = {w: r for g in sent for w, r in g["workers"].items()}
        got = while_heard(lambda: self._client(spare).snapshot_restore(job, number, sorted(lost_parts),
                                                                       timeout=self.s.step_timeout_s, side="replica"),
                          spare, self.snaps.heard, "the restore of the lost ranks")
        md.restored.update(got["workers"])
        self.store.update_op(op_id, metadata=md.dump())

    def _discard(self, host: str, job: str, ids: list[str]) -> bool:
        """End the ranks restored on `host` so far; False: it could not be reached."""
        if not self.snaps.heard(host):  # silent past the failure deadline: no call would be answered
            log.warning("could not end a half-restored rank: its host is silent", host=host, job=job)
            return False
        try:
            with self._client(host, timeout=RECOVERY_AGENT_TIMEOUT_S) as c:
                c.stop_workers(job, ids)
            return True
        except PitstopError as e:
            log.warning("could not end a half-restored rank", host=host, job=job, error=e.message)
            return False
