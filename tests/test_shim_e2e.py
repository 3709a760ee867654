"""The NCCL shim end to end: unchanged NCCL programs (numpy + ctypes over the host NCCL),
4 ranks on hosts that are separate network namespaces with their own addresses, evacuated
through the coordinator with a consistent cut and rewired communicators."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from pitstop.dev.devcluster import pitstop_cmd
from pitstop.dev.netns import NetHosts
from pitstop.errors import PitstopError
from pitstop.wire.coordinator_client import CoordinatorClient

from . import nccl_builds
from .helpers import WORKLOADS, assert_same_as_reference, let_finish, pace_file, until, wait_for_step

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
STEPS = 300
_REF: dict[tuple, list[str]] = {}


def _program(script: str) -> list[str]:
    """A workload: a Python script in tests/workloads, or a compiled program's absolute path."""
    return [script] if os.path.isabs(script) else [sys.executable, str(WORKLOADS / script)]


def _cmd(script: str, rdv: Path, out: Path, steps: int = STEPS, extra: tuple[str, ...] = ()) -> list[str]:
    return [*_program(script), "--steps", str(steps), "--step-sleep", "0.02",
            "--pace-file", str(pace_file(out)), "--rendezvous", str(rdv), "--out", str(out), *extra]


def reference(script: str, steps: int = STEPS, job_env: dict[str, str] | None = None) -> list[str]:
    """The same program, uninterrupted, over the host NCCL alone: no shim, no pitstop."""
    key = (script, steps, tuple(sorted((job_env or {}).items())))
    if key not in _REF:
        with tempfile.TemporaryDirectory() as d:
            rdv, out = Path(d) / "rdv", Path(d) / "out"
            rdv.mkdir()
            env = dict(os.environ, LD_LIBRARY_PATH=str(ROOT / "native" / "build"), PYTHONPATH=str(WORKLOADS),
                       HOSTNCCL_ADDR="127.0.0.1", WORLD_SIZE="4", **(job_env or {}))
            cmd = _cmd(script, rdv, out, steps)
            cmd[cmd.index("--step-sleep") + 1] = "0"
            ps = [subprocess.Popen(cmd, env=dict(env, RANK=str(r)), stdout=subprocess.DEVNULL) for r in range(4)]
            assert [p.wait(120) for p in ps] == [0] * 4
            _REF[key] = [(out / f"rank{r}.sha256").read_text().strip() for r in range(4)]
    return _REF[key]


def _start(cluster, tmp_path, script, spares=1, steps=STEPS, extra=(), coord_env=None, job_env=None, run_args=(),
           agent_env=None):
    cluster.net = NetHosts()
    if coord_env:
        os.environ.update(coord_env)
    try:
        cluster.start_coordinator()
    finally:
        for k in coord_env or {}:
            os.environ.pop(k, None)
    with cluster.starting():
        for name in ("host-a", "host-b"):
            cluster.start_agent(name, env=(agent_env or {}).get(name))
        for i in range(spares):
            cluster.start_agent(f"spare-{i + 1}", spare=True, env=(agent_env or {}).get(f"spare-{i + 1}"))
    rdv, out = tmp_path / "rdv", tmp_path / "out"
    rdv.mkdir()
    ranks = cluster.start_job("nccl", _cmd(script, rdv, out, steps, extra), 4,
                              {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"},
                              env={"PYTHONPATH": str(WORKLOADS), **(job_env or {})},
                              run_args=["--host-nccl", *run_args])
    return CoordinatorClient(cluster.coordinator_url, cluster.operator_token), ranks, out


def _evacuate(cc, node, to=None):
    op = cc.evacuate(node, to=to)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        op = cc.op(op["name"])
        if op["done"]:
            return op
        time.sleep(0.1)
    raise TimeoutError(op)


@pytest.mark.parametrize("script", ["nccl_dp.py", "nccl_tp_dp.py", "nccl_pipeline.py"])
def test_evacuate_nccl_job_across_addresses(cluster, tmp_path, script):
    cc, ranks, out = _start(cluster, tmp_path, script)
    wait_for_step(ranks[3].log, 20)
    op = _evacuate(cc, "host-b")
    md = op["metadata"]
    assert md["result"] == "succeeded", op.get("error")
    assert md["plan"]["pause"] == "nccl_cut", md["plan"]  # the shim's consistent cut, not SIGSTOP
    assert "rewire" in md["phases"] and md["cut"]["rewired"] and md["cut"]["new_ids"]
    # the early rewire (the default): the ranks that stay began re-creating their communicators as the
    # capture began; the restored ones joined them; the full ids are not kept once spent
    assert md["cut"]["early"] is True and md["cut"]["prewire_s"] > 0 and "early_ids" not in md["cut"], md["cut"]
    assert any(c["type"] == "Rewired" and "began during the capture" in c["message"] for c in md["conditions"])
    # no allocator the shim could reach (no torch, no CUDA runtime): nothing released, the move as before
    assert md["workers"]["nccl.2"]["device_memory"] == {"released_by": ["nothing reachable"]}, md["workers"]
    assert any(c["type"] == "Quiesced" and c["reason"] == "ConsistentCut" for c in md["conditions"])
    assert any(c["type"] == "Rewired" and c["status"] == "True" for c in md["conditions"])
    # the new unique id names the new rendezvous address: another host's own address
    addrs = {h["name"]: h["url"].split("//")[1].split(":")[0] for h in cc.hosts()}
    assert addrs["host-b"] != addrs["spare-1"] != addrs["host-a"]
    # the ledger: the job's time to useful progress after the move, measured from its collectives
    entry = until(lambda: next((m for m in cc.moves() if m["operation"] == op["name"] and m["after_move"]), None),
                  timeout=30, what="the move's entry in the ledger, with what the job did after it")
    a = entry["after_move"]
    assert a["measured"] and a["ranks"] == 4, a
    assert 0 < a["first_collectives_s"] < 10 and a["first_collectives_s"] != md["downtime_s"], a
    assert a["collectives_per_s_after"] > 0, a
    # a step's run of NCCL calls, found in the shim's trail before the move: dp 2 all-reduces; tp_dp an
    # all-gather, 2 all-reduces and a broadcast; the pipeline's middle stages 2 sends and 2 receives
    assert a["ops_per_step"] == {"nccl_dp.py": 2, "nccl_tp_dp.py": 4, "nccl_pipeline.py": 4}[script], a
    # timed by each rank's shim (its operations' stamps), not by the coordinator's reads
    assert a["timed_by"] == "shim" and a["first_collectives_s"] <= a["first_step_s"] < 10, a
    # from the last restore (the destination's clock) to every rank's first collective done (the shims')
    assert md["last_restore"] < a["first_collectives_at"] < md["last_restore"] + 10, (md["last_restore"], a)
    # the pause each rank saw, from its own shim: all four, each about the move's
    pauses = entry["rank_pause_s"]
    assert sorted(pauses) == [f"nccl.{r}" for r in range(4)], entry
    assert all(0 < p < md["downtime_s"] + 1.0 for p in pauses.values()) and max(pauses.values()) > md["downtime_s"] / 2
    if "collectives_per_s_before" in a:  # measured where the move's start and its cut were far enough apart
        assert a["collectives_per_s_before"] > 0 and a["step_time_ratio"] > 0, a
    assert entry["decision"]["destination"] == "spare-1" and entry["pause_s"] == md["downtime_s"]
    assert entry["bytes"]["during_pause"] > 0 and entry["leaving"] == ["nccl.2", "nccl.3"]
    metrics = httpx.get(cluster.coordinator_url + "/metrics", timeout=10).text
    assert "pitstop_coordinator_move_first_collectives_seconds_count 1.0" in metrics
    assert "pitstop_coordinator_move_first_step_seconds_count 1.0" in metrics
    let_finish(out)
    assert [r.proc.wait(180) for r in ranks] == [0] * 4
    assert_same_as_reference(out, reference(script))
    log = (cluster.root / "coordinator.log").read_text()
    assert "consistent cut reached" in log and "communicators re-created with new unique ids" in log
    # nothing in the application knew: no pitstop name in its output
    assert all("pitstop" not in r.log.read_text().replace(str(cluster.root), "") for r in ranks)


def test_the_early_rewire_off_re_creates_every_communicator_after_the_restore(cluster, tmp_path):
    """PITSTOP_COORDINATOR_EARLY_REWIRE=false: the order before the early rewire, every rank
    re-creating its communicators once the leaving ones are restored, rank 0's ids."""
    cc, ranks, out = _start(cluster, tmp_path, "nccl_tp_dp.py",
                            coord_env={"PITSTOP_COORDINATOR_EARLY_REWIRE": "false"})
    wait_for_step(ranks[3].log, 20)
    md = _evacuate(cc, "host-b")["metadata"]
    assert md["result"] == "succeeded" and md["cut"]["rewired"], md
    assert md["cut"]["early"] is False and "EARLY_REWIRE=false" in md["cut"]["early_why_not"], md["cut"]
    assert "prewire_s" not in md["cut"] and "early_ids" not in md["cut"], md["cut"]
    let_finish(out)
    assert [r.proc.wait(180) for r in ranks] == [0] * 4
    assert_same_as_reference(out, reference("nccl_tp_dp.py"))


def test_a_pair_wholly_on_the_leaving_host_gets_its_id_from_a_restored_rank(cluster, tmp_path):
    """The tensor x data parallel job with its pairs made by ncclCommInitRank of their own
    (NCCLPY_GROUPS=init, as PyTorch's new_group makes them): the pair of ranks 2 and 3 lies wholly
    on host-b.  The ranks that stay make the ids of the world and of the three pairs they belong to
    and rebuild during the capture; the leaving pair's id is made by rank 2 once restored.  Bitwise
    equal to an uninterrupted run."""
    env = {"NCCLPY_GROUPS": "init"}
    cc, ranks, out = _start(cluster, tmp_path, "nccl_tp_dp.py", job_env=env)
    wait_for_step(ranks[3].log, 20)
    md = _evacuate(cc, "host-b")["metadata"]
    assert md["result"] == "succeeded" and md["cut"]["early"] is True, md
    assert len(md["cut"]["new_ids"]) == 5, md["cut"]
    let_finish(out)
    assert [r.proc.wait(180) for r in ranks] == [0] * 4
    assert_same_as_reference(out, reference("nccl_tp_dp.py", job_env=env))


@pytest.mark.parametrize("fault", ["restore_fails", "ids_spent"])
def test_a_rollback_with_the_early_rebuild_under_way_leaves_the_job_whole(cluster, tmp_path, fault):
    """The ranks that stay are waiting in their early rebuild's bootstrap when the move fails.
    restore_fails: the destination's restore fails (the sources were released): each source is
    restored from its own images and joins the survivors' rebuild with the same ids, none redone.
    ids_spent: the record already says the restored ranks were told the ids (a fault right after):
    the early rebuild is abandoned and every communicator re-created in place with fresh ids.
    Either way the job ends bitwise equal to an uninterrupted run, on its own hosts."""
    spent = fault == "ids_spent"
    cc, ranks, out = _start(cluster, tmp_path, "nccl_tp_dp.py",
                            coord_env={"PITSTOP_ENABLE_FAULTS": "1", "PITSTOP_FAULTS": "rewire:ids_spent=fail"}
                            if spent else None,
                            agent_env=None if spent else {"spare-1": {"PITSTOP_ENABLE_FAULTS": "1",
                                                                      "PITSTOP_FAULTS": "restore:before_criu=fail"}})
    wait_for_step(ranks[3].log, 20)
    op = _evacuate(cc, "host-b")
    md = op["metadata"]
    assert md["result"] == "failed" and "injected fault" in op["error"]["message"], op.get("error")
    assert not op["error"]["details"][0].get("metadata", {}).get("rollback_problems"), op["error"]
    assert md["cut"]["prewire_s"] > 0 and md["cut"]["early_ids"] and not md["cut"]["destroyed"], md["cut"]
    assert bool(md["cut"].get("early_joined")) is spent, md["cut"]
    log = (cluster.root / "coordinator.log").read_text()
    assert ("redone in place" in log) is spent, log[-3000:]
    if not spent:  # the rollback's rewire: the two rolled-back sources joined the survivors' rebuild
        assert re.search(r"communicators re-created with new unique ids .*early=True.*joined=2", log), log[-3000:]
    let_finish(out)
    assert [r.proc.wait(180) for r in ranks] == [0] * 4
    assert_same_as_reference(out, reference("nccl_tp_dp.py"))
    where = {w["id"]: w["host"] for j in cc.jobs() for w in j["workers"]}
    assert where["nccl.2"] == "host-b" and where["nccl.3"] == "host-b"


def test_evacuate_a_job_whose_communicators_are_nonblocking(cluster, tmp_path):
    """config.blocking = 0 (PyTorch's nonblocking mode): init and split answer ncclInProgress;
    the shim keeps the caller's whole config and, re-creating them, waits until each is ready
    before splitting the next from it."""
    cc, ranks, out = _start(cluster, tmp_path, "nccl_tp_dp.py", job_env={"NCCLPY_NONBLOCKING": "1"})
    wait_for_step(ranks[3].log, 20)
    op = _evacuate(cc, "host-b")
    assert op["metadata"]["result"] == "succeeded", op.get("error")
    assert op["metadata"]["cut"]["rewired"]
    let_finish(out)
    assert [r.proc.wait(180) for r in ranks] == [0] * 4
    assert_same_as_reference(out, reference("nccl_tp_dp.py"))


def test_three_evacuations_in_a_row_one_back_to_its_first_host(cluster, tmp_path):
    cc, ranks, out = _start(cluster, tmp_path, "nccl_tp_dp.py", spares=2, steps=500)
    wait_for_step(ranks[3].log, 20)
    assert _evacuate(cc, "host-b")["metadata"]["result"] == "succeeded"          # 2, 3 -> spare-1
    cc.uncordon("host-b")  # drained by the evacuation: back in service before it takes them again
    assert _evacuate(cc, "spare-1", to="host-b")["metadata"]["result"] == "succeeded"  # back home
    assert _evacuate(cc, "host-a")["metadata"]["result"] == "succeeded"          # 0, 1 -> spare-2
    where = {w["id"]: w["host"] for j in cc.jobs() for w in j["workers"]}
    assert where == {"nccl.0": "spare-2", "nccl.1": "spare-2", "nccl.2": "host-b", "nccl.3": "host-b"}
    let_finish(out)
    assert [r.proc.wait(240) for r in ranks] == [0] * 4
    assert_same_as_reference(out, reference("nccl_tp_dp.py", 500))


def test_rank_that_never_reaches_the_cut_fails_cleanly(cluster, tmp_path):
    cc, ranks, out = _start(cluster, tmp_path, "nccl_dp.py",
                            extra=("--stall-rank", "1", "--stall-at", "40", "--stall-seconds", "8"),
                            coord_env={"PITSTOP_COORDINATOR_CUT_DEADLINE_S": "2"})
    wait_for_step(ranks[1].log, 40)
    op = _evacuate(cc, "host-b")
    assert op["metadata"]["result"] == "failed"
    assert op["error"]["details"][0]["reason"] == "cut_failed"
    assert "nccl.1" in op["error"]["message"] and "keeps running" in op["error"]["details"][0]["action"]
    let_finish(out)
    assert [r.proc.wait(180) for r in ranks] == [0] * 4
    assert_same_as_reference(out, reference("nccl_dp.py"))
    where = {w["id"]: w["host"] for j in cc.jobs() for w in j["workers"]}
    assert where["nccl.2"] == "host-b"


@pytest.mark.parametrize("mode", ["around", "kept"])
def test_a_job_with_premulsum_operators_moves_across_addresses(cluster, tmp_path, mode):
    """ncclRedOpCreatePreMulSum (tests/workloads/nccl_premul.py).  'around': an operator made, used and
    destroyed around every all-reduce, as PyTorch's ProcessGroupNCCL does for PREMUL_SUM, so none is
    alive at the cut.  'kept': operators alive across collectives, one reading its scalar from the
    job's memory at each collective, which NCCL numbers differently on the rebuilt communicator.
    Once refused as unmovable; now listed movable, evacuated across addresses (live operators made
    again, the job's values translated) and bitwise equal to an uninterrupted run."""
    env = {"NCCLPY_PREMUL": mode}
    pace_file(tmp_path / "out").write_text("0.05\n")  # until let_finish: the move must find it running
    cc, ranks, out = _start(cluster, tmp_path, "nccl_premul.py", job_env=env)
    wait_for_step(ranks[3].log, 20)
    blocks = cluster.agents["host-b"].client().shim_blocks_many(["nccl.2", "nccl.3"])
    assert all(b["comms"] and b["refused"] is None for bs in blocks.values() for b in bs), blocks
    op = _evacuate(cc, "host-b", to="spare-1")  # the cut refuses what a shim refused (test_cut.py)
    md = op["metadata"]
    assert md["result"] == "succeeded", op.get("error")
    assert md["plan"]["pause"] == "nccl_cut" and md["cut"]["rewired"], md
    let_finish(out)
    assert [r.proc.wait(180) for r in ranks] == [0] * 4
    assert_same_as_reference(out, reference("nccl_premul.py", job_env=env))
    assert all("pitstop" not in r.log.read_text().replace(str(cluster.root), "") for r in ranks)


# -- only live device bytes move: the allocators' unused memory released at the cut ---------------

FAKE_ALLOCATOR = WORKLOADS / "fake_cuda_allocator"


def test_the_leaving_ranks_release_unused_device_memory_at_the_cut_and_only_they(cluster, tmp_path):
    """A stand-in for PyTorch's caching allocator (1000 MiB reserved, 200 MiB live) in every rank:
    the shim empties the leaving ranks' caches once, while they are parked at the cut, before
    their capture; the peers' are left alone.  The job finishes as if nothing happened."""
    log = tmp_path / "empty_cache.log"
    cc, ranks, out = _start(cluster, tmp_path, "nccl_dp.py",
                            job_env={"PYTHONPATH": f"{FAKE_ALLOCATOR}:{WORKLOADS}", "FAKE_ALLOC_LOG": str(log)})
    wait_for_step(ranks[3].log, 20)
    op = _evacuate(cc, "host-b")
    md = op["metadata"]
    assert md["result"] == "succeeded", op.get("error")
    calls = [line.split() for line in log.read_text().splitlines()]
    assert sorted(rank for rank, _ in calls) == ["2", "3"], calls  # once each, the leaving ranks only
    assert all(md["first_pause"] < float(t) < md["last_resume"] for _, t in calls), (calls, md)
    for wid in ("nccl.2", "nccl.3"):
        assert md["workers"][wid]["device_memory"] == {
            "released_by": ["torch"], "reserved_before": 1000 * 2**20, "reserved_after": 200 * 2**20,
            "released": 800 * 2**20}, md["workers"][wid]
    assert md["cut"]["trim_s"] > 0
    let_finish(out)
    assert [r.proc.wait(180) for r in ranks] == [0] * 4
    assert_same_as_reference(out, reference("nccl_dp.py"))


def test_a_release_that_fails_rolls_the_move_back_and_the_job_runs_on(cluster, tmp_path):
    cc, ranks, out = _start(cluster, tmp_path, "nccl_dp.py",
                            job_env={"PYTHONPATH": f"{FAKE_ALLOCATOR}:{WORKLOADS}",
                                     "FAKE_ALLOC_LOG": str(tmp_path / "empty_cache.log"), "FAKE_ALLOC_FAIL": "1"})
    wait_for_step(ranks[3].log, 20)
    op = _evacuate(cc, "host-b")
    assert op["metadata"]["result"] == "failed"
    msg = op["error"]["message"]
    assert "release of unused device memory failed" in msg and "illegal memory access" in msg, msg
    assert "nccl.2" in msg and "runs on where it was" in op["error"]["details"][0]["action"]
    let_finish(out)
    assert [r.proc.wait(180) for r in ranks] == [0] * 4
    assert_same_as_reference(out, reference("nccl_dp.py"))
    where = {w["id"]: w["host"] for j in cc.jobs() for w in j["workers"]}
    assert where["nccl.2"] == "host-b" and where["nccl.3"] == "host-b"


# -- an unchanged C program, and one the shim can only half see ----------------------------------

@pytest.fixture(scope="module")
def fsdp_program(tmp_path_factory):
    """tests/workloads/nccl_fsdp.c built as a user would: against NCCL's header, linked to libnccl."""
    return str(nccl_builds.fsdp_program(tmp_path_factory.mktemp("fsdp")))


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    """The same program loading libnccl itself (dlopen, dlsym), a copy of libnccl at another path, and
    NCCL linked into another library."""
    d = tmp_path_factory.mktemp("nccl_builds")
    return {"fsdp_dlopen": nccl_builds.fsdp_program(d, dlopen=True), "copy": nccl_builds.nccl_copy(d / "other"),
            "trainer": nccl_builds.static_nccl_library(d)}


def test_an_unchanged_c_program_with_a_split_communicator_moves_across_addresses(cluster, tmp_path, fsdp_program):
    """ncclCommInitRank from an id shared by a file, ncclCommSplit(world, rank % 2, rank, &sub, NULL),
    then broadcast, all-gather and reduce-scatter on the world and an all-reduce on the split one:
    evacuated to a host with other addresses, every rank ends bitwise equal to an uninterrupted run."""
    cc, ranks, out = _start(cluster, tmp_path, fsdp_program)
    wait_for_step(ranks[3].log, 20)
    assert [j["movable"] for j in cc.jobs()] == [True]
    op = _evacuate(cc, "host-b", to="spare-1")
    md = op["metadata"]
    assert md["result"] == "succeeded", op.get("error")
    assert md["cut"]["rewired"] and md["cut"]["new_ids"]
    let_finish(out)
    assert [r.proc.wait(180) for r in ranks] == [0] * 4
    assert_same_as_reference(out, reference(fsdp_program))
    assert not any("did not create" in r.log.read_text() for r in ranks)


@pytest.mark.parametrize("load", ["soname", "path"])
def test_an_unchanged_python_program_that_loads_libnccl_with_ctypes_moves_across_addresses(cluster, tmp_path, load,
                                                                                           builds):
    """ctypes.CDLL on libnccl, every function from that handle, as vLLM's PyNccl and CuPy load it: a
    world and a split communicator, collectives on both.  By soname; or by full path, a copy in
    another directory, beside the library found by soname with a world of its own on it (two copies
    of NCCL in one process).  Before: refused as unmovable (the shim met its communicators only when
    NCCL polled them).  Evacuated to a host with other addresses, bitwise equal to an uninterrupted run."""
    env = {} if load == "soname" else {"NCCL_SO_PATH": str(builds["copy"]), "NCCL_ALSO_SONAME": "1"}
    cc, ranks, out = _start(cluster, tmp_path, "nccl_ctypes.py", job_env=env)
    wait_for_step(ranks[3].log, 20)
    until(lambda: [j["movable"] for j in cc.jobs()] == [True] and all(
        w["unmovable"] is None for w in cc.jobs()[0]["workers"]), timeout=30, what="the job listed movable")
    op = _evacuate(cc, "host-b", to="spare-1")
    md = op["metadata"]
    assert md["result"] == "succeeded", op.get("error")
    assert md["plan"]["pause"] == "nccl_cut" and md["cut"]["rewired"], md
    assert len(md["cut"]["new_ids"]) == (1 if load == "soname" else 2), md["cut"]  # a world per copy of NCCL
    let_finish(out)
    assert [r.proc.wait(180) for r in ranks] == [0] * 4
    assert_same_as_reference(out, reference("nccl_ctypes.py", job_env=env))
    assert all("pitstop" not in r.log.read_text().replace(str(cluster.root), "") for r in ranks)


@pytest.mark.parametrize("how", ["local", "deepbind"])
def test_an_unchanged_c_program_that_dlopens_libnccl_moves_across_addresses(cluster, tmp_path, how, builds,
                                                                            fsdp_program):
    """The FSDP program not linked to libnccl: it dlopens libnccl.so.2 (RTLD_LOCAL, or with
    RTLD_DEEPBIND) and takes each function with dlsym.  Moved across addresses, it ends bitwise equal
    to the same program linked to libnccl and never interrupted."""
    cc, ranks, out = _start(cluster, tmp_path, str(builds["fsdp_dlopen"]), extra=("--dlopen", how))
    wait_for_step(ranks[3].log, 20)
    until(lambda: [j["movable"] for j in cc.jobs()] == [True] and all(
        w["unmovable"] is None for w in cc.jobs()[0]["workers"]), timeout=30, what="the job listed movable")
    op = _evacuate(cc, "host-b", to="spare-1")
    md = op["metadata"]
    assert md["result"] == "succeeded", op.get("error")
    assert md["cut"]["rewired"] and md["cut"]["new_ids"], md["cut"]
    let_finish(out)
    assert [r.proc.wait(180) for r in ranks] == [0] * 4
    assert_same_as_reference(out, reference(fsdp_program))
    assert not any("pitstop shim" in r.log.read_text() for r in ranks)


def test_a_job_the_shim_cannot_move_is_refused_before_anything_pauses(cluster, tmp_path, builds):
    """A second communicator made through NCCL linked into another library (its calls bound inside
    it): what the shim cannot stand in front of, seen when the library is loaded.  Refused before
    anything pauses, with the reason and what to do."""
    # 2,000 steps (40 s at the job's pace): it must still run when the evacuation is asked, after
    # the agents' reports, a CLI call and the checks (300 steps had ended by then on a loaded machine)
    cc, ranks, out = _start(cluster, tmp_path, "nccl_private_comm.py", steps=2000,
                            job_env={"PRIVATE_NCCL": str(builds["trainer"])})
    wait_for_step(ranks[3].log, 10)
    until(lambda: cc.jobs() and all(w["unmovable"] for w in cc.jobs()[0]["workers"]), timeout=30,
          what="every rank reported unmovable by its agent")
    job = cc.jobs()[0]
    inside = f"NCCL is inside {builds['trainer']}"
    assert not job["movable"] and all(w["unmovable"].startswith(inside) for w in job["workers"]), job
    env = dict(os.environ, PITSTOP_TOKEN=cluster.operator_token)
    p = subprocess.run([*pitstop_cmd(), "jobs", "--coordinator", cluster.coordinator_url], capture_output=True,
                       text=True, env=env, timeout=60)
    assert p.returncode == 0 and "no, because" in " ".join(p.stdout.split()), p.stdout + p.stderr
    with pytest.raises(PitstopError) as e:
        cc.evacuate("host-b")
    assert e.value.code == "unmovable_job" and "nothing was paused" in e.value.action, e.value
    assert "nccl.2" in e.value.message and inside in e.value.message and "libnccl.so.2" in e.value.message
    assert cc.ops() == [], "no operation may start"
    for name in ("host-a", "host-b"):  # no rank was ever asked to stop at a cut
        blocks = cluster.agents[name].client().shim_blocks_many([f"nccl.{r}" for r in range(4)
                                                                 if (r < 2) == (name == "host-a")])
        assert blocks and all(b["request"] == 0 for bs in blocks.values() for b in bs), blocks
    let_finish(out)
    assert [r.proc.wait(180) for r in ranks] == [0] * 4
