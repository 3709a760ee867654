"""Where CRIU is, which version it is, and whether this kernel can run it.

pitstop needs CRIU >= 4.2 on Linux >= 6.16 (older releases fail `criu check`
on the [vvar_vclock] mapping or cannot dump TCP sockets).  The CRIU pitstop carries wins:
4.2.1 with the patches in criu/patches/, built by scripts/build-criu.sh (a forked child's
copy-on-write pages are dumped once, by its parent, and kept shared by the restore instead of
read and compared one page at a time).  Where it could not be built (or PITSTOP_CRIU_STOCK=1),
a stock CRIU runs: a host criu that is new enough, or an older one that passes a real dump and
restore on this kernel (criu/criuprobe.py), else Debian's in the private prefix made by
scripts/provision-criu.sh.  pycriu is taken from the same place so the RPC schema always
matches the binary.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pitstop.errors import FailedPrecondition

CRIU_CHECK_TIMEOUT_S = 60  # `criu check` probes many kernel features; seconds on a loaded host
VERSION_TIMEOUT_S = 30  # `criu --version`

MIN_VERSION = (4, 2)


def default_prefix() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(os.environ.get("PITSTOP_CRIU_PREFIX") or Path(cache) / "pitstop" / "criu-4.2")


def carried_prefix() -> Path:
    """Where scripts/build-criu.sh installs the CRIU pitstop carries."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(os.environ.get("PITSTOP_CRIU_CARRIED_PREFIX") or Path(cache) / "pitstop" / "criu-carried")


def carried_patches(prefix: Path) -> tuple[str, ...]:
    """The patches a carried build was made with, in order (its PATCHES file: the series)."""
    try:
        lines = (prefix / "PATCHES").read_text().splitlines()
    except OSError:
        return ()
    return tuple(ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#"))


def _parse_version(text: str) -> tuple[int, ...] | None:
    m = re.search(r"Version:\s*([0-9.]+)", text)
    if not m:
        return None
    return tuple(int(x) for x in m.group(1).split(".") if x.isdigit())


@dataclass(frozen=True)
class CriuRuntime:
    """A usable CRIU: binary (or wrapper), version, pycriu location, nft helper."""

    binary: str
    version: tuple[int, ...]
    pycriu_path: str | None
    nft: str | None
    source: str  # "carried", "host", "prefix" or "env"
    patches: tuple[str, ...] = ()  # the carried build's patch series, in order

    @property
    def carried(self) -> bool:
        """Whether this is the CRIU pitstop carries (criu/patches/ applied)."""
        return self.source == "carried"

    @property
    def version_str(self) -> str:
        return ".".join(map(str, self.version))

    def check(self) -> tuple[bool, str]:
        """Run `criu check`; return (ok, CRIU's own words)."""
        p = subprocess.run([self.binary, "check"], capture_output=True, text=True, timeout=CRIU_CHECK_TIMEOUT_S)
        out = (p.stdout + p.stderr).strip()
        return p.returncode == 0, out

    def import_pycriu(self):  # noqa: ANN201 - pycriu has no types
        if self.pycriu_path and self.pycriu_path not in sys.path:
            sys.path.insert(0, self.pycriu_path)
        import pycriu  # type: ignore[import-not-found]

        return pycriu


def _version_of(binary: str) -> tuple[int, ...] | None:
    try:
        p = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return _parse_version(p.stdout + p.stderr)


@functools.lru_cache(maxsize=1)
def locate() -> CriuRuntime:
    """Find a CRIU >= 4.2, the carried one first; raise FailedPrecondition saying how to get one."""
    prefix = default_prefix()
    candidates: list[tuple[str, str, str | None, str | None]] = []
    if os.environ.get("PITSTOP_CRIU"):
        candidates.append((os.environ["PITSTOP_CRIU"], "env", os.environ.get("PITSTOP_PYCRIU"),
                           os.environ.get("PITSTOP_NFT")))
    carried = carried_prefix()
    if (carried / "bin" / "criu").exists() and os.environ.get("PITSTOP_CRIU_STOCK", "") in ("", "0"):
        candidates.append((str(carried / "bin" / "criu"), "carried", str(carried / "pycriu"),
                           str(carried / "bin" / "nft") if (carried / "bin" / "nft").exists() else None))
    host = shutil.which("criu")
    if host and not os.environ.get("PITSTOP_FORCE_PRIVATE_CRIU"):
        candidates.append((host, "host", None, shutil.which("nft")))
    if (prefix / "bin" / "criu").exists():
        candidates.append((str(prefix / "bin" / "criu"), "prefix", str(prefix / "pycriu"),
                           str(prefix / "bin" / "nft") if (prefix / "bin" / "nft").exists() else None))
    seen = []
    for binary, source, pyc, nft in candidates:
        v = _version_of(binary)
        seen.append(f"{binary}: {'.'.join(map(str, v)) if v else 'no version'}")
        if v and v >= MIN_VERSION:
            return CriuRuntime(binary, v, pyc, nft, source, carried_patches(carried) if source == "carried" else ())
        if v and source == "host":  # older than the floor, but it may work on this kernel: try it
            from pitstop.criu.criuprobe import passes

            ok, why = passes(binary, v)
            if ok:
                return CriuRuntime(binary, v, pyc, nft, source)
            seen[-1] += f" (probe: {why})"
    raise FailedPrecondition(
        "no CRIU >= 4.2 found" + (f" (tried {'; '.join(seen)})" if seen else ""),
        action="run `pitstop provision-criu` (as root: Debian's CRIU >= 4.2 in a private prefix unless the host's "
               "passes, then the CRIU pitstop carries), or set PITSTOP_CRIU to a criu >= 4.2",
        code="criu_missing")


@dataclass(frozen=True)
class CriuCommand:
    """A CRIU to start (criu/swrk.py): its binary and what its environment adds, a library
    preloaded into it and that library's settings.  Not a script that sets them: a script written
    just before it runs is refused by the kernel (ETXTBSY) while a process another thread forked
    meanwhile still holds its write descriptor, which failed a move's restore in CI."""

    binary: str
    env: tuple[tuple[str, str], ...] = ()

    def environ(self) -> dict[str, str]:
        """This process's environment with the command's additions (a preload goes first)."""
        return {**os.environ, **dict(self.env)}


def preloaded(rt: CriuRuntime, lib: Path, env: dict[str, str] | None = None) -> CriuCommand:
    """This CRIU with `lib` preloaded (ahead of any preload this process has) and `env` set."""
    before = os.environ.get("LD_PRELOAD")
    return CriuCommand(rt.binary, (*sorted((env or {}).items()),
                                   ("LD_PRELOAD", f"{lib}:{before}" if before else str(lib))))
