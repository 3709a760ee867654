"""What an agent finds after its own restart: images of moves that died with its previous run,
and lazy fills that previous run started and nobody watches now.

Why apart from the restore (agent/receiving.py): none of it concerns a restore under way; it runs
once at start, and then only for what the previous run left."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import structlog

from pitstop.agent.settings import AgentSettings
from pitstop.agent.state import AgentState
from pitstop.memory import lazy_pages
from pitstop.proc import proctree

log = structlog.get_logger("pitstop.agent.restore")

UNFILLED = "its memory could not be filled after a lazy restore: "  # a lost worker's reason


class Leftovers:
    def __init__(self, settings: AgentSettings, state: AgentState) -> None:
        self.s, self.state = settings, state

    def remove_stale_slots(self) -> list[str]:
        """At start: images an earlier run of this agent was receiving or restoring from.

        Slots live in memory, so every `in-*` directory found now belongs to a move that died
        with that process; its operation has failed and rolled back on the source.  One still
        in use (a lazy-pages daemon filling a worker it restored works in it) is kept."""
        busy = _dirs_in_use(self.s.images)
        gone = []
        for d in self.s.images.glob("in-*"):
            if not d.is_dir():
                continue
            if d in busy:  # a fill that outlived the previous agent: its images go when it ends
                threading.Thread(target=self._remove_when_unused, args=(d,), daemon=True,
                                 name=f"fill-images-{d.name}").start()
                continue
            self._settle_fills(d)
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d.name)
        for w in list(self.state.workers.values()):  # a fill whose images are gone ended too
            if w.fill and w.fill.state == "filling" and not Path(w.fill.images).exists():
                self._settle_fills(Path(w.fill.images))
        if gone:
            log.info("removed images of moves that died with the previous agent", slots=gone)
        return gone

    def _settle_fills(self, d: Path) -> None:
        """Record how the fills that worked in `d` ended, which nobody watched: the previous
        agent started them and the restart lost their daemons' exit status (lazy_pages.ended_unwatched)."""
        for w in list(self.state.workers.values()):
            if not (w.fill and w.fill.state == "filling" and d in (Path(w.fill.images), Path(w.fill.images).parent)):
                continue  # a delta's fill works in its slot's lazy view (restore_views.lazy_delta_view)
            alive = proctree.is_running(w.root_pid, w.start_time)
            ok, why = lazy_pages.ended_unwatched(Path(w.fill.images), alive)
            if ok is False and w.state in ("running", "exited"):  # the relay stopped it, or it read zeros
                if alive:
                    proctree.kill_tree(w.root_pid)
                self.state.update_worker(w, state="lost", reason=UNFILLED + why)
            self.state.end_fill(w, {True: "filled", False: "failed", None: "unknown"}[ok],
                             reason=why or "it ended while the agent was restarting")
            log.info("a fill that outlived the previous agent has ended", worker=w.id, state=w.fill.state,
                     reason=w.fill.reason)

    def _remove_when_unused(self, d: Path, every_s: float = 2.0) -> None:
        """Nobody watches a fill the previous agent started: its daemon (and page relay) end on
        their own, the relay stopping the worker if the source fails; then the images go."""
        log.info("a lazy fill outlived the previous agent; its images go when it ends", slot=d.name)
        while d.exists() and d in _dirs_in_use(self.s.images):
            time.sleep(every_s)
        self._settle_fills(d)
        shutil.rmtree(d, ignore_errors=True)
        log.info("removed the images of a fill that outlived the previous agent", slot=d.name)


def _dirs_in_use(root: Path) -> set[Path]:
    """Directories directly under `root` that some process works in or holds a file of."""
    out: set[Path] = set()
    top = str(root.resolve()) + "/"
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        # One link at a time: a busy process (a lazy-pages daemon filling, the very one looked
        # for) closes fds between the listing and the readlink, and one fd gone must not hide
        # its other files and its working directory.
        links = []
        for link in ["cwd", *(f"fd/{fd}" for fd in _listdir(f"/proc/{pid}/fd"))]:
            try:
                links.append(os.readlink(f"/proc/{pid}/{link}"))
            except OSError:
                continue
        for ln in links:
            if ln.startswith(top):
                out.add(root / ln[len(top):].split("/", 1)[0])
    return out


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:  # the process has gone, or its fd table is not ours to read
        return []
