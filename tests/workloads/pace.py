"""The sleep between two steps of a test workload, which a test can change while the job runs.

A test keeps a job running slowly while it needs the job alive (a move, a second move), then
writes 0 to the pace file so that the remaining steps run at full speed (tests/helpers.py,
let_finish). The sleep never touches what the job computes, so its result is the same."""

from __future__ import annotations

import time


def pause(step_sleep: float, pace_file: str | None) -> None:
    """Sleep step_sleep, or the number in pace_file once that file exists."""
    seconds = step_sleep
    if pace_file:
        try:
            with open(pace_file) as f:
                seconds = float(f.read().strip() or 0)
        except (OSError, ValueError):
            pass
    if seconds:
        time.sleep(seconds)
