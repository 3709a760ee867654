"""pitstop against its floor, checkpoint-restart and naive CRIU, in one run on one machine.

    .venv/bin/python bench/compare.py [--state-mb 512] [--worlds 2,4,8] [--restart-worlds 4]
    (make bench-compare)

The reference job is tests/workloads/ddp_train.py: torch gloo DDP, every rank holding
--state-mb of extra state, launched through `pitstop run`, 4 ranks on 2 hosts (host-a:
ranks 0-1, host-b: ranks 2-3).  Methods, each on a fresh local cluster:

- pitstop: host-b evacuated to a spare through the coordinator, as it does by default: the
  leaving ranks' memory is pre-copied while the job trains (memory/precopy.py) and only
  what changed travels during the pause; downtime (first rank paused to last rank resumed),
  every phase, and the pause the job saw (the longest gap between two consecutive steps of
  any rank).  The pre-copy's own time (before anything pauses) is reported beside it.
- pitstop, stop-and-copy: the same without pre-copy (`pre_copy: false`): every byte travels
  during the pause, streamed while CRIU dumps.  Its stream rate is the transfer figure.
- floor: the leaving ranks' image bytes / raw TCP bandwidth between two processes,
  measured in this run (hosts here share one kernel: the link is loopback).
- pitstop, post-copy: the stop-and-copy evacuation with the spare restoring lazily
  (PITSTOP_AGENT_LAZY_RESTORE=1, memory/lazy_pages.py): the job resumes while CRIU's
  lazy-pages daemon fills the restored ranks' memory from the received images.
- pitstop, pre-copy + post-copy: the default's pre-copy with the spare restoring lazily: CRIU's
  daemon cannot read the pre-copy as a parent image, so a local page server answers it from the
  delta and the pre-copy (memory/lazydelta.py).  Nothing depends on the source after the commit.
- pitstop, network post-copy: the sources split their dumps (PITSTOP_COORDINATOR_POST_COPY=1,
  memory/postcopy.py): only the pages a restore must place travel before it; the spare's
  lazy-pages daemon fetches the rest from the sources after the job resumes.  Its fill time
  and rate are reported next to the downtime.
- naive CRIU, to disk: what issue 7 calls naive CRIU, with agents that keep their images
  in a directory on the machine's disk (/var/tmp, PITSTOP_AGENT_IMAGE_MOUNT=off), dump whole,
  then copy, then restore (PITSTOP_AGENT_STREAM_WHILE_DUMPING=0).  CRIU does not fsync, so the
  images go to the page cache: no disk wait is counted unless writeback starts in the window.
- naive CRIU: the same on the agents' own huge-page tmpfs (agent/imagefs.py), the image
  directory pitstop itself uses: a kinder baseline than the definition, since that tmpfs
  halves CRIU's memory dump (and, before 2026-12-03, the only naive method here, though this
  text called it "to disk").  Both copy with pitstop's own transport, so either is faster
  than a naive CRIU with scp or rsync.
- checkpoint-restart: the same job, launched plainly, saves model, optimizer and state
  with torch.save after a step, every rank exits, the job is relaunched at once, loads and
  continues; its pause runs from the last step before the save to the first after the load.
  No scheduler delay and no fsync are counted: the most favourable case for it.
- pitstop, stock CRIU (`stock-criu`, `stock-criu-stop-and-copy`): the default (or stop-and-copy)
  with the stock CRIU instead of the one pitstop carries (PITSTOP_CRIU_STOCK=1, criu/README.md):
  before and after its patches in one run.
- pitstop, no loader workers (`no-workers`, `no-workers-stop-and-copy`): the same job without
  DataLoader workers, where --loader-workers gives some: its images are the ranks' own memory,
  and its pause what the workers' should come close to.
- scaling: pitstop with 2, 4 and 8 ranks in the job and the same leaving part (one rank
  on host-b), the others on host-a; eagerly, and with network post-copy; --scaling-repeats
  runs of each size, interleaved, judged by the sizes' medians (every run is in the JSON).

Writes bench/out/compare.json and bench/out/compare.png (downtime by phase).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    evacuate_and_wait,
    first_divergent_step,
    host_reclaimed_kib,
    keep_logs,
    machine,
    moved_after_step,
    prewarm,
    raw_tcp_bandwidth,
)
from pitstop.dev.devcluster import LocalCluster, free_port, step_gaps, step_times, wait_for_step  # noqa: E402
from pitstop.wire.coordinator_client import CoordinatorClient  # noqa: E402
from tests.helpers import ddp_cmd  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
NETWORK_POST_COPY = {"PITSTOP_COORDINATOR_POST_COPY": "1"}
LOCAL_POST_COPY = {"PITSTOP_AGENT_LAZY_RESTORE": "1"}  # from the copy on the destination
NAIVE_DISK = "naive CRIU, to disk"
BASELINES = ("naive CRIU", NAIVE_DISK, "checkpoint-restart")
METHOD_KEYS = ("default", "stop-and-copy", "post-copy", "pre-copy+post-copy", "network-post-copy", "naive",
               "naive-disk", "checkpoint-restart", "stock-criu", "stock-criu-stop-and-copy", "no-workers",
               "no-workers-stop-and-copy")
STOCK_CRIU = {"PITSTOP_CRIU_STOCK": "1"}  # the stock CRIU instead of the one pitstop carries (criu/)


MEMORY_FS = ("tmpfs", "ramfs")


def fs_type(path: Path) -> str:
    """The file system `path` lies on, as stat(1) names it ("ext2/ext3", "tmpfs", ...)."""
    p = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, timeout=10)
    if p.returncode != 0:
        raise SystemExit(f"--disk-dir {path}: {p.stderr.strip() or 'cannot be read'}")
    return p.stdout.strip()


def _final_hashes(out: Path, world: int) -> list[str]:
    return [(out / f"rank{r}.sha256").read_text().strip() for r in range(world)]


class EndedBeforeTheMove(Exception):
    """The job's steps ran out before the move began: a slow prewarm (cold memory) outlasted a
    small job's 300 steps (2 ranks train one in 0.07 s).  Not a measurement: made again."""


STEPS_AFTER_MOVE = 10  # a move the job did not train on after is no measurement
ATTEMPTS = 3


def evacuation(world: int, leaving: list[int], state_mb: float, steps: int, agent_env: dict | None = None,
               label: str = "pitstop", prewarm_gib: float = 0.0, pre_copy: bool | None = None,
               image_disk: Path | None = None, loader_workers: int = 0) -> dict:
    """One measured move, made again (a fresh job) when the job had reached its last steps before
    the move ended.  A slow prewarm (up to 46 s on this VM) or a slow pre-copy can use up the
    job's 300 steps: the move then catches ranks that are finishing or tearing down, whose
    memory and timing are not a training job's (dumps of 1,982 MB instead of 1,469, and a
    "pause the job saw" of 0.14 s beside a downtime of 11.9 s, in the run of 2026-12-02 03:03)."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            r = _evacuation_once(world, leaving, state_mb, steps, agent_env, label, prewarm_gib, pre_copy, image_disk,
                                 loader_workers)
        except EndedBeforeTheMove as e:
            if attempt == ATTEMPTS:
                raise SystemExit(f"{label} ({world} ranks): {e} in {ATTEMPTS} attempts; raise --steps") from None
            print(f"{label} ({world} ranks): {e}; running it again", flush=True)
            continue
        if r["steps_after_move"] >= STEPS_AFTER_MOVE:
            return {**r, "attempts": attempt}
        print(f"{label} ({world} ranks): the job made only {r['steps_after_move']} steps after the move "
              f"(prewarm {r['prewarm_s']} s, pre-copy {r['precopy_s']} s): not a measurement; "
              f"{'running it again' if attempt < ATTEMPTS else 'kept, marked near_the_end (raise --steps)'}",
              flush=True)
    return {**r, "attempts": ATTEMPTS, "near_the_end": True}


def _evacuation_once(world: int, leaving: list[int], state_mb: float, steps: int, agent_env: dict | None,
                     label: str, prewarm_gib: float, pre_copy: bool | None, image_disk: Path | None = None,
                     loader_workers: int = 0) -> dict:
    """Run the job through `pitstop run` and evacuate host-b (which holds `leaving`) to a spare.
    image_disk: the agents keep their images in directories under it, as they are (no tmpfs)."""
    disk = Path(tempfile.mkdtemp(prefix="pitstop-bench-images-", dir=image_disk)) if image_disk else None
    if disk:
        agent_env = {**(agent_env or {}), "PITSTOP_AGENT_IMAGE_MOUNT": "off"}
    try:
        return _evacuation_in(world, leaving, state_mb, steps, agent_env, label, prewarm_gib, pre_copy, disk,
                              loader_workers)
    finally:
        if disk:
            shutil.rmtree(disk, ignore_errors=True)


def _evacuation_in(world: int, leaving: list[int], state_mb: float, steps: int, agent_env: dict | None,
                   label: str, prewarm_gib: float, pre_copy: bool | None, disk: Path | None,
                   loader_workers: int = 0) -> dict:
    with LocalCluster(root=Path(tempfile.mkdtemp(prefix="pitstop-bench-"))) as c:
        c.start_coordinator(env=agent_env)  # PITSTOP_COORDINATOR_* among them reach it; the rest it ignores
        for name in ("host-a", "host-b"):
            c.start_agent(name, env=agent_env, image_dir=disk / name if disk else None)
        c.start_agent("spare-1", spare=True, env=agent_env, image_dir=disk / "spare-1" if disk else None)
        cc = CoordinatorClient(c.coordinator_url, c.operator_token)
        placement = {r: ("host-b" if r in leaving else "host-a") for r in range(world)}
        out = c.root / "out"
        ranks = c.start_job("b", ddp_cmd(out, steps=steps, state_mb=state_mb, workers=loader_workers) + ["--trace-params"],
                            world, placement)
        for rk in ranks:
            wait_for_step(rk.log, 20, timeout_s=300)
        warm_s = prewarm(prewarm_gib)
        t0 = time.time()
        reported0 = host_reclaimed_kib()
        md = evacuate_and_wait(cc, "host-b", label, pre_copy=pre_copy)
        done_at = time.time()
        reported1 = host_reclaimed_kib()
        codes = [r.proc.wait(600) for r in ranks]
        if codes != [0] * world:
            raise SystemExit(f"{label}: job exit codes {codes}")
        gaps = [sorted(step_gaps(rk.log, since=t0)) for rk in ranks]
        if not any(gaps):
            raise EndedBeforeTheMove(f"the job finished before the evacuation (prewarm {warm_s:.1f} s)")
        pause = max(g[-1] for g in gaps if g)
        normal = sorted(x for g in gaps for x in g)[len([x for g in gaps for x in g]) // 2]
        diverged = first_divergent_step([rk.log for rk in ranks])
        if diverged is not None:  # keep the evidence (docs/reliability.md: the MKL race)
            keep = keep_logs(c.root, OUT / f"divergent-{label.replace(' ', '_').replace(',', '')}-{world}-"
                                           f"{int(time.time())}")
            print(f"{label}: ranks disagree from step {diverged} on; logs kept in {keep}", flush=True)
        caps = [w.get("capture_phases", {}) for w in md["workers"].values()]
        later = md.get("bytes_after_resume") or 0
        fills = [float(x) for x in re.findall(r"memory filled\s+seconds=([0-9.]+)",
                                               c.agents["spare-1"].log.read_text(errors="replace"))]
        dump = max((cp.get("dump", 0.0) for cp in caps), default=0.0)
        phases = dict(md["phases"])
        after = phases.pop("fill", None)  # after the resume: not part of the downtime the bars show
        ahead = phases.pop("precopy", None)  # before the pause: likewise
        phases.pop("cleanup", None)  # the node freeing its images, after the resume: likewise
        pre = sum(w.get("bytes_pre_copied", 0) for w in md["workers"].values())
        return {"method": label, "world": world, "leaving_ranks": leaving, "state_mb": state_mb,
                "downtime_s": md["downtime_s"], "job_pause_s": round(pause, 4), "median_step_s": round(normal, 4),
                # each rank's largest gap: job_pause_s is the largest of these, of more ranks the bigger the job
                "job_pause_per_rank_s": [round(g[-1], 4) if g else None for g in gaps],
                "bytes": md["bytes_total"] + later + pre, "bytes_before_resume": md["bytes_total"],
                "bytes_pre_copied": pre, "precopy_s": ahead, "pre_copy_sent_bytes": md.get("pre_copy_bytes", 0),
                # how the delta knew what changed: the kernel's write tracking, or digests
                "pre_copy_tracked_tasks": sum(w.get("pre_copy_tracked_tasks", 0) for w in md["workers"].values()),
                "pre_copy_digested_tasks": sum(w.get("pre_copy_digested_tasks", 0) for w in md["workers"].values()),
                # who cut the delta, per leaving rank: CRIU's incremental dump ("criu") or pitstop
                "pre_copy_by": sorted({w["pre_copy_by"] for w in md["workers"].values() if w.get("pre_copy_by")}),
                "bytes_after_resume": later, "fill_s": max(fills, default=None),
                "node_free_after_resume_s": md.get("fill_s") if after is not None else 0.0,
                "phases": phases, "pause_round_s": md.get("pause_round_s"), "dump_s": round(dump, 4),
                "capture_phases": caps, "restore_phases": [w.get("restore_phases", {}) for w in md["workers"].values()],
                "prewarm_s": round(warm_s, 2), "final": _final_hashes(out, world),
                "first_divergent_step": diverged, "moved_after_step": moved_after_step(ranks[0].log, t0),
                "steps_after_move": min(sum(1 for _, t in step_times(rk.log) if t >= done_at) for rk in ranks),
                "host_reclaimed_mib": None if reported0 is None or reported1 is None else (reported1 - reported0) >> 10}


def _phase_times(log: Path) -> dict[str, float]:
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^phase (\w+) t=([0-9.]+)", log.read_text(errors="replace"), re.M)}


def checkpoint_restart(world: int, state_mb: float, steps: int, save_at: int = 20, prewarm_gib: float = 0.0,
                       loader_workers: int = 0) -> dict:
    """torch.save at a step, every rank exits, relaunch at once, torch.load, continue."""
    root = Path(tempfile.mkdtemp(prefix="pitstop-bench-ckpt-", dir="/var/tmp"))  # a disk, not tmpfs
    try:
        out, ckpt = root / "out", root / "ckpt"
        ckpt.mkdir()

        def launch(tag: str, extra: list[str]) -> list[Path]:
            port, procs, logs = free_port(), [], []
            for r in range(world):
                log = root / f"{tag}.rank{r}.log"
                env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port), USE_LIBUV="0", PYTHONUNBUFFERED="1")
                procs.append(subprocess.Popen([*ddp_cmd(out, steps=steps, state_mb=state_mb, workers=loader_workers),
                                               "--ckpt", str(ckpt),
                                               *extra], env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT))
                logs.append(log)
            codes = [p.wait(600) for p in procs]
            if codes != [0] * world:
                raise SystemExit(f"checkpoint-restart ({tag}): exit codes {codes}; see {root}")
            return logs

        warm_s = prewarm(prewarm_gib)  # before the first launch: the save comes a few seconds later
        first = launch("before", ["--save-at-step", str(save_at)])
        second = launch("after", ["--resume"])
        a, b = _phase_times(first[0]), _phase_times(second[0])
        last_step = step_times(first[0])[-1][1]
        first_step = step_times(second[0])[0][1]
        gaps = sorted(step_gaps(first[0]))
        phases = {"save": a["saved"] - last_step,
                  "exit_and_relaunch": b["start"] - a["saved"],
                  "import": b["imported"] - b["start"],
                  "init_process_group": b["group"] - b["imported"],
                  "build_and_load": b["loaded"] - b["group"],
                  "first_step": first_step - b["loaded"]}
        ckpt_bytes = sum(f.stat().st_size for f in ckpt.iterdir())
        return {"method": "checkpoint-restart", "world": world, "state_mb": state_mb,
                "job_pause_s": round(first_step - last_step, 4), "downtime_s": round(first_step - last_step, 4),
                "median_step_s": round(gaps[len(gaps) // 2], 4), "checkpoint_bytes": ckpt_bytes,
                "phases": {k: round(v, 4) for k, v in phases.items()}, "prewarm_s": round(warm_s, 2),
                "final": _final_hashes(out, world)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


CHART_PHASES = {  # method phase -> chart segment
    "pause": "pause (cut)", "verify": "verify", "release": "release", "restore": "restore",
    "rewire": "rewire", "commit": "commit + resume", "resume": "commit + resume",
    "save": "save", "exit_and_relaunch": "exit + relaunch", "import": "import torch",
    "init_process_group": "init_process_group", "build_and_load": "build + load", "first_step": "first step",
}


def workers_summary(runs: list[dict], pause: dict[str, float]) -> dict[str, float]:
    """The ratios a job with DataLoader workers is judged by, where their runs were made: its images
    and pre-copy against the same job's without workers (the ranks' own memory), its pause against
    that job's, and the stock CRIU against the one pitstop carries."""
    by = {r["method"]: r for r in runs}
    out: dict[str, float] = {}

    def ratio(key: str, a: str, b: str, field: str) -> None:
        if a in by and b in by and by[b].get(field):
            out[key] = by[a][field] / by[b][field]

    ratio("image bytes: stop-and-copy / no loader workers, stop-and-copy", "pitstop, stop-and-copy",
          "pitstop, no loader workers, stop-and-copy", "bytes")
    ratio("pre-copy bytes: pitstop / no loader workers", "pitstop", "pitstop, no loader workers", "pre_copy_sent_bytes")
    ratio("image bytes: stock CRIU, stop-and-copy / stop-and-copy", "pitstop, stock CRIU, stop-and-copy",
          "pitstop, stop-and-copy", "bytes")
    ratio("pre-copy bytes: stock CRIU / pitstop", "pitstop, stock CRIU", "pitstop", "pre_copy_sent_bytes")
    for a, b in (("pitstop", "pitstop, no loader workers"), ("pitstop, stock CRIU", "pitstop"),
                 ("pitstop, stop-and-copy", "pitstop, no loader workers, stop-and-copy"),
                 ("pitstop, stock CRIU, stop-and-copy", "pitstop, stop-and-copy")):
        if a in pause and b in pause:
            out[f"job pause: {a} / {b}"] = pause[a] / pause[b]
    return out


def median_runs(runs: list[dict]) -> list[dict]:
    """Per (method, job size), the run whose downtime is the median (the lower middle of an
    even count), in the order the sizes were first run."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["method"], r["world"]), []).append(r)
    return [sorted(g, key=lambda r: r["downtime_s"])[(len(g) - 1) // 2] for g in groups.values()]


def chart(runs: list[dict], path: Path, floor_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, stacks = [], []
    for r in runs:
        seg: dict[str, float] = {}  # in the order the phases happen
        for k, v in r["phases"].items():
            if k == "capture":
                dump = min(r["dump_s"], v)
                delta = min(max((cp.get("delta", 0.0) for cp in r.get("capture_phases", [])), default=0.0), v - dump)
                seg["dump (CRIU)"] = dump
                if delta:
                    seg["delta against the pre-copy"] = delta
                seg["transfer after dump"] = v - dump - delta
                continue
            name = CHART_PHASES.get(k, k)
            seg[name] = seg.get(name, 0.0) + v
        labels.append(f"{r['method']}\n{r['world']} ranks")
        stacks.append(seg)
    names = list(dict.fromkeys(k for s in stacks for k in s))
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(runs) + 2))
    left = [0.0] * len(runs)
    cmap = plt.get_cmap("tab20")
    for i, n in enumerate(names):
        w = [s.get(n, 0.0) for s in stacks]
        ax.barh(labels, w, left=left, label=n, color=cmap(i))
        left = [a + b for a, b in zip(left, w)]
    for i, r in enumerate(runs):
        ax.plot([r["job_pause_s"]], [i], "k|", markersize=18)
    ax.axvline(floor_s, color="red", linestyle="--", label=f"data floor {floor_s:.2f} s")
    ax.set_xlabel("seconds (bars: phases of the downtime; | : longest gap between steps the job saw)")
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Moving the ranks of one host: downtime by phase")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def scaling_summary(scaling: list[dict], medians: list[dict]) -> dict:
    """The spread of the sizes' median downtimes, per method, and what each size's pause round took."""
    out: dict = {}
    for label in sorted({s["method"] for s in scaling}):
        d = [s["downtime_s"] for s in medians if s["method"] == label]
        out[f"scaling_downtime_spread ({label}, medians)"] = (max(d) - min(d)) / min(d)
        every = [s["downtime_s"] for s in scaling if s["method"] == label]
        out[f"scaling_downtime_range ({label}, every run)"] = [min(every), max(every)]
        out[f"scaling_median_downtime_s ({label})"] = {str(s["world"]): s["downtime_s"]
                                                       for s in medians if s["method"] == label}
        for phase in ("pause", "resume"):
            out[f"scaling_{phase}_s ({label}, every run)"] = {
                str(w): [round(s["phases"].get(phase, 0.0), 3) for s in scaling
                         if s["method"] == label and s["world"] == w]
                for w in sorted({s["world"] for s in scaling if s["method"] == label})}
    return out


def _report_scaling(a: argparse.Namespace, started: float, bw: float, scaling: list[dict],
                    medians: list[dict]) -> None:
    summary = {"raw_tcp_bytes_per_s": bw, **scaling_summary(scaling, medians)}
    doc = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "command": " ".join(sys.argv),
           "wall_s": round(time.time() - started, 1), "summary": summary, "scaling": scaling}
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"{machine()}; scaling only")
    for r in scaling:
        print(f"{r['method']:<34}{r['world']:>3} ranks  downtime {r['downtime_s']:.2f} s  job pause "
              f"{r['job_pause_s']:.2f} s  " + " ".join(f"{k}={v:.2f}" for k, v in r["phases"].items()))
    for k, v in summary.items():
        print(f"  {k}: {v if isinstance(v, (bool, list, dict)) else round(v, 3)}")
    print(f"wrote {a.out}")


def _kept(measure: Callable[..., dict], partial: Path, bw: float, done: list[dict]) -> Callable[..., dict]:
    """`measure`, whose every result is also appended to `done` and written to `partial` as it
    ends: a full run takes the better part of an hour, and one stopped early still leaves what
    it measured."""
    def run(*args: Any, **kw: Any) -> dict:
        r = measure(*args, **kw)
        done.append(r)
        partial.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": machine(),
                                       "command": " ".join(sys.argv), "raw_tcp_bytes_per_s": bw,
                                       "finished": False, "runs": done}, indent=1))
        return r
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--state-mb", type=float, default=512.0, help="extra state per rank (MiB), up to about 2048")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--worlds", default="2,4,8", help="job sizes for the scaling runs (one leaving rank)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each 4-rank method, interleaved; the table and ratios use each method's "
                         "medians (downtime and job pause separately)")
    ap.add_argument("--scaling-repeats", type=int, default=3,
                    help="runs per job size, interleaved (2,4,8,2,4,8,...); the spread is taken between "
                         "the sizes' medians: one run of each varied by as much as the target allows")
    ap.add_argument("--restart-worlds", default="4", help="job sizes for checkpoint-restart")
    ap.add_argument("--scaling-only", action="store_true",
                    help="only the scaling runs (2/4/8 ranks, one leaving): the spread, without the 4-rank methods")
    ap.add_argument("--skip-naive", action="store_true")
    ap.add_argument("--disk-dir", default="/var/tmp",
                    help="a directory on a disk, for naive CRIU's images (not a tmpfs: checked at the start)")
    ap.add_argument("--skip-post-copy", action="store_true")
    ap.add_argument("--methods", default=",".join(METHOD_KEYS),
                    help=f"the 4-rank methods to run, of {','.join(METHOD_KEYS)} (with the --skip-* options)")
    ap.add_argument("--loader-workers", type=int, default=0,
                    help="DataLoader worker processes per rank (they move with their rank)")
    ap.add_argument("--prewarm-gib", type=float, default=0.0,
                    help="touch and free this much tmpfs right before each evacuation (see prewarm())")
    ap.add_argument("--out", default=str(OUT / "compare.json"))
    ap.add_argument("--chart-only", metavar="JSON", help="redraw the chart of an earlier run's JSON")
    a = ap.parse_args()
    if a.chart_only:
        d = json.loads(Path(a.chart_only).read_text())
        chart(d["runs"] + median_runs(d["scaling"]), Path(a.chart_only).with_suffix(".png"), d["summary"]["floor_s"])
        return
    unknown = set(a.methods.split(",")) - set(METHOD_KEYS)
    if unknown or "default" not in a.methods.split(","):
        raise SystemExit(f"--methods {a.methods!r}: " + (f"unknown {sorted(unknown)}; " if unknown else "") +
                         f"give some of {','.join(METHOD_KEYS)}, default among them (every ratio is against it)")
    if not a.skip_naive and not a.scaling_only:
        kind = fs_type(Path(a.disk_dir))
        if kind in MEMORY_FS:
            raise SystemExit(f"--disk-dir {a.disk_dir} is on {kind}, not a disk: naive CRIU to disk would "
                             "measure memory; give a directory on a disk (or --skip-naive)")
    OUT.mkdir(parents=True, exist_ok=True)
    started = time.time()
    bw = raw_tcp_bandwidth()
    partial = Path(a.out).with_suffix(".partial.json")
    done: list[dict] = []
    evacuate, restart = _kept(evacuation, partial, bw, done), _kept(checkpoint_restart, partial, bw, done)
    every_run: list[dict] = []
    for rep in range(0 if a.scaling_only else max(1, a.repeats)):  # interleaved: a slow spell hits every method
        first = len(every_run)
        want = set(a.methods.split(","))
        job = {"prewarm_gib": a.prewarm_gib, "loader_workers": a.loader_workers}
        if "default" in want:
            every_run.append(evacuate(4, [2, 3], a.state_mb, a.steps, **job))
        if "stop-and-copy" in want:
            every_run.append(evacuate(4, [2, 3], a.state_mb, a.steps, label="pitstop, stop-and-copy", pre_copy=False,
                                      **job))
        if "stock-criu" in want:
            every_run.append(evacuate(4, [2, 3], a.state_mb, a.steps, STOCK_CRIU, label="pitstop, stock CRIU", **job))
        if "stock-criu-stop-and-copy" in want:
            every_run.append(evacuate(4, [2, 3], a.state_mb, a.steps, STOCK_CRIU,
                                      label="pitstop, stock CRIU, stop-and-copy", pre_copy=False, **job))
        if "no-workers" in want:
            every_run.append(evacuate(4, [2, 3], a.state_mb, a.steps, label="pitstop, no loader workers",
                                      **{**job, "loader_workers": 0}))
        if "no-workers-stop-and-copy" in want:
            every_run.append(evacuate(4, [2, 3], a.state_mb, a.steps, label="pitstop, no loader workers, stop-and-copy",
                                      pre_copy=False, **{**job, "loader_workers": 0}))
        if not a.skip_post_copy:
            if "post-copy" in want:
                every_run.append(evacuate(4, [2, 3], a.state_mb, a.steps, LOCAL_POST_COPY,
                                          label="pitstop, post-copy", pre_copy=False, **job))
            if "pre-copy+post-copy" in want:
                every_run.append(evacuate(4, [2, 3], a.state_mb, a.steps, LOCAL_POST_COPY,
                                          label="pitstop, pre-copy + post-copy", **job))
            if "network-post-copy" in want:
                every_run.append(evacuate(4, [2, 3], a.state_mb, a.steps, NETWORK_POST_COPY,
                                          label="pitstop, network post-copy", **job))
        if not a.skip_naive:
            if "naive" in want:
                every_run.append(evacuate(4, [2, 3], a.state_mb, a.steps, {"PITSTOP_AGENT_STREAM_WHILE_DUMPING": "0"},
                                          label="naive CRIU", pre_copy=False, **job))
            if "naive-disk" in want:
                every_run.append(evacuate(4, [2, 3], a.state_mb, a.steps, {"PITSTOP_AGENT_STREAM_WHILE_DUMPING": "0"},
                                          label=NAIVE_DISK, pre_copy=False, image_disk=Path(a.disk_dir), **job))
        if "checkpoint-restart" in want:
            every_run += [restart(int(w), a.state_mb, a.steps, **job) for w in a.restart_worlds.split(",") if w]
        for r in every_run[first:]:
            r["repeat"] = rep
    runs = median_runs(every_run)  # per method: the run of median downtime; ratios use medians (below)
    pause = {m: statistics.median(r["job_pause_s"] for r in every_run if r["method"] == m)
             for m in {r["method"] for r in every_run}}
    scaling = []
    for rep in range(max(1, a.scaling_repeats)):
        for w in (int(x) for x in a.worlds.split(",") if x):
            scaling.append({**evacuate(w, [w - 1], a.state_mb, a.steps, label="pitstop, 1 rank leaving",
                                       prewarm_gib=a.prewarm_gib), "repeat": rep})
            if not a.skip_post_copy:
                scaling.append({**evacuate(w, [w - 1], a.state_mb, a.steps, NETWORK_POST_COPY,
                                           label="network post-copy, 1 rank leaving",
                                           prewarm_gib=a.prewarm_gib), "repeat": rep})
    medians = median_runs(scaling)
    if a.scaling_only:
        _report_scaling(a, started, bw, scaling, medians)
        partial.unlink(missing_ok=True)
        return
    ref = runs[0]
    floor = ref["bytes"] / bw
    after_bw = raw_tcp_bandwidth()
    summary = {
        "raw_tcp_bytes_per_s": [bw, after_bw], "floor_s": floor,
        "target_floor_s": 1.5 * floor + 0.5,
        "pitstop_vs_target": ref["downtime_s"] / (1.5 * floor + 0.5),
        "downtime_over_floor": ref["downtime_s"] / floor,
    }
    for r in runs[1:]:
        summary[f"{r['method']} / pitstop (job pause)"] = pause[r["method"]] / pause[ref["method"]]
    for method, name in (("pitstop, post-copy", "post-copy"), ("pitstop, pre-copy + post-copy", "pre-copy + post-copy"),
                         ("pitstop, network post-copy", "network post-copy")):
        v = next((r for r in runs if r["method"] == method), None)
        if v is None:
            continue
        summary[f"{name}: downtime_over_floor"] = v["downtime_s"] / floor
        summary[f"{name}: vs_target"] = v["downtime_s"] / (1.5 * floor + 0.5)
        for r in runs:
            if r["method"] in BASELINES:
                summary[f"{r['method']} / {name} (job pause)"] = pause[r["method"]] / pause[v["method"]]
                summary[f"{r['method']} / {name} (downtime)"] = r["downtime_s"] / v["downtime_s"]
    net = next((r for r in runs if r["method"] == "pitstop, network post-copy"), None)
    if net and net.get("fill_s"):
        summary["network post-copy: fill_s"] = net["fill_s"]
        summary["network post-copy: fill_bytes_per_s"] = net["bytes_after_resume"] / net["fill_s"]
        summary["network post-copy: fill_vs_raw_tcp"] = net["bytes_after_resume"] / net["fill_s"] / bw
    summary.update(scaling_summary(scaling, medians))
    whole = next((r for r in runs if r["method"] == "pitstop, stop-and-copy"), ref)
    transfer = [cp.get("transfer", 0.0) for cp in whole["capture_phases"]]
    if transfer and max(transfer) > 0:
        summary["stream_bytes_per_s"] = whole["bytes"] / max(transfer)
        summary["stream_vs_raw_tcp"] = summary["stream_bytes_per_s"] / bw
    if ref.get("precopy_s"):  # the pre-copy: live memory read and sent while the job trains
        summary["pre_copy_s"] = ref["precopy_s"]
        summary["pre_copy_bytes_per_s"] = ref["pre_copy_sent_bytes"] / ref["precopy_s"]
        summary["pre_copy_vs_raw_tcp"] = summary["pre_copy_bytes_per_s"] / bw
        summary["bytes_sent_during_pause / image bytes"] = ref["bytes_before_resume"] / ref["bytes"]
        if whole is not ref:
            summary["pitstop, stop-and-copy / pitstop (downtime)"] = whole["downtime_s"] / ref["downtime_s"]
    for r in runs:
        if r["method"] in BASELINES:
            summary[f"{r['method']} / pitstop (downtime)"] = r["downtime_s"] / ref["downtime_s"]
    summary.update(workers_summary(runs, pause))
    # (the job without loader workers is another job: its own runs must agree among themselves)
    exact = {tuple(r["final"]) for r in every_run + scaling if r["world"] == 4 and r["method"] != "checkpoint-restart"
             and "no loader workers" not in r["method"]}
    summary["pitstop_and_naive_identical"] = len(exact) == 1
    alone = {tuple(r["final"]) for r in every_run if "no loader workers" in r["method"]}
    if alone:
        summary["no_loader_workers_runs_identical"] = len(alone) == 1
    summary["runs_whose_ranks_disagree"] = [f"{r['method']} ({r['world']} ranks): from step {r['first_divergent_step']},"
                                            f" moved after step {r['moved_after_step']}"
                                            for r in every_run + scaling if r.get("first_divergent_step") is not None]
    summary["runs_measured_again"] = [f"{r['method']} ({r['world']} ranks): {r['attempts']} attempts"
                                      for r in every_run + scaling if r.get("attempts", 1) > 1]
    summary["runs_near_the_job_end"] = [f"{r['method']} ({r['world']} ranks), repeat {r.get('repeat')}"
                                        for r in every_run + scaling if r.get("near_the_end")]
    # DDP rebuilds its gradient buckets after a relaunch, which changes the order in which a
    # 4-rank allreduce sums (last-bit rounding): checkpoint-restart is not bit-exact here.
    summary["checkpoint_restart_identical_to_pitstop"] = all(
        tuple(r["final"]) in exact for r in every_run if r["method"] == "checkpoint-restart")
    doc = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "command": " ".join(sys.argv),
           "wall_s": round(time.time() - started, 1), "summary": summary, "runs": runs, "every_run": every_run,
           "median_job_pause_s": pause, "scaling": scaling}
    Path(a.out).write_text(json.dumps(doc, indent=1))
    partial.unlink(missing_ok=True)
    png = Path(a.out).with_suffix(".png")
    chart(runs + medians, png, floor)
    print(f"{machine()}; raw TCP {bw / 1e9:.2f} GB/s; floor {floor:.3f} s for {ref['bytes'] / 1e6:.0f} MB")
    print(f"{'method':<28}{'ranks':>6}{'downtime s':>11}{'job pause s':>12}{'MB':>7}  phases")
    for r in every_run + scaling:
        mb = r.get("bytes") or r.get("checkpoint_bytes", 0)
        print(f"{r['method']:<28}{r['world']:>6}{r['downtime_s']:>11.2f}{r['job_pause_s']:>12.2f}{mb / 1e6:>7.0f}  "
              + " ".join(f"{k}={v:.2f}" for k, v in r["phases"].items()))
    for k, v in summary.items():
        print(f"  {k}: {v if isinstance(v, (bool, list, dict)) else round(v, 3)}")
    print(f"wrote {a.out} and {png}")


if __name__ == "__main__":
    main()
