"""The page relay (memory/page_relay.py) against real sockets and real processes.

Invariant: while a reply is owed, the daemon's side is closed only after the guarded tree is
gone, so the kernel never drops the userfaultfd of a process that still runs.  A clean close
kills nothing.  (The end-to-end runs with CRIU are in test_remote_post_copy.py.)
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading

import pytest

from pitstop.memory.page_relay import Guardian, Relay, _Frames
from pitstop.memory.page_server import PS_IOV_ADD_F, PS_IOV_FORCE_CLOSE, PS_IOV_GET, PSI
from pitstop.memory.postcopy import PAGE
from pitstop.proc import proctree

from .helpers import until

pytestmark = pytest.mark.timeout(60)


def _get(nr: int, vaddr: int = 0x7000_0000, dst: int = 42) -> bytes:
    return PSI.pack(PS_IOV_GET, nr, vaddr, dst)


def _reply(nr: int, vaddr: int = 0x7000_0000, dst: int = 42) -> bytes:
    return PSI.pack((4 << 16) | PS_IOV_ADD_F, nr, vaddr, dst) + bytes([7]) * (nr * PAGE)


class Rig:
    """A relay in a thread: `source` and `daemon` are the far ends of its two sockets."""

    def __init__(self, idle_timeout_s: float = 5.0, guard_timeout_s: float = 5.0) -> None:
        self.source, up = socket.socketpair()
        self.daemon, dn = socket.socketpair()
        self.ctl_r, self.ctl_w = os.pipe()
        out_r, out_w = os.pipe()
        self.out = os.fdopen(out_r, "r")
        self.relay = Relay(up, dn, Guardian(self.ctl_r, os.fdopen(out_w, "w"), guard_timeout_s),
                           idle_timeout_s=idle_timeout_s)
        self.result: dict = {}
        self.t = threading.Thread(target=lambda: self.result.update(self.relay.run()), daemon=True)
        self.t.start()

    def ask(self, nr: int) -> bytes:
        """The daemon asks for nr pages; the request as the source receives it."""
        self.daemon.sendall(_get(nr))
        return _recv_all(self.source, PSI.size)

    def guard(self, pid: int) -> str:
        os.write(self.ctl_w, f"guard {pid}\n".encode())
        return self.out.readline().strip()

    def close(self) -> None:
        self.t.join(20)
        for s in (self.source, self.daemon):
            s.close()
        os.close(self.ctl_w)
        os.close(self.ctl_r)
        self.relay.g.ctl_out.close()
        self.out.close()


@pytest.fixture
def make_rig():
    rigs: list[Rig] = []

    def make(**kw: float) -> Rig:
        rigs.append(Rig(**kw))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


@pytest.fixture
def victim():
    """A real tree (a parent with a child) standing in for the restored worker."""
    p = subprocess.Popen([sys.executable, "-c", "import subprocess,time; c=subprocess.Popen(['sleep','60']); "
                          "print(c.pid, flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    child = int(p.stdout.readline())
    yield p, child
    proctree.kill_tree(p.pid)
    p.wait(10)
    subprocess.run(["kill", "-9", str(child)], capture_output=True)


def _recv_all(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        b = sock.recv(n - len(buf))
        assert b, "closed early"
        buf += b
    return buf


def test_frames_follow_requests_and_replies_across_any_split():
    f = _Frames()
    f.from_daemon(_get(3)[:10])
    assert not f.outstanding
    f.from_daemon(_get(3)[10:] + _get(1))
    assert list(f.expect) == ["pages", "pages"]
    stream = _reply(2) + _reply(1) + _reply(1)[:5]  # fewer pages than asked, then the rest
    f.from_daemon(_get(1))  # the daemon asks again for the page it did not get
    for i in range(0, len(stream), 997):  # in odd-sized pieces
        f.from_source(memoryview(stream[i:i + 997]))
    assert f.pages == 3 and list(f.expect) == ["pages"]  # a header not yet whole counts nothing
    f.from_source(memoryview(_reply(1)[5:]))
    assert f.pages == 4 and not f.outstanding
    f.from_daemon(PSI.pack(PS_IOV_FORCE_CLOSE, 0, 0, 0))
    f.from_source(memoryview(b"\0\0\0\0"))
    assert f.closed and not f.outstanding


def test_frames_refuse_what_no_request_asked_for():
    with pytest.raises(ValueError, match="no request asked for"):
        _Frames().from_source(memoryview(b"x"))
    with pytest.raises(ValueError, match="command 0x99"):
        _Frames().from_daemon(PSI.pack(0x99, 0, 0, 0))


def test_clean_fill_passes_pages_through_and_kills_nothing(victim, make_rig):
    p, child = victim
    rig = make_rig()
    assert rig.guard(p.pid) == "ok"
    assert rig.ask(2) == _get(2)
    rig.source.sendall(_reply(2))
    assert _recv_all(rig.daemon, PSI.size + 2 * PAGE) == _reply(2)
    rig.daemon.sendall(PSI.pack(PS_IOV_FORCE_CLOSE, 0, 0, 0))
    _recv_all(rig.source, PSI.size)
    rig.source.sendall(b"\0\0\0\0")
    rig.source.shutdown(socket.SHUT_WR)
    assert _recv_all(rig.daemon, 4) == b"\0\0\0\0"
    rig.t.join(10)
    assert rig.result["ok"] and rig.result["pages"] == 2 and rig.result["killed"] == []
    assert proctree.exists(p.pid) and proctree.exists(child)


def test_source_hangup_kills_the_tree_before_the_daemon_sees_it(victim, make_rig):
    p, child = victim
    rig = make_rig()
    assert rig.guard(p.pid) == "ok"
    rig.ask(4)
    rig.source.sendall(_reply(4)[:PSI.size + PAGE])  # one page of four, then the host is gone
    rig.source.close()
    _recv_all(rig.daemon, PSI.size + PAGE)
    assert rig.daemon.recv(1) == b""  # the daemon's side closes ...
    assert not proctree.exists(p.pid) and not proctree.exists(child)  # ... after the whole tree went
    rig.t.join(10)
    assert not rig.result["ok"] and "hung up after 4 pages" in rig.result["reason"]
    assert sorted(rig.result["killed"]) == sorted([p.pid, child])


def test_source_gone_during_the_restore_refuses_the_tree_it_is_then_given(victim, make_rig):
    p, child = victim
    rig = make_rig()
    rig.ask(1)
    rig.source.close()
    until(lambda: rig.relay.g.failure, timeout=10)
    assert not select.select([rig.daemon], [], [], 0.3)[0]  # held open while the restore runs
    answer = rig.guard(p.pid)  # the restore returns: its tree must not run
    assert answer.startswith("failed the source's page server hung up"), answer
    assert not proctree.exists(p.pid) and not proctree.exists(child)
    assert rig.daemon.recv(1) == b""


def test_silent_source_is_given_up_at_the_idle_deadline(victim, make_rig):
    p, child = victim
    rig = make_rig(idle_timeout_s=0.5)
    assert rig.guard(p.pid) == "ok"
    rig.ask(1)  # ... and the source never answers
    assert rig.daemon.recv(1) == b""
    assert not proctree.exists(p.pid)
    rig.t.join(10)
    assert "sent nothing for 0.5 s while a request was outstanding" in rig.result["reason"]


def test_relay_process_reports_its_end_as_one_json_line(tmp_path):
    """The module as the agent runs it: fds passed, a guard handshake, a JSON line at the end."""
    source, up = socket.socketpair()
    daemon, dn = socket.socketpair()
    r = subprocess.Popen([sys.executable, "-m", "pitstop.memory.page_relay", "--upstream-fd", str(up.fileno()),
                          "--daemon-fd", str(dn.fileno())], pass_fds=(up.fileno(), dn.fileno()),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    up.close()
    dn.close()
    try:
        daemon.sendall(PSI.pack(PS_IOV_FORCE_CLOSE, 0, 0, 0))
        _recv_all(source, PSI.size)
        source.sendall(b"\0\0\0\0")
        source.close()
        assert _recv_all(daemon, 4) == b"\0\0\0\0"
        out, _ = r.communicate(timeout=20)
        assert r.returncode == 0
        assert json.loads(out.strip().splitlines()[-1])["ok"] is True
    finally:
        if r.poll() is None:
            r.kill()
            r.wait(10)
        daemon.close()


def test_the_relay_process_leaves_its_verdict_for_an_agent_that_restarted(tmp_path):
    """The agent that started the relay may be gone when the fill ends (its pipe with it): the
    verdict is also written where the restarted agent looks (lazy_pages.ended_unwatched)."""
    from pitstop.memory import lazy_pages

    source, up = socket.socketpair()
    daemon, dn = socket.socketpair()
    result = tmp_path / lazy_pages.RELAY_RESULT
    p = subprocess.Popen([sys.executable, "-m", "pitstop.memory.page_relay", "--upstream-fd", str(up.fileno()),
                          "--daemon-fd", str(dn.fileno()), "--result-file", str(result)],
                         pass_fds=(up.fileno(), dn.fileno()), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        up.close()
        dn.close()
        p.stdin.close()  # as when the agent died: nobody on the control pipe
        daemon.sendall(_get(2))
        _recv_all(source, PSI.size)
        source.close()  # the source goes with a request outstanding
        assert p.wait(20) == 1
        verdict = json.loads(result.read_text())
        assert verdict["ok"] is False and "hung up" in verdict["reason"], verdict
        ok, why = lazy_pages.ended_unwatched(tmp_path, worker_alive=False)
        assert ok is False and "hung up" in why
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        daemon.close()


@pytest.mark.parametrize("relay,daemon_log,alive,expect", [
    ({"ok": True}, "", False, True),             # the relay saw the daemon's close: filled, whatever came after
    (None, "", True, True),                     # a local fill, no error logged, the worker runs on
    (None, "(00.5) Error (criu/uffd.c:1): uffd: bad\n", True, False),  # the daemon said it failed
    (None, "", False, None),                    # nothing on record and the worker is gone
], ids=["relay ok", "local, worker alive", "daemon error", "nothing known"])
def test_an_unwatched_fill_is_judged_by_what_it_left(tmp_path, relay, daemon_log, alive, expect):
    from pitstop.memory import lazy_pages

    if relay is not None:
        (tmp_path / lazy_pages.RELAY_RESULT).write_text(json.dumps(relay))
    (tmp_path / lazy_pages.LOG).write_text(daemon_log)
    ok, why = lazy_pages.ended_unwatched(tmp_path, worker_alive=alive)
    assert ok is expect, why
    assert bool(why) == (ok is not True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("source_says", ["goodbye", "nothing"], ids=["fill over", "source gone"])
def test_a_relay_that_ended_before_the_restore_returned_is_judged_by_its_verdict(tmp_path, source_says):
    """A dump can have no lazy pages at all (a worker whose memory is all locked or shared; once
    also CRIU's stack test, memory/lazyrule.py): the daemon is done
    before the restore returns and the relay has ended.  Its verdict, not a missing "ok", decides: a fill that ended well leaves
    nothing to guard (CI failure of 2026-11-30: such a move was rolled back as if the source
    had gone), one whose source hung up refuses the tree."""
    from pitstop.memory import lazy_pages

    source, up = socket.socketpair()
    daemon, dn = socket.socketpair()
    r = subprocess.Popen([sys.executable, "-m", "pitstop.memory.page_relay", "--upstream-fd", str(up.fileno()),
                          "--daemon-fd", str(dn.fileno()), "--guard-timeout", "0.5"],
                         pass_fds=(up.fileno(), dn.fileno()), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    fill = lazy_pages.LazyFill(proc=r, images=tmp_path, relay=r)
    up.close()
    dn.close()
    victim = subprocess.Popen(["sleep", "60"])
    try:
        if source_says == "goodbye":  # the daemon closes at once: nothing to fetch
            daemon.sendall(PSI.pack(PS_IOV_FORCE_CLOSE, 0, 0, 0))
            _recv_all(source, PSI.size)
            source.sendall(b"\0\0\0\0")
            source.close()
        else:  # the source goes with a request outstanding
            daemon.sendall(_get(2))
            _recv_all(source, PSI.size)
            source.close()
        r.wait(20)  # ended before the guard: what the agent meets when the restore returns
        why = fill.guard(victim.pid, timeout_s=5)
        if source_says == "goodbye":
            assert why is None and victim.poll() is None
            assert fill._relay_result()["ok"] is True  # still there for wait()
        else:
            assert why and "hung up" in why, why
    finally:
        victim.kill()
        victim.wait(10)
        if r.poll() is None:
            r.kill()
            r.wait(10)
        daemon.close()
