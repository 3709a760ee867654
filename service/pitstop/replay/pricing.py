"""What one event costs each method, in seconds of the whole job: a model, not a measurement.

Used by `pitstop replay` (each event of a history priced) and by bench/projection.py (the table
at 1,024 and 16,384 GPUs).  Every input is measured (here or on the lent H200 VM, with the date),
cited (a public figure, the exact words and where, and whether it could be read here) or
assumed (with why), and says which.  Checkpoint-restart is priced on two stacks, an optimised
and a default one; pitstop runs on the same stack, so its rewire (every communicator of the job
re-created at the job's size, inside the pause) costs the stack's NCCL creation, unless it is
taken off the critical path (`rewire_on_path=False`, not built).

pitstop, GPU ranks (a host = 8 GPUs; every GPU of the job waits while it runs):
    move      = control (3 rounds) + the leaving ranks' device bytes through the CUDA checkpoint,
                out and back in + their crossing (the stream) + CRIU's restore of them + rewire.
                Device bytes: the live ones (the release at the cut is on by default); host
                memory follows after the resume (network post-copy, the source's default).
    snapshot  = control (4 rounds) + the host part (measured on CPU) + every rank's device bytes
                out, into CRIU's dump, and back in + rewire.  Every reserved byte: no release at
                a snapshot, and device memory is not write-tracked, so all of it every time.
    recovery  = detection (the failure deadline) + control (4 rounds) + every rank's image
                restored (host and device bytes by CRIU, device bytes back through the CUDA
                restore) + rewire; then the work since the snapshot is redone.  The lost host's
                buddy is taken to be a spare, so its replica needs no crossing.
pitstop, CPU ranks: the measured pauses of bench/recovery.py and bench/compare.py, plus control.
checkpoint-restart:
    planned   = save + requeue + process start + NCCL creation + checkpoint load
    unplanned = detection + requeue + process start + NCCL creation + load; then the work since
                the checkpoint is redone.  Its checkpoints are the job's own, common to both
                methods (a pitstop job keeps them for what it cannot recover), so not charged.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pitstop.errors import InvalidRequest
from pitstop.replay.model import Costs

Stack = Literal["optimised", "default"]
STACKS: tuple[Stack, ...] = ("optimised", "default")
Ranks = Literal["gpu", "cpu"]
GPUS_PER_HOST = 8


@dataclass(frozen=True)
class Input:
    value: float
    unit: str
    kind: str  # measured | cited | assumed | given (on the command line)
    source: str


H200 = "lent H200 VM (NVIDIA H200, driver 580.159.04)"
RECOVERY = "bench/results/2026-12-06-recovery-with-torchft.md (4-rank DDP job, 3.3 GB of images, 2 cores)"
COMPARE = "bench/results/2026-12-03-compare-evening.md (AMD EPYC, 2 cores)"
LLAMA3 = "Meta, The Llama 3 Herd of Models, arXiv:2407.21783 (2024)"
NOT_READ = "not verified here: the stored copies of the paper reachable from this workplace give its abstract only"

INPUTS: dict[str, Input] = {
    # pitstop, measured
    "cuda_checkpoint_gbps": Input(0.52, "GB/s per GPU", "measured",
                                  f"cuda-checkpoint out, 32 GiB, one process, {H200}, 2026-11-30 (tests/gpu check d; "
                                  "docs/img/gpu-2026-11-30-h200.json); 8 processes on the one GPU at once: 3.59 GB/s "
                                  "together (0.45 each), 2026-12-04"),
    "cuda_restore_gbps": Input(1.60, "GB/s per GPU", "measured",
                               "cuda-checkpoint back in, the same run; 8 processes at once: 4.82 GB/s together"),
    "criu_dump_gbps": Input(1.24, "GB/s per rank", "measured",
                            f"CRIU's full dump of a rank, {COMPARE}: what a snapshot pays for the device bytes "
                            "the CUDA checkpoint parked in the process (never write-tracked)"),
    "criu_restore_gbps": Input(3.12, "GB/s per rank", "measured", f"CRIU's restore of a rank, {COMPARE}"),
    "stream_gbps": Input(1.48, "GB/s per rank", "measured", f"pitstop's stream of a leaving rank, {COMPARE}"),
    "round_s": Input(0.015, "s", "measured", f"a control round (pause, commit, resume), {COMPARE}"),
    "rpc_cpu_s": Input(0.0017, "s per host per round", "measured",
                       "coordinator CPU per agent call, a full heartbeat's (bench/heartbeat_load.py, 2026-11-29): "
                       "a round over the job's hosts costs this for each"),
    "pitstop_detection_s": Input(10.0, "s", "measured",
                                 f"the coordinator's failure deadline (PITSTOP_COORDINATOR_FAILURE_DEADLINE_S, 10 s); "
                                 f"measured 9.9 s ({RECOVERY}) and 10.7 s (bench/results/2026-12-06-recovery.md)"),
    "snapshot_host_s": Input(0.46, "s", "measured",
                             f"an incremental snapshot's pause of CPU ranks, median of 5, {RECOVERY}: taken as a GPU "
                             "rank's host part"),
    "snapshot_cpu_s": Input(0.86, "s of the job's time", "measured",
                            f"what each incremental snapshot costs a CPU job (its 0.46 s pause and the replication "
                            f"after it, as the step rate's loss x the interval), {RECOVERY}"),
    "recovery_cpu_s": Input(1.67, "s", "measured",
                            f"a recovery's pause of CPU ranks, stop to resume (restore 1.48 s), {RECOVERY}"),
    "move_cpu_s": Input(0.65, "s", "measured", f"a move's downtime of a CPU rank, {COMPARE}"),
    "pcie_gbps": Input(55.3, "GB/s per GPU", "measured",
                       f"device to pinned host memory, {H200}, 2026-12-04 (bench/gpu_host_copy.py): the most a "
                       "CUDA checkpoint through pinned memory could reach"),
    # assumed
    "device_reserved_gb": Input(100.0, "GB per GPU", "assumed",
                                "what a rank's caching allocator holds reserved in a large job, most of an H200's "
                                "141 GB: what a snapshot copies today (no release at a snapshot)"),
    "device_live_gb": Input(16.0, "GB per GPU", "assumed",
                            "parameters, gradients and Adam state of a 1 B-parameter shard at 16 B a parameter: "
                            "what a move copies once the release at the cut has run (on by default; what it frees "
                            "on a GPU is not measured yet)"),
    "host_state_gb": Input(20.0, "GB per GPU", "assumed", "host memory per rank (pinned buffers, loaders, Python)"),
    "checkpoint_shard_gb": Input(10.0, "GB per GPU", "assumed",
                                 "parameters and Adam state (16 B a parameter) of a sharded model, per GPU"),
    "nic_gbps": Input(50.0, "GB/s per host", "assumed", "one 400 Gb/s front-end NIC"),
    # checkpoint-restart, both stacks
    "storage_gbps": Input(2000.0, "GB/s aggregate", "cited",
                          f"Meta's Tectonic for Llama 3: 2 TB/s sustained, 7 TB/s peak ({LLAMA3}, section 3.3.4; "
                          "not verified here: read in secondary summaries of the paper only)"),
    "optimised.detection_s": Input(10.0, "s", "assumed",
                                   "a heartbeat deadline like pitstop's own; FlashRecovery detects failures 'within "
                                   "seconds' (arXiv:2509.03047, abstract, read here)"),
    "default.detection_s": Input(600.0, "s", "cited",
                                 "PyTorch's ProcessGroupNCCL default timeout, 10 minutes (pytorch/pytorch pull "
                                 "request 110947, 'Change ProcessGroupNCCL default timeout to 10 min', read here): "
                                 "how long a survivor may wait on a silent peer before its watchdog ends it"),
    "optimised.requeue_s": Input(10.0, "s", "assumed",
                                 "a spare already held and the job relaunched by its own launcher, no scheduler queue"),
    "default.requeue_s": Input(60.0, "s", "assumed", "the scheduler requeues the job and allocates a spare"),
    "optimised.start_s": Input(20.0, "s", "assumed",
                               "imports, CUDA contexts and the model built from a warm image; the toy job here takes "
                               f"4.1 s to exit, relaunch and import and 3.4 s to build and load ({RECOVERY})"),
    "default.start_s": Input(60.0, "s", "assumed", "containers, imports, CUDA contexts, model build at scale"),
    "optimised.checkpoint_every_h": Input(1 / 6, "h", "assumed",
                                          "asynchronous checkpoints every 10 minutes: the write (10 GB a GPU; 82 s "
                                          "at 16,384 GPUs at 2 TB/s) is hidden behind training"),
    "default.checkpoint_every_h": Input(1.0, "h", "assumed", "synchronous checkpoints every hour"),
    "optimised.nccl_at_2048_s": Input(5.0, "s at 2,048 GPUs", "cited",
                                      "MegaScale (ByteDance, NSDI '24): under 5 s at 2,048 GPUs after its "
                                      f"initialisation work ({NOT_READ}); other sizes scaled by log2(GPUs), assumed"),
    "default.nccl_at_4096_s": Input(150.0, "s at 4,096 GPUs", "cited",
                                    "NVIDIA/nccl issue 1156, Meta's kwen2501, 2024-01-23 (read here): 'We are "
                                    "experiencing 2.5-minute init time at large scale (e.g. above certain K GPUs)', "
                                    "'from the default init path'; read as 4,096 GPUs (assumed)"),
    "default.nccl_at_98304_s": Input(265.0, "s at 96K GPUs", "cited",
                                     "Meta, Collective Communication for 100k+ GPUs (NCCLX), arXiv:2510.20171: "
                                     "stock NCCL's initialisation at 96K GPUs about 265 s (not verified here: the "
                                     "paper's text beyond its abstract could not be read; the figure is read in a "
                                     "third-party summary, rajatbisht.net); between the two cited points, linear in "
                                     "log2(GPUs), assumed"),
}

# Published recoveries of other systems, to set beside (not inputs of the model).
PUBLISHED: dict[str, dict[str, Any]] = {
    "trainmover": {"seconds": 20.0, "gpus": 1024, "events": "planned and unplanned",
                   "source": "TrainMover (Alibaba, Harvard, UT Austin), arXiv:2412.12636v3 (15 May 2026), abstract "
                             "(read here): 'consistently achieves around 20 seconds of downtime when handling various "
                             "interruptions at the 1024-GPU scale'; OSDI '26 per the UCCL team's blog (18 May 2026). "
                             "The 'under 30 s unplanned' figure could not be found here."},
    "flashrecovery": {"seconds": 150.0, "gpus": 4800, "events": "unplanned",
                      "source": "FlashRecovery (iFLYTEK, USTC, Huawei), arXiv:2509.03047, abstract (read here): "
                                "'training restoration on training cluster with 4,800 devices in 150 seconds', 'nearly "
                                "consistent for different scales', work redone within one step"},
    "deadpool": {"seconds": 40.0, "gpus": 512, "events": "unplanned",
                 "source": "DeadPool, arXiv:2607.01646v1, abstract (read here): 'up to 512 NVIDIA A100 GPUs', "
                           "'hot-swapping recovery completing in under 40 seconds'"},
    "ft_hsdp_synchronous": {"seconds": 600.0, "gpus": 100000, "events": "unplanned",
                            "source": "Meta, Training LLMs with Fault Tolerant HSDP on 100,000 GPUs, arXiv:2602.00277v1, "
                                      "abstract (read here): fully synchronous training at O(100K) GPUs stalls 10 "
                                      "minutes per failure recovery (FT-HSDP: 3), effective training time 44 % (80 %)"},
    "llama3_effective": {"share": 0.90, "gpus": 16384, "events": "419 unexpected, 47 planned in 54 days",
                         "source": f"{LLAMA3}, section 3.3.4: effective training time above 90 % (not verified here: "
                                   "read as quoted by DatacenterDynamics, 'more than a 90 percent effective training "
                                   "time'; the paper's section could not be read)"},
}


def values(**overrides: float) -> dict[str, float]:
    unknown = sorted(set(overrides) - set(INPUTS))
    if unknown:
        raise InvalidRequest(f"no such pricing input: {', '.join(unknown)}", code="bad_replay_input",
                             action=f"one of: {', '.join(INPUTS)}")
    v = {k: i.value for k, i in INPUTS.items()}
    v.update(overrides)
    return v


def described(overrides: dict[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """Every input with its value, unit, kind and source; an override is 'given'."""
    out = {k: asdict(i) for k, i in INPUTS.items()}
    for k, x in (overrides or {}).items():
        out[k] = {**out[k], "value": x, "kind": "given", "source": f"given on the command line (else: {out[k]['source']})"}
    return out


def hosts_of(gpus: int) -> int:
    return max(1, gpus // GPUS_PER_HOST)


def nccl_create_s(gpus: int, stack: Stack, v: dict[str, float]) -> float:
    """Every communicator of the job created at its size, on the stack's NCCL."""
    lg = math.log2(max(2, gpus))
    optimised = v["optimised.nccl_at_2048_s"] * lg / 11.0
    if stack == "optimised":
        return optimised
    a, b = math.log2(4096), math.log2(98304)
    slope = (v["default.nccl_at_98304_s"] - v["default.nccl_at_4096_s"]) / (b - a)
    return max(optimised, v["default.nccl_at_4096_s"] + slope * (lg - a))


def control_s(gpus: int, rounds: int, v: dict[str, float]) -> float:
    return rounds * (v["round_s"] + hosts_of(gpus) * v["rpc_cpu_s"])


def restart_terms(gpus: int, stack: Stack, v: dict[str, float]) -> dict[str, float]:
    """Checkpoint-restart's terms on a stack (seconds); 'save' only for a planned event,
    'detection' only for an unplanned one.  The optimised stack keeps its checkpoint in host
    memory (a replica on a peer for the host that dies), so it saves and loads at the PCIe
    link's measured rate; the default one writes and reads every shard through the shared file
    system's aggregate rate."""
    shards = gpus * v["checkpoint_shard_gb"]
    if stack == "optimised":  # an asynchronous save pauses for the copy to host memory; load from there
        save = load = v["checkpoint_shard_gb"] / v["pcie_gbps"]
    else:  # synchronous, through the shared file system
        save = load = shards / v["storage_gbps"]
    return {"detection": v[f"{stack}.detection_s"], "save": save, "requeue": v[f"{stack}.requeue_s"],
            "start": v[f"{stack}.start_s"], "nccl": nccl_create_s(gpus, stack, v), "load": load}


def pitstop_terms(gpus: int, stack: Stack, v: dict[str, float], ranks: Ranks = "gpu",
                  rewire_on_path: bool = True) -> dict[str, dict[str, float]]:
    """pitstop's move, snapshot and recovery, term by term (seconds)."""
    rewire = nccl_create_s(gpus, stack, v) if rewire_on_path else 0.0
    if ranks == "cpu":  # gloo: SIGSTOP, connections kept, nothing to rewire
        return {"move": {"measured": v["move_cpu_s"], "control": control_s(gpus, 3, v)},
                "snapshot": {"measured": v["snapshot_cpu_s"], "control": control_s(gpus, 4, v)},
                "recovery": {"measured": v["recovery_cpu_s"], "control": control_s(gpus, 4, v)}}
    live, full, host = v["device_live_gb"], v["device_reserved_gb"], v["host_state_gb"]
    out_, in_ = v["cuda_checkpoint_gbps"], v["cuda_restore_gbps"]
    leaving = GPUS_PER_HOST * live
    return {
        "move": {"control": control_s(gpus, 3, v), "gpu": live / out_ + live / in_,
                 "data": leaving / min(GPUS_PER_HOST * v["stream_gbps"], v["nic_gbps"]),
                 "restore": live / v["criu_restore_gbps"], "rewire": rewire},
        "snapshot": {"control": control_s(gpus, 4, v), "host": v["snapshot_host_s"],
                     "gpu": full / out_ + full / v["criu_dump_gbps"] + full / in_, "rewire": rewire},
        "recovery": {"control": control_s(gpus, 4, v), "restore": (host + full) / v["criu_restore_gbps"],
                     "gpu": full / in_, "rewire": rewire},
    }


def mtbf_h(gpus: int, per_host_day: float | None = None) -> float:
    """Hours between unplanned events of a job of this size, at Llama 3's rate per host (cited in
    trace.py) unless another is given."""
    from pitstop.replay.trace import UNPLANNED_PER_HOST_DAY

    return 24.0 / ((per_host_day or UNPLANNED_PER_HOST_DAY) * hosts_of(gpus))


def best_interval_h(snapshot_s: float, mtbf: float) -> float:
    """The snapshot interval that costs the least at this failure rate (Young: sqrt(2 C M)),
    within what `--snapshot-every` takes (5 s to a week)."""
    return min(168.0, max(5 / 3600, math.sqrt(2 * snapshot_s / 3600 * mtbf)))


@dataclass(frozen=True)
class Priced:
    """Both methods on one stack, as the replay takes them, with every term."""
    stack: Stack
    pitstop: Costs
    restart: Costs
    terms: dict[str, Any]


def price(gpus: int, stack: Stack, v: dict[str, float], ranks: Ranks = "gpu", rewire_on_path: bool = True,
          snapshot_every_h: float | None = None, mtbf: float | None = None) -> Priced:
    """pitstop's and checkpoint-restart's costs on a stack.  The snapshot interval, where not
    given, is the best one at the job's failure rate (`mtbf` hours; Llama 3's by default)."""
    p = pitstop_terms(gpus, stack, v, ranks, rewire_on_path)
    r = restart_terms(gpus, stack, v)
    snap = sum(p["snapshot"].values())
    every = snapshot_every_h if snapshot_every_h is not None else best_interval_h(
        snap, mtbf if mtbf is not None else mtbf_h(gpus))
    pit = Costs(planned_s=sum(p["move"].values()), detection_s=v["pitstop_detection_s"],
                recover_s=sum(p["recovery"].values()), every_h=every, each_s=snap)
    res = Costs(planned_s=r["save"] + r["requeue"] + r["start"] + r["nccl"] + r["load"],
                detection_s=r["detection"], recover_s=r["requeue"] + r["start"] + r["nccl"] + r["load"],
                every_h=v[f"{stack}.checkpoint_every_h"], each_s=r["save"])
    return Priced(stack, pit, res, {"pitstop": p, "checkpoint_restart": r})


def per_failure_s(c: Costs, mtbf: float, charge_periodic: bool) -> float:
    """The job's seconds lost per unplanned event on average: detection, the pause, half an
    interval of work redone and, where charged, the periodic cost over the time between
    failures (pitstop's snapshots; checkpoint-restart's checkpoints are common)."""
    s = c.detection_s + c.recover_s + c.every_h * 3600 / 2
    return s + (c.each_s * mtbf / c.every_h if charge_periodic else 0.0)


def break_even_interval_h(p: Costs, target_s: float, mtbf: float) -> tuple[float, float] | None:
    """The snapshot intervals (hours) within which pitstop loses no more per failure than
    `target_s`: T^2/2 - (target - detection - pause) T + C M = 0; None where no interval does."""
    k = target_s - p.detection_s - p.recover_s
    disc = k * k - 2 * p.each_s * mtbf * 3600
    if k <= 0 or disc < 0:
        return None
    return (k - math.sqrt(disc)) / 3600, (k + math.sqrt(disc)) / 3600


DEVICE_RATES = ("cuda_checkpoint_gbps", "criu_dump_gbps", "cuda_restore_gbps")


def scaled(v: dict[str, float], k: float) -> dict[str, float]:
    """The device path of a snapshot k times as fast: the CUDA checkpoint out, CRIU's dump of the
    bytes it parked, and the CUDA restore back in."""
    return {**v, **{n: v[n] * k for n in DEVICE_RATES}}


def snapshot_gbps(gpus: int, stack: Stack, v: dict[str, float]) -> float:
    """A snapshot's device rate, GB/s per GPU: the device bytes over the time they hold the job
    (out, into the dump, back in)."""
    return v["device_reserved_gb"] / pitstop_terms(gpus, stack, v)["snapshot"]["gpu"]


def break_even_factor(cost: Any, target_s: float, v: dict[str, float]) -> float | None:
    """The factor k on the device path's rates (scaled()) at which cost(values) falls to
    target_s; None where no k within 1000 x does (what is left is not the device path's)."""
    def at(k: float) -> float:
        return cost(scaled(v, k)) - target_s

    lo, hi = 1e-3, 1e3
    if at(hi) > 0:
        return None
    if at(lo) <= 0:
        return lo
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        if at(mid) > 0:
            lo = mid
        else:
            hi = mid
    return hi
