"""Dump and restore process trees through CRIU's RPC (pycriu, `criu swrk`).

Options are fixed by what pitstop guarantees rather than left to callers:
- dump leaves the source *stopped* (leave_stopped): until the move commits,
  the source is the job's copy of record and can be resumed;
- established TCP connections are dumped (tcp_established) and the network is
  locked with nftables (iptables is not assumed to exist);
- stdio pipes to outside the tree are handed back on restore (inherit_fd), as
  runc and podman do, so output keeps flowing to whoever owns the new pipes.
- cgroups are left alone (manage_cgroups ignore): the destination's agent places the tree.
- a worker with its own network namespace (network/workerns.py) has that
  namespace marked external (key "wnet") and is restored into a namespace the
  agent prepared with the same address; the agent locks the whole namespace
  itself, so CRIU's per-connection lock is skipped for it.
Each call writes CRIU's log next to the images; failures quote its Error lines.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pitstop.criu import criulog, runtime, swrk
from pitstop.errors import CaptureFailed, RestoreFailed
from pitstop.proc import proctree

DEVICE_MAPPING = "Can't handle non-regular mapping"  # CRIU's words (criu/proc_parse.c)
DUMP_LOG = "dump.log"
RESTORE_LOG = "restore.log"


@dataclass
class DumpResult:
    seconds: float
    frozen_s: float
    memdump_s: float
    pages_written: int
    run_id: str
    stats: dict[str, Any] = field(default_factory=dict)
    pages_in_parent: int = 0  # an incremental dump's pages left in its parent image
    attempts: int = 1  # dumps it took: agent/dumper.py dumps again one that met another's /proc mount point


def _criu(rt: runtime.CriuRuntime, command: runtime.CriuCommand | None = None,  # noqa: ANN202
          pass_fds: tuple[int, ...] = ()):
    """pycriu's client, with its worker started by subprocess, not os.fork (criu/swrk.py)."""
    pycriu = rt.import_pycriu()
    c = pycriu.criu()
    c._comm = swrk.SpawnedSwrk(command or runtime.CriuCommand(rt.binary), pass_fds)
    return pycriu, c


def _load_image(rt: runtime.CriuRuntime, path: Path) -> dict[str, Any]:
    pycriu = rt.import_pycriu()
    with open(path, "rb") as f:
        return pycriu.images.load(f)["entries"][0]


NET_KEY = "wnet"


@dataclass(frozen=True)
class DumpOptions:
    """How one dump runs: the agent's captures and snapshots alike build one of these
    (agent/dumper.py), as runc drives CRIU with one options object, instead of passing a
    handful of keywords that each caller re-derives.

    leave_running: a snapshot's dump (agent/snapshots.py): CRIU gives the tree back as it found it
    (a tree the coordinator stopped stays stopped) and takes its sockets out of repair mode.
    Else the tree is left stopped: until the move commits, it is the job's copy of record.
    track_mem: a whole dump that a later incremental one can take as its parent (CRIU then records
    the dump's time, its pid-reuse check); only with `command`, as for `parent`.
    parent: an incremental dump (CRIU's --track-mem) against the image directory at this path
    (relative to the images); only with `command`, a CRIU that can tell what changed
    (criu/criutrack.py).
    own_netns: the inode of the worker's own network namespace, dumped as external."""

    timeout_s: int = 60  # bounds CRIU's freeze of the tree
    own_netns: int | None = None
    parent: str | None = None
    command: runtime.CriuCommand | None = None
    log_level: int = 4
    leave_running: bool = False
    track_mem: bool = False


def dump(root_pid: int, images: Path, opts: DumpOptions | None = None, *,
         rt: runtime.CriuRuntime | None = None) -> DumpResult:
    """Dump the tree rooted at root_pid into `images`, as `opts` say (left stopped, by default)."""
    opts = opts or DumpOptions()
    rt = rt or runtime.locate()
    pycriu, c = _criu(rt, opts.command)
    images.mkdir(parents=True, exist_ok=True)
    dfd = os.open(images, os.O_DIRECTORY)
    try:
        c.opts.images_dir_fd = dfd
        c.opts.pid = root_pid
        if opts.leave_running:
            c.opts.leave_running = True
        else:
            c.opts.leave_stopped = True
        c.opts.tcp_established = True
        c.opts.network_lock = pycriu.rpc.NFTABLES
        _no_cgroups(pycriu, c)
        if opts.own_netns is not None:  # the worker's namespace: external, locked whole by the agent
            c.opts.external.append(f"net[{opts.own_netns}]:{NET_KEY}")
            c.opts.network_lock = pycriu.rpc.SKIP
        if opts.parent is not None or opts.track_mem:
            c.opts.track_mem = True
        if opts.parent is not None:
            c.opts.parent_img = opts.parent
        c.opts.log_file = DUMP_LOG
        c.opts.log_level = opts.log_level
        c.opts.timeout = opts.timeout_s  # bounds CRIU's freeze of the tree
        t0 = time.monotonic()
        try:
            c.dump()
        except Exception as e:  # pycriu raises its own exception types
            lines = criulog.error_lines(images / DUMP_LOG)
            raise CaptureFailed(
                f"CRIU could not dump pid {root_pid}: {e}" + (": " + " | ".join(lines) if lines else ""),
                action=_dump_action(lines, images / DUMP_LOG),
                details={"criu_errors": lines, "log": str(images / DUMP_LOG)}) from None
        seconds = time.monotonic() - t0
    finally:
        c._comm.close()
        os.close(dfd)
    stats = _load_image(rt, images / "stats-dump").get("dump", {})
    inv = _load_image(rt, images / "inventory.img")
    return DumpResult(seconds=seconds, frozen_s=stats.get("frozen_time", 0) / 1e6,
                      memdump_s=stats.get("memdump_time", 0) / 1e6,
                      pages_written=stats.get("pages_written", 0),
                      run_id=inv.get("dump_criu_run_id", ""), stats=stats,
                      pages_in_parent=stats.get("pages_skipped_parent", 0))


class _Deadline:
    """Cut a CRIU restore short: when it overruns `timeout_s`, or as soon as `abort` is set.

    Why: a restore can wait forever (a restorer that hits a BUG leaves CRIU on a futex,
    seen under a too-narrow capability set), and while it waits it holds the worker's
    restored sockets on this host, so the rollback on the source could not bind them again.
    Killing CRIU and everything it has forked so far is safe before the commit: that copy is
    not the job's copy of record.  Killing is sticky: a CRIU that starts after the deadline
    passed is killed too."""

    def __init__(self, c: Any, timeout_s: float, abort: threading.Event | None) -> None:
        self.c, self.timeout_s, self.abort = c, timeout_s, abort
        self.done = threading.Event()
        self.why: str | None = None
        self._t = threading.Thread(target=self._watch, name="criu-deadline", daemon=True)

    def __enter__(self) -> "_Deadline":
        self._t.start()
        return self

    def __exit__(self, *a: object) -> None:
        self.done.set()
        self._t.join(5)

    def _watch(self) -> None:
        end = time.monotonic() + self.timeout_s
        while not self.done.wait(0.05):
            if self.why is None:
                if self.abort is not None and self.abort.is_set():
                    self.why = "the restore was abandoned (the move is being rolled back)"
                elif time.monotonic() > end:
                    self.why = f"CRIU did not finish restoring within {self.timeout_s:g} s"
            if self.why is not None:
                worker = getattr(getattr(self.c, "_comm", None), "swrk", None)
                if worker:
                    for pid in proctree.tree(worker):
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass


def restore(images: Path, inherit: dict[str, int], *, net_fd: int | None = None, lazy: bool = False,
            rt: runtime.CriuRuntime | None = None, timeout_s: float = 120.0,
            abort: threading.Event | None = None,
            command: runtime.CriuCommand | None = None) -> tuple[int, float]:
    """Restore a tree detached from us; return (host pid of its root, seconds).

    `inherit` maps CRIU external ids ("pipe:[ino]") to fds of ours that take
    their place.  The caller should be a child subreaper so that the restored
    root becomes its child once CRIU exits.  lazy: the tree's anonymous memory
    is left to a lazy-pages daemon the caller started (memory/lazy_pages.py).
    timeout_s, abort: CRIU and the partial tree are killed past the deadline or once
    `abort` is set (_Deadline), and RestoreFailed says which.  command: a CRIU to run instead of
    rt's (one with a library preloaded: criu/criufill.py).
    """
    rt = rt or runtime.locate()
    if net_fd is not None:
        inherit = {**inherit, NET_KEY: net_fd}
    # CRIU takes the inherited fds by number in its own process: they go to its worker alone
    pycriu, c = _criu(rt, command, pass_fds=tuple(inherit.values()))
    dfd = os.open(images, os.O_DIRECTORY)  # CRIU reads it through /proc/<our pid>/fd
    try:
        c.opts.images_dir_fd = dfd
        c.opts.tcp_established = True
        c.opts.network_lock = pycriu.rpc.NFTABLES
        _no_cgroups(pycriu, c)
        if net_fd is not None:
            c.opts.network_lock = pycriu.rpc.SKIP
        c.opts.log_file = RESTORE_LOG
        c.opts.log_level = 4
        c.opts.lazy_pages = lazy
        for key, fd in inherit.items():
            i = c.opts.inherit_fd.add()
            i.key = key
            i.fd = fd
        t0 = time.monotonic()
        deadline = _Deadline(c, timeout_s, abort)
        try:
            with deadline:
                resp = c.restore()
            if deadline.why:  # it finished as the deadline passed: that copy must not run either
                proctree.kill_and_wait(resp.pid)
                raise RuntimeError("cut short")
        except Exception as e:
            lines = criulog.error_lines(images / RESTORE_LOG)
            cause = deadline.why or f"CRIU could not restore: {e}"
            raise RestoreFailed(
                cause + (": " + " | ".join(lines) if lines else ""),
                action=f"the images are kept for a retry or rollback; see {images / RESTORE_LOG}",
                details={"criu_errors": lines, "log": str(images / RESTORE_LOG)}) from None
        return resp.pid, time.monotonic() - t0
    finally:
        c._comm.close()
        os.close(dfd)


def _no_cgroups(pycriu: Any, c: Any) -> None:
    """CRIU neither dumps nor restores the tree's cgroups: the destination's agent places a restored
    tree itself (agent/scope.py: a systemd scope of its own where systemd runs the host).  Why: a
    tree in a scope of one host names cgroups another host (or a systemd in another cgroup
    namespace) lacks; CRIU's default mode then failed both the restore and the rollback ("cg: No
    set 1 found", seen moving a rank off an agent run by the shipped unit)."""
    c.opts.manage_cgroups = True
    c.opts.manage_cgroups_mode = pycriu.rpc.IGNORE


def _dump_action(lines: list[str], log: Path) -> str:
    """What an operator does about a failed dump, from CRIU's own lines."""
    if any(DEVICE_MAPPING in line for line in lines):
        # CRIU met a device still mapped: a process that began to use the GPU after pitstop
        # suspended the tree's CUDA processes (gpu/checkpoint.py), or a device nothing moves
        return (f"the worker was resumed; a process of it mapped a device when CRIU froze it (a process "
                f"that began to use the GPU during the pause, or a device pitstop cannot move): evacuate "
                f"again, and see {log}")
    return f"the worker was resumed; see {log}"
