"""A restore whose worker init directory vanished under CRIU is done once more (agent/receiving.py,
_criu_restore_in; nsinit.pinned, nsinit.lost_cwd).

Why: in CI (2026-12-07) a rank rolled back from its own snapshot part failed with CRIU's "Can't
open cwd" on its init directory, made and pinned just before.  A failed CRIU restore leaves
nothing running, so one more try is safe; anything else CRIU says fails at once, as before.
The CRIU call is stood in for (logic only); the directory, the pin and the path checks are real."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from pitstop import nsinit
from pitstop.agent.receiving import DestinationSide
from pitstop.errors import RestoreFailed

pytestmark = pytest.mark.timeout(30)

CWD_ERRORS = ["Error (criu/files-reg.c:2353): Can't open file {p} on restore: No such file or directory",
              "Error (criu/files.c:1399): Can't open cwd", "Error (criu/cr-restore.c:2331): Restoring FAILED."]


class _Fake:
    """What _criu_restore_in needs of the destination: a CRIU restore that fails as told."""

    def __init__(self, failures: list[list[str]]) -> None:
        self.failures, self.calls, self.pinned_seen = failures, 0, []

    def _criu_restore(self, directory, inherit, net_fd, lazy, abort, phases):  # noqa: ANN001, ANN202
        self.calls += 1
        self.pinned_seen.append(os.path.exists(os.path.join(self.init_dir, nsinit.PIN)))
        if self.failures:
            lines = self.failures.pop(0)
            shutil.rmtree(self.init_dir)  # gone under CRIU, pin and all
            raise RestoreFailed("CRIU could not restore: " + " | ".join(lines), details={"criu_errors": lines})
        return 4242, 0.1


def _init_dir(tmp_path) -> str:  # noqa: ANN001
    d = str(tmp_path / "init" / "pitstop-init.train.1.w8htirnl")
    nsinit.ensure(d)
    return d


def test_a_restore_that_lost_its_init_directory_is_done_once_more_pinned(tmp_path):
    d = _init_dir(tmp_path)
    f = _Fake([[line.format(p=d.lstrip("/")) for line in CWD_ERRORS]])
    f.init_dir = d
    pid, _ = DestinationSide._criu_restore_in(f, d, tmp_path, {}, None, False, None, None)
    assert pid == 4242 and f.calls == 2 and f.pinned_seen == [True, True]
    assert os.path.isdir(d) and not os.path.exists(os.path.join(d, nsinit.PIN)), "made again, unpinned after"


def test_any_other_failure_and_a_second_loss_are_not_tried_again(tmp_path):
    d = _init_dir(tmp_path)
    f = _Fake([["Error (criu/cr-restore.c:2331): Restoring FAILED."]])
    f.init_dir = d
    with pytest.raises(RestoreFailed):
        DestinationSide._criu_restore_in(f, d, tmp_path, {}, None, False, None, None)
    assert f.calls == 1
    nsinit.ensure(d)
    twice = [[line.format(p=d.lstrip("/")) for line in CWD_ERRORS]] * 2
    f = _Fake(list(twice))
    f.init_dir = d
    with pytest.raises(RestoreFailed):
        DestinationSide._criu_restore_in(f, d, tmp_path, {}, None, False, None, None)
    assert f.calls == 2


def test_a_post_copy_or_aborted_restore_is_not_tried_again(tmp_path):
    d = _init_dir(tmp_path)
    for lazy, abort in ((True, None), (False, threading.Event())):
        if abort is not None:
            abort.set()
        f = _Fake([[line.format(p=d.lstrip("/")) for line in CWD_ERRORS]])
        f.init_dir = d
        nsinit.ensure(d)
        with pytest.raises(RestoreFailed):
            DestinationSide._criu_restore_in(f, d, tmp_path, {}, None, lazy, abort, None)
        assert f.calls == 1


def test_lost_cwd_says_what_is_there_now(tmp_path):
    d = _init_dir(tmp_path)
    lost = [CWD_ERRORS[1]]
    assert nsinit.lost_cwd(d, ["Restoring FAILED."]) is None
    assert nsinit.lost_cwd(None, lost) is None and nsinit.lost_cwd("/etc", lost) is None
    assert nsinit.lost_cwd(d, lost) == "present, not pinned"
    with nsinit.pinned(d):
        assert nsinit.lost_cwd(d, lost) == "present, pinned"
    os.rmdir(d)
    assert nsinit.lost_cwd(d, lost) == "missing"
