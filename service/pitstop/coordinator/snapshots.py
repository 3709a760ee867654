"""A job's in-memory snapshots, taken by the coordinator on the job's schedule.

One snapshot, start to end:
  check    every host of the job is asked whether it can (before anything pauses)
  pause    every rank stopped (SIGSTOP), all hosts at once
  lock     every rank's own network namespace drops all traffic, on every host, before the
           first dump: a byte a still-running kernel acknowledged after its sender was dumped
           would be in neither image
  dump     every host dumps its ranks leaving them as they were (CRIU leave-running)
  unlock, resume   always, whatever happened above: the job's pause ends here
  replicate        after the resume, each host sends its parts to its buddy
  commit   the snapshot counts only once every part and its replica are complete; the older
           ones are then dropped everywhere
A snapshot that fails anywhere is dropped on every host and recorded failed with why; the
previous committed one still counts.  The job is never left paused: the resume is in a
`finally`, and each step has a deadline.

The buddy of a host is chosen here and written in the snapshot's record with why: a healthy host
other than itself, outside its failure domain where one is known (`pitstop agent
--failure-domain`), a spare first (it is where a recovery would restore, so the replica is
already there), else the next host of the cluster by name.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from typing import Any, Callable

import structlog

from pitstop import faults
from pitstop.coordinator import pausing
from pitstop.coordinator.cut import Cut, through_agents
from pitstop.coordinator.fanout import HostSilent, each_while_heard, in_parallel
from pitstop.coordinator.pausing import JobHold
from pitstop.coordinator.planner import healthy, usable_spare
from pitstop.coordinator.progress import per_step_by_worker
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.store import LIVE, BaseStore
from pitstop.coordinator.timeouts import (
    ENDED_JOB_SNAPSHOTS_KEEP_S,
    SNAPSHOT_DROP_TIMEOUT_S,
    SNAPSHOT_PAUSE_MARGIN_S,
    SNAPSHOT_STEP_TIMEOUT_S,
)
from pitstop.errors import Conflict, FailedPrecondition, PitstopError
from pitstop.wire.agent_client import AgentClient, Fence
from pitstop.wire.snapshot_record import SnapshotPart, SnapshotRecord, SnapshotState, StoredSnapshot
from pitstop.wire.store_rows import StoredHost, StoredWorker

log = structlog.get_logger("pitstop.coordinator.snapshots")

MIN_EVERY_S = 5.0  # as `pitstop run --snapshot-every` (wire/agent_requests.py)


def interval(store: BaseStore, job: str, workers: list[StoredWorker]) -> float | None:
    """The job's snapshot interval: the API's value where one was set (0: off), else the
    smallest `pitstop run --snapshot-every` among its live ranks; None: no snapshots."""
    set_ = store.snapshot_policy(job)
    if set_ is not None:
        return set_ or None
    asked = [float(w.snapshot_every_s) for w in workers if w.snapshot_every_s]
    return min(asked) if asked else None


def buddies(hosts: list[str], all_hosts: list[StoredHost], timeout_s: float,
            previous: dict[str, str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """Each host of the job -> the host that keeps its replica, and why that one (both written in
    the snapshot's record).  In order of preference: a spare in another failure domain (where a
    recovery restores anyway), another host in another failure domain, a spare, the next host by
    name.  Another domain first, because a replica that dies with its host (one rack's power, one
    switch) leaves nothing to recover from; a spare second, because the recovery can send a
    replica to the spare it restores on, but cannot bring back a lost one.  A host with no
    `--failure-domain` is in no known domain: for it the spare-then-next rule alone decides.
    previous: the last snapshot's choice, kept while it is still among the best: a part is a delta
    against the one before it, which only the same buddy holds (another would refuse it)."""
    alive = [h for h in all_hosts if healthy(h, timeout_s) and h.role in ("active", "spare")]
    domain = {h.name: h.failure_domain for h in all_hosts}
    spares = sorted(h.name for h in alive if usable_spare(h))  # a cordoned spare: as any other host
    names = sorted(h.name for h in alive)
    out, why = {}, {}
    for i, host in enumerate(sorted(hosts)):
        mine = domain.get(host)
        after = [n for n in names if n > host] + [n for n in names if n < host]

        def apart(n: str, mine: str | None = mine) -> bool:
            return bool(mine) and bool(domain.get(n)) and domain.get(n) != mine

        outside = f" outside failure domain {mine}" if mine else ""
        # (why, candidates, spread: spares are shared out among the job's hosts; other hosts taken in turn)
        tiers = ((f"a spare{outside}", [s for s in spares if s != host and apart(s)], True),
                 (f"a host{outside} (no spare there)", [n for n in after if apart(n)], False),
                 ("a spare" + (f" (none{outside})" if mine else ""), [s for s in spares if s != host], True),
                 ("the next host by name (no spare" + (f", none{outside})" if mine else ")"), after, False))
        for reason, pick, spread in tiers:
            if pick:
                before = (previous or {}).get(host, "")
                out[host] = before if before in pick else pick[i % len(pick)] if spread else pick[0]
                why[host] = reason
                break
        else:
            raise FailedPrecondition(f"no other healthy host can keep a replica of {host}'s snapshot",
                                     code="no_buddy", action="add a spare or another host to the cluster")
    return out, why


def _released(got: dict[str, list[dict[str, Any]]]) -> int:
    """Device bytes the ranks' allocators released at the cut (shim/trim.c), over every process
    whose allocator said (0 where none holds device memory: a CPU job)."""
    total = 0
    for blocks in got.values():
        for b in blocks:
            t = b.get("trim") or {}
            if t.get("reserved_before") is not None and t.get("reserved_after") is not None:
                total += int(t["reserved_before"]) - int(t["reserved_after"])
    return total


class Snapshots:
    """The coordinator's snapshot schedule and the taking of each snapshot."""

    def __init__(self, store: BaseStore, settings: CoordinatorSettings, busy: Callable[[], dict[str, str]],
                 fence: Fence | None = None) -> None:
        self.store, self.s, self.busy = store, settings, busy
        self.fence = fence  # the leader's term on every call to an agent (coordinator/leadership.py)
        self.last: dict[str, float] = {}  # job -> when its last snapshot began (monotonic)
        self.errors: dict[str, str] = {}  # job -> why its last snapshot failed
        self.taking: set[str] = set()
        self.pausing: set[str] = set()  # jobs between a snapshot's pause and its resume: a recovery waits for them
        self.held: set[str] = set()  # jobs being recovered: no snapshot meanwhile
        self.recoveries: dict[str, int] = {}  # job -> recoveries begun: a snapshot begun before one never commits
        self.ended: dict[str, float] = {}  # job -> since when none of its ranks is live (monotonic)
        self.kept: dict[str, str] = {}  # job -> why its snapshot is kept though none of its ranks runs
        self.pauses: dict[str, float] = {}  # job -> its last snapshot's pause (s)
        self.paused_total: dict[str, float] = {}  # job -> seconds its snapshots paused it, since this coordinator began
        self.first_at: dict[str, float] = {}  # job -> when its first snapshot here began (wall clock)
        self.stretched: dict[str, str] = {}  # job -> why its interval is longer than asked
        self.lock = threading.Lock()

    def agent(self, host: str, timeout: float | None = None) -> AgentClient:
        return AgentClient(self.url(host), self.s.cluster_token, timeout=timeout or self.s.step_timeout_s,
                           fence=self.fence)

    def url(self, host: str) -> str:
        h = self.store.host(host)
        if h is None:
            raise PitstopError(f"host {host} is unknown", action="it must heartbeat to the coordinator")
        return h.url

    # -- the schedule --------------------------------------------------------------------------
    def due(self) -> list[str]:
        """Jobs whose snapshot is due now."""
        jobs: dict[str, list[StoredWorker]] = defaultdict(list)
        for w in self.store.workers():
            if w.state in LIVE:
                jobs[w.job].append(w)
        out = []
        now = time.monotonic()
        for job, ws in jobs.items():
            every = self.effective(job, interval(self.store, job, ws))
            if every is None or job in self.taking or job in self.held:
                continue
            if now - self.last.get(job, -1e18) >= every:
                out.append(job)
        return out

    def effective(self, job: str, asked: float | None) -> float | None:
        """The interval the job gets: the one asked, lengthened where its snapshots' pauses would
        take more than snapshot_pause_share of its time (a snapshot every 5 s that pauses 3 s would
        stop the job half its time), and said so (`stretched`)."""
        if asked is None:
            self.stretched.pop(job, None)
            return None
        pause = self.pauses.get(job)
        share = self.s.snapshot_pause_share
        if not pause or pause / asked <= share:
            self.stretched.pop(job, None)
            return asked
        every = pause / share
        self.stretched[job] = (f"every {every:.0f} s, not the {asked:g} s asked: its last snapshot paused the job "
                               f"{pause:.2f} s, and snapshots may take at most {share:.0%} of its time "
                               "(PITSTOP_COORDINATOR_SNAPSHOT_PAUSE_SHARE)")
        return every

    def paused(self, job: str, pause_s: float) -> None:
        """A snapshot paused the job `pause_s`: its time lost to snapshots, and its next interval."""
        with self.lock:
            self.pauses[job] = pause_s
            self.paused_total[job] = self.paused_total.get(job, 0.0) + pause_s
            self.first_at.setdefault(job, time.time() - pause_s)

    def protection(self, job: str, asked: float | None) -> dict[str, Any] | None:
        """Whether a job that asked for snapshots is covered now: a committed snapshot, recent
        enough (within three of its intervals and a minute); else why not.  None: it asked none."""
        if asked is None:
            return None
        every = self.effective(job, asked) or asked
        snap = self.committed(job)
        age = time.time() - snap.created if snap else None
        why = None
        if snap is None:
            why = "no snapshot has been committed yet" + (f"; the last one failed: {self.errors[job]}"
                                                          if job in self.errors else "")
        elif age is not None and age > 3 * every + 60:
            why = f"its newest snapshot is {age:.0f} s old" + (f"; the last one failed: {self.errors[job]}"
                                                               if job in self.errors else "")
        return {"protected": why is None, "snapshot": snap.number if snap else None,
                "age_s": round(age, 1) if age is not None else None, "every_s": round(every, 3),
                "why_not": why, "stretched": self.stretched.get(job),
                "paused_share": None if self.lost_share(job) is None else round(self.lost_share(job) or 0.0, 5)}

    def lost_share(self, job: str) -> float | None:
        """The share of the job's time since its first snapshot that snapshots paused it."""
        first = self.first_at.get(job)
        if first is None:
            return None
        return self.paused_total.get(job, 0.0) / max(1e-3, time.time() - first)

    def tick(self) -> None:
        for job in self.due():
            try:
                self.take(job)
            except PitstopError as e:
                log.warning("snapshot not taken", job=job, error=e.message)
        self.forget_ended()

    def forget_ended(self) -> None:
        """A job none of whose ranks is live any more needs its snapshots no longer once it
        finished (a rank exited 0) or was stopped (its end was asked for): dropped on every host
        that answers after ENDED_JOB_SNAPSHOTS_KEEP_S, then forgotten.  A job that ended by failing keeps its last
        committed snapshot (a recovery, by itself or an operator's, may still restore it) for
        failed_snapshot_keep_s, and says why in its listing (`kept`)."""
        by_job: dict[str, list[StoredWorker]] = defaultdict(list)
        for w in self.store.workers():
            by_job[w.job].append(w)
        now = time.monotonic()
        for job in self.store.snapshot_jobs():
            ws = by_job.get(job, [])
            if any(w.state in LIVE for w in ws) or job in self.held or job in self.taking:
                self.ended.pop(job, None)
                self.kept.pop(job, None)
                continue
            since = self.ended.setdefault(job, now)
            over = any(w.state == "exited" and w.exit_code == 0 or w.end_asked for w in ws)
            if over or self.committed(job) is None:
                if now - since >= ENDED_JOB_SNAPSHOTS_KEEP_S:
                    self._forget(job, "its ranks have all ended (it finished or was stopped)")
                continue
            keep_s = self.s.failed_snapshot_keep_s
            if now - since < keep_s:
                self.kept[job] = (f"the job ended by failing: its last snapshot is kept for a recovery for "
                                  f"{keep_s:g} s after its end (PITSTOP_COORDINATOR_FAILED_SNAPSHOT_KEEP_S); "
                                  "`pitstop recover JOB --node HOST` restores it, `pitstop snapshots JOB --drop` "
                                  "drops it")
                continue
            self._forget(job, f"the job ended by failing {keep_s:g} s ago and was not recovered")

    def _forget(self, job: str, why: str) -> None:
        self.drop_everywhere(job, why)
        self.ended.pop(job, None)
        self.kept.pop(job, None)

    def drop_everywhere(self, job: str, why: str) -> None:
        """Every snapshot of the job, on every host that answers, and its records."""
        for h in [h for h in self.store.hosts() if healthy(h, self.s.heartbeat_timeout_s)]:
            try:
                with self.agent(h.name, timeout=SNAPSHOT_DROP_TIMEOUT_S) as c:
                    c.snapshot_drop(job)
            except PitstopError as e:
                log.info("a job's snapshots could not be dropped there now", job=job, host=h.name, error=e.message)
        self.store.forget_snapshots(job, keep=None)
        log.info("a job's snapshots dropped", job=job, why=why)

    def reconcile(self) -> list[str]:
        """After a restart: a snapshot the last coordinator left under way.  One still `taking` may
        have its job paused (stopped, or parked at the NCCL cut with its communicators destroyed)
        and its networks locked: every host of the job is unlocked and resumed (the communicators
        re-created, or the cut released), then it is recorded failed and its parts dropped.  One
        `replicating` had its job resumed already: recorded failed, its parts dropped.  The
        previous committed snapshot still counts.  What was reconciled ("job/number")."""
        out = []
        for job in self.store.snapshot_jobs():
            for snap in self.store.snapshots(job):
                if snap.state not in ("taking", "replicating"):
                    continue
                number, record = snap.number, snap.record
                problems = self._unpause(job, record) if snap.state == "taking" else []
                record.error = ("the coordinator restarted during it; the job was resumed" if not problems else
                                   "the coordinator restarted during it; resuming the job: " + "; ".join(problems))
                self.errors[job] = record.error
                self.store.update_snapshot(job, number, "failed", record)
                hosts = sorted({p.host for p in record.parts.values()} | set(record.buddies.values()))
                clients = {}
                for h in hosts:
                    try:
                        clients[h] = self.agent(h, timeout=SNAPSHOT_DROP_TIMEOUT_S)
                    except PitstopError:
                        continue
                threading.Thread(target=self._drop, args=(job, clients, self._committed(job)), daemon=True,
                                 name=f"drop-{job}-{number}").start()
                log.warning("a snapshot left under way by the last coordinator: the job resumed, the snapshot failed",
                            job=job, number=number, was=snap.state, problems=problems)
                out.append(f"{job}/{number}")
        return out

    def _unpause(self, job: str, record: SnapshotRecord) -> list[str]:
        """Undo whatever of a snapshot's pause may be in effect (each step idempotent); problems."""
        by_host: dict[str, list[str]] = defaultdict(list)
        for wid, p in record.parts.items():
            by_host[p.host].append(wid)
        cut = record.pause == "nccl_cut"
        problems = []
        clients: dict[str, AgentClient] = {}
        try:
            for h in sorted(by_host):
                if not self.heard(h):  # silent: no answer would come; its agent isolates its ranks by itself
                    problems.append(f"{h}: silent, skipped")
                    continue
                try:  # the agent answers once its dump under way, if any, has ended: the dump's deadline
                    clients[h] = self.agent(h, timeout=self.s.capture_deadline_s)
                    clients[h].snapshot_lock(job, by_host[h], False, cut=cut)
                    if not cut:
                        clients[h].resume_many(by_host[h])
                except PitstopError as e:
                    problems.append(f"{h}: {e.message}")
            if cut and len(clients) == len(by_host):  # every host answered: the job's communicators come back
                c = through_agents({w: h for h, ws in by_host.items() for w in ws}, lambda h: clients[h],
                                   self.s.cut_deadline_s)
                try:
                    states = {b["state"] for bs in c.get_all(c.workers).values() for b in bs} if c.get_all else set()
                    c.rewire() if "destroyed" in states else c.release()
                except PitstopError as e:
                    problems.append(f"the job's communicators: {e.message}")
        finally:
            for cl in clients.values():
                cl.close()
        return problems

    def restart_clock(self, job: str, at: float | None = None) -> None:
        self.last[job] = time.monotonic() if at is None else at

    # -- one snapshot --------------------------------------------------------------------------
    def take(self, job: str) -> dict[str, Any]:
        """Take one snapshot of `job` now; its record (committed or failed, with why)."""
        with self.lock:
            if job in self.taking or job in self.held:
                raise Conflict(f"job {job} is already being snapshotted or recovered", action="wait for it")
            self.taking.add(job)
            generation = self.recoveries.get(job, 0)
        self.restart_clock(job)
        try:
            return self._take(job, generation)
        finally:
            with self.lock:
                self.taking.discard(job)

    def heard(self, host: str) -> bool:
        """Whether `host` reported within the failure deadline: a call waiting on one that did not
        is abandoned (fanout.while_heard)."""
        h = self.store.host(host)
        return h is not None and healthy(h, self.s.failure_deadline_s)

    def hold(self, job: str) -> None:
        """A recovery of `job` begins: no snapshot of it pauses or commits until release(), and one
        begun before never commits, even after the release: its parts are of ranks the recovery
        replaced, on hosts that may be fenced (a snapshot dumped just before a partition, whose
        replica completes when the partition heals)."""
        with self.lock:
            self.held.add(job)
            self.recoveries[job] = self.recoveries.get(job, 0) + 1

    def release(self, job: str) -> None:
        with self.lock:
            self.held.discard(job)

    def commit(self, job: str, number: int, record: SnapshotRecord, generation: int) -> None:
        """Snapshot `number`, complete everywhere, counts from here, unless a recovery of the job
        began since it began (`generation`: the recoveries begun then): a recovery reading the
        previous one needs it to stay the newest, and this one's parts are of ranks it replaced."""
        with self.lock:
            if job in self.held or self.recoveries.get(job, 0) != generation:
                record.error = "a recovery of the job began before this snapshot was complete"
                self.store.update_snapshot(job, number, "failed", record)
                raise Conflict(record.error, action="the next snapshot follows the recovery")
            self._record(job, number, "committed", record)

    def _record(self, job: str, number: int, state: SnapshotState, record: SnapshotRecord) -> None:
        """The snapshot's record at its next step; a snapshot whose record was dropped meanwhile
        (the job's snapshots dropped by a failed recovery or its end) goes no further."""
        if not self.store.update_snapshot(job, number, state, record):
            raise Conflict(f"the snapshots of job {job} were dropped while snapshot {number} was taken",
                           code="snapshot_dropped", action="the next snapshot is taken if the job runs on")

    def _ranks(self, job: str) -> tuple[list[StoredWorker], dict[str, list[str]]]:
        """The job's ranks and their hosts, if a snapshot may be taken now: every rank registered
        and running, no host busy with a move, none silent.  Refused (Conflict), saying why, else."""
        ws = [w for w in self.store.workers(job=job) if w.state in ("running", "paused", "capturing", "stopped")]
        if not ws:
            raise FailedPrecondition(f"job {job} has no live ranks", action="nothing to snapshot")
        world = max((w.world or 0 for w in ws), default=0)
        if world and sorted(w.rank for w in ws) != list(range(world)):
            raise Conflict(f"job {job} runs {len(ws)} of its {world} ranks; a snapshot takes them all",
                           code="job_incomplete", action="it is taken once every rank has registered")
        busy_hosts = self.busy()
        busy = {w.host: busy_hosts[w.host] for w in ws if w.host in busy_hosts}
        not_running = [f"{w.id} is {w.state}" for w in ws if w.state != "running"]
        if busy or not_running:
            raise Conflict(f"job {job} is being moved ({busy or '; '.join(not_running)}); its snapshot waits",
                           action="it is taken at the next tick after the move")
        by_host: dict[str, list[str]] = defaultdict(list)
        for w in ws:
            by_host[w.host].append(w.id)
        hosts = sorted(by_host)
        known = {h.name: h for h in self.store.hosts()}
        silent = [h for h in hosts if h not in known or not healthy(known[h], self.s.heartbeat_timeout_s)]
        if silent:
            raise Conflict(f"hosts {', '.join(silent)} of job {job} are silent; no snapshot is taken meanwhile",
                           code="host_silent", action="the job is recovered from its last snapshot if they stay so")
        return ws, dict(by_host)

    def _take(self, job: str, generation: int) -> dict[str, Any]:
        ws, by_host = self._ranks(job)
        hosts = sorted(by_host)
        done = [s.number for s in self.store.snapshots(job)]
        number = max(done, default=0) + 1
        last = self.committed(job)
        before = last.record.buddies if last else {}
        buddy, buddy_why = buddies(hosts, self.store.hosts(), self.s.heartbeat_timeout_s, previous=before)
        record = SnapshotRecord(
            parts={w.id: SnapshotPart(host=w.host, rank=w.rank, buddy=buddy[w.host]) for w in ws},
            buddies=buddy, buddy_why=buddy_why, phases={},
            # a host whose buddy changed dumps whole: its new buddy holds no part a delta would be against
            whole={h: f"its buddy changed from {before[h]} to {buddy[h]}" for h in hosts
                   if before.get(h) not in (None, buddy[h])})
        self.store.put_snapshot(job, number, "taking", record)
        clients = {h: self.agent(h, timeout=SNAPSHOT_STEP_TIMEOUT_S) for h in set(hosts) | set(buddy.values())}
        t0 = time.monotonic()
        try:
            cut = through_agents({w.id: w.host for w in ws}, lambda h: clients[h], self.s.cut_deadline_s)
            shim = cut.uses_shim()  # NCCL: the shim's consistent cut, communicators destroyed; else SIGSTOP
            record.pause = "nccl_cut" if shim else "sigstop"
            self._record(job, number, "taking", record)  # how it pauses, for a restart to undo it
            faults.hit("snapshot_phase:check")
            in_parallel(lambda h: clients[h].snapshot_check(job, by_host[h], cut=shim), hosts)
            record.phases["check"] = round(time.monotonic() - t0, 4)
            pause_s = self._paused_dump(job, number, by_host, buddy, clients, record, cut if shim else None)
            record.pause_s = round(pause_s, 4)
            faults.hit("snapshot_phase:resume")  # resumed, not yet recorded replicating
            self._record(job, number, "replicating", record)
            faults.hit("snapshot_phase:replicate")
            self._await_replicas(job, number, hosts, clients, record)
        except PitstopError as e:
            record.error = e.message
            self.errors[job] = e.message
            # its record, written "taking" as it began, is gone where a failed recovery dropped the job's
            # snapshots meanwhile: a failure is no reason to write one back
            dropped = not self.store.update_snapshot(job, number, "failed", record)
            threading.Thread(target=self._drop, args=(job, dict(clients), self._committed(job)), daemon=True,
                             name=f"drop-{job}-{number}").start()
            clients = {}
            if dropped:
                log.warning("a snapshot under way when the job's snapshots were dropped failed; no record kept",
                            job=job, number=number, error=e.message)
            else:
                log.warning("snapshot failed; the previous one still counts", job=job, number=number, error=e.message)
            raise
        finally:
            for c in clients.values():
                c.close()
        record.seconds = round(time.monotonic() - t0, 4)
        faults.hit("snapshot_phase:commit")  # every replica complete, not recorded committed yet
        self.commit(job, number, record, generation)
        self.errors.pop(job, None)
        self.store.forget_snapshots(job, keep=number)
        everyone = {h.name: h for h in self.store.hosts() if healthy(h, self.s.heartbeat_timeout_s)}
        for h in everyone:
            try:
                with self.agent(h, timeout=SNAPSHOT_DROP_TIMEOUT_S) as c:
                    c.snapshot_drop(job, keep=number)
            except PitstopError as e:
                log.info("an older snapshot could not be dropped now", job=job, host=h, error=e.message)
        log.info("snapshot committed", job=job, number=number, pause_s=record.pause_s)
        return {"job": job, "number": number, "state": "committed", **record.dump()}

    def _paused_dump(self, job: str, number: int, by_host: dict[str, list[str]], buddy: dict[str, str],
                     clients: dict[str, AgentClient], record: SnapshotRecord, cut: Cut | None) -> float:
        """Pause, lock, dump, unlock, resume; the pause the job saw.  Each step pushes its way back
        onto one hold (coordinator/pausing.py), released whatever happened: every host is unlocked
        and resumed even if one fails.  cut: an NCCL job, parked at the shim's consistent cut with
        its communicators destroyed (no NCCL socket in any image), then rewired and resumed, as a
        move does; else every rank is stopped."""
        hosts = sorted(by_host)
        buddy_url = {h: self.url(buddy[h]) for h in hosts}
        t_pause = time.monotonic()
        with self.lock:
            if job in self.held:
                raise Conflict(f"job {job} is being recovered", action="its next snapshot follows the recovery")
            self.pausing.add(job)
        hold = JobHold(self.heard)
        try:
            self._pause_job(by_host, clients, record, cut, hold)
            t = time.monotonic()
            record.phases["pause"] = round(t - t_pause, 4)
            faults.hit("snapshot_phase:pause")  # paused, not locked yet

            def lock(h: str) -> None:
                hold.did("unlock", functools.partial(clients[h].snapshot_lock, job, by_host[h], False,
                                                     cut=cut is not None), host=h)  # before: a lock half done
                clients[h].snapshot_lock(job, by_host[h], True, cut=cut is not None)
            in_parallel(lock, hosts)
            record.phases["lock"] = round(time.monotonic() - t, 4)
            faults.hit("snapshot_phase:lock")  # paused and locked, nothing dumped yet
            t = time.monotonic()
            got = each_while_heard(
                lambda h: clients[h].snapshot_take(job, number, by_host[h], buddy_url[h], timeout=self.s.capture_deadline_s,
                                                   whole=h in record.whole, cut=cut is not None),
                hosts, self.heard, "its snapshot dump")
            record.phases["dump"] = round(time.monotonic() - t, 4)
            parts = [p for g in got for p in g["parts"].values()]
            record.bytes = sum(p["bytes"] for p in parts)
            # an incremental part's pages left in the part before it: not dumped, not sent again
            record.bytes_in_parent = sum(p.get("bytes_in_parent", 0) for p in parts)
            record.incremental = sorted(w for g in got for w, p in g["parts"].items() if p.get("parent"))
            for g in got:  # each part's process count and where its agent's time in the pause went
                for w, p in g["parts"].items():
                    if w in record.parts:
                        record.parts[w].processes, record.parts[w].steps = p.get("processes"), p.get("steps") or {}
            faults.hit("snapshot_phase:dump")  # dumped everywhere, still paused and locked
        finally:
            t = time.monotonic()
            try:
                problems = hold.release()  # raises only what is not an agent's answer, once every step ran
            finally:
                record.phases["resume"] = round(time.monotonic() - t, 4)
                with self.lock:
                    self.pausing.discard(job)  # else a recovery of the job would wait for this pause for ever
                self.paused(job, time.monotonic() - t_pause)  # the job did pause: its time is lost, whatever came after
            if problems:
                log.error("a host could not be unlocked or resumed after a snapshot", job=job, errors=problems)
        return time.monotonic() - t_pause

    def _pause_job(self, by_host: dict[str, list[str]], clients: dict[str, AgentClient], record: SnapshotRecord,
                   cut: Cut | None, hold: JobHold) -> None:
        """Every rank of the job paused: parked at the NCCL cut with its communicators destroyed,
        or stopped (SIGSTOP), all hosts at once; each with its way back on `hold`."""
        if cut is None:
            # past the deadline the agents resume the job by themselves: this coordinator would have, unless it died
            pausing.stop(lambda h: clients[h], by_host, self.s.capture_deadline_s + SNAPSHOT_PAUSE_MARGIN_S, hold)
            return
        res = cut.quiesce()  # releases the job itself when no cut is reached
        # where the job stands, for a recovery to say how many steps it redoes (progress.py)
        record.issued = res.issued
        record.ops_per_step = per_step_by_worker(cut.get_all(cut.workers, trail=True) if cut.get_all else {})
        # the communicators come back before anything runs on (pushed first: a destroy half done too)
        hold.did("the job's communicators", cut.rewire)
        cut.destroy()
        record.cut_rounds = res.rounds
        if self.s.release_device_cache:  # every rank is checkpointed: live device bytes only, as a move's
            record.device_released_bytes = _released(cut.trim(cut.workers, deadline_s=self.s.cut_deadline_s))

    def _await_replicas(self, job: str, number: int, hosts: list[str], clients: dict[str, AgentClient],
                        record: SnapshotRecord) -> None:
        t0 = time.monotonic()
        end = t0 + self.s.capture_deadline_s
        waiting = set(hosts)
        while waiting:
            for h in sorted(waiting):
                if not self.heard(record.buddies[h]):
                    raise HostSilent(f"{record.buddies[h]}, which keeps {h}'s replica, went silent",
                                     action="the next snapshot picks another buddy")
                mine = [s for s in clients[h].snapshots(job) if s["number"] == number]
                rep = mine[0]["replication"] if mine else None
                if rep is None:
                    raise FailedPrecondition(f"{h} no longer holds its part of snapshot {number}",
                                             code="snapshot_part_missing", action="the next snapshot is taken as scheduled")
                if rep["done"]:
                    if rep["error"]:
                        raise FailedPrecondition(f"{h} could not replicate its part to {rep['buddy']}: {rep['error']}",
                                                 code="replica_failed", action="check the buddy host's agent; the "
                                                 "next snapshot is taken as scheduled")
                    waiting.discard(h)
            if waiting and time.monotonic() > end:
                raise FailedPrecondition(f"the replicas of {', '.join(sorted(waiting))} were not complete within "
                                         f"{self.s.capture_deadline_s:g} s", code="replica_late",
                                         action="check the links between the hosts and their buddies")
            if waiting:
                time.sleep(0.1)
        record.phases["replicate"] = round(time.monotonic() - t0, 4)

    def _committed(self, job: str) -> int | None:
        c = [s.number for s in self.store.snapshots(job) if s.state == "committed"]
        return max(c) if c else None

    def committed(self, job: str) -> StoredSnapshot | None:
        c = [s for s in self.store.snapshots(job) if s.state == "committed"]
        return c[-1] if c else None

    def _drop(self, job: str, clients: dict[str, AgentClient], keep: int | None) -> None:
        """A failed snapshot's parts, dropped off the job's path (a dead host's call waits out its timeout)."""
        for h, c in clients.items():
            try:
                c.snapshot_drop(job, keep=keep)
            except PitstopError as e:
                log.info("a failed snapshot's parts could not be dropped now", job=job, host=h, error=e.message)
            finally:
                c.close()
