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
untouched pages would read as zeros.  The agent therefore kills the worker the moment the
daemon fails (agent/receiving.py, _watch_fill): a dead rank the job's own recovery sees.
That is after the fact: a daemon that dies on its own leaves a few milliseconds in which the
worker may read zeros.  (Holding a copy of each userfaultfd in the agent would close that
window, but CRIU's daemon closes a finished task's userfaultfd without removing it from its
epoll set, so with a second copy open the set keeps reporting a task it has freed: fills that
never ended, when tried.)  Where the pages come from the source, the likelier failure (the
source or the link going) is caught before the daemon sees it, by a relay that kills the
worker first (memory/page_relay.py).  A delta against a pre-copy is served the same way,
by a local page server, since this daemon cannot read a parent image (lazydelta.py).
Operators choose this mode
(PITSTOP_AGENT_LAZY_RESTORE); the eager restore stays the default.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pitstop.criu import criulog, runtime
from pitstop.errors import RestoreFailed

STOP_WAIT_S = 10  # a lazy-pages daemon or page relay, killed, to be reaped
LAZY_PAGES_CHECK_TIMEOUT_S = 60  # CRIU's lazy-pages support probe (`criu check --feature uffd-noncoop`)

LOG = "lazy-pages.log"
RELAY_LOG = "page-relay.log"  # the relay's stderr: empty unless it crashed
RELAY_RESULT = "page-relay.result"  # its outcome, for an agent that restarted while the fill ran
RELAY_END_S = 15.0  # how long the relay may take to report once the daemon has exited
SOCKET = "lazy-pages.socket"  # CRIU's name for it, in the work directory (the images here)


@dataclass
class LazyFill:
    """A running `criu lazy-pages` daemon serving one restore's memory (and, when the pages come
    from the source, the relay between them: memory/page_relay.py)."""

    proc: subprocess.Popen[bytes]
    images: Path
    relay: subprocess.Popen[bytes] | None = None
    started: float = field(default_factory=time.monotonic)
    _relay_out: bytes = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def pids(self) -> tuple[int, ...]:
        return (self.proc.pid,) + ((self.relay.pid,) if self.relay else ())

    def guard(self, root_pid: int, timeout_s: float = 10.0) -> str | None:
        """Hand the relay the restored tree to kill should the source stop serving; None, or why
        the tree must not run (the source went while it was being restored: the relay killed it)."""
        if self.relay is None:
            return None
        try:
            assert self.relay.stdin is not None
            self.relay.stdin.write(f"guard {root_pid}\n".encode())
            self.relay.stdin.flush()
        except OSError:  # it has ended: its verdict may be in the pipe still (below)
            pass
        line = self._relay_line(timeout_s)
        if line == "ok":
            return None
        if line and line.startswith("{"):
            # The relay ended before the restore returned, so this is its verdict, not an answer:
            # put back for wait().  Ended well, the fill was over already and there is nothing
            # to guard: a dump in which CRIU marked nothing lazy (seen once, 2026-11-30: 301 MB
            # placed eagerly; CRIU places a thread's stack VMA eagerly, and one merged with the
            # rest of anonymous memory would do that, not confirmed).
            self._relay_out = line.encode() + b"\n" + self._relay_out
            try:
                verdict = json.loads(line)
            except ValueError:
                return f"the page relay ended saying {line!r}"
            return None if verdict.get("ok") else str(verdict.get("reason") or line)
        if line:
            return line.removeprefix("failed ")
        if self.relay.poll() is not None:
            return f"the page relay is gone (exit status {self.relay.returncode}; see {self.images / RELAY_LOG})"
        return f"the page relay did not answer within {timeout_s:g} s"

    def _relay_line(self, timeout_s: float) -> str | None:
        assert self.relay is not None and self.relay.stdout is not None
        fd = self.relay.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._relay_out:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._relay_out += chunk
        line, self._relay_out = self._relay_out.split(b"\n", 1)
        return line.decode(errors="replace").strip()

    def wait(self, timeout_s: float) -> tuple[bool, str]:
        """Wait for every page to be in place; (ok, what went wrong in CRIU's or the relay's words).

        On a deadline nothing is killed here: the caller stops the worker first, then the daemon
        (`kill`), so that no page is ever read as zero."""
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False, f"the page fill did not finish within {timeout_s:.0f} s"
        relayed = self._relay_result()
        if relayed is not None and not relayed.get("ok"):
            return False, str(relayed.get("reason"))  # the root cause; the daemon only saw its socket close
        if rc == 0:
            return True, ""
        if self.relay is not None and relayed is None:  # the relay itself failed: say how
            tail = _tail(self.images / RELAY_LOG)
            if tail:
                return False, f"the page relay failed: {tail}"
        lines = criulog.error_lines(self.images / LOG)
        how = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
        return False, f"CRIU's lazy-pages daemon stopped with {how}" + (": " + " | ".join(lines) if lines else "")

    def _relay_result(self) -> dict[str, object] | None:
        if self.relay is None:
            return None
        line = self._relay_line(RELAY_END_S)
        try:
            self.relay.wait(RELAY_END_S)
        except subprocess.TimeoutExpired:
            self.relay.kill()
            self.relay.wait(STOP_WAIT_S)
        try:
            return json.loads(line) if line else None
        except ValueError:
            return None

    def kill(self) -> None:
        """Stop the daemon (and relay).  The worker must already be stopped: see LazyFill.wait."""
        for p in (self.proc, self.relay):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(STOP_WAIT_S)

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started


def start(images: Path, *, ready_timeout_s: float = 10.0, rt: runtime.CriuRuntime | None = None,
          page_socket: socket.socket | None = None, page_idle_timeout_s: float = 60.0,
          local_index: Path | None = None) -> LazyFill:
    """Start the daemon for `images` and wait until it listens for the restore.

    page_socket: post-copy over the network (memory/postcopy.py): the lazy pages are not in
    `images`; they come from the source over this socket (CRIU's page-server protocol,
    memory/page_server.py).  The daemon does not get it: a relay process holds it and hands
    the daemon one end of a socketpair (memory/page_relay.py says why).  The relay gets its
    own copy of the socket; the caller closes theirs.
    local_index: a delta restored lazily (memory/lazydelta.py): a local page server process
    (memory/local_pages.py) answers the daemon from the files the index names, in the
    relay's place and on the relay's terms."""
    rt = rt or runtime.locate()
    sock = images / SOCKET
    sock.unlink(missing_ok=True)
    argv = [rt.binary, "lazy-pages", "-D", str(images), "-W", str(images), "-o", LOG, "-v4"]
    fds: tuple[int, ...] = ()
    relay = None
    if page_socket is not None or local_index is not None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        if page_socket is not None:
            server = ["pitstop.memory.page_relay", "--upstream-fd", str(page_socket.fileno())]
            keep: tuple[int, ...] = (page_socket.fileno(), ours.fileno())
        else:
            server = ["pitstop.memory.local_pages", "--index", str(local_index)]
            keep = (ours.fileno(),)
        try:
            with open(images / RELAY_LOG, "wb") as err:
                relay = subprocess.Popen(
                    [sys.executable, "-m", *server, "--daemon-fd", str(ours.fileno()),
                     "--idle-timeout", str(page_idle_timeout_s), "--result-file", str(images / RELAY_RESULT)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, pass_fds=keep,
                    start_new_session=True)
        finally:
            ours.close()
        fds = (theirs.fileno(),)
        argv += ["--page-server", "--ps-socket", str(fds[0])]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, pass_fds=fds,
                                start_new_session=True)  # not in the agent's process group: its signals are not ours
    except OSError:
        if relay is not None:
            relay.kill()
            relay.wait(STOP_WAIT_S)
        raise
    finally:
        if fds:
            theirs.close()
    fill = LazyFill(proc, images, relay)
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


def ended_unwatched(images: Path, worker_alive: bool) -> tuple[bool | None, str]:
    """How a fill ended that nobody watched (the agent restarted while it ran): True, filled;
    False, failed, and why; None, not known.

    The relay leaves its verdict in RELAY_RESULT; CRIU's daemon, run locally, leaves only its
    log, whose error lines say it failed.  A worker still alive with no error on record was
    filled: a failed remote fill kills it, and a failed local one logs why."""
    try:
        relayed = json.loads((images / RELAY_RESULT).read_text())
    except (OSError, ValueError):
        relayed = None
    if isinstance(relayed, dict) and not relayed.get("ok"):
        return False, str(relayed.get("reason") or "the page relay reported a failure")
    lines = criulog.error_lines(images / LOG)
    if lines:
        return False, "CRIU's lazy-pages daemon: " + " | ".join(lines)
    if isinstance(relayed, dict) or worker_alive:
        return True, ""
    return None, "the worker and its fill both ended while the agent was restarting"


def _tail(path: Path, limit: int = 400) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-3:])[-limit:]


def supported(rt: runtime.CriuRuntime | None = None) -> tuple[bool, str]:
    """Whether this kernel can serve restores lazily: CRIU's uffd checks, in its words."""
    rt = rt or runtime.locate()
    p = subprocess.run([rt.binary, "check", "--feature", "uffd-noncoop"],
                       capture_output=True, text=True, timeout=LAZY_PAGES_CHECK_TIMEOUT_S)
    return p.returncode == 0, (p.stdout + p.stderr).strip()
