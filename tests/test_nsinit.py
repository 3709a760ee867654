"""native/pitinit.c, the init of every worker's PID namespace (pitstop/nsinit.py): the command
runs under it as it would alone (working directory, exit status, signals), the init works in a
directory of its own that goes when the command ends, and `pitstop run` starts every worker so.
Real processes in real PID namespaces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pitstop import nsinit
from pitstop.dev.devcluster import pitstop_cmd
from pitstop.proc import proctree

from .helpers import until

INIT = Path(__file__).resolve().parent.parent / "native" / "build" / "pitstop-init"
pytestmark = pytest.mark.timeout(120)


def _under_init(tmp_path: Path, *cmd: str, **kw) -> tuple[subprocess.Popen, Path]:
    d = tmp_path / "init.0"
    d.mkdir()
    p = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", str(INIT), str(d), "--", *cmd],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, **kw)
    return p, d


def _root(p: subprocess.Popen) -> int:
    """The namespace's init, once `setsid` has become it (exec)."""
    return until(lambda: next((c for c in proctree.children(p.pid) if nsinit.is_init(c)), None), 10,
                 "the namespace's init")


def test_the_command_keeps_its_directory_and_exit_status_and_the_init_works_in_its_own(tmp_path):
    p, d = _under_init(tmp_path, sys.executable, "-c", "import os, time; print(os.getpid(), os.getcwd(), flush=True);"
                                                       "time.sleep(1); raise SystemExit(3)")
    root = _root(p)
    pid, cwd = p.stdout.readline().split()  # the command runs: the init is in its directory already
    assert nsinit.is_init(root) and os.readlink(f"/proc/{root}/cwd") == str(d)
    p.communicate(timeout=30)
    assert (pid, cwd) == ("2", str(tmp_path))  # not the namespace's init any more; the caller's directory
    assert p.returncode == 3 and not d.exists()  # the init removed its directory on the way out


def test_a_forwarded_signal_does_what_it_does_outside_a_namespace(tmp_path):
    """As its namespace's init the command ignored signals it had no handler for."""
    plain, _ = _under_init(tmp_path, "sleep", "60")
    root = _root(plain)
    until(lambda: proctree.children(root), 10, "the command")
    os.kill(root, signal.SIGTERM)
    assert plain.wait(30) == 128 + signal.SIGTERM
    (tmp_path / "init.0").mkdir()
    # Short sleeps, as a real main loop: CPython runs a handler only between bytecodes, so a SIGTERM
    # landing between the print and a long sleep's syscall would wait out the whole sleep.
    handled = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", str(INIT), str(tmp_path / "init.0"), "--",
                                sys.executable, "-c", "import signal, sys, time\n"
                                "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
                                "print('ready', flush=True)\nwhile True: time.sleep(0.1)"],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert handled.stdout.readline().strip() == "ready"
        os.kill(_root(handled), signal.SIGTERM)
        assert handled.wait(30) == 7
    finally:
        if handled.poll() is None:
            for p in reversed(proctree.tree(handled.pid)):
                os.kill(p, signal.SIGKILL)
            handled.wait(10)


@pytest.mark.slow
def test_orphans_are_reaped_and_a_missing_command_is_named(tmp_path):
    p, _ = _under_init(tmp_path, "sh", "-c", "(sleep 0.2 &); sleep 3")  # the inner sleep is orphaned
    root = _root(p)
    time.sleep(1.5)
    zombies = [c for c in proctree.children(root) if proctree.state(c) == "Z"]
    assert not zombies and len(proctree.children(root)) == 1  # only the command is left
    assert p.wait(30) == 0
    r = subprocess.run([str(INIT), str(tmp_path), "--", "no-such-command-here"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 127 and "cannot run no-such-command-here" in r.stderr
    assert subprocess.run([str(INIT)], capture_output=True, text=True, timeout=30).returncode == 125


def test_only_directories_named_as_a_launcher_names_them_are_made_for_a_restore(tmp_path):
    ok = str(tmp_path / "other-host" / "pitstop-init.job.3.abc123")  # wherever the source's launcher put it
    nsinit.ensure(ok)
    assert Path(ok).is_dir()
    for bad in (str(tmp_path / "elsewhere"), str(tmp_path / "pitstop-init.x" / ".."), "/etc/x",
                "relative/pitstop-init.job.3.abc", str(tmp_path / "pitstop-init.a" / ".." / "pitstop-init.b"),
                str(tmp_path / "pitstop-init.")):
        with pytest.raises(ValueError):
            nsinit.ensure(bad)
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "pitstop-init.a").exists()
    nsinit.remove_unused(ok)
    assert not Path(ok).exists()


def test_the_launcher_registers_the_init_only_once_it_has_moved_into_its_directory(tmp_path):
    """The launcher registered the init as soon as it led its session, before it moved into its
    directory (native/pitinit.c: setsid, chdir, fork): on a busy machine the agent then read the
    launcher's directory, the rank's snapshots named no init directory, and its restore on a spare
    failed with CRIU's "Can't open cwd" (CI).  A stand-in init that is slow to move in: bash, made a
    session leader by setsid, waiting half a second on a FIFO (no child to give it away)."""
    from pitstop.launcher.run import _find_ns_init

    own = tmp_path / "pitstop-init.job.0.abc123"
    own.mkdir()
    os.mkfifo(tmp_path / "fifo")
    init = f"exec 3<>{tmp_path}/fifo; read -t 0.5 -u 3; cd {own}; sleep 30 & wait"
    p = subprocess.Popen(["bash", "-c", f"setsid bash -c '{init}' & wait"], cwd=tmp_path)
    try:
        root = _find_ns_init(p)
        assert os.readlink(f"/proc/{root}/cwd") == str(own)
    finally:
        proctree.kill_tree(p.pid)
        p.wait(10)


def test_without_pitstops_init_the_command_is_the_init_and_is_found_at_once(tmp_path):
    """`pitstop run` without native/build/pitstop-init starts `unshare --pid --fork setsid CMD`: CMD
    is the namespace's init and may fork nothing; it is found without waiting for a child."""
    from pitstop.launcher.run import _find_ns_init

    p = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", "sleep", "30"], cwd=tmp_path)
    try:
        t0 = time.monotonic()
        root = _find_ns_init(p, timeout_s=5, forks=False)
        assert time.monotonic() - t0 < 4
        # the session leader found may still be `setsid` a moment before it becomes the command (exec)
        until(lambda: os.path.basename(os.readlink(f"/proc/{root}/exe")) == "sleep", 10, "the command, exec'd")
    finally:
        proctree.kill_tree(p.pid)
        p.wait(10)


def test_with_pid_namespace_the_init_makes_it_and_a_killed_tree_ends_without_a_word(tmp_path):
    """`pitstop run`'s start: the init makes the namespace and leads its session; when a move
    kills the tree, the waiter outside exits 128 + 9 and prints nothing into the job's stderr
    (util-linux unshare printed "sigprocmask unblock failed" there)."""
    d = tmp_path / "init.0"
    d.mkdir()
    p = subprocess.Popen([str(INIT), "--pid-namespace", str(d), "--", sys.executable, "-c",
                          "import os; print(os.getpid(), os.getsid(0), flush=True); import time; time.sleep(60)"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        root = _root(p)
        pid, sid = p.stdout.readline().split()  # once the command runs, the init has set itself up
        assert (pid, sid) == ("2", "1")  # the command, under the namespace's init, in the init's session
        assert os.readlink(f"/proc/{root}/ns/pid") != os.readlink("/proc/self/ns/pid")
        assert proctree.session_id(root) == root and os.readlink(f"/proc/{root}/cwd") == str(d)
        os.kill(root, signal.SIGKILL)  # as a move ends the source's tree
        assert p.wait(30) == 128 + signal.SIGKILL
        assert p.stderr.read() == ""
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_with_pid_namespace_a_refused_namespace_is_named_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    r = subprocess.run(["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin", "--",
                        str(INIT), "--pid-namespace", str(tmp_path), "--", "touch", str(marker)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 125 and "cannot make a PID namespace" in r.stderr and "CAP_SYS_ADMIN" in r.stderr, r
    assert not marker.exists()


@pytest.mark.e2e
def test_pitstop_run_starts_the_worker_under_the_init_and_passes_signals_on(cluster):
    cluster.start_agent("host-a")
    p = subprocess.Popen([*pitstop_cmd(), "run", "--job", "sig", "--rank", "0", "--agent",
                          cluster.agents["host-a"].url, "--", "sleep", "120"],
                         env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        w = cluster.wait_registered("host-a", "sig.0")
        root = w.root_pid
        assert nsinit.is_init(root)
        d = w.init_dir
        assert d and Path(d).parent == cluster.root / "init" and os.readlink(f"/proc/{root}/cwd") == d
        assert Path(d).name.startswith("pitstop-init.sig.0.")
        os.kill(p.pid, signal.SIGTERM)  # to the launcher, as a scheduler would
        assert p.wait(60) == 128 + signal.SIGTERM, p.stderr.read()[-2000:]
        assert not Path(d).exists()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.mark.e2e
def test_pitstop_run_without_the_init_built_registers_the_command_as_the_init(cluster, tmp_path):
    """Without native/build/pitstop-init the command is its namespace's init and forks nothing: the
    launcher registers it without waiting for a child of its own (it waited, and gave up, once)."""
    cluster.start_agent("host-a")
    p = subprocess.Popen([*pitstop_cmd(), "run", "--job", "plain", "--rank", "0", "--agent",
                          cluster.agents["host-a"].url, "--", "sleep", "120"],
                         env={**cluster.env(), "PITSTOP_INIT": str(tmp_path / "absent")},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        w = cluster.wait_registered("host-a", "plain.0")
        assert not nsinit.is_init(w.root_pid) and not w.init_dir
        os.kill(p.pid, signal.SIGTERM)  # its end goes as unshare's does (its exit status, not this test's)
        p.wait(60)
        assert "pitstop-init is not built" in p.stderr.read()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_a_launcher_that_cannot_find_the_init_ends_the_whole_tree_it_started(tmp_path):
    """When `pitstop run` gives up on finding the namespace's init, it kills what it started.  It
    killed only its direct child (the outer unshare or init), and the command's tree, in its own
    PID namespace, ran on with nobody to end it.  Run in a process of its own (the launcher limits
    the caller's system calls for the worker), with the search made to fail once the tree runs."""
    script = f"""
import json, sys, time
from pitstop.errors import PitstopError
from pitstop.launcher import run as launcher
from pitstop.proc import proctree

class Agent:
    def info(self, timeout=None):
        return {{}}
    def close(self):
        pass

def comm(pid):
    try:
        return open(f"/proc/{{pid}}/comm").read().strip()
    except OSError:
        return None

def never(p, timeout_s=10.0, forks=True):
    end = time.monotonic() + 10
    while time.monotonic() < end:
        tree = proctree.tree(p.pid)
        if any(comm(t) == "sleep" for t in tree):
            open({str(tmp_path / "tree.json")!r}, "w").write(json.dumps(tree))
            break
        time.sleep(0.01)
    raise PitstopError("the command did not start in its own PID namespace")

launcher._find_ns_init = never
launcher.agent_client = lambda url: Agent()
sys.exit(launcher.run(["sleep", "60"], job="leak", agent_url="http://127.0.0.1:9", rank=0))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, WORLD_SIZE="1"))
    assert r.returncode == 125, r.stderr
    assert "could not register with the agent" in r.stderr
    tree = json.loads((tmp_path / "tree.json").read_text())
    left = [t for t in tree if proctree.exists(t)]
    proctree.kill_all(left)  # a test leaves nothing behind, failed or not
    assert len(tree) >= 3  # unshare or the outer init, the namespace's init, the command
    assert not left, "the command's tree was left running"
