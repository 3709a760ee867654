"""How one capture's images travel, chosen once before the worker stops (SourceSide._choose).

Four kinds, one object each, so that the capture's steps (agent/capturing.py) ask the kind
instead of re-deciding from a handful of booleans at every turn:

- `Whole`: the dump itself travels (or stays here, for a capture without a destination).
- `PreCopyDelta`: a pre-copy sent the memory ahead; pitstop cuts the delta against it from a
  full dump (memory/precopy.py), and only the delta travels.
- `CriuIncremental`: as above, but CRIU dumps only what changed, against the pre-copy moved in as
  its parent (criu/criutrack.py).  Where CRIU cannot, it becomes a `PreCopyDelta` then and there.
- `PostCopyView`: network post-copy; a view of the dump without its lazy pages travels, and the
  destination fetches those after the resume (memory/postcopy.py).

A GPU worker is not a kind of its own: any of the four can carry one.  Its CUDA lock and
checkpoint are a step every kind runs before the dump, with its own undo (capturing.py); a GPU
that appeared after a pre-copy makes a CriuIncremental a PreCopyDelta (`distrusted`), because the
device may have written memory the write tracking never saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from pitstop import faults
from pitstop.criu import criu_ops
from pitstop.criu.runtime import CriuCommand
from pitstop.memory import precopy
from pitstop.memory.precopy import Basis

if TYPE_CHECKING:
    from pitstop.agent.state import Capture, Worker

VIEW = "post-copy-view"  # inside a capture's images: what travels before the restore (memory/postcopy.py)
DELTA = "pre-copy-delta"  # inside a capture's images: what travels after a pre-copy (memory/precopy.py)
PARENT = "parent"  # inside a capture's images: the pre-copy CRIU's incremental dump is against (criutrack.py)

StreamStart = Literal["before_dump", "after_dump", "at_end"]


class SourceSide(Protocol):
    """What a kind asks of the capturing agent (agent/capturing.py SourceSide), and no more: the
    kinds stay below the agent's capture loop, which imports them."""

    def dump_whole(self, cap: "Capture", w: "Worker", images: Path, overlap: bool) -> criu_ops.DumpResult: ...

    def dump_incremental(self, cap: "Capture", w: "Worker", images: Path, overlap: bool, basis: Basis,
                         command: CriuCommand) -> tuple[criu_ops.DumpResult, bool]: ...

    def cut_delta(self, cap: "Capture", images: Path, basis: Basis) -> None: ...

    def split(self, cap: "Capture", images: Path) -> dict: ...


@dataclass
class Dumped:
    """What a kind's dump produced, and the kind that actually applied (CRIU's incremental dump
    may have fallen back to a whole one)."""

    result: criu_ops.DumpResult
    kind: "CaptureKind"


class CaptureKind:
    name: ClassVar[str] = "whole"
    whole: ClassVar[bool] = True  # the dump itself travels (else a view of it, written after it)

    def streamed(self, images: Path) -> Path:
        """The directory the image stream tails."""
        return images

    def stream_start(self, stream_while_dumping: bool) -> StreamStart:
        """When the stream may start: while CRIU writes what it sends, once the dump is over (a
        delta written append-only, file by file, is tailed while it is cut), or once all is written."""
        return "before_dump" if stream_while_dumping else "at_end"

    def distrusted(self) -> "CaptureKind":
        """The kind once the pre-copy's tracking cannot be trusted (a GPU appeared since)."""
        return self

    def dump(self, side: "SourceSide", cap: "Capture", w: "Worker", images: Path, overlap: bool) -> Dumped:
        return Dumped(side.dump_whole(cap, w, images, overlap), self)

    def after_dump(self, side: "SourceSide", cap: "Capture", images: Path) -> tuple[dict[str, Any] | None, str | None]:
        """Write what travels instead of the dump; (post-copy's page source, pre-copy's parent)."""
        return None, None


class Whole(CaptureKind):
    pass


@dataclass
class PreCopyDelta(CaptureKind):
    basis: Basis
    name: ClassVar[str] = "pre_copy_delta"
    whole: ClassVar[bool] = False

    def streamed(self, images: Path) -> Path:
        return images / DELTA

    def stream_start(self, stream_while_dumping: bool) -> StreamStart:
        return "after_dump" if stream_while_dumping else "at_end"

    def after_dump(self, side: "SourceSide", cap: "Capture", images: Path) -> tuple[dict[str, Any] | None, str | None]:
        side.cut_delta(cap, images, self.basis)
        return None, _parent_of(cap)


@dataclass
class CriuIncremental(CaptureKind):
    basis: Basis
    command: CriuCommand  # the CRIU that tracks what changed (criu/criutrack.py)
    name: ClassVar[str] = "criu_incremental"
    whole: ClassVar[bool] = False

    def stream_start(self, stream_while_dumping: bool) -> StreamStart:
        return "at_end"  # its `parent` is a directory, not streamed: it travels once CRIU is done

    def distrusted(self) -> CaptureKind:
        self.basis.drop_local()
        return PreCopyDelta(self.basis)

    def dump(self, side: "SourceSide", cap: "Capture", w: "Worker", images: Path, overlap: bool) -> Dumped:
        res, incremental = side.dump_incremental(cap, w, images, overlap, self.basis, self.command)
        # dumped whole after all: the delta is cut from it, as without CRIU's help
        return Dumped(res, self if incremental else PreCopyDelta(self.basis))

    def after_dump(self, side: "SourceSide", cap: "Capture", images: Path) -> tuple[dict[str, Any] | None, str | None]:
        faults.hit("precopy:before_delta")  # CRIU wrote the delta itself
        return None, _parent_of(cap)


class PostCopyView(CaptureKind):
    name: ClassVar[str] = "post_copy_view"
    whole: ClassVar[bool] = False

    def streamed(self, images: Path) -> Path:
        return images / VIEW

    def stream_start(self, stream_while_dumping: bool) -> StreamStart:
        return "at_end"

    def after_dump(self, side: "SourceSide", cap: "Capture", images: Path) -> tuple[dict[str, Any] | None, str | None]:
        return side.split(cap, images), None


def _parent_of(cap: "Capture") -> str:
    assert cap.image_id is not None, "a capture with a pre-copy has the move's image id"
    return cap.image_id + precopy.PRE_SUFFIX
