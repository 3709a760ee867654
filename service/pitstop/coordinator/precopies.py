"""The pre-copy phase of a move: the leaving workers' memory sent while the job still runs
(memory/precopy.py), followed into the operation's record, waited for under two deadlines (a
whole one, and one for a pre-copy that stopped moving), and stopped.

Its own state is the pre-copies' threads and when their bytes last moved; the operation
(evacuation_run.OpRun) is what it reports into: its record, its conditions and its cancel.  Best effort
by design: a pre-copy only shortens the pause that follows, so one that fails, passes its
deadline or stalls is stopped, reported, and the move sends everything instead."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from pitstop.coordinator.evacuation_ops import Evacuation
from pitstop.coordinator.store import StoreUnavailable
from pitstop.coordinator.timeouts import AGENT_QUESTION_TIMEOUT_S, PRECOPY_PROGRESS_EVERY_S, PRECOPY_STOP_WAIT_S
from pitstop.errors import PitstopError, Unavailable
from pitstop.wire.agent_client import AgentClient
from pitstop.wire.evacuation import MovePlan

log = structlog.get_logger("pitstop.coordinator.precopies")


class PreCopies:
    """This move's pre-copies from one source."""

    def __init__(self, run: Evacuation, src: AgentClient) -> None:
        self.run = run
        self.src = src
        self.ours = {run.image_id(w) for w in run.md.workers}  # the pre-copies' ids on the source

    def send(self, dst: AgentClient, plan: MovePlan) -> None:
        """Send the leaving workers' memory while the job still runs (memory/precopy.py).

        Best effort by design: a pre-copy only shortens the pause that follows, so one that
        fails, passes its deadline or stalls is stopped, reported, and the move sends everything
        instead."""
        if not plan.pre_copy:
            return
        self.run.enter("precopy")
        results: dict[str, Any] = {}

        def one(wid: str) -> None:
            try:
                results[wid] = self.src.precopy(wid, dst.url, self.run.image_id(wid), post_copy=plan.post_copy,
                                                timeout=self.run.settings.precopy_deadline_s + 30)
            except PitstopError as e:
                results[wid] = {"error": e.message}
                log.warning("pre-copy failed; the move sends everything", op=self.run.id, worker=wid, error=e.message)

        ids = list(self.run.md.workers)
        running = {wid: threading.Thread(target=one, args=(wid,), name=f"precopy-{wid}", daemon=True) for wid in ids}
        for t in running.values():
            t.start()
        gave_up = ""
        try:
            with self._progress() as last_moved:
                gave_up = self._wait(running, last_moved)
        finally:  # given up on, or the evacuation cancelled: what still runs is stopped, not left to compete
            stopped = self._stop(running)
        final: dict[str, Any] = {}  # not `results`: a stopped pre-copy's thread may still write there
        for wid in ids:
            r = results.get(wid)
            if wid in stopped and (r is None or "error" in r):  # one that ended well as it was stopped counts
                r = {"error": gave_up}
                log.warning("pre-copy given up on; the move sends everything", op=self.run.id, worker=wid, why=gave_up)
            final[wid] = r or {"error": "no answer"}
        sent = sum(r.get("bytes", 0) for r in final.values())
        failed = {w: r["error"] for w, r in final.items() if "error" in r}
        if failed:  # a source that stopped answering would fail the move after the pause: stop before it
            try:
                self.src.info(timeout=AGENT_QUESTION_TIMEOUT_S)
            except PitstopError as e:
                raise Unavailable(f"the agent on {self.run.md.node} stopped answering during the pre-copy "
                                  f"({e.message}); nothing was paused", code="source_unavailable",
                                  action=f"check the agent on {self.run.md.node}, then evacuate again") from None
        skipped = {r["skipped"] for r in final.values() if "skipped" in r}
        with self.run.lock:
            self.run.md.pre_copy_bytes = sent
            for wid, r in final.items():
                if r.get("compression"):
                    self.run.md.workers[wid].pre_copy_compression = r["compression"]
            self.run.md.unset("pre_copy_bytes_total")  # an estimate, for the progress while it ran
            self.run.save()
        self.run.leave("precopy")
        if failed:
            self.run.condition("PreCopied", False, "PreCopyFailed", "; ".join(f"{w}: {m}" for w, m in failed.items())
                           + " (those workers' memory travels whole during the pause)")
        elif skipped:
            self.run.condition("PreCopied", False, "PreCopySkipped", "; ".join(sorted(skipped)))
        else:
            self.run.condition("PreCopied", True, "MemorySentAhead", f"{sent} bytes sent while the job ran")
        self.run.check()

    @contextlib.contextmanager
    def _progress(self) -> Iterator[Callable[[], float]]:
        """Follow the source's pre-copies into the operation (`pre_copy_bytes` of about
        `pre_copy_bytes_total`) while they run: a host's memory can take minutes to send, and
        `pitstop evacuate --wait` should show it moving.  Yields when they last moved
        (time.monotonic()): how the wait tells a slow pre-copy from a stalled one.  Best
        effort: a missed reading only leaves the figures where they were."""
        stop = threading.Event()
        ours = self.ours
        moved = [time.monotonic(), -1]  # when, and the bytes then

        def follow() -> None:
            while not stop.wait(PRECOPY_PROGRESS_EVERY_S):
                try:
                    got = [p for p in self.src.precopies(timeout=PRECOPY_PROGRESS_EVERY_S) if p.get("image_id") in ours]
                except PitstopError:
                    continue
                if got:
                    sent = sum(int(p.get("bytes_sent") or 0) for p in got)
                    if sent > moved[1]:
                        moved[:] = [time.monotonic(), sent]
                    with self.run.lock:
                        self.run.md.pre_copy_bytes = sent
                        self.run.md.pre_copy_bytes_total = sum(int(p.get("bytes_total") or 0) for p in got)
                        try:
                            self.run.save()
                        except StoreUnavailable:
                            pass  # the phase's own write, after the pre-copies, says it and rolls back

        t = threading.Thread(target=follow, name=f"precopy-progress-{self.run.id}", daemon=True)
        t.start()
        try:
            yield lambda: moved[0]
        finally:
            stop.set()
            t.join(PRECOPY_PROGRESS_EVERY_S + 1)

    def _wait(self, running: dict[str, threading.Thread], last_moved: Callable[[], float]) -> str:
        """'' once every pre-copy has ended; otherwise why the coordinator gives up on those
        still running.  Two deadlines: a whole one, and one for a pre-copy that stopped moving
        (a slow one on a big host is worth waiting for; a stalled one is not).  A cancel of the
        evacuation is honoured here too (raised)."""
        t0 = time.monotonic()
        deadline, stall = self.run.settings.precopy_deadline_s, self.run.settings.precopy_stall_s
        while True:
            alive = [t for t in running.values() if t.is_alive()]
            if not alive:
                return ""
            now = time.monotonic()
            if now - t0 > deadline:
                return f"timed out: not done within {deadline:g} s (PITSTOP_COORDINATOR_PRECOPY_DEADLINE_S)"
            if now - last_moved() > stall:
                return f"timed out: no bytes sent for {stall:g} s (PITSTOP_COORDINATOR_PRECOPY_STALL_S)"
            self.run.check()
            alive[0].join(0.2)

    def _stop(self, running: dict[str, threading.Thread]) -> list[str]:
        """Stop the pre-copies still running (DELETE /v1/precopies/{id}) and wait a little for
        them to end; the workers whose pre-copy was stopped."""
        stopped = [wid for wid, t in running.items() if t.is_alive()]
        for wid in stopped:
            try:
                self.src.stop_precopy(self.run.image_id(wid))
            except PitstopError as e:  # ended meanwhile, or the source is gone (checked after)
                log.info("could not stop a pre-copy", op=self.run.id, worker=wid, error=e.message)
        end = time.monotonic() + PRECOPY_STOP_WAIT_S
        for wid in stopped:
            running[wid].join(max(0.0, end - time.monotonic()))
        return stopped

    def end(self) -> None:
        """Stop this operation's pre-copies still running on the source and wait (a little)
        for them to end, so that none lands at the destination after the rollback discarded
        what was there.  Best effort: nothing running is the usual answer."""
        ours = self.ours
        try:
            running = {p["image_id"] for p in self.src.precopies() if p.get("image_id") in ours}
        except PitstopError:
            return  # the source is gone: so are its pre-copies
        for image_id in ours:  # also drops an ended one's copy kept for the incremental dump
            try:
                self.src.stop_precopy(image_id)
            except PitstopError:
                pass  # it ended meanwhile, or its capture took it
        end = time.monotonic() + PRECOPY_STOP_WAIT_S
        while running and time.monotonic() < end:
            time.sleep(0.1)
            try:
                running = {p["image_id"] for p in self.src.precopies() if p.get("image_id") in ours}
            except PitstopError:
                return
