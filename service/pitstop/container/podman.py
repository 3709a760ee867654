"""podman, driven so that a container's checkpoint lands in pitstop's image directory and its
restore reads it from there: nothing is copied on either side.

- **Checkpoint.**  podman asks the container's OCI runtime (runc) to checkpoint into the
  container's directory (`<static dir>/checkpoint`).  That path is made a link to the capture's
  image directory first, so CRIU's images are written straight where pitstop streams them from
  (the agent's huge-page tmpfs), while they are written.  `--export` then writes only the
  container's own files (its configuration, log, /dev/shm): the checkpoint travels as the link,
  a few tens of KiB in all.
- **Restore.**  `podman container restore --import` re-creates the container from those files,
  under its own id, and asks runc to restore from `<static dir>/checkpoint`; the id is known
  before podman makes the container, so that path is linked to the received images beforehand
  and podman finds a complete checkpoint there (config.py writes the archive without one).
- **CRIU.**  runc runs `criu` from its PATH: the agent puts the CRIU pitstop runs first on the
  PATH it gives podman, and a configuration file (CRIU_CONFIG_FILE) with the nftables network
  lock, since CRIU's default lock calls iptables, which hosts may lack.
Every call has a deadline and fails as a PitstopError quoting podman's own words.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pitstop.container import config
from pitstop.criu import criulog
from pitstop.errors import CaptureFailed, FailedPrecondition, PitstopError, RestoreFailed

QUERY_TIMEOUT_S = 30.0  # inspect, info, image exists: podman takes its locks, seconds on a loaded host
REMOVE_TIMEOUT_S = 60.0
CHECKPOINT_LINK = "checkpoint"
CRIU_CONF = "network-lock nftables\n"
SEARCH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


class PodmanFailed(PitstopError):
    code = "container_runtime_failed"


@dataclass
class Podman:
    """One host's podman.  `criu`: the CRIU runc is to run (the agent's own);
    `work`: a directory of the agent's for the link and configuration that make runc run it."""

    criu: str | None = None
    work: Path | None = None
    command: str = "podman"
    _info: dict[str, Any] | None = field(default=None, repr=False)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.criu and self.work:
            bin_dir = self.work / "bin"
            bin_dir.mkdir(parents=True, exist_ok=True)
            link = bin_dir / "criu"
            if not link.is_symlink() or os.readlink(link) != self.criu:
                tmp = bin_dir / f".criu.{os.getpid()}"
                tmp.unlink(missing_ok=True)
                tmp.symlink_to(self.criu)
                tmp.rename(link)
            conf = self.work / "criu.conf"
            if not conf.exists() or conf.read_text() != CRIU_CONF:
                conf.write_text(CRIU_CONF)
            env["PATH"] = f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
            env["CRIU_CONFIG_FILE"] = str(conf)
        return env

    def run(self, *args: str, timeout_s: float, error: type[PitstopError] = PodmanFailed,
            action: str = "see the message; `podman` itself says more") -> str:
        try:
            p = subprocess.run([self.command, *args], capture_output=True, text=True, timeout=timeout_s,
                               env=self.env(), stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise FailedPrecondition(f"{self.command} is not installed on this host", code="no_container_runtime",
                                     action="install podman (Debian: `apt-get install podman runc`)") from None
        except subprocess.TimeoutExpired:
            raise error(f"`{self.command} {' '.join(args[:3])}` did not finish within {timeout_s:g} s",
                        action=action) from None
        if p.returncode != 0:
            said = " | ".join(ln.strip() for ln in p.stderr.strip().splitlines()[-4:]) or f"exit status {p.returncode}"
            raise error(f"`{self.command} {' '.join(args[:3])}` failed: {said}", action=action,
                        details={"stderr": p.stderr[-4000:]})
        return p.stdout

    # -- questions ------------------------------------------------------------------------------
    def version(self) -> str | None:
        """podman's version, or None where it cannot be run."""
        try:
            return self.run("version", "--format", "{{.Client.Version}}", timeout_s=QUERY_TIMEOUT_S).strip()
        except PitstopError:
            return None

    def info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = json.loads(self.run("info", "--format", "json", timeout_s=QUERY_TIMEOUT_S))
        return self._info

    def storage(self) -> dict[str, str]:
        """Where this podman keeps containers: graph root, run root, driver."""
        store = self.info().get("store", {})
        return {"graph_root": store.get("graphRoot", ""), "run_root": store.get("runRoot", ""),
                "driver": store.get("graphDriverName", "overlay")}

    def inspect(self, ref: str) -> dict[str, Any] | None:
        """The container's inspect record, or None where there is no such container."""
        try:
            out = self.run("container", "inspect", ref, timeout_s=QUERY_TIMEOUT_S)
        except PodmanFailed as e:
            if "no such container" in e.message.lower():
                return None
            raise
        got = json.loads(out)
        return got[0] if got else None

    def image_exists(self, image: str) -> bool:
        try:
            self.run("image", "exists", image, timeout_s=QUERY_TIMEOUT_S)
            return True
        except PodmanFailed:
            return False

    def container_dir(self, cid: str) -> Path:
        """Where podman keeps a container of this id (its static directory), before it exists."""
        s = self.storage()
        return Path(s["graph_root"]) / f"{s['driver']}-containers" / cid / "userdata"

    # -- checkpoint and restore -----------------------------------------------------------------
    def checkpoint(self, cid: str, static_dir: str, images: Path, export: Path, timeout_s: float) -> dict[str, float]:
        """Checkpoint the container into `images` (CRIU's images), its own files into `export`;
        the container's processes are gone after (runc kills them once dumped).  CRIU's
        statistics (seconds)."""
        link = Path(static_dir) / CHECKPOINT_LINK
        _link(link, images)
        t0 = time.monotonic()
        try:
            out = self.run("container", "checkpoint", "--export", str(export), "--compress", "none",
                           "--tcp-established", "--print-stats", cid, timeout_s=timeout_s, error=CaptureFailed,
                           action="the container was left running, or restored where it was; see the runtime's "
                                  f"log {Path(static_dir) / 'dump.log'}")
        except CaptureFailed as e:
            lines = criulog.error_lines(Path(static_dir) / "dump.log")
            if lines:
                e.message += ": " + " | ".join(lines)
                e.details["criu_errors"] = lines
            raise
        finally:
            _unlink(link)
        stats = _stats(out, "criu_statistics")
        stats["runtime_checkpoint"] = _stats(out, "runtime_checkpoint_duration", scalar=True).get("value", 0.0)
        stats["podman_checkpoint"] = time.monotonic() - t0
        return stats

    def restore(self, images: Path, mapping: dict[str, str], timeout_s: float) -> tuple[dict[str, Any], dict[str, float]]:
        """Re-create the container checkpointed into `images` and restore it from there; its
        inspect record, and the restore's statistics.  A stopped container of that id left here
        (the source's own, after a checkpoint without --rm) is removed first."""
        cfg = config.load_config(images)
        cid, name = cfg["id"], cfg.get("name", "")
        old = self.inspect(cid)
        if old is not None:
            if old.get("State", {}).get("Running"):
                raise RestoreFailed(f"container {name or cid[:12]} already runs on this host",
                                    action="this would run it twice; stop that one first")
            self.remove(cid)
        archive = images / (config.PREFIX + "import.tar")
        config.import_tar(images, archive, mapping)
        link = self.container_dir(cid) / CHECKPOINT_LINK
        _link(link, images)
        t0 = time.monotonic()
        try:
            out = self.run("container", "restore", "--import", str(archive), "--tcp-established", "--keep",
                           "--print-stats", timeout_s=timeout_s, error=RestoreFailed,
                           action="the images are kept for a retry or the rollback; see the runtime's log "
                                  f"{link.parent / 'restore.log'}")
        except RestoreFailed as e:
            lines = criulog.error_lines(link.parent / "restore.log")
            if lines:
                e.message += ": " + " | ".join(lines)
                e.details["criu_errors"] = lines
            self._forget(cid)
            raise
        finally:
            _unlink(link)
            archive.unlink(missing_ok=True)
        stats = _stats(out, "criu_statistics")
        stats["runtime_restore"] = _stats(out, "runtime_restore_duration", scalar=True).get("value", 0.0)
        stats["podman_restore"] = time.monotonic() - t0
        rec = self.inspect(cid)
        if rec is None or not rec.get("State", {}).get("Pid"):
            raise RestoreFailed(f"podman restored container {name or cid[:12]} but does not list it running",
                                action="see `podman ps -a` and the runtime's log on this host")
        return rec, stats

    def remove(self, ref: str) -> bool:
        """Remove a container, running or not; False where there was none."""
        try:
            self.run("container", "rm", "--force", "--time", "0", ref, timeout_s=REMOVE_TIMEOUT_S)
            return True
        except PodmanFailed as e:
            if "no such container" in e.message.lower():
                return False
            raise

    def _forget(self, cid: str) -> None:
        """A failed restore may leave the re-created container behind (created, not running)."""
        try:
            self.remove(cid)
        except PitstopError:
            pass


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.is_file():
        link.unlink()
    elif link.is_dir():
        shutil.rmtree(link)  # a checkpoint podman kept in its own directory from an earlier run
    link.symlink_to(target)


def _unlink(link: Path) -> None:
    if link.is_symlink():
        link.unlink()


def _stats(out: str, key: str, scalar: bool = False) -> dict[str, float]:
    """CRIU's figures from podman's --print-stats answer, in seconds (CRIU counts microseconds)."""
    try:
        doc = json.loads(out[out.index("{"):])
    except ValueError:
        return {}
    for c in doc.get("container_statistics") or []:
        v = c.get(key)
        if scalar:
            return {"value": float(v) / 1e6} if isinstance(v, (int, float)) else {}
        if isinstance(v, dict):
            return {k: float(x) / (1e6 if k.endswith("_time") else 1) for k, x in v.items()
                    if isinstance(x, (int, float))}
    return {}


def runtime_path(name: str) -> str | None:
    """The OCI runtime binary a container names (`runc`, `crun` or a path)."""
    if "/" in name:
        return name if os.access(name, os.X_OK) else None
    return shutil.which(name) or shutil.which(name, path=":".join(SEARCH))


def runtime_cannot_checkpoint(name: str) -> str | None:
    """Why the OCI runtime `name` cannot checkpoint and restore a container here; None if it can.

    runc always can (it runs CRIU).  crun can only when built with libcriu: its --version then
    lists +CRIU; Debian's crun 1.8 is built without it."""
    path = runtime_path(name)
    if path is None:
        return f"the container's OCI runtime {name} is not installed on this host"
    base = os.path.basename(path)
    if base.startswith("runc"):
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=QUERY_TIMEOUT_S).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the container's OCI runtime {path} did not answer --version: {e}"
    if base.startswith("crun"):
        return None if "+CRIU" in out else f"{path} was built without checkpoint support (its --version lacks +CRIU)"
    return f"pitstop moves containers whose OCI runtime is runc or a crun built with CRIU, not {base}"
