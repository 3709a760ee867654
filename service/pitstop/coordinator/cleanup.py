"""The source's cleanup after a move: its agent frees each moved worker's images and CRIU's
network lock, after the job runs again (the node may be the failing one, and nothing the job
needs may wait on it).  What is left is recorded in the operation and tried again whenever the
node's agent reports."""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from pitstop.coordinator.evacuation_ops import Evacuation
from pitstop.coordinator.fanout import in_parallel
from pitstop.errors import NotFound, PitstopError

log = structlog.get_logger("pitstop.coordinator.cleanup")


class SourceCleanup:
    """One done move's cleanup on its source."""

    def __init__(self, run: Evacuation, on_pending: Callable[[str, str, bool], None]) -> None:
        self.run = run
        self.on_pending = on_pending  # (node, operation, whether anything is left): the driver's retry list

    def free(self, later: bool = False) -> bool:
        """Past the resume: the node's agent frees each moved worker's images and CRIU's network lock.

        After the job runs again, on purpose: the node being evacuated may be the failing one,
        and nothing the job needs waits on it (when this came before the resume, a node that
        stopped answering after the commit point held every peer paused, and past the retries
        left them so).  Bounded by source_cleanup_deadline_s; what is left is recorded in
        `source_cleanup_pending` and tried again whenever the node's agent reports
        (Driver.node_seen, with `later`: the operation is done and keeps its phase).  Whether
        nothing is left."""
        node, dest = self.run.md.node, self.run.md.destination
        moved_to = {"agent": dest, "url": getattr(self.run.store.host(dest), "url", "")}
        deadline = time.monotonic() + self.run.settings.source_cleanup_deadline_s
        if not later:
            self.run.enter("cleanup")
        problems: list[str] = []
        while True:
            pending = self.run.md.pending_cleanup()
            if not pending or time.monotonic() >= deadline:
                break

            def commit(wid: str) -> str | None:
                w = self.run.md.workers[wid]
                try:
                    if w.capture_id is None:  # no capture of it on the node: nothing to free
                        raise NotFound(f"{wid} has no capture on record")
                    self.run.agent(node).commit(w.capture_id, moved_to,
                                            timeout=max(1.0, min(10.0, deadline - time.monotonic())))
                except PitstopError as e:
                    if e.http_status != 404:  # 404: the node has no such capture, so nothing to free
                        return f"{wid}: {e.message}"
                with self.run.lock:
                    w.state = "committed"
                return None

            problems = [p for p in in_parallel(commit, pending) if p]
            if problems and time.monotonic() < deadline:
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        pending = self.run.md.pending_cleanup()
        with self.run.lock:
            self.run.md.source_cleanup_pending = pending
            resp = self.run.op.response if later else None
            if resp and not pending and "source_cleanup_pending" in resp:
                resp = {k: v for k, v in resp.items() if k != "source_cleanup_pending"}
                self.run.save(response=resp)
            else:
                self.run.save()
        self.on_pending(node, self.run.id, bool(pending))
        if not later:
            self.run.leave("cleanup")
        if pending:
            self.run.condition("SourceCleaned", False, "NodeUnreachable",
                           f"the job runs on {dest}; {node}'s agent did not free the images of "
                           f"{', '.join(pending)} ({'; '.join(problems) or 'no answer'}): tried again whenever "
                           f"{node}'s agent reports; nothing to do unless {node} is to be reused without its agent")
            log.warning("source not cleaned up; tried again when it reports", op=self.run.id, node=node, workers=pending)
        else:
            self.run.condition("SourceCleaned", True, "ImagesFreed", f"{node} freed the moved workers' images and locks")
        return not pending
