"""The destination decides once how an image is restored (agent/restore_kinds.py): the source's
post-copy wins over the agent's own lazy restore, and a delta names its parent whatever fills it.
The real restores of each kind run in test_precopy_e2e.py, test_remote_post_copy.py and
test_lazy_restore.py."""

from __future__ import annotations

import pytest

from pitstop.agent.restore_kinds import PageFill, RestorePlan
from pitstop.transfer.manifest import Manifest

SERVED = {"url": "http://a:7070", "data_port": 7071, "image_id": "i1", "lazy_bytes": 4096}


@pytest.mark.parametrize(("pages_from", "parent", "lazy_restore", "fill"), [
    (None, None, False, PageFill.EAGER),
    (None, "pre1", False, PageFill.EAGER),
    (None, None, True, PageFill.LOCAL),
    (None, "pre1", True, PageFill.LOCAL),
    (SERVED, None, False, PageFill.REMOTE),
    (SERVED, None, True, PageFill.REMOTE),  # the source left pages out: only it can fill them
    (SERVED, "pre1", True, PageFill.REMOTE),
])
def test_one_plan_per_image(pages_from, parent, lazy_restore, fill):
    p = RestorePlan.of(Manifest(capture_id="c1", pages_from=pages_from, parent=parent), lazy_restore)
    assert p.fill is fill
    assert p.parent == parent
    assert p.lazy is (fill is not PageFill.EAGER)
    assert ("delta against pre1" in p.describe()) is (parent is not None)
