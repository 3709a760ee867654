"""What a move is watched for once it is done: the job's progress after it, and the fills of
ranks restored lazily from the destination's own copy.  Nobody waits for either; each runs on a
thread of its own and adds what it learns to the operation's record, where a refused write only
delays it (the operation is done: best effort).

The operation (evacuation_run.OpRun) is what it reports into, through the small surface of `Evacuation` (evacuation_ops.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import structlog

from pitstop.coordinator import progress
from pitstop.coordinator.cut import issued_by_worker
from pitstop.coordinator.evacuation_ops import Evacuation
from pitstop.coordinator.fanout import by_agent, in_parallel
from pitstop.coordinator.timeouts import AGENT_QUESTION_TIMEOUT_S, PROGRESS_READ_TIMEOUT_S
from pitstop.errors import PitstopError
from pitstop.wire.agent_client import AgentClient

log = structlog.get_logger("pitstop.coordinator.aftermove")


class AfterMoveWatch:
    """The watches of one done move."""

    def __init__(self, run: Evacuation) -> None:
        self.run = run

    def watch_local_fills(self, dest: str) -> None:
        """A post-copy restore from the destination's own copy (its agent's PITSTOP_AGENT_LAZY_RESTORE)
        holds nothing open: the operation is done at the resume, and its fill runs on.  Its end is
        the job's pause's end where the job stalls on it (ledger.job_pause): asked of the
        destination on a thread of its own, until it ends or fill_deadline_s passes."""
        waiting = [wid for wid, w in self.run.md.workers.items()
                   if "fill_start" in w.restore_phases and not w.bytes_after_resume and not w.fill]
        if not waiting:
            return
        url, token, fence = self.run.url(dest), self.run.settings.cluster_token, self.run.fence

        def body() -> None:
            deadline = time.monotonic() + self.run.settings.fill_deadline_s
            with AgentClient(url, token, timeout=AGENT_QUESTION_TIMEOUT_S, fence=fence) as a:
                while waiting and time.monotonic() < deadline:
                    for wid in list(waiting):
                        try:
                            fill = a.worker(wid).fill
                        except PitstopError:
                            continue  # asked again next round, until the deadline
                        if fill is None or fill.state != "filling":
                            waiting.remove(wid)
                            if fill:
                                with self.run.lock:
                                    self.run.md.workers[wid].fill = fill.model_dump(mode="json")
                                    self.run.best_effort = True  # the operation is done: a refused write waits
                                    self.run.save()
                    if waiting:
                        time.sleep(self.run.settings.fill_poll_s)
            self.run.settle_job_pause()

        threading.Thread(target=body, daemon=True, name=f"local-fills-{self.run.id}").start()

    def measure(self, resumed_at: float) -> None:
        """The job's time to useful progress after the move (coordinator/progress.py), watched on a
        thread of its own after the operation is done, and added to its record when known: nobody
        waits for it."""
        if self.run.settings.progress_window_s <= 0:
            return
        if self.run.progress_cut is None:
            why = ("the job's ranks use no NCCL communicator the shim counts (gloo, or none): nothing shows "
                   "its progress without a change to it" if self.run.md.plan and self.run.md.plan.pause == "sigstop"
                   else "the move was finished by a coordinator that did not see its cut")
            pauses = progress.pauses_between(self.run.rank_stopped, self.run.rank_running)
            self.run.record_after(progress.not_measured(why).model_copy(update={"rank_pause_s": pauses or None}))
            return
        cut, before, window = self.run.progress_cut, self.run.progress_before, self.run.settings.progress_window_s
        hosts = dict(self.run.md.peers) | {wid: self.run.md.destination for wid in self.run.md.workers}
        groups = by_agent(list(hosts.items()))
        urls = {h: self.run.url(h) for h, _ in groups}
        token, fence = self.run.settings.cluster_token, self.run.fence

        def body() -> None:
            # clients of its own: the operation's close when its thread ends
            clients = {h: AgentClient(u, token, timeout=PROGRESS_READ_TIMEOUT_S, fence=fence) for h, u in urls.items()}

            last: dict[str, list[dict[str, Any]]] = {}
            per_step = before.per_step if before else None
            times: dict[str, tuple] = {}

            def read() -> dict[str, int]:
                got: dict[str, list[dict[str, Any]]] = {}
                trail = len(times) < len(cut.issued)  # until every rank's operations are timed
                for part in in_parallel(lambda g: clients[g[0]].shim_blocks_many(g[1], trail=trail), groups):
                    got.update(part)
                last.clear()
                last.update(got)
                if trail:
                    times.update(progress.op_times(got, cut, per_step))
                return issued_by_worker([(w, b) for w, bs in got.items() for b in bs])

            try:
                after = progress.watch(read, cut, resumed_at, before, window_s=window)
                # the pause times are written by the shims at the resume, and read since
                after = progress.with_op_times(after, times, progress.last_resume(last))
                pauses = progress.rank_pauses(last)
                self.run.record_after(after.model_copy(update={"rank_pause_s": pauses or None}))
            except Exception as e:  # noqa: BLE001 - a measurement: it must never take the coordinator down
                log.warning("could not measure the job's progress after the move", op=self.run.id, error=repr(e))
            finally:
                for c in clients.values():
                    c.close()

        threading.Thread(target=body, daemon=True, name=f"progress-{self.run.id}").start()
