"""bench/projection.py's inputs: the GPU rates come from a tests/gpu report's check (d), its
largest size, and a report without one is refused with the command that makes one; the CPU
rates come from the kept compare runs, a full dump's rate never from an incremental one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import projection  # noqa: E402

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
    """A fresh clone has no bench/out: the defaults are kept files (docs/img)."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "projection.py"), "--json"], capture_output=True,
                       text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert [s["gpus"] for s in d["sizes"]] == [64, 1024, 16384]
    for s in d["sizes"]:
        assert s["checkpoint_restart_s"] > 0 and s["pitstop_today_s"] > s["pitstop_live_s"] > 0
    assert d["sizes"][1]["trainmover_s"] == 20.0 and "2412.12636" in d["trainmover"]["source"]
    for name, i in d["inputs"].items():
        assert i["kind"] in ("measured", "cited", "assumed") and len(i["source"]) > 20, name
    assert d["inputs"]["cuda_checkpoint_gbps"]["kind"] == "measured" and "H200" in d["inputs"]["cuda_checkpoint_gbps"]["source"]


def test_at_each_break_even_value_both_methods_take_as_long():
    m = projection._load(projection.MEASURED)
    g = projection.load_gpu(projection.GPU_REPORT)
    rows = projection.sensitivity(m, g)
    found = 0
    for row in rows:
        for gpus, v in row["break_even"].items():
            if v is None:
                continue
            r = projection.project(m, gpus, g, "live", **{row["input"]: v})
            assert projection.best(r) == pytest.approx(r["checkpoint_restart_s"], rel=1e-3), (row["input"], gpus)
            found += 1
    assert found >= 10
    # more live device memory per GPU makes pitstop slower: its break-even lies above today's value
    live = next(r for r in rows if r["input"] == "device_live_gb")
    assert all(v > live["now"] for v in live["break_even"].values())
