"""proctree.let_go: a released source frees its addresses and ports before it has exited.

The release kills the stopped source; a restore of the same connections on the same kernel
(the test cluster's agents share one) fails until the source's sockets are gone, and a
killed process closes them only after its memory is freed.  Invariants, with real processes
and loopback TCP: right after let_go, sockets bound to the source's own four-tuple and
listening port can be made as CRIU's restore makes them (the control, without let_go, gets
"Cannot assign requested address"); the peer hears nothing; the tree exits.  A tree holding
something else a restore would collide with (a unix socket bound to an abstract name, a file
lock) is left as it was, with the reason; a unix socket bound to a path is not such a thing.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time

import pytest

from pitstop.proc import proctree

pytestmark = pytest.mark.timeout(60)

TCP_REPAIR = 19

HOLDER = """
import fcntl, os, socket, sys, tempfile, time
extra = sys.argv[2]
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
ls = socket.create_server(("127.0.0.1", 0))           # its own listener, bound to a port
if extra == "unix":
    u = socket.socket(socket.AF_UNIX); u.bind("\\0pitstop-let-go-%d" % os.getpid())
if extra == "unix-path":                              # as Python's multiprocessing binds one
    d = tempfile.mkdtemp(prefix="pymp-"); u = socket.socket(socket.AF_UNIX); u.bind(d + "/listener"); u.listen()
if extra == "lock":
    f = tempfile.TemporaryFile(); fcntl.flock(f, fcntl.LOCK_EX)
ballast = bytearray(256 << 20)                        # memory whose freeing delays the exit
for i in range(0, len(ballast), 4096): ballast[i] = 1
child = os.fork()                                     # a child holds the sockets too
if child:
    print(s.getsockname()[1], ls.getsockname()[1], flush=True)
time.sleep(60)
"""


@pytest.fixture
def holder(request, tmp_path):
    """Our listening end, a tree connected to it (stopped, as a dump leaves it), its ports."""
    ls = socket.create_server(("127.0.0.1", 0))
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(ls.getsockname()[1]), request.param],
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    ours, _ = ls.accept()
    local, listening = (int(x) for x in p.stdout.readline().split())
    proctree.stop(proctree.tree(p.pid))
    deadline = time.monotonic() + 10                 # a signal is delivered when each is next scheduled
    while not _stopped(p.pid) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert _stopped(p.pid)
    yield ours, ls.getsockname()[1], p, local, listening
    for pid in proctree.tree(p.pid) if proctree.exists(p.pid) else []:
        subprocess.run(["kill", "-9", str(pid)], capture_output=True)
    p.wait(10)
    ours.close()
    ls.close()


def _stopped(root: int) -> bool:
    return all(proctree.state(x) == "T" for x in proctree.tree(root))


def _restore_like(local: int, peer: int) -> socket.socket:
    """A connection re-made as CRIU restores one: repair mode, bound to its old end, connected.

    Repair mode forces port reuse (SK_FORCE_REUSE) unless SO_REUSEADDR is set after it, so the
    bind never fails on another connection's port (TIME_WAIT ones included, as in a full test
    run); what fails while the source holds the connection is the connect: its four-tuple."""
    s = socket.socket()
    try:
        s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, 1)
        s.bind(("127.0.0.1", local))
        s.connect(("127.0.0.1", peer))
    except OSError:
        s.close()
        raise
    return s


@pytest.mark.parametrize("holder", ["none"], indirect=True)
def test_the_control_a_stopped_source_holds_its_connection(holder):
    ours, peer, p, local, _ = holder
    with pytest.raises(OSError) as e:
        _restore_like(local, peer)
    assert e.value.errno == errno.EADDRNOTAVAIL


@pytest.mark.parametrize("holder", ["none", "unix-path"], indirect=True)
def test_let_go_frees_the_ends_at_once_and_the_peer_hears_nothing(holder):
    """Also for a tree with a unix socket bound to a path (a DataLoader worker's, from Python's
    multiprocessing): CRIU's restore binds the path again, the source's exit is not awaited."""
    ours, peer, p, local, listening = holder
    pids = proctree.tree(p.pid)
    assert proctree.let_go(p.pid) is None
    s = _restore_like(local, peer)                   # while the tree may still be freeing its memory
    ls = socket.create_server(("127.0.0.1", listening))
    s.close()
    ls.close()
    ours.settimeout(1.0)
    with pytest.raises(TimeoutError):                # neither EOF nor a reset
        ours.recv(1)
    proctree.set_policy(pids, os.SCHED_OTHER)        # as the commit does: off idle time for the rest
    deadline = time.monotonic() + 10
    while any(proctree.exists(x) for x in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(proctree.exists(x) for x in pids)


@pytest.mark.parametrize("holder,what", [("unix", "abstract name"), ("lock", "file lock")],
                         indirect=["holder"])
def test_a_tree_holding_more_than_tcp_is_left_for_the_exit(holder, what):
    ours, peer, p, local, _ = holder
    why = proctree.let_go(p.pid)
    assert why is not None and what in why
    assert _stopped(p.pid)                           # untouched: still stopped
    with pytest.raises(OSError):
        _restore_like(local, peer)                   # its connection still held


def test_set_policy_reaches_every_thread():
    p = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                          "[threading.Thread(target=time.sleep, args=(30,), daemon=True).start() for _ in range(3)]\n"
                          "print('ready', flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        tids = [int(t) for t in os.listdir(f"/proc/{p.pid}/task")]
        assert len(tids) == 4
        proctree.set_policy([p.pid], os.SCHED_IDLE)
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_IDLE}
        proctree.set_policy([p.pid], os.SCHED_OTHER)
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_OTHER}
    finally:
        p.kill()
        p.wait(10)
