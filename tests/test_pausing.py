"""Pausing workers (coordinator/pausing.py): a job's hold runs every step's way back, last first,
whatever failed before; a silent host is skipped and said so; the failures are reported per host,
not raised.  Stopping and resuming is one call per host, and a resume tries every host."""

from __future__ import annotations

from pitstop.coordinator import pausing
from pitstop.coordinator.pausing import JobHold
from pitstop.errors import PitstopError
from pitstop.wire.worker_report import WorkerReport


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


class _Agent:
    """One host's agent: stops and resumes what it is asked, timing each, or refuses."""

    def __init__(self, host: str, calls: list, refuse_resume: bool = False) -> None:
        self.host, self.calls, self.refuse = host, calls, refuse_resume

    def pause_many(self, ids: list[str], deadline_s: float | None = None) -> list[WorkerReport]:
        self.calls.append((self.host, "pause", tuple(ids), deadline_s))
        return [_report(w, paused_at=100.0 + len(self.calls)) for w in ids]

    def resume_many(self, ids: list[str]) -> list[WorkerReport]:
        self.calls.append((self.host, "resume", tuple(ids)))
        if self.refuse:
            raise PitstopError("agent gone", action="none")
        return [_report(w, running_since=200.0) for w in ids]


def _report(wid: str, **at: float) -> WorkerReport:
    return WorkerReport(id=wid, job="j", rank=int(wid.split(".")[1]), root_pid=1, start_time=0, **at)


def test_stop_is_one_call_per_host_with_its_deadline_and_its_way_back_on_the_hold():
    calls: list = []
    agents = {h: _Agent(h, calls) for h in ("a", "b")}
    hold = JobHold(heard=lambda h: True)
    at = pausing.stop(agents.__getitem__, {"a": ["j.0", "j.1"], "b": ["j.2"]}, 65.0, hold)
    assert sorted(calls) == [("a", "pause", ("j.0", "j.1"), 65.0), ("b", "pause", ("j.2",), 65.0)]
    assert set(at) == {"j.0", "j.1", "j.2"} and all(t > 100 for t in at.values())
    calls.clear()
    assert hold.release() == []
    assert sorted(calls) == [("a", "resume", ("j.0", "j.1")), ("b", "resume", ("j.2",))]


def test_resume_tries_every_host_and_names_each_that_failed():
    calls: list = []
    agents = {"a": _Agent("a", calls, refuse_resume=True), "b": _Agent("b", calls), "c": _Agent("c", calls)}
    got = pausing.resume(agents.__getitem__, {"a": ["j.0"], "b": ["j.1"], "c": ["j.2", "j.3"]})
    assert sorted(c[0] for c in calls) == ["a", "b", "c"], "one failure stops no other host's resume"
    assert got.problems == ["a (j.0): agent gone"]
    assert got.running_since == {"j.1": 200.0, "j.2": 200.0, "j.3": 200.0}
