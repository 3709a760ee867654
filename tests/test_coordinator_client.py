"""The operators' and launchers' client over several coordinators (wire/coordinator_client.py): a
unit test of which answers move it to the next coordinator and which it asks again."""

from __future__ import annotations

import httpx
import pytest

from pitstop.errors import Unavailable
from pitstop.wire.coordinator_client import CoordinatorClient

A, B = "http://10.0.0.1:7000", "http://10.0.0.2:7000"


def _client(handle) -> tuple[CoordinatorClient, list[str]]:  # noqa: ANN001
    seen: list[str] = []

    def record(req: httpx.Request) -> httpx.Response:
        seen.append(f"{req.method} {req.url.scheme}://{req.url.host}:{req.url.port}")
        return handle(req)

    c = CoordinatorClient(f"{A},{B}", "t", follow_s=2.0)
    c.http = httpx.Client(transport=httpx.MockTransport(record))
    return c, seen


def test_a_read_that_times_out_at_a_stalled_coordinator_is_asked_of_the_next():
    def handle(req: httpx.Request) -> httpx.Response:
        if req.url.host == "10.0.0.1":
            raise httpx.ReadTimeout("timed out", request=req)
        return httpx.Response(200, json=[])

    c, seen = _client(handle)
    assert c.hosts() == []
    assert seen == [f"GET {A}", f"GET {B}"] and c.url == B


def test_a_write_that_timed_out_is_never_sent_again_elsewhere():
    """It may have acted at the first coordinator: the caller is told, nothing is repeated."""
    def handle(req: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=req)

    c, seen = _client(handle)
    with pytest.raises(Unavailable, match="cannot reach the coordinator"):
        c.cordon("h1")
    assert seen == [f"POST {A}"]


def test_a_read_meeting_a_database_restart_is_asked_again_until_it_is_back():
    answers = iter([503, 503, 200])

    def handle(req: httpx.Request) -> httpx.Response:
        code = next(answers)
        if code == 503:
            return httpx.Response(503, json={"error": {"code": "database_unavailable", "message": "restarting"}})
        return httpx.Response(200, json=[{"name": "h1"}])

    c, seen = _client(handle)
    assert c.hosts() == [{"name": "h1"}]
    assert seen == [f"GET {A}"] * 3
