"""Shared HTTP plumbing: errors as JSON problems, bearer-token checks."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .errors import PitstopError, Unauthenticated


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(PitstopError)
    async def _pitstop(_: Request, e: PitstopError) -> JSONResponse:
        return JSONResponse({"error": e.to_dict()}, status_code=e.http_status)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException) -> JSONResponse:
        """Routing errors (unknown path, wrong method) in the same shape as every other error."""
        return JSONResponse({"error": {"code": f"http_{e.status_code}", "message": str(e.detail),
                                       "action": "check the method and path against /openapi.json",
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
