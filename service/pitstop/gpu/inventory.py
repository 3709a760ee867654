"""What GPUs this host has, read through NVML (nvidia-ml-py), cached.

The coordinator only moves workers to spares whose GPU model and count match
the leaving host's, so this is part of every heartbeat.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=1)
def nvml() -> Any:
    """pynvml, initialised once per process; raises (NVML's own errors) where there is no GPU."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml


@functools.lru_cache(maxsize=1)
def inventory() -> dict[str, Any]:
    try:
        pynvml = nvml()
    except Exception as e:  # noqa: BLE001 - NVML raises its own family when absent
        return {"gpus": [], "gpu_model": None, "gpu_count": 0, "gpu_note": f"not present ({type(e).__name__})"}
    gpus = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        gpus.append({"index": i, "uuid": pynvml.nvmlDeviceGetUUID(h), "name": pynvml.nvmlDeviceGetName(h),
                     "memory_total": mem.total})
    model = gpus[0]["name"] if gpus else None
    return {"gpus": gpus, "gpu_model": model, "gpu_count": len(gpus),
            "driver": pynvml.nvmlSystemGetDriverVersion(), "gpu_note": ""}


def used_device_memory(pids: list[int]) -> dict[int, int]:
    """Device bytes each of `pids` holds, as NVML's compute-process list says (what a CUDA
    checkpoint of it will copy out); pids it does not list, or no NVML at all, are left out."""
    want = set(pids)
    try:
        pynvml = nvml()
        out: dict[int, int] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i)):
                if p.pid in want and p.usedGpuMemory is not None:
                    out[p.pid] = out.get(p.pid, 0) + int(p.usedGpuMemory)
        return out
    except Exception:  # noqa: BLE001 - a measurement: NVML raises its own family
        return {}
