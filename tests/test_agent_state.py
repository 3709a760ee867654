"""The agent's state forgets what has ended, and only that (agent/state.py).

Every change rewrites the whole state file, several times inside a move's pause, so a state
that keeps every capture it ever made slows every later pause.  What may never be forgotten:
a capture that a rollback or commit still needs (dumping, dumped, sent, released), a worker
with a process, and a moved worker whose launcher still follows it."""

from __future__ import annotations

import json

import pytest

from pitstop.agent import state as st
from pitstop.agent.state import AgentState, Capture, Worker


def _cap(i: int, state: str) -> Capture:
    return Capture(id=f"cap-{i:05d}", worker_id=f"job.{i}", state=state, image_dir=f"/img/{i}", updated=1000.0 + i)


def _worker(i: int, state: str) -> Worker:
    return Worker(id=f"job.{i}", job="job", rank=i, root_pid=100 + i, start_time=1, state=state,
                  registered_at=1000.0 + i)


def test_ended_captures_beyond_the_newest_are_forgotten_and_open_ones_never(tmp_path):
    s = AgentState(tmp_path)
    n = 5 * st.KEEP_ENDED
    for i in range(n):
        s.captures[f"cap-{i:05d}"] = _cap(i, ("committed", "rolled_back", "failed")[i % 3])
    open_states = ("dumping", "dumped", "sent", "released")
    for j, state in enumerate(open_states):  # the oldest of all: age does not matter for these
        s.captures[f"open-{j}"] = _cap(j, state).model_copy(update={"id": f"open-{j}", "updated": 1.0})
    s.save()
    kept = set(json.loads(s.path.read_text())["captures"])
    assert {f"open-{j}" for j in range(len(open_states))} <= kept
    ended = sorted(k for k in kept if k.startswith("cap-"))
    assert ended == [f"cap-{i:05d}" for i in range(n - st.KEEP_ENDED, n)]  # the newest, by last change
    assert AgentState(tmp_path).captures.keys() == s.captures.keys()  # what a restarted agent loads


def test_an_ended_worker_is_forgotten_only_once_nobody_reads_it(tmp_path):
    forgotten: list[str] = []
    s = AgentState(tmp_path)
    s.on_forget = lambda w: forgotten.append(w.id)
    n = 3 * st.KEEP_ENDED
    for i in range(n):
        s.workers[f"job.{i}"] = _worker(i, ("moved", "exited", "lost")[i % 3])
    s.workers["job.run"] = _worker(n, "running").model_copy(update={"id": "job.run", "registered_at": 0.0})
    s.workers["job.rel"] = _worker(n, "released").model_copy(update={"id": "job.rel", "registered_at": 0.0})
    s.save()
    assert len(s.workers) == n + 2 and forgotten == []  # all of them were read "now" (loaded or created)

    s._loaded -= st.UNREAD_S + 1  # an hour on: nobody has read them since
    s.read("job.0")  # but a launcher still follows the oldest, a moved worker
    s.save()
    assert "job.0" in s.workers and {"job.run", "job.rel"} <= set(s.workers)
    gone = {f"job.{i}" for i in range(1, n - st.KEEP_ENDED)}
    assert set(forgotten) == gone and not gone & set(s.workers)
    assert {f"job.{i}" for i in range(n - st.KEEP_ENDED, n)} <= set(s.workers)  # the newest stay anyway
    assert set(json.loads(s.path.read_text())["workers"]) == set(s.workers)


@pytest.mark.parametrize("history", [0, 2000])
def test_the_state_file_stays_small_whatever_the_history(tmp_path, history):
    s = AgentState(tmp_path)
    for i in range(history):
        s.captures[f"cap-{i:05d}"] = _cap(i, "committed")
    c = _cap(history, "dumping").model_copy(update={"id": "now"})
    s.captures["now"] = c
    s.update_capture(c, state="sent")
    raw = json.loads(s.path.read_text())
    assert "now" in raw["captures"] and len(raw["captures"]) <= st.KEEP_ENDED + 1
