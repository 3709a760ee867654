"""What a standby coordinator answers (coordinator/leadership.py): reads from the shared database,
and, to anything that would act (a write, a heartbeat, a read that reaches an agent), the leader's
URL instead.

A plain ASGI middleware in front of the routes, so that no route has to know: `503 not_leader`,
the leader in `details.leader` and in the `X-Pitstop-Leader` header, for the client to follow
(wire/coordinator_client.py, the agents' heartbeats).  Why 503 and not a redirect: a 307 would
make every HTTP client resend a POST by itself, including ones that do not know the leader may
change between the two requests; the clients that follow do so on purpose, and a plain one sees a
clear error saying where to go.  While the lease is between leaders (the last one lost, no new
one yet) `leader` is null: the client waits and asks again.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

LEADER_HEADER = "x-pitstop-leader"
READS = ("GET", "HEAD")
AGENT_READS = ("/v1/workers/",)  # reads that reach an agent (a worker's output): the leader's to make


def answers_on_standby(method: str, path: str) -> bool:
    """Whether a standby serves this request itself: reads of the database only."""
    return method in READS and not path.startswith(AGENT_READS)


class LeaderGate:
    """ASGI middleware: passes everything through while this coordinator leads; on a standby, the
    reads, and `not_leader` for the rest."""

    def __init__(self, app: Callable, *, view: Callable[[], dict[str, Any] | None]) -> None:
        """view(): None while this coordinator leads (or leads alone), else the lease as it knows
        it (Leadership.view)."""
        self.app = app
        self._view = view

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or answers_on_standby(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        v = self._view()
        if v is None:
            await self.app(scope, receive, send)
            return
        leader = v.get("leader") if v.get("leader") != v.get("this") else None
        body = json.dumps({"error": {
            "code": "not_leader",
            "message": f"this coordinator ({v.get('this')}) is a standby: "
                       + (f"{leader} leads (term {v.get('term')})" if leader else "no coordinator leads at this moment "
                          "(a new leader takes over within seconds)"),
            "action": (f"send the request to {leader}; give every coordinator's URL (PITSTOP_COORDINATOR="
                       "URL1,URL2) and pitstop's clients find the leader themselves") if leader else
                      "send it again in a few seconds",
            "details": {"leader": leader, "term": v.get("term"), "this": v.get("this")}}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"retry-after", b"1")]
        if leader:
            headers.append((LEADER_HEADER.encode(), leader.encode()))
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})
