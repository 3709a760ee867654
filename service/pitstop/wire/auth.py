"""The bearer header every call between pitstop's parts carries (agents, coordinator, operators),
and the handle token that lets a rank's own launcher follow it anywhere."""

from __future__ import annotations

import hashlib
import hmac


def bearer(token: str | None) -> dict[str, str]:
    """The Authorization header for `token`; none where no token is configured (a test cluster,
    or mutual TLS alone)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def handle_token(secret: str | None, wid: str) -> str:
    """The token of one worker's handle: HMAC of its id under the cluster token.  Given to the
    rank's launcher when it registers (over the local socket, so to the rank's own user), it opens
    the coordinator's handle routes for that worker alone (its output, its state, a signal), so
    the launcher follows its rank when the agent it registered with is gone.  Any holder of the
    cluster token can check it without keeping it; it names no other worker and does nothing else."""
    if not secret:
        return ""
    return hmac.new(secret.encode(), b"pitstop-handle\0" + wid.encode(), hashlib.sha256).hexdigest()


def handle_token_ok(secret: str | None, wid: str, got: str | None) -> bool:
    if not secret:
        return True  # insecure development mode, as every route
    return bool(got) and hmac.compare_digest(handle_token(secret, wid).encode(), (got or "").encode())

