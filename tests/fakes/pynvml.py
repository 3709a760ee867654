"""A stand-in for nvidia-ml-py, for tests on hosts without GPUs.

Put this directory first on PYTHONPATH and FAKE_NVML_FILE at a JSON file:
    {"driver": "580.65", "gpus": [{"uuid": "GPU-...", "name": "NVIDIA H200", "memory_total": 150000000000,
                                   "temperature_c": 40, "ecc_uncorrected_volatile": 0, ...}]}
The file is read on every call, so a test degrades a "GPU" by rewriting it.
Only the calls pitstop makes exist here; anything else raises AttributeError.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - NVML's own spelling
    pass


def _state() -> dict:
    with open(os.environ["FAKE_NVML_FILE"]) as f:
        return json.load(f)


def _gpu(h: int) -> dict:
    return _state()["gpus"][h]


def _field(h: int, key: str, default=None):  # noqa: ANN001, ANN202
    v = _gpu(h).get(key, default)
    if v is None:
        raise NVMLError_NotSupported(key)
    return v


def nvmlInit() -> None:  # noqa: N802
    if not os.environ.get("FAKE_NVML_FILE"):
        raise NVMLError("FAKE_NVML_FILE is not set")


def nvmlSystemGetDriverVersion() -> str:  # noqa: N802
    return _state().get("driver", "580.00")


def nvmlDeviceGetCount() -> int:  # noqa: N802
    return len(_state()["gpus"])


def nvmlDeviceGetHandleByIndex(i: int) -> int:  # noqa: N802
    return i


def nvmlDeviceGetName(h: int) -> str:  # noqa: N802
    return _field(h, "name")


def nvmlDeviceGetUUID(h: int) -> str:  # noqa: N802
    return _field(h, "uuid")


def nvmlDeviceGetMemoryInfo(h: int) -> SimpleNamespace:  # noqa: N802
    total = _field(h, "memory_total", 150 * 10**9)
    return SimpleNamespace(total=total, used=_field(h, "memory_used", 0), free=total)


def nvmlDeviceGetTemperature(h: int, sensor: int) -> int:  # noqa: N802
    return _field(h, "temperature_c", 40)


def nvmlDeviceGetTotalEccErrors(h: int, kind: int, counter: int) -> int:  # noqa: N802
    key = {(1, 0): "ecc_uncorrected_volatile", (1, 1): "ecc_uncorrected_aggregate",
           (0, 0): "ecc_corrected_volatile", (0, 1): "ecc_corrected_aggregate"}[(kind, counter)]
    return _field(h, key, 0)


def nvmlDeviceGetRetiredPages(h: int, cause: int) -> list[int]:  # noqa: N802
    n = _field(h, "retired_pages", 0)
    return list(range(n)) if cause == NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR else []


def nvmlDeviceGetRetiredPagesPendingStatus(h: int) -> int:  # noqa: N802
    return int(_field(h, "retired_pages_pending", False))


def nvmlDeviceGetRemappedRows(h: int) -> tuple[int, int, int, int]:  # noqa: N802
    return (0, _field(h, "remapped_rows_uncorrectable", 0), int(_field(h, "remap_pending", False)),
            int(_field(h, "remap_failed", False)))


def nvmlDeviceGetCurrentClocksEventReasons(h: int) -> int:  # noqa: N802
    return _field(h, "throttle_mask", 0)
