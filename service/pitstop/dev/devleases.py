"""What a local cluster (tests, the demo, benches) holds on this machine, and who holds it.

Why: a run that is killed (SIGKILL, a CI timeout, a closed terminal) cannot clean up, and what it
left breaks the next run in ways that do not point back to it: agents still bound to their
ports, a bridge whose subnet takes a new cluster's routes, image mounts filling /dev/shm.  So
every LocalCluster and NetHosts writes a lease naming its owner (pid and start time) and what it
made; the next one to start removes what leases of dead owners name, and says what it removed.
A lease whose owner is alive is never touched, so parallel runs stay safe.

Processes are found by a marker in their environment (PITSTOP_DEV_CLUSTER=<lease>), which every
process a cluster starts inherits, and so do the workers an agent restores (CRIU restores the
environment with the memory), rather than by name: a machine may run a real agent too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from pitstop.agent import imagefs
from pitstop.proc import proctree

MARKER = "PITSTOP_DEV_CLUSTER"


def registry() -> Path:
    """Where leases live: PITSTOP_DEV_LEASES, else /run/pitstop-dev for root, else a per-user temp dir."""
    env = os.environ.get("PITSTOP_DEV_LEASES")
    if env:
        return Path(env)
    if os.geteuid() == 0 and Path("/run").is_dir():
        return Path("/run/pitstop-dev")
    return Path(tempfile.gettempdir()) / f"pitstop-dev-{os.geteuid()}"


SHARE = "PITSTOP_DEV_SHARE"


def share() -> tuple[int, int]:
    """This run's share of the machine among runs started side by side on purpose (the test
    suite's parallel workers): (i, n) from PITSTOP_DEV_SHARE="i/n", else (0, 1).  A free port or
    subnet is chosen in this share only: two runs that each check "free" and then take it a
    moment later would otherwise, now and then, take the same one."""
    try:
        i, n = (int(x) for x in os.environ.get(SHARE, "0/1").split("/"))
    except ValueError:
        return 0, 1
    return (i, n) if 0 <= i < n else (0, 1)


def in_share(lo: int, hi: int) -> tuple[int, int]:
    """The part [lo, hi) of a range that is this run's (share())."""
    i, n = share()
    step = (hi - lo) // n
    return lo + i * step, lo + (i + 1) * step if i < n - 1 else hi


def take(name: str, **what: Any) -> Path:
    """Record that this process holds `what` (keys: paths, netns_prefix, links, marker)."""
    d = registry()
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = d / f"{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "start": proctree.start_time(os.getpid()), **what}))
    os.replace(tmp, path)
    return path


def drop(name: str) -> None:
    (registry() / f"{name}.json").unlink(missing_ok=True)


def _alive(lease: dict[str, Any]) -> bool:
    pid = lease.get("pid")
    return isinstance(pid, int) and proctree.is_running(pid, lease.get("start"))


def _marked(value: str) -> list[int]:
    """Processes whose environment carries MARKER=value."""
    needle = f"{MARKER}={value}".encode()
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            if needle in (p / "environ").read_bytes().split(b"\0"):
                out.append(int(p.name))
        except OSError:
            continue
    return out


def _netns_pids(prefix: str) -> tuple[list[str], list[int]]:
    names = [n for n in os.listdir("/run/netns") if n.startswith(prefix)] if Path("/run/netns").is_dir() else []
    pids: list[int] = []
    for n in names:
        r = subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True, timeout=10)
        pids += [int(x) for x in r.stdout.split() if x.isdigit()]
    return names, pids


def remove(lease: dict[str, Any]) -> list[str]:
    """Remove what `lease` names, processes first (they hold the mounts and namespaces); what was removed."""
    done: list[str] = []
    pids = _marked(lease["marker"]) if lease.get("marker") else []
    ns_names: list[str] = []
    if lease.get("netns_prefix"):
        ns_names, ns_pids = _netns_pids(lease["netns_prefix"])
        pids += ns_pids
    if pids:
        proctree.kill_all(sorted(set(pids)), timeout_s=5.0)
        done.append(f"{len(set(pids))} processes")
    for n in ns_names:
        subprocess.run(["ip", "netns", "delete", n], capture_output=True, timeout=10)
        done.append(f"netns {n}")
    for link in lease.get("links", []):
        if subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=10).returncode == 0:
            done.append(f"link {link}")
    for p in map(Path, lease.get("paths", [])):
        if p.exists():
            imagefs.unmount_under(p)
            shutil.rmtree(p, ignore_errors=True)
            done.append(str(p))
    return done


def _leases() -> list[tuple[Path, dict[str, Any] | None]]:
    """Every lease file with what it says (None: unreadable, half-written by a run killed mid-write)."""
    d = registry()
    out: list[tuple[Path, dict[str, Any] | None]] = []
    for f in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            out.append((f, json.loads(f.read_text())))
        except (OSError, ValueError):
            out.append((f, None))
    return out


def held_by_others() -> list[dict[str, Any]]:
    """The leases of live owners other than this process: what a check for this process's own
    leftovers must leave alone (a bench or the demo running beside the tests)."""
    return [lease for _, lease in _leases() if lease and lease.get("pid") != os.getpid() and _alive(lease)]


def sweep() -> list[str]:
    """Remove what every lease of a dead owner names; one line per lease that held anything."""
    lines = []
    for f, lease in _leases():
        if lease is None:
            f.unlink(missing_ok=True)  # names nothing usable
            continue
        if _alive(lease):
            continue
        removed = remove(lease)
        f.unlink(missing_ok=True)
        if removed:
            lines.append(f"removed what a killed run (pid {lease.get('pid')}) left: {', '.join(removed)}")
    return lines
