"""Compressed images end to end: a real training job evacuated through the coordinator with every
image piece that shrinks sent compressed (PITSTOP_AGENT_COMPRESS=on on the source), with and
without pre-copy; the job must end with the parameters of an uninterrupted run.  Whether `auto`
compresses is decided by the link (tests/test_compress.py); `on` makes this loopback cluster take
the compressed path in every stream of a move."""

from __future__ import annotations

import pytest

from .test_precopy_e2e import _evacuate, _finish

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
ON = {"PITSTOP_AGENT_COMPRESS": "on"}


def _compressed(c: dict | None) -> None:
    assert c and c["mode"] == "on" and c["encoding"] == "zstd", c
    assert c["compressed_pieces"] >= 1 and c["wire_bytes"] < c["raw_bytes"], c


@pytest.mark.parametrize("pre_copy", [True, False], ids=["pre-copy", "stop-and-copy"])
def test_a_move_with_compressed_images_ends_bitwise(cluster, tmp_path, pre_copy):
    cc, spare, op, out, kw, ranks = _evacuate(cluster, tmp_path, src_env=ON, pre_copy=pre_copy)
    md = op["metadata"]
    assert md["result"] == "succeeded", op
    w = md["workers"]["train.1"]
    _compressed(w.get("compression"))  # the pause's stream: the delta, or the whole dump as it is written
    if pre_copy:
        _compressed(w.get("pre_copy_compression"))
        assert w["pre_copy_compression"]["raw_bytes"] >= 64 << 20  # the ballast went compressed
    else:
        assert w["compression"]["raw_bytes"] >= 64 << 20
    _finish(tmp_path, out, kw, ranks)
