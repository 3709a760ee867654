"""Post-copy restore from the local copy: CRIU's lazy-pages daemon fills memory after the restore.

An eager restore copies every page into the new process before it runs: about 0.4 s per
700 MiB here, spent while the whole job waits.  With `restore --lazy-pages` CRIU re-creates
the tree with its anonymous private memory registered to a userfaultfd and hands that to a
`criu lazy-pages` daemon, which serves faults first and copies the rest in the background,
from the same images on this host.  The job resumes while the fill runs.

Why only from the local copy: CRIU's own network post-copy (`dump --lazy-pages`) fails on
this kernel in the dump's page server ("page-pipe: tee: Operation not permitted", see
docs/benchmarks.md), while the daemon reading local images works.  The images have
arrived and been verified before the source is released, so the commit point is unchanged.

The risk, stated plainly: after the move commits, the restored worker depends on the
daemon until the fill ends.  If the daemon dies, the kernel drops the userfaultfd and
untouched pages would read as zeros.  `LazyFill.watch` therefore kills the worker the
moment the daemon fails: a dead rank the job's own recovery sees, never a silently
corrupted one.  Operators choose this mode (PITSTOP_AGENT_LAZY_RESTORE); the eager restore
stays the default.
"""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import RestoreFailed
from . import criulog, runtime

LOG = "lazy-pages.log"
SOCKET = "lazy-pages.socket"  # CRIU's name for it, in the work directory (the images here)


@dataclass
class LazyFill:
    """A running `criu lazy-pages` daemon serving one restore's memory."""

    proc: subprocess.Popen[bytes]
    images: Path
    started: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout_s: float) -> tuple[bool, str]:
        """Wait for every page to be in place; (ok, what went wrong in CRIU's own words)."""
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return False, f"the page fill did not finish within {timeout_s:.0f} s"
        if rc == 0:
            return True, ""
        lines = criulog.error_lines(self.images / LOG)
        how = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
        return False, f"CRIU's lazy-pages daemon stopped with {how}" + (": " + " | ".join(lines) if lines else "")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started


def start(images: Path, *, ready_timeout_s: float = 10.0, rt: runtime.CriuRuntime | None = None,
          page_socket: socket.socket | None = None) -> LazyFill:
    """Start the daemon for `images` and wait until it listens for the restore.

    page_socket: post-copy over the network (capture/postcopy.py): the lazy pages are not in
    `images`; the daemon asks the source for them on this socket (CRIU's page-server protocol,
    transfer/page_server.py).  The daemon gets its own copy; the caller closes theirs."""
    rt = rt or runtime.locate()
    sock = images / SOCKET
    sock.unlink(missing_ok=True)
    argv = [rt.binary, "lazy-pages", "-D", str(images), "-W", str(images), "-o", LOG, "-v4"]
    fds: tuple[int, ...] = ()
    if page_socket is not None:
        fds = (page_socket.fileno(),)
        argv += ["--page-server", "--ps-socket", str(fds[0])]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            pass_fds=fds,
                            start_new_session=True)  # not in the agent's process group: its signals are not ours
    fill = LazyFill(proc, images)
    deadline = time.monotonic() + ready_timeout_s
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            fill.kill()
            lines = criulog.error_lines(images / LOG)
            raise RestoreFailed(
                "CRIU's lazy-pages daemon did not start" + (": " + " | ".join(lines) if lines else
                                                             f" within {ready_timeout_s:.0f} s"),
                action=f"the images are kept for a retry or rollback; see {images / LOG}, "
                       "or restore eagerly (PITSTOP_AGENT_LAZY_RESTORE=0)",
                details={"criu_errors": lines, "log": str(images / LOG)})
        time.sleep(0.005)
    return fill


def supported(rt: runtime.CriuRuntime | None = None) -> tuple[bool, str]:
    """Whether this kernel can serve restores lazily: CRIU's uffd checks, in its words."""
    rt = rt or runtime.locate()
    p = subprocess.run([rt.binary, "check", "--feature", "uffd-noncoop"],
                       capture_output=True, text=True, timeout=60)
    return p.returncode == 0, (p.stdout + p.stderr).strip()
