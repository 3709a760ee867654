"""`pitstop replay` (replay/): a small trace priced by hand gives the same numbers; bad traces and
inputs are refused saying what is wrong; the synthetic trace follows its cited rates; the command
line writes its report, JSON and chart."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pitstop import cli
from pitstop.errors import InvalidRequest
from pitstop.replay import model, trace

TRACE = """time_h,host,kind,domain
0.5,h1,planned,r1
2.25,h2,unplanned,r1
3.0,h3,unplanned,r2
"""
# 4 hosts of 2 GPUs (8 GPUs); a spare per rack, back 2 h after use; a move 36 s (0.01 h), a
# restart 360 s (0.1 h), a checkpoint 180 s (0.05 h) every hour; 4 hours.
INPUTS = model.Inputs(hosts=4, gpus_per_host=2, spares_per_domain=1, pooled_spares=0, repair_h=2.0,
                      move_pause_s=36.0, restart_s=360.0, checkpoint_save_s=180.0, checkpoint_interval_h=1.0,
                      duration_h=4.0)


@pytest.fixture
def small(tmp_path: Path) -> list[trace.Event]:
    p = tmp_path / "t.csv"
    p.write_text(TRACE)
    return trace.read(p)


def test_a_small_trace_gives_what_a_hand_calculation_gives(small):
    r = model.replay(small, INPUTS)
    # 0.5 h, planned, r1's spare free: restart (0.05 + 0.1) x 8 = 1.2; pitstop 0.01 x 8 = 0.08.
    # 2.25 h, unplanned, r1's spare back only at 2.5: wait 0.25 h; 0.25 h since the 2 h checkpoint;
    #   both (0.25 + 0.1 + 0.25) x 8 = 4.8.
    # 3.0 h, unplanned, r2's spare free, just checkpointed: both (0 + 0.1) x 8 = 0.8.
    assert r.lost_restart_gpu_h == pytest.approx(1.2 + 4.8 + 0.8)
    assert r.lost_pitstop_gpu_h == pytest.approx(0.08 + 4.8 + 0.8)
    assert r.saved_gpu_h == pytest.approx(1.12)
    assert r.wait_gpu_h == pytest.approx(0.25 * 8) and r.unplanned_lost_work_gpu_h == pytest.approx(0.25 * 8)
    assert r.checkpoints_gpu_h == pytest.approx(4 * 0.05 * 8)      # 4 checkpoints of 0.05 h, 8 GPUs
    assert r.spares_idle_gpu_h == pytest.approx(2 * 2 * 4)         # 2 spares (one per rack) of 2 GPUs, 4 h
    assert r.break_even_move_pause_s == 540.0
    assert (r.planned, r.unplanned) == (1, 2)
    c1, c2 = r.coverage["r1"], r.coverage["r2"]
    assert (c1.events, c1.own_spare, c1.waited, c1.covered_share) == (2, 1, 1, 0.5)
    assert c1.wait_h == pytest.approx(0.25)
    assert (c2.events, c2.own_spare, c2.covered_share) == (1, 1, 1.0)


def test_a_pooled_spare_covers_what_the_racks_cannot(small):
    r = model.replay(small, model.Inputs(**{**INPUTS.__dict__, "pooled_spares": 1}))
    assert r.coverage["r1"].pooled == 1 and r.coverage["r1"].waited == 0 and r.wait_gpu_h == 0.0
    assert r.lost_restart_gpu_h == pytest.approx(1.2 + (0.25 + 0.1) * 8 + 0.8)


def test_sensitivity_by_hand(small):
    sens = model.sensitivity(small, INPUTS)
    by = {s["input"]: s for s in sens}
    # the one planned event: a restart of 180 s or 720 s instead of 360 s makes its
    # checkpoint-restart cost (0.05 + 0.05) x 8 = 0.8 or (0.05 + 0.2) x 8 = 2.0 instead of 1.2
    assert sens[0]["input"] == "restart_s"
    assert by["restart_s"]["low_saved_gpu_h"] == pytest.approx(0.8 - 0.08)
    assert by["restart_s"]["high_saved_gpu_h"] == pytest.approx(2.0 - 0.08)
    # halving the move's pause saves 0.04 GPU-hours more, doubling it 0.08 less
    assert by["move_pause_s"]["low_saved_gpu_h"] == pytest.approx(1.12 + 0.04)
    assert by["move_pause_s"]["high_saved_gpu_h"] == pytest.approx(1.12 - 0.08)
    # unplanned costs are the same either way: the checkpoint interval moves both alike
    assert by["checkpoint_interval_h"]["low_saved_gpu_h"] == pytest.approx(1.12)
    assert by["spares_per_domain"]["low_saved_gpu_h"] is None  # no spare at all: refused, not priced


@pytest.mark.parametrize(("text", "says"), [
    ("time_h,host,kind\n1,h,planned\n", "header must name time_h, host, kind, domain"),
    ("time_h,host,kind,domain\n1,h,crashed,r\n", "line 2: kind 'crashed' is neither planned nor unplanned"),
    ("time_h,host,kind,domain\n-1,h,planned,r\n", "line 2: time_h -1.0 is before the trace's start"),
    ("time_h,host,kind,domain\nsoon,h,planned,r\n", "line 2: time_h 'soon' is not a number of hours"),
    ("time_h,host,kind,domain\n1,,planned,r\n", "line 2: missing host"),
    ("time_h,host,kind,domain\n", "has no events"),
])
def test_a_bad_trace_is_refused_with_its_line(tmp_path, text, says):
    p = tmp_path / "t.csv"
    p.write_text(text)
    with pytest.raises(InvalidRequest, match=says):
        trace.read(p)


def test_inputs_that_cannot_be_are_refused(small):
    with pytest.raises(InvalidRequest, match="hosts=0"):
        model.replay(small, model.Inputs(hosts=0))
    with pytest.raises(InvalidRequest, match="no spare at all"):
        model.replay(small, model.Inputs(hosts=4, pooled_spares=0))


def test_the_synthetic_trace_follows_its_cited_rates():
    ev = trace.synthesize(2048, 54, seed=3)
    assert ev == trace.synthesize(2048, 54, seed=3)  # reproducible
    planned = sum(1 for e in ev if e.kind == "planned")
    # Llama 3's 54 days on 2,048 hosts: 47 planned, 419 unexpected interruptions (Poisson: within 4 sigma)
    assert abs(planned - 47) < 4 * 47 ** 0.5
    assert abs((len(ev) - planned) - 419) < 4 * 419 ** 0.5 + 16 * 4  # rack events add hosts in sixteens
    assert {e.domain for e in ev} <= {f"rack-{r:03d}" for r in range(128)}
    assert all(0 <= e.time_h < 54 * 24 for e in ev)


def test_the_command_line_writes_a_report_json_and_a_chart(tmp_path, monkeypatch):
    monkeypatch.setattr("pitstop.logs.setup", lambda *a, **k: None)
    p = tmp_path / "t.json"
    r = CliRunner().invoke(cli.app, ["replay-synth", str(p), "--hosts", "64", "--days", "30", "--seed", "1"])
    assert r.exit_code == 0, r.output
    assert json.loads(p.read_text())["events"]
    r = CliRunner().invoke(cli.app, ["replay", str(p), "--hosts", "64", "--pooled-spares", "2", "--json",
                                     "--chart", str(tmp_path / "c.svg")])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["lost_gpu_h"]["checkpoint_restart"] >= d["lost_gpu_h"]["pitstop"] - 1e-9 or d["saved_gpu_h"] < 0
    assert d["inputs"]["move_pause_s"] == model.DEFAULT_MOVE_PAUSE_S and d["sensitivity"]
    assert (tmp_path / "c.svg").read_text().startswith("<svg")
    subprocess.run(["python3", "-c", "import xml.dom.minidom,sys; xml.dom.minidom.parse(sys.argv[1])",
                    str(tmp_path / "c.svg")], check=True, timeout=30)
    r = CliRunner().invoke(cli.app, ["replay", str(tmp_path / "none.csv"), "--hosts", "4"])
    assert r.exit_code == 1 and "cannot read trace" in r.output


def test_hosts_failing_together_cost_one_restart_and_a_failure_during_one_only_lengthens_it(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("time_h,host,kind,domain\n1.5,h1,unplanned,r1\n1.5,h2,unplanned,r1\n1.55,h3,unplanned,r2\n")
    i = model.Inputs(hosts=4, gpus_per_host=2, pooled_spares=3, restart_s=360.0, checkpoint_interval_h=1.0)
    r = model.replay(trace.read(p), i)
    # one spell: down from 1.5 to 1.65 (the last failure at 1.55 restarts until 1.65), 0.5 h of work lost once
    assert r.lost_restart_gpu_h == pytest.approx((0.15 + 0.5) * 8)
    assert r.lost_pitstop_gpu_h == r.lost_restart_gpu_h and r.unplanned_lost_work_gpu_h == pytest.approx(0.5 * 8)
