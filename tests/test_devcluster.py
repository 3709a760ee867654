"""The local cluster's own promises: the ports it picks stay free until used, and a process that
fails to come up says why.

Why these matter: agents start side by side (LocalCluster.starting), so a port chosen for one is
bound only after a second or more of imports, while the others already make connections and bind
data ports.  A port from the kernel's ephemeral range could be taken in between, and the agent
exited with "address in use" (CI, 2026-12-01: one such start in a suite of 369 tests)."""

from __future__ import annotations

import socket

import pytest

from pitstop.dev.devcluster import LocalCluster, _ephemeral_range, free_port

pytestmark = pytest.mark.timeout(60)


def test_ports_come_from_outside_the_ephemeral_range_and_are_not_handed_out_twice():
    lo, hi = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert not [p for p in ports if lo <= p <= hi]


def test_a_chosen_port_stays_free_while_the_kernel_hands_out_thousands_of_others():
    """The race itself: choose, let the kernel give away ports (as outgoing connections and
    bind(0) data ports do), then bind what was chosen.  With ports from bind(0), as before, 13 to 16
    of 50 were gone in three tries."""
    chosen = [free_port() for _ in range(50)]
    taken: list[socket.socket] = []
    try:
        for _ in range(3000):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            taken.append(s)
        lost = []
        for p in chosen:
            try:
                socket.create_server(("127.0.0.1", p)).close()
            except OSError:
                lost.append(p)
        assert not lost, f"ports taken between choosing and binding: {lost}"
    finally:
        for s in taken:
            s.close()


@pytest.mark.e2e
def test_an_agent_that_cannot_start_is_reported_with_its_own_words():
    held = socket.create_server(("127.0.0.1", 0))
    try:
        with LocalCluster() as c:
            with pytest.raises(RuntimeError) as e:
                c.start_agent("host-a", port=held.getsockname()[1])
        msg = str(e.value)
        assert "exited with 1" in msg
        assert f"cannot listen on 127.0.0.1:{held.getsockname()[1]}" in msg, msg
    finally:
        held.close()
