"""A stand-in for PyTorch's CUDA caching allocator, for testing on a CPU the release of unused
device memory at the cut (shim/trim.c): `torch.cuda` with the entry points the shim calls
(is_initialized, device_count, memory_reserved, empty_cache), 1000 MiB reserved of which 200 MiB
live.  Loaded as `sitecustomize` where this folder leads PYTHONPATH, into jobs that use no torch.

FAKE_ALLOC_LOG: each call of empty_cache appends "RANK TIME" to this file.
FAKE_ALLOC_FAIL: empty_cache raises, as a CUDA error would."""

import os
import sys
import time
import types

if "torch" not in sys.modules and os.environ.get("FAKE_ALLOC_LOG"):
    _reserved = {"bytes": 1000 * 2**20}

    def _empty_cache() -> None:
        with open(os.environ["FAKE_ALLOC_LOG"], "a") as f:
            f.write(f"{os.environ.get('RANK')} {time.time()}\n")
        if os.environ.get("FAKE_ALLOC_FAIL"):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        _reserved["bytes"] = 200 * 2**20

    _torch = types.ModuleType("torch")
    _torch.cuda = types.SimpleNamespace(is_initialized=lambda: True, device_count=lambda: 1,  # type: ignore[attr-defined]
                                        memory_reserved=lambda device=0: _reserved["bytes"], empty_cache=_empty_cache)
    sys.modules["torch"] = _torch
