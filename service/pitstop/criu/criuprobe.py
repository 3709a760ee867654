"""Whether a CRIU works on this kernel: a real dump and restore of a tiny process that holds a
listening TCP socket, in a PID namespace and session of its own as `pitstop run` makes them.

Why: a CRIU's version says little about this kernel.  4.1 passes `criu check` on Linux 6.16+ and
still fails every dump of a process with a TCP socket (SO_PASSCRED is refused there); a distro's
older CRIU may carry the fix.  So `pitstop doctor` runs this probe and says which CRIU passed, and
a host CRIU older than pitstop's floor is used when it passes rather than replaced by the
private one (criu/runtime.py).
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOLDER = ("import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
          "open(sys.argv[1], 'w').close(); time.sleep(120)")


def _tail(d: Path, log: str) -> str:
    try:
        lines = [ln for ln in (d / log).read_text(errors="replace").splitlines() if "Error" in ln]
    except OSError:
        return "no log"
    return lines[-1].strip() if lines else "no Error line in its log"


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def probe(binary: str, timeout_s: float = 30.0) -> tuple[bool, str]:
    """(passed, what happened): dump the holder with `binary`, restore it, see it run, remove it."""
    d = Path(tempfile.mkdtemp(prefix="pitstop-criu-probe-"))
    ready = d / "ready"
    holder = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "setsid", sys.executable, "-c", HOLDER,
                               str(ready)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    restored = 0
    try:
        end = time.monotonic() + timeout_s
        while not ready.exists():
            if holder.poll() is not None or time.monotonic() > end:
                return False, "the probe's process did not start (unshare --pid needs root)"
            time.sleep(0.02)
        kids = Path(f"/proc/{holder.pid}/task/{holder.pid}/children").read_text().split()
        if not kids:
            return False, "the probe's process is gone"
        lock = ["--network-lock", "nftables"]
        imgs = d / "images"
        imgs.mkdir()
        p = subprocess.run([binary, "dump", "-t", kids[0], "-D", str(imgs), "-o", "dump.log", "-v2", *lock],
                           capture_output=True, text=True, timeout=timeout_s)
        if p.returncode != 0:
            return False, f"dump failed: {_tail(imgs, 'dump.log')}"
        p = subprocess.run([binary, "restore", "-D", str(imgs), "-d", "--pidfile", str(d / "pid"),
                            "-o", "restore.log", "-v2", *lock], capture_output=True, text=True, timeout=timeout_s)
        if p.returncode != 0:
            return False, f"restore failed: {_tail(imgs, 'restore.log')}"
        restored = int((d / "pid").read_text().split()[0])
        if not Path(f"/proc/{restored}").exists():
            return False, "the restored process did not survive"
        return True, "a process with a TCP socket dumped and restored"
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        return False, f"probe failed: {e}"
    finally:
        if restored:
            _kill(restored)
        for k in Path(f"/proc/{holder.pid}/task/{holder.pid}/children").read_text().split() \
                if holder.poll() is None else []:
            _kill(int(k))
        _kill(holder.pid)
        holder.wait(10)
        shutil.rmtree(d, ignore_errors=True)


@functools.lru_cache(maxsize=8)
def passes(binary: str, version: tuple[int, ...]) -> tuple[bool, str]:
    """probe(), once per binary and version in a process (the kernel does not change under it)."""
    ok, why = probe(binary)
    return ok, f"{why} on Linux {platform.release()}"
