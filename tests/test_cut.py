"""The cut's refusals, as logic: they happen before anything is paused (no post reaches a
worker), and each says what was wrong.  The cut itself runs against real shims in
test_shim_e2e.py and tests/gpu."""

from __future__ import annotations

import pytest

from pitstop.coordinator.cut import Cut, CutFailed


def _block(rank: int, nranks: int = 2, foreign: int = 0) -> dict:
    return {"token": f"t{rank}", "state": "running", "foreign": foreign,
            "comms": [{"key": "k0", "issued": 5, "sent": [], "recvd": [], "nranks": nranks, "rank": rank,
                       "alive": True}]}


def _cut(blocks: dict[str, list[dict]]) -> tuple[Cut, list]:
    posted: list = []
    return Cut(list(blocks), lambda w: blocks[w], lambda w, body: posted.append((w, body)), deadline_s=1), posted


def test_a_job_with_communicators_the_shim_did_not_make_is_refused_before_any_pause():
    cut, posted = _cut({"r0": [_block(0)], "r1": [_block(1, foreign=3)]})
    with pytest.raises(CutFailed) as e:
        cut.quiesce()
    assert posted == []
    assert "did not create" in e.value.message and "r1" in e.value.message
    assert "keeps running" in e.value.action and e.value.details == {"workers": ["r1"]}


def test_a_rank_pitstop_cannot_see_is_named_before_any_pause():
    cut, posted = _cut({"r0": [_block(0, nranks=3)], "r1": [_block(1, nranks=3)]})
    with pytest.raises(CutFailed) as e:
        cut.quiesce()
    assert posted == [] and "lacks rank(s) [2]" in e.value.message
