"""Image manifests: what a destination must have, byte for byte, before it restores.

A manifest lists every image file with its size and digest, plus what the
restore needs to know about the captured tree (the pipes at its stdio that
must be handed back, the worker's identity).  A restore refuses to start
unless every file matches: a corrupt image must never become a running
process that silently computes garbage.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash
from pydantic import BaseModel, Field

from pitstop.errors import IntegrityError, InvalidRequest

MANIFEST = "pitstop-manifest.json"
DIGEST = "xxh3_128"
"""Why not sha256: it hashes 1.3 GB/s per core here and both ends hash every byte of a move, on
the cores CRIU also needs; xxh3 hashes 8 GB/s.  The digest catches corruption (a flipped bit, a
short or reordered stream, a file changed at rest).  It is not what authenticates the images:
the sender is authenticated by the cluster token or mutual TLS, and images at rest are root-only
(docs/architecture.md, threat model), so a forger would need root on a host already."""


def new_hasher() -> "xxhash.xxh3_128":
    return xxhash.xxh3_128()


class FileEntry(BaseModel):
    name: str
    size: int
    digest: str


class StdioPipe(BaseModel):
    key: str
    fd: int
    writable: bool


class Manifest(BaseModel):
    capture_id: str
    digest_algorithm: str = DIGEST
    worker: dict[str, Any] = Field(default_factory=dict)
    files: list[FileEntry] = Field(default_factory=list)
    stdio: list[StdioPipe] = Field(default_factory=list)
    output_base: dict[str, int] = Field(default_factory=dict)  # see agent/receiving.py
    criu_version: str = ""
    gpu: dict[str, Any] = Field(default_factory=dict)  # GPU model, UUIDs, driver, CUDA, CUDA processes
    net: dict[str, str] | None = None  # the worker's own address (network/workerns.py)
    keep_peers: list[str] | None = None  # connections to other addresses are reset at the destination
    # Post-copy over the network (memory/postcopy.py): the lazy pages are not in these files; the
    # source serves them ({"url", "data_port", "image_id", "lazy_bytes"}) until the fill ends.
    pages_from: dict[str, Any] | None = None
    # Pre-copy (memory/precopy.py): the image id of the pre-copy these pages files are a delta
    # against (restored as their `parent`); or, in a pre-copy's own manifest, the move it serves.
    parent: str | None = None
    pre_copy_of: str | None = None
    # The files the tree used, as the dump found them (proc/file_identity.py: path -> [uid, dev,
    # ino]) and the host it was dumped on: what the restore's reopen of each path is checked against.
    file_ids: dict[str, list[int]] = Field(default_factory=dict)
    host: str = ""
    # A container's checkpoint (container/podman.py): the container as its source agent recorded it
    # (agent/containers.py); its runtime restores it.  None: a process tree pitstop's CRIU restores.
    container: dict[str, Any] | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def write(self, directory: Path) -> None:
        (directory / MANIFEST).write_text(self.model_dump_json(indent=1))

    @classmethod
    def read(cls, directory: Path) -> "Manifest":
        try:
            return cls.model_validate_json((directory / MANIFEST).read_text())
        except FileNotFoundError:
            raise IntegrityError(f"no manifest in {directory}: the transfer did not finish",
                                 action="send the images again") from None


def check_image_id(image_id: str) -> None:
    """Image ids name directories on both agents: letters, digits, '-' and '_' only."""
    if not image_id.replace("-", "").replace("_", "").isalnum():
        raise InvalidRequest(f"bad image id {image_id!r}", action="use letters, digits, '-' and '_'")


def digest_file(path: Path, bufsize: int = 4 << 20) -> str:
    h = new_hasher()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def verify(directory: Path, manifest: Manifest) -> None:
    """Raise IntegrityError naming every file that is missing, short, long or altered."""
    problems: list[str] = []
    if manifest.digest_algorithm != DIGEST:
        raise IntegrityError(f"image manifest uses digest {manifest.digest_algorithm!r}; this agent checks {DIGEST!r}",
                             action="run the same pitstop version on both agents, then move again")

    def one(e: FileEntry) -> str | None:
        p = directory / e.name
        if not p.is_file():
            return f"{e.name}: missing"
        size = p.stat().st_size
        if size != e.size:
            return f"{e.name}: size {size}, manifest says {e.size}"
        if digest_file(p) != e.digest:
            return f"{e.name}: content differs from the manifest ({DIGEST})"
        return None

    with ThreadPoolExecutor(max_workers=4) as ex:  # xxhash releases the GIL
        problems = [r for r in ex.map(one, manifest.files) if r]
    if problems:
        raise IntegrityError("image does not match its manifest: " + "; ".join(problems[:5]),
                             action="the copy is discarded; send the images again from the source",
                             details={"problems": problems})

