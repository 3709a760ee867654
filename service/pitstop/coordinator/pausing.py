"""What the coordinator did to a job's ranks on their hosts (stopped them, parked them at the NCCL
cut, locked their networks), each with its way back on one undo stack (pitstop/undo.py).

Why: a snapshot pauses every rank of a job across all its hosts, and whatever happens next (a
dump that fails, a host that goes silent, this thread's own error) the job must run again.  The
way back used to be rebuilt by hand in a `finally` from lists of which hosts had been paused and
locked; here each step pushes its own undo as it takes effect, and `release` runs them all, last
first: every host is unlocked and resumed even if one fails, and a host that went silent is
skipped (no answer would come; its agent isolates its ranks by itself), each said in what it
returns."""

from __future__ import annotations

from collections.abc import Callable

from pitstop.errors import PitstopError
from pitstop.undo import Undo

_RELEASED = Exception("the job's pause is over")  # why the hold is unwound: always, at its end


class JobHold:
    def __init__(self, heard: Callable[[str], bool]) -> None:
        self._heard = heard
        self._undo = Undo(resumed_by="the coordinator, as the job's pause ends")
        self._problems: list[str] = []

    def did(self, what: str, way_back: Callable[[], object], host: str | None = None) -> None:
        """A step took effect (on `host`, where it concerns one host): `way_back` undoes it."""
        def undo(e: BaseException) -> None:
            if host is not None and not self._heard(host):  # no answer would come; the others wait for none
                self._problems.append(f"{host}: silent, skipped (an agent cut off isolates its snapshot jobs' ranks)")
                return
            try:
                way_back()
            except PitstopError as err:
                self._problems.append(f"{host or what}: {err.message}")
        self._undo.push(what, undo)

    def release(self) -> list[str]:
        """Undo every step, last first; what could not be undone, per host."""
        self._undo.unwind(_RELEASED)
        return list(self._problems)
