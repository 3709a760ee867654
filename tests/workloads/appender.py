"""A job that keeps an append-only log open and writes a line a step (a training log, a metrics
file), then its result; no pitstop code.  Its log is the subject of a rollback's rule for files."""

import argparse
import time

p = argparse.ArgumentParser()
p.add_argument("--log", required=True)
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=200)
p.add_argument("--step-sleep", type=float, default=0.05)
p.add_argument("--hold", help="a file kept open for reading all along (its input, a config)")
a = p.parse_args()
log = open(a.log, "a")  # kept open, appended to, as a job's own log is
held = open(a.hold) if a.hold else None
total = 0
for step in range(1, a.steps + 1):
    total = (total * 31 + step) % 1_000_003
    log.write(f"step {step} {total}\n")
    log.flush()
    print(f"step {step} t={time.time():.6f}", flush=True)
    time.sleep(a.step_sleep)
log.close()
if held:
    held.close()
with open(a.out, "w") as f:
    f.write(f"{total}\n")
