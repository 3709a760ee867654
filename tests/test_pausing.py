"""A job's hold (coordinator/pausing.py): every step's way back runs, last first, whatever failed
before; a silent host is skipped and said so; the failures are reported per host, not raised."""

from __future__ import annotations

from pitstop.coordinator.pausing import JobHold
from pitstop.errors import PitstopError


def test_every_way_back_runs_last_first_skipping_silent_hosts_and_saying_what_failed():
    ran: list[str] = []
    hold = JobHold(heard=lambda h: h != "c")

    def step(name: str, fail: bool = False):  # noqa: ANN202
        def way_back() -> None:
            ran.append(name)
            if fail:
                raise PitstopError(f"{name} refused", action="none")
        return way_back

    hold.did("the job's communicators", step("rewire"))
    for h in ("a", "b", "c"):
        hold.did("resume", step(f"resume {h}", fail=h == "a"), host=h)
    for h in ("a", "b", "c"):
        hold.did("unlock", step(f"unlock {h}"), host=h)
    problems = hold.release()
    assert ran == ["unlock b", "unlock a", "resume b", "resume a", "rewire"]
    assert problems == ["c: silent, skipped (an agent cut off isolates its snapshot jobs' ranks)"] * 2 \
        + ["a: resume a refused"]
    assert hold.release() == problems  # released once: nothing runs twice
    assert ran == ["unlock b", "unlock a", "resume b", "resume a", "rewire"]
