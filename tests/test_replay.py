"""`pitstop replay` (replay/): a small trace priced by hand gives the same numbers, and so do the
per-event prices (pricing.py) and the break-even searches; bad traces and inputs are refused saying
what is wrong; the synthetic trace follows its cited rates; the command line writes its report,
JSON and chart, and prices the kept Llama 3 trace with every input's kind and source."""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pitstop import cli
from pitstop.errors import InvalidRequest
from pitstop.replay import model, pricing, study, trace

TRACE = """time_h,host,kind,domain
0.5,h1,planned,r1
2.25,h2,unplanned,r1
3.0,h3,unplanned,r2
"""
# 4 hosts of 2 GPUs (8 GPUs); a spare per rack, back 2 h after use; 4 hours.
# pitstop: a move 36 s (0.01 h); a failure detected in 36 s (0.01 h), recovered in 72 s (0.02 h);
#   a snapshot every 0.5 h costing the job 18 s (0.005 h).
# checkpoint-restart: a planned event 540 s (0.15 h: save 180, restart 360); a failure detected
#   in 180 s (0.05 h), restarted in 360 s (0.1 h); a checkpoint every hour, 180 s each (common).
PITSTOP = model.Costs(planned_s=36.0, detection_s=36.0, recover_s=72.0, every_h=0.5, each_s=18.0)
RESTART = model.Costs(planned_s=540.0, detection_s=180.0, recover_s=360.0, every_h=1.0, each_s=180.0)
INPUTS = model.Inputs(hosts=4, gpus_per_host=2, spares_per_domain=1, pooled_spares=0, repair_h=2.0,
                      pitstop=PITSTOP, restart=RESTART, duration_h=4.0)


@pytest.fixture
def small(tmp_path: Path) -> list[trace.Event]:
    p = tmp_path / "t.csv"
    p.write_text(TRACE)
    return trace.read(p)


def test_a_small_trace_gives_what_a_hand_calculation_gives(small):
    r = model.replay(small, INPUTS)
    # 0.5 h, planned, r1's spare free: pitstop 0.01 x 8 = 0.08; checkpoint-restart 0.15 x 8 = 1.2.
    # 2.25 h, unplanned, r1's spare back only at 2.5: a wait of 0.25 h for both.
    #   pitstop: down 0.25 + 0.01 + 0.02 = 0.28 h -> 2.24; 0.25 h since the 2.0 h snapshot -> 2.0.
    #   checkpoint-restart: down 0.25 + 0.05 + 0.1 = 0.4 h -> 3.2; 0.25 h since the 2 h checkpoint -> 2.0.
    # 3.0 h, unplanned, r2's spare free, a snapshot and a checkpoint just taken: pitstop 0.03 x 8 =
    #   0.24; checkpoint-restart 0.15 x 8 = 1.2; no work lost.
    # pitstop's 8 snapshots (4 h / 0.5) of 0.005 h: 0.32.
    assert r.pitstop.planned_gpu_h == pytest.approx(0.08) and r.restart.planned_gpu_h == pytest.approx(1.2)
    assert r.pitstop.unplanned_gpu_h == pytest.approx(2.24 + 0.24)
    assert r.restart.unplanned_gpu_h == pytest.approx(3.2 + 1.2)
    assert r.pitstop.work_gpu_h == pytest.approx(2.0) and r.restart.work_gpu_h == pytest.approx(2.0)
    assert r.pitstop.periodic_gpu_h == pytest.approx(0.32) and r.restart.periodic_gpu_h == 0.0
    assert r.lost_pitstop_gpu_h == pytest.approx(4.88) and r.lost_restart_gpu_h == pytest.approx(7.6)
    assert r.saved_gpu_h == pytest.approx(2.72)
    assert r.wait_gpu_h == pytest.approx(0.25 * 8)
    assert r.checkpoints_gpu_h == pytest.approx(4 * 0.05 * 8)      # 4 checkpoints of 0.05 h, 8 GPUs: common
    assert r.spares_idle_gpu_h == pytest.approx(2 * 2 * 4)         # 2 spares (one per rack) of 2 GPUs, 4 h
    assert r.break_even_move_pause_s == 540.0
    assert (r.planned, r.unplanned, r.failures) == (1, 2, 2)
    # per event: a planned one 0.08 against 1.2; a failure (its down, work and, for pitstop, the
    # snapshots over the history) (2.48 + 2.0 + 0.32) / 2 = 2.4 against (4.4 + 2.0) / 2 = 3.2
    assert r.per_planned_gpu_h("pitstop") == pytest.approx(0.08)
    assert r.per_failure_gpu_h("pitstop") == pytest.approx(2.4)
    assert r.per_failure_gpu_h("checkpoint_restart") == pytest.approx(3.2)
    c1, c2 = r.coverage["r1"], r.coverage["r2"]
    assert (c1.events, c1.own_spare, c1.waited, c1.covered_share) == (2, 1, 1, 0.5)
    assert c1.wait_h == pytest.approx(0.25)
    assert (c2.events, c2.own_spare, c2.covered_share) == (1, 1, 1.0)


def test_a_pooled_spare_covers_what_the_racks_cannot(small):
    r = model.replay(small, replace(INPUTS, pooled_spares=1))
    assert r.coverage["r1"].pooled == 1 and r.coverage["r1"].waited == 0 and r.wait_gpu_h == 0.0
    assert r.lost_restart_gpu_h == pytest.approx(1.2 + (0.05 + 0.1) * 8 + 2.0 + 1.2)


def test_sensitivity_by_hand(small):
    sens = model.sensitivity(small, INPUTS)
    by = {s["input"]: s for s in sens}
    # a checkpoint every 2 h instead of 1: the failure at 3.0 h loses 0.35 h of work (since the
    # job resumed at 2.65 h, after the checkpoint at 2 h): 2.8 GPU-hours more for checkpoint-restart
    assert sens[0]["input"] == "checkpoint_restart.every_h"
    assert by["checkpoint_restart.every_h"]["high_saved_gpu_h"] == pytest.approx(2.72 + 2.8)
    # the planned event's save and restart at 270 or 1080 s: 0.6 or 2.4 GPU-hours instead of 1.2
    assert by["checkpoint_restart.planned_s"]["low_saved_gpu_h"] == pytest.approx(2.72 - 0.6)
    assert by["checkpoint_restart.planned_s"]["high_saved_gpu_h"] == pytest.approx(2.72 + 1.2)
    # snapshots every 0.25 h: 16 of them (0.64) and no work lost; every hour: 4 (0.16), 0.25 h lost
    assert by["pitstop.every_h"]["low_saved_gpu_h"] == pytest.approx(7.6 - (0.08 + 2.48 + 0.0 + 0.64))
    assert by["pitstop.every_h"]["high_saved_gpu_h"] == pytest.approx(7.6 - (0.08 + 2.48 + 2.0 + 0.16))
    # a snapshot costing 9 or 36 s: 0.16 less or 0.32 more
    assert by["pitstop.each_s"]["low_saved_gpu_h"] == pytest.approx(2.72 + 0.16)
    assert by["pitstop.each_s"]["high_saved_gpu_h"] == pytest.approx(2.72 - 0.32)
    assert by["spares_per_domain"]["low_saved_gpu_h"] is None  # no spare at all: refused, not priced


def test_the_break_even_interval_and_rate_are_where_both_lose_as_much(small):
    """At the edges the break-even search returns, pitstop loses as much as checkpoint-restart
    (within the search's tolerance); inside, no more; at the best interval, least."""
    slow = replace(INPUTS, pitstop=replace(PITSTOP, each_s=200.0))
    be = model.break_even_interval(small, slow)
    assert be["shortest_h"] is not None and be["shortest_h"] < be["best_h"] < be["longest_h"]

    def gap(h: float) -> float:
        r = model.replay(small, replace(slow, pitstop=replace(slow.pitstop, every_h=h)))
        return r.lost_pitstop_gpu_h - r.lost_restart_gpu_h
    assert gap(be["shortest_h"]) <= 0 and gap(be["shortest_h"] * 0.999) > 0
    assert gap(be["best_h"]) <= 0
    never = replace(INPUTS, pitstop=replace(PITSTOP, each_s=5000.0))
    assert model.break_even_interval(small, never)["shortest_h"] is None
    # a rate: the snapshot's cost falls as 200 s / x; break-even where the history balances
    x = model.break_even(small, lambda k: replace(slow, pitstop=replace(slow.pitstop, each_s=200.0 / k)))
    assert x is not None
    r = model.replay(small, replace(slow, pitstop=replace(slow.pitstop, each_s=200.0 / x)))
    assert r.lost_pitstop_gpu_h == pytest.approx(r.lost_restart_gpu_h, abs=1e-6)


def test_pricing_by_hand():
    v = pricing.values()
    # NCCL creation: the default stack through 150 s at 4,096 and 265 s at 98,304 GPUs, linear in
    # log2: 25.08 s a doubling; the optimised one 5 s at 2,048, in proportion to log2
    slope = 115 / math.log2(24)
    assert pricing.nccl_create_s(16384, "default", v) == pytest.approx(150 + 2 * slope)
    assert pricing.nccl_create_s(1024, "default", v) == pytest.approx(150 - 2 * slope)
    assert pricing.nccl_create_s(16384, "optimised", v) == pytest.approx(5 * 14 / 11)
    # a snapshot of a 16,384-GPU job on the optimised stack: 4 rounds over 2,048 hosts, the host
    # part, 100 GB out (0.52 GB/s), into CRIU's dump (1.24) and back in (1.60), and the rewire
    terms = pricing.pitstop_terms(16384, "optimised", v)["snapshot"]
    assert terms["control"] == pytest.approx(4 * (0.015 + 2048 * 0.0017))
    assert terms["gpu"] == pytest.approx(100 / 0.52 + 100 / 1.24 + 100 / 1.60)
    assert sum(terms.values()) == pytest.approx(13.9864 + 0.46 + 335.4529 + 6.3636, abs=1e-3)
    # checkpoint-restart, default stack: 164 TB through 2 TB/s to save and again to load
    r = pricing.restart_terms(16384, "default", v)
    assert (r["save"], r["load"], r["detection"]) == (pytest.approx(81.92), pytest.approx(81.92), 600.0)
    p = pricing.price(16384, "default", v)
    assert p.restart.planned_s == pytest.approx(81.92 + 60 + 60 + 150 + 2 * slope + 81.92)
    # per failure: detection 10, pause 20, half a 0.5 h interval redone, 60 s snapshots over 10 h
    c = model.Costs(planned_s=0, detection_s=10, recover_s=20, every_h=0.5, each_s=60)
    assert pricing.per_failure_s(c, 10.0, charge_periodic=True) == pytest.approx(10 + 20 + 900 + 60 * 20)
    assert pricing.per_failure_s(c, 10.0, charge_periodic=False) == pytest.approx(930)
    # the interval that costs least: sqrt(2 x 2 s x 10 h); the intervals within 1,000 s a failure
    assert pricing.best_interval_h(2.0, 10.0) == pytest.approx(math.sqrt(2 * 2 / 3600 * 10))
    lo, hi = pricing.break_even_interval_h(replace(c, each_s=2.0), 1000.0, 10.0)
    root = math.sqrt(970 ** 2 - 2 * 2 * 36000)
    assert (lo, hi) == (pytest.approx((970 - root) / 3600), pytest.approx((970 + root) / 3600))
    assert pricing.break_even_interval_h(replace(c, each_s=20.0), 100.0, 10.0) is None
    with pytest.raises(InvalidRequest, match="no such pricing input"):
        pricing.values(cuda_gbps=2.0)


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
        model.replay(small, replace(INPUTS, hosts=0))
    with pytest.raises(InvalidRequest, match="no spare at all"):
        model.replay(small, replace(INPUTS, spares_per_domain=0, pooled_spares=0))
    with pytest.raises(InvalidRequest, match="pitstop.every_h=0"):
        model.replay(small, replace(INPUTS, pitstop=replace(PITSTOP, every_h=0.0)))


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
                                     "--move-pause-s", "50", "--set", "cuda_checkpoint_gbps=2",
                                     "--chart", str(tmp_path / "c.svg")])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert set(d["stacks"]) == {"optimised", "default"}
    for run in d["stacks"].values():
        assert run["costs"]["pitstop"]["planned_s"] == 50.0 and run["sensitivity"]
        lost = run["lost_gpu_h"]
        assert run["saved_gpu_h"] == pytest.approx(lost["checkpoint_restart"]["total"] - lost["pitstop"]["total"])
    assert d["inputs"]["cuda_checkpoint_gbps"]["kind"] == "given" and d["inputs"]["cuda_checkpoint_gbps"]["value"] == 2
    assert d["given"]["pitstop.planned_s"]["value"] == 50.0
    assert (tmp_path / "c.svg").read_text().startswith("<svg")
    subprocess.run(["python3", "-c", "import xml.dom.minidom,sys; xml.dom.minidom.parse(sys.argv[1])",
                    str(tmp_path / "c.svg")], check=True, timeout=30)
    r = CliRunner().invoke(cli.app, ["replay", str(tmp_path / "none.csv"), "--hosts", "4"])
    assert r.exit_code == 1 and "cannot read trace" in r.output
    r = CliRunner().invoke(cli.app, ["replay", str(p), "--hosts", "4", "--set", "cuda_checkpoint_gbps=fast"])
    assert r.exit_code == 1 and "NAME=VALUE" in r.output
    r = CliRunner().invoke(cli.app, ["replay", str(p), "--hosts", "4", "--stack", "best"])
    assert r.exit_code == 1 and "optimised, default or both" in r.output


KEPT = Path(__file__).resolve().parent.parent / "bench" / "results" / "2026-12-05-replay-llama3-trace.csv"


def test_the_kept_llama3_trace_is_priced_with_every_input_said(monkeypatch):
    """The trace the results keep runs as checked in; its JSON names each input's kind and source,
    both methods' ranges over the stacks, and says where pitstop loses."""
    monkeypatch.setattr("pitstop.logs.setup", lambda *a, **k: None)
    r = CliRunner().invoke(cli.app, ["replay", str(KEPT), "--hosts", "2048", "--spares-per-domain", "1",
                                     "--pooled-spares", "16", "--duration-h", "1296", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (d["events"], d["planned"], d["unplanned"], d["job"]["gpus"]) == (505, 51, 454, 16384)
    for name, i in d["inputs"].items():
        assert i["kind"] in ("measured", "cited", "assumed") and len(i["source"]) > 20, name
    assert {k for k, i in d["inputs"].items() if i["kind"] == "cited"} >= {
        "storage_gbps", "default.detection_s", "optimised.nccl_at_2048_s", "default.nccl_at_4096_s",
        "default.nccl_at_98304_s"}
    for key in ("pitstop_lost_gpu_h", "checkpoint_restart_lost_gpu_h", "pitstop_failure", "checkpoint_restart_failure"):
        lo, hi = d["ranges"][key]
        assert 0 < lo <= hi, key
    opt, dflt = d["stacks"]["optimised"], d["stacks"]["default"]
    # the default stack's restart: a 10-minute watchdog, then stock NCCL at 16,384 GPUs
    assert dflt["costs"]["checkpoint_restart"]["detection_s"] == 600.0
    assert dflt["terms"]["checkpoint_restart"]["nccl"] > 150 > opt["terms"]["checkpoint_restart"]["nccl"]
    # pitstop's rewire costs the same NCCL creation inside every snapshot, move and recovery
    for run in (opt, dflt):
        t = run["terms"]["pitstop"]
        assert t["snapshot"]["rewire"] == t["move"]["rewire"] == run["terms"]["checkpoint_restart"]["nccl"]
        assert run["per_event"]["failure"]["gpu_h"]["pitstop"] > 0
        assert isinstance(run["where_pitstop_loses"], list)
    assert "flashrecovery" in d["published"] and "2509.03047" in d["published"]["flashrecovery"]["source"]


def test_cpu_ranks_are_priced_with_their_measured_pauses(small):
    job = study.Job(hosts=4, gpus_per_host=2, spares_per_domain=1, pooled_spares=0, repair_h=2.0, duration_h=4.0,
                    ranks="cpu", snapshot_every_h=0.5)
    d = study.study(small, job, ("optimised",), minutes=())
    c = d["stacks"]["optimised"]["costs"]["pitstop"]
    v = pricing.values()
    control = 0.015 + 1 * 0.0017  # a round over the one host a 2-GPU job of 8 GPUs / 8 per host counts
    assert c["each_s"] == pytest.approx(v["snapshot_cpu_s"] + 4 * control)
    assert c["recover_s"] == pytest.approx(v["recovery_cpu_s"] + 4 * control)
    assert c["planned_s"] == pytest.approx(v["move_cpu_s"] + 3 * control)
    assert c["every_h"] == 0.5 and not d["stacks"]["optimised"]["break_even"]["device_rates_at_snapshot_every"]


def test_hosts_failing_together_cost_one_restart_and_a_failure_during_one_only_lengthens_it(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("time_h,host,kind,domain\n1.5,h1,unplanned,r1\n1.5,h2,unplanned,r1\n1.55,h3,unplanned,r2\n")
    same = model.Costs(planned_s=0.0, detection_s=0.0, recover_s=360.0, every_h=1.0, each_s=0.0)
    i = model.Inputs(hosts=4, gpus_per_host=2, pooled_spares=3, pitstop=same, restart=same)
    r = model.replay(trace.read(p), i)
    # one spell: down from 1.5 to 1.65 (the last failure at 1.55 restarts until 1.65), 0.5 h of work lost once
    assert r.lost_restart_gpu_h == pytest.approx((0.15 + 0.5) * 8)
    assert r.lost_pitstop_gpu_h == r.lost_restart_gpu_h and r.restart.work_gpu_h == pytest.approx(0.5 * 8)
    assert r.failures == 2
