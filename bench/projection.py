"""A projection, not a measurement: pitstop against checkpoint-restart at 64 to 16,384 GPUs, both
sides as ranges (an optimised and a default stack), planned and unplanned events.

    .venv/bin/python bench/projection.py [--json | --markdown] [--chart docs/img/projection.png]
        [--measured docs/img/compare-2026-12-03-evening.json] [--gpu-report docs/img/gpu-2026-11-30-h200.json]

Runs as checked in: its measured inputs default to a kept full comparison (bench/compare.py's
JSON, kept in docs/img/) and to the H200 VM's CUDA checkpoint rates (tests/gpu's check (d)).
Every input is measured (here, or on the lent H200 VM, with the date), cited (a public figure:
the exact words, where, and whether it could be read here) or assumed (with why), and says which
(INPUTS here, and pitstop/replay/pricing.py's, which `pitstop replay` prices events with).  Every
GPU of the job waits while either method runs, so an event costs its seconds times the job's GPUs.

Two parts:
- `sizes`: one host of 8 GPUs leaving (a planned event) in detail, three device-byte scenarios
  and pitstop's variants (the stream at the NIC's speed, post-copy, pre-copy), with the value of
  each input at which pitstop and checkpoint-restart break even.
    pitstop   = control (3 rounds x (round + hosts x RPC CPU)) + gpu (device bytes out and back in
                through the CUDA checkpoint) + data (leaving bytes / min(8 x stream, NIC)) + restore
                (leaving bytes / 8 x CRIU restore) + rewire (every communicator of the job created
                at its size, on the stack's NCCL)
    restart   = save + requeue + process start + NCCL creation + load, on the stack
- `events`: planned and unplanned events at 1,024 and 16,384 GPUs, priced as `pitstop replay`
  prices them (pricing.py: moves, snapshots, recoveries; checkpoint-restart on each stack), in
  seconds and GPU-hours per event, beside TrainMover and FlashRecovery's published figures; the
  break-even snapshot interval and GPU snapshot rate; and, for each cell, what must hold on a GPU
  for pitstop to win it.  Failures come at Llama 3's rate per host (pitstop/replay/trace.py).

Post-copy applies to host memory only.  cuda-checkpoint parks device memory in the process's
host memory and copies it back to the device before the rank can run: device memory stays on the
critical path in every variant.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pitstop.replay import pricing

GPUS_PER_HOST = 8
SIZES = (64, 1024, 16384)
EVENT_SIZES = (1024, 16384)
MINUTES = (10, 30, 60)
ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "docs" / "img" / "compare-2026-12-03-evening.json"
GPU_REPORT = ROOT / "docs" / "img" / "gpu-2026-11-30-h200.json"
TRAINMOVER_S = pricing.PUBLISHED["trainmover"]["seconds"]


@dataclass(frozen=True)
class Input:
    value: float
    unit: str
    kind: str  # "measured", "cited" or "assumed"
    source: str


# The inputs `pitstop replay` prices events with (pitstop/replay/pricing.py) are the same ones:
# one source for both.  Only the digest rate is this model's own.
SHARED = ("device_reserved_gb", "device_live_gb", "host_state_gb", "checkpoint_shard_gb", "cuda_checkpoint_gbps",
          "cuda_restore_gbps", "pcie_gbps", "nic_gbps", "storage_gbps", "rpc_cpu_s")
INPUTS: dict[str, Input] = {
    **{k: Input(**asdict(pricing.INPUTS[k])) for k in SHARED},
    "digest_gbps": Input(6.8, "GB/s per rank", "measured",
                         "a pre-copy's delta by digests, 810 MB in 0.09-0.14 s, this VM, 2026-12-01 "
                         "(docs/benchmarks.md): what a GPU host's ranks pay, not being write-tracked"),
}
MEASURED_HERE = {"stream_Bps": "pitstop's stream per rank", "restore_Bps": "CRIU restore per rank",
                 "round_s": "a control round"}


def _load(measured: Path) -> dict:
    d = json.loads(measured.read_text())
    runs = {r["method"]: r for r in d["runs"]}
    p = runs["pitstop"]
    # Per-rank rates from a move of one rank alone (the smallest scaling run): on 2 cores two
    # concurrent ranks halve each other's rates, which a host with cores for each rank does not.
    solo = min(d.get("scaling") or [p], key=lambda r: r["world"])
    caps = solo["capture_phases"]
    per_rank = solo["bytes"] / len(caps)
    # The stream's rate from a run whose bytes all travelled in the pause: since pre-copy is the
    # default, that is the 4-rank stop-and-copy run, whose two leaving ranks streamed together
    # on the 2 cores: their aggregate rate stands for one rank's (a solo rank also had both
    # cores: its sender and its receiver each take one), as it did before pre-copy (1.20 GB/s).
    whole = (runs.get("pitstop, stop-and-copy") if solo.get("bytes_pre_copied") else None) or solo
    # A pre-copied rank whose delta no capture phase cut was dumped by CRIU incrementally (only
    # what changed; 2026-12-02 on): its dump's rate is no full dump's.  The dumps of the
    # stop-and-copy run are, two ranks at once on the 2 cores, each with a core of its own.
    incremental = bool(solo.get("bytes_pre_copied")) and not any(c.get("delta") for c in caps)
    dumped, dump_caps = (whole, whole["capture_phases"]) if incremental else (solo, caps)
    rates_from = f"{solo['method']}, {solo['world']} ranks"
    if whole is not solo:
        which = "the stream's and the dump's" if incremental else "the stream's"
        rates_from += f"; {which} from {whole['method']}, {whole['world']} ranks"
    out = {"date": d["date"], "machine": d["machine"], "rates_from": rates_from,
           "dump_Bps": dumped["bytes"] / len(dump_caps) / max(c["dump"] for c in dump_caps),
           "stream_Bps": (whole["bytes"] if whole is not solo else per_rank)
           / max(c["transfer"] for c in whole["capture_phases"]),
           "restore_Bps": per_rank / solo["phases"]["restore"],
           "round_s": (p["phases"]["pause"] + p["phases"]["commit"] + p["phases"]["resume"]) / 3,
           "pitstop_downtime_s": p["downtime_s"], "moved_bytes": p["bytes"]}
    post = runs.get("pitstop, post-copy")
    # What is left of the restore on the critical path when the memory fill runs after it
    deltas = [c["delta"] for c in caps if c.get("delta")]
    if deltas and not solo.get("pre_copy_tracked_tasks"):  # the dump's pages digested, per rank
        out["digest_Bps"] = per_rank / max(deltas)
    elif solo.get("bytes_pre_copied"):
        # The kernel said what was written (memory/writetrack.py), and pitstop or CRIU itself
        # cut the delta from that: nothing was digested in this run.  A GPU host's ranks map the
        # device, so they are not write-tracked and their deltas are digested: use the rate
        # measured for that on this VM.
        out["digest_Bps"] = INPUTS["digest_gbps"].value * 1e9
        if deltas:
            out["tracked_delta_Bps"] = per_rank / max(deltas)
    out["post_copy_restore_ratio"] = post["phases"]["restore"] / p["phases"]["restore"] if post else 1.0
    ck = runs.get("checkpoint-restart")
    if ck:
        ph = ck["phases"]
        out.update({"ckpt_relaunch_s": ph["exit_and_relaunch"] + ph["import"], "ckpt_pause_s": ck["job_pause_s"]})
    return out


def load_gpu(report: Path) -> dict:
    """The CUDA checkpoint and restore rates of the largest size tests/gpu's check (d) moved."""
    d = json.loads(report.read_text())
    runs = d.get("runs", [d])
    for r in runs:
        thr = r.get("checks", {}).get("d_checkpoint_throughput", {})
        sizes = [(float(k.removesuffix("GiB")), v) for k, v in thr.items()
                 if k.endswith("GiB") and isinstance(v, dict) and "checkpoint_GBps" in v]
        if sizes:
            gib, v = max(sizes, key=lambda kv: kv[0])
            m = r.get("machine", {})
            return {"checkpoint_GBps": v["checkpoint_GBps"], "restore_GBps": v["restore_GBps"], "at_gib": gib,
                    "source": f"{m.get('gpu', 'GPU')}, driver {m.get('driver', '?')}, {r.get('date', '?')}"}
    raise SystemExit(f"{report}: no passed checkpoint-throughput check (d) in it; run tests/gpu/run.sh --only d")


SCENARIOS = {
    "today": "every reserved device byte, at the CUDA checkpoint rates measured on the H200 VM",
    "live": "live device bytes only (the release at the cut, on by default, unmeasured on a GPU), at the same rates",
    "live_at_pcie": "live device bytes only, with the CUDA checkpoint at the PCIe link's measured rate",
}


def values(gpu: dict | None = None, **overrides: float) -> dict[str, float]:
    """Every input's value: pricing.py's and INPUTS, the GPU rates of a tests/gpu report where
    given, then overrides."""
    a = pricing.values()
    a.update({k: v.value for k, v in INPUTS.items()})
    if gpu:
        a["cuda_checkpoint_gbps"], a["cuda_restore_gbps"] = gpu["checkpoint_GBps"], gpu["restore_GBps"]
    a.update(overrides)
    return a


def project(m: dict, gpus: int, gpu: dict | None = None, scenario: str = "today", stack: str = "default",
            **overrides: float) -> dict:
    """One host leaving a job of this size, one scenario (SCENARIOS), one stack (the NCCL both
    methods create communicators with, and checkpoint-restart's terms); overrides replace inputs."""
    a = values(gpu, **overrides)
    m = {**m, **{k: v for k, v in overrides.items() if k in MEASURED_HERE}}
    device_gb = a["device_live_gb"] if scenario in ("live", "live_at_pcie") else a["device_reserved_gb"]
    out_gbps, in_gbps = ((a["pcie_gbps"], a["pcie_gbps"]) if scenario == "live_at_pcie"
                         else (a["cuda_checkpoint_gbps"], a["cuda_restore_gbps"]))
    hosts = gpus // GPUS_PER_HOST
    gb = 1e9
    leaving = GPUS_PER_HOST * (device_gb + a["host_state_gb"]) * gb
    # Measured per rank on 2 shared cores; a GPU host streams and restores its 8 ranks on cores
    # of their own, so the per-rank rates add up, until the NIC caps the stream.
    stream = min(m["stream_Bps"] * GPUS_PER_HOST, a["nic_gbps"] * gb)
    pit = {
        "control": 3 * (m["round_s"] + hosts * a["rpc_cpu_s"]),
        "gpu": device_gb / out_gbps + device_gb / in_gbps,
        "data": leaving / stream,
        "restore": leaving / (m["restore_Bps"] * GPUS_PER_HOST),
        "rewire": pricing.nccl_create_s(gpus, stack, a),  # type: ignore[arg-type]
    }
    r = pricing.restart_terms(gpus, stack, a)  # type: ignore[arg-type]
    ck = {k: r[k] for k in ("save", "requeue", "start", "nccl", "load")}
    tp, tc = sum(pit.values()), sum(ck.values())
    device = GPUS_PER_HOST * device_gb * gb
    nic = a["nic_gbps"] * gb
    at_nic = tp - pit["data"] + leaving / nic
    host_share = 1 - device / leaving  # of the restore, what post-copy can take off the path
    local_pc = at_nic - pit["restore"] * host_share * (1 - m.get("post_copy_restore_ratio", 1.0))
    # network post-copy: host memory neither crosses the NIC nor is restored before the resume
    network_pc = at_nic - (leaving - device) / nic - pit["restore"] * host_share
    # pre-copy: host memory crossed the NIC before the pause; during it, it is digested instead.
    # Device memory gains nothing: cuda-checkpoint writes it into the process at the pause.
    host = leaving - device
    digest = a["digest_gbps"] * gb if "digest_gbps" in overrides else m.get("digest_Bps")
    pre = at_nic - host / nic + host / (digest * GPUS_PER_HOST) if digest else None
    return {"gpus": gpus, "scenario": scenario, "stack": stack, "pitstop_s": tp, "checkpoint_restart_s": tc,
            "pitstop": pit, "checkpoint_restart": ck, "pitstop_dominant": max(pit, key=lambda k: pit[k]),
            "restart_dominant": max(ck, key=lambda k: ck[k]),
            "gpu_hours_pitstop": gpus * tp / 3600, "gpu_hours_restart": gpus * tc / 3600,
            "pitstop_at_nic_speed_s": at_nic, "pitstop_at_nic_speed_post_copy_s": local_pc,
            "pitstop_at_nic_speed_network_post_copy_s": network_pc, "pitstop_at_nic_speed_pre_copy_s": pre}


def best(r: dict) -> float:
    """pitstop's pause in its best variant of this scenario: the stream at the NIC's speed where
    that is faster, and network post-copy (host memory after the resume)."""
    return min(r["pitstop_s"], r["pitstop_at_nic_speed_network_post_copy_s"])


def sensitivity_names(stack: str) -> list[str]:
    nccl = ("optimised.nccl_at_2048_s",) if stack == "optimised" else ("default.nccl_at_4096_s",
                                                                        "default.nccl_at_98304_s")
    return [*INPUTS, *MEASURED_HERE, f"{stack}.requeue_s", f"{stack}.start_s", *nccl]


def break_even(m: dict, gpus: int, gpu: dict | None, scenario: str, name: str, stack: str = "default") -> float | None:
    """The value of input `name` at which pitstop's best variant and checkpoint-restart break even,
    everything else as it is; None where they do not within 1/1000 to 1000 x its value."""
    base = {**values(gpu), **{k: m[k] for k in MEASURED_HERE}}[name]

    def gap(x: float) -> float:
        r = project(m, gpus, gpu, scenario, stack, **{name: x})
        return best(r) - r["checkpoint_restart_s"]

    lo, hi = base / 1000, base * 1000
    glo, ghi = gap(lo), gap(hi)
    if glo == 0:
        return lo
    if (glo < 0) == (ghi < 0):
        return None
    for _ in range(80):  # bisection in log space
        mid = math.sqrt(lo * hi)
        gm = gap(mid)
        if (gm < 0) == (glo < 0):
            lo, glo = mid, gm
        else:
            hi = mid
    return math.sqrt(lo * hi)


def sensitivity(m: dict, gpu: dict | None, scenario: str = "live", stack: str = "default") -> list[dict]:
    rows = []
    units = {k: v.unit for k, v in pricing.INPUTS.items()} | {k: v.unit for k, v in INPUTS.items()} | {
        "stream_Bps": "B/s", "restore_Bps": "B/s", "round_s": "s"}
    for n in sensitivity_names(stack):
        now = {**values(gpu), **{k: m[k] for k in MEASURED_HERE}}[n]
        rows.append({"input": n, "now": now, "unit": units[n],
                     "break_even": {g: break_even(m, g, gpu, scenario, n, stack) for g in SIZES}})
    return rows


# ---- events: planned and unplanned, both methods, as `pitstop replay` prices them ----

def _move_s(gpus: int, stack: Any, w: dict[str, float], rewire: bool = True) -> float:
    return sum(pricing.pitstop_terms(gpus, stack, w, "gpu", rewire)["move"].values())


def _failure_s(gpus: int, stack: Any, w: dict[str, float], mtbf: float, rewire: bool = True,
               every_h: float | None = None) -> float:
    p = pricing.price(gpus, stack, w, "gpu", rewire, every_h, mtbf).pitstop
    return pricing.per_failure_s(p, mtbf, charge_periodic=True)


def _released(w: dict[str, float]) -> dict[str, float]:
    """Snapshots releasing the allocators' cache as moves do (not built): live bytes only."""
    return {**w, "device_reserved_gb": w["device_live_gb"]}


def must_hold(kind: str, gpus: int, stack: Any, v: dict[str, float], target_s: float, mtbf: float) -> dict:
    """What must hold on a GPU for pitstop (on `stack`) to lose no more than target_s on one event
    of this kind: the first set of conditions, each added to the ones before, that suffices, with
    the device path's rate it needs (scaled(): the CUDA checkpoint out, the dump, back in)."""
    conditions = [("as built", {"rewire": True, "release": False, "fanout": True})]
    if kind == "unplanned":
        conditions.append(("snapshots releasing the cache as moves do (not built)",
                           {"rewire": True, "release": True, "fanout": True}))
    conditions.append(("the rewire off the critical path (not built)",
                       {"rewire": False, "release": kind == "unplanned", "fanout": True}))
    conditions.append(("the coordinator's rounds not growing with the job's hosts",
                       {"rewire": False, "release": kind == "unplanned", "fanout": False}))
    said: list[str] = []
    beyond: float | None = None
    for label, c in conditions:
        def cost(w: dict[str, float], c: dict[str, bool] = c) -> float:
            w = _released(w) if c["release"] else w
            w = w if c["fanout"] else {**w, "rpc_cpu_s": 0.0}
            return (_move_s(gpus, stack, w, c["rewire"]) if kind == "planned"
                    else _failure_s(gpus, stack, w, mtbf, c["rewire"]))
        if label != "as built":
            said.append(label)
        lead = "; ".join(said)
        now = cost(v)
        if now <= target_s:
            return {"holds": not said, "conditions": said, "factor": 1.0,
                    "text": (lead + ": " if lead else "") + f"holds on the measured rates ({now:,.0f} s against "
                                                            f"{target_s:,.0f} s)"}
        k = pricing.break_even_factor(cost, target_s, v)
        if k is not None and k * v["cuda_checkpoint_gbps"] <= v["pcie_gbps"]:
            return {"holds": False, "conditions": said, "factor": k,
                    "cuda_checkpoint_gbps_out": k * v["cuda_checkpoint_gbps"],
                    "text": (lead + "; and " if lead else "") + f"a device path {k:,.1f} x the measured (CUDA "
                            f"checkpoint out {k * v['cuda_checkpoint_gbps']:,.2f} GB/s per GPU, measured "
                            f"{v['cuda_checkpoint_gbps']:.2f})"}
        if k is not None:
            beyond = k * v["cuda_checkpoint_gbps"]
    if beyond is not None:
        return {"holds": False, "conditions": None, "factor": None,
                "text": f"cannot within the PCIe link: with all of these ({'; '.join(said)}) it needs a CUDA "
                        f"checkpoint out of {beyond:,.0f} GB/s per GPU or more, the link measured "
                        f"{v['pcie_gbps']:g}"}
    left = cost(pricing.scaled(v, 1e6))
    return {"holds": False, "conditions": None, "factor": None,
            "text": f"cannot: with all of these ({'; '.join(said)}) and an instant device path, {left:,.0f} s "
                    f"remain against {target_s:,.0f} s"}


def events(v: dict[str, float]) -> list[dict]:
    """Each size, each kind of event: both methods on both stacks, the published figures, the
    break-evens and what must hold for pitstop to win against each."""
    out = []
    for gpus in EVENT_SIZES:
        mtbf = pricing.mtbf_h(gpus)
        stacks: dict[str, Any] = {}
        for stack in pricing.STACKS:
            p = pricing.price(gpus, stack, v, "gpu", True, None, mtbf)
            off = pricing.price(gpus, stack, v, "gpu", False, None, mtbf)
            cr_fail = pricing.per_failure_s(p.restart, mtbf, charge_periodic=False)
            pit_fail = pricing.per_failure_s(p.pitstop, mtbf, charge_periodic=True)

            def be_rate(minutes: int, stack: Any = stack, cr_fail: float = cr_fail) -> dict | None:
                k = pricing.break_even_factor(lambda w: _failure_s(gpus, stack, w, mtbf, True, minutes / 60),
                                              cr_fail, v)
                return None if k is None else {"snapshot_gbps": k * pricing.snapshot_gbps(gpus, stack, v),
                                               "cuda_checkpoint_gbps_out": k * v["cuda_checkpoint_gbps"]}
            stacks[stack] = {
                "pitstop": {"planned_s": p.pitstop.planned_s, "failure_s": pit_fail,
                            "failure_pause_s": p.pitstop.detection_s + p.pitstop.recover_s,
                            "snapshot_every_h": p.pitstop.every_h, "snapshot_s": p.pitstop.each_s,
                            "snapshots_per_failure_s": p.pitstop.each_s * mtbf / p.pitstop.every_h,
                            "redone_s": p.pitstop.every_h * 3600 / 2},
                "pitstop_rewire_off_path": {"planned_s": off.pitstop.planned_s,
                                            "failure_s": pricing.per_failure_s(off.pitstop, mtbf, True)},
                "checkpoint_restart": {"planned_s": p.restart.planned_s, "failure_s": cr_fail,
                                       "failure_pause_s": p.restart.detection_s + p.restart.recover_s,
                                       "checkpoint_every_h": p.restart.every_h, "redone_s": p.restart.every_h * 1800,
                                       "checkpoints_per_failure_s": p.restart.each_s * mtbf / p.restart.every_h},
                "terms": p.terms,
                "break_even": {"snapshot_interval_h": pricing.break_even_interval_h(p.pitstop, cr_fail, mtbf),
                               "snapshot_gbps_at_every": {f"{m}_min": be_rate(m) for m in MINUTES},
                               "measured_snapshot_gbps": pricing.snapshot_gbps(gpus, stack, v)},
                "must_hold": {"planned": must_hold("planned", gpus, stack, v, p.restart.planned_s, mtbf),
                              "unplanned": must_hold("unplanned", gpus, stack, v, cr_fail, mtbf)},
            }
        published = {}
        tm = pricing.PUBLISHED["trainmover"]
        fr = pricing.PUBLISHED["flashrecovery"]
        if gpus == tm["gpus"]:
            published["trainmover"] = {"planned_s": tm["seconds"], "failure_s": tm["seconds"],
                                       "must_hold": {k: must_hold(k, gpus, "optimised", v, tm["seconds"], mtbf)
                                                     for k in ("planned", "unplanned")}}
        # FlashRecovery: 150 s at 4,800 devices, 'nearly consistent for different scales' (its claim)
        published["flashrecovery"] = {"planned_s": None, "failure_s": fr["seconds"],
                                      "must_hold": {"unplanned": must_hold("unplanned", gpus, "optimised", v,
                                                                           fr["seconds"], mtbf)}}
        out.append({"gpus": gpus, "mtbf_h": mtbf, "stacks": stacks, "published": published})
    return out


def calibration(v: dict[str, float]) -> dict:
    """The restart side against the two whole-system figures published for it: Meta's 10-minute
    stall per failure at about 100K GPUs (FT-HSDP) and Llama 3's 90 % effective training time
    at 16,384 GPUs (which bounds what each unexpected interruption cost, all told)."""
    from pitstop.replay.trace import LLAMA3_DAYS

    big = 98304
    llama_bound = (1 - pricing.PUBLISHED["llama3_effective"]["share"]) * LLAMA3_DAYS * 86400 / 419
    out: dict[str, Any] = {
        "ft_hsdp": {"gpus": big, "published_stall_s": pricing.PUBLISHED["ft_hsdp_synchronous"]["seconds"],
                    "modelled_stall_s": {}},
        "llama3": {"gpus": 16384, "at_most_s_per_unexpected_interruption": llama_bound, "modelled_s": {}},
    }
    for stack in pricing.STACKS:
        r = pricing.restart_terms(big, stack, v)
        out["ft_hsdp"]["modelled_stall_s"][stack] = r["detection"] + r["requeue"] + r["start"] + r["nccl"] + r["load"]
        p = pricing.price(16384, stack, v)
        out["llama3"]["modelled_s"][stack] = pricing.per_failure_s(p.restart, pricing.mtbf_h(16384), False) + (
            p.restart.each_s * pricing.mtbf_h(16384) / p.restart.every_h)
    return out


def gpu_hours(seconds: float | None, gpus: int) -> float | None:
    return None if seconds is None else seconds * gpus / 3600


def report(m: dict, gpu: dict | None) -> dict:
    """What --json prints: the planned move in detail and the events, both stacks, and every
    input with its kind and source, so a script can read where pitstop stands."""
    v = values(gpu)
    sizes = []
    for n in SIZES:
        per_stack = {}
        for stack in pricing.STACKS:
            rs = {sc: project(m, n, gpu, sc, stack) for sc in SCENARIOS}
            per_stack[stack] = {"checkpoint_restart_s": round(rs["today"]["checkpoint_restart_s"], 1),
                                **{f"pitstop_{sc}_s": round(best(r), 1) for sc, r in rs.items()},
                                "terms": {sc: {k: round(x, 2) for k, x in r["pitstop"].items()} for sc, r in rs.items()},
                                "restart_terms": {k: round(x, 2) for k, x in rs["today"]["checkpoint_restart"].items()}}
        ranges = {k: [min(per_stack[s][k] for s in per_stack), max(per_stack[s][k] for s in per_stack)]
                  for k in ("checkpoint_restart_s", *(f"pitstop_{sc}_s" for sc in SCENARIOS))}
        sizes.append({"gpus": n, "stacks": per_stack, "ranges": ranges,
                      "trainmover_s": TRAINMOVER_S if n == 1024 else None})
    inputs = {**pricing.described(), **{k: asdict(x) for k, x in INPUTS.items()}}
    if gpu:
        for k, x in (("cuda_checkpoint_gbps", gpu["checkpoint_GBps"]), ("cuda_restore_gbps", gpu["restore_GBps"])):
            inputs[k] = {**inputs[k], "value": x, "source": f"tests/gpu check d, {gpu['at_gib']:g} GiB, {gpu['source']}"}
    for k, what in MEASURED_HERE.items():
        inputs[k] = {"value": m[k], "unit": "s" if k == "round_s" else "B/s", "kind": "measured",
                     "source": f"{what}, {m['machine']}, {m['date']} (bench/compare.py: {m['rates_from']})"}
    return {"model": "a projection, not a measurement", "scenarios": SCENARIOS,
            "pitstop_is": "its best variant: the stream at the NIC's speed where faster, host memory after the resume "
                          "(network post-copy)", "stacks": list(pricing.STACKS), "sizes": sizes,
            "events": events(v), "calibration": calibration(v), "inputs": inputs, "published": pricing.PUBLISHED,
            "trainmover": {"seconds": TRAINMOVER_S, "gpus": 1024, "source": pricing.PUBLISHED["trainmover"]["source"]},
            "sensitivity": {stack: sensitivity(m, gpu, "live", stack) for stack in pricing.STACKS}}


def chart(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8), sharey=True)
    for ax, (kind, key) in zip(axes, (("planned (a host leaves)", "planned_s"), ("unplanned (a host dies)", "failure_s"))):
        labels, groups = [], []
        for e in rep["events"]:
            labels.append(f"{e['gpus']:,} GPUs")
            groups.append([e["stacks"]["optimised"]["pitstop"][key], e["stacks"]["optimised"]["checkpoint_restart"][key],
                           e["stacks"]["default"]["pitstop"][key], e["stacks"]["default"]["checkpoint_restart"][key]])
        series = [("pitstop, optimised stack", "#2ca02c"), ("checkpoint-restart, optimised", "#98df8a"),
                  ("pitstop, default stack", "#d62728"), ("checkpoint-restart, default", "#ff9896")]
        w = 0.2
        for i, (label, colour) in enumerate(series):
            ys = [g[i] for g in groups]
            bars = ax.bar([x + (i - 1.5) * w for x in range(len(groups))], ys, w, label=label, color=colour)
            ax.bar_label(bars, labels=[f"{y:.0f}" for y in ys], fontsize=7, padding=1)
        if kind.startswith("planned"):
            ax.axhline(TRAINMOVER_S, color="#1f77b4", linestyle="--", linewidth=1, label="TrainMover, 1,024 GPUs: 20 s")
        else:
            ax.axhline(150, color="#9467bd", linestyle="--", linewidth=1, label="FlashRecovery, 4,800 devices: 150 s")
        ax.set_yscale("log")
        ax.set_ylim(10, 2e5)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(kind)
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    axes[0].set_ylabel("seconds of the whole job per event (log)")
    axes[1].set_xlabel("unplanned: detection, pause, work redone, and pitstop's snapshots between failures", fontsize=8)
    fig.suptitle("A projection, not a measurement: pitstop as built against checkpoint-restart")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _f(x: float | None, d: int = 0) -> str:
    return "-" if x is None else f"{x:,.{d}f}"


def markdown(m: dict, rep: dict) -> str:
    out = [f"Measured here ({m['date']}, {m['machine']}, bench/compare.py, rates from '{m['rates_from']}'): "
           f"per leaving rank, CRIU dump {m['dump_Bps'] / 1e9:.2f} GB/s, pitstop stream {m['stream_Bps'] / 1e9:.2f} "
           f"GB/s, CRIU restore {m['restore_Bps'] / 1e9:.2f} GB/s; a control round {m['round_s']:.3f} s.", "",
           "## Events, both stacks (seconds of the whole job per event; GPU-hours = seconds x GPUs / 3600)", "",
           "Unplanned: detection, the pause, half an interval of work redone, and for pitstop its snapshots' cost "
           "over the time between failures (at Llama 3's rate per host); checkpoint-restart's checkpoints are the "
           "job's own, common to both, not charged.", "",
           "| GPUs | event | pitstop, optimised | pitstop, default | checkpoint-restart, optimised | "
           "checkpoint-restart, default | TrainMover | FlashRecovery |", "|---|---|---|---|---|---|---|---|"]
    for e in rep["events"]:
        g = e["gpus"]
        for kind, key in (("planned", "planned_s"), ("unplanned", "failure_s")):
            cells = [e["stacks"][s][side][key] for s in ("optimised", "default") for side in ("pitstop",)]
            cells += [e["stacks"][s]["checkpoint_restart"][key] for s in ("optimised", "default")]
            tm = e["published"].get("trainmover", {}).get(key)
            fr = e["published"]["flashrecovery"].get(key)
            out.append(f"| {g:,} | {kind} | " + " | ".join(f"{_f(c)} s, {_f(gpu_hours(c, g), 1)} GPU-h" for c in cells)
                       + f" | {_f(tm)}{' s' if tm else ''} | {_f(fr)}{' s' if fr else ''} |")
    out += ["", "What must hold on a GPU for pitstop to win each cell (pitstop on the opponent's stack; against "
            "the published figures, on the optimised stack):", "",
            "| GPUs | event | against checkpoint-restart, optimised | against checkpoint-restart, default | "
            "against TrainMover | against FlashRecovery |", "|---|---|---|---|---|---|"]
    for e in rep["events"]:
        for kind in ("planned", "unplanned"):
            tm = e["published"].get("trainmover", {}).get("must_hold", {}).get(kind)
            fr = e["published"]["flashrecovery"]["must_hold"].get(kind)
            out.append(f"| {e['gpus']:,} | {kind} | {e['stacks']['optimised']['must_hold'][kind]['text']} | "
                       f"{e['stacks']['default']['must_hold'][kind]['text']} | {tm['text'] if tm else '-'} | "
                       f"{fr['text'] if fr else '-'} |")
    out += ["", "Snapshots (GPU ranks, every reserved byte, as built): the least costly interval at the failure rate, "
            "each one's pause, the intervals within which pitstop loses no more per failure than checkpoint-restart, "
            "and the GPU snapshot rate (device bytes over the time they hold the job) at which snapshots every 10, "
            "30 or 60 minutes break even:", "",
            "| GPUs | stack | failures every | snapshot every | each pauses | break-even interval | measured GPU "
            "snapshot rate | break-even rate at 10 / 30 / 60 min |", "|---|---|---|---|---|---|---|---|"]
    for e in rep["events"]:
        for s, x in e["stacks"].items():
            be = x["break_even"]
            iv = be["snapshot_interval_h"]
            rates = " / ".join("none" if r is None else f"{r['snapshot_gbps']:.2f}" for r in be["snapshot_gbps_at_every"].values())
            out.append(f"| {e['gpus']:,} | {s} | {e['mtbf_h']:.1f} h | {x['pitstop']['snapshot_every_h'] * 60:.0f} min | "
                       f"{x['pitstop']['snapshot_s']:.0f} s | "
                       + ("none" if iv is None else f"{iv[0] * 60:.1f}-{iv[1] * 60:.1f} min")
                       + f" | {be['measured_snapshot_gbps']:.2f} GB/s | {rates} GB/s |")
    c = rep["calibration"]
    out += ["", f"Calibration of the restart side: at {c['ft_hsdp']['gpus']:,} GPUs its stall (detection to the job "
            f"running again) models {c['ft_hsdp']['modelled_stall_s']['optimised']:,.0f} s optimised and "
            f"{c['ft_hsdp']['modelled_stall_s']['default']:,.0f} s default, against Meta's published "
            f"{c['ft_hsdp']['published_stall_s']:,.0f} s (FT-HSDP, synchronous, O(100K) GPUs); at 16,384 GPUs "
            f"Llama 3's 90 % effective training time allows at most {c['llama3']['at_most_s_per_unexpected_interruption']:,.0f}"
            f" s per unexpected interruption, all told, against {c['llama3']['modelled_s']['optimised']:,.0f} s "
            f"(optimised) and {c['llama3']['modelled_s']['default']:,.0f} s (default) modelled with the checkpoints' "
            "own cost."]
    out += ["", "## One host leaving, in detail", "",
            "Projected job-observed pause, seconds, per stack (optimised / default; pitstop: " + rep["pitstop_is"] + "):",
            "", "| GPUs | checkpoint-restart | pitstop today | ... live bytes only | ... and at the PCIe link's rate "
            "| TrainMover (published) |", "|---|---|---|---|---|---|"]
    for s in rep["sizes"]:
        o, d = s["stacks"]["optimised"], s["stacks"]["default"]
        out.append(f"| {s['gpus']:,} | {o['checkpoint_restart_s']:.0f} / {d['checkpoint_restart_s']:.0f} | "
                   f"{o['pitstop_today_s']:.0f} / {d['pitstop_today_s']:.0f} | {o['pitstop_live_s']:.0f} / "
                   f"{d['pitstop_live_s']:.0f} | {o['pitstop_live_at_pcie_s']:.0f} / {d['pitstop_live_at_pcie_s']:.0f} | "
                   + (f"{s['trainmover_s']:.0f}" if s["trainmover_s"] else "-") + " |")
    out += ["", "Terms of pitstop's pause (s) and of checkpoint-restart's:", "",
            "| GPUs | stack | scenario | control | gpu | data | restore | rewire | restart: save / requeue / start / "
            "nccl / load |", "|---|---|---|---|---|---|---|---|---|"]
    for s in rep["sizes"]:
        for stack, st in s["stacks"].items():
            rt = st["restart_terms"]
            for sc, t in st["terms"].items():
                out.append(f"| {s['gpus']:,} | {stack} | {sc} | {t['control']:.2f} | {t['gpu']:.1f} | {t['data']:.1f} | "
                           f"{t['restore']:.1f} | {t['rewire']:.1f} | {rt['save']:.1f} / {rt['requeue']:.0f} / "
                           f"{rt['start']:.0f} / {rt['nccl']:.1f} / {rt['load']:.1f} |")

    def fmt(x: float | None) -> str:
        return "none" if x is None else f"{x:.3g}"

    for stack, rows in rep["sensitivity"].items():
        out += ["", f"Break-even of one host leaving, {stack} stack (live bytes only): the value of each input at which "
                "pitstop and checkpoint-restart take as long, the others as they are; 'none' where none within "
                "1/1000 to 1000 x today's.", "", "| input | today | 64 GPUs | 1,024 GPUs | 16,384 GPUs |",
                "|---|---|---|---|---|"]
        for r in rows:
            be = r["break_even"]
            out.append(f"| {r['input']} ({r['unit']}) | {fmt(r['now'])} | {fmt(be[64])} | {fmt(be[1024])} | "
                       f"{fmt(be[16384])} |")
    out += ["", "Inputs:", ""]
    out += [f"- {k} = {x['value']:g} {x['unit']}, {x['kind']}: {x['source']}" for k, x in rep["inputs"].items()]
    out += ["", "Published, beside (not inputs):", ""]
    out += [f"- {k}: {x['source']}" for k, x in rep["published"].items()]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", type=Path, default=MEASURED, help="a full comparison's JSON (bench/compare.py)")
    ap.add_argument("--gpu-report", type=Path, default=GPU_REPORT,
                    help="a tests/gpu report whose check (d) gives the CUDA checkpoint and restore rates")
    ap.add_argument("--json", action="store_true", help="the report as JSON (the default output)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--chart", type=Path, help="write the chart here (PNG; needs the bench extra's matplotlib)")
    a = ap.parse_args()
    m = _load(a.measured)
    gpu = load_gpu(a.gpu_report) if a.gpu_report else None
    rep = report(m, gpu)
    if a.chart:
        chart(rep, a.chart)
    if a.markdown:
        print(markdown(m, rep))
        return
    print(json.dumps({"measured": m, "gpu": gpu, **rep}, indent=1))


if __name__ == "__main__":
    main()
