"""The undo stack (pitstop/undo.py) and the capture kinds (agent/capture_kinds.py): the logic a
capture's way back rests on.  End to end, every failure path of a capture is exercised by the
rollback tests (test_precopy_e2e.py, test_remote_post_copy.py, test_image_dir_security.py, the
fault matrix in tests/qualify)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pitstop.agent.capture_kinds import DELTA, VIEW, CriuIncremental, PostCopyView, PreCopyDelta, Whole
from pitstop.errors import CaptureFailed, IntegrityError
from pitstop.undo import Undo


def test_undos_run_last_first_each_told_why_and_the_stage_says_who_resumed():
    done: list[tuple[str, str]] = []
    u = Undo("nobody")
    u.push("stream", lambda e: done.append(("stream", str(e))))
    u.stage("pitstop (GPU lock undone)", push=(("network", lambda e: done.append(("network", str(e)))),))
    u.push("gpu", lambda e: done.append(("gpu", str(e))))
    u.stage("criu")
    assert u.resumed_by == "criu" and u.names() == ["stream", "network", "gpu"]
    u.unwind(CaptureFailed("dump failed"))
    assert done == [("gpu", "dump failed"), ("network", "dump failed"), ("stream", "dump failed")]
    assert u.names() == []


def test_a_later_stage_replaces_the_undos_it_supersedes():
    done: list[str] = []
    u = Undo("nobody")
    for name in ("stream", "network", "gpu"):
        u.push(name, lambda e, n=name: done.append(n))
    u.stage("pitstop", replace=("gpu", "network", "stream"),
            push=(("rollback", lambda e: done.append("rollback")), ("stream", lambda e: done.append("stream"))))
    u.unwind(CaptureFailed("x"))
    assert done == ["stream", "rollback"] and u.resumed_by == "pitstop"


def test_every_undo_runs_though_one_fails_and_the_first_failure_is_raised():
    done: list[str] = []

    def refused(e: BaseException) -> None:
        raise IntegrityError("the dump changed at rest", action="leave it stopped")

    u = Undo("pitstop")
    u.push("stream", lambda e: done.append("stream"))
    u.push("rollback", refused)
    u.push("later", lambda e: (_ for _ in ()).throw(RuntimeError("second")))
    with pytest.raises(RuntimeError, match="second"):
        u.unwind(CaptureFailed("x"))
    assert done == ["stream"]  # the stream still closed after the refused rollback
    u2 = Undo("pitstop")
    u2.push("stream", lambda e: done.append("stream2"))
    u2.push("rollback", refused)
    with pytest.raises(IntegrityError):
        u2.unwind(CaptureFailed("x"))
    assert done[-1] == "stream2"


class _Basis:
    def __init__(self) -> None:
        self.dropped = False

    def drop_local(self) -> None:
        self.dropped = True


def test_each_kind_says_what_travels_and_when_the_stream_starts():
    images = Path("/img")
    b = _Basis()
    kinds = {"whole": Whole(), "delta": PreCopyDelta(b), "criu": CriuIncremental(b, "/criu"), "view": PostCopyView()}
    assert {k: v.streamed(images) for k, v in kinds.items()} == {
        "whole": images, "delta": images / DELTA, "criu": images, "view": images / VIEW}
    assert {k: v.whole for k, v in kinds.items()} == {"whole": True, "delta": False, "criu": False, "view": False}
    assert {k: v.stream_start(True) for k, v in kinds.items()} == {
        "whole": "before_dump", "delta": "after_dump", "criu": "at_end", "view": "at_end"}
    assert {v.stream_start(False) for v in kinds.values()} == {"at_end"}
    # a GPU that appeared after the pre-copy: CRIU's incremental dump would trust the tracking
    assert kinds["delta"].distrusted() is kinds["delta"]
    d = kinds["criu"].distrusted()
    assert isinstance(d, PreCopyDelta) and d.basis is b and b.dropped
