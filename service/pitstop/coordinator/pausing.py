"""Pausing a set of workers across their hosts, and the way back, written once for every
operation: `stop` (SIGSTOP, one call per host, all hosts at once), `resume` (the same way back,
saying which hosts could not be reached), and `JobHold`, what the coordinator did to a job's ranks
(stopped them, parked them at the NCCL cut, locked their networks), each with its way back on
one undo stack (pitstop/undo.py).  The NCCL cut over a set of workers is cut.through_agents.

Who uses what: an evacuation stops its peers and resumes them past the commit point or in its
rollback (its way back is driven from its record, since a restarted coordinator must undo it
too: rollback.py); a snapshot holds the whole job on a JobHold; a recovery resumes every rank it
restored.

Why: a snapshot pauses every rank of a job across all its hosts, and whatever happens next (a
dump that fails, a host that goes silent, this thread's own error) the job must run again.  The
way back used to be rebuilt by hand in a `finally` from lists of which hosts had been paused and
locked; here each step pushes its own undo as it takes effect, and `release` runs them all, last
first: every host is unlocked and resumed even if one fails, and a host that went silent is
skipped (no answer would come; its agent isolates its ranks by itself), each said in what it
returns."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pitstop.coordinator.fanout import in_parallel
from pitstop.errors import PitstopError
from pitstop.undo import Undo
from pitstop.wire.worker_report import WorkerReport

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


class PauseAgent(Protocol):
    """What pausing asks of an agent (wire/agent_client.AgentClient)."""

    def pause_many(self, ids: list[str], deadline_s: float | None = None) -> list[WorkerReport]: ...
    def resume_many(self, ids: list[str]) -> list[WorkerReport]: ...


def stop(agent: Callable[[str], PauseAgent], by_host: dict[str, list[str]], deadline_s: float,
         hold: JobHold | None = None) -> dict[str, float]:
    """Every worker stopped (SIGSTOP): one call per host, all hosts at once (one round trip, not
    one per worker).  deadline_s: past it each agent resumes its workers by itself, should the
    caller be gone.  hold: each host's resume is pushed on it as its stop takes effect.  Each
    worker's stop time (wall clock), as its agent timed it."""
    def one(h: str) -> list[WorkerReport]:
        got = agent(h).pause_many(by_host[h], deadline_s=deadline_s)
        if hold is not None:
            hold.did("resume", functools.partial(agent(h).resume_many, by_host[h]), host=h)
        return got
    return answered_at(in_parallel(one, sorted(by_host)), "paused_at")


@dataclass
class Resumed:
    problems: list[str] = field(default_factory=list)  # "host (workers): why", for each host not resumed
    running_since: dict[str, float] = field(default_factory=dict)  # worker -> when it ran again, as its agent timed it


def resume(agent: Callable[[str], PauseAgent], by_host: dict[str, list[str]]) -> Resumed:
    """Every worker resumed, one call per host, all hosts at once; what went wrong for which host,
    not the first failure only (resuming is idempotent: a caller tries again)."""
    def one(h: str) -> tuple[str | None, list[WorkerReport]]:
        try:
            return None, agent(h).resume_many(by_host[h])
        except PitstopError as e:
            return f"{h} ({', '.join(by_host[h])}): {e.message}", []
    got = in_parallel(one, sorted(by_host))
    return Resumed([p for p, _ in got if p], answered_at([a for _, a in got], "running_since"))


def answered_at(answers: list[list[WorkerReport]], key: Literal["paused_at", "running_since"]) -> dict[str, float]:
    """Each worker's `key` (a wall-clock time its agent wrote) from the agents' answers, where given."""
    return {w.id: at for ws in answers for w in ws if (at := getattr(w, key)) is not None}
