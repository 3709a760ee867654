"""Hosts whose ranks run in podman containers, on one machine (tests, benchmarks).

Each local "host" gets a podman of its own: its own storage (graph root, run root, tmp dir),
given by CONTAINERS_STORAGE_CONF and CONTAINERS_CONF in the environment of its agent and of
every podman command run for it, so that a container checkpointed on one is restored by
another that has never seen it, as on two machines.  The test image (scripts/build-test-image.sh:
the venv's interpreter and the host libraries it loads; the checkout with its venv is bind-mounted
read-only at its own path) is imported once per build into a read-only image store of the cache,
which each host lists as an additional image store: no host copies it.  A host made without it
lacks the image, as a spare that was never given it does.

The settings podman needs on this kind of machine are in each host's containers.conf: cgroupfs
(no systemd), events to a file, runc (Debian's crun cannot checkpoint), and ulimits the
unprivileged-resource root of the test VMs can set (no CAP_SYS_RESOURCE).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
BUILD_SCRIPT = REPO / "scripts" / "build-test-image.sh"
IMAGE_NAME = "localhost/pitstop-test"
SOCKET_IN_CONTAINER = "/run/pitstop"  # where a container mounts its agent's socket directory
PODMAN_TIMEOUT_S = 300.0


def podman_missing() -> str | None:
    """Why containers cannot run here (None: podman and runc are installed)."""
    for tool in ("podman", "runc", "conmon"):
        if shutil.which(tool) is None and shutil.which(tool, path="/usr/sbin:/usr/bin:/usr/libexec/podman") is None:
            return f"{tool} is not installed (Debian: apt-get install podman runc)"
    return None


def image_tarball() -> Path:
    """The test image's tarball, built (or found in the cache) by scripts/build-test-image.sh."""
    out = subprocess.run([str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"build-test-image.sh failed: {out.stderr[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def image_store(tarball: Path) -> tuple[Path, str]:
    """A read-only image store holding the test image (made once per tarball, under a lock), and
    the image's name."""
    key = tarball.stem.rsplit("-", 1)[-1]
    store = tarball.parent / f"store-{key}"
    ref = f"{IMAGE_NAME}:{key}"
    done = store / ".imported"
    if done.exists():
        return store, ref
    with open(tarball.parent / ".store.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(store, ignore_errors=True)
            run = tarball.parent / f".store-run-{os.getpid()}"
            try:
                subprocess.run(["podman", "--root", str(store), "--runroot", str(run), "--cgroup-manager", "cgroupfs",
                                "--events-backend", "none", "import", "--quiet", str(tarball), ref],
                               check=True, capture_output=True, timeout=PODMAN_TIMEOUT_S)
            finally:
                shutil.rmtree(run, ignore_errors=True)
            done.write_text(ref + "\n")
        for old in tarball.parent.glob("store-*"):  # stores of older builds
            if old != store:
                shutil.rmtree(old, ignore_errors=True)
    return store, ref


@dataclass
class PodmanHost:
    """One host's podman.  root: its directory (removed by close()); images: an image store it
    lists read-only (None: it has no image at all)."""

    name: str
    root: Path
    images: Path | None = None
    containers: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "tmp").mkdir(exist_ok=True)
        extra = f'additionalimagestores = ["{self.images}"]\n' if self.images else ""
        (self.root / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{self.root / "storage"}"\nrunroot = "{self.root / "run"}"\n'
            f'[storage.options]\n{extra}')
        (self.root / "containers.conf").write_text(
            '[containers]\ndefault_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]\n'
            f'[engine]\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n'
            f'events_logfile_path = "{self.root / "events.log"}"\ntmp_dir = "{self.root / "tmp"}"\n'
            'runtime = "runc"\n')

    @property
    def env(self) -> dict[str, str]:
        return {"CONTAINERS_STORAGE_CONF": str(self.root / "storage.conf"),
                "CONTAINERS_CONF": str(self.root / "containers.conf")}

    def podman(self, *args: str, timeout_s: float = PODMAN_TIMEOUT_S, check: bool = True) -> str:
        p = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout_s,
                           env={**os.environ, **self.env}, stdin=subprocess.DEVNULL)
        if check and p.returncode != 0:
            raise RuntimeError(f"podman {' '.join(args[:4])} on {self.name} failed: {p.stderr[-1500:]}")
        return p.stdout

    def run_rank(self, name: str, image: str, job: str, rank: int, world: int, socket_dir: Path,
                 cmd: list[str], env: dict[str, str], mounts: Sequence[tuple[str, str]] = (),
                 podman_args: Sequence[str] = ()) -> str:
        """Start a rank in a container, detached, as an operator would:
        `podman run -v SOCKET_DIR:/run/pitstop ... IMAGE pitstop run --job J -- CMD`.
        The checkout (and its venv) is mounted read-only at its own path."""
        args = ["run", "-d", "--name", name, "--network", "host", "--runtime", "runc",
                "-v", f"{REPO}:{REPO}:ro", "-v", f"{socket_dir}:{SOCKET_IN_CONTAINER}"]
        for src, dst in mounts:
            args += ["-v", f"{src}:{dst}"]
        for k, v in {**env, "RANK": str(rank), "WORLD_SIZE": str(world), "PYTHONUNBUFFERED": "1"}.items():
            args += ["-e", f"{k}={v}"]
        python = REPO / ".venv" / "bin" / "python"
        args += [*podman_args, image, str(python), "-m", "pitstop.cli", "run", "--job", job,
                 "--agent", f"unix:{SOCKET_IN_CONTAINER}/agent.sock", "--", *cmd]
        cid = self.podman(*args).strip()
        self.containers.append(name)
        return cid

    def inspect(self, name: str) -> dict | None:
        out = self.podman("container", "inspect", name, check=False)
        try:
            got = json.loads(out)
        except ValueError:
            return None
        return got[0] if got else None

    def logs(self, name: str) -> str:
        p = subprocess.run(["podman", "logs", name], capture_output=True, text=True, timeout=60,
                           env={**os.environ, **self.env})
        return p.stdout + p.stderr

    def names(self) -> list[str]:
        out = self.podman("ps", "-a", "--format", "{{.Names}}", check=False)
        return [n for n in out.split() if n]

    def wait(self, name: str, timeout_s: float = 300.0) -> int | None:
        """The container's exit code once it has ended (None: it did not end in time, or is unknown here)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            rec = self.inspect(name)
            if rec is None:
                return None
            st = rec.get("State", {})
            if not st.get("Running") and st.get("Status") in ("exited", "stopped"):
                return int(st.get("ExitCode", -1))
            time.sleep(0.3)
        return None

    def close(self) -> None:
        """Remove every container and this host's storage, mounts included."""
        with contextlib.suppress(Exception):
            self.podman("rm", "--all", "--force", "--time", "0", timeout_s=120, check=False)
        with contextlib.suppress(Exception):
            self.podman("system", "reset", "--force", timeout_s=120, check=False)
        for line in reversed(Path("/proc/self/mounts").read_text().splitlines()):
            mnt = line.split()[1]
            if mnt.startswith(str(self.root) + "/"):
                subprocess.run(["umount", "-l", mnt], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)
