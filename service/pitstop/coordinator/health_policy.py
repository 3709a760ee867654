"""When a host's GPUs are no longer fit to train on, and what the coordinator does then.

The thresholds are the coordinator's settings (PITSTOP_COORDINATOR_HEALTH_*),
one policy for the fleet.  A degraded host is never offered as a spare, and
with auto-evacuation on (the default) its workers are moved off by a planned
evacuation that the coordinator starts by itself, whose reason names the
readings that tripped it.  A reading that is absent (None) never trips.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from pitstop.errors import PitstopError

log = structlog.get_logger("pitstop.coordinator.health")


class HealthPolicy:
    def __init__(self, *, max_temperature_c: float = 90.0, max_ecc_uncorrected: int = 0,
                 max_retired_pages: int = 60, max_remapped_rows_uncorrectable: int = 512,
                 throttle_reasons: tuple[str, ...] = ("hw_slowdown", "hw_thermal_slowdown",
                                                      "hw_power_brake_slowdown")) -> None:
        self.max_temperature_c = max_temperature_c
        self.max_ecc_uncorrected = max_ecc_uncorrected
        self.max_retired_pages = max_retired_pages
        self.max_remapped_rows = max_remapped_rows_uncorrectable
        self.throttle_reasons = set(throttle_reasons)

    def evaluate(self, gpus: list[dict[str, Any]]) -> list[str]:
        """Why this host is degraded, one reason per tripped reading; [] when healthy."""
        out: list[str] = []
        for g in gpus:
            name = f"GPU {g.get('index', '?')}"
            t = g.get("temperature_c")
            if t is not None and t > self.max_temperature_c:
                out.append(f"{name} temperature {t} C > {self.max_temperature_c:g} C")
            e = g.get("ecc_uncorrected_volatile")
            if e is not None and e > self.max_ecc_uncorrected:
                out.append(f"{name} {e} uncorrected ECC errors since boot (limit {self.max_ecc_uncorrected})")
            r = g.get("retired_pages")
            if r is not None and r > self.max_retired_pages:
                out.append(f"{name} {r} retired pages > {self.max_retired_pages}")
            if g.get("retired_pages_pending"):
                out.append(f"{name} page retirement pending (needs a GPU reset)")
            rr = g.get("remapped_rows_uncorrectable")
            if rr is not None and rr > self.max_remapped_rows:
                out.append(f"{name} {rr} rows remapped for uncorrectable errors > {self.max_remapped_rows}")
            if g.get("remap_pending"):
                out.append(f"{name} row remapping pending (needs a GPU reset)")
            if g.get("remap_failed"):
                out.append(f"{name} row remapping failed (GPU should be replaced)")
            hit = sorted(self.throttle_reasons & set(g.get("throttle_reasons") or []))
            if hit:
                out.append(f"{name} throttled: {', '.join(hit)}")
        return out


class AutoEvacuator:
    """Starts at most one evacuation per degraded host, retrying a blocked one after a back-off.

    `start(node, reason)` plans and starts the operation (the operator API's own
    path); it runs on a thread of its own because planning asks the agents what
    they run, and a heartbeat handler must answer at once.
    """

    def __init__(self, start: Callable[[str, str], str], busy: Callable[[], dict[str, str]],
                 has_workers: Callable[[str], bool], retry_s: float = 30.0) -> None:
        self._start = start
        self._busy = busy
        self._has_workers = has_workers
        self.retry_s = retry_s
        self.status: dict[str, dict[str, Any]] = {}  # host -> {"at", "operation" | "blocked", "reasons"}
        self._lock = threading.Lock()
        self._running: set[str] = set()
        self._degraded: dict[str, list[str]] = {}
        self._ticker: threading.Thread | None = None

    def verdict(self, node: str, reasons: list[str]) -> None:
        """A host's latest health verdict.  Beats repeat a verdict without restating it, so a
        degraded host is retried from here (every few seconds, `observe` keeps the back-off)
        until it is healthy again, evacuated, or empty."""
        with self._lock:
            if reasons:
                self._degraded[node] = reasons
            else:
                self._degraded.pop(node, None)
            start = bool(reasons) and self._ticker is None
            if start:
                self._ticker = threading.Thread(target=self._tick, daemon=True, name="auto-evacuate-retry")
        if start:
            assert self._ticker is not None
            self._ticker.start()
        self.observe(node, reasons)

    def _tick(self) -> None:
        while True:
            time.sleep(max(0.2, min(self.retry_s, 5.0)))
            with self._lock:
                degraded = list(self._degraded.items())
            for node, reasons in degraded:
                try:
                    self.observe(node, reasons)
                except Exception as e:  # noqa: BLE001 - the next tick tries again
                    log.warning("automatic evacuation retry failed", host=node, error=repr(e)[:200])

    def observe(self, node: str, reasons: list[str]) -> None:
        if not reasons:
            return
        with self._lock:
            last = self.status.get(node)
            if node in self._running or node in self._busy():
                return
            if last and time.time() - last["at"] < self.retry_s:
                return
            if not self._has_workers(node):
                return
            self._running.add(node)
            self.status[node] = {"at": time.time(), "reasons": reasons, "state": "starting"}
        threading.Thread(target=self._run, args=(node, reasons), daemon=True, name=f"auto-evacuate-{node}").start()

    def _run(self, node: str, reasons: list[str]) -> None:
        reason = "automatic: GPU health degraded: " + "; ".join(reasons)
        try:
            op = self._start(node, reason)
            entry: dict[str, Any] = {"state": "started", "operation": op}
            log.warning("host degraded; evacuation started", host=node, operation=op, reasons=reasons)
        except PitstopError as e:
            entry = {"state": "blocked", "error": e.to_dict()}
            log.error("host degraded but cannot be evacuated", host=node, reasons=reasons, error=e.message,
                      action=e.action)
        with self._lock:
            self.status[node] = {"at": time.time(), "reasons": reasons, **entry}
            self._running.discard(node)
