"""Errors as values an operator can act on.

Every failure pitstop reports carries a stable machine-readable ``code``, a
``message`` saying what went wrong (quoting the underlying tool where there is
one, e.g. CRIU's own Error lines), and an ``action`` saying what to do about it.
The HTTP layers serialise these unchanged, so the CLI, the REST API and the
logs all tell the same story.
"""

from __future__ import annotations

from typing import Any


class PitstopError(Exception):
    """Base of every error pitstop raises on purpose."""

    http_status: int = 500
    code: str = "internal"

    def __init__(self, message: str, *, action: str = "", code: str | None = None,
                 http_status: int | None = None, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.action = action
        if code:
            self.code = code
        if http_status:
            self.http_status = http_status
        self.details = details or {}

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "action": self.action,
                "details": self.details}

    @classmethod
    def from_dict(cls, d: dict[str, Any], http_status: int = 500) -> "PitstopError":
        """Rebuild the error a peer raised, as its own class where the code names one."""
        code = d.get("code", "internal")
        klass = _by_code().get(code, cls)
        return klass(d.get("message", "unknown error"), action=d.get("action", ""),
                     code=code, http_status=http_status, details=d.get("details") or {})

    def __str__(self) -> str:
        return f"{self.message} ({self.action})" if self.action else self.message


_RPC_CODES = {"invalid_request": (3, "INVALID_ARGUMENT"), "not_found": (5, "NOT_FOUND"), "conflict": (10, "ABORTED"),
              "cancelled": (1, "CANCELLED"), "deadline_exceeded": (4, "DEADLINE_EXCEEDED"),
              "unavailable": (14, "UNAVAILABLE"), "database_unavailable": (14, "UNAVAILABLE"),
              "image_integrity": (15, "DATA_LOSS")}


def rpc_status(e: PitstopError) -> dict[str, Any]:
    """The error as a google.rpc.Status, the shape AIP-151 operations carry in their `error`: the
    code and its name, the message, and pitstop's own code and action in an ErrorInfo detail."""
    code, status = _RPC_CODES.get(e.code, (9, "FAILED_PRECONDITION") if e.http_status == 412 else (13, "INTERNAL"))
    return {"code": code, "status": status, "message": e.message,
            "details": [{"@type": "type.pitstop.dev/ErrorInfo", "reason": e.code, "action": e.action,
                         **({"metadata": e.details} if e.details else {})}]}


class InvalidRequest(PitstopError):
    http_status = 400
    code = "invalid_request"


class Unauthenticated(PitstopError):
    http_status = 401
    code = "unauthenticated"


class Forbidden(PitstopError):
    http_status = 403
    code = "forbidden"


class NotFound(PitstopError):
    http_status = 404
    code = "not_found"


class Conflict(PitstopError):
    http_status = 409
    code = "conflict"


class Unprocessable(PitstopError):
    http_status = 422
    code = "unprocessable"


class FailedPrecondition(PitstopError):
    http_status = 412
    code = "failed_precondition"


class CaptureFailed(PitstopError):
    http_status = 500
    code = "capture_failed"


class RestoreFailed(PitstopError):
    http_status = 500
    code = "restore_failed"


class TransferFailed(PitstopError):
    http_status = 502
    code = "transfer_failed"


class IntegrityError(PitstopError):
    http_status = 422
    code = "image_integrity"


class DeadlineExceeded(PitstopError):
    http_status = 504
    code = "deadline_exceeded"


class Unavailable(PitstopError):
    http_status = 503
    code = "unavailable"


def _by_code() -> dict[str, type[PitstopError]]:
    out: dict[str, type[PitstopError]] = {}
    todo = list(PitstopError.__subclasses__())
    while todo:
        k = todo.pop()
        out.setdefault(k.code, k)
        todo += k.__subclasses__()
    return out
