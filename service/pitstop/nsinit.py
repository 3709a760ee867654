"""The worker's namespace init (native/pitinit.c) and the directory it works in.

`pitstop run` makes native/pitinit.c the init of the worker's PID namespace, working in a
directory of its own under init_dirs(), so that CRIU's parasite, which mounts a private /proc
in the root task's working directory, never meets another rank's mount point there: dumps of
ranks sharing a working directory start at once instead of taking turns
(proc/procwindow.py remains for trees pitstop did not start).

That directory is in the worker's images (the root task's cwd), so it must exist wherever the
worker is restored: the capture records it (`init_dir` in the manifest's worker) and the
destination makes it before CRIU runs.  Whoever sees the worker end removes it: the init
itself when its command exits, the launcher or the destination agent when the tree was killed.

init_dirs() is /run/pitstop/init, or $PITSTOP_INIT_DIRS (a local cluster keeps its own under
its root, so that a test leaves none behind).  An agent makes only directories named as a
launcher names them (`pitstop-init.<job>.<rank>.<random>`), wherever the source's launcher put
them: the restore needs that very path, and a peer that may ask for a restore (as root) gains
nothing from an empty directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pitstop import nativelib, safepath

BINARY = "pitstop-init"
PREFIX = "pitstop-init."
_NAME = re.compile(r"^pitstop-init\.[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")


def init_dirs() -> Path:
    return Path(os.environ.get("PITSTOP_INIT_DIRS", "/run/pitstop/init"))


def binary() -> Path | None:
    """native/build/pitstop-init ($PITSTOP_INIT), or None where it is not built."""
    return nativelib.built("PITSTOP_INIT", BINARY)


def prepare(job: str, rank: int) -> Path | None:
    """A new directory for one worker's init; None where none can be made (the worker then
    starts without the init: correct, only its dumps take turns with its neighbours' again)."""
    root = init_dirs()
    try:
        root.mkdir(mode=0o755, parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{job}.{rank}")[:120]
        return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{safe}.", dir=root))
    except OSError:
        return None


def command(init: Path, directory: Path, cmd: list[str]) -> list[str]:
    """The whole start of a worker: the init makes the PID namespace itself (not util-linux
    unshare, which prints an error into the job's stderr when a move kills the tree)."""
    return [str(init), "--pid-namespace", str(directory), "--", *cmd]


def valid(path: str) -> bool:
    """A directory an init may work in, as a launcher names one (`pitstop-init.<job>.<rank>.<random>`),
    absolute and normalised.  Not "under this host's init_dirs()": the source's launcher chose the
    path (its host may set PITSTOP_INIT_DIRS otherwise), and the restore needs that very path."""
    p = Path(path)
    return p.is_absolute() and os.path.normpath(path) == path and bool(_NAME.match(p.name))


def owned_dir(pid: int) -> str | None:
    """The init directory `pid` works in, where `pid` is a pitstop init; else None.  Read once the
    init has forked its command (the launcher registers it only then): it moves in before."""
    if not is_init(pid):
        return None
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None
    return cwd if valid(cwd) else None


def is_init(pid: int) -> bool:
    """Whether `pid` runs native/pitinit.c (a process that holds none of the job's state)."""
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe")) == BINARY
    except OSError:
        return False


def _parent(path: str) -> int:
    """An O_PATH descriptor of the init directory's parent, made where missing, reached without
    following links: the agent acts as root on a path a launcher chose (ValueError otherwise)."""
    try:
        return safepath.makedirs_nofollow(os.path.dirname(path), 0o755)
    except safepath.LinkInPath as e:
        raise ValueError(f"the init directory {path} is not safe to make: {e.message}") from None


def ensure(path: str | None) -> None:
    """Make the init directory a restore needs (the images name it as the root task's cwd),
    following no link on the way.

    Raises ValueError for a path no launcher would have made, or one that reaches a link."""
    if not path:
        return
    if not valid(path):
        raise ValueError(f"{path!r} is not a worker init directory (<dir>/{PREFIX}<job>.<rank>.<random>)")
    parent, name = _parent(path), os.path.basename(path)
    try:
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            pass
        try:
            os.close(os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent))
        except OSError as e:
            raise ValueError(f"the init directory {path} is not a directory (a link, or a file)") from e
    finally:
        os.close(parent)


PIN = ".pitstop-restoring"


@contextlib.contextmanager
def pinned(path: str | None) -> Iterator[None]:
    """Keep the init directory from being removed while CRIU restores into it: a file in it makes
    every rmdir of it fail (ENOTEMPTY).  Why: whoever saw the worker's earlier copy end removes
    the directory (its init at a normal end, its launcher), and a restore of the worker from an
    older image (a snapshot) can run just then; CRIU then cannot open the working directory."""
    if not path or not valid(path):
        yield
        return
    fd = -1
    try:
        ensure(path)  # made again if removed since the restore began
        parent = _parent(path)
        try:
            fd = os.open(os.path.basename(path), os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=parent)
        finally:
            os.close(parent)
        os.close(os.open(PIN, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd))
    except (OSError, ValueError):
        pass
    try:
        yield
    finally:
        if fd >= 0:
            try:
                os.unlink(PIN, dir_fd=fd)
            except OSError:
                pass
            os.close(fd)


def remove(path: str | Path | None) -> None:
    """Remove the init directory of a worker that ended here (only while empty; never through a link)."""
    if not path or not valid(str(path)):
        return
    try:
        parent = safepath.open_nofollow(os.path.dirname(str(path)), os.O_PATH | os.O_DIRECTORY)
    except (OSError, safepath.LinkInPath):
        return
    try:
        os.rmdir(os.path.basename(str(path)), dir_fd=parent)
    except OSError:
        pass
    finally:
        os.close(parent)


def remove_unused(path: str | Path | None) -> None:
    """Remove an init directory no process works in any more: the source's, after its worker
    moved (on one machine, the restored worker's init may work in the same one)."""
    if not path or not valid(str(path)):
        return
    path = str(path)
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if os.readlink(p / "cwd") == path:
                    return
            except OSError:
                continue
    remove(path)
