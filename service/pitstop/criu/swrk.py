"""Start `criu swrk` without forking the agent's Python.

pycriu starts CRIU's RPC worker with os.fork() and runs Python in the child (it sends its pid
over the socket, closes stdio, then execs). The agent is multi-threaded: two restores (or a
dump and a stream) run at once, and a fork copies every lock another thread holds at that
moment. On 2026-12-03 a child of a fork blocked on such a lock, before its exec, in 2 of 12
runs of the three-evacuation test (two restores at once on one spare). Its parent waited
forever for the pid the child never sent, and the restore's deadline could not kill it:
it had no pid to kill. The coordinator only rolled the move back after its own step
deadline, 180 s later.

subprocess.Popen runs no Python between fork and exec (_posixsubprocess, vfork where it
can). That makes the spawn safe from any thread. The pid is known as soon as the call returns,
so a restore's deadline can always kill the worker. The socket's far end and the fds CRIU
must inherit go to this child alone (pass_fds), never to another restore's CRIU that starts
at the same time.

This replaces pycriu's private `_comm` object, whose interface (connect, disconnect, swrk)
comes from the pycriu that runtime.py provisions with CRIU itself.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterable

from pitstop.criu.runtime import CriuCommand

# How long a CRIU that has answered may take to exit before it is killed. It exits right after
# its answer; this bound only keeps a wedged one from holding the agent's thread forever.
EXIT_WAIT_S = 30.0


class SpawnedSwrk:
    """pycriu's `_criu_comm_bin`, with the worker started by subprocess instead of os.fork."""

    COMM_BIN = 2  # pycriu's value for "binary"

    def __init__(self, command: CriuCommand, pass_fds: Iterable[int] = ()) -> None:
        self.comm_type = self.COMM_BIN
        self.command = command
        self.comm = command.binary
        self.pass_fds = tuple(pass_fds)
        self.swrk: int | None = None
        self.daemon = False
        self.sk: socket.socket | None = None
        self._proc: subprocess.Popen | None = None

    def connect(self, daemon: bool) -> socket.socket:
        """Start the worker on one end of a socket pair and return the other end."""
        if daemon:  # pycriu asks for it only to dump the caller itself, which pitstop never does
            raise RuntimeError("a detached criu swrk (a self-dump) is not supported by pitstop")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen([self.command.binary, "swrk", str(theirs.fileno())],
                                          pass_fds=(theirs.fileno(), *self.pass_fds), env=self.command.environ(),
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the worker holds its end: when it dies, our reads end
        self.swrk = self._proc.pid
        self.sk = ours
        return ours

    def disconnect(self) -> None:
        """Close our end and reap the worker (killed if it outlives its answer by EXIT_WAIT_S)."""
        self.close()

    def close(self) -> None:
        """disconnect, also where pycriu does not call it (its request failed: a worker killed by
        a deadline, a broken socket), so that no worker is left a zombie.  Safe to call twice."""
        if self.sk is not None:
            self.sk.close()
        if self._proc is not None and self._proc.returncode is None:
            try:
                self._proc.wait(EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
