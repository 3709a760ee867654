"""Pausing and resuming a job's peers in one call per agent (the coordinator's pause round).

Real agent, real processes: the batch stops every process of every named worker's tree, or,
if one name is wrong, none of them.  And a coordinator facing an older agent that lacks the
batch call still pauses, one call per worker.
"""

from __future__ import annotations

import os
import sys

import httpx
import pytest

from pitstop.errors import PitstopError
from pitstop.proc import proctree
from pitstop.wire.agent_client import AgentClient

from .helpers import WORKLOADS, until

pytestmark = [pytest.mark.timeout(120)]

SLEEPER = [sys.executable, str(WORKLOADS / "sleeper.py"), "60"]


def _stopped(root: int) -> list[bool]:
    return [proctree.state(p) == "T" for p in proctree.tree(root)]


def _schedule(pid: int) -> set[tuple[int, int]]:
    """(scheduling policy, nice) of every thread of pid: stat fields 41 and 19."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        f = proctree._stat_fields(pid, f"/proc/{pid}/task/{tid}/stat")
        if f:
            out.add((int(f[38]), int(f[16])))
    return out


def _back_to_own(agent_pid: int, before: set[tuple[int, int]]) -> None:
    """The batch calls answer with the event loop's thread on SCHED_FIFO and put it back once
    the answer is sent, which is just after the client has it."""
    until(lambda: _schedule(agent_pid) == before, what="every agent thread back to its own policy and nice")


@pytest.mark.e2e
def test_batch_pause_is_all_or_nothing_and_resume_undoes_it(cluster):
    a = cluster.start_agent("a")
    ranks = cluster.start_job("idle", SLEEPER, 3, {0: "a", 1: "a", 2: "a"})
    c = a.client()
    roots = {f"idle.{r}": cluster.wait_registered("a", f"idle.{r}").root_pid for r in range(3)}
    own = _schedule(a.proc.pid)
    if os.geteuid() == 0:
        assert own == {(os.SCHED_OTHER, -10)}  # the agent's default priority, every thread

    # One unknown name: refused, and no process of the others was stopped.
    with pytest.raises(PitstopError) as e:
        c.pause_many(["idle.0", "idle.9"])
    assert e.value.http_status == 404 and "idle.9" in e.value.message
    assert not any(_stopped(roots["idle.0"])) and c.worker("idle.0").state == "running"
    _back_to_own(a.proc.pid, own)  # a refused call gives its boost back too

    # Two workers in one call: every process of both trees stops; the third runs on.
    got = c.pause_many(["idle.0", "idle.1", "idle.0"])
    assert [w.id for w in got] == ["idle.0", "idle.1"] and {w.state for w in got} == {"paused"}
    for wid in ("idle.0", "idle.1"):
        until(lambda: all(_stopped(roots[wid])), what=f"{wid} stopped")
    assert not any(_stopped(roots["idle.2"])) and c.worker("idle.2").state == "running"
    _back_to_own(a.proc.pid, own)

    # The shim's blocks of several workers in one read; an unknown one fails the read.
    blocks = c.shim_blocks_many(["idle.0", "idle.2"])
    assert set(blocks) == {"idle.0", "idle.2"}
    assert blocks["idle.2"] == c.shim_blocks("idle.2") and blocks["idle.0"] == c.shim_blocks("idle.0")
    with pytest.raises(PitstopError) as e:
        c.shim_blocks_many(["idle.0", "nope"])
    assert e.value.http_status == 404 and "nope" in e.value.message

    # A worker that has ended cannot be paused: the call is refused and changes nothing.
    ranks[2].proc.kill()
    ranks[2].proc.wait(30)
    until(lambda: c.worker("idle.2").state in ("exited", "lost"), what="idle.2 ended")
    with pytest.raises(PitstopError) as e:
        c.pause_many(["idle.2"])
    assert e.value.http_status == 409 and "nothing was paused" in e.value.message

    # Resume is idempotent: paused ones run again, a running or ended one is left as it is.
    got = c.resume_many(["idle.0", "idle.1", "idle.2"])
    assert [w.state for w in got][:2] == ["running", "running"]
    for wid in ("idle.0", "idle.1"):
        until(lambda: not any(_stopped(roots[wid])), what=f"{wid} running")
    c.resume_many(["idle.0"])
    assert c.worker("idle.0").state == "running"
    _back_to_own(a.proc.pid, own)
    for r in ranks[:2]:
        r.proc.kill()
        r.proc.wait(30)


def _fake_agent(batch_route: bool, calls: list[str]) -> AgentClient:
    def handle(req: httpx.Request) -> httpx.Response:
        calls.append(f"{req.method} {req.url.path}")
        path = req.url.path
        if path.startswith("/v1/workers:batch"):  # batchPause, batchResume, batchGetShim
            if not batch_route:  # how an older agent's router answers an unknown path
                return httpx.Response(404, json={"error": {"code": "http_404", "message": "Not Found"}})
            return httpx.Response(404, json={"error": {"code": "not_found", "message": "no worker 'x'"}})
        if path.endswith("/shim"):
            return httpx.Response(200, json={"blocks": [{"token": path.split("/")[3]}]})
        wid = path.rsplit("/", 1)[1].split(":")[0]
        return httpx.Response(200, json={"id": wid, "job": "j", "rank": 0, "root_pid": 1, "start_time": 0,
                                         "state": "paused"})

    c = AgentClient("http://agent")
    c.http = httpx.Client(base_url="http://agent", transport=httpx.MockTransport(handle))
    return c


def test_an_agent_without_the_batch_call_gets_one_call_per_worker():
    calls: list[str] = []
    got = _fake_agent(False, calls).pause_many(["j.0", "j.1"])
    assert [w.id for w in got] == ["j.0", "j.1"]
    assert calls == ["POST /v1/workers:batchPause", "POST /v1/workers/j.0:pause", "POST /v1/workers/j.1:pause"]


def test_an_unknown_worker_is_not_mistaken_for_an_older_agent():
    calls: list[str] = []
    with pytest.raises(PitstopError) as e:
        _fake_agent(True, calls).pause_many(["x", "j.1"])
    assert e.value.code == "not_found" and calls == ["POST /v1/workers:batchPause"]


def test_shim_blocks_from_an_agent_without_the_batch_read_come_one_call_each():
    calls: list[str] = []
    got = _fake_agent(False, calls).shim_blocks_many(["j.0", "j.1"])
    assert got == {"j.0": [{"token": "j.0"}], "j.1": [{"token": "j.1"}]}
    assert calls == ["GET /v1/workers:batchGetShim", "GET /v1/workers/j.0/shim", "GET /v1/workers/j.1/shim"]
