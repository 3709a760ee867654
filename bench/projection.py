"""A projection, not a measurement: pitstop vs checkpoint-restart for one host leaving a job of
64, 1,024 and 16,384 GPUs.

    .venv/bin/python bench/projection.py [--json | --markdown] [--chart docs/img/projection.png]
        [--measured docs/img/compare-2026-12-03-evening.json] [--gpu-report docs/img/gpu-2026-11-30-h200.json]

Runs as checked in: its measured inputs default to a kept full comparison (bench/compare.py's
JSON, kept in docs/img/) and to the H200 VM's CUDA checkpoint rates (tests/gpu's check (d)).
Every input is one of three kinds, and says which and where it comes from (INPUTS): measured
(here, or on the lent H200 VM, with the date), cited (a public figure, with the publication), or
assumed (a guess, with why).  Every GPU of the job waits while either method runs, so the cost of
an evacuation is its pause times the job's GPUs.

pitstop, one host of 8 GPUs leaving (cost follows the leaving host; only control grows):
    control   = 3 rounds (pause, commit, resume) x (measured round latency + hosts x RPC CPU)
    gpu       = device bytes moved / CUDA checkpoint rate (out) + / restore rate (back in)
    data      = leaving bytes (device + host memory) / min(8 x stream rate per rank, NIC)
    restore   = leaving bytes / (8 x CRIU restore rate per rank)
    rewire    = NCCL communicator re-creation at the job's size
checkpoint-restart of the same planned evacuation (cost follows the whole job):
    save      = every GPU's checkpoint shard / shared storage's aggregate write rate
    relaunch  = scheduler, process start, imports, CUDA init, every rank in parallel
    nccl_init = NCCL communicator creation at the job's size
    load      = every shard / aggregate read rate
Device bytes moved: every byte a rank has reserved (`device_reserved_gb`, what a move takes
today), or only its live bytes (`device_live_gb`, once the caching allocator's free blocks are
released at the cut).  A checkpoint holds parameters and optimizer state only, a shard per GPU;
pitstop moves only the leaving host's bytes, but all of them.

Post-copy applies to host memory only.  cuda-checkpoint parks device memory in the process's
host memory and copies it back to the device before the rank can run: device memory stays on the
critical path in every variant.

The sensitivity table gives, for each input and job size, the value at which pitstop and
checkpoint-restart break even (every other input as it is), or none within 1/1000 to 1000 x.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

GPUS_PER_HOST = 8
SIZES = (64, 1024, 16384)
ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "docs" / "img" / "compare-2026-12-03-evening.json"
GPU_REPORT = ROOT / "docs" / "img" / "gpu-2026-11-30-h200.json"
TRAINMOVER_S = 20.0  # planned or unplanned interruption at 1,024 GPUs (cited below)


@dataclass(frozen=True)
class Input:
    value: float
    unit: str
    kind: str  # "measured", "cited" or "assumed"
    source: str


LLAMA3 = "Meta, The Llama 3 Herd of Models, arXiv:2407.21783 (2024), section 3.3"
INPUTS: dict[str, Input] = {
    "device_reserved_gb": Input(100.0, "GB per GPU", "assumed",
                                "what a rank's caching allocator holds reserved: most of an H200's 141 GB in a "
                                "large job; a move takes all of it today"),
    "device_live_gb": Input(16.0, "GB per GPU", "assumed",
                            "what holds live data between steps: parameters, gradients and Adam state at 16 B "
                            "a parameter for a 1 B-parameter shard (the checkpoint shard below, plus gradients); "
                            "to be measured on a GPU with the release at the cut"),
    "host_state_gb": Input(20.0, "GB per GPU", "assumed", "host memory per rank (pinned buffers, loaders, Python)"),
    "checkpoint_shard_gb": Input(10.0, "GB per GPU", "assumed",
                                 "parameters + Adam state (16 B/param) of a sharded model, per GPU"),
    "cuda_checkpoint_gbps": Input(0.52, "GB/s per GPU", "measured",
                                  "cuda-checkpoint out, 32 GiB, one process, lent H200 VM, 2026-11-30 (tests/gpu "
                                  "check d; docs/img/gpu-2026-11-30-h200.json); 8 processes at once: 3.59 GB/s "
                                  "together, 2026-12-04"),
    "cuda_restore_gbps": Input(1.60, "GB/s per GPU", "measured",
                               "cuda-checkpoint back in, same run; 8 processes at once: 4.82 GB/s together"),
    "pcie_gbps": Input(55.3, "GB/s per GPU", "measured",
                       "device to pinned host memory, lent H200 VM, 2026-12-04 (bench/gpu_host_copy.py); PCIe Gen5 "
                       "x16 carries 63 GB/s a direction (32 GT/s x 16 lanes, 128b/130b): the bound a "
                       "checkpoint path that copies to pinned memory could reach"),
    "nic_gbps": Input(50.0, "GB/s per host", "assumed", "one 400 Gb/s front-end NIC; pitstop's stream is TCP"),
    "storage_write_gbps": Input(2000.0, "GB/s aggregate", "cited",
                                f"Meta's Tectonic for Llama 3 training: 2 TB/s sustained, 7 TB/s peak ({LLAMA3})"),
    "storage_read_gbps": Input(2000.0, "GB/s aggregate", "cited", f"the same file system's sustained rate ({LLAMA3})"),
    "relaunch_s": Input(60.0, "s", "assumed",
                        "scheduler, containers, imports, CUDA contexts (4.6 s here for a toy job); no public "
                        "breakdown at scale could be read here"),
    "nccl_init_s_per_log2": Input(2.5, "s per doubling", "assumed",
                                  "a log2(N) bootstrap: 35 s at 16,384 GPUs, 42 s at 131,072, in line with "
                                  "'several dozens of seconds at 100K scale' (NVIDIA/nccl pull request 1789, Meta, "
                                  "2025)"),
    "digest_gbps": Input(6.8, "GB/s per rank", "measured",
                         "a pre-copy's delta by digests, 810 MB in 0.09-0.14 s, this VM, 2026-12-01 "
                         "(docs/benchmarks.md): what a GPU host's ranks pay, not being write-tracked"),
    "rpc_cpu_s": Input(0.0017, "s per host per round", "measured",
                       "coordinator CPU per agent call, a full heartbeat's (bench/heartbeat_load.py, 2026-11-29)"),
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
    "live": "live device bytes only, at the same rates",
    "live_at_pcie": "live device bytes only, with the CUDA checkpoint at the PCIe link's measured rate",
}


def values(gpu: dict | None = None, **overrides: float) -> dict[str, float]:
    """Every input's value: INPUTS, the GPU rates of a tests/gpu report where given, then overrides."""
    a = {k: v.value for k, v in INPUTS.items()}
    if gpu:
        a["cuda_checkpoint_gbps"], a["cuda_restore_gbps"] = gpu["checkpoint_GBps"], gpu["restore_GBps"]
    a.update(overrides)
    return a


def project(m: dict, gpus: int, gpu: dict | None = None, scenario: str = "today", **overrides: float) -> dict:
    """One job size under one scenario (SCENARIOS); overrides replace inputs (sensitivity)."""
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
    log2 = max(1.0, gpus.bit_length() - 1)
    pit = {
        "control": 3 * (m["round_s"] + hosts * a["rpc_cpu_s"]),
        "gpu": device_gb / out_gbps + device_gb / in_gbps,
        "data": leaving / stream,
        "restore": leaving / (m["restore_Bps"] * GPUS_PER_HOST),
        "rewire": a["nccl_init_s_per_log2"] * log2,
    }
    shards = gpus * a["checkpoint_shard_gb"]
    ck = {
        "save": shards / a["storage_write_gbps"],
        "relaunch": a["relaunch_s"],
        "nccl_init": a["nccl_init_s_per_log2"] * log2,
        "load": shards / a["storage_read_gbps"],
    }
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
    return {"gpus": gpus, "scenario": scenario, "pitstop_s": tp, "checkpoint_restart_s": tc, "pitstop": pit,
            "checkpoint_restart": ck, "pitstop_dominant": max(pit, key=lambda k: pit[k]),
            "restart_dominant": max(ck, key=lambda k: ck[k]),
            "gpu_hours_pitstop": gpus * tp / 3600, "gpu_hours_restart": gpus * tc / 3600,
            "pitstop_at_nic_speed_s": at_nic, "pitstop_at_nic_speed_post_copy_s": local_pc,
            "pitstop_at_nic_speed_network_post_copy_s": network_pc, "pitstop_at_nic_speed_pre_copy_s": pre}


def best(r: dict) -> float:
    """pitstop's pause in its best variant of this scenario: the stream at the NIC's speed where
    that is faster, and network post-copy (host memory after the resume)."""
    return min(r["pitstop_s"], r["pitstop_at_nic_speed_network_post_copy_s"])


def break_even(m: dict, gpus: int, gpu: dict | None, scenario: str, name: str) -> float | None:
    """The value of input `name` at which pitstop's best variant and checkpoint-restart break even,
    everything else as it is; None where they do not within 1/1000 to 1000 x its value."""
    base = {**values(gpu), **{k: m[k] for k in MEASURED_HERE}}[name]

    def gap(x: float) -> float:
        r = project(m, gpus, gpu, scenario, **{name: x})
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


def sensitivity(m: dict, gpu: dict | None, scenario: str = "live") -> list[dict]:
    names = [*INPUTS, *MEASURED_HERE]
    rows = []
    for n in names:
        now = {**values(gpu), **{k: m[k] for k in MEASURED_HERE}}[n]
        unit = INPUTS[n].unit if n in INPUTS else {"stream_Bps": "B/s", "restore_Bps": "B/s", "round_s": "s"}[n]
        rows.append({"input": n, "now": now, "unit": unit,
                     "break_even": {g: break_even(m, g, gpu, scenario, n) for g in SIZES}})
    return rows


def report(m: dict, gpu: dict | None) -> dict:
    """What --json prints: for each size, each scenario's pause against checkpoint-restart's, and
    every input with its kind and source, so a script can read where pitstop stands."""
    sizes = []
    for n in SIZES:
        rs = {sc: project(m, n, gpu, sc) for sc in SCENARIOS}
        sizes.append({"gpus": n, "checkpoint_restart_s": round(rs["today"]["checkpoint_restart_s"], 1),
                      **{f"pitstop_{sc}_s": round(best(r), 1) for sc, r in rs.items()},
                      "trainmover_s": TRAINMOVER_S if n == 1024 else None,
                      "terms": {sc: {k: round(v, 2) for k, v in r["pitstop"].items()} for sc, r in rs.items()},
                      "restart_terms": {k: round(v, 2) for k, v in rs["today"]["checkpoint_restart"].items()}})
    inputs = {k: asdict(v) for k, v in INPUTS.items()}
    if gpu:
        for k, v in (("cuda_checkpoint_gbps", gpu["checkpoint_GBps"]), ("cuda_restore_gbps", gpu["restore_GBps"])):
            inputs[k] = {**inputs[k], "value": v, "source": f"tests/gpu check d, {gpu['at_gib']:g} GiB, {gpu['source']}"}
    for k, what in MEASURED_HERE.items():
        inputs[k] = {"value": m[k], "unit": "s" if k == "round_s" else "B/s", "kind": "measured",
                     "source": f"{what}, {m['machine']}, {m['date']} (bench/compare.py: {m['rates_from']})"}
    return {"scenarios": SCENARIOS, "pitstop_is": "its best variant: the stream at the NIC's speed where faster, "
            "host memory after the resume (network post-copy)", "sizes": sizes, "inputs": inputs,
            "trainmover": {"seconds": TRAINMOVER_S, "gpus": 1024, "source": "TrainMover, arXiv:2412.12636 "
                           "(Harvard, Alibaba, UT Austin): around 20 s of downtime at 1,024 GPUs"},
            "sensitivity": sensitivity(m, gpu)}


def chart(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [("checkpoint-restart", "checkpoint_restart_s", "#888888"),
              ("pitstop today (every reserved byte)", "pitstop_today_s", "#d62728"),
              ("pitstop, live bytes only", "pitstop_live_s", "#ff7f0e"),
              ("pitstop, live bytes at the PCIe link's rate", "pitstop_live_at_pcie_s", "#2ca02c")]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    xs = range(len(rep["sizes"]))
    w = 0.2
    for i, (label, key, color) in enumerate(series):
        ys = [s[key] for s in rep["sizes"]]
        bars = ax.bar([x + (i - 1.5) * w for x in xs], ys, w, label=label, color=color)
        ax.bar_label(bars, labels=[f"{y:.0f}" for y in ys], fontsize=7, padding=1)
    ax.axhline(TRAINMOVER_S, color="#1f77b4", linestyle="--", linewidth=1, label="TrainMover at 1,024 GPUs "
               "(published): 20 s")
    ax.set_yscale("log")
    ax.set_ylim(8, 1500)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xticks(list(xs), [f"{s['gpus']:,} GPUs" for s in rep["sizes"]])
    ax.set_ylabel("job-observed pause, s (log scale)")
    ax.set_title("One 8-GPU host leaving: a projection, not a measurement")
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(m: dict, rep: dict) -> str:
    out = [f"Measured here ({m['date']}, {m['machine']}, bench/compare.py, rates from '{m['rates_from']}'): "
           f"per leaving rank, CRIU dump {m['dump_Bps'] / 1e9:.2f} GB/s, pitstop stream {m['stream_Bps'] / 1e9:.2f} "
           f"GB/s, CRIU restore {m['restore_Bps'] / 1e9:.2f} GB/s; a control round {m['round_s']:.3f} s.", "",
           "Projected job-observed pause, seconds (pitstop: " + rep["pitstop_is"] + "):", "",
           "| GPUs | checkpoint-restart | pitstop today | ... live bytes only | ... and at the PCIe link's rate "
           "| TrainMover (published) |", "|---|---|---|---|---|---|"]
    for s in rep["sizes"]:
        out.append(f"| {s['gpus']:,} | {s['checkpoint_restart_s']:.0f} | {s['pitstop_today_s']:.0f} | "
                   f"{s['pitstop_live_s']:.0f} | {s['pitstop_live_at_pcie_s']:.0f} | "
                   + (f"{s['trainmover_s']:.0f}" if s["trainmover_s"] else "-") + " |")
    out += ["", "Terms of pitstop's pause (s) and of checkpoint-restart's:", "",
            "| GPUs | scenario | control | gpu | data | restore | rewire | restart: save / relaunch / nccl_init / load |",
            "|---|---|---|---|---|---|---|---|"]
    for s in rep["sizes"]:
        rt = s["restart_terms"]
        for sc, t in s["terms"].items():
            out.append(f"| {s['gpus']:,} | {sc} | {t['control']:.2f} | {t['gpu']:.1f} | {t['data']:.1f} | "
                       f"{t['restore']:.1f} | {t['rewire']:.1f} | {rt['save']:.0f} / {rt['relaunch']:.0f} / "
                       f"{rt['nccl_init']:.0f} / {rt['load']:.0f} |")
    out += ["", "Break-even (live bytes only): the value of each input at which pitstop and checkpoint-restart "
            "take as long, the others as they are; 'none' where none within 1/1000 to 1000 x today's.", "",
            "| input | today | 64 GPUs | 1,024 GPUs | 16,384 GPUs |", "|---|---|---|---|---|"]

    def fmt(v: float | None) -> str:
        return "none" if v is None else f"{v:.3g}"

    for r in rep["sensitivity"]:
        be = r["break_even"]
        out.append(f"| {r['input']} ({r['unit']}) | {fmt(r['now'])} | {fmt(be[64])} | {fmt(be[1024])} | "
                   f"{fmt(be[16384])} |")
    out += ["", "Inputs:", ""]
    out += [f"- {k} = {v['value']:g} {v['unit']}, {v['kind']}: {v['source']}" for k, v in rep["inputs"].items()]
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
