import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from pitstop.criu import netlock, runtime
from pitstop.dev import devleases
from pitstop.dev.devcluster import LocalCluster
from pitstop.proc import proctree

from .postgres import pg_url, postgres  # noqa: F401 - the fixtures of the tests that need a real PostgreSQL

_suite_lock_fd: int | None = None

# The suite's jobs ask for snapshots every few seconds to reach the case under test within its
# deadline; on a busy machine a snapshot pauses a job seconds, and the coordinator would lengthen
# their interval to keep the pause share under 5 % (coordinator/snapshots.py, effective) and leave
# the test waiting a minute for a snapshot.  That lengthening has its own test
# (tests/test_snapshot_logic.py); every other test runs without it.
os.environ.setdefault("PITSTOP_COORDINATOR_SNAPSHOT_PAUSE_SHARE", "1")

# Every rank the suite starts computes on one intra-op thread, as torchrun starts the ranks it runs
# side by side (OMP_NUM_THREADS=1 per process).  torch's default is a thread per core, and an
# OpenMP thread spins between parallel regions: four ranks stepping every 50 ms kept both cores
# of a 2-core machine spinning, so every agent, CRIU and coordinator under test ran on what was
# left (the demo scenario took 41 s instead of 20 s; same final parameters).  A test that needs
# several threads in a rank sets its own.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_LONGEST = ("test_recovery_e2e.py", "test_recovery_orders_e2e.py", "test_pause_owner_e2e.py", "test_remote_post_copy.py",
            "test_shim_e2e.py", "test_security_replays.py", "test_worker_network_e2e.py", "test_precopy_e2e.py",
            "test_coordinator_e2e.py", "test_slurm_e2e.py", "test_gpu_script.py")


def _is_worker(config) -> bool:  # noqa: ANN001
    return hasattr(config, "workerinput")


def pytest_configure(config):  # noqa: ANN001, ANN201
    """On parallel workers (`make test TEST_WORKERS=2`, pytest-xdist) each takes its own part of the
    free ports and subnets (dev/devleases.py, share), so that two workers never choose the same one
    a moment apart; every process a test starts inherits it."""
    if _is_worker(config):
        wi = config.workerinput
        os.environ[devleases.SHARE] = f"{int(wi['workerid'][2:])}/{int(wi['workercount'])}"


def pytest_sessionstart(session):  # noqa: ANN001, ANN201
    """One run of this suite per machine at a time.  Its leak checks take what appeared during
    the run and is still there at its end for the run's own leftovers, and remove it: a second
    run at the same time would have its agents' mounts and network namespaces removed under it,
    and fail both runs in ways that point nowhere.  So the second one stops at once, saying why."""
    global _suite_lock_fd
    if _is_worker(session.config):
        return  # the run's controller holds the lock and makes the run's leak checks
    d = devleases.registry()
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = d / "test-suite.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
        finally:
            os.close(fd)
        pytest.exit(f"another run of pitstop's test suite is under way on this machine ({holder}); its "
                    f"leak checks and this run's would remove each other's agents' mounts and namespaces. "
                    f"Wait for it to end (or stop it), then run again. Lock: {path}", returncode=3)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}, started {proctree.start_time(os.getpid())}\n".encode(), 0)
    _suite_lock_fd = fd  # held until this process exits
    session.config.stash[_BEFORE] = {"tables": _lock_tables(), "mounts": _mount_points()}


_BEFORE = pytest.StashKey[dict]()


def pytest_sessionfinish(session, exitstatus):  # noqa: ANN001, ANN201
    """The whole run's leak checks, once every test (on every worker) has ended: what appeared
    during the run and is still there is its leftover, removed, and the run fails saying what."""
    if _is_worker(session.config) or _BEFORE not in session.config.stash:
        return
    before = session.config.stash[_BEFORE]
    problems = _tables_left(before["tables"]) + _mounts_left(before["mounts"])
    if problems:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        for p in problems:
            if tr is not None:
                tr.write_line(f"LEAK: {p}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _foreign_paths() -> list[str]:
    """What the live local clusters of other processes (a bench, the demo) hold: not this run's to
    remove or to count as its leftovers (dev/devleases.py)."""
    out: list[str] = []
    for lease in devleases.held_by_others():
        out += [str(p).rstrip("/") + "/" for p in lease.get("paths", [])]
        if lease.get("netns_prefix"):
            out += [f"{ns}/{lease['netns_prefix']}" for ns in IPROUTE_NETNS_DIRS]
    return out


def _e2e_ready() -> str | None:
    if os.geteuid() != 0:
        return "end-to-end tests need root (CRIU)"
    try:
        runtime.locate()
    except Exception as e:  # noqa: BLE001
        return f"CRIU not available: {e} (run `make test`, which provisions it)"
    return None


def pytest_collection_modifyitems(config, items):
    # Parallel workers (`make test`: --dist loadfile) take whole modules, the longest first: a worker
    # that took one of them last would end the run alone.
    items.sort(key=lambda it: _LONGEST.index(it.path.name) if it.path.name in _LONGEST else len(_LONGEST))
    reason = _e2e_ready()
    if reason is None:
        return
    if os.environ.get("CI"):
        return  # in CI a missing CRIU must fail loudly, not skip
    for it in items:
        if "e2e" in it.keywords:
            it.add_marker(pytest.mark.skip(reason=reason))


def _leftovers(marker: str) -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            out.append(f"{pid}: {cmd[:160]}")
    return out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ANN001, ANN201
    """Remember each phase's report on the test item, so fixtures can tell whether it failed."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


def _keep_logs(root: Path, dest: Path, limit: int = 20 << 20) -> None:
    """Copy a failed test's logs (ranks, agents, coordinator) out of the cluster before it is removed:
    rare failures (such as the MKL race of docs/reliability.md) are diagnosed from the step lines."""
    for f in (Path(d) / n for d, _, names in os.walk(root) for n in names):  # walk: a vanished directory is skipped
        try:
            if f.is_file() and (f.suffix == ".log" or f.suffix in (".stdout", ".stderr")) and f.stat().st_size < limit:
                target = dest / f.relative_to(root)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, target)
        except OSError:  # removed meanwhile (a running agent's images): the others are kept
            continue


@pytest.fixture
def cluster(tmp_path_factory, request):
    """A LocalCluster that must leave no process, directory or tmpfs file behind.  If the test
    failed, its logs are kept under <pytest's base temp>/failed-logs/<test name>."""
    c = LocalCluster(root=tmp_path_factory.mktemp("cluster"))
    nets_before = _worker_nets(c.worker_netns_prefix)
    try:
        yield c
    finally:
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            dest = tmp_path_factory.getbasetemp() / "failed-logs" / request.node.name
            _keep_logs(c.root, dest)
            if c.shm.exists():  # CRIU's own logs (dump.log, restore.log) beside the images
                _keep_logs(c.shm, dest / "images")
            print(f"\nlogs of the failed test kept in {dest}")
        c.close()
        left = _leftovers(str(c.root))
        for ln in left:  # clean up anyway, then fail
            try:
                os.kill(int(ln.split(":")[0]), 9)
            except ProcessLookupError:
                pass
        assert not left, f"processes left behind: {left}"
        assert not c.shm.exists(), f"{c.shm} left behind"
        nets = _worker_nets(c.worker_netns_prefix) - nets_before  # named here, not by a later test
        for n in nets:
            subprocess.run(["ip", "netns", "delete", n], capture_output=True, timeout=10)
        assert not nets, f"worker network namespaces left behind: {sorted(nets)}"


def _worker_nets(prefix: str) -> set[str]:
    """The workers' network namespaces of one cluster (its own prefix: others may run beside it)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return {ln.split()[0] for ln in out.splitlines() if ln.startswith(prefix)}


def _lock_tables() -> set[tuple[str, str]]:
    try:
        rt = runtime.locate()
    except Exception:  # noqa: BLE001
        return set()
    if not rt.nft or os.geteuid() != 0:
        return set()
    return set(netlock.tables(rt))


def _tables_left(before: set[tuple[str, str]]) -> list[str]:
    """Every dump's nftables lock must be lifted by commit or rollback."""
    left = _lock_tables() - before
    for family, name in left:
        subprocess.run([runtime.locate().nft, "delete", "table", family, name], capture_output=True)
    return [f"CRIU network-lock tables left behind: {sorted(left)}"] if left else []


# iproute2 bind-mounts its namespace directory on itself at the first `ip netns add` after boot
# and never unmounts it: the suite may be the first to make a namespace (CI on a machine just
# booted), so that mount, empty, is iproute2's, not a leftover.  A namespace's own mount under it
# still is one.
IPROUTE_NETNS_DIRS = ("/run/netns", "/var/run/netns")


def _mount_points() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4] for line in f}


def _mounts_left(before: set[str]) -> list[str]:
    """Agents mount their image directories (agent/imagefs.py): none may outlive the suite."""
    theirs = _foreign_paths()
    left = {p for p in _mount_points() - before if not any((p + "/").startswith(f) for f in theirs)}
    for d in IPROUTE_NETNS_DIRS:
        if d in left and not os.listdir(d):
            left.discard(d)
            subprocess.run(["umount", "-l", d], capture_output=True)  # as the suite found it
    for p in sorted(left, key=len, reverse=True):
        subprocess.run(["umount", "-l", p], capture_output=True)
    return [f"mounts left behind: {sorted(left)}"] if left else []


@pytest.fixture(scope="session")
def _suite_tmpdir(tmp_path_factory):
    """A temporary directory only this suite writes to, as TMPDIR for it and every process it
    starts: what a test leaves there (a tool's mkdtemp nobody removes, as torchrun's
    torchelastic_* log directories were) is then its own, found by the check below, not mixed
    with the rest of the machine's /tmp."""
    tmp_path_factory.getbasetemp()  # pytest's own directories stay where pytest puts them
    d = Path(tempfile.mkdtemp(prefix="pitstop-suite-tmp-"))
    d.chmod(0o1777)  # as /tmp: a test's process that drops root still has a temporary directory
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(d)
    # The workers' init directories (nsinit.py) of tests that launch outside a local cluster (which
    # keeps its own): here, not in the machine's /run/pitstop, and checked after each test below.
    (d / INIT_DIRS).mkdir()
    os.environ["PITSTOP_INIT_DIRS"] = str(d / INIT_DIRS)
    tempfile.tempdir = None  # tempfile caches the directory it chose
    try:
        yield d
    finally:
        os.environ.pop("PITSTOP_INIT_DIRS", None)
        if old is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old
        tempfile.tempdir = None
        shutil.rmtree(d, ignore_errors=True)


# Caches a tool keeps in $TMPDIR on purpose, for every later run (torch's compile cache, which
# torchrun's import of torch makes), and the session's own PostgreSQL server (tests/postgres.py,
# made by the first test that needs it, stopped and removed at the session's end): not a test's
# leftover; the suite's directory goes at its end.
TMP_CACHES = ("torchinductor_", "pitstop-pg-")
INIT_DIRS = "init"


@pytest.fixture(autouse=True)
def _no_temp_files_left(_suite_tmpdir):
    before = set(os.listdir(_suite_tmpdir))
    yield
    left = sorted(n for n in set(os.listdir(_suite_tmpdir)) - before if not n.startswith(TMP_CACHES))
    for name in left:  # remove anyway, then fail
        p = _suite_tmpdir / name
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    inits = sorted(os.listdir(_suite_tmpdir / INIT_DIRS))
    for name in inits:
        shutil.rmtree(_suite_tmpdir / INIT_DIRS / name, ignore_errors=True)
    assert not left, f"temporary files left behind in $TMPDIR: {left}"
    assert not inits, f"workers' init directories left behind: {inits}"
