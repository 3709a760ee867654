"""The early rewire's first half (coordinator/cut.py): as the capture begins, the ranks that stay
make fresh communicator ids and begin re-creating their communicators, so that after the restore
only the restored ranks' joining is left in the pause.

Its own state is its thread and the event that tells it to post nothing more once the rewire
after the restore, or a rollback, takes over.  The ids are recorded in the operation before any
rank is told: a rollback, or a restarted coordinator's, joins them."""

from __future__ import annotations

import contextlib
import threading
import time

import structlog

from pitstop.coordinator.evacuation_ops import Evacuation
from pitstop.coordinator.store import StoreUnavailable
from pitstop.coordinator.timeouts import PREWIRE_JOIN_EXTRA_S

log = structlog.get_logger("pitstop.coordinator.prewire")


class EarlyRewire:
    """One move's early rewire."""

    def __init__(self, run: Evacuation) -> None:
        self.run = run
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def begin(self) -> None:
        """The early rewire's first half, on a thread of its own as the capture begins: the ranks that
        stay make fresh ids and begin re-creating their communicators (coordinator/cut.py), so that
        after the restore only the restored ranks' joining is left in the pause.  The ids are
        recorded before any rank is told: a rollback, or a restarted coordinator's, joins them."""
        cutmd = self.run.md.cut
        if cutmd is None or not cutmd.destroyed:
            return
        if not self.run.settings.early_rewire:
            with self.run.lock:
                cutmd.early_why_not = "PITSTOP_COORDINATOR_EARLY_REWIRE=false"
                self.run.save()
            return
        t0 = time.monotonic()

        def body() -> None:
            try:
                cut = self.run.cut()
                leaving = set(self.run.md.workers)
                ids = cut.early_ids(leaving)
                if ids is None or self._stop.is_set():
                    with self.run.lock:
                        cutmd.early_why_not = cut.why_not or "the rewire began first"
                        self.run.save()
                    return
                with self.run.lock:
                    cutmd.early_ids = ids
                    try:
                        self.run.save()
                    except StoreUnavailable:
                        cutmd.unset("early_ids")  # unrecorded: nobody may rebuild with them
                        raise
                if self._stop.is_set():
                    return  # the ranks not told yet are told by the rewire, or the rollback, with these ids
                cut.prebuild(ids, leaving)
                with self.run.lock:
                    cutmd.prewire_s = round(time.monotonic() - t0, 4)
                    self.run.save()
                log.info("the ranks that stay are re-creating their communicators", op=self.run.id,
                         communicators=len(ids), seconds=cutmd.prewire_s)
            except Exception as e:  # noqa: BLE001 - the rewire after the restore does what is left
                why = getattr(e, "message", repr(e))
                log.warning("the early rewire did not begin; the rewire after the restore does it", op=self.run.id,
                            error=why)
                with self.run.lock:
                    cutmd.early_why_not = f"it failed to begin: {why}"[:500]
                    with contextlib.suppress(StoreUnavailable):
                        self.run.save()

        self._thread = threading.Thread(target=body, daemon=True, name=f"prewire-{self.run.id}")
        self._thread.start()

    def end(self) -> None:
        """Let the early rewire's thread post nothing more, and wait for it (its calls have deadlines)."""
        self._stop.set()
        t = self._thread
        if t is not None:
            t.join(3 * self.run.settings.cut_deadline_s + PREWIRE_JOIN_EXTRA_S)
