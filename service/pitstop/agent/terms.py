"""The coordinator terms this agent has seen: the fence between a leading coordinator and one that
no longer leads (coordinator/leadership.py).

Every call a coordinator makes to an agent carries its term (X-Pitstop-Term, wire/agent_client.py).
The agent keeps the highest term it has seen, from those calls, from a new leader's announcement
(POST /v1/coordinator:term) and from its heartbeats' answers, and refuses any call of a lower one
(409 stale_term, naming the term it has seen): a leader that was cut off, or stalled, and comes
back after another took over cannot pause, capture, restore or stop anything through this agent.
Calls without a term (other agents, the local launcher) are not the coordinator's and pass.

The term is kept in the state directory, so that an agent that restarts still refuses an old
leader.  A term only grows here; the coordinator that leads moves its own above what an agent
reports having seen, should its database ever hold less (coordinator/routes.py, heartbeat).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("pitstop.agent.terms")


class Terms:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.seen = 0
        self.leader = ""  # the URL of the coordinator that leads in `seen`, where it said
        self.since: float | None = None  # when this agent first saw `seen` (unix time)
        self.refused = 0  # calls refused for a stale term, since this agent started
        try:
            d = json.loads(path.read_text())
            self.seen, self.leader, self.since = int(d["term"]), str(d.get("leader") or ""), d.get("since")
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("the coordinator term kept in the state directory cannot be read; starting from none",
                        path=str(path), error=repr(e)[:200])

    def admit(self, term: int, leader: str = "") -> bool:
        """Whether a call (or an answer) of `term` may act here; a higher term is remembered first."""
        with self.lock:
            if term < self.seen:
                self.refused += 1
                return False
            new = term > self.seen
            if new or (leader and leader != self.leader):
                if new:
                    log.info("a new coordinator term", term=term, was=self.seen, leader=leader or None)
                    self.since = time.time()
                self.seen = term
                self.leader = leader if leader or not new else ""
                self._save()
            return True

    def view(self) -> dict[str, Any]:
        return {"term": self.seen, "leader": self.leader or None, "since": self.since, "refused": self.refused}

    def _save(self) -> None:
        """Atomically: a crash mid-write leaves the old term, never a torn file."""
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"term": self.seen, "leader": self.leader, "since": self.since}))
            os.replace(tmp, self.path)
        except OSError as e:  # kept in memory: still refused until this agent restarts
            log.warning("could not keep the coordinator term in the state directory", path=str(self.path),
                        error=e.strerror)
