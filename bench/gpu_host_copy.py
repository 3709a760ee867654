"""The floor under cuda-checkpoint on this host: how fast device memory can reach host memory.

cuda-checkpoint measured 0.4-0.6 GB/s out and 1.1-1.6 GB/s back in on the H200 VM
(docs/benchmarks.md), far below PCIe.  Whether that is the link, the driver, or the host
memory it lands in decides what the projection may assume, so this measures, in one run on
the same GPU, copies of the same bytes:

- device -> pinned host memory that is already touched (the link's rate: the floor);
- device -> pageable host memory that is already touched (one bounce through a staging buffer);
- device -> fresh pageable host memory (first touch included: what a checkpoint into newly
  allocated host memory pays on a host whose guest memory grows on demand);
- a plain memset of fresh host memory (first touch alone, no GPU);
- pinned host -> device (the way back).

    python3 bench/gpu_host_copy.py [--gib 4] [--out result.json]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import mmap
import platform
import sys
import time
from pathlib import Path


def _rate(nbytes: int, fn) -> float:  # noqa: ANN001 - a thunk
    t0 = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t0) / 1e9


def _fresh_fill(nbytes: int) -> float:
    """First touch of fresh anonymous memory, 4 KiB pages: the host-side cost alone."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    try:
        return _rate(nbytes, lambda a=addr: ctypes.memset(a, 1, nbytes))
    finally:
        del addr
        m.close()


def measure(gib: float) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_host_copy: no CUDA device here (torch.cuda.is_available() is False); "
                         "run it on a GPU host")
    n = int(gib * 2**30)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.fill_(7)
    torch.cuda.synchronize()

    def d2h(dst: torch.Tensor) -> None:
        dst.copy_(dev, non_blocking=False)
        torch.cuda.synchronize()

    out: dict = {"gib": gib}
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(0)
    d2h(pinned)  # warm the path once
    out["d2h_pinned_touched_GBps"] = _rate(n, lambda p=pinned: d2h(p))
    out["h2d_pinned_GBps"] = _rate(n, lambda p=pinned: (dev.copy_(p), torch.cuda.synchronize()))
    del pinned
    pageable = torch.empty(n, dtype=torch.uint8)
    pageable.fill_(0)
    out["d2h_pageable_touched_GBps"] = _rate(n, lambda p=pageable: d2h(p))
    del pageable
    fresh = torch.empty(n, dtype=torch.uint8)  # malloc'd, untouched: the copy faults it in
    out["d2h_pageable_fresh_GBps"] = _rate(n, lambda p=fresh: d2h(p))
    del fresh
    out["host_fresh_fill_GBps"] = _fresh_fill(n)
    out["device"] = torch.cuda.get_device_name(0)
    out["torch"] = torch.__version__
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.0, help="bytes per copy, GiB (default 4)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    a = ap.parse_args(argv)
    if not 0 < a.gib <= 64 or not 1 <= a.repeats <= 10:
        ap.error("--gib must be in (0, 64] and --repeats in [1, 10]")
    runs = [measure(a.gib) for _ in range(a.repeats)]
    res = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
           "kernel": platform.release(), "command": " ".join(["gpu_host_copy.py", *argv]), "runs": runs}
    text = json.dumps(res, indent=1)
    if a.out:
        a.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
