"""The agent keeps files that explain something odd (a CRIU log) out of image directories that
are deleted after the move, and only the newest few of them."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pitstop.agent import diagnostics


def test_a_kept_diagnostic_outlives_its_images_and_only_the_newest_stay(tmp_path: Path) -> None:
    state = tmp_path / "state"
    images = tmp_path / "images"
    images.mkdir()
    state.mkdir()
    kept = []
    for i in range(diagnostics.KEPT + 3):
        (images / "dump.log").write_text(f"dump {i}\n")
        kept.append(diagnostics.keep(state, images / "dump.log", f"cap-{i}-dump.log"))
        os.utime(kept[-1], (time.time() - 1000 + i,) * 2)  # distinct ages, whatever the clock's grain
    left = sorted(p.name for p in (state / "diagnostics").iterdir())
    assert left == sorted(f"cap-{i}-dump.log" for i in range(3, diagnostics.KEPT + 3))
    assert kept[-1].read_text() == f"dump {diagnostics.KEPT + 2}\n"
    assert diagnostics.keep(state, images / "missing.log", "x.log") is None  # says so in the log, raises nothing
