"""The bearer header every call between pitstop's parts carries (agents, coordinator, operators)."""

from __future__ import annotations


def bearer(token: str | None) -> dict[str, str]:
    """The Authorization header for `token`; none where no token is configured (a test cluster,
    or mutual TLS alone)."""
    return {"Authorization": f"Bearer {token}"} if token else {}
