"""Shared HTTP plumbing: errors as JSON problems, bearer-token checks."""

from __future__ import annotations

import collections
import hmac
import json
import time
from collections.abc import Callable
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pitstop.errors import PitstopError, Unauthenticated

log = structlog.get_logger("pitstop.httpapi")

HEADER_TIMEOUT_S = 10.0
"""From a connection's first byte (or its opening) to the end of its request's headers."""


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(PitstopError)
    async def _pitstop(_: Request, e: PitstopError) -> JSONResponse:
        return JSONResponse({"error": e.to_dict()}, status_code=e.http_status)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException) -> JSONResponse:
        """Routing errors (unknown path, wrong method) in the same shape as every other error."""
        action = "send a smaller request" if e.status_code == 413 else "check the method and path against /openapi.json"
        return JSONResponse({"error": {"code": f"http_{e.status_code}", "message": str(e.detail),
                                       "action": action,
                                       "details": {}}}, status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        problems = [f"{'.'.join(str(x) for x in err.get('loc', ()))}: {err.get('msg')}" for err in e.errors()]
        return JSONResponse({"error": {"code": "invalid_request", "message": "invalid request: " + "; ".join(problems),
                                       "action": "fix the request and send it again",
                                       "details": {"problems": problems}}}, status_code=400)


def bearer(request: Request) -> str | None:
    h = request.headers.get("authorization", "")
    return h[7:].strip() if h.lower().startswith("bearer ") else None


def token_matches(request: Request, expected: str | None) -> bool:
    got = bearer(request)
    return bool(got and expected and hmac.compare_digest(got.encode(), expected.encode()))


def require_token(request: Request, expected: str | None, what: str, env: str) -> None:
    """Constant-time check of a bearer token; `expected` None means insecure mode."""
    if expected is None:
        return
    got = bearer(request)
    if not got or not hmac.compare_digest(got.encode(), expected.encode()):
        raise Unauthenticated(f"{'missing' if not got else 'wrong'} {what} token",
                              action=f"send 'Authorization: Bearer <token>' with the value of {env}")


# -- what a request must show before its body is read -----------------------------------------

MAX_BODY = 1 << 20
"""The largest JSON body any route takes (an evacuation with its options, a heartbeat with a few
hundred workers is far less).  Image uploads, the one large body, name their own limit."""

_OPEN = ("/healthz",)


class RequestGuard:
    """ASGI middleware, outermost: a request that carries a body must hold a valid token before a
    byte of that body is read, and no body may exceed its limit.

    Why: FastAPI reads and parses the whole body before a route's dependencies check the token, so
    without this an unauthenticated client could make the service hold a body of any size (an
    agent beside a training job rose from 92 to 523 MB on one 200 MB POST; the kernel's OOM killer
    may then pick the job).  Requests without a body go on to the routes, whose own checks give
    the precise refusal (a read-only token on a mutation, a wrong certificate role)."""

    def __init__(self, app: Any, *, tokens: Callable[[], tuple[str | None, ...]],
                 max_body: int = MAX_BODY, large: Callable[[str, str], int | None] = lambda m, p: None) -> None:
        self.app = app
        self._tokens = tokens   # any of these opens the body; all None: insecure development mode
        self._max = max_body
        self._large = large     # (method, path) -> a route's own larger limit, or None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN:
            return await self.app(scope, receive, send)
        length, chunked, auth = None, False, b""
        for k, v in scope["headers"]:
            if k == b"content-length":
                length = int(v) if v.isdigit() else -1
            elif k == b"transfer-encoding":
                chunked = b"chunked" in v.lower()
            elif k == b"authorization":
                auth = v
        if not chunked and not length:  # no body: the route's own checks apply
            return await self.app(scope, receive, send)
        if not self._authorized(auth):
            return await _refuse(send, 401, "unauthenticated", "a request with a body needs a valid token; "
                                 "its body was not read", "send 'Authorization: Bearer <token>' (PITSTOP_TOKEN "
                                 "for operators, PITSTOP_CLUSTER_TOKEN for agents)")
        limit = self._large(scope["method"], scope["path"]) or self._max
        if length is not None and (length < 0 or length > limit):
            return await _refuse(send, 413, "body_too_large", f"the request body ({length} bytes) exceeds "
                                 f"{limit} bytes", "send a smaller request")
        await self.app(scope, _capped(receive, limit), send)

    def _authorized(self, auth: bytes) -> bool:
        expected = [t for t in self._tokens() if t]
        if not expected:
            return True  # insecure development mode, as the routes
        if auth[:7].lower() != b"bearer ":
            return False
        got = auth[7:].strip()
        return any(hmac.compare_digest(got, t.encode()) for t in expected)


def _capped(receive: Any, limit: int) -> Any:
    """`receive`, failing the request once more than `limit` bytes arrived (a chunked body names
    no length up front)."""
    seen = 0

    async def wrapped() -> dict:
        nonlocal seen
        m = await receive()
        if m["type"] == "http.request":
            seen += len(m.get("body", b""))
            if seen > limit:  # FastAPI passes an HTTPException on as it is (anything else becomes a 400)
                raise HTTPException(413, f"the request body exceeds {limit} bytes")
        return m

    return wrapped


async def _refuse(send: Any, status: int, code: str, message: str, action: str) -> None:
    body = json.dumps({"error": {"code": code, "message": message, "action": action, "details": {}}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


_TOO_MANY = json.dumps({"error": {
    "code": "too_many_connections", "message": "this address holds as many connections to the service as one address "
    "may", "action": "close idle connections (a client needs a few), or raise the service's per-source limit",
    "details": {}}}).encode()


def with_header_deadline(base: type, seconds: float = HEADER_TIMEOUT_S, per_source: int | None = None) -> type:
    """uvicorn's HTTP protocol class, closing a connection whose request line and headers have not
    all arrived `seconds` after its first byte (or after the connection opened), and, with
    `per_source`, answering 503 and closing a connection from an address that already holds that
    many (TCP only; a Unix socket's peers are checked by their credentials).

    Why: uvicorn times out idle keep-alive connections but not a request that trickles in, so
    clients sending a header byte every few seconds could hold connections and their memory
    without ever showing a token (40 such connections were all still open after 75 s).  And its
    concurrency limit is one for all: 4,300 idle connections from one address, renewed inside the
    header deadline, took every slot from the agents' reports, and the coordinator then took the
    silent hosts for dead and recovered a healthy job.  One address gets its share only."""

    class HeaderDeadline(base):  # type: ignore[misc, valid-type]
        _deadline: Any = None
        _source: str | None = None
        by_source: collections.Counter[str] = collections.Counter()  # open connections per address, this server's

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            if per_source is not None and isinstance(peer, tuple) and peer:
                src = str(peer[0])
                if self.by_source[src] >= per_source:
                    _refuse_connection(transport, src, self.by_source[src])
                    return
                self._source = src
                self.by_source[src] += 1
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Any) -> None:
            self._disarm()
            if self._source is not None:
                self.by_source[self._source] -= 1
                if self.by_source[self._source] <= 0:
                    del self.by_source[self._source]
                self._source = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                log.info("closed a connection whose request headers did not arrive in time",
                         peer=self.transport.get_extra_info("peername"), seconds=seconds)
                self.transport.close()

    return HeaderDeadline


_refusals: dict[str, float] = {}


def _refuse_connection(transport: Any, src: str, held: int) -> None:
    """503 and close, before a byte of the request is read; logged at most once a minute per address."""
    transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: " + str(len(_TOO_MANY)).encode() + b"\r\n\r\n" + _TOO_MANY)
    transport.close()
    now = time.monotonic()
    if now - _refusals.get(src, -1e9) >= 60.0:
        _refusals[src] = now
        if len(_refusals) > 4096:
            _refusals.clear()
        log.warning("refused a connection: its address holds its share already", peer=src, held=held)
