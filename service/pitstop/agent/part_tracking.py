"""What each worker wrote since its last snapshot part: the kernel's write tracking
(memory/writetrack.py) of every process of the worker, and the part it was last reset at.

Why a collaborator of its own: it outlives every snapshot (it is reset at each part, not made
anew), it holds open file descriptors of the worker's processes that must close when the worker
leaves, and whether the next part may be a delta depends on it alone."""

from __future__ import annotations

import structlog

from pitstop import nsinit
from pitstop.agent.state import Worker
from pitstop.memory import writetrack
from pitstop.proc import proctree

log = structlog.get_logger("pitstop.agent.part_tracking")


class PartTracking:
    def __init__(self) -> None:
        self._trackers: dict[str, dict[int, writetrack.Tracked]] = {}  # worker -> its processes' write tracking
        self._reset_at: dict[str, tuple[str, int]] = {}  # worker -> (job, the part its tracking was last reset at)

    def track(self, w: Worker) -> None:
        """Track the writes of every process of the worker not tracked yet; asked while it runs
        (the handoff needs its processes to answer a signal), before the snapshot's pause."""
        pids = proctree.tree(w.root_pid)
        have = self._trackers.setdefault(w.id, {})
        for pid in [p for p in have if p not in pids]:  # ended: their tracking ends with them
            have.pop(pid).close()
        new = [p for p in pids if p not in have and not nsinit.is_init(p)]  # the init holds nothing of the job's
        if new:
            tracked, why = writetrack.start(new)
            have.update(tracked)
            if why:
                log.info("processes of a snapshot's worker not tracked: each is dumped whole", worker=w.id,
                         processes=len(why), why=sorted(set(why.values()))[:3])

    def tracked(self, w: Worker) -> bool:
        return bool(self._trackers.get(w.id))

    def last_part(self, w: Worker, job: str) -> int | None:
        """The part of `job` the worker's tracking was last reset at: what a delta would be against."""
        at = self._reset_at.get(w.id)
        return at[1] if self.tracked(w) and at is not None and at[0] == job else None

    def reset(self, w: Worker, number: int, pids: list[int]) -> None:
        """Part `number` is dumped (the job still paused): from now on only new writes count."""
        have = self._trackers.get(w.id, {})
        if not have:
            return
        for pid in pids:
            if pid in have:
                have[pid].refresh()  # its new mappings too: else they read as written at every snapshot
        self._reset_at[w.id] = (w.job, number)

    def end(self, wid: str) -> None:
        for t in self._trackers.pop(wid, {}).values():
            t.close()
        self._reset_at.pop(wid, None)
