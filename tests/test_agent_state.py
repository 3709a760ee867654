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

    s._loaded -= st.ENDED_WORKER_UNREAD_S + 1  # an hour on: nobody has read them since
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


@pytest.mark.slow
def test_kept_pre_copies_expire_from_one_sweeper_that_holds_none_a_move_has_taken(tmp_path):
    """A kept pre-copy goes after precopy_keep_s unless its move takes it first; the sweeper is one
    thread for all of them and holds each by a weak reference (a timer thread per pre-copy kept
    every one, and a sleeping thread, for 15 minutes after its move had used it)."""
    import gc
    import threading
    import time
    import weakref

    from pitstop.agent.dumper import Dumper
    from pitstop.agent.page_sources import PageSources
    from pitstop.agent.precopies import PreCopies
    from pitstop.agent.sending import ImageSender
    from pitstop.agent.settings import AgentSettings
    from pitstop.memory.precopy import Basis

    s = AgentSettings(state_dir=tmp_path / "s", image_dir=tmp_path / "i", precopy_keep_s=1.0)
    state = AgentState(tmp_path)
    src = PreCopies(s, state, ImageSender(s), PageSources(s, state), Dumper(s))
    kept = tmp_path / "pre-a"
    kept.mkdir()
    threads = threading.active_count()
    with src.state.lock:
        for k in ("a", "b", "c"):
            src.bases[k] = Basis(worker_id="job.0", tasks={}, local=kept if k == "a" else tmp_path / f"pre-{k}")
            src._expire_later(k, src.bases[k])
    assert threading.active_count() == threads + 1  # one sweeper, not one thread per pre-copy
    taken = weakref.ref(src.bases.pop("b"))  # a move took it and is done with it
    gc.collect()
    assert taken() is None  # nothing of the expiry kept it alive
    deadline = time.monotonic() + 10
    while ("a" in src.bases or src._expiring) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "a" not in src.bases and not kept.exists()  # expired: its kept copy deleted
    assert not src._expiring
    while src._sweeper is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    assert src._sweeper is None and threading.active_count() == threads  # nothing left to watch: it ended
