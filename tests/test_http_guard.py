"""No request without a token may make a service hold memory or connections (httpapi.RequestGuard,
with_header_deadline), against the real agent and coordinator processes.

Before the fix, an unauthenticated 200 MB `POST /v1/captures` raised an agent from 92 to 523 MB
(FastAPI reads the body before the token is checked), and 40 connections trickling their headers
a byte at a time all stayed open after 75 s."""

from __future__ import annotations

import json
import os
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

HEADER_TIMEOUT = 2.0


def _addr(url: str) -> tuple[str, int]:
    u = urlsplit(url)
    return u.hostname, u.port


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _answer(s: socket.socket, timeout: float = 10.0) -> tuple[int, dict]:
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body or b"{}")


def _length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def _flood(url: str, path: str, mb: int) -> tuple[int, dict, int]:
    """POST `mb` MB with no token, as an attacker would: headers, then the whole body as fast as
    the server takes it.  Returns the answer and how many body bytes the server took."""
    s = socket.create_connection(_addr(url), timeout=10)
    total = mb << 20
    s.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              f"content-length: {total}\r\n\r\n".encode())
    sent, block = 0, b"{" + b" " * ((1 << 20) - 1)
    try:
        while sent < total:
            sent += s.send(block)
    except OSError:
        pass  # the server answered and closed: what it should do
    status, body = _answer(s)
    s.close()
    return status, body, sent


@pytest.fixture
def services(cluster):
    env = {"PITSTOP_AGENT_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT),
           "PITSTOP_COORDINATOR_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT)}
    coord = cluster.start_coordinator(env=env)
    a = cluster.start_agent("a", env=env)
    assert os.stat(cluster.coordinator_db).st_mode & 0o077 == 0, "the database is the coordinator's alone"
    return {"agent": (a.url, "/v1/captures", a.proc.pid),
            "coordinator": (coord, "/v1/nodes/a:evacuate", cluster.coordinator_proc.pid)}


@pytest.mark.parametrize("service", ["agent", "coordinator"])
def test_a_large_body_without_a_token_is_refused_before_it_is_read(services, service):
    url, path, pid = services[service]
    before = _rss_mb(pid)
    for _ in range(2):
        status, body, sent = _flood(url, path, 200)
        assert status == 401, body
        assert body["error"]["code"] == "unauthenticated" and "not read" in body["error"]["message"]
    grew = _rss_mb(pid) - before
    assert grew < 40, f"{service} grew {grew:.0f} MB on bodies it should never have read"


@pytest.mark.parametrize("service", ["agent", "coordinator"])
def test_a_chunked_body_without_a_token_is_refused(services, service):
    url, path, _ = services[service]
    s = socket.create_connection(_addr(url), timeout=10)
    s.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n".encode())
    status, body = _answer(s)
    s.close()
    assert status == 401 and body["error"]["code"] == "unauthenticated"


def test_a_body_over_the_limit_is_refused_even_with_a_token(services, cluster):
    url, path, _ = services["agent"]
    headers = {"Authorization": f"Bearer {cluster.token}"}
    r = httpx.post(url + path, content=b"{" + b" " * (2 << 20) + b"}", headers=headers, timeout=30)
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"], r.text
    with httpx.Client(timeout=30) as c:  # a chunked one (no length up front) is cut off at the limit
        r = c.post(url + path, content=iter([b"{" + b" " * (1 << 19)] * 4), headers=headers)
    assert r.status_code == 413, r.text
    assert httpx.get(url + "/v1/info", headers=headers, timeout=10).status_code == 200


@pytest.mark.parametrize("service", ["agent", "coordinator"])
def test_connections_that_trickle_their_headers_are_closed_at_the_deadline(services, service, cluster):
    url, path, _ = services[service]
    conns = [socket.create_connection(_addr(url), timeout=10) for _ in range(20)]
    silent = socket.create_connection(_addr(url), timeout=10)  # sends nothing at all
    line = f"GET {path} HTTP/1.1\r\nhost: x\r\nx-slow: ".encode()
    t0 = time.monotonic()
    closed: set[int] = set()
    i = 0
    while len(closed) < len(conns) and time.monotonic() - t0 < HEADER_TIMEOUT + 8:
        for n, s in enumerate(conns):
            if n in closed:
                continue
            try:
                s.send(line[i:i + 1] if i < len(line) else b"a")
            except OSError:
                closed.add(n)
        i += 1
        time.sleep(0.25)
    waited = time.monotonic() - t0
    assert len(closed) == len(conns), f"{len(conns) - len(closed)} slow connections still open after {waited:.1f} s"
    silent.settimeout(HEADER_TIMEOUT + 5)
    assert silent.recv(1) == b"", "a connection that never sent a byte must be closed too"
    for s in [*conns, silent]:
        s.close()
    token = cluster.operator_token if service == "coordinator" else cluster.token
    assert httpx.get(url + "/v1/" + ("hosts" if service == "coordinator" else "info"),
                     headers={"Authorization": f"Bearer {token}"}, timeout=10).status_code == 200
