"""proctree.discard_copy: a restored copy whose move rolled back goes without a word.

It holds the very TCP connections its source holds, and the rollback restores them there.
Invariant: the peer of a connection whose holder is discarded sees neither EOF nor a reset;
a plain kill (the control) makes it see EOF.  Real processes, real loopback TCP.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from pitstop.proc import proctree

pytestmark = pytest.mark.timeout(60)

HOLDER = """
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
child = __import__("os").fork()   # a child holds it too, as a DataLoader worker would
if child:                           # one line from the parent only: two writers could interleave
    print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def connection():
    """A listening socket here, a process tree there connected to it: (our end, the tree)."""
    ls = socket.create_server(("127.0.0.1", 0))
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(ls.getsockname()[1])], stdout=subprocess.PIPE, text=True)
    ours, _ = ls.accept()
    assert p.stdout.readline().strip() == "ready"
    yield ours, p
    for pid in proctree.tree(p.pid) if proctree.exists(p.pid) else []:
        subprocess.run(["kill", "-9", str(pid)], capture_output=True)
    p.wait(10)
    ours.close()
    ls.close()


def _peer_hears(sock: socket.socket, wait_s: float = 1.5) -> str:
    sock.settimeout(wait_s)
    try:
        return "EOF" if sock.recv(1) == b"" else "data"
    except TimeoutError:
        return "nothing"
    except ConnectionResetError:
        return "reset"


@pytest.mark.slow
def test_a_discarded_copy_leaves_its_connections_silent(connection):
    ours, p = connection
    pids = proctree.discard_copy(p.pid)
    assert len(pids) == 2 and not any(proctree.exists(x) for x in pids)
    assert _peer_hears(ours) == "nothing"


def test_a_plain_kill_closes_them_the_control(connection):
    ours, p = connection
    proctree.kill_tree(p.pid)
    assert _peer_hears(ours) == "EOF"


def test_silence_counts_only_tcp_sockets(connection):
    ours, p = connection
    proctree.stop(proctree.tree(p.pid))
    assert proctree.silence_tcp(proctree.tree(p.pid)) == 2  # one socket, two holders' descriptors
