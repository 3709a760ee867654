"""A container's configuration as it travels with its images, and as the spare's runtime reads it.

`podman container checkpoint --export` writes the container's own configuration (config.dump:
libpod's, spec.dump: the OCI spec), its network status, its log and its /dev/shm contents; a
restore with `--import` re-creates the same container from them, same id and name.  Two things
in them name the host they were written on:
- the runtime's storage (graph root and run root: the container's directory, its conmon pid file,
  its log), the same on every host of a fleet set up alike, different on the spare where it is not;
- the bind mount of the agent's socket directory, through which `pitstop run` inside talks to
  the agent of the host the container runs on: it must be the spare's agent after the move.
They are rewritten for the spare (rewrite_paths), every other path is kept: a bind mount whose
source the spare lacks is refused before anything pauses (container/needs.py).
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path
from typing import Any

CONFIG = "config.dump"
SPEC = "spec.dump"
# What podman's export holds besides the checkpoint: carried as they are (a missing one is fine)
SMALL_FILES = (CONFIG, SPEC, "network.status", "ctr.log", "devshm-checkpoint.tar", "rootfs-diff.tar",
               "deleted.files", "stats-dump")
PREFIX = "ctr-"  # how they are named among CRIU's images (no CRIU file starts so)


def stored(name: str) -> str:
    """The name an export's file has among the images: prefixed, and never `*.log`, which the
    image stream leaves out as CRIU's own logs (transfer/stream.py): the container's log travels."""
    return PREFIX + (name[:-len(".log")] + "-log" if name.endswith(".log") else name)


def rewrite_paths(value: Any, mapping: dict[str, str]) -> Any:
    """`value` (parsed JSON) with every string that is, or lies under, a key of `mapping` moved to
    the key's value.  Longest prefix first; a path is never matched half way through a name
    (/a/b does not match /a/bc)."""
    keys = sorted((k for k, v in mapping.items() if k and k != v), key=len, reverse=True)

    def one(s: str) -> str:
        for k in keys:
            if s == k or s.startswith(k.rstrip("/") + "/"):
                return mapping[k] + s[len(k):]
        return s

    def walk(x: Any) -> Any:
        if isinstance(x, str):
            return one(x)
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return x

    return walk(value) if keys else value


def keep_from_export(export: Path, images: Path) -> list[str]:
    """Copy the export's own files (not the checkpoint, which CRIU wrote into `images` itself)
    into `images`, prefixed; their names."""
    out = []
    with tarfile.open(export) as t:
        for m in t.getmembers():
            name = m.name.removeprefix("./")
            if name in SMALL_FILES and m.isfile():
                f = t.extractfile(m)
                assert f is not None
                with open(images / stored(name), "wb") as dst:
                    shutil.copyfileobj(f, dst, 1 << 20)
                out.append(name)
    if CONFIG not in out or SPEC not in out:
        raise ValueError(f"the container's export has no {CONFIG} or {SPEC}")
    return out


def load_config(images: Path) -> dict[str, Any]:
    """The container's libpod configuration, as travelled."""
    return json.loads((images / stored(CONFIG)).read_text())


def import_tar(images: Path, target: Path, mapping: dict[str, str]) -> dict[str, Any]:
    """Write the archive `podman container restore --import` reads: the export's own files with
    this host's paths, and no checkpoint (the runtime finds that in the container's directory,
    which the caller links to `images` beforehand: nothing is copied).  Returns the rewritten
    libpod configuration."""
    config: dict[str, Any] = {}
    with tarfile.open(target, "w") as t:
        for name in SMALL_FILES:
            src = images / stored(name)
            if not src.exists():
                continue
            if name not in (CONFIG, SPEC):  # the log, /dev/shm's contents: as they are
                t.add(src, arcname=name)
                continue
            parsed = rewrite_paths(json.loads(src.read_bytes()), mapping)
            if name == CONFIG:
                config = parsed
            data = json.dumps(parsed).encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o600
            t.addfile(info, io.BytesIO(data))
    return config
