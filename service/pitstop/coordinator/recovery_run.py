"""One recovery of a job whose host died, from its last committed snapshot: an operation of the
operations' framework (operations.py), started by Recoveries (recovery.py) when a host of a job
with snapshots fails, or by an operator.

Phases (FORWARD), each written to the operation before it starts:
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
  resume   every rank of the job continues, from the snapshot's step (the commit: `commit`)
Recovery is idempotent: every phase can run again from the start, and the framework's takeover
and resume both do that (a failed spare is replaced by another one, a restarted coordinator runs
the operation again).  When no spare can take the ranks, every restored copy is ended and the
operation fails saying so: nothing runs half.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import structlog

from pitstop.coordinator import pausing, progress
from pitstop.coordinator.cut import through_agents
from pitstop.coordinator.fanout import each_while_heard, in_parallel, while_heard
from pitstop.coordinator.operations import Operation
from pitstop.coordinator.planner import healthy, usable_spare
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.store import BaseStore, StoreUnavailable
from pitstop.coordinator.timeouts import RECOVERY_AGENT_TIMEOUT_S
from pitstop.errors import FailedPrecondition, PitstopError
from pitstop.wire.agent_client import Fence
from pitstop.wire.recovery_state import RecoveryState
from pitstop.wire.snapshot_record import SnapshotPart

log = structlog.get_logger("pitstop.coordinator.recovery")

SPARE_TRIES = 2


class SnapshotHold(Protocol):
    """What a recovery needs of the job's snapshots (snapshots.Snapshots)."""

    pausing: set[str]

    def hold(self, job: str) -> None: ...
    def release(self, job: str) -> None: ...
    def restart_clock(self, job: str, at: float) -> None: ...
    def drop_everywhere(self, job: str, why: str) -> None: ...
    def heard(self, host: str) -> bool: ...


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



@dataclass
class _Recovering:
    """What every phase of one run of a recovery works with."""

    plan: Plan | None = None
    paused_at: float = 0.0  # wall clock: the survivors were stopped (the job's pause begins)
    spare: str = ""


class RecoveryRun(Operation):
    """One recovery being driven by this coordinator process."""

    md: RecoveryState
    fault_prefix = "recovery_phase"
    after_snapshots = True  # a snapshot left under way is undone first: its resume must not reach restored ranks
    reads_store_to_take_over = True  # it runs again from the record the store holds

    def __init__(self, store: BaseStore, settings: CoordinatorSettings, fence: Fence | None, op_id: str,
                 snaps: SnapshotHold, busy: Callable[[], dict[str, str]],
                 on_done: Callable[[dict[str, Any]], None]) -> None:
        op = store.op(op_id)
        assert op is not None
        super().__init__(store, settings, fence, op, RecoveryState.load(op.metadata))
        self.snaps = snaps
        self.busy = busy  # hosts other operations hold (a spare must be free)
        self.on_done = on_done  # the metrics, once the record is final

    # -- driving: every way in runs it from its start (it is idempotent) ------------------------
    def run(self) -> None:
        job = self.md.job
        self.snaps.hold(job)
        while job in self.snaps.pausing:  # a snapshot's pause ends first (its resume must not reach restored ranks)
            time.sleep(0.05)
        try:
            self.drive()
        except StoreUnavailable:
            log.error("a recovery could not record its progress; the watchdog runs it again once the database "
                      "takes writes", op=self.id, job=job)
        except PitstopError as e:
            log.error("recovery failed", op=self.id, job=job, error=e.message)
            self.md.result = "failed"
            self.end(done=True, result="failed", error=e.to_dict())
            if isinstance(e, Unrecoverable):  # not tried again by itself: the job restarts from its checkpoint
                self.snaps.drop_everywhere(job, "its recovery failed: " + e.message)
        except Exception as e:  # noqa: BLE001 - recorded, never left running
            log.exception("recovery crashed", op=self.id)
            self.end(done=True, result="failed",
                     error={"code": "internal", "message": repr(e), "action": "see the coordinator's log"})
        finally:
            self.snaps.release(job)
            self.snaps.restart_clock(job, at=-1e18)  # the next snapshot at once: only then is the job covered again

    def take_over(self) -> None:
        """Its thread ended on a write the database refused, after it may have stopped the
        survivors: run again from its start, from the record as the database has it."""
        self._reload()
        log.error("watchdog: a recovery's thread ended without ending it; running it again from its start",
                  op=self.id, takeover=self.takeovers)
        self.run()

    def resume(self, by: str) -> None:
        self._reload()
        self.run()

    def _reload(self) -> None:
        op = self.store.op(self.id)
        assert op is not None
        self.op, self.md = op, RecoveryState.load(op.metadata)

    def end(self, **fields: Any) -> None:
        """The operation's last record: kept in memory where the database refuses it, and written by
        the watchdog once it takes writes (the recovery is over on the agents: never run again)."""
        try:
            self.on_done({**self.md.dump(), "result": fields.get("result")})
        except Exception:  # noqa: BLE001 - a metric never fails a recovery
            log.exception("recording a recovery's metrics failed", op=self.id)
        if not self.finish(**fields):
            log.error("a recovery ended but its record could not be written; the watchdog writes it once the "
                      "database takes writes", op=self.id, result=fields.get("result"))

    # -- the phases ---------------------------------------------------------------------------
    def begin(self) -> _Recovering:
        return _Recovering()

    def _plan_phase(self, r: _Recovering) -> None:
        self.enter("plan")
        r.plan = self._plan()

    def _fence_phase(self, r: _Recovering) -> None:
        self.enter("fence", leaving="plan")
        assert r.plan is not None
        self._fence(r.plan)

    def _stop(self, r: _Recovering) -> None:
        self.enter("stop", leaving="fence")
        plan = r.plan
        assert plan is not None
        now, unread = self._survivor_blocks(plan)
        for k, v in progress.steps_redone(plan.nccl, plan.issued_at, plan.ops_per_step, now, unread).items():
            setattr(self.md, k, v)
        self.md.survivors = self._survivors(plan, now)
        r.paused_at = time.time()
        in_parallel(lambda h: self.agent(h).stop_workers(plan.job, plan.survivors[h]), sorted(plan.survivors))

    def _restore(self, r: _Recovering) -> None:
        self.enter("restore", leaving="stop")
        plan = r.plan
        assert plan is not None
        r.spare = self._restore_lost(plan)
        got = each_while_heard(lambda h: self.agent(h).snapshot_restore(plan.job, plan.number, plan.survivors[h],
                                                                        timeout=self.s.step_timeout_s),
                               sorted(plan.survivors), self.snaps.heard, "the restore of its ranks")
        md = self.md
        md.restored = {**md.restored, **{w: r for g in got for w, r in g["workers"].items()}}
        md.files = {"cut_back": [f for r in md.restored.values() for f in r.get("files_cut_back", [])]}

    FORWARD = (_plan_phase, _fence_phase, _stop, _restore)

    def commit(self, r: _Recovering) -> None:
        """Every rank resumed (rewired), the spare's role recorded, and the last record."""
        plan, spare, md = r.plan, r.spare, self.md
        assert plan is not None
        self.enter("resume", leaving="restore")
        self._resume(plan, spare)
        md.pause_s = round(time.time() - r.paused_at, 3)
        md.destination = spare
        md.phase = "done"
        md.result = "succeeded"
        self.store.set_role(spare, "active", {"reason": f"took job {plan.job}'s lost ranks", "operation":
                                              f"operations/{self.id}", "requested_by": md.requested_by})
        md.spares_left = sum(1 for h in self.store.hosts() if usable_spare(h)
                             and healthy(h, self.s.heartbeat_timeout_s))
        if not md.spares_left:
            md.conditions.append({"type": "SpareLeft", "status": "False", "reason": "NoSpareLeft",
                                  "message": f"{spare} was the last spare: the next host to fail has none"})
            log.error("the last spare was used: the next host failure has none", job=plan.job, spare=spare)
        self.end(phase="done", done=True, result="succeeded",
                 response={"job": plan.job, "destination": spare, "snapshot": plan.number})
        log.info("job recovered", op=self.id, job=plan.job, lost=plan.lost, spare=spare, snapshot=plan.number,
                 pause_s=md.pause_s, lost_s=md.lost_s)

    def _plan(self) -> Plan:
        """Everything the recovery needs, checked before anything is stopped: the snapshot still
        committed, the survivors' hosts and the lost parts' buddies alive and holding their parts,
        the files the job writes matchable.  Unrecoverable, saying why, where not."""
        md = self.md
        job, lost, number = md.job, md.node, md.snapshot
        started = time.time()
        snap = next((s for s in self.store.snapshots(job) if s.number == number), None)
        if snap is None or snap.state != "committed":
            raise Unrecoverable(f"snapshot {number} of job {job} is no longer complete",
                                action="restart the job from its own checkpoint")
        hosts = {h.name: h for h in self.store.hosts()}
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
        """The surviving ranks' shim blocks with their trails, read just before they are stopped
        (none for a job without the shim's communicators), and why not where they could not be read."""
        if not plan.nccl:
            return {}, None
        try:
            now: dict[str, list[dict[str, Any]]] = {}
            for got in in_parallel(lambda h: self.asking(h, RECOVERY_AGENT_TIMEOUT_S).shim_blocks_many(
                    plan.survivors[h], trail=True), sorted(plan.survivors)):
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
        states = {w.id: w.state for w in self.store.workers(job=plan.job)}
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

    def _fence(self, plan: Plan) -> None:
        md = self.md
        epoch = int(time.time() * 1000)
        self.store.fence(plan.job, plan.lost, epoch=epoch)
        md.fence_epoch = epoch
        # a host still heard from (an operator's recovery) is told now; a silent one when it reports again
        md.fenced_now = plan.lost_heard and self._fence_now(plan.job, plan.lost, epoch)

    def _resume(self, plan: Plan, spare: str) -> None:
        """Every rank at once; an NCCL job's communicators re-created at their new addresses (its
        ranks were restored parked at the cut, communicators destroyed), as after a move."""
        where = {h: list(ids) for h, ids in plan.survivors.items()}
        where.setdefault(spare, []).extend(plan.lost_parts)
        problems = pausing.resume(self.agent, where).problems
        for w in plan.lost_parts:
            self.store.set_worker_host(w, spare, state="running")
        self.md.phases["resume"] = round(self.phase_seconds(), 4)
        if problems:
            raise PitstopError(f"the job was restored but some ranks could not be resumed: {'; '.join(problems)}",
                               code="resume_incomplete", action="send those ranks SIGCONT, or stop the job")
        if plan.nccl:
            self.enter("rewire")
            hosts_of = {w: spare if w in plan.lost_parts else p.host for w, p in plan.parts.items()}
            through_agents(hosts_of, self.agent, self.s.cut_deadline_s).rewire()
            self.md.phases["rewire"] = round(self.phase_seconds(), 4)

    def _fence_now(self, job: str, lost: str, epoch: int) -> bool:
        """A lost host whose agent still answers (an operator's recovery, a host whose beats alone
        were lost) ends the job's workers now, before any copy of them is restored; one that does
        not answer is told when it reports again (enforce_fences) and isolates them meanwhile
        by itself (agent/snapshots.py).  Whether it answered."""
        try:
            with self.asking(lost, RECOVERY_AGENT_TIMEOUT_S) as c:
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
                with self.asking(h, RECOVERY_AGENT_TIMEOUT_S) as c:
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
                with self.asking(a[0], RECOVERY_AGENT_TIMEOUT_S) as c:
                    c.snapshot_check_files(job, number, a[2], a[1], timeout=RECOVERY_AGENT_TIMEOUT_S)
            except PitstopError as e:
                return f"{a[0]}: {e.message}"
            return None

        problems = [p for p in in_parallel(ask, asks) if p]
        if problems:
            raise Unrecoverable(f"job {job} cannot be rolled back to snapshot {number}: {'; '.join(problems)}",
                                action="restart the job from its own checkpoint")

    def _restore_lost(self, plan: Plan) -> str:
        """The lost host's ranks on a spare; another spare if one fails.  Where none can take
        them, everything restored so far is ended and the recovery fails (nothing runs half)."""
        tried: list[str] = []
        last: PitstopError | None = None
        md = self.md
        earlier = md.destination  # where an earlier run of this recovery (a coordinator since lost) sent them
        for _ in range(SPARE_TRIES):
            spare = self._spare(plan.alive - set(tried) - set(plan.survivors))
            if spare is None:
                break
            tried.append(spare)
            self.store.clear_fence(plan.job, spare)  # a host fenced for the job earlier takes its ranks now
            if spare == earlier:  # the copies that run restored there are ended first, as the survivors' are
                self._discard(spare, plan.job, list(plan.lost_parts))
            md.destination = spare
            self.save(dest=spare)
            try:
                self._to_spare(plan.job, plan.number, plan.lost_parts, spare)
                return spare
            except PitstopError as e:
                last = e
                md.spares_failed.append({"spare": spare, "error": e.message})
                self.save()
                log.warning("a spare could not take the lost ranks; trying another", op=self.id, spare=spare,
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

    def _spare(self, candidates: set[str]) -> str | None:
        """The first usable spare of `candidates` that no other operation holds (this recovery's own
        record names the spare an earlier run of it chose: that one stays a candidate)."""
        busy = {h: o for h, o in self.busy().items() if o != self.id}
        hosts = [h for h in self.store.hosts() if h.name in candidates and h.name not in busy]
        spares = sorted(h.name for h in hosts if usable_spare(h))
        return spares[0] if spares else None

    def _to_spare(self, job: str, number: int, lost_parts: dict[str, SnapshotPart], spare: str) -> None:
        """The lost ranks' replicas onto the spare (already there where it was their buddy), kept
        there as replicas, then restored from them."""
        md = self.md
        spare_url = self.url(spare)
        by_buddy: dict[str, list[str]] = defaultdict(list)
        for w, p in lost_parts.items():
            if p.buddy != spare:
                by_buddy[p.buddy].append(w)
        sent = in_parallel(lambda b: while_heard(
            lambda: self.agent(b).send_replicas(job, number, by_buddy[b], spare_url, timeout=self.s.capture_deadline_s),
            (b, spare), self.snaps.heard, f"sending replicas to {spare}"), sorted(by_buddy))
        md.replicas_sent = {w: r for g in sent for w, r in g["workers"].items()}
        got = while_heard(lambda: self.agent(spare).snapshot_restore(job, number, sorted(lost_parts),
                                                                       timeout=self.s.step_timeout_s, side="replica"),
                          spare, self.snaps.heard, "the restore of the lost ranks")
        md.restored.update(got["workers"])
        self.save()

    def _discard(self, host: str, job: str, ids: list[str]) -> bool:
        """End the ranks restored on `host` so far; False: it could not be reached."""
        if not self.snaps.heard(host):  # silent past the failure deadline: no call would be answered
            log.warning("could not end a half-restored rank: its host is silent", host=host, job=job)
            return False
        try:
            with self.asking(host, RECOVERY_AGENT_TIMEOUT_S) as c:
                c.stop_workers(job, ids)
            return True
        except PitstopError as e:
            log.warning("could not end a half-restored rank", host=host, job=job, error=e.message)
            return False
