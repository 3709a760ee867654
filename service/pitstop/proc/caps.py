"""Capabilities a restored worker needs, and what the restoring agent may grant.

CRIU gives a restored process back its permitted, inheritable and ambient capabilities,
and it can only give what the restoring agent itself holds: a worker holding a capability
outside the destination agent's bounding set cannot be restored there (CRIU's restorer
fails on it, "Unable to restore capabilities", and used to hang).  pitstop-agent.service
narrows the agent's bounding set on purpose, so:

- `pitstop run` narrows each worker's bounding set to its agent's (where it may: root with
  CAP_SETPCAP), so that every worker it launches can be restored by any agent running the
  same unit; a training job has no use for the capabilities dropped (module loading, raw
  I/O, the clock...);
- each worker's needs are reported, and the coordinator refuses, before anything pauses, a
  move to an agent that could not grant them, naming the capabilities.

A worker's bounding set is not a need: CRIU narrows a restored bounding set to the
agent's without complaint.  A non-root worker (no capabilities) moves anywhere.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from pitstop.proc import proctree

CAP_NAMES = (
    "chown", "dac_override", "dac_read_search", "fowner", "fsetid", "kill", "setgid", "setuid", "setpcap",
    "linux_immutable", "net_bind_service", "net_broadcast", "net_admin", "net_raw", "ipc_lock", "ipc_owner",
    "sys_module", "sys_rawio", "sys_chroot", "sys_ptrace", "sys_pacct", "sys_admin", "sys_boot", "sys_nice",
    "sys_resource", "sys_time", "sys_tty_config", "mknod", "lease", "audit_write", "audit_control", "setfcap",
    "mac_override", "mac_admin", "syslog", "wake_alarm", "block_suspend", "audit_read", "perfmon", "bpf",
    "checkpoint_restore")
CAP_SETPCAP = 8
PR_CAPBSET_DROP = 24


def _status(pid: int | str) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def bounding_set(pid: int | str = "self") -> int:
    return int(_status(pid)["CapBnd"], 16)


def _user_ns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/user")
    except OSError:
        return None


def needs(root_pid: int) -> int:
    """What a restore of the tree at root_pid must grant: permitted, inheritable and ambient
    capabilities of every process in it that lives in the agent's own user namespace.

    A process inside a user namespace of its own holds its capabilities only over that namespace
    (an unprivileged user may make one and be "root" there): none of them is the host's to grant,
    and counting them made such a worker's node impossible to evacuate."""
    mask = 0
    ours = _user_ns("self")
    for pid in proctree.tree(root_pid):
        try:
            st = _status(pid)
        except OSError:
            continue  # exited meanwhile
        if _user_ns(pid) != ours:
            continue
        for key in ("CapPrm", "CapInh", "CapAmb"):
            mask |= int(st.get(key, "0"), 16)
    return mask


def names(mask: int) -> list[str]:
    return [f"cap_{CAP_NAMES[i]}" if i < len(CAP_NAMES) else f"cap_{i}" for i in range(64) if mask >> i & 1]


def missing(need: int, have: int) -> list[str]:
    """Names of the capabilities in `need` that `have` lacks."""
    return names(need & ~have)


def limit_bounding_set(allowed: int) -> list[str]:
    """Drop from this process's bounding set (inherited by what it starts) every capability
    outside `allowed`; the names dropped.  Nothing is done without CAP_SETPCAP (a non-root
    launcher, whose workers hold no capabilities anyway)."""
    if not int(_status("self")["CapEff"], 16) >> CAP_SETPCAP & 1:
        return []
    libc = ctypes.CDLL(None, use_errno=True)
    extra = bounding_set() & ~allowed  # read once: only this call changes it
    dropped = [cap for cap in range(64) if extra >> cap & 1 and libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0]
    return names(sum(1 << cap for cap in dropped))
