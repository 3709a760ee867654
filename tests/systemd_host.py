"""A real systemd, as PID 1 of its own PID, mount and cgroup namespaces, for end-to-end tests
of the units in systemd/.

Why: PID 1 of this VM (and of CI) is not systemd, so without this the units could only be
linted, and what matters about them (Type=notify readiness, the watchdog, the sandbox CRIU
has to work in, KillMode=process, restored workers in scopes of their own over D-Bus) would
never run.  This boots the distribution's own systemd and dbus-daemon in a container of
namespaces: the mount namespace gets its own /run, /dev/shm, /var/lib, /etc/systemd/system
and a unit directory holding only the units a test installs, so nothing of the host's is
started and nothing written there outlives the test.  The network namespace is the host's
(the services listen on loopback ports the test picks), so agents and ranks outside talk to
those inside as they would across hosts.

Cleanup: SIGKILL to the namespace's PID 1 takes every process in it down (the kernel's rule
for a PID namespace), the mounts go with the mount namespace, and the cgroup made for it is
removed, depth first.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

HOST_UNITS = Path("/usr/lib/systemd/system")
SYSTEMD = Path("/lib/systemd/systemd")
STUB_TARGETS = ("sysinit", "basic", "sockets", "multi-user", "network-online", "network", "shutdown")


def unavailable() -> str | None:
    """Why a systemd namespace cannot be booted here, or None."""
    if os.geteuid() != 0:
        return "needs root (namespaces, cgroups)"
    for p in (SYSTEMD, HOST_UNITS / "dbus.socket", HOST_UNITS / "dbus.service", Path("/usr/bin/dbus-daemon")):
        if not p.exists():
            return f"{p} is not installed (packages systemd and dbus)"
    for tool in ("unshare", "nsenter", "busctl"):
        if not shutil.which(tool):
            return f"{tool} is not installed"
    return None


def _cgroup_roots() -> list[Path]:
    """Where a cgroup for the namespace is made: the unified hierarchy, and systemd's named v1
    hierarchy where the host runs the hybrid layout."""
    base = Path("/sys/fs/cgroup")
    if (base / "cgroup.controllers").exists():
        return [base]  # pure cgroup2
    return [p for p in (base / "unified", base / "systemd") if p.is_dir()]


def _private_tmps() -> set[Path]:
    """The PrivateTmp= directories of pitstop's units that exist now."""
    return {d for top in ("/tmp", "/var/tmp") for d in Path(top).glob("systemd-private-*-pitstop-*.service-*")}


def installed_host(root: Path, interpreter_prefix: str, site_packages: str, checkout: Path,
                   etc_files: dict[str, str]) -> str:
    """Shell lines (for `SystemdHost(prepare=...)`) that make the namespace look like a host where
    pitstop is installed as the units expect: /usr/local/bin/pitstop and /etc/pitstop/*.env.

    Why: the units must run as shipped, ExecStart= included, and a test's interpreter and checkout
    usually live under /root or /tmp, which the coordinator's sandbox hides (ProtectHome=yes,
    PrivateTmp=yes, a dynamic user).  So the interpreter, its site-packages and the checkout are
    bind-mounted under /usr/local/lib/pitstop-test (binds stay visible whatever hides their source
    path), and /etc and /usr/local get overlays whose upper layers live on this namespace's /run:
    the host's own /etc and /usr/local are read, never written.
    """
    stage = root / "etc-stage"
    for name, text in etc_files.items():
        (stage / name).parent.mkdir(parents=True, exist_ok=True)
        (stage / name).write_text(text)
        (stage / name).chmod(0o600)
    lib = "/usr/local/lib/pitstop-test"
    launcher = (f"#!/bin/sh\nexport PYTHONPATH={lib}/checkout/service:{lib}/site\n"
                f"export LD_LIBRARY_PATH={lib}/python/lib\n"
                f"exec {lib}/python/bin/python3 -m pitstop.cli \"$@\"\n")
    (root / "pitstop-launcher").write_text(launcher)
    lines = ["mkdir -p /run/.overlay/etc/up /run/.overlay/etc/work /run/.overlay/local/up /run/.overlay/local/work",
             "mount -t overlay overlay -o lowerdir=/etc,upperdir=/run/.overlay/etc/up,workdir=/run/.overlay/etc/work /etc",
             "mount -t overlay overlay -o lowerdir=/usr/local,upperdir=/run/.overlay/local/up,"
             "workdir=/run/.overlay/local/work /usr/local",
             f"mkdir -p /etc/pitstop {lib}/python {lib}/site {lib}/checkout /usr/local/bin",
             f"cp -a {stage}/. /etc/pitstop/",
             f"mount --bind -o ro {interpreter_prefix} {lib}/python",
             f"mount --bind -o ro {site_packages} {lib}/site",
             f"mount --bind -o ro {checkout} {lib}/checkout",
             f"install -m 0755 {root / 'pitstop-launcher'} /usr/local/bin/pitstop"]
    return "".join(line + "\n" for line in lines)


class SystemdHost:
    """One booted systemd.  `units`: file name (or "name.d/drop-in.conf") -> text."""

    def __init__(self, root: Path, units: dict[str, str], boot_timeout_s: float = 30.0,
                 prepare: str = "") -> None:
        """`prepare`: shell lines run inside the namespaces before systemd starts, with /run and
        /var/lib already private (see `installed_host`)."""
        self.root = root
        self.units = units
        self.prepare = prepare
        self.boot_timeout_s = boot_timeout_s
        self.cgroup = f"pitstop-test-{secrets.token_hex(4)}"
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None  # systemd, as this (the host's) PID namespace sees it

    def _write_units(self) -> Path:
        d = self.root / "units"
        d.mkdir(parents=True)
        for name in ("dbus.socket", "dbus.service"):
            shutil.copy(HOST_UNITS / name, d / name)
        for t in STUB_TARGETS:
            (d / f"{t}.target").write_text(f"[Unit]\nDescription={t} (test stub)\n")
        for name, text in self.units.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_text(text)
        (d / "pitstop-test.target").write_text("[Unit]\nDescription=boot target of the test\nWants=dbus.socket\n")
        return d

    def _boot_script(self, units: Path) -> Path:
        two = _cgroup_roots() != [Path("/sys/fs/cgroup")]
        cg = ("mount -t tmpfs -o mode=755 tmpfs /sys/fs/cgroup\n"
              "mkdir /sys/fs/cgroup/unified /sys/fs/cgroup/systemd\n"
              "mount -t cgroup2 cgroup2 /sys/fs/cgroup/unified\n"
              "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd\n") if two else \
             "mount -t cgroup2 cgroup2 /sys/fs/cgroup\n"
        s = self.root / "boot.sh"
        s.write_text(
            "set -e\n"
            "mount --make-rprivate /\n"
            "mount -t tmpfs -o mode=755 tmpfs /run\n"
            "mkdir -p /run/systemd/system\n"
            "mount -t tmpfs -o mode=1777 tmpfs /dev/shm\n"
            "mount -t tmpfs -o mode=755 tmpfs /var/lib\n"
            + self.prepare + cg +
            f"mount --bind {units} {HOST_UNITS}\n"
            "mount -t tmpfs -o mode=755 tmpfs /etc/systemd/system\n"
            f"exec env container=pitstop-test {SYSTEMD} --system --unit=pitstop-test.target "
            "--log-target=console --log-level=notice\n")
        return s

    def start(self) -> "SystemdHost":
        self._private_before = _private_tmps()
        units = self._write_units()
        script = self._boot_script(units)
        join = "; ".join(f"mkdir -p {r}/{self.cgroup} && echo $$ > {r}/{self.cgroup}/cgroup.procs"
                         for r in _cgroup_roots())
        log = open(self.root / "systemd.log", "ab")
        self.proc = subprocess.Popen(
            ["bash", "-c", f"{join}; exec unshare --pid --mount --cgroup --fork --mount-proc bash {script}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        end = time.monotonic() + self.boot_timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"systemd did not boot: {self.log_tail()}")
            if self.pid is None:
                try:
                    kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
                except OSError:
                    kids = []
                if kids and Path(f"/proc/{kids[0]}/exe").resolve().name == "systemd":
                    self.pid = int(kids[0])
            if self.pid is not None:
                state = self.ctl("is-system-running", check=False).stdout.strip()
                if state in ("running", "degraded"):
                    return self
            time.sleep(0.1)
        raise TimeoutError(f"systemd did not come up within {self.boot_timeout_s} s: {self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return (self.root / "systemd.log").read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def enter(self, *cmd: str, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run a command inside the namespaces (systemctl, busctl, cat of a cgroup file)."""
        assert self.pid is not None
        p = subprocess.run(["nsenter", "-t", str(self.pid), "-m", "-p", "-C", *cmd], capture_output=True,
                           text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr or p.stdout}")
        return p

    def ctl(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return self.enter("systemctl", "--no-pager", *args, check=check, timeout=timeout)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.ctl("show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait_active(self, unit: str, timeout_s: float = 60.0, since_restarts: int | None = None) -> dict[str, str]:
        """Until `unit` is active (for Type=notify: it sent READY=1), with more than
        `since_restarts` restarts if given."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            s = self.show(unit, "ActiveState", "SubState", "MainPID", "NRestarts", "Result")
            if s.get("ActiveState") == "active" and s.get("SubState") == "running" and \
                    (since_restarts is None or int(s.get("NRestarts", "0")) > since_restarts):
                return s
            if s.get("ActiveState") == "failed":
                raise AssertionError(f"{unit} failed: {s}\n{self.journal(unit)}")
            time.sleep(0.1)
        raise TimeoutError(f"{unit} not active within {timeout_s} s: {self.show(unit, 'ActiveState', 'SubState')}\n"
                           f"{self.journal(unit)}")

    def journal(self, unit: str) -> str:
        """What the unit printed: the services log to the console of this systemd (no journald here)."""
        return self.log_tail()

    def close(self) -> None:
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)  # PID 1 of the namespace: every process in it goes too
            except ProcessLookupError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        for r in _cgroup_roots():
            top = r / self.cgroup
            end = time.monotonic() + 20
            while top.exists() and time.monotonic() < end:
                for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
                    try:
                        d.rmdir()
                    except OSError:
                        pass  # its last process is still exiting: again in a moment
                if top.exists():
                    time.sleep(0.1)
            assert not top.exists(), f"cgroup {top} left behind"
        # A unit with PrivateTmp=yes gets /tmp/systemd-private-*-<unit>-*; systemd removes it when
        # the unit stops, but this systemd is killed, not stopped: remove what appeared meanwhile.
        for d in _private_tmps() - getattr(self, "_private_before", _private_tmps()):
            shutil.rmtree(d, ignore_errors=True)

    def __enter__(self) -> "SystemdHost":
        return self.start()

    def __exit__(self, *a: object) -> None:
        self.close()
