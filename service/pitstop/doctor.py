"""`pitstop doctor`: can this host capture and restore workers, and if not, why not."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pitstop.container import podman
from pitstop.criu import netlock, runtime
from pitstop.errors import PitstopError
from pitstop.memory import lazy_pages


@dataclass
class Check:
    name: str
    ok: bool | None  # None: informational / not present, does not block
    detail: str
    required: bool = True


def _kconfig(option: str) -> str | None:
    for path in (Path("/proc/config.gz"), Path(f"/boot/config-{platform.release()}")):
        try:
            if path.suffix == ".gz":
                import gzip

                text = gzip.decompress(path.read_bytes()).decode()
            else:
                text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith(option + "="):
                return line.split("=", 1)[1]
            if line == f"# {option} is not set":
                return "n"
    return None


def run_checks() -> list[Check]:
    checks: list[Check] = []
    checks.append(Check("privileges", os.geteuid() == 0,
                        "root" if os.geteuid() == 0 else f"uid {os.geteuid()}: CRIU needs root (CAP_SYS_ADMIN et al.)"))
    checks.append(Check("kernel", True, platform.release(), required=False))
    try:
        rt = runtime.locate()
        checks.append(Check("criu", True, f"{rt.version_str} ({rt.source}: {rt.binary})"))
        checks.append(_carried(rt))
        ok, out = rt.check()
        checks.append(Check("criu check", ok, out.splitlines()[-1] if out else "(no output)"))
        if ok and os.geteuid() == 0:
            from pitstop.criu.criuprobe import passes

            done, why = passes(rt.binary, rt.version)
            checks.append(Check("criu dump and restore", done, f"{why}, with the {rt.source} CRIU {rt.version_str}"
                                if done else f"{rt.binary}: {why}"))
        try:
            rt.import_pycriu()
            checks.append(Check("pycriu", True, rt.pycriu_path or "importable"))
        except ImportError as e:
            checks.append(Check("pycriu", False, f"cannot import: {e}"))
        checks.append(Check("network lock", bool(rt.nft), f"nftables ({rt.nft})" if rt.nft else
                            "nft not found: a rolled-back source could not talk again"))
        if rt.nft:
            checks.append(_lock_tables_left(rt))
        lazy_ok, lazy_out = lazy_pages.supported(rt)
        checks.append(Check("post-copy restore (lazy pages)", lazy_ok,
                            "available: PITSTOP_AGENT_LAZY_RESTORE=1 may be used" if lazy_ok else
                            f"unavailable, restores stay eager: {lazy_out.splitlines()[-1] if lazy_out else ''}",
                            required=False))
    except PitstopError as e:
        checks.append(Check("criu", False, f"{e.message}; {e.action}"))
    cr = _kconfig("CONFIG_CHECKPOINT_RESTORE")
    checks.append(Check("CONFIG_CHECKPOINT_RESTORE", None if cr is None else cr == "y",
                        cr or "kernel config not readable", required=cr is not None))
    sd = _kconfig("CONFIG_MEM_SOFT_DIRTY")
    checks.append(Check("soft-dirty", None, ("available" if sd == "y" else "not available")
                        + " (not used: pitstop's pre-copy tracks writes with userfaultfd, memory/writetrack.py)",
                        required=False))
    checks.append(_write_tracking())
    checks.append(_incremental_dump())
    checks.append(_restore_fill())
    unshare = shutil.which("unshare")
    if unshare:
        p = subprocess.run([unshare, "--pid", "--fork", "--kill-child", "true"], capture_output=True, text=True)
        checks.append(Check("pid namespaces", p.returncode == 0,
                            "unshare --pid works" if p.returncode == 0 else p.stderr.strip()))
    else:
        checks.append(Check("pid namespaces", False, "unshare (util-linux) not found"))
    checks.append(_procself(unshare))
    checks.append(_worker_init())
    checks.append(_image_root())
    checks.append(_huge_tmpfs())
    checks.append(_exit_status_kept())
    checks.append(agent_unit())
    checks.append(containers())
    checks.append(coordinators())
    checks += gpu_checks()
    return checks


LEADER_QUESTION_TIMEOUT_S = 3.0  # one coordinator asked who leads; one that takes longer is reported unreachable


def coordinators(urls: str | None = None) -> Check:
    """Which coordinator leads, in which term and since when (coordinator/leadership.py), asked of
    every coordinator PITSTOP_COORDINATOR names (GET /v1/leader, open); not a check of this host:
    informational, and a warning where none leads or they disagree."""
    import time

    import httpx

    from pitstop.endpoints import split_urls
    from pitstop.wire.coordinator_client import leader_view

    urls = urls if urls is not None else os.environ.get("PITSTOP_COORDINATOR", "")
    if not urls:
        return Check("coordinators", None, "PITSTOP_COORDINATOR is not set: none asked", required=False)
    said, leaders = [], set()
    for url in split_urls(urls):
        try:
            v = leader_view(url, LEADER_QUESTION_TIMEOUT_S)
        except (httpx.HTTPError, ValueError) as e:
            said.append(f"{url}: unreachable ({type(e).__name__})")
            continue
        since = v.get("since")
        when = (f", since {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(since))} "
                f"({(time.time() - since) / 60:.0f} min)" if since else "")
        if v.get("role") == "leader":
            leaders.add(url)
            said.append(f"{url}: leads, term {v.get('term')}{when}")
        else:
            leaders.add(v.get("leader") or "")
            said.append(f"{url}: {v.get('role')} ({v.get('leader') or 'no coordinator'} leads, term {v.get('term')})")
    leaders.discard("")
    return Check("coordinators", len(leaders) == 1, "; ".join(said), required=False)


def containers() -> Check:
    """Whether ranks in containers can move from and to this host (container/podman.py): podman,
    and an OCI runtime that checkpoints (runc; crun only where built with CRIU)."""
    name = "ranks in containers"
    version = podman.Podman().version()
    if version is None:
        return Check(name, None, "podman is not installed: ranks run in containers elsewhere cannot move here, "
                                 "nor containers from here (apt-get install podman runc)", required=False)
    can = {rt: podman.runtime_cannot_checkpoint(rt) for rt in ("runc", "crun") if podman.runtime_path(rt)}
    good = sorted(rt for rt, why in can.items() if why is None)
    try:
        default = podman.Podman().info().get("host", {}).get("ociRuntime", {}).get("name", "")
    except PitstopError:
        default = ""
    if not good:
        return Check(name, False, f"podman {version}, but no OCI runtime here can checkpoint: "
                                  + "; ".join(f"{rt}: {why}" for rt, why in can.items()) + " (install runc)",
                     required=False)
    note = "" if default in good else (f"; podman's default runtime {default or '(unknown)'} cannot checkpoint: "
                                       f"run ranks' containers with --runtime {good[0]}")
    return Check(name, True, f"podman {version}; checkpointing runtimes: {', '.join(good)}{note}", required=False)


UNIT = "pitstop-agent.service"
UNIT_DIRS = ("etc/systemd/system", "run/systemd/system", "usr/local/lib/systemd/system", "usr/lib/systemd/system",
             "lib/systemd/system")
"""Where systemd looks for units, first wins (drop-ins `UNIT.d/*.conf` from all of them, by name)."""


def unit_exec_start(root: Path = Path("/")) -> tuple[Path, str] | None:
    """The installed agent unit and the program its ExecStart runs (drop-ins applied: an empty
    `ExecStart=` clears, the last one counts); None where no unit is installed."""
    unit = next((root / d / UNIT for d in UNIT_DIRS if (root / d / UNIT).is_file()), None)
    if unit is None:
        return None
    drop_ins = {f.name: f for d in reversed(UNIT_DIRS) for f in (root / d / f"{UNIT}.d").glob("*.conf")}
    cmd = ""
    for f in [unit, *(drop_ins[n] for n in sorted(drop_ins))]:
        section = ""
        for line in _read(str(f)).splitlines():
            line = line.strip()
            if line.startswith("["):
                section = line
            elif section == "[Service]" and line.startswith("ExecStart="):
                cmd = line.split("=", 1)[1].strip()
    return unit, cmd.lstrip("-@+!:").split()[0].strip("\"'") if cmd.strip("-@+!: ") else ""


def agent_unit(root: Path = Path("/")) -> Check:
    """Whether the installed agent unit runs a pitstop that exists.  The unit names
    /usr/local/bin/pitstop, where `pip install` as root puts it; a pitstop installed in a virtual
    environment is elsewhere, and the unit would fail at every start with only systemd's
    "No such file or directory" (status 203/EXEC) to say why."""
    name = "agent unit"
    found = unit_exec_start(root)
    here = Path(sys.executable).with_name("pitstop")
    me = str(here) if here.exists() else shutil.which("pitstop") or "/path/to/venv/bin/pitstop"
    if found is None:
        return Check(name, None, f"{UNIT} not installed (systemd/{UNIT} in the source)", required=False)
    unit, program = found
    if program and os.access(program, os.X_OK):
        return Check(name, True, f"{unit} runs {program}", required=False)
    return Check(name, False, f"{unit} runs {program or 'nothing (no ExecStart=)'}, which "
                 f"{'does not exist' if program else 'cannot start'}: the agent would fail at every start. This "
                 f"pitstop is {me}; point the unit at it with a drop-in: `systemctl edit {UNIT}`, then "
                 f"[Service] ExecStart= (empty: clears the unit's) and ExecStart={me} agent ... (the unit's "
                 "arguments), then `systemctl daemon-reload`", required=False)


def _carried(rt: runtime.CriuRuntime) -> Check:
    """Whether the CRIU pitstop carries runs (criu/patches/), and what the stock one costs where not."""
    name = "carried CRIU"
    if rt.carried:
        return Check(name, True, f"{len(rt.patches)} patches ({', '.join(p.split('-', 1)[0] for p in rt.patches)}; "
                     f"criu/patches/series): a forked child's copy-on-write pages are dumped once and stay shared",
                     required=False)
    built = runtime.carried_prefix() / "bin" / "criu"
    why = ("PITSTOP_CRIU_STOCK is set" if built.exists() and os.environ.get("PITSTOP_CRIU_STOCK", "") not in ("", "0")
           else "PITSTOP_CRIU names another" if built.exists()
           else "not built here (`pitstop provision-criu` builds it, and says why where it cannot)")
    return Check(name, None, f"{why}; the {rt.source} CRIU {rt.version_str} runs. Its cost: ranks with forked "
                 "workers (DataLoader) dump each worker's copy-on-write pages again (images about N + 1 times the "
                 "rank's memory) and restore them one 4 KiB read and compare at a time (a pause 2-3 x longer); "
                 "images this host dumps restore on any CRIU >= 4.2, and it cannot restore images of hosts that run "
                 "the carried one", required=False)


def _image_root() -> Check:
    """The default image directory's parents: only root may change them (safepath.py)."""
    from pitstop.agent.settings import IMAGE_ROOT
    from pitstop.safepath import UnsafePath, check_parents

    try:
        check_parents(IMAGE_ROOT)
    except UnsafePath as e:
        return Check("image directory", False, f"{e.message} ({e.action})")
    free = shutil.disk_usage("/run").free / 2**30 if Path("/run").is_dir() else 0.0
    return Check("image directory", True, f"{IMAGE_ROOT}/NAME: root's alone; the agent mounts its own tmpfs "
                 f"there (/run has {free:.1f} GiB free)", required=False)


def _procself(unshare: str | None) -> Check:
    """A worker is init of its own pid namespace under the host's /proc; CUDA needs the
    preloaded fix-up (native/procself.c) to find /proc/self/task/<its tid>."""
    from pitstop.launcher.environment import procself_path

    name = "worker /proc fix-up"
    lib = procself_path()
    if lib is None:
        return Check(name, False, "native/build/libpitstop_procself.so is missing: CUDA cannot initialise in "
                                  "a worker (error 304); run `make native`")
    if not unshare:
        return Check(name, None, f"{lib} (not tried: no unshare)", required=False)
    # In the namespace, cat is pid 1: /proc/1/comm must name cat, not the host's init.
    p = subprocess.run([unshare, "--pid", "--fork", "--kill-child", "env", f"LD_PRELOAD={lib}", "cat",
                        "/proc/1/comm"], capture_output=True, text=True, timeout=30)
    ok = p.returncode == 0 and p.stdout.strip() == "cat"
    return Check(name, ok, f"{lib}: a worker finds its own /proc entries" if ok else
                 f"{lib} does not take effect (read {p.stdout.strip() or p.stderr.strip()!r} for /proc/1/comm); "
                 "rebuild with `make native`")


def _worker_init() -> Check:
    """pitstop's init at the root of every worker's tree (native/pitinit.c, nsinit.py): without it
    a worker still runs and moves, but ranks sharing a directory take turns to be dumped."""
    from pitstop import nsinit

    name = "worker init"
    init = nsinit.binary()
    if init is None:
        return Check(name, False, "native/build/pitstop-init is missing: ranks sharing a working directory take "
                                  "turns to be dumped; run `make native`", required=False)
    root = nsinit.init_dirs()
    probe = root if root.exists() else next((p for p in root.parents if p.exists()), Path("/"))
    if not os.access(probe, os.W_OK):
        return Check(name, False, f"{root} cannot be made or written here: workers start without the init "
                                  "(PITSTOP_INIT_DIRS names another directory)", required=False)
    # What `pitstop run` does: the init makes the namespace and runs the command under itself.
    with tempfile.TemporaryDirectory(prefix="pitstop-doctor.") as d:
        work = Path(d) / "init"  # the init removes the directory it worked in when the command ends
        work.mkdir()
        try:
            p = subprocess.run([str(init), "--pid-namespace", str(work), "--", "true"], capture_output=True,
                               text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return Check(name, False, f"{init} could not start a command: {e}; run `make native`", required=False)
    if p.returncode != 0:
        return Check(name, False, f"{init} could not start a command in a PID namespace of its own: "
                                  f"{p.stderr.strip() or f'exit status {p.returncode}'}", required=False)
    return Check(name, True, f"{init} starts a command in a PID namespace of its own; its directories under "
                             f"{root}", required=False)


def _write_tracking() -> Check:
    """Whether a pre-copy can ask the kernel what a worker wrote (memory/writetrack.py), or must
    hash every page of the dump during the pause."""
    from pitstop.launcher.environment import writetrack_path
    from pitstop.memory import writetrack

    name = "pre-copy write tracking"
    why = writetrack.unavailable()
    if why:
        return Check(name, False, f"{why}: a pre-copy's delta hashes every page during the pause", required=False)
    if writetrack_path() is None:
        return Check(name, False, "native/build/libpitstop_writetrack.so is missing: a pre-copy's delta hashes "
                                  "every page during the pause; run `make native`", required=False)
    return Check(name, True, "available: async userfaultfd write-protection and PAGEMAP_SCAN "
                 "(PITSTOP_AGENT_PRECOPY_WRITE_TRACKING=0 to hash instead)", required=False)


def _incremental_dump() -> Check:
    """Whether CRIU can dump a pre-copied worker incrementally (criu/criutrack.py), or dumps all
    its memory during the pause for pitstop to cut the delta from."""
    from pitstop.criu import criutrack

    name = "incremental dump after a pre-copy"
    command, why = criutrack.command()
    if command is None:
        return Check(name, False, f"{why}: the pause holds CRIU's full dump of each pre-copied worker",
                     required=False)
    return Check(name, True, f"available: CRIU dumps only what changed since the pre-copy, told by "
                 f"{criutrack.LIBRARY} (PITSTOP_AGENT_PRECOPY_CRIU_PARENT=0 to dump whole)", required=False)


def _restore_fill() -> Check:
    """Whether CRIU's restore of a pre-copied worker fills its memory by UFFDIO_COPY
    (criu/criufill.py) or at the page-fault rate, each page zeroed first."""
    from pitstop.criu import criufill, runtime

    name = "restore fill by UFFDIO_COPY"
    try:
        why = criufill.unavailable(runtime.locate())
    except Exception as e:  # noqa: BLE001 - no CRIU: the CRIU check says so
        why = str(e)
    if not why and "[always]" in _read("/sys/kernel/mm/transparent_hugepage/enabled"):
        why = "transparent huge pages are `always` here, which faults fill faster; the library stands aside"
    if why:
        return Check(name, False, f"{why}: restores fill memory at CRIU's page-fault rate", required=False)
    return Check(name, True, f"available: {criufill.LIBRARY} copies a pre-copied worker's pages into place "
                 "(PITSTOP_AGENT_RESTORE_UFFD_FILL=0 for CRIU's own read)", required=False)


def _lock_tables_left(rt: runtime.CriuRuntime) -> Check:
    """CRIU lock tables that outlived their dump (pitstop lifts its own at commit, rollback and
    agent start; these come from other CRIU users, or an agent whose state was wiped).

    Each one costs every later dump inside the pause: with 24 of them, a process holding 8 TCP
    connections stayed frozen 0.123 s in its dump against 0.011 s on a clean ruleset (9 ms per
    connection against 0.3 ms: bench/lock_tables.py, docs/benchmarks.md); and each keeps
    dropping packets of the connections it names, so a new connection that reuses one of their
    addresses and ports is silently dropped.  Not deleted here: one may belong to a dump under way."""
    try:
        left = netlock.tables(rt)
    except (OSError, subprocess.SubprocessError) as e:
        return Check("criu lock tables left", None, f"cannot list the ruleset: {e}", required=False)
    if not left:
        return Check("criu lock tables left", True, "none", required=False)
    names = ", ".join(f"{f} {n}" for f, n in left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
    return Check("criu lock tables left", False,
                 f"{len(left)} ({names}): each slows every later dump's network lock inside the pause and drops "
                 "packets of the connections it names; when no move and no other CRIU dump is under way, remove "
                 "them with `nft delete table <family> <name>`", required=False)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _huge_tmpfs() -> Check:
    """Whether the agent's image mount can have huge pages (agent/imagefs.py)."""
    try:
        knob = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        return Check("huge-page image tmpfs", False, "this kernel has no transparent huge pages for tmpfs: "
                     "images stay in 4 KiB pages (slower dumps and restores)", required=False)
    if "[deny]" in knob:
        return Check("huge-page image tmpfs", False, "shmem_enabled is `deny`: tmpfs mounts get no huge pages "
                     "(echo never > /sys/kernel/mm/transparent_hugepage/shmem_enabled allows them)", required=False)
    return Check("huge-page image tmpfs", True, "available: the agent mounts its image directory with "
                 "huge=within_size (PITSTOP_AGENT_IMAGE_MOUNT=off to keep it as it is)", required=False)


def _exit_status_kept() -> Check:
    """Whether a restored worker's exit status survives a restart of its agent (agent/exitkeeper.py)."""
    from pitstop.agent import exitkeeper

    if exitkeeper.supported():
        return Check("exit status after an agent restart", True, "kept: a pidfd tells a non-parent "
                     "(PIDFD_INFO_EXIT)", required=False)
    return Check("exit status after an agent restart", False, "lost: this kernel cannot tell a non-parent "
                 "(PIDFD_INFO_EXIT needs Linux 6.15); a worker restored here that ends after its agent "
                 "restarted is reported with its status unknown", required=False)


def gpu_checks() -> list[Check]:
    out: list[Check] = []
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        drv = pynvml.nvmlSystemGetDriverVersion()
        names = {pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(n)}
        out.append(Check("gpus", None, f"{n} x {', '.join(map(str, names))}, driver {drv}", required=False))
    except Exception as e:  # noqa: BLE001 - NVML raises many types when absent
        out.append(Check("gpus", None, f"not present ({type(e).__name__})", required=False))
    from pitstop.gpu.driver import NoDriver, load

    try:
        v = load().version()
        out.append(Check("cuda checkpoint API", True, f"driver API CUDA {v // 1000}.{v % 1000 // 10}",
                         required=False))
    except NoDriver as e:
        out.append(Check("cuda checkpoint API", None, f"not present ({e}); CPU-only workers can still move",
                         required=False))
    return out


def ready(checks: list[Check]) -> tuple[bool, list[str]]:
    reasons = [f"{c.name}: {c.detail}" for c in checks if c.required and c.ok is False]
    return not reasons, reasons
