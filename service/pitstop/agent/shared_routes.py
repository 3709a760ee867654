"""What both of the agent's doors answer alike: its info, one worker, a worker's output.

The peer door (peer_routes.py) puts the cluster token in front; the local door (the Unix
socket, whose file mode and SO_PEERCRED guard it; local_routes.py) serves them to `pitstop run`
as they are.  agent/api.py mounts this router on both.
"""

from __future__ import annotations

import httpx
from fastapi import APIRouter, Request, Response

from pitstop.agent import containers, peercred
from pitstop.agent.agent import AgentDep
from pitstop.agent.state import Worker
from pitstop.errors import FailedPrecondition
from pitstop.wire.agent_client import fetch_output

router = APIRouter()


@router.get("/info")
def info(agent: AgentDep, request: Request) -> dict:
    """On the local socket, also what the agent sees of the caller: the container it runs in, if
    any (`pitstop run` inside one registers the container: launcher/incontainer.py)."""
    out = agent.info()
    if peercred.local(request.scope):
        pid = peercred.caller_pid(request.scope)
        out = {**out, "caller": {"pid": pid, "container": containers.caller_container(pid) if pid else None}}
    return out


def _theirs(request: Request, w: Worker) -> Worker:
    """On the local socket, a worker is its owner's to read (its output may carry its secrets);
    on the peer door the cluster token has admitted an agent or the coordinator."""
    if peercred.local(request.scope):
        peercred.own(request.scope, f"worker {w.id}", w.owner_uid if w.owner_uid is not None else 0)
    return w


@router.get("/workers/{wid}")
def worker(agent: AgentDep, wid: str, request: Request) -> Worker:
    return agent.refresh(_theirs(request, agent.state.worker(wid)))


@router.get("/workers/{wid}/output")
async def output(agent: AgentDep, wid: str, request: Request, stream: str = "stdout", offset: int = 0) -> Response:
    """Output of a worker from `offset`; follows the worker to wherever it moved."""
    if stream not in ("stdout", "stderr"):
        raise FailedPrecondition(f"unknown stream {stream!r}", action="use stdout or stderr")
    w = agent.refresh(_theirs(request, agent.state.worker(wid)))
    agent.state.read(wid)
    if w.state == "moved" and w.moved_to:
        try:
            r = await fetch_output(w.moved_to["url"], agent.s.cluster_token, wid, stream, offset)
        except httpx.HTTPError as e:
            return Response(b"", headers={"X-Pitstop-State": "unreachable", "X-Pitstop-Error": repr(e)[:200]})
        return Response(r.content, status_code=r.status_code,
                        headers={k: v for k, v in r.headers.items() if k.lower().startswith("x-pitstop")})
    data = agent.dest.read_output(wid, stream, offset) if w.restored else b""
    headers = {"X-Pitstop-State": w.state, "X-Pitstop-Agent": agent.s.name}
    if w.restored:  # where this host's copy begins: what came before went to the hosts it left
        headers["X-Pitstop-Output-Start"] = str(w.output_base.get(stream, 0))
    if w.exit_code is not None:
        headers["X-Pitstop-Exit-Code"] = str(w.exit_code)
    return Response(data, media_type="application/octet-stream", headers=headers)
