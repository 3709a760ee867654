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


# -- the early rewire's steps, against blocks that act as the shim does ------------------------------

class Shims:
    """Control blocks that carry out the cut's commands as shim/shim.c does, states and ids only: an
    INIT communicator's rebuild finishes once every member rebuilds it with the same id (NCCL's
    bootstrap), so a rank that stays waits in `rebuilding` until the leaving ones join."""

    def __init__(self, members: dict[str, dict[str, int]], nranks: dict[str, int], version: int = 5) -> None:
        self.blocks = {w: {"token": w, "pid": i + 100, "version": version, "state": "destroyed", "note": "",
                           "command_seq": 0, "done_seq": 0,
                           "comms": [{"key": k, "kind": "init", "rank": r, "nranks": nranks[k], "alive": True,
                                      "issued": 5, "sent": [], "recvd": [], "myid": None} for k, r in ms.items()]}
                       for i, (w, ms) in enumerate(members.items())}
        self.using: dict[str, dict[str, str]] = {}  # worker -> the ids its rebuild uses
        self.posted: list[tuple[str, str, dict]] = []
        self.fresh = 0

    def get(self, w: str) -> list[dict]:
        return [dict(self.blocks[w], comms=[dict(c) for c in self.blocks[w]["comms"]])]

    def post(self, w: str, body: dict) -> None:
        b = self.blocks[w]
        name, ids = body["command"], body.get("ids") or {}
        self.posted.append((w, name, dict(ids)))
        b["command_seq"] += 1
        if b["state"] == "rebuilding" and name != "destroy":
            raise AssertionError(f"{name} posted to {w} while its rebuild runs")
        if name in ("makeids", "genids"):
            for c in b["comms"]:
                asked = ids.get(c["key"]) == str(c["rank"]) if name == "makeids" else c["rank"] == 0
                self.fresh += asked
                c["myid"] = f"id{self.fresh}" if asked else None
            b["state"] = "ids_ready"
        elif name in ("prebuild", "rebuild") and b["state"] != "rebuilt":
            self.using[w] = {c["key"]: ids[c["key"]] for c in b["comms"]}
            b["state"] = "rebuilding"
        elif name == "destroy":
            self.using.pop(w, None)
            b["state"] = "destroyed"
        elif name == "resume":
            b["state"] = "running"
        b["done_seq"] = b["command_seq"]
        self._bootstrap()

    def _bootstrap(self) -> None:
        for w, b in self.blocks.items():
            if b["state"] != "rebuilding":
                continue
            if all(sum(1 for v, u in self.using.items() if self.blocks[v]["state"] in ("rebuilding", "rebuilt")
                       and u.get(c["key"]) == self.using[w][c["key"]]) == c["nranks"] for c in b["comms"]):
                b["state"] = "rebuilt"

    def cut(self) -> Cut:
        return Cut(list(self.blocks), self.get, self.post, deadline_s=1, poll_s=0.001)

    def told(self, name: str) -> list[str]:
        return sorted(w for w, n, _ in self.posted if n == name)


# a world of 4, a pair on the leaving host (r2, r3) and a pair across (r1, r2); r2 and r3 leave
MEMBERS = {"r0": {"w": 0}, "r1": {"w": 1, "x": 0}, "r2": {"w": 2, "p": 0, "x": 1}, "r3": {"w": 3, "p": 1}}
SIZES = {"w": 4, "p": 2, "x": 2}


def test_the_shim_version_the_cut_asks_for_is_the_one_that_has_the_early_rewire():
    from pitstop.coordinator.cut import EARLY_REWIRE_SHIM
    from pitstop.shimctl import layout

    assert EARLY_REWIRE_SHIM == layout.EARLY_REWIRE_VERSION
    assert {"prebuild", "makeids"} <= set(layout.COMMANDS) and "rebuilding" in layout.STATES.values()


def test_early_ids_come_from_the_lowest_ranked_member_that_stays_and_never_from_a_leaving_rank():
    s = Shims(MEMBERS, SIZES)
    cut = s.cut()
    ids = cut.early_ids({"r2", "r3"})
    # the world's id from r0 (rank 0 stays); the pair across from r1 (its rank 0); the pair on the
    # leaving host has no member that stays: no early id (a restored member makes it later)
    assert s.posted == [("r0", "makeids", {"w": "0"}), ("r1", "makeids", {"x": "0"})]
    assert ids == {"w": "id1", "x": "id2"}
    s2 = Shims(MEMBERS, SIZES)
    s2.cut().early_ids({"r0", "r1"})  # rank 0 of the world leaves: the lowest rank that stays makes it
    assert s2.posted == [("r2", "makeids", {"w": "2", "x": "1", "p": "0"})]


def test_no_early_rewire_with_a_shim_older_than_it_or_with_no_rank_that_stays():
    s = Shims(MEMBERS, SIZES, version=4)
    cut = s.cut()
    assert cut.early_ids({"r3"}) is None and s.posted == []
    assert cut.why_not and "r0" in cut.why_not and "older" in cut.why_not
    s = Shims(MEMBERS, SIZES)
    cut = s.cut()
    assert cut.early_ids({"r0", "r1", "r2", "r3"}) is None and s.posted == [] and cut.why_not


def test_the_ranks_that_stay_wait_until_the_restored_ones_join_with_the_same_ids_and_then_all_resume():
    s = Shims(MEMBERS, SIZES)
    cut = s.cut()
    ids = cut.early_ids({"r2", "r3"})
    cut.prebuild(ids, {"r2", "r3"})
    assert s.told("prebuild") == ["r0", "r1"]
    assert {w: b["state"] for w, b in s.blocks.items()} == {"r0": "rebuilding", "r1": "rebuilding",
                                                             "r2": "destroyed", "r3": "destroyed"}
    order: list[str] = []
    _, every = cut.finish_rewire(ids, on_join=lambda: order.append(f"joined after {len(s.posted)} posts"))
    # the pair on the leaving host: its id from its own rank 0 (r2), once restored
    assert s.posted[4] == ("r2", "makeids", {"p": "0"}) and every == {**ids, "p": "id3"}
    assert order == ["joined after 5 posts"]  # recorded before the restored ranks are told
    assert s.told("prebuild") == ["r0", "r1", "r2", "r3"] and s.told("resume") == ["r0", "r1", "r2", "r3"]
    assert all(b["state"] == "running" for b in s.blocks.values())


def test_a_rollback_joins_the_survivors_early_rebuild_where_the_ids_are_unspent_and_redoes_it_otherwise():
    for spent in (False, True):
        s = Shims(MEMBERS, SIZES)
        cut = s.cut()
        ids = cut.early_ids({"r2", "r3"})
        cut.prebuild(ids, {"r2", "r3"})
        s.posted.clear()
        _, every = s.cut().rejoin(ids, spent=spent)
        if not spent:  # the rolled-back sources join: nothing destroyed, no fresh world id
            assert s.told("destroy") == [] and s.told("prebuild") == ["r2", "r3"]
            assert every["w"] == ids["w"]
        else:  # a restored copy may have used them: abandoned, and everything made again with fresh ids
            assert s.told("destroy") == ["r0", "r1", "r2", "r3"] and s.told("genids") == ["r0", "r1", "r2", "r3"]
            assert s.told("rebuild") == ["r0", "r1", "r2", "r3"] and every["w"] != ids["w"]
        assert all(b["state"] == "running" for b in s.blocks.values()), spent


def test_a_rank_whose_early_rebuild_failed_has_the_rewire_redone_in_place():
    s = Shims(MEMBERS, SIZES)
    cut = s.cut()
    ids = cut.early_ids({"r3"})
    cut.prebuild(ids, {"r3"})
    s.blocks["r1"]["state"], s.blocks["r1"]["note"] = "failed", "rebuilt communicators: FAILED (6)"
    s.posted.clear()
    _, every = cut.finish_rewire(ids)
    assert [n for _, n, _ in s.posted][:4] == ["destroy"] * 4 and every["w"] != ids["w"]
    assert all(b["state"] == "running" for b in s.blocks.values())
