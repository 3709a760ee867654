"""An evacuation as one durable, resumable operation: OpRun drives one, phase by phase.

Phases, each written to the store before it starts:
  pause    peers of the affected jobs on other hosts are stopped (SIGSTOP); the
           consistent cut between collectives plugs in here for NCCL jobs
  capture  every leaving worker is dumped and streamed to the spare, in parallel
  verify   the spare checks each copy against its manifest
  release  the stopped sources are killed; their images stay on the node
  restore  the spare restores every worker
  commit   <- the commit point: the coordinator records the new membership
  resume   peers continue (the downtime ends here)
  cleanup  the node frees the moved workers' images and network locks; after the resume,
           so that a node that dies past the commit point holds up nobody (retried later)
  fill     network post-copy only: until every moved worker's memory is in place the node
           serves it, so the operation stays open and the node `draining`
Before the commit point any failure, cancel, deadline or coordinator restart
rolls back: copies on the spare are discarded, sources are resumed in place
(or restored from their own images once released), peers resumed.  After it,
the driver only moves forward.  Nothing here ever leaves a job paused or
running twice: see resume() for what a restarted coordinator does.

The database can fail too (a full file system).  Before the commit point a phase
that cannot be recorded is not started: the move rolls back.  The rollback, and
everything past the commit point, acts on the agents whatever the database does:
its writes there are best effort, kept, and written once the database takes
writes again (journal.py).  And the operations' watchdog (operations.Operations.watch),
every few seconds, looks for an operation whose driving thread ended without ending
it (a bug, an error nobody expected) and drives its rollback, or its commit
(take_over): no rank stays paused because a thread died.  OpRun is an operation of
that framework (operations.Operation): its record, phases and agents' clients are
the framework's; FORWARD is its phase table.

The phases' collaborators hold their own state and see the operation through
evacuation_ops.Evacuation: the pre-copies (precopies.py), the early rewire
(prewire.py), the after-commit checks and fills (fills.py), the source's cleanup
(cleanup.py) and the after-move watch (aftermove.py).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx
import structlog

from pitstop import faults, priority
from pitstop.coordinator import ledger, pausing, progress
from pitstop.coordinator.aftermove import AfterMoveWatch
from pitstop.coordinator.cleanup import SourceCleanup
from pitstop.coordinator.cut import Cut, device_memory, issued_by_worker, through_agents
from pitstop.coordinator.evacuation_ops import DriverHooks
from pitstop.coordinator.fanout import by_agent, in_parallel
from pitstop.coordinator.filecheck import check_files
from pitstop.coordinator.fills import AfterCommit
from pitstop.coordinator.operations import Operation
from pitstop.coordinator.precopies import PreCopies
from pitstop.coordinator.prewire import EarlyRewire
from pitstop.coordinator.rollback import Undo
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.store import StoreUnavailable
from pitstop.coordinator.timeouts import (
    AGENT_QUESTION_TIMEOUT_S,
    MOVE_PAUSE_MARGIN_S,
)
from pitstop.errors import DeadlineExceeded, PitstopError, Unavailable, rpc_status
from pitstop.wire.agent_client import AgentClient
from pitstop.wire.capture_report import CaptureReport
from pitstop.wire.evacuation import AfterMove, CutRecord, EvacuationState, MovePlan
from pitstop.wire.worker_report import WorkerReport

log = structlog.get_logger("pitstop.coordinator.driver")


class Cancelled(PitstopError):
    http_status = 409
    code = "cancelled"




class OpRun(Operation):
    """One evacuation being driven (or taken over, or resumed) by this coordinator process."""

    md: EvacuationState

    @property
    def settings(self) -> CoordinatorSettings:
        return self.s

    def pause_deadline_s(self) -> float:
        """How long the peers' pause may last before their agents end it by themselves: the whole
        operation's deadline (its rollback comes before it) and a margin."""
        return self.s.operation_deadline_s + MOVE_PAUSE_MARGIN_S

    def __init__(self, driver: DriverHooks, op_id: str) -> None:
        op = driver.store.op(op_id)
        assert op is not None
        super().__init__(driver.store, driver.s, driver.fence, op, EvacuationState.load(op.metadata),
                         observe=driver.observe_phase)
        self.d = driver
        self.undoing: PitstopError | None = None  # why the rollback began, for a takeover to finish it
        # the job's collectives counted while it ran and at the cut (coordinator/progress.py)
        self.progress_before: progress.Sample | None = None
        self.progress_cut: progress.Sample | None = None
        # Where the job is stopped with SIGSTOP, each rank's pause as its agents timed it (wall
        # clock): stopped (SIGSTOP, or the capture stopping a leaving rank) and running again.
        self.rank_stopped: dict[str, float] = {}
        self.rank_running: dict[str, float] = {}
        # The early rewire's first half, on a thread beside the capture (prewire.py).
        self.prewire = EarlyRewire(self)

    def condition(self, type_: str, status: bool, reason: str, message: str = "") -> None:
        with self.lock:
            self.md.set_condition(type_, status, reason, message)
            self.save()

    def check(self) -> None:
        """Between phases: honour cancel and the operation's deadline."""
        op = self.store.op(self.id)
        if op and op.cancel_requested:
            raise Cancelled("cancelled by the operator before the commit point", action="nothing to do; "
                            "the job keeps running where it was")
        if time.monotonic() - self.started > self.s.operation_deadline_s:
            raise DeadlineExceeded(f"the evacuation did not reach its commit point within "
                                   f"{self.s.operation_deadline_s:.0f} s", action="check the agents' logs")

    def cut(self, moved: bool = False) -> Cut:
        """The consistent-cut driver over every worker of the affected jobs, through their agents.

        moved: the leaving workers are addressed at the destination (after restore)."""
        hosts = dict(self.md.peers)
        for wid in self.md.workers:
            hosts[wid] = self.md.destination if moved else self.md.node
        return through_agents(hosts, self.agent, self.s.cut_deadline_s)

    def image_id(self, wid: str) -> str:
        return f"{self.id}-{wid}".replace(".", "_")

    def each(self, fn: Callable[[str], Any]) -> None:
        """Run fn for every leaving worker in parallel; raise the first failure."""
        in_parallel(fn, list(self.md.workers))

    # -- the forward path ---------------------------------------------------------------------
    def run(self) -> None:
        """The move, phase by phase (FORWARD), then the commit.  Any failure before the commit point
        goes to `rollback`, which undoes on the agents what the record says was done, whichever
        phase it stopped in (it may run in a restarted coordinator, from the record alone)."""
        try:
            self.drive()
        except Exception as e:  # noqa: BLE001 - every failure before commit rolls back
            err = e if isinstance(e, PitstopError) else PitstopError(f"internal error: {e!r}",
                                                                     action="see the coordinator's log")
            if self.md.committed:
                self.finish_commit(err)
            else:
                self.rollback(err)

    def begin(self) -> "_Move":
        return _Move(node=self.md.node, dest=self.md.destination, src=self.agent(self.md.node),
                     dst=self.agent(self.md.destination))

    def commit(self, m: "_Move") -> None:
        self._commit()

    def _plan(self, m: "_Move") -> None:
        self.condition("Planned", True, "SpareSelected", f"{len(self.md.workers)} worker(s) of "
                       f"{', '.join(self.md.jobs)} move from {m.node} to {m.dest}")
        self.progress_before = self._count_collectives(self.cut())
        self._check_files(m.src, m.dst)
        m.plan = self._settle(m.src)

    @staticmethod
    def _count_collectives(cut: Cut) -> progress.Sample | None:
        """Every worker's collectives so far, for the job's rate before the move, and its operations
        per step from their trail; None where they cannot be read now (it is only a measurement:
        the move does not wait on it)."""
        try:
            at = time.time()
            got = cut.get_all(cut.workers, trail=True) if cut.get_all else {}
        except (PitstopError, httpx.HTTPError):
            return None
        return progress.Sample(at, issued_by_worker([(w, b) for w, bs in got.items() for b in bs]),
                               per_step=progress.per_step_by_worker(got))

    def _precopy_phase(self, m: "_Move") -> None:
        assert m.plan is not None
        PreCopies(self, m.src).send(m.dst, m.plan)

    def _pause(self, m: "_Move") -> None:
        """Pause: the intent persisted first, so a restart knows whom to resume."""
        assert m.plan is not None
        self.enter("pause")
        cut = self.cut()
        shim = cut.uses_shim()  # asked while the job runs: the downtime starts at the first pause below
        m.plan.pause = "nccl_cut" if shim else "sigstop"
        if shim:
            self.md.first_pause = time.time()
            self.save()
            # NCCL jobs: every rank parks at one consistent point between collectives, then the
            # real communicators are destroyed, so no NCCL socket crosses the capture.
            with self.lock:
                self.md.cut = CutRecord(used=True, destroyed=False)
                self.save()
            res = cut.quiesce()
            self.progress_cut = progress.Sample(time.time(), res.issued)
            cut.destroy()
            with self.lock:
                self.md.cut = CutRecord(used=True, destroyed=True, rounds=res.rounds, seconds=round(res.seconds, 4))
                self.save()
            if self.s.release_device_cache:
                self._release_device_cache(cut)
            self.leave("pause")
            self.condition("Quiesced", True, "ConsistentCut",
                           f"{len(cut.workers)} worker(s) parked at a consistent cut after {res.rounds} round(s); "
                           "NCCL communicators destroyed")
        else:
            # One call per agent, all agents at once: one round trip, not one per peer (0.15 s of
            # the pause at 8 ranks, on 2 cores, when they went one by one).  Resuming is idempotent
            # and resumes every peer, so a restart between here and the save below leaves nothing
            # stopped.  This thread (and the calls' threads, which inherit it) on SCHED_FIFO: the
            # ranks still run and would otherwise take their turns between its steps.
            peers = list(self.md.peers.items())
            with priority.critical():
                self.md.first_pause = time.time()
                self.save()
                # past the operation's deadline and a margin the agents resume them by themselves: this
                # coordinator would have (rolled back), unless it died and never came back
                self.rank_stopped.update(pausing.stop(self.agent, dict(by_agent(peers)), self.pause_deadline_s()))
                with self.lock:  # leave() writes them: one state write after the round, not two
                    self.md.paused.extend(wid for wid, _ in peers)
                    # the round alone: the phase also holds the shim check, made while the job runs
                    self.md.pause_round_s = round(time.time() - self.md.first_pause, 4)
                    self.leave("pause")
            self.condition("Quiesced", True, "PeersPaused", f"{len(self.md.paused)} peer(s) paused (SIGSTOP)")
        self.check()

    def _release_device_cache(self, cut: Cut) -> None:
        """The leaving ranks, parked with their communicators gone, release what their allocators
        hold reserved without using it: their CUDA checkpoint then carries live bytes only.  Peers
        keep their caches (nothing of theirs is checkpointed).  A failure raises: the move rolls
        back and the job runs on where it was."""
        t0 = time.monotonic()
        got = cut.trim(sorted(self.md.workers), deadline_s=self.s.cut_deadline_s)
        with self.lock:
            for wid, blocks in got.items():
                self.md.workers[wid].device_memory = device_memory(blocks)
            assert self.md.cut is not None
            self.md.cut.trim_s = round(time.monotonic() - t0, 4)
            self.save()

    def _capture(self, m: "_Move") -> None:
        assert m.plan is not None
        plan, src, dst = m.plan, m.src, m.dst
        self.enter("capture")
        with self.lock:  # from here a rollback must look for captures on the node, even unrecorded ones
            self.md.capture_begun = True
            self.save()
        self.prewire.begin()

        def capture(wid: str) -> None:
            w = self.md.workers[wid]
            cap = src.capture(wid, dest_url=dst.url, image_id=self.image_id(wid),
                              keep_peers=self.md.keep_peers, post_copy=plan.post_copy)
            with self.lock:
                w.capture_id, w.state = cap["id"], "capturing"
                self.save()

            def progress(c: CaptureReport) -> None:
                with self.lock:
                    w.bytes_done, w.bytes_total = c.bytes_sent, c.bytes_total
                    self.md.bytes_done = sum(x.bytes_done for x in self.md.workers.values())
                    self.save()

            report = src.wait_capture(cap["id"], self.s.capture_deadline_s, progress)
            if report.state == "failed":
                raise PitstopError.from_dict(report.error or {"message": "capture failed"})
            if report.stopped_at:
                self.rank_stopped[wid] = report.stopped_at
            if report.gpu.get("device_bytes") is not None:  # what its CUDA checkpoint copied out
                with self.lock:
                    w.device_memory = {**(w.device_memory or {}), "checkpointed": report.gpu["device_bytes"]}
            with self.lock:
                w.captured(report)
                self.md.totals()
                self.save()

        self.each(capture)
        self.leave("capture")
        later = self.md.bytes_after_resume or 0
        self.condition("Transferred", True, "ImagesStreamed", f"{self.md.bytes_total} bytes"
                       + (f"; {later} bytes of memory follow after the resume (network post-copy)" if later else ""))
        self.check()

    def _verify(self, m: "_Move") -> None:
        self.enter("verify")
        self.each(lambda wid: m.dst.verify(self.image_id(wid)))
        self.leave("verify")
        self.check()

    def _release(self, m: "_Move") -> None:
        self.enter("release")

        def release(wid: str) -> None:
            cid = self.md.workers[wid].capture_id
            assert cid is not None, "every leaving worker is captured before the release"
            m.src.release(cid)
            with self.lock:
                self.md.workers[wid].state = "released"
                self.save()

        self.each(release)
        self.leave("release")

    def _restore(self, m: "_Move") -> None:
        self.enter("restore")

        def restore(wid: str) -> None:
            r = m.dst.restore(self.image_id(wid), timeout=self.s.step_timeout_s)
            with self.lock:
                self.md.workers[wid].state = "restored"
                self.md.workers[wid].restored_pid = r["worker"]["root_pid"]
                self.md.workers[wid].restore_phases = r.get("phases", {})
                self.save()
            self.rank_running.update(pausing.answered_at([[WorkerReport.model_validate(r["worker"])]], "running_since"))

        self.each(restore)
        ran = [self.rank_running[w] for w in self.md.workers if w in self.rank_running]
        if ran:
            with self.lock:
                self.md.last_restore = max(ran)
        self.leave("restore")
        self.condition("Restored", True, "WorkersRestored", f"on {m.dest}")

    def _rewire(self, m: "_Move") -> None:
        """NCCL jobs: communicators re-created behind the same handles, at the new addresses."""
        if self.md.cut and self.md.cut.destroyed:
            self.enter("rewire")
            self.prewire.end()
            cutmd = self.md.cut
            if cutmd.early_ids:  # the ranks that stay began during the capture: the restored ones join them
                secs, ids = self.cut(moved=True).finish_rewire(cutmd.early_ids, on_join=self._early_ids_spent)
            else:
                secs, ids = self.cut(moved=True).rewire()
            early = bool(cutmd.early_ids)
            with self.lock:
                cutmd.destroyed, cutmd.rewired = False, True
                cutmd.new_ids = {k: v[:32] for k, v in ids.items()}
                cutmd.early = early
                cutmd.unset("early_ids")  # spent, and in new_ids: the record need not keep them whole
                self.save()
            self.leave("rewire")
            self.condition("Rewired", True, "CommunicatorsRecreated",
                           f"{len(ids)} communicator(s) re-created with new unique ids"
                           + ("; the ranks that stay began during the capture, the restored ones joined them"
                              if early else f" after the restore ({cutmd.early_why_not or 'no early rewire'})"))
        self.check()

    def _early_ids_spent(self) -> None:
        """Recorded before a restored rank is told the early rewire's ids: from here a rollback
        cannot have the sources join them (a restored copy may have used them) and redoes."""
        with self.lock:
            assert self.md.cut is not None
            self.md.cut.early_joined = True
            self.save()
        faults.hit("rewire:ids_spent")

    def _check_files(self, src: AgentClient, dst: AgentClient) -> None:
        """Refuse, before anything pauses, a destination that lacks files the leaving workers use
        by path (their Python, libraries, working directories, open files: proc/files.py).
        CRIU's restore would fail on it after the pause and the move would roll back."""
        res = check_files(src, dst, list(self.md.workers))
        if res.unchecked:
            log.warning("an agent predates the file check; the restore will say what is missing, if anything",
                        op=self.id, workers=res.unchecked)
        err = res.error(self.md.destination)
        if err:
            raise err
        self.condition("FilesPresent", True, "DestinationHasFiles",
                       f"{self.md.destination} has every path the leaving workers use" if not res.unchecked
                       else "not checked: an agent predates the check")

    def _settle(self, src: AgentClient) -> MovePlan:
        """The move's plan, decided here once and recorded: what the request asked, else the
        coordinator's settings.  Post-copy by default gives way, logged, where the source cannot
        serve it (asked for, it was refused before anything paused: service.check_post_copy)."""
        post = self.md.post_copy
        if post is None and self.s.post_copy:
            support = src.info(timeout=AGENT_QUESTION_TIMEOUT_S).get("post_copy") or {}
            why = support.get("unavailable") if "unavailable" in support else "its agent predates post-copy"
            post = not why
            if why:
                log.warning("post-copy by default is unavailable on the source; the images travel whole",
                            op=self.id, node=self.md.node, reason=why)
        post = bool(post)
        pre = (self.s.pre_copy if self.md.pre_copy is None else self.md.pre_copy) and not post
        with self.lock:
            self.md.plan = MovePlan(pre_copy=pre, post_copy=post)
            self.save()
        return self.md.plan

    def _pass_commit_point(self) -> None:
        """The commit point is its record: until the database holds `committed`, a restarted
        coordinator would roll back, so this one must too (the write's error is raised, and
        the metadata says not committed).  From here on, only forward, and the agents' side
        never waits on the database (best_effort)."""
        with self.lock:
            if not self.md.committed:
                self.md.committed = True
                try:
                    self.save()
                except StoreUnavailable:
                    self.md.committed = False
                    raise
            self.best_effort = True

    def _commit(self) -> None:
        node, dest = self.md.node, self.md.destination
        self._pass_commit_point()
        self.enter("commit")
        faults.hit("after_commit_point")
        for wid, w in self.md.workers.items():  # the membership first: the coordinator's own record, no agent asked
            left = {"host": node, **w.left_copy} if w.left_copy else None
            self.record(functools.partial(self.store.set_worker_host, wid, dest, left=left))
        why = {"reason": self.md.reason, "requested_by": self.md.requested_by, "operation": f"operations/{self.id}"}
        self.record(lambda: self.store.set_role(dest, "active", {**why, "reason": f"took {node}'s workers"}))
        filling = bool(self.md.bytes_after_resume)
        self.record(lambda: self.store.set_role(node, "draining" if filling else "drained", why))
        self.save()
        self.leave("commit")
        self.condition("Committed", True, "MembershipRecorded", f"{dest} now runs the workers; {node} is drained")
        self.enter("resume")
        with priority.critical():  # the woken ranks would take their turns before this thread's
            stuck = self._resume_peers()
            resumed_at = time.time()
        if stuck:  # finish_commit tries again (resuming is idempotent); the downtime is not over
            raise Unavailable("peers could not be resumed: " + "; ".join(stuck),
                              action="check those peers' agents; the coordinator keeps trying")
        self.leave("resume")
        if self.md.last_resume is None:  # a restarted coordinator finishing this op keeps the first
            self.md.last_resume = resumed_at
            if self.md.first_pause is not None:  # recorded as the pause began: always, but say none if not
                self.md.downtime_s = round(self.md.last_resume - self.md.first_pause, 4)
        after = AfterCommit(self)
        after.check_replacements(dest)  # after the last resume: nobody waits for this look
        self.clean_source()
        failed = after.await_network(node, dest) if filling and self.d.await_fills else None
        self.settle_job_pause()
        response = {"@type": "type.pitstop.dev/EvacuateResponse", "node": node, "destination": dest,
                    "workers": sorted(self.md.workers), "downtime_s": self.md.downtime_s,
                    "bytes": self.md.bytes_total}
        if filling:
            response.update(bytes_after_resume=self.md.bytes_after_resume, fill_s=self.md.fill_s)
        if self.md.source_cleanup_pending:
            response["source_cleanup_pending"] = self.md.source_cleanup_pending
        if failed:
            self.condition("Succeeded", False, failed.code, failed.message)
            self.d.count("failed", self.md.bytes_total or 0)
            self.finish(phase="done", done=True, result="failed", error=rpc_status(failed), response=response)
            log.error("evacuated, but not every fill ended well", op=self.id, node=node, reason=failed.message)
            return
        self.condition("Succeeded", True, "Evacuated", f"downtime {self.md.downtime_s} s")
        self.d.count("succeeded", self.md.bytes_total or 0, self.md.downtime_s)
        self.finish(phase="done", done=True, result="succeeded", response=response)
        log.info("evacuated", op=self.id, node=node, dest=dest, downtime_s=self.md.downtime_s,
                 **self.md.phases)
        watch = AfterMoveWatch(self)
        watch.measure(resumed_at)
        watch.watch_local_fills(dest)

    def record_after(self, after: AfterMove) -> None:
        """The job after the move (aftermove.py), into the record, the ledger's pause and the metrics."""
        with self.lock:
            self.md.after_move = after
            self.best_effort = True  # the operation is done: a refused write only delays this one
            self.save()
        self.settle_job_pause()
        if self.d.on_after_move:
            self.d.on_after_move(after)
        log.info("the job after the move", op=self.id, **after.model_dump(exclude_none=True))

    def settle_job_pause(self) -> None:
        """The pause the job saw (ledger.job_pause), again whenever one of its inputs arrives: the
        last resume, the fills' ends, the job's first step after the move."""
        with self.lock:
            pause, until = ledger.job_pause(self.md)
            if pause is None or (pause, until) == (self.md.job_pause_s, self.md.job_pause_until):
                return
            self.md.job_pause_s, self.md.job_pause_until = pause, until
            self.save()

    def clean_source(self, later: bool = False) -> bool:
        """The source frees what the move left there (cleanup.py); whether nothing is left."""
        return SourceCleanup(self, self.d.cleanup_pending).free(later)

    def finish_commit(self, err: PitstopError) -> None:
        """Past the commit point: retry the remaining steps; never roll back."""
        self.best_effort = True  # the agents' side never waits on the database from here
        for attempt in range(5):
            try:
                self._commit()
                return
            except Exception as e:  # noqa: BLE001
                log.warning("commit step failed; retrying", op=self.id, attempt=attempt, error=str(e))
                time.sleep(1 + attempt)
        self.condition("Succeeded", False, "CommitIncomplete", str(err))
        self.finish(done=True, result="failed", error=rpc_status(PitstopError(
            f"the workers run on {self.md.destination}, but finishing the commit failed: {err}",
            code="commit_incomplete", action="the error names what failed: peers whose agent could not be reached "
                                             "may still be paused (SIGSTOP) and continue when sent SIGCONT")))

    def _resume_peers(self) -> list[str]:
        """Resume every peer (pausing.resume); what went wrong for which host."""
        got = pausing.resume(self.agent, dict(by_agent(list(self.md.peers.items()))))
        self.rank_running.update(got.running_since)
        return got.problems

    # -- the way back -------------------------------------------------------------------------
    def take_over(self) -> None:
        """Driven by the watchdog (Operations.watch): the thread that drove this operation ended
        without ending it.  Before the commit point: roll back (or finish the rollback it
        began); past it: finish the commit."""
        why = self.crash or "it ended without a word"
        if self.md.committed:
            self.finish_commit(PitstopError(f"the coordinator's driver of this operation stopped past the "
                                             f"commit point: {why}"))
            return
        self.rollback(self.undoing or PitstopError(
            f"the coordinator's driver of this operation stopped in phase {self.md.phase!r}, before "
            f"the commit point ({why}); the coordinator's watchdog rolled it back", code="driver_stopped",
            action="evacuate again if the host must still be drained; the coordinator's log has the error"))

    def rollback(self, err: PitstopError) -> None:
        """Undo on the agents whatever the database does: its writes here are best effort.

        Two lists of what could not be undone: `problems`, where the job may not be whole where it
        was (the operator must act), and `leftovers`, where it is whole but the destination may
        hold a copy to clean up."""
        cancelled = isinstance(err, Cancelled) or err.code == "cancelled"
        log.warning("rolling back", op=self.id, reason=err.message)
        self.best_effort = True
        self.undoing = self.undoing or err
        self.enter("rollback")
        problems: list[str] = []
        leftovers: list[str] = []
        src: AgentClient | None
        dst: AgentClient | None
        try:
            src, dst = self.agent(self.md.node), self.agent(self.md.destination)
        except PitstopError as e:
            src = dst = None
            problems.append(e.message)
        if src is not None:  # one still sending (a coordinator restarted mid-way) would land after the discard
            PreCopies(self, src).end()
        undo = Undo(self)
        for wid, w in self.md.workers.items():
            if dst is not None:
                leftovers += undo.discard_copy(dst, wid)
            if src is not None:
                undo.undo_capture(src, dst, wid, w, problems, leftovers)
        problems += self._resume_peers()
        problems += undo.rewire_in_place()
        out = undo.error(err, problems, leftovers)
        self.condition("RolledBack", not problems, "Cancelled" if cancelled else "Failed", out.message)
        self.d.count("cancelled" if cancelled else "failed", 0)
        self.finish(phase="done", done=True, result="cancelled" if cancelled else "failed", error=rpc_status(out))

    def resume(self, by: str) -> None:
        """Found running by a coordinator that did not start it (a restart, a new leader): past the
        commit point it is finished, before it rolled back.  Its first write says who, and when."""
        committed = self.md.committed
        try:
            self.condition("Resumed", True, "CoordinatorChanged",
                           f"resumed by {by}: {'finished past the commit point' if committed else 'rolled back'}")
        except StoreUnavailable:
            pass  # a database that refuses it delays nothing on the agents
        if committed:
            log.info("reconcile: finishing committed operation", op=self.id)
            self.finish_commit(PitstopError("coordinator restarted"))
            return
        log.info("reconcile: rolling back operation", op=self.id, phase=self.md.phase)
        self.rollback(PitstopError(
            f"the coordinator restarted (or another took over) during phase {self.op.phase!r}, before the "
            "commit point; rolled back", code="coordinator_restarted",
            action="evacuate again if the host must still be drained"))

    # The forward phases, in order, up to the commit point (commit and after: only forward).  The
    # way back from any of them is rollback, driven by the record each phase writes.
    FORWARD = (_plan, _precopy_phase, _pause, _capture, _verify, _release, _restore, _rewire)

@dataclass
class _Move:
    """What every forward phase of one operation works with."""

    node: str
    dest: str
    src: AgentClient
    dst: AgentClient
    plan: MovePlan | None = None
