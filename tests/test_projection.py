"""bench/projection.py's inputs: the GPU rates come from a tests/gpu report's check (d), its
largest size, and a report without one is refused with the command that makes one; the CPU
rates come from the kept compare runs, a full dump's rate never from an incremental one.  Its
events (both stacks, planned and unplanned) recomputed by hand, and its break-even values hold."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import projection  # noqa: E402
from pitstop.replay import pricing  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_rates_come_from_the_largest_size_of_check_d():
    g = projection.load_gpu(ROOT / "docs" / "img" / "gpu-2026-11-30-h200.json")
    assert g["at_gib"] == 32 and 0.5 < g["checkpoint_GBps"] < 0.53 and 1.5 < g["restore_GBps"] < 1.7
    assert "H200" in g["source"]
    m = {"stream_Bps": 1e9, "restore_Bps": 1.5e9, "round_s": 0.02}
    today, live = projection.project(m, 64, g), projection.project(m, 64, g, "live")
    assert today["pitstop"]["gpu"] == pytest.approx(100 / g["checkpoint_GBps"] + 100 / g["restore_GBps"])
    assert live["pitstop"]["gpu"] == pytest.approx(16 / g["checkpoint_GBps"] + 16 / g["restore_GBps"])
    link = projection.project(m, 64, g, "live_at_pcie")
    assert link["pitstop"]["gpu"] == pytest.approx(2 * 16 / 55.3)  # the link's measured rate both ways


def test_a_report_without_check_d_is_refused(tmp_path):
    r = tmp_path / "r.json"
    r.write_text(json.dumps({"checks": {"a_cuda_checkpoint_roundtrip": {"status": "passed"}}}))
    with pytest.raises(SystemExit, match="run tests/gpu/run.sh --only d"):
        projection.load_gpu(r)


@pytest.mark.parametrize("kept,dump_gbps,incremental", [
    ("compare-2026-12-01.json", 2.28, False),  # pitstop cut the delta out of CRIU's full dump
    ("compare-2026-12-02-parent.json", 1.62, True),  # CRIU dumped only what changed, itself
])
def test_a_full_dumps_rate_never_comes_from_an_incremental_dump(kept, dump_gbps, incremental):
    """Since 2026-12-02 a pre-copied rank's dump holds only what changed: 0.12 s for 771 MB is no
    dump rate (it read 6.5 GB/s), so the model takes it from the stop-and-copy run's full dumps."""
    m = projection._load(ROOT / "docs" / "img" / kept)
    assert m["dump_Bps"] / 1e9 == pytest.approx(dump_gbps, abs=0.01)
    assert ("the dump's from pitstop, stop-and-copy" in m["rates_from"]) is incremental
    assert m["digest_Bps"] > 0  # a GPU host's ranks are digested: the pre-copy column stays


def test_the_json_runs_as_checked_in_and_says_where_each_input_comes_from():
    """A fresh clone has no bench/out: the defaults are kept files (docs/img).  Both sides come
    as ranges over the two stacks, every input says its kind and source."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "projection.py"), "--json"], capture_output=True,
                       text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["model"].startswith("a projection") and d["stacks"] == ["optimised", "default"]
    assert [s["gpus"] for s in d["sizes"]] == [64, 1024, 16384]
    for s in d["sizes"]:
        for st in s["stacks"].values():
            assert st["checkpoint_restart_s"] > 0 and st["pitstop_today_s"] > st["pitstop_live_s"] > 0
        lo, hi = s["ranges"]["checkpoint_restart_s"]
        assert 0 < lo < hi  # the optimised stack restarts faster than the default one
    assert d["sizes"][1]["trainmover_s"] == 20.0 and "2412.12636" in d["trainmover"]["source"]
    for name, i in d["inputs"].items():
        assert i["kind"] in ("measured", "cited", "assumed") and len(i["source"]) > 20, name
    assert d["inputs"]["cuda_checkpoint_gbps"]["kind"] == "measured" and "H200" in d["inputs"]["cuda_checkpoint_gbps"]["source"]
    assert [e["gpus"] for e in d["events"]] == [1024, 16384]
    for e in d["events"]:
        for stack, x in e["stacks"].items():
            for side in ("pitstop", "checkpoint_restart"):
                assert x[side]["planned_s"] > 0 and x[side]["failure_s"] > 0, (stack, side)
            assert set(x["must_hold"]) == {"planned", "unplanned"}
            assert all(m["text"] for m in x["must_hold"].values())
        assert e["published"]["flashrecovery"]["failure_s"] == 150.0
    assert "trainmover" in d["events"][0]["published"] and "trainmover" not in d["events"][1]["published"]
    assert d["calibration"]["ft_hsdp"]["published_stall_s"] == 600.0


def test_events_by_hand():
    """A planned event at 16,384 GPUs on the default stack, and what must hold, recomputed."""
    v = projection.values()
    ev = {e["gpus"]: e for e in projection.events(v)}[16384]["stacks"]
    slope = 115 / math.log2(24)
    nccl = 150 + 2 * slope
    assert ev["default"]["checkpoint_restart"]["planned_s"] == pytest.approx(81.92 + 60 + 60 + nccl + 81.92)
    # a move: 3 rounds over 2,048 hosts, 16 live GB out and back in, 128 GB streamed at 8 x 1.48
    # GB/s, restored at 3.12 GB/s a rank, the rewire at the job's size
    move = 3 * (0.015 + 2048 * 0.0017) + 16 / 0.52 + 16 / 1.6 + 128 / (8 * 1.48) + 16 / 3.12 + nccl
    assert ev["default"]["pitstop"]["planned_s"] == pytest.approx(move)
    assert ev["default"]["pitstop_rewire_off_path"]["planned_s"] == pytest.approx(move - nccl)
    # where a device-rate factor is given, pitstop's event costs exactly the opponent's there
    for stack, x in ev.items():
        mh = x["must_hold"]["planned"]
        if mh["factor"] not in (None, 1.0) and not mh["conditions"]:
            w = pricing.scaled(v, mh["factor"])
            assert projection._move_s(16384, stack, w) == pytest.approx(x["checkpoint_restart"]["planned_s"], rel=1e-6)
    # the break-even interval, where there is one, holds pitstop to checkpoint-restart's loss a failure
    mtbf = pricing.mtbf_h(16384)
    for stack, x in ev.items():
        iv = x["break_even"]["snapshot_interval_h"]
        if iv is not None:
            for h in iv:
                assert projection._failure_s(16384, stack, v, mtbf, True, h) == pytest.approx(
                    x["checkpoint_restart"]["failure_s"], rel=1e-6)


def test_at_each_break_even_value_both_methods_take_as_long():
    m = projection._load(projection.MEASURED)
    g = projection.load_gpu(projection.GPU_REPORT)
    found = 0
    for stack in ("optimised", "default"):
        rows = projection.sensitivity(m, g, "live", stack)
        for row in rows:
            for gpus, v in row["break_even"].items():
                if v is None:
                    continue
                r = projection.project(m, gpus, g, "live", stack, **{row["input"]: v})
                assert projection.best(r) == pytest.approx(r["checkpoint_restart_s"], rel=1e-3), (row["input"], gpus)
                found += 1
        # more live device memory per GPU makes pitstop slower: where it is ahead today its break-even
        # lies above today's value, where it is behind, below
        live = next(r for r in rows if r["input"] == "device_live_gb")
        for gpus, v in live["break_even"].items():
            r = projection.project(m, gpus, g, "live", stack)
            if v is not None:
                assert (v > live["now"]) == (projection.best(r) < r["checkpoint_restart_s"]), (stack, gpus)
    assert found >= 10
