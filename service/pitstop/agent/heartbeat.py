"""Register with the coordinator and keep telling it what this host holds.

One POST a heartbeat period, with a deadline, carrying the host's identity,
role, inventory and its workers; the coordinator learns jobs from these.  A
coordinator that is down only delays the next beat: agents never depend on
it to keep their workers running.
"""

from __future__ import annotations

import asyncio

import httpx
import structlog

from .. import tls
from .api import Agent

log = structlog.get_logger("pitstop.agent.heartbeat")


def payload(agent: Agent) -> dict:
    from ..gpu.health import readings
    from ..gpu.inventory import inventory

    workers = [agent.refresh(w).model_dump(include={"id", "job", "rank", "state", "root_pid", "moved_to", "net",
                                                      "exit_code"})
               for w in list(agent.state.workers.values())]
    return {"name": agent.s.name, "url": agent.s.url, "spare": agent.s.spare, "workers": workers,
            **inventory(), "gpu_health": readings()}


async def heartbeat_loop(agent: Agent) -> None:
    url = agent.s.coordinator.rstrip("/") + "/v1/agents:heartbeat"
    headers = {"Authorization": f"Bearer {agent.s.cluster_token}"} if agent.s.cluster_token else {}
    failing = False
    async with httpx.AsyncClient(timeout=5.0, verify=tls.client_context()) as c:
        while True:
            try:
                r = await c.post(url, json=payload(agent), headers=headers)
                if r.status_code >= 300:
                    raise httpx.HTTPStatusError(r.text[:200], request=r.request, response=r)
                if failing:
                    log.info("coordinator reachable again", url=url)
                failing = False
            except (httpx.HTTPError, OSError) as e:
                if not failing:
                    log.warning("heartbeat failed; will keep trying", url=url, error=repr(e)[:200])
                failing = True
            await asyncio.sleep(agent.s.heartbeat_s)
