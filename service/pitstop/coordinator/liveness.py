"""What the hosts' beats say, kept in memory between the batches that write it
(coordinator/store.py, `flush`).

Why in memory: at 10,000 agents beating once a second, one transaction per beat costs more CPU
than the coordinator has (bench/heartbeat_load.py).  A beat only says "alive, still generation
G": it touches this, and the store writes every changed last_seen (and GPU health) in one
transaction about once a second.  What a restart loses is at most that second of last_seen,
which only ages a host by a second."""

from __future__ import annotations

import threading
import time

Health = tuple[list, dict]  # (gpu_health, verdict) as a beat carries them
Pending = tuple[str, float | None, Health | None]  # (host, last beat, health) not yet written


class Liveness:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}  # host -> last beat (unix time), newer than the table's
        self._health: dict[str, Health] = {}  # host -> readings from beats, newer than its report's
        self._dirty: set[str] = set()
        self._generation: dict[str, str] = {}  # host -> the generation of its last full report

    def load(self, generations: dict[str, str]) -> None:
        """The generations the database holds: a restarted coordinator takes the hosts' beats at
        once instead of asking every agent for a full report in the same second."""
        with self._lock:
            self._generation = dict(generations)

    def excuse(self, last_seen: dict[str, float], gap_s: float) -> None:
        """No coordinator listened for `gap_s`: each host is taken as heard `gap_s` later than it
        last was (never later than now)."""
        now = time.time()
        with self._lock:
            for name, at in last_seen.items():
                self._seen[name] = max(self._seen.get(name, 0.0), min(now, at + gap_s))

    def beat(self, name: str, generation: str) -> bool:
        """A beat from an agent; False: ask it for a full report (its generation is not the last
        one held).  Either way a beat from a known host is contact: its host is alive, whether or
        not its report got through (a flood or an overloaded coordinator may hold the report back;
        the host must not be taken for dead meanwhile, nor its jobs recovered)."""
        current = self._generation.get(name) == generation
        if current or name in self._generation:
            with self._lock:
                self._seen[name] = time.time()
                self._dirty.add(name)
        return current

    def set_health(self, name: str, gpu_health: list, verdict: dict) -> None:
        with self._lock:
            self._health[name] = (gpu_health, verdict)
            self._dirty.add(name)

    def take(self) -> list[Pending]:
        """What changed since the last batch; put back (`put_back`) if it could not be written."""
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            return [(n, self._seen.get(n), self._health.pop(n, None)) for n in dirty]

    def put_back(self, pending: list[Pending]) -> None:
        with self._lock:
            for name, _, health in pending:
                self._dirty.add(name)
                if health is not None:
                    self._health.setdefault(name, health)

    def reported(self, name: str, at: float, generation: str | None) -> None:
        """A full report was written: it carried the freshest readings, and its generation."""
        with self._lock:
            self._seen[name] = at
            self._health.pop(name, None)
            if generation:
                self._generation[name] = generation
            else:
                self._generation.pop(name, None)

    def last_seen(self, name: str, recorded: float) -> float:
        """The later of what the database recorded and what a beat since said."""
        return max(recorded, self._seen.get(name, 0.0))

    def health(self, name: str) -> Health | None:
        return self._health.get(name)

    def forget(self, name: str) -> None:
        with self._lock:
            self._seen.pop(name, None)
            self._health.pop(name, None)
            self._generation.pop(name, None)

