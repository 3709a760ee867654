"""The way back of a move before its commit point (evacuation_run.OpRun.rollback calls these in order):
a copy the spare restored is discarded with its images, the source's capture is undone (its
worker resumed, or restored from its own images once released), and the job's communicators
are made again where its workers run.  What could not be undone is said in two lists:
`problems`, where the job may not be whole where it was (the operator must act), and
`leftovers`, where it is whole but the destination may hold a copy to clean up."""

from __future__ import annotations

import structlog

from pitstop.coordinator.evacuation_ops import Evacuation
from pitstop.errors import PitstopError
from pitstop.wire.agent_client import AgentClient
from pitstop.wire.evacuation import WorkerProgress

log = structlog.get_logger("pitstop.coordinator.rollback")


class Undo:
    """The undo steps of one move."""

    def __init__(self, run: Evacuation) -> None:
        self.run = run

    def discard_copy(self, dst: AgentClient, wid: str) -> list[str]:
        """A copy the spare already restored is discarded, and the images it holds: what could not be."""
        left = []
        try:
            got = dst.worker(wid)
            if got.restored and got.state in ("running", "paused", "capturing", "stopped"):
                dst.discard_worker(wid)
        except PitstopError as e:
            if e.http_status != 404:
                left.append(f"{wid} on {self.run.md.destination}: {e.message}")
        try:  # also stops a copy a restore registered after the look above
            dst.discard(self.run.image_id(wid))
        except PitstopError as e:
            left.append(f"{wid}'s images on {self.run.md.destination}: {e.message}")
        return left

    def undo_capture(self, src: AgentClient, dst: AgentClient | None, wid: str, w: WorkerProgress,
                      problems: list[str], leftovers: list[str]) -> None:
        """The source's capture of `wid` rolled back (its worker resumed or restored from its own
        images); one still dumping is waited for first, and what its stream brought to the
        destination after the discard is discarded again."""
        if not (w.capture_id or self.run.md.capture_begun):
            w.state = "rolled_back"  # never asked to capture: nothing to undo on the node
            return
        in_flight = False
        try:
            cid = w.capture_id or next((c.id for c in src.captures() if c.image_id == self.run.image_id(wid)), None)
            if cid:
                c = src.get_capture(cid)
                if c.state == "dumping":
                    in_flight = True
                    c = src.wait_capture(cid, self.run.settings.capture_deadline_s)
                if c.state not in ("failed", "rolled_back", "committed"):
                    src.rollback(cid)
            w.state = "rolled_back"
        except PitstopError as e:
            problems.append(f"{wid} on {self.run.md.node}: {e.message}")
        if in_flight and dst is not None:
            try:
                dst.discard(self.run.image_id(wid))
            except PitstopError as e:
                leftovers.append(f"{wid}'s images on {self.run.md.destination}: {e.message}")

    def rewire_in_place(self) -> list[str]:
        """The job's communicators again where its workers run (they were cut for the move): the
        sources join the ranks that stay where those are rebuilding already (the early rewire)."""
        cutmd = self.run.md.cut
        if cutmd is None or not cutmd.used:
            return []
        self.run.prewire.end()
        try:
            if cutmd.destroyed and cutmd.early_ids:
                self.run.cut().rejoin(cutmd.early_ids, spent=bool(cutmd.early_joined))
                cutmd.destroyed = False
            elif cutmd.destroyed:
                self.run.cut().rewire()
                cutmd.destroyed = False
            else:
                self.run.cut().release()
        except PitstopError as e:
            return [f"rewiring in place: {e.message}"]
        return []

    def error(self, err: PitstopError, problems: list[str], leftovers: list[str]) -> PitstopError:
        """The operation's error: the cause, then what the rollback could not undo and what to do."""
        node, dest = self.run.md.node, self.run.md.destination
        msg = err.message
        if problems:
            msg += "; ROLLBACK INCOMPLETE: " + "; ".join(problems)
        elif leftovers:
            msg += f"; rolled back, but {dest} could not be cleaned up: " + "; ".join(leftovers)
        return PitstopError(msg, code=err.code, http_status=err.http_status,
                            action=(err.action + "; " if err.action else "") +
                            (f"the job keeps running on {node}" if not problems else
                             "some workers may still be stopped: see the problems listed and the agents' logs")
                            + (f"; on {dest}, check that no copy of {', '.join(sorted(self.run.md.workers))} "
                               f"runs there; {dest}'s agent removes the images of this move when it starts again"
                               if leftovers and not problems else ""),
                            details={**err.details, "rollback_problems": problems,
                                     "destination_leftovers": leftovers,
                                     **({"database_error": self.run.store_error} if self.run.store_error else {})})
