"""Checks, every step, that the /proc paths a program builds from its own pid and tid name
it (as CUDA's cuInit does: /proc/self/task/<gettid()>/comm), also those of a second thread.
Prints "step N ok outer=<pid as /proc knows it>" per step, or "BAD ..." and exits 3."""

import os
import sys
import threading
import time

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100
ready, box = threading.Event(), {}


def helper() -> None:
    threading.current_thread().name = "helper"
    box["tid"] = threading.get_native_id()
    box["comm"] = open("/proc/thread-self/comm").read()
    ready.set()
    threading.Event().wait()


threading.Thread(target=helper, daemon=True).start()
ready.wait()
for step in range(1, steps + 1):
    tid = threading.get_native_id()
    pairs = [(f"/proc/self/task/{tid}/comm", "/proc/thread-self/comm"),
             (f"/proc/{os.getpid()}/task/{tid}/comm", "/proc/thread-self/comm"),
             (f"/proc/{os.getpid()}/stat", "/proc/self/stat"),
             (f"/proc/self/task/{box['tid']}/comm", None)]
    for built, truth in pairs:
        try:
            got = open(built).read()
        except OSError as e:
            print(f"BAD step {step}: {built}: {e}", flush=True)
            sys.exit(3)
        want = open(truth).read() if truth else box["comm"]
        if built.endswith("stat"):  # field 1 (pid as /proc knows it) and 2 (comm) identify the process
            got, want = got.split()[:2], want.split()[:2]
        if got != want:
            print(f"BAD step {step}: {built} read {got!r}, expected {want!r}", flush=True)
            sys.exit(3)
    print(f"step {step} ok outer={os.readlink('/proc/self')}", flush=True)
    time.sleep(0.05)
print("done", flush=True)
