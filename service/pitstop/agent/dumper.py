"""The agent's one way to dump a worker's tree: a capture's dump (agent/capturing.py) and a
snapshot's part (agent/snapshots.py) take the same typed options (criu_ops.DumpOptions), the
same start window, the same rule for an incremental dump, and the same manifest.

Why one: the two were written apart and drifted.  The snapshot's dumps ran without the window
that keeps two dumps in one working directory from colliding on CRIU's /proc mount point; its
fallback from an incremental dump kept CRIU's log where the capture's did not; the manifest's
worker entry was spelled twice.  Each rule is now written here once:

- options: the worker's own network namespace is external, the dump's time bound is the
  agent's, an incremental dump logs at the level that tells what its parent held;
- the window: one dump at a time *starts* per working directory (proc/procwindow.py); one that
  met another's mount point anyway is dumped again, a few times at most;
- incremental, else whole: a dump against a parent that CRIU refuses leaves the tree running
  as it was, its writes still tracked, so it is dumped whole then and there; its log is kept
  (agent/diagnostics.py).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from pitstop.agent import diagnostics
from pitstop.agent.settings import AgentSettings
from pitstop.agent.state import Worker
from pitstop.criu import criu_ops, criutrack, runtime
from pitstop.criu.criu_ops import DumpOptions, DumpResult
from pitstop.errors import CaptureFailed
from pitstop.network import workerns
from pitstop.proc import procwindow
from pitstop.transfer.manifest import Manifest, StdioPipe

log = structlog.get_logger("pitstop.agent.dumper")


class Dumper:
    def __init__(self, settings: AgentSettings) -> None:
        self.s = settings
        self._cwd_locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def options(self, w: Worker, *, parent: str | None = None, command: runtime.CriuCommand | None = None,
                leave_running: bool = False, track_mem: bool = False) -> DumpOptions:
        """The options of a dump of `w` (criu_ops.DumpOptions says what each means)."""
        return DumpOptions(timeout_s=self.s.dump_timeout_s,
                           own_netns=workerns.netns_inode(w.root_pid) if w.net else None,
                           parent=parent, command=command, leave_running=leave_running, track_mem=track_mem,
                           log_level=criutrack.LOG_LEVEL if parent else 4)

    def dump(self, w: Worker, images: Path, opts: DumpOptions, *, overlap: bool = True) -> DumpResult:
        """Dump `w` into `images`.  `overlap`: other dumps in the same working directory may run
        beside this one once it has started; one that collided anyway is dumped again from
        scratch.  Without it (something streams the directory while CRIU writes it) the
        directory's lock is held for the whole dump.  An incremental dump is not retried: its
        caller dumps whole instead (incremental_else_whole)."""
        attempt = 0
        while True:
            attempt += 1
            lock, cwd = self._cwd_lock(w.root_pid)
            try:
                with procwindow.DumpStartWindow(lock, cwd if overlap else ""):
                    res = criu_ops.dump(w.root_pid, images, opts)
                return dataclasses.replace(res, attempts=attempt)
            except CaptureFailed as e:
                if opts.parent or not (overlap and attempt < procwindow.ATTEMPTS and procwindow.collided(e.details)):
                    raise
                log.info("the dump met another dump's /proc mount point; dumping again", worker=w.id,
                         images=str(images), attempt=attempt)
                procwindow.clear_for_retry(images, attempt)

    def incremental_else_whole(self, w: Worker, images: Path, incremental: DumpOptions, whole: DumpOptions, *,
                               overlap: bool, log_name: str,
                               fell_back: Callable[[CaptureFailed], None] = lambda e: None) -> tuple[DumpResult, bool]:
        """Dump `w` against `incremental.parent`; where CRIU cannot, dump it whole with `whole`.
        Returns the dump and whether it is incremental.  CRIU's log of the failed attempt is kept
        as `log_name` (agent/diagnostics.py); `fell_back` is told why."""
        try:
            return self.dump(w, images, incremental, overlap=overlap), True
        except CaptureFailed as e:  # CRIU let the tree be as it was; its writes are still tracked
            kept = diagnostics.keep(self.s.state_dir, images / criu_ops.DUMP_LOG, log_name)
            log.warning("CRIU's incremental dump failed; dumping whole", worker=w.id, reason=e.message,
                        log=str(kept) if kept else None)
            procwindow.clear_for_retry(images, 0, keep_log=False)  # the parent too: a whole dump has none
            fell_back(e)
        return self.dump(w, images, whole, overlap=overlap), False

    def _cwd_lock(self, pid: int) -> tuple[threading.Lock, str]:
        """One dump at a time per working directory *starts* (proc/procwindow.py).

        A worker is not in the host's PID namespace, so CRIU's parasite mounts a private
        /proc at a fixed name ("proc.crtools") in the task's working directory; two
        concurrent dumps of ranks sharing a directory race on that mkdir (EEXIST).
        """
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            cwd = ""
        with self._guard:
            return self._cwd_locks.setdefault(cwd, threading.Lock()), cwd


def worker_entry(w: Worker, *, snapshot: bool = False) -> dict[str, Any]:
    """The worker as a manifest carries it: what its restore registers it as.  A snapshot's part
    also carries the job's snapshot period, which its recovery keeps."""
    return {"id": w.id, "job": w.job, "rank": w.rank, **({"init_dir": w.init_dir} if w.init_dir else {}),
            **({"slurm_job": w.slurm_job} if w.slurm_job else {}),
            **({"snapshot_every_s": w.snapshot_every_s} if snapshot and w.snapshot_every_s else {})}


def manifest(w: Worker, capture_id: str, *, host: str, stdio: list[dict[str, Any]], output_base: dict[str, int],
             gpu: dict[str, Any], file_ids: dict[str, list[int]], snapshot: bool = False, **more: Any) -> Manifest:
    """A dump's manifest: the one builder of a capture's and a snapshot part's (`more`: the
    fields only a capture has, e.g. where its lazy pages are served)."""
    return Manifest(capture_id=capture_id, stdio=[StdioPipe(**s) for s in stdio],
                    criu_version=runtime.locate().version_str, output_base=output_base,
                    worker=worker_entry(w, snapshot=snapshot), gpu=gpu, net=w.net, host=host, file_ids=file_ids,
                    **more)
