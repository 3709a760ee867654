#!/usr/bin/env python3
"""One-shot validation of pitstop's GPU path on a real GPU host (run by tests/gpu/run.sh).

  (a) a CUDA training loop is locked, checkpointed, restored and unlocked through the
      driver API mid-training and finishes bitwise equal to an uninterrupted run;
  (b) the same, with the process dumped by CRIU, killed, and restored by CRIU in between
      (skipped, with CRIU's reason, where this kernel cannot run CRIU, e.g. gVisor);
  (c) the NCCL shim under real PyTorch ProcessGroupNCCL, world size 1: consistent cut,
      destroy, re-create with a fresh unique id, continue, bitwise equal;
  (d) GPU->host checkpoint and host->GPU restore throughput for 1, 8 and 32 GiB;
  (e) the whole product: a coordinator and two agents on this host, the CUDA job started by
      `pitstop run`, its host evacuated to the spare mid-training, bitwise equal at the end;
  (f) the same with a worker tree of three CUDA processes (a parent training and two children
      training alike), which the agent locks, checkpoints and restores all at once.

Every check has a deadline; the whole run stops starting new checks past --budget-s.
Writes a JSON report (--report) and prints a summary.  Exit status: 0 when nothing
failed (skips are not failures, each says why), 1 when a check failed, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "service"))
TRAIN = HERE / "cuda_train.py"
CHECKS = {"a": "cuda_checkpoint_roundtrip", "b": "criu_with_cuda", "c": "shim_under_processgroupnccl",
          "d": "checkpoint_throughput", "e": "evacuation_through_agents",
          "f": "cuda_tree_evacuation_through_agents", "g": "live_device_bytes"}


class Skip(Exception):
    """The check cannot run on this machine; the message says why."""


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="gpu_check.py")
    p.add_argument("--report", type=Path, default=Path("gpu-report.json"), help="JSON report to write")
    p.add_argument("--only", default="a,b,c,d,e,f,g", help="checks to run, comma separated, from a,b,c,d,e,f,g")
    p.add_argument("--g-cache-gib", type=float, default=8.0,
                   help="(g): the free cache the job's allocator holds at the cut, GiB")
    p.add_argument("--sizes-gib", default="1,8,32", help="device memory sizes for (d), GiB, comma separated")
    p.add_argument("--host-gib", type=float, default=None,
                   help="host memory (d) may use, GiB (default: MemAvailable; give it on a VM whose memory "
                        "grows on demand, where MemAvailable starts low)")
    p.add_argument("--d-rounds", type=int, default=1,
                   help="(d) checkpoints and restores the same process this many times: later rounds show the "
                        "rates once the driver's host memory has been touched before")
    p.add_argument("--d-parallel", type=int, default=1,
                   help="(d) also splits each size over this many processes and checkpoints and restores them "
                        "at once, as an agent does a host's ranks: whether the driver's rate is per process")
    p.add_argument("--steps", type=int, default=300, help="training steps of the (a)-(c) workload")
    p.add_argument("--budget-s", type=float, default=450.0, help="no check starts after this many seconds")
    p.add_argument("--work-dir", type=Path, default=None, help="scratch directory (default: a fresh tmp dir)")
    p.add_argument("--b-plain", action="store_true",
                   help="(b) starts the workload as a plain child, not in a pid namespace of its own "
                        "(the CRIU restore then takes back its freed pid)")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="no GPU here: run checks (b), (e) and (f) on the CPU to exercise the harness")
    a = p.parse_args(argv)
    only = [x.strip() for x in a.only.split(",") if x.strip()]
    bad = [x for x in only if x not in CHECKS]
    if bad or not only:
        p.error(f"--only takes letters from {','.join(CHECKS)}; got {a.only!r}")
    a.only = only
    try:
        a.sizes = [float(x) for x in a.sizes_gib.split(",") if x.strip()]
    except ValueError:
        p.error(f"--sizes-gib takes numbers of GiB, e.g. 1,8,32; got {a.sizes_gib!r}")
    if not a.sizes or any(s <= 0 or s > 1024 for s in a.sizes):
        p.error(f"--sizes-gib must be between 0 and 1024 GiB; got {a.sizes_gib!r}")
    if a.host_gib is not None and not 0 < a.host_gib <= 65536:
        p.error(f"--host-gib must be between 0 and 65536; got {a.host_gib}")
    if not 1 <= a.d_parallel <= 16:
        p.error(f"--d-parallel must be between 1 and 16; got {a.d_parallel}")
    if not 1 <= a.d_rounds <= 5:
        p.error(f"--d-rounds must be between 1 and 5; got {a.d_rounds}")
    if a.steps < 100:
        p.error("--steps must be at least 100 (the checks interrupt the run at step 50)")
    return a


# -- processes ---------------------------------------------------------------------------------
class Proc:
    """A workload process with its output in a file; killed (whole group) on close."""

    def __init__(self, cmd: list[str], out: Path, env: dict[str, str] | None = None, stdin: int | None = None,
                 pidns: bool = False) -> None:
        self.out = out
        sink = open(out, "wb")
        env = dict(env or {})
        if pidns:  # as `pitstop run` starts workers: init of its own pid namespace and session,
            # with native/procself.c preloaded (CUDA's cuInit fails there without it: error 304)
            from pitstop.launcher.environment import procself_env

            env.setdefault("LD_PRELOAD", os.environ.get("LD_PRELOAD", ""))
            env, _ = procself_env(env)
            # The worker writes the file itself: unshare's own messages (it reports its child's
            # death) must not change a file whose size CRIU recorded.
            cmd = ["unshare", "--pid", "--fork", "setsid", "sh", "-c", f'exec "$0" "$@" >"{out}" 2>&1', *cmd]
            sink = open(os.devnull, "wb")
        self.p = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT,
                                  stdin=stdin if stdin is not None else subprocess.DEVNULL,
                                  env={**os.environ, **(env or {})}, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.p.pid

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def steps(self) -> int:
        ms = re.findall(r"^step (\d+) ", self.text(), re.M)
        return int(ms[-1]) if ms else 0

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            m = re.search(pattern, self.text(), re.M)
            if m:
                return m
            if self.p.poll() is not None:
                raise RuntimeError(f"workload exited ({self.p.returncode}) before {pattern!r}: {self.text()[-800:]}")
            time.sleep(0.02)
        raise TimeoutError(f"no {pattern!r} within {timeout_s:.0f} s: {self.text()[-800:]}")

    def close(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.p.wait(10)


def final_hash(text: str) -> str:
    m = re.search(r"^done sha256=([0-9a-f]{64})", text, re.M)
    if not m:
        raise RuntimeError(f"the workload did not finish: {text[-800:]}")
    return m.group(1)


def run_to_end(work: Path, name: str, args: list[str], env: dict[str, str] | None = None,
               timeout_s: float = 180) -> tuple[str, float]:
    t0 = time.monotonic()
    p = Proc([sys.executable, str(TRAIN), *args], work / f"{name}.out", env)
    try:
        rc = p.p.wait(timeout_s)
    finally:
        p.close()
    if rc != 0:
        raise RuntimeError(f"{name} exited {rc}: {p.text()[-800:]}")
    return final_hash(p.text()), time.monotonic() - t0


# -- preflight ---------------------------------------------------------------------------------
def preflight() -> dict:
    info: dict = {"python": platform.python_version(), "kernel": platform.release()}
    try:
        from pitstop.criu import runtime

        rt = runtime.locate()
        info["criu"] = f"{rt.version_str} ({rt.source}: {rt.binary})"
    except Exception as e:  # noqa: BLE001 - reported; only (b) needs CRIU
        info["criu"] = f"not usable: {e}"
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        if not torch.cuda.is_available():
            info["skip"] = "no CUDA device: torch.cuda.is_available() is False"
            return info
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    except ImportError as e:
        info["skip"] = f"torch is not importable: {e}"
        return info
    from pitstop.gpu.driver import NoDriver, load

    try:
        info["cuda_driver_api"] = load().version()
    except NoDriver as e:
        info["skip"] = f"CUDA driver API unusable: {e}"
        return info
    from pitstop.gpu.inventory import inventory

    inv = inventory()
    info["driver"] = inv.get("driver")
    info["gpu_uuids"] = [g["uuid"] for g in inv.get("gpus", [])]
    info["host_memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return info


# -- (a) -------------------------------------------------------------------------------------------
def check_a(a: argparse.Namespace, work: Path, ref: str) -> dict:
    from pitstop.gpu.driver import load

    drv = load()
    p = Proc([sys.executable, str(TRAIN), "--steps", str(a.steps)], work / "a.out")
    try:
        p.wait_for(r"^step 50 ", 120)
        t0 = time.monotonic()
        drv.lock(p.pid, 10_000)
        t1 = time.monotonic()
        drv.checkpoint(p.pid)
        t2 = time.monotonic()
        state = drv.state(p.pid)
        before = p.steps()
        time.sleep(1.0)
        progressed = p.steps() - before
        drv.restore(p.pid, [])
        t3 = time.monotonic()
        drv.unlock(p.pid)
        t4 = time.monotonic()
        rc = p.p.wait(180)
        got = final_hash(p.text())
    finally:
        p.close()
    res = {"lock_s": t1 - t0, "checkpoint_s": t2 - t1, "restore_s": t3 - t2, "unlock_s": t4 - t3,
           "state_while_checkpointed": state, "steps_while_checkpointed": progressed, "exit": rc,
           "sha256": got, "reference_sha256": ref}
    if state != "checkpointed" or progressed or rc != 0 or got != ref:
        raise AssertionError(f"round trip not transparent: {res}")
    return res


# -- (b) -------------------------------------------------------------------------------------------
def become_subreaper() -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def check_b(a: argparse.Namespace, work: Path, ref: str) -> dict:
    from pitstop.criu import criu_ops, runtime
    from pitstop.errors import PitstopError
    from pitstop.gpu.checkpoint import GpuCheckpointer
    from pitstop.proc import proctree

    try:
        rt = runtime.locate()
    except PitstopError as e:
        raise Skip(f"no CRIU: {e.message}") from None
    ok, why = rt.check()
    if not ok:
        raise Skip(f"this kernel cannot run CRIU (`criu check`: {why})")
    if shutil.which("unshare") is None or shutil.which("setsid") is None:
        raise Skip("util-linux unshare/setsid are missing")
    become_subreaper()
    gpu = GpuCheckpointer(lock_timeout_s=10)
    dev = ["--device", "cpu"] if a.cpu_dry_run else []
    p = Proc([sys.executable, str(TRAIN), "--steps", str(a.steps), *dev], work / "b.out", pidns=not a.b_plain)
    images = work / "b-images"
    restored = None
    try:
        p.wait_for(r"^step 50 ", 120)
        root = p.pid if a.b_plain else proctree.children(p.pid)[0]
        pids = proctree.tree(root)
        s = gpu.suspend(pids)
        if s is None and not a.cpu_dry_run:
            raise AssertionError(f"no process of the tree {pids} was seen holding /dev/nvidia*")
        record = s.record() if s else {}
        dump = criu_ops.dump(root, images, criu_ops.DumpOptions(timeout_s=60))
        image_bytes = sum(f.stat().st_size for f in images.iterdir())
        if a.b_plain:
            os.kill(root, signal.SIGKILL)  # our child: reaping it frees its pid for the restore
        else:
            proctree.kill_and_wait(root)
        p.p.wait(10)
        t0 = time.monotonic()
        restored, _ = criu_ops.restore(images, {})
        t1 = time.monotonic()
        timings = gpu.resume_restored(restored, record) if record else {}
        end = time.monotonic() + 180
        while proctree.exists(restored) and time.monotonic() < end:
            try:
                os.waitpid(restored, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.05)
        got = final_hash(p.text())
    finally:
        if restored and proctree.exists(restored):
            proctree.kill_and_wait(restored)
        p.close()
    res = {"gpu_lock_s": s.lock_s if s else None, "gpu_checkpoint_s": s.checkpoint_s if s else None,
           "cpu_dry_run": a.cpu_dry_run, "launch": "plain" if a.b_plain else "pid namespace", "criu_dump_s": dump.seconds,
           "criu_restore_s": t1 - t0, **timings, "image_bytes": image_bytes, "sha256": got,
           "reference_sha256": ref}
    if got != ref:
        raise AssertionError(f"restored run diverged: {res}")
    return res


# -- (c) -------------------------------------------------------------------------------------------
def check_c(a: argparse.Namespace, work: Path) -> dict:
    from pitstop import shimctl
    from pitstop.coordinator.cut import Cut

    shim = Path(os.environ.get("PITSTOP_SHIM", ROOT / "shim" / "build" / "libpitstop_shim.so"))
    if not shim.exists():
        raise Skip(f"the shim is not built ({shim}); run `make -C shim`")
    args = ["--steps", str(a.steps), "--pg", "nccl"]
    ref, _ = run_to_end(work, "c-ref", args, {"PG_STORE": str(work / "c-ref.store")})
    p = Proc([sys.executable, str(TRAIN), *args], work / "c.out",
             {"LD_PRELOAD": str(shim), "PG_STORE": str(work / "c.store")})
    try:
        p.wait_for(r"^step 50 ", 180)
        blocks = shimctl.blocks(p.pid)
        if not blocks or not any(b.view()["comms"] for b in blocks):
            raise AssertionError(f"the shim holds no communicator of ProcessGroupNCCL: "
                                 f"{[b.view() for b in blocks]}")

        def post(_w: str, body: dict) -> None:
            for b in shimctl.blocks(p.pid):
                if body["op"] == "quiesce":
                    shimctl.quiesce(b, body["gen"])
                elif body["op"] == "targets":
                    shimctl.set_targets(b, body["targets"])
                else:
                    shimctl.command(b, body["command"], body["ids"])

        cut = Cut(["rank0"], lambda _w: [b.view() for b in shimctl.blocks(p.pid)], post, deadline_s=30)
        q = cut.quiesce()
        at = p.steps()
        destroy_s = cut.destroy()
        rewire_s, ids = cut.rewire()
        rc = p.p.wait(180)
        got = final_hash(p.text())
    finally:
        p.close()
    res = {"quiesce_s": q.seconds, "cut_rounds": q.rounds, "cut_at_step": at, "destroy_s": destroy_s,
           "rewire_s": rewire_s, "communicators": len(ids), "exit": rc, "sha256": got, "reference_sha256": ref}
    if rc != 0 or got != ref:
        raise AssertionError(f"the job did not continue unchanged: {res}")
    return res


# -- (d) -------------------------------------------------------------------------------------------
def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def check_d(a: argparse.Namespace, work: Path) -> dict:
    import torch

    from pitstop.gpu.driver import load

    drv = load()
    out: dict = {}
    free_dev = torch.cuda.mem_get_info(0)[0] / 2**30
    host = a.host_gib if a.host_gib is not None else mem_available_gib()
    out["host_memory"] = {"usable_gib": round(host, 1), "from": "--host-gib" if a.host_gib else "MemAvailable",
                          "mem_available_gib_at_start": round(mem_available_gib(), 1)}
    for gib in a.sizes:
        key = f"{gib:g}GiB"
        if gib * 1.15 > host or gib * 1.05 > free_dev:
            out[key] = {"skipped": f"needs {gib:g} GiB on the GPU ({free_dev:.0f} free) and in host memory "
                                   f"({host:.0f} GiB usable)"}
            continue
        p = Proc([sys.executable, str(TRAIN), "--hold-gib", str(gib)], work / f"d-{key}.out", stdin=subprocess.PIPE)
        try:
            m = p.wait_for(r"^holding .* checksum=(-?\d+)", 120)
            rounds = []
            for _ in range(a.d_rounds):
                t0 = time.monotonic()
                drv.lock(p.pid, 10_000)
                t1 = time.monotonic()
                drv.checkpoint(p.pid)
                t2 = time.monotonic()
                drv.restore(p.pid, [])
                t3 = time.monotonic()
                drv.unlock(p.pid)
                t4 = time.monotonic()
                rounds.append((t0, t1, t2, t3, t4))
            p.p.stdin.write(b"\n")
            p.p.stdin.flush()
            m2 = p.wait_for(r"^after checksum=(-?\d+)", 120)
        finally:
            p.close()
        nbytes = gib * 2**30

        def rates(t: tuple[float, ...]) -> dict:
            t0, t1, t2, t3, t4 = t
            return {"lock_s": t1 - t0, "checkpoint_s": t2 - t1, "restore_s": t3 - t2, "unlock_s": t4 - t3,
                    "checkpoint_GBps": nbytes / (t2 - t1) / 1e9, "restore_GBps": nbytes / (t3 - t2) / 1e9}

        out[key] = {**rates(rounds[0]), "later_rounds": [rates(t) for t in rounds[1:]],
                    "intact": m.group(1) == m2.group(1)}
        if not out[key]["intact"]:
            raise AssertionError(f"device memory changed across checkpoint/restore at {key}: {out[key]}")
        if a.d_parallel > 1:
            out[f"{key} in {a.d_parallel} processes"] = _parallel(drv, work, key, gib, a.d_parallel)
    return out


def _parallel(drv, work: Path, key: str, gib: float, n: int) -> dict:  # noqa: ANN001 - the driver
    """The same bytes split over n processes, each checkpointed (then restored) in a thread of its
    own, all at once: the aggregate rate against one process's."""
    from concurrent.futures import ThreadPoolExecutor

    procs = [Proc([sys.executable, str(TRAIN), "--hold-gib", str(gib / n)], work / f"d-{key}-p{i}.out",
                  stdin=subprocess.PIPE) for i in range(n)]
    try:
        sums = [p.wait_for(r"^holding .* checksum=(-?\d+)", 120).group(1) for p in procs]

        def out_(p: Proc) -> None:
            drv.lock(p.pid, 10_000)
            drv.checkpoint(p.pid)

        def in_(p: Proc) -> None:
            drv.restore(p.pid, [])
            drv.unlock(p.pid)

        with ThreadPoolExecutor(n) as pool:
            t0 = time.monotonic()
            list(pool.map(out_, procs))
            t1 = time.monotonic()
            list(pool.map(in_, procs))
            t2 = time.monotonic()
        for p in procs:
            p.p.stdin.write(b"\n")
            p.p.stdin.flush()
        after = [p.wait_for(r"^after checksum=(-?\d+)", 120).group(1) for p in procs]
    finally:
        for p in procs:
            p.close()
    nbytes = gib * 2**30
    res = {"processes": n, "gib_each": gib / n, "checkpoint_s": t1 - t0, "restore_s": t2 - t1,
           "checkpoint_GBps": nbytes / (t1 - t0) / 1e9, "restore_GBps": nbytes / (t2 - t1) / 1e9,
           "intact": sums == after}
    if not res["intact"]:
        raise AssertionError(f"device memory changed across a parallel checkpoint/restore at {key}: {res}")
    return res


# -- (e), (f), (g): the product on a GPU --------------------------------------------------------------
def evacuate_job(root: Path, cmd: list[str], env: dict[str, str] | None = None, ledger: bool = False) -> dict:
    """A coordinator and two agents (gpu-a, gpu-spare) under `root`; a one-rank job of `cmd` on
    gpu-a, evacuated to the spare at step 50; the operation, the job's exit and output, where its
    worker ended, and (ledger) the move's ledger entry once it says what the job did after it."""
    from pitstop.dev.devcluster import LocalCluster, wait_for_step
    from pitstop.wire.coordinator_client import CoordinatorClient

    root.mkdir(parents=True, exist_ok=True)
    with LocalCluster(root=root) as c:
        c.start_coordinator()
        c.start_agent("gpu-a")
        c.start_agent("gpu-spare", spare=True)
        ranks = c.start_job("g", cmd, 1, {0: "gpu-a"}, env=env)
        wait_for_step(ranks[0].log, 50, timeout_s=180)
        cc = CoordinatorClient(c.coordinator_url, c.operator_token)
        op = cc.evacuate("gpu-a")
        end = time.monotonic() + 300
        while not op["done"] and time.monotonic() < end:
            time.sleep(0.2)
            op = cc.op(op["name"])
        moves: list[dict] = []
        end = time.monotonic() + 30  # the ledger's word on the job after the move
        while ledger and time.monotonic() < end and not (moves and moves[0].get("after_move")):
            moves = [m for m in cc.moves() if m["operation"] == op["name"]]
            time.sleep(0.5)
        rc = ranks[0].proc.wait(300)
        text = ranks[0].log.read_text(errors="replace")
        where = {w["id"]: w["host"] for j in cc.jobs() for w in j["workers"]}
    return {"op": op, "md": op.get("metadata", {}), "exit": rc, "text": text, "host": where.get("g.0"),
            "move": moves[0] if moves else None}


# -- (e) -------------------------------------------------------------------------------------------
def check_e(a: argparse.Namespace, work: Path, ref: str, children: int = 0) -> dict:
    dev = ["--device", "cpu"] if a.cpu_dry_run else []
    tree = ["--cuda-children", str(children)] if children else []
    e = evacuate_job(work / ("cluster" if not children else "cluster-tree"),
                     [sys.executable, str(TRAIN), "--steps", str(a.steps), *dev, *tree])
    op, md, rc, text, where = e["op"], e["md"], e["exit"], e["text"], {"g.0": e["host"]}
    got = final_hash(text)
    res = {"result": md.get("result"), "error": op.get("error"), "downtime_s": md.get("downtime_s"),
           "phases": md.get("phases"), "bytes": md.get("bytes_total"), "worker_host": where.get("g.0"), "exit": rc,
           # where the capture's time went (GPU lock and checkpoint, CRIU's freeze and dump, the
           # pre-copy's delta) and how the pre-copy told what changed, as the source agent saw it
           "workers": {wid: {k: v for k, v in w.items() if k not in ("state",)}
                       for wid, w in (md.get("workers") or {}).items()},
           "cpu_dry_run": a.cpu_dry_run, "sha256": got, "reference_sha256": ref}
    if children:
        res["children"] = children
        res["children_agree"] = f"children agree n={children}" in text
        if not a.cpu_dry_run:  # every process of the tree held CUDA at the pause, and was suspended
            ph = (md.get("workers") or {}).get("g.0", {}).get("capture_phases", {})
            res["gpu_processes"] = ph.get("gpu_processes")
            res["children_agree"] = res["children_agree"] and ph.get("gpu_processes") == children + 1
    if md.get("result") != "succeeded" or rc != 0 or got != ref or where.get("g.0") != "gpu-spare" \
            or res.get("children_agree") is False:
        raise AssertionError(f"the evacuation was not transparent: {res}; the job's output ends: {text[-1500:]}")
    return res


def check_g(a: argparse.Namespace, work: Path) -> dict:
    """Only live device bytes move: an NCCL job (ProcessGroupNCCL, world of 1) whose caching
    allocator holds a large free cache at every step's end is evacuated through the product; at
    the cut the shim empties the leaving rank's cache (shim/trim.c) before its CUDA checkpoint.
    Reports the bytes reserved before and after the release and what the checkpoint copied, the
    downtime, and the job's first step after the move; bitwise equal to the same run uninterrupted."""
    job = ["--steps", str(a.steps), "--pg", "nccl", "--cache-gib", str(a.g_cache_gib)]
    store = work / "g-store"
    ref, _ = run_to_end(work, "g-reference", [*job, "--step-sleep", "0"], env={"PG_STORE": str(work / "g-ref-store")})
    e = evacuate_job(work / "cluster-g", [sys.executable, str(TRAIN), *job], env={"PG_STORE": str(store)},
                     ledger=True)
    op, md, rc, text, moves = e["op"], e["md"], e["exit"], e["text"], [e["move"]] if e["move"] else []
    got = final_hash(text)
    w = (md.get("workers") or {}).get("g.0", {})
    mem = w.get("device_memory") or {}
    res = {"result": md.get("result"), "error": op.get("error"), "downtime_s": md.get("downtime_s"),
           "phases": md.get("phases"), "bytes": md.get("bytes_total"), "cache_gib": a.g_cache_gib,
           "device_memory": mem, "trim_s": (md.get("cut") or {}).get("trim_s"),
           "capture_phases": w.get("capture_phases"), "after_move": moves[0].get("after_move") if moves else None,
           "exit": rc, "sha256": got, "reference_sha256": ref}
    released = mem.get("released") or 0
    if md.get("result") != "succeeded" or rc != 0 or got != ref or released < 0.9 * a.g_cache_gib * 2**30:
        raise AssertionError(f"only live bytes did not move, or not transparently: {res}; "
                             f"the job's output ends: {text[-1500:]}")
    return res


# -- main --------------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    a = parse(argv)
    t_start = time.monotonic()
    report: dict = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                    "host": platform.node(), "command": " ".join([Path(sys.argv[0]).name, *argv]), "checks": {}}
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="pitstop-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    report["machine"] = pre = preflight()
    ref: str | None = None
    for letter in a.only:
        name = CHECKS[letter]
        t0 = time.monotonic()
        try:
            dry = a.cpu_dry_run and letter in "bef"
            if pre.get("skip") and not dry:
                raise Skip(pre["skip"] + ("; --cpu-dry-run exercises (b), (e) and (f) only" if a.cpu_dry_run else ""))
            if time.monotonic() - t_start > a.budget_s:
                raise Skip(f"time budget of {a.budget_s:.0f} s spent before this check")
            if letter in "abef" and ref is None:
                ref, secs = run_to_end(work, "reference", ["--steps", str(a.steps), "--step-sleep", "0",
                                                           *(["--device", "cpu"] if a.cpu_dry_run else [])])
                report["reference"] = {"sha256": ref, "seconds": secs}
            res = {"status": "passed", **{"a": lambda: check_a(a, work, ref), "b": lambda: check_b(a, work, ref),
                                          "c": lambda: check_c(a, work), "d": lambda: check_d(a, work),
                                          "e": lambda: check_e(a, work, ref),
                                          "f": lambda: check_e(a, work, ref, children=2),
                                          "g": lambda: check_g(a, work)}[letter]()}
        except Skip as e:
            res = {"status": "skipped", "reason": str(e)}
        except Exception as e:  # noqa: BLE001 - every failure is reported, then the next check runs
            res = {"status": "failed", "reason": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()[-3000:]}
        res["seconds"] = round(time.monotonic() - t0, 3)
        report["checks"][f"{letter}_{name}"] = res
        print(f"({letter}) {name}: {res['status']}" + (f" - {res['reason']}" if res.get("reason") else ""), flush=True)
        a.report.write_text(json.dumps(report, indent=1))  # a partial report survives a kill
    report["seconds"] = round(time.monotonic() - t_start, 3)
    a.report.parent.mkdir(parents=True, exist_ok=True)
    a.report.write_text(json.dumps(report, indent=1))
    if a.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    print(f"report: {a.report}")
    return 1 if any(c["status"] == "failed" for c in report["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
