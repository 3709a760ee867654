"""The paths a restore of a dump will open by name: CRIU's files.img, read before CRIU runs.

Why: CRIU's restore, as root, reopens every regular file and directory of the tree by the path
it recorded (open descriptors, mapped files, working and root directories all refer to files.img's
REG entries).  pitstop checks those very paths before it lets CRIU at them
(proc/file_identity.py), not a list of its own that could differ from CRIU's.
"""

from __future__ import annotations

from pathlib import Path

from pitstop.criu import runtime

FILES_IMG = "files.img"


def reopened(images: Path, rt: runtime.CriuRuntime | None = None) -> list[str]:
    """Every path files.img names for a regular file or directory, once each, in its order
    (none where the dump has no files.img)."""
    path = images / FILES_IMG
    if not path.exists():
        return []
    pycriu = (rt or runtime.locate()).import_pycriu()
    with open(path, "rb") as f:
        entries = pycriu.images.load(f, pretty=False)["entries"]
    out: dict[str, None] = {}
    for e in entries:
        reg = e.get("reg") if e.get("type") in ("REG", 1) else None
        name = reg.get("name") if reg else None
        if name:
            out[name if name.startswith("/") else "/" + name] = None
    return list(out)
