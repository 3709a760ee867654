"""A projection, not a measurement: pitstop vs checkpoint-restart for one host leaving a job of
64, 1,024 and 16,384 GPUs.

    .venv/bin/python bench/projection.py [--measured bench/out/compare-warm.json]
        [--gpu-report docs/img/gpu-2026-11-30-h200.json] [--markdown]

The model is made of the components bench/compare.py measures on this machine (rates of
CRIU's dump and restore, pitstop's stream, torch.save/torch.load, a relaunch's start-up,
the coordinator's cost per host contacted), of the CUDA checkpoint rates measured on a GPU
(--gpu-report: tests/gpu's check (d); else an assumed PCIe rate) and of GPU-cluster inputs
that nobody has measured here (each is named in ASSUMED with where it comes from).
Every GPU of the job waits while either method runs, so the cost of an evacuation is its
pause times the job's GPUs.

pitstop, one host of 8 GPUs leaving (cost follows the leaving host; only control grows):
    control   = 3 rounds (pause, commit, resume) x (measured round latency + hosts x RPC CPU)
    gpu       = device memory in use / checkpoint rate (out) + / restore rate (back in)
    data      = leaving bytes (device + host memory) / min(8 x stream rate per rank, NIC)
    restore   = leaving bytes / (8 x CRIU restore rate per rank)
    rewire    = NCCL communicator re-creation at the job's size
checkpoint-restart of the same planned evacuation (cost follows the whole job):
    save      = every GPU's checkpoint shard / shared storage's aggregate write rate
    relaunch  = scheduler, process start, imports, CUDA init, every rank in parallel
    nccl_init = NCCL communicator creation at the job's size
    load      = every shard / aggregate read rate
Asymmetry worth knowing: a checkpoint holds parameters and optimizer state only, a shard
per GPU, while pitstop moves all device memory in use (activations and caches included),
but only the leaving host's.

Post-copy applies to host memory only.  cuda-checkpoint parks device memory in the process's
host memory and copies it back to the device before the rank can run, which would fault
every page of it in first: device memory stays on the critical path in every variant, and
only host_state_gb is restored (local post-copy) or moved (network post-copy) after the job
resumes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GPUS_PER_HOST = 8
SIZES = (64, 1024, 16384)

ASSUMED = {
    # name: (value, unit, source)
    "device_in_use_gb": (100.0, "GB per GPU", "H200 has 141 GB; a large job keeps most of it busy"),
    "host_state_gb": (20.0, "GB per GPU", "host memory per rank (pinned buffers, loaders, Python)"),
    "checkpoint_shard_gb": (10.0, "GB per GPU", "parameters + Adam state (16 B/param), sharded across the job"),
    "cuda_checkpoint_gbps": (20.0, "GB/s per GPU",
                             "device-to-host over PCIe Gen5, bare metal; used when no --gpu-report is given"),
    "cuda_restore_gbps": (20.0, "GB/s per GPU",
                          "host-to-device over PCIe Gen5, bare metal; used when no --gpu-report is given"),
    "nic_gbps": (50.0, "GB/s per host", "one 400 Gb/s front-end NIC; pitstop's stream is TCP, not RDMA"),
    "storage_write_gbps": (1000.0, "GB/s aggregate", "a large parallel file system"),
    "storage_read_gbps": (2000.0, "GB/s aggregate", "a large parallel file system"),
    "relaunch_s": (60.0, "s", "scheduler, containers, imports, CUDA contexts (4.6 s here for a toy job)"),
    "nccl_init_s_per_log2": (2.5, "s per doubling",
                             "NCCL init at 16k GPUs takes tens of seconds in public reports; modelled as "
                             "a log2(N) bootstrap"),
    "digest_gbps": (6.8, "GB/s per rank",
                    "a pre-copy's delta by digests (810 MB in 0.09-0.14 s alone, docs/benchmarks.md, 2026-12-01 "
                    "03:55): what a GPU host's ranks pay, since a process that maps a device is not write-tracked"),
    "rpc_cpu_s": (0.0017, "s per host per round",
                  "coordinator CPU per agent call, as measured for a full heartbeat (bench/heartbeat_load.py)"),
}


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
        out["digest_Bps"] = ASSUMED["digest_gbps"][0] * 1e9
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


def project(m: dict, gpus: int, gpu: dict | None = None) -> dict:
    a = {k: v[0] for k, v in ASSUMED.items()}
    if gpu:
        a["cuda_checkpoint_gbps"], a["cuda_restore_gbps"] = gpu["checkpoint_GBps"], gpu["restore_GBps"]
    hosts = gpus // GPUS_PER_HOST
    gb = 1e9
    leaving = GPUS_PER_HOST * (a["device_in_use_gb"] + a["host_state_gb"]) * gb
    # Measured per rank on 2 shared cores; a GPU host streams and restores its 8 ranks on cores
    # of their own, so the per-rank rates add up, until the NIC caps the stream.
    stream = min(m["stream_Bps"] * GPUS_PER_HOST, a["nic_gbps"] * gb)
    log2 = max(1.0, gpus.bit_length() - 1)
    pit = {
        "control": 3 * (m["round_s"] + hosts * a["rpc_cpu_s"]),
        "gpu": a["device_in_use_gb"] / a["cuda_checkpoint_gbps"] + a["device_in_use_gb"] / a["cuda_restore_gbps"],
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
    device = GPUS_PER_HOST * a["device_in_use_gb"] * gb
    nic = a["nic_gbps"] * gb
    at_nic = tp - pit["data"] + leaving / nic
    host_share = 1 - device / leaving  # of the restore, what post-copy can take off the path
    local_pc = at_nic - pit["restore"] * host_share * (1 - m.get("post_copy_restore_ratio", 1.0))
    # network post-copy: host memory neither crosses the NIC nor is restored before the resume
    network_pc = at_nic - (leaving - device) / nic - pit["restore"] * host_share
    # pre-copy: host memory crossed the NIC before the pause; during it, it is digested instead.
    # Device memory gains nothing: cuda-checkpoint writes it into the process at the pause.
    host = leaving - device
    pre = at_nic - host / nic + host / (m["digest_Bps"] * GPUS_PER_HOST) if m.get("digest_Bps") else None
    return {"gpus": gpus, "pitstop_s": tp, "checkpoint_restart_s": tc, "pitstop": pit, "checkpoint_restart": ck,
            "pitstop_dominant": max(pit, key=pit.get), "restart_dominant": max(ck, key=ck.get),
            "gpu_hours_pitstop": gpus * tp / 3600, "gpu_hours_restart": gpus * tc / 3600,
            "pitstop_at_nic_speed_s": at_nic, "pitstop_at_nic_speed_post_copy_s": local_pc,
            "pitstop_at_nic_speed_network_post_copy_s": network_pc, "pitstop_at_nic_speed_pre_copy_s": pre}


def markdown(m: dict, rows: list[dict], gpu: dict | None = None) -> str:
    rates = (f"CUDA checkpoint {gpu['checkpoint_GBps']:.2f} GB/s out and {gpu['restore_GBps']:.2f} GB/s back in, "
             f"measured with {gpu['at_gib']:g} GiB ({gpu['source']})" if gpu else
             f"CUDA checkpoint {ASSUMED['cuda_checkpoint_gbps'][0]:g} GB/s out and "
             f"{ASSUMED['cuda_restore_gbps'][0]:g} GB/s back in, assumed (PCIe Gen5, bare metal)")
    out = [f"GPU rates: {rates}.", "",f"Measured inputs ({m['date']}, {m['machine']}, bench/compare.py, rates from the run "
           f"'{m['rates_from']}'): per leaving rank, CRIU dump "
           f"{m['dump_Bps'] / 1e9:.2f} GB/s, pitstop stream {m['stream_Bps'] / 1e9:.2f} GB/s, CRIU restore "
           f"{m['restore_Bps'] / 1e9:.2f} GB/s"
           + (f", pre-copy digest {m['digest_Bps'] / 1e9:.2f} GB/s" if m.get("digest_Bps") else "")
           + (f" (assumed: this run's deltas were write-tracked, at {m['tracked_delta_Bps'] / 1e9:.0f} GB/s "
              "a rank, which a GPU host's ranks are not)" if m.get("tracked_delta_Bps") else "")
           + f"; a control round (pause, commit or resume) {m['round_s']:.2f} s.", "",
           f"A post-copy restore left {m.get('post_copy_restore_ratio', 1.0):.0%} of the eager restore on the "
           "critical path in the same run.", "",
           "| GPUs | pitstop (s) | its largest term | pitstop with a NIC-speed stream (s) | ... and local post-copy "
           "(s) | ... or network post-copy (s) | ... or pre-copy (s) | checkpoint-restart (s) | its largest term | "
           "GPU-hours per evacuation: pitstop / restart |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['gpus']:,} | {r['pitstop_s']:.0f} | {r['pitstop_dominant']} "
                   f"({r['pitstop'][r['pitstop_dominant']]:.0f} s) | {r['pitstop_at_nic_speed_s']:.0f} | "
                   f"{r['pitstop_at_nic_speed_post_copy_s']:.0f} | {r['pitstop_at_nic_speed_network_post_copy_s']:.0f} | "
                   + (f"{r['pitstop_at_nic_speed_pre_copy_s']:.0f} | " if r["pitstop_at_nic_speed_pre_copy_s"] else "- | ")
                   + f"{r['checkpoint_restart_s']:.0f} | "
                   f"{r['restart_dominant']} ({r['checkpoint_restart'][r['restart_dominant']]:.0f} s) | "
                   f"{r['gpu_hours_pitstop']:.1f} / {r['gpu_hours_restart']:.1f} |")
    out += ["", "Assumed (not measured here):", ""]
    out += [f"- {k} = {v} {u}: {src}" for k, (v, u, src) in ASSUMED.items()]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", default=str(Path(__file__).resolve().parent / "out" / "compare-warm.json"))
    ap.add_argument("--gpu-report", type=Path, default=None,
                    help="a tests/gpu report (or a file of several under 'runs') whose check (d) gives the "
                         "CUDA checkpoint and restore rates; without it they are assumed")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    m = _load(Path(a.measured))
    gpu = load_gpu(a.gpu_report) if a.gpu_report else None
    rows = [project(m, n, gpu) for n in SIZES]
    if a.markdown:
        print(markdown(m, rows, gpu))
        return
    print(json.dumps({"measured": m, "gpu": gpu, "assumed": ASSUMED, "projection": rows}, indent=1))


if __name__ == "__main__":
    main()
