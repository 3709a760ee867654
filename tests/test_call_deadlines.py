"""Calls to an agent that does not answer end: at the client's own timeout when a method is given
none (never httpx's "no timeout at all"), and at once when the host stops reporting
(fanout.while_heard), not at the call's own long deadline."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from pitstop.coordinator.fanout import HostSilent, while_heard
from pitstop.errors import DeadlineExceeded
from pitstop.wire.agent_client import AgentClient

pytestmark = pytest.mark.timeout(60)


def test_a_method_given_no_timeout_keeps_the_clients_own():
    """An agent that accepts the connection and never answers (a host hung, or gone with its
    connections half-open): stop_workers(timeout=None) once waited for ever."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)  # never accepted: the kernel completes the handshake, nobody answers
    try:
        c = AgentClient(f"http://127.0.0.1:{srv.getsockname()[1]}", "t", timeout=0.5)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            c.stop_workers("job", ["job.0"], timeout=None)
        assert time.monotonic() - t0 < 5
    finally:
        srv.close()


def test_a_call_to_a_host_that_goes_silent_is_abandoned():
    release = threading.Event()
    silent_at = time.monotonic() + 0.6
    t0 = time.monotonic()
    with pytest.raises(HostSilent, match="host-b went silent during its dump"):
        while_heard(lambda: release.wait(30), ("spare-1", "host-b"),
                    lambda h: h != "host-b" or time.monotonic() < silent_at, "its dump")
    assert time.monotonic() - t0 < 3
    release.set()


def test_a_call_to_a_host_still_heard_gives_its_result_or_its_error():
    assert while_heard(lambda: (time.sleep(0.7), 42)[1], "host-a", lambda h: True, "x") == 42

    def fails():
        raise ValueError("its own error")
    with pytest.raises(ValueError, match="its own error"):
        while_heard(fails, "host-a", lambda h: True, "x")
