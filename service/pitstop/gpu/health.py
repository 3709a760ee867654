"""GPU health readings through NVML (nvidia-ml-py), fresh at every heartbeat.

The agent only reports; the coordinator judges (coordinator/health_policy.py),
so that thresholds are one fleet-wide setting and not baked into every host.
A reading a GPU does not support is None, never a guess.
"""

from __future__ import annotations

from typing import Any

# NVML's clock-event ("throttle") reason bits, by the names operators know from nvidia-smi.
THROTTLE_BITS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}


def throttle_names(mask: int) -> list[str]:
    return [name for bit, name in THROTTLE_BITS.items() if mask & bit]


def _try(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - NVMLError_NotSupported and kin: the reading does not exist
        return None


def readings() -> list[dict[str, Any]]:
    """One dict per GPU; [] where there is no NVML (the heartbeat then says "not present")."""
    from pitstop.gpu.inventory import nvml

    try:
        pynvml = nvml()
        n = pynvml.nvmlDeviceGetCount()
    except Exception:  # noqa: BLE001
        return []
    out = []
    for i in range(n):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        mem = _try(pynvml.nvmlDeviceGetMemoryInfo, h)
        unc = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        cor = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        retired_dbe = _try(pynvml.nvmlDeviceGetRetiredPages, h, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        retired_sbe = _try(pynvml.nvmlDeviceGetRetiredPages, h,
                           pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        remap = _try(pynvml.nvmlDeviceGetRemappedRows, h)  # (corr, unc, pending, failure)
        pending = _try(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
        reasons = _try(getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                       or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, h)
        out.append({
            "index": i,
            "uuid": _try(pynvml.nvmlDeviceGetUUID, h),
            "temperature_c": _try(pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU),
            "memory_used": mem.used if mem else None,
            "memory_total": mem.total if mem else None,
            "ecc_uncorrected_volatile": _try(pynvml.nvmlDeviceGetTotalEccErrors, h, unc, pynvml.NVML_VOLATILE_ECC),
            "ecc_uncorrected_aggregate": _try(pynvml.nvmlDeviceGetTotalEccErrors, h, unc,
                                              pynvml.NVML_AGGREGATE_ECC),
            "ecc_corrected_volatile": _try(pynvml.nvmlDeviceGetTotalEccErrors, h, cor, pynvml.NVML_VOLATILE_ECC),
            "retired_pages": (len(retired_dbe) + len(retired_sbe)) if retired_dbe is not None
            and retired_sbe is not None else None,
            "retired_pages_pending": bool(pending) if pending is not None else None,
            "remapped_rows_uncorrectable": remap[1] if remap else None,
            "remap_pending": bool(remap[2]) if remap else None,
            "remap_failed": bool(remap[3]) if remap else None,
            "throttle_reasons": throttle_names(int(reasons)) if reasons is not None else None,
        })
    return out
