"""Recoveries of jobs whose host died, from their last committed snapshots: finding the failed
host (silent past the failure deadline, or every rank on it failed at once), starting the recovery
(an AIP-151 operation, `POST /v1/jobs/{job}:recover`, recovery_run.RecoveryRun, driven by the
operations' framework), and ending the old workers of a fenced host that comes back.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from typing import Any, Callable

import structlog

from pitstop.coordinator.operations import Operations
from pitstop.coordinator.planner import healthy
from pitstop.coordinator.recovery_run import RecoveryRun, Unrecoverable
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.snapshots import Snapshots
from pitstop.coordinator.store import BaseStore
from pitstop.coordinator.timeouts import RECOVERY_AGENT_TIMEOUT_S
from pitstop.errors import Conflict, FailedPrecondition, NotFound, PitstopError
from pitstop.wire.agent_client import AgentClient, Fence
from pitstop.wire.recovery_state import TYPE_URL, RecoveryState
from pitstop.wire.store_rows import StoredOp, StoredWorker

log = structlog.get_logger("pitstop.coordinator.recovery")

CRASH_WINDOW_S = 2.0  # a host's ranks of a job that all failed within this of each other failed "at once"
CRASH_RECOVERIES_PER_HOUR = 3  # a job whose ranks keep failing so is then left to its operator
CRASH_BY = "the coordinator (ranks failed"
REPORTED_SINCE_S = 1.5  # agents report every second: a host not heard this long after a crash may be dying too
SPARE_TRIES = 2


def is_recovery(op: StoredOp) -> bool:
    return op.metadata.get("@type") == TYPE_URL


class Recoveries:
    def __init__(self, store: BaseStore, settings: CoordinatorSettings, snapshots: Snapshots,
                 busy: Callable[[], dict[str, str]], on_done: Callable[[dict[str, Any]], None] = lambda md: None,
                 fence: Fence | None = None, operations: Operations | None = None) -> None:
        self.store, self.s, self.snaps, self.busy = store, settings, snapshots, busy
        self.fence = fence  # the leader's term on every call to an agent (coordinator/leadership.py)
        self.on_done = on_done  # the metrics, once a recovery's record is final
        # the framework that runs, watches and reconciles every operation (operations.py): the
        # coordinator's own, shared with the evacuations, or one for these recoveries alone
        self.ops = operations or Operations(store, settings)
        self.ops.kind(TYPE_URL, self.load)

    def load(self, op_id: str) -> RecoveryRun:
        """The recovery `op_id`, as the store holds it, ready to be driven."""
        return RecoveryRun(self.store, self.s, self.fence, op_id, self.snaps, self.busy, self.on_done)

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
        hosts = {h.name: h for h in self.store.hosts()}
        ws = self.store.workers(job=job)
        snap = self.snaps.committed(job)
        since = max(snap.created if snap else float("inf"), self._last_recovery_end(job))
        over = any(w.state == "exited" and w.exit_code == 0 or w.end_asked for w in ws)
        out: dict[str, bool] = {}
        for w in ws:
            h = hosts.get(w.host)
            if h is None or healthy(h, self.s.failure_deadline_s):
                continue
            if w.state in ("running", "paused", "capturing", "stopped"):
                out[w.host] = False
            elif w.state in ("exited", "lost") and not over and float(w.ended_at or 0) >= since:
                out.setdefault(w.host, True)
        return sorted(out.items())

    def _last_recovery_end(self, job: str) -> float:
        """When the job's last recovery ended: ends before it are what that recovery answered."""
        return max((op.updated for op in self.store.ops(done=True) if is_recovery(op)
                    and op.metadata.get("job") == job), default=0.0)

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
        if any(w.state == "exited" and w.exit_code == 0 or w.end_asked for w in ws):
            return None
        hosts = {h.name: h for h in self.store.hosts()}
        fenced = {f.host for f in self.store.fences() if f.job == job}
        by_host: dict[str, list[StoredWorker]] = defaultdict(list)
        for w in ws:
            by_host[w.host].append(w)
        found = []
        for host, on in by_host.items():
            h = hosts.get(host)
            if h is None or host in fenced or not healthy(h, self.s.failure_deadline_s):
                continue  # a silent host is failed_hosts' to find
            ends = [float(w.ended_at) for w in on if w.state in ("exited", "lost") and w.ended_at]
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
        if any(hosts[o].last_seen < first + REPORTED_SINCE_S for o in by_host if o != host and o in hosts):
            return None
        return host, (f"every rank of the job on {host} failed within {CRASH_WINDOW_S:g} s of each other, "
                      "before any other host's")

    def _recent_crash_recoveries(self, job: str) -> int:
        since = time.time() - 3600
        return sum(1 for op in self.store.ops() if is_recovery(op) and op.metadata.get("job") == job
                   and op.created >= since and op.metadata.get("requested_by", "").startswith(CRASH_BY))

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
        hosts = {h.name: h for h in self.store.hosts()}
        for f in self.store.fences(unacked=True):
            h = hosts.get(f.host)
            if h is None or not healthy(h, self.s.heartbeat_timeout_s):
                continue
            try:
                with AgentClient(h.url, self.s.cluster_token, timeout=RECOVERY_AGENT_TIMEOUT_S, fence=self.fence) as c:
                    got = c.fence(f.job, f.epoch, "the coordinator fenced this host")
                self.store.ack_fence(f.job, f.host)
                log.warning("a fenced host came back; its old workers were ended", job=f.job, host=f.host,
                            killed=got.get("killed"))
            except PitstopError as e:
                log.warning("a fenced host came back but could not be told yet", host=f.host, error=e.message)

    def running(self, job: str) -> str | None:
        for op in self.store.ops(running_only=True):
            if is_recovery(op) and op.metadata.get("job") == job:
                return op.id
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
        self.ops.start(op_id, lambda: self.store.create_op(op_id, lost, None, md.dump(), None))
        return op_id

    def _detected_after(self, job: str, lost: str) -> float | None:
        """Seconds from the host's failure to now: from the first end of its ranks of the job that
        was not asked for, else from its last beat where it is silent; None for a live host whose
        ranks run (an operator's recovery of it)."""
        now = time.time()
        since = self._last_recovery_end(job)
        ends = [float(w.ended_at) for w in self.store.workers(job=job) if w.host == lost
                and w.state in ("exited", "lost") and w.ended_at and float(w.ended_at) >= since
                and not w.end_asked]
        h = self.store.host(lost)
        silent_since = h.last_seen if h is not None and not healthy(h, self.s.failure_deadline_s) else None
        at = min([*ends, *([silent_since] if silent_since else [])], default=None)
        return round(now - at, 3) if at is not None else None

