"""The rule for files a rolled-back job writes (proc/written_files.py): appends are cut back to the
snapshot, anything else is refused before any file is cut."""

from __future__ import annotations

import os

import pytest

from pitstop.errors import FailedPrecondition
from pitstop.proc.written_files import cut_back, written_files


def test_open_for_writing_regular_files_are_found_and_appends_cut_back(tmp_path):
    log, ro = tmp_path / "log", tmp_path / "ro"
    ro.write_text("read only\n")
    with open(log, "a") as f, open(ro) as _:
        f.write("one\n")
        f.flush()
        got = written_files([os.getpid()])
        assert [w.path for w in got if w.path.startswith(str(tmp_path))] == [str(log)]
        snap = [w for w in got if w.path == str(log)]
        f.write("two\n")
        f.flush()
    assert cut_back(snap, apply=False) == [{"path": str(log), "from": 8, "to": 4}]
    assert log.read_text() == "one\ntwo\n", "a check cuts nothing"
    assert cut_back(snap) == [{"path": str(log), "from": 8, "to": 4}]
    assert log.read_text() == "one\n"


@pytest.mark.parametrize("change,why", [
    (lambda p: p.write_text("ONE\nmore\n"), "rewritten"),
    (lambda p: p.write_text(""), "shorter"),
    (lambda p: p.unlink(), "gone"),
])
def test_a_file_that_cannot_be_matched_is_refused_and_nothing_is_cut(tmp_path, change, why):
    good, bad = tmp_path / "good", tmp_path / "bad"
    with open(good, "a") as g, open(bad, "a") as b:
        g.write("x\n")
        b.write("one\n")
        g.flush()
        b.flush()
        snap = [w for w in written_files([os.getpid()]) if w.path.startswith(str(tmp_path))]
        g.write("after\n")
    change(bad)
    with pytest.raises(FailedPrecondition, match=why) as e:
        cut_back(snap)
    assert e.value.code == "files_changed" and "own checkpoint" in e.value.action
    assert good.read_text() == "x\nafter\n"
