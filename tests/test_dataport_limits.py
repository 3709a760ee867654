"""What a peer can make an agent's data port and image receptions spend: the attacks of the
security audit (findings 3 and 7), each played against real sockets on 127.0.0.1.

Without the token (finding 3): connections that never greet, or greet a byte at a time, and a
host out of file descriptors, must neither stop the port nor hold it.  With the token, as a
buggy peer would (finding 7): a frame announcing more than any sender sends, more than the image
directory has room for, more receptions than the agent allows, a stream that never ends."""

from __future__ import annotations

import json
import os
import selectors
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest

from pitstop.agent.receiving import DestinationSide
from pitstop.agent.settings import AgentSettings
from pitstop.agent.state import AgentState
from pitstop.errors import TransferFailed
from pitstop.transfer import dataport
from pitstop.transfer.compress import MAX_PIECE
from pitstop.transfer.dataport import DataPort
from pitstop.transfer.manifest import Manifest
from pitstop.transfer.stream import MAX_MANIFEST, DirectoryTail, StreamReceiver

from .helpers import end_stdin_child, until

TOKEN = "cluster-token"
MiB = 1 << 20
SERVICE = Path(__file__).resolve().parents[1] / "service"


# -- helpers ----------------------------------------------------------------------------------------

def _fake_slots(root: Path) -> dict:
    """What DataPort needs of an agent, without one: a receiver per image under `root`."""
    def open_slot(image_id: str) -> SimpleNamespace:
        return SimpleNamespace(image_id=image_id, receiver=StreamReceiver(root / image_id))

    return {"open_slot": open_slot, "fail_slot": lambda slot: slot.receiver.close(),
            "finished": lambda slot: {"bytes": slot.receiver.received}, "on_error": lambda slot, e: e}


def _agent_slots(dest: DestinationSide) -> dict:
    """DataPort wired to a real DestinationSide, as agent/server.py wires it."""
    def finished(slot) -> dict:  # noqa: ANN001
        slot.state = "complete"
        return {"bytes": slot.receiver.received}

    return {"open_slot": dest.open_slot, "fail_slot": dest.fail_slot, "finished": finished,
            "on_error": lambda slot, e: TransferFailed(f"write failed: {e}")}


@pytest.fixture
def ports():
    """Start DataPorts in this process; each is closed, and its threads gone, at the end."""
    started: list[DataPort] = []

    def start(**kw) -> DataPort:
        p = DataPort("127.0.0.1", 0, token=TOKEN, **kw).start()
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()
    until(lambda: not [t for t in threading.enumerate() if t.name.startswith("dataport-")], 10,
          "the data ports' threads to end")


@pytest.fixture
def clients():
    """Client sockets of a test: all closed at its end."""
    made: list[socket.socket] = []

    def connect(port: int, source: str | None = None) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0) if source else None)
        made.append(s)
        return s

    yield connect
    for s in made:
        s.close()


@pytest.fixture
def dest(tmp_path):
    """A DestinationSide over a temporary image directory; settings per test."""
    made: list[DestinationSide] = []

    def make(**settings) -> DestinationSide:
        s = AgentSettings(name="rx", state_dir=tmp_path / "state", image_dir=tmp_path / "images",
                          cluster_token=TOKEN, image_mount=False, **settings)
        s.state_dir.mkdir(parents=True, exist_ok=True)
        d = DestinationSide(s, AgentState(s.state_dir))
        made.append(d)
        return d

    yield make
    for d in made:
        for slot in list(d.slots.values()):
            d.fail_slot(slot)


@pytest.fixture(autouse=True)
def _no_files_left(tmp_path):
    """Images received, sent or refused here go with the test (pytest would keep the last runs')."""
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)


def _images(d: Path, size: int) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "pages-1.img").write_bytes(os.urandom(size))
    return d


def _send(src: Path, port: int, image_id: str, timeout_s: float = 10.0) -> dict:
    """A legitimate sender: an agent streaming `src` with the token."""
    tail = DirectoryTail(src)
    tail.manifest_base = Manifest(capture_id=image_id)
    tail.finished.set()
    return dataport.send(iter(tail), "127.0.0.1", port, image_id, TOKEN, timeout_s=timeout_s)


def _greet(s: socket.socket, image_id: str) -> dict:
    """Say a valid hello on a raw socket; the port's answer."""
    s.sendall(json.dumps({"image_id": image_id, "token": TOKEN}).encode() + b"\n")
    return json.loads(_line(s))


def _line(s: socket.socket) -> bytes:
    out = b""
    while not out.endswith(b"\n"):
        b = s.recv(1)
        if not b:
            break
        out += b
    return out


def _closed_by_peer(s: socket.socket, within_s: float) -> tuple[float, bytes]:
    """Wait for the port to close `s`: (seconds it took, what it said before)."""
    t0 = time.monotonic()
    s.settimeout(within_s)
    said = b""
    try:
        while b := s.recv(4096):
            said += b
    except ConnectionResetError:
        pass
    return time.monotonic() - t0, said


# -- finding 3: the data port without a token -------------------------------------------------------

SERVER = r"""
import resource, os, sys
from pathlib import Path
from types import SimpleNamespace
from pitstop.transfer.dataport import DataPort
from pitstop.transfer.stream import StreamReceiver
root, spare = Path(sys.argv[1]), int(sys.argv[2])
open_slot = lambda image_id: SimpleNamespace(image_id=image_id, receiver=StreamReceiver(root / image_id))
port = DataPort("127.0.0.1", 0, token="cluster-token", open_slot=open_slot, fail_slot=lambda s: s.receiver.close(),
                finished=lambda s: {"bytes": s.receiver.received}, on_error=lambda s, e: e, greeting_s=60,
                per_source_greeting=1000, per_source=1000).start()  # one source: this test is about the fd limit
limit = len(os.listdir("/proc/self/fd")) + spare
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(port.port, limit, flush=True)
sys.stdin.readline()
port.close()
"""


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_the_port_outlives_running_out_of_file_descriptors(tmp_path, clients):
    """Idle connections take every file descriptor the receiving process may open: accept()
    fails with EMFILE, which once ended the accept thread for good.  Now it is logged and waited
    out, and the first legitimate stream after the flood goes through."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(tmp_path / "rx"), "16"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(SERVICE)})
    out: list[str] = []
    try:
        port, limit = map(int, proc.stdout.readline().split())
        threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
        flood = [clients(port) for _ in range(3 * 16)]  # the kernel queues what accept() cannot take
        until(lambda: len(os.listdir(f"/proc/{proc.pid}/fd")) >= limit, 10, "the receiver to run out of fds")
        time.sleep(1.0)  # several failed accept() calls, each one an end of the port before
        for s in flood:
            s.close()
        reply = _send(_images(tmp_path / "src", 1 * MiB), port, "after-the-flood", timeout_s=15)
        assert reply["bytes"] == 1 * MiB
        assert (tmp_path / "rx" / "after-the-flood" / "pages-1.img").stat().st_size == 1 * MiB
    finally:
        end_stdin_child(proc)
    assert proc.returncode == 0, "".join(out)
    errors = [ln for ln in out if "cannot accept" in ln]
    assert errors and "EMFILE" in errors[0], "".join(out)


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_slow_senders_are_closed_at_the_greeting_deadline(tmp_path, ports, clients):
    """40 peers each send their hello a byte at a time, well inside the per-read timeout: each
    is closed once the greeting deadline has passed, counted from its connect; meanwhile and
    after, a legitimate stream goes through."""
    greeting_s = 1.5
    port = ports(greeting_s=greeting_s, idle_timeout_s=30.0, per_source_greeting=64, per_source=64,
                 **_fake_slots(tmp_path / "rx"))  # all from one address: this test is about the deadline
    slow = {clients(port.port): time.monotonic() for _ in range(40)}
    sel = selectors.DefaultSelector()
    for s in slow:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    closed: dict[socket.socket, tuple[float, bytes]] = {}
    prefix = b'{"image_id": "x", "token": "'
    said = {s: b"" for s in slow}
    try:
        sent = 0
        end = time.monotonic() + greeting_s + 5
        while len(closed) < len(slow) and time.monotonic() < end:
            for s in slow:  # one byte each, every 0.2 s
                if s not in closed:
                    try:
                        s.send(prefix[sent:sent + 1] if sent < len(prefix) else b"a")
                    except OSError:
                        pass
            sent += 1
            for key, _ in sel.select(0.2):
                s = key.fileobj
                try:
                    b = s.recv(4096)
                except ConnectionResetError:
                    b = b""
                said[s] += b
                if not b:
                    closed[s] = (time.monotonic() - slow[s], said[s])
                    sel.unregister(s)
    finally:
        sel.close()
    assert len(closed) == len(slow), f"{len(slow) - len(closed)} slow senders still connected"
    times = sorted(t for t, _ in closed.values())
    assert greeting_s - 0.1 <= times[0] and times[-1] <= greeting_s + 1.5, times
    assert all(b"deadline_exceeded" in what for _, what in closed.values())
    assert _send(_images(tmp_path / "src", 1 * MiB), port.port, "legit")["bytes"] == 1 * MiB
    until(lambda: port.connections == (0, 0), 5, "every connection to be released")


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_tls_handshake_sent_a_byte_at_a_time_ends_at_the_greeting_deadline(tmp_path, ports, clients, monkeypatch):
    """With TLS the greeting starts with the handshake, whose reads the per-read timeout bounded
    one by one: a ClientHello trickled in never ended.  The deadline covers it too; an agent with
    its certificate still streams."""
    from pitstop import tls

    tls.init_ca(tmp_path / "pki")
    crt, key = tls.issue(tmp_path / "pki", "rx", ["127.0.0.1"], role="agent")
    for k, v in {"PITSTOP_TLS_CA": tmp_path / "pki" / "ca.pem", "PITSTOP_TLS_CERT": crt, "PITSTOP_TLS_KEY": key}.items():
        monkeypatch.setenv(k, str(v))
    greeting_s = 1.5
    port = ports(greeting_s=greeting_s, idle_timeout_s=30.0, **_fake_slots(tmp_path / "rx"))
    s = clients(port.port)
    t0 = time.monotonic()
    s.sendall(b"\x16\x03\x01\x02\x00")  # a handshake record of 512 bytes, then a byte every 0.2 s
    s.settimeout(0.2)
    gone = None
    while gone is None and time.monotonic() - t0 < greeting_s + 5:
        try:
            s.send(b"\x01")
            gone = time.monotonic() - t0 if s.recv(4096) == b"" else None
        except TimeoutError:
            continue
        except OSError:
            gone = time.monotonic() - t0
    assert gone is not None, "the trickled handshake still holds its connection"
    assert greeting_s - 0.1 <= gone <= greeting_s + 1.5, gone
    assert _send(_images(tmp_path / "src", 1 * MiB), port.port, "over-tls")["bytes"] == 1 * MiB


@pytest.mark.timeout(60)
def test_connections_past_the_caps_are_refused_at_once(tmp_path, ports, clients):
    """The port holds at most `max_greeting` connections that have not greeted, and
    `max_connections` in all: one more is told the port is busy and closed, without a thread."""
    port = ports(greeting_s=30.0, idle_timeout_s=30.0, max_greeting=4, max_connections=5,
                 **_fake_slots(tmp_path / "rx"))
    idle = [clients(port.port) for _ in range(4)]
    until(lambda: port.connections == (4, 4), 5, "four connections greeting")
    took, said = _closed_by_peer(clients(port.port), 5)
    assert took < 1.0 and b"data_port_busy" in said and b"not said who they are" in said

    for s in idle[1:]:
        s.close()
    until(lambda: port.connections == (1, 1), 5, "three greetings to end")
    for i in range(4):  # authenticated receptions, waiting for their frames
        assert _greet(clients(port.port), f"img-{i}")["ok"]
    until(lambda: port.connections == (5, 1), 5, "five connections open")
    took, said = _closed_by_peer(clients(port.port), 5)
    assert took < 1.0 and b"data_port_busy" in said and b"5 connections open" in said
    threads = [t for t in threading.enumerate() if t.name == "dataport-conn"]
    assert len(threads) == 5, "a refused connection must not cost a thread"


@pytest.mark.timeout(60)
def test_one_source_cannot_lock_the_port_for_another(tmp_path, ports, clients):
    """The audit's M2: 70 silent connections locked the data port for the next real sender.  One
    address may hold only its share of the greeting connections: past it, that address alone is
    refused, and a stream from another host goes through."""
    port = ports(greeting_s=30.0, idle_timeout_s=30.0, per_source_greeting=3, per_source=5,
                 **_fake_slots(tmp_path / "rx"))
    [clients(port.port, "127.0.0.2") for _ in range(3)]
    until(lambda: port.connections == (3, 3), 5, "three connections greeting")
    took, said = _closed_by_peer(clients(port.port, "127.0.0.2"), 5)
    assert took < 1.0 and b"data_port_busy" in said and b"from 127.0.0.2" in said
    got = _send(_images(tmp_path / "src", 1 << 20), port.port, "img-a")
    assert got["bytes"] > 0, "another host's stream goes through"
    for i in range(2):  # greeted connections count toward the address's whole share
        assert _greet(clients(port.port, "127.0.0.3"), f"img-{i}")["ok"]
    [clients(port.port, "127.0.0.3") for _ in range(3)]
    until(lambda: port.connections == (8, 6), 5, "five from 127.0.0.3")
    took, said = _closed_by_peer(clients(port.port, "127.0.0.3"), 5)
    assert took < 1.0 and b"5 connections open from 127.0.0.3" in said


# -- finding 7: peers holding the token ------------------------------------------------------------

def _header(kind: bytes, n: int) -> bytes:
    """A frame header announcing `n` bytes (of a file named a.img where the frame names one)."""
    name = b"a.img"
    if kind == b"D":
        return b"D" + struct.pack("!HQI", len(name), 0, n) + name
    if kind == b"C":
        return b"C" + struct.pack("!HQIHQ", len(name), 0, n, len(name), 0) + name + name
    if kind == b"Z":
        return b"Z" + struct.pack("!HQII", len(name), 0, n, n) + name
    return kind + struct.pack("!I", n)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind,limit", [(b"D", MAX_PIECE), (b"C", MAX_PIECE), (b"Z", MAX_PIECE),
                                        (b"M", MAX_MANIFEST), (b"E", MAX_MANIFEST)])
def test_a_frame_larger_than_any_sender_sends_is_refused_before_it_is_buffered(tmp_path, kind, limit):
    """A header announcing 4 GiB is refused as it is parsed: nothing of the frame is kept, or
    written, first (an M frame's body was buffered whole, however long it said it was)."""
    rx = StreamReceiver(tmp_path / "rx")
    body = bytes(8 * MiB)
    tracemalloc.start()
    try:
        with pytest.raises(TransferFailed, match=f"at most {limit}"):
            rx.feed(_header(kind, 0xFFFF_FFFF))
            rx.feed(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        rx.close()
    assert peak < MiB, f"{peak} bytes allocated for a refused frame"
    assert not (tmp_path / "rx" / "a.img").exists() or (tmp_path / "rx" / "a.img").stat().st_size == 0


@pytest.mark.timeout(30)
def test_the_data_port_answers_an_oversized_frame_at_once(tmp_path, ports, clients):
    """The same over a socket: the refusal comes before any byte of the announced body is sent."""
    port = ports(**_fake_slots(tmp_path / "rx"))
    s = clients(port.port)
    assert _greet(s, "huge")["ok"]
    s.sendall(_header(b"M", 0xFFFF_FFF0))
    took, said = _closed_by_peer(s, 5)
    assert took < 2.0
    err = json.loads(said)
    assert err["error"]["code"] == "transfer_failed" and "at most" in err["error"]["message"], err
    until(lambda: port.connections == (0, 0), 5, "the connection to be released")


@pytest.mark.timeout(60)
def test_a_reception_that_would_fill_the_image_directory_fails_with_507(tmp_path, dest, ports):
    """The image directory's file system may keep no less than the reserve free: a stream that
    would take more fails at the piece that would cross it, with 507 and what to do, and its
    partial copy is discarded."""
    images = tmp_path / "images"
    images.mkdir(parents=True)
    st = os.statvfs(images)
    room = 16 * MiB  # what the reserve leaves of what is free now
    d = dest(image_free_reserve_mb=(st.f_bavail * st.f_frsize - room) // MiB)
    port = ports(**_agent_slots(d))
    with pytest.raises(TransferFailed) as e:
        _send(_images(tmp_path / "src", 64 * MiB), port.port, "too-big")
    err = e.value
    assert err.details["status"] == 507 and err.details["code"] == "destination_storage", err
    assert "not enough space" in err.message and "PITSTOP_AGENT_IMAGE_FREE_RESERVE_MB" in err.message
    assert "free space" in err.action
    slot = d.slots["too-big"]
    assert slot.state == "failed" and not slot.directory.exists()
    assert slot.receiver.received <= room + 2 * MiB, "written past the reserve"


@pytest.mark.timeout(60)
def test_receptions_past_the_agents_limit_are_refused(tmp_path, dest, ports, clients):
    """Two receptions under way, the limit: a third is refused (503, what to do); once one has
    ended, the next is received."""
    d = dest(max_receptions=2)
    port = ports(**_agent_slots(d))
    held = [clients(port.port) for _ in range(2)]
    for i, s in enumerate(held):
        assert _greet(s, f"held-{i}")["ok"]
    src = _images(tmp_path / "src", 1 * MiB)
    with pytest.raises(TransferFailed) as e:
        _send(src, port.port, "third")
    assert e.value.details == {"status": 503, "code": "too_many_receptions"}
    assert "PITSTOP_AGENT_MAX_RECEPTIONS" in e.value.action
    held[0].close()
    until(lambda: d.slots["held-0"].state == "failed", 5, "the first reception to end")
    assert _send(src, port.port, "fourth")["bytes"] == 1 * MiB


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_trickling_reception_ends_at_its_deadline(tmp_path, dest, ports, clients):
    """A peer with the token sends a valid stream a byte every 0.2 s, inside the per-read
    timeout: the reception fails at dump_timeout_s + transfer_timeout_s from its hello (the
    source streams while it dumps), and its copy goes."""
    d = dest(dump_timeout_s=1, transfer_timeout_s=0.5)
    port = ports(idle_timeout_s=30.0, **_agent_slots(d))
    s = clients(port.port)
    assert _greet(s, "trickle")["ok"]
    t0 = time.monotonic()
    frame = _header(b"D", 1 * MiB)
    answer = b""
    s.settimeout(0.2)
    for i in range(40):
        try:
            s.send(frame[i:i + 1] if i < len(frame) else b"\0")
            answer += s.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            break
        if answer.endswith(b"\n"):
            break
    took = time.monotonic() - t0
    err = json.loads(answer)
    assert err["status"] == 504 and err["error"]["code"] == "deadline_exceeded", err
    assert "PITSTOP_AGENT_TRANSFER_TIMEOUT_S" in err["error"]["action"]
    assert 1.0 <= took <= 3.5, took
    assert d.slots["trickle"].state == "failed" and not d.slots["trickle"].directory.exists()


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_trickling_http_upload_ends_at_its_deadline(tmp_path):
    """The same on the agent's HTTP fallback (PUT /v1/images/{id}): uvicorn never times out a
    body that trickles in; the route does, at dump_timeout_s + transfer_timeout_s, with a 504."""
    import uvicorn

    from pitstop.agent.agent import Agent
    from pitstop.agent.api import peer_app

    s = AgentSettings(name="rx", state_dir=tmp_path / "state", image_dir=tmp_path / "images", cluster_token=TOKEN,
                      image_mount=False, dump_timeout_s=1, transfer_timeout_s=0.5)
    agent = Agent(s)
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(peer_app(agent), log_level="warning", lifespan="off"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    c = None
    try:
        until(lambda: server.started, 10, "the agent's HTTP server to start")
        c = socket.create_connection(sock.getsockname(), timeout=0.2)
        c.sendall(b"PUT /v1/images/trickle HTTP/1.1\r\nHost: rx\r\nAuthorization: Bearer " + TOKEN.encode()
                  + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
        t0 = time.monotonic()
        frame = _header(b"D", 1 * MiB)
        answer = b""
        for i in range(40):
            try:
                c.sendall(b"1\r\n" + (frame[i:i + 1] if i < len(frame) else b"\0") + b"\r\n")
                answer += c.recv(65536)
            except TimeoutError:
                continue
            if b"\r\n\r\n" in answer:
                break
        took = time.monotonic() - t0
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 504"), answer
        c.settimeout(5)
        while not body.rstrip().endswith(b"}"):
            body += c.recv(65536)
        assert json.loads(body)["error"]["code"] == "deadline_exceeded"
        assert 1.0 <= took <= 3.5, took
        assert agent.dest.slots["trickle"].state == "failed"
        assert not agent.dest.slots["trickle"].directory.exists()
    finally:
        if c is not None:
            c.close()
        server.should_exit = True
        t.join(10)
        sock.close()
