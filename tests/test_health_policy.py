"""The GPU health policy (unit) and the coordinator's automatic evacuation (logic)."""

from __future__ import annotations

import time

import pytest

from pitstop.coordinator.health_policy import AutoEvacuator, HealthPolicy
from pitstop.errors import FailedPrecondition
from pitstop.gpu.health import throttle_names

pytestmark = pytest.mark.timeout(30)

OK = {"index": 0, "temperature_c": 60, "ecc_uncorrected_volatile": 0, "retired_pages": 2,
      "retired_pages_pending": False, "remapped_rows_uncorrectable": 0, "remap_pending": False,
      "remap_failed": False, "throttle_reasons": ["gpu_idle", "sw_power_cap"]}


@pytest.mark.parametrize("change,reason", [
    ({"temperature_c": 95}, "GPU 0 temperature 95 C > 90 C"),
    ({"ecc_uncorrected_volatile": 3}, "GPU 0 3 uncorrected ECC errors"),
    ({"retired_pages": 61}, "GPU 0 61 retired pages > 60"),
    ({"retired_pages_pending": True}, "page retirement pending"),
    ({"remapped_rows_uncorrectable": 600}, "600 rows remapped"),
    ({"remap_pending": True}, "row remapping pending"),
    ({"remap_failed": True}, "row remapping failed"),
    ({"throttle_reasons": ["hw_thermal_slowdown", "gpu_idle"]}, "GPU 0 throttled: hw_thermal_slowdown"),
])
def test_each_reading_trips_with_a_reason(change, reason):
    p = HealthPolicy()
    assert p.evaluate([OK]) == []
    got = p.evaluate([OK, {**OK, "index": 1}, {**OK, "index": 0, **change}])
    assert len(got) == 1 and got[0].startswith("GPU 0 ") and reason in got[0], got


def test_missing_readings_never_trip_and_thresholds_are_settings():
    assert HealthPolicy().evaluate([{k: None for k in OK} | {"index": 3}]) == []
    p = HealthPolicy(max_temperature_c=70, throttle_reasons=("sw_power_cap",))
    assert p.evaluate([OK]) == ["GPU 0 throttled: sw_power_cap"]
    assert p.evaluate([{**OK, "temperature_c": 71}])[0] == "GPU 0 temperature 71 C > 70 C"


def test_coordinator_settings_build_the_policy(monkeypatch):
    from pitstop.coordinator.settings import CoordinatorSettings

    monkeypatch.setenv("PITSTOP_COORDINATOR_HEALTH_MAX_TEMPERATURE_C", "80")
    monkeypatch.setenv("PITSTOP_COORDINATOR_HEALTH_THROTTLE_REASONS", "hw_slowdown, sw_thermal_slowdown")
    p = CoordinatorSettings().health_policy()
    assert p.max_temperature_c == 80 and p.throttle_reasons == {"hw_slowdown", "sw_thermal_slowdown"}


def test_throttle_bits_are_named_like_nvidia_smi():
    assert throttle_names(0x8 | 0x40 | 0x1) == ["gpu_idle", "hw_slowdown", "hw_thermal_slowdown"]


def _wait(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.01)
    raise TimeoutError


def test_auto_evacuation_starts_once_and_retries_a_blocked_one_after_backoff():
    started: list[tuple[str, str]] = []
    busy: dict[str, str] = {}
    spare = {"ok": False}

    def start(node, reason):
        if not spare["ok"]:
            raise FailedPrecondition("no compatible spare for host-b", code="no_compatible_spare",
                                     action="start a spare")
        started.append((node, reason))
        busy[node] = "op-1"
        return "op-1"

    a = AutoEvacuator(start, busy=lambda: busy, has_workers=lambda n: n != "idle", retry_s=0.3)
    a.observe("host-b", [])                                  # healthy: nothing
    a.observe("idle", ["GPU 0 temperature 99 C > 90 C"])     # degraded but nothing to move
    a.observe("host-b", ["GPU 0 temperature 99 C > 90 C"])
    _wait(lambda: a.status.get("host-b", {}).get("state") == "blocked")
    assert a.status["host-b"]["error"]["code"] == "no_compatible_spare" and "idle" not in a.status
    spare["ok"] = True
    a.observe("host-b", ["GPU 0 temperature 99 C > 90 C"])   # within the back-off: not retried
    time.sleep(0.05)
    assert started == []
    time.sleep(0.3)
    a.observe("host-b", ["GPU 0 temperature 99 C > 90 C"])
    _wait(lambda: a.status["host-b"].get("state") == "started")
    assert started == [("host-b", "automatic: GPU health degraded: GPU 0 temperature 99 C > 90 C")]
    time.sleep(0.35)
    a.observe("host-b", ["GPU 0 temperature 99 C > 90 C"])   # busy with its evacuation: no second one
    time.sleep(0.05)
    assert len(started) == 1


def test_a_degraded_verdict_is_retried_without_further_reports():
    """Beats do not restate an unchanged verdict: the evacuator retries a blocked host by itself,
    and stops once the host is healthy again."""
    attempts: list[str] = []
    spare = {"ok": False}

    def start(node, reason):
        attempts.append(node)
        if not spare["ok"]:
            raise FailedPrecondition("no compatible spare", code="no_compatible_spare", action="start a spare")
        return "op-1"

    a = AutoEvacuator(start, busy=lambda: {}, has_workers=lambda n: True, retry_s=0.2)
    a.verdict("host-c", [])
    a.verdict("host-b", ["GPU 0 temperature 99 C > 90 C"])   # one report, then only beats
    _wait(lambda: a.status.get("host-b", {}).get("state") == "blocked")
    spare["ok"] = True
    _wait(lambda: a.status["host-b"].get("state") == "started")
    assert attempts[0] == "host-b" and len(attempts) >= 2 and "host-c" not in attempts
    a.verdict("host-b", [])  # healthy again: no more retries
    n = len(attempts)
    time.sleep(0.6)
    assert len(attempts) == n
