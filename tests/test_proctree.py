"""A killed process is gone only when its last thread is (proc/proctree.py, exists).

The move kills the stopped source before the destination restores its TCP connections, and a
rollback kills a restored copy before the source restores the same connections: each restore
needs the addresses the killed process held.  Its main thread shows as a zombie first, while
its other threads still close the files they share; watching only the main thread let 7 of 10
kills of this test's process (4 busy threads, 50 sockets) return with ports still held."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from pitstop.proc import proctree

CHILD = r"""
import socket, threading, time
held = []
for _ in range(50):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    held.append(s)
def spin():
    while True:
        pass
for _ in range(4):
    threading.Thread(target=spin, daemon=True).start()
print(" ".join(str(s.getsockname()[1]) for s in held), flush=True)
time.sleep(100)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kill", ["kill_and_wait", "kill_tree"])
@pytest.mark.slow
def test_a_killed_process_has_let_go_of_its_addresses_when_the_kill_returns(kill: str) -> None:
    for _ in range(10):
        p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
        try:
            ports = [int(x) for x in p.stdout.readline().split()]
            getattr(proctree, kill)(p.pid)  # not reaped yet: its main thread is a zombie at best
            for port in ports:
                with socket.socket() as s:
                    # SO_REUSEADDR: an earlier connection's TIME_WAIT on the port (the child bound
                    # it with SO_REUSEADDR too) must not read as held; a listening socket that any
                    # thread still holds is refused all the same
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("127.0.0.1", port))  # EADDRINUSE if any thread still held it
        finally:
            p.kill()
            p.wait()


READER = r"""
import subprocess, sys, time
kid = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"], stdout=subprocess.PIPE)
print("ready", flush=True)
time.sleep(60)
"""


def test_a_pipe_whose_both_ends_the_tree_holds_is_not_handed_back_as_the_jobs() -> None:
    """A parent reading its child's output holds that pipe's read end, the child its write end at
    fd 1: the tree's own pipe, which CRIU restores as it is.  Only the tree's own stdout, whose
    reader is outside (here: this test), is a pipe to hand back on restore."""
    p = subprocess.Popen([sys.executable, "-c", READER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         stdin=subprocess.DEVNULL)
    try:
        assert p.stdout.readline().strip() == b"ready"
        tree = proctree.tree(p.pid)
        assert len(tree) == 2
        import os

        ours = os.readlink(f"/proc/{p.pid}/fd/1")
        kids = os.readlink(f"/proc/{tree[1]}/fd/1")
        assert ours.startswith("pipe:") and kids.startswith("pipe:") and ours != kids
        got = proctree.stdio_pipes(tree)
        assert [(e.key, e.fd, e.writable) for e in got] == [(ours, 1, True)], got
    finally:
        for pid in reversed(proctree.tree(p.pid)):
            proctree.kill_and_wait(pid)
        p.wait(10)
