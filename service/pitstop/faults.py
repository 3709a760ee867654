"""Fault-injection hooks, kept in production code and inert there.

A hook fires only when *both* PITSTOP_ENABLE_FAULTS=1 and PITSTOP_FAULTS name it, so a
stray variable cannot turn one on.  PITSTOP_FAULTS is a comma-separated list of
`point=action`; actions: `sleep:SECONDS`, `fail` (raise).  Used by the tests to stop a
process at a precise phase (CRIU's zdtm does the same with its own hooks).
"""

from __future__ import annotations

import os
import time

from .errors import PitstopError


def _table() -> dict[str, str]:
    if os.environ.get("PITSTOP_ENABLE_FAULTS") != "1":
        return {}
    out = {}
    for item in os.environ.get("PITSTOP_FAULTS", "").split(","):
        if "=" in item:
            k, v = item.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def hit(point: str) -> None:
    action = _table().get(point)
    if not action:
        return
    if action.startswith("sleep:"):
        time.sleep(float(action.split(":", 1)[1]))
    elif action == "fail":
        raise PitstopError(f"injected fault at {point}", code="injected_fault", action="this is a test")
