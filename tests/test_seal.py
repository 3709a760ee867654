"""The seal on a dump's files (criu/seal.py): what a rollback or a recovery checks before it turns
the images back into a process."""

from __future__ import annotations

import pytest

from pitstop.criu import seal
from pitstop.errors import IntegrityError


def _dump(tmp_path):
    d = tmp_path / "images"
    d.mkdir()
    (d / "pages-1.img").write_bytes(b"p" * 4096)
    (d / "core-7.img").write_bytes(b"c" * 100)
    (d / "dump.log").write_text("criu's log\n")
    return d


def test_a_restore_from_the_images_leaves_them_sealed(tmp_path):
    """CRIU writes stats-restore (and appends to its logs) each time it restores from a directory:
    a snapshot's part restored once, then again by a recovery run from its start (a new leader),
    is the same dump."""
    d = _dump(tmp_path)
    s = seal.take(d)
    (d / "stats-restore").write_bytes(b"stats")
    (d / "restore.log").write_text("restored\n")
    seal.check(d, s)


@pytest.mark.parametrize("change", ["added", "grown", "removed"])
def test_any_other_change_is_refused_with_the_file_named(tmp_path, change):
    d = _dump(tmp_path)
    s = seal.take(d)
    if change == "added":
        (d / "pages-2.img").write_bytes(b"x")
    elif change == "grown":
        with open(d / "core-7.img", "ab") as f:
            f.write(b"!")
    else:
        (d / "pages-1.img").unlink()
    with pytest.raises(IntegrityError, match={"added": "pages-2.img: added after the dump",
                                              "grown": "core-7.img: changed after the dump",
                                              "removed": "pages-1.img: missing"}[change]):
        seal.check(d, s)
