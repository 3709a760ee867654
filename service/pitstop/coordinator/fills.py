"""After the commit of a move with network post-copy: the moved workers' memory still comes from
the node.  The operation stays open, and the node `draining`, until every fill has ended; and
whether every moved worker survived its first moments at the destination is said plainly (past
the commit point nothing rolls back, but the operation must not hide it)."""

from __future__ import annotations

import time
from typing import Any

import structlog

from pitstop.coordinator.evacuation_ops import Evacuation
from pitstop.coordinator.timeouts import AGENT_QUESTION_TIMEOUT_S
from pitstop.errors import PitstopError
from pitstop.wire.agent_client import AgentClient

log = structlog.get_logger("pitstop.coordinator.fills")


class AfterCommit:
    """The checks of one committed move that the operation waits for."""

    def __init__(self, run: Evacuation) -> None:
        self.run = run

    def await_network(self, node: str, dest: str) -> PitstopError | None:
        """Network post-copy: after the resume the moved workers' memory still comes from `node`.

        The operation stays open, and the node `draining`, until every fill has ended: an
        operator who powers the node off once the operation is done must not take a rank with
        it.  Asks the destination's agent, which watches each fill (agent/receiving.py), with a
        short timeout per call; never raises (the commit is behind us); says what went wrong."""
        self.run.enter("fill")
        url = self.run.url(dest)
        waiting = [wid for wid, w in self.run.md.workers.items() if w.bytes_after_resume]
        ended: dict[str, dict[str, Any]] = {}
        last_error = ""
        deadline = time.monotonic() + self.run.settings.fill_deadline_s
        with AgentClient(url, self.run.settings.cluster_token, timeout=AGENT_QUESTION_TIMEOUT_S, fence=self.run.fence) as a:
            while waiting and time.monotonic() < deadline:
                for wid in list(waiting):
                    try:
                        fill = a.worker(wid).fill
                    except PitstopError as e:
                        last_error = e.message
                        continue  # asked again next round, until the deadline
                    if fill is None or fill.state != "filling":
                        ended[wid] = (fill.model_dump(mode="json") if fill else
                                      {"state": "unknown", "reason": f"{dest} has no fill on record for it"})
                        waiting.remove(wid)
                        with self.run.lock:
                            self.run.md.workers[wid].fill = ended[wid]
                            self.run.save()
                if waiting:
                    time.sleep(self.run.settings.fill_poll_s)
        self.run.leave("fill")
        with self.run.lock:
            self.run.md.fill_s = round(time.time() - (self.run.md.last_resume or time.time()), 4)
            self.run.save()
        if waiting:
            why = (f"{', '.join(waiting)} still filling after {self.run.settings.fill_deadline_s:.0f} s"
                   + (f" (last error asking {dest}: {last_error})" if last_error else ""))
            self.run.condition("MemoryFilled", False, "FillUnconfirmed", why)
            return PitstopError(f"the workers run on {dest}, but their memory may still come from {node}: {why}",
                                code="fill_unconfirmed",
                                action=f"keep {node} up until `GET /v1/workers` on {dest} shows no fill "
                                       f"'filling'; then it may leave (it stays 'draining' until then)")
        self.run.record(lambda: self.run.store.set_role(node, "drained"))
        bad = {wid: f for wid, f in ended.items() if f.get("state") != "filled"}
        if bad:
            why = "; ".join(f"{wid}: {f.get('state')} ({f.get('reason') or 'no reason given'})" for wid, f in bad.items())
            self.run.condition("MemoryFilled", False, "FillFailed", why)
            return PitstopError(f"after the commit point the memory of some moved workers could not be filled "
                                f"from {node}: {why}", code="fill_failed",
                                action="the job's state was moved, but those workers were stopped rather than run "
                                       f"on missing memory: restart the job from its last checkpoint; {node} may leave")
        self.run.condition("MemoryFilled", True, "Filled", f"every moved worker's memory is on {dest} "
                       f"{self.run.md.fill_s} s after the resume; {node} may leave")
        return None

    def check_replacements(self, dest: str) -> None:
        """Say plainly if a moved worker did not survive its first moments at the destination.

        Past the commit point there is nothing to roll back to; the job's own recovery (its
        checkpoint-restart) is out of pitstop's scope, but the operation must not hide it."""
        gone = []
        for wid in self.run.md.workers:
            try:
                w = self.run.agent(dest).worker(wid)
            except PitstopError as e:
                gone.append(f"{wid}: destination agent unreachable ({e.message})")
                continue
            if w.state not in ("running", "paused"):
                gone.append(f"{wid}: {w.state}" + (f" (exit code {w.exit_code})" if w.exit_code is not None else ""))
        if gone:
            self.run.condition("ReplacementsRunning", False, "ReplacementEnded",
                           "after the commit point: " + "; ".join(gone) + ". The job's state was moved intact; "
                           "restart the job from its last checkpoint")
            log.error("moved worker ended right after the move", op=self.run.id, workers=gone)
        else:
            self.run.condition("ReplacementsRunning", True, "Running", f"every moved worker runs on {dest}")
