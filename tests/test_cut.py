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


def test_a_job_whose_shim_refused_something_is_refused_with_its_reason_before_any_pause():
    why = "NCCL is inside /opt/x/libtrainer.so (soname libtrainer.so), not a libnccl the shim can stand in front of"
    cut, posted = _cut({"r0": [_block(0)], "r1": [dict(_block(1), refused=why)]})
    with pytest.raises(CutFailed) as e:
        cut.quiesce()
    assert posted == [] and f"r1: {why}" in e.value.message and e.value.details == {"workers": {"r1": why}}


def test_a_refusal_a_rank_meets_as_it_parks_releases_every_rank():
    """The shim looks again as a rank parks (a reference bound past it since it last looked): the
    cut sees the note in its next round, releases every rank and fails with the reason."""
    why = "/opt/x/libplugin.so called ncclAllReduce past the shim"
    reads: dict[str, int] = {"r0": 0, "r1": 0}

    def get(w: str) -> list[dict]:
        reads[w] += 1
        b = _block(int(w[1]))
        return [dict(b, refused=why) if w == "r1" and reads[w] > 1 else b]

    posted: list = []
    cut = Cut(["r0", "r1"], get, lambda w, body: posted.append((w, body)), deadline_s=5)
    with pytest.raises(CutFailed) as e:
        cut.quiesce()
    assert why in e.value.message and "released" in e.value.action
    assert [(w, b["op"]) for w, b in posted][:2] == [("r0", "quiesce"), ("r1", "quiesce")]
    assert sorted((w, b["command"]) for w, b in posted if b["op"] == "command") == [("r0", "release"),
                                                                                    ("r1", "release")]


def test_a_rank_pitstop_cannot_see_is_named_before_any_pause():
    cut, posted = _cut({"r0": [_block(0, nranks=3)], "r1": [_block(1, nranks=3)]})
    with pytest.raises(CutFailed) as e:
        cut.quiesce()
    assert posted == [] and "lacks rank(s) [2]" in e.value.message


def test_every_rank_is_read_and_told_at_once_not_one_after_another():
    """8 ranks: each read and each post waits until all 8 are in flight together, which a
    loop over the ranks would never reach (the barrier would break after its timeout)."""
    import threading

    workers = [f"r{i}" for i in range(8)]
    reads, posts = threading.Barrier(8, timeout=10), threading.Barrier(8, timeout=10)
    got: list = []

    def get(w: str) -> list[dict]:
        reads.wait()
        return [{"token": w, "state": "running", "comms": []}]

    def post(w: str, body: dict) -> None:
        posts.wait()
        got.append((w, body["op"]))

    cut = Cut(workers, get, post, deadline_s=1)
    assert cut.uses_shim() is False
    cut._post_all({"op": "quiesce"})
    assert sorted(got) == [(w, "quiesce") for w in workers]
    assert [w for w, _ in cut._all()] == workers  # results stay in the workers' order


def test_a_transport_that_reads_every_rank_in_one_call_is_used_instead():
    asked: list = []

    def get_all(workers: list[str]) -> dict:
        asked.append(list(workers))
        return {w: [{"token": w, "state": "running", "comms": []}] for w in workers}

    def get_one(w: str) -> list:
        raise AssertionError("read one by one")

    cut = Cut(["r0", "r1", "r2"], get_one, lambda w, body: None, deadline_s=1, get_all=get_all)
    assert cut.uses_shim() is False and asked == [["r0", "r1", "r2"]]
