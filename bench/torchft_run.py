"""torchft's own recovery of lost replica groups, on the bench's DDP job (bench/workloads/torchft_ddp.py),
for bench/recovery.py to set beside pitstop's recovery and checkpoint-restart.

1. The same job without torchft (tests/workloads/ddp_train.py, plain torch DDP over gloo, full speed)
   and with it: the median step time of each, which gives torchft's per-step cost (its quorum
   and commit round trips on every step).
2. Every group trains, then groups 2 and 3 (host-b's ranks) are SIGKILLed: how long the
   survivors stall before they step on without them.  torchft keeps training on the groups left,
   with a smaller global batch: nothing is rolled back, but the job is no longer the same run.
3. The two groups are relaunched at once (their scheduler's part; a replacement host's start-up
   is not counted): how long until each steps again (start-up, quorum, healing from a live
   peer over torchft's HTTP transport: the model, the optimiser and the extra state), and how
   long the survivors stall while they join.

Everything runs as plain processes on this machine with torchft's lighthouse in this process.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pitstop.dev.devcluster import free_port, step_times

HERE = Path(__file__).resolve().parent
WORKLOAD = HERE / "workloads" / "torchft_ddp.py"
DDP = HERE.parent / "tests" / "workloads" / "ddp_train.py"


def _groups(log: Path) -> list[tuple[int, float, int]]:
    """(step, unix time, participating groups) of every step line."""
    return [(int(m.group(1)), float(m.group(2)), int(m.group(3)))
            for m in re.finditer(r"^step (\d+) t=([0-9.]+) loss=\S+ groups=(\d+)", log.read_text(errors="replace"), re.M)]


def _median_step(log: Path, t0: float, t1: float) -> float:
    ts = [t for _, t in step_times(log) if t0 <= t <= t1]
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    return statistics.median(gaps) if gaps else float("nan")


def _wait(what: str, cond, timeout: float) -> None:
    end = time.time() + timeout
    while not cond():
        if time.time() > end:
            raise SystemExit(f"torchft run: {what} within {timeout:.0f} s")
        time.sleep(0.1)


def plain_ddp_step(world: int, state_mb: float, window: float, root: Path) -> float:
    """The median step time of the plain DDP job, every rank on this machine, at full speed."""
    port, procs, logs = free_port(), [], []
    for r in range(world):
        log = root / f"plain.rank{r}.log"
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   USE_LIBUV="0", PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([sys.executable, str(DDP), "--steps", "100000", "--out", str(root / "plain"),
                                       "--state-mb", str(state_mb), "--step-sleep", "0"],
                                      env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT))
        logs.append(log)
    try:
        _wait("the plain job's first steps", lambda: len(step_times(logs[0])) > 20, 120)
        t0 = time.time()
        time.sleep(window)
        return _median_step(logs[0], t0, time.time())
    finally:
        for p in procs:
            p.kill()
            p.wait(30)


def run(world: int = 4, lost: tuple[int, ...] = (2, 3), state_mb: float = 128.0, window: float = 30.0) -> dict:
    from torchft._torchft import LighthouseServer

    root = Path(tempfile.mkdtemp(prefix="pitstop-bench-torchft-", dir="/var/tmp"))
    procs: dict[int, subprocess.Popen] = {}
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=10000, quorum_tick_ms=100)
    ok = False
    try:
        plain = plain_ddp_step(world, state_mb, window, root)

        def launch(group: int, tag: str) -> Path:
            log = root / f"{tag}.group{group}.log"
            procs[group] = subprocess.Popen(
                [sys.executable, str(WORKLOAD), "--group", str(group), "--lighthouse", lighthouse.address(),
                 "--state-mb", str(state_mb)], env=dict(os.environ, PYTHONUNBUFFERED="1"),
                stdout=open(log, "wb"), stderr=subprocess.STDOUT)
            return log

        logs = {g: launch(g, "first") for g in range(world)}
        survivor = logs[0]
        _wait("every group in one quorum", lambda: any(n == world for _, _, n in _groups(survivor)[-5:]), 180)
        t0 = time.time()
        time.sleep(window)
        tft = _median_step(survivor, t0, time.time())

        killed_at = time.time()
        for g in lost:
            procs[g].send_signal(signal.SIGKILL)
            procs[g].wait(30)
        _wait("the survivors stepping on without the lost groups",
              lambda: any(t > killed_at and n == world - len(lost) for _, t, n in _groups(survivor)), 120)
        after = [(s, t, n) for s, t, n in _groups(survivor) if t > killed_at]
        resumed = next(t for _, t, n in after if n == world - len(lost))
        before = max(t for _, t, _n in _groups(survivor) if t <= killed_at)

        relaunched_at = time.time()
        new = {g: launch(g, "relaunch") for g in lost}
        _wait("the relaunched groups stepping", lambda: all(_groups(log) for log in new.values()), 300)
        _wait("the survivors in a whole quorum again",
              lambda: any(t > relaunched_at and n == world for _, t, n in _groups(survivor)), 120)
        first_back = {g: _groups(log)[0][1] for g, log in new.items()}
        rejoined = next(t for _, t, n in _groups(survivor) if t > relaunched_at and n == world)
        gaps_join = [b - a for (_, a, _n), (_, b, _m) in zip(_groups(survivor), _groups(survivor)[1:])
                     if b >= relaunched_at and a <= rejoined]
        phases = {}
        for g, log in new.items():
            ph = {m.group(1): float(m.group(2)) for m in
                  re.finditer(r"^phase (\w+) t=([0-9.]+)", log.read_text(errors="replace"), re.M)}
            phases[g] = {"start_to_import": round(ph["imported"] - ph["start"], 3),
                         "manager_and_model": round(ph["manager"] - ph["imported"], 3),
                         "quorum_heal_first_step": round(first_back[g] - ph["manager"], 3)}
        healed_steps = {g: _groups(log)[0][0] for g, log in new.items()}
        ok = True
        return {
            "world": world, "groups_lost": list(lost), "state_mb": state_mb,
            "plain_ddp_step_s": round(plain, 5), "torchft_step_s": round(tft, 5),
            "per_step_cost": round(tft / plain - 1, 4) if plain else None,
            "stall_at_failure_s": round(resumed - before, 3),
            "relaunch_to_stepping_s": {g: round(t - relaunched_at, 3) for g, t in first_back.items()},
            "relaunch_phases_s": phases, "healed_at_step": healed_steps,
            "survivors_stall_at_join_s": round(max(gaps_join), 3) if gaps_join else 0.0,
            "groups_missing_s": round(rejoined - killed_at, 3),
            "lighthouse": {"min_replicas": 1, "join_timeout_ms": 10000, "quorum_tick_ms": 100},
        }
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(30)
        lighthouse.shutdown()
        if ok:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"torchft run: its logs are kept in {root}", file=sys.stderr)


if __name__ == "__main__":
    import json

    sys.path.insert(0, str(HERE.parent))
    print(json.dumps(run(window=float(sys.argv[1]) if len(sys.argv) > 1 else 30.0), indent=1))
