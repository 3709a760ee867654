"""A parent that reads its child's output through a pipe, line by line (no pitstop code).

The child prints "child N" every --every seconds; the parent prints "step N t=..." for each line
it reads and, at the end, "done in order n=N" when every line came, in order.  Both ends of that
pipe are in the tree: a move must keep them joined (proc/proctree.py stdio_pipes).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--lines", type=int, default=150)
p.add_argument("--every", type=float, default=0.03)
p.add_argument("--child", action="store_true")
a = p.parse_args()
if a.child:
    for i in range(1, a.lines + 1):
        print(f"child {i}", flush=True)
        time.sleep(a.every)
    sys.exit(0)
kid = subprocess.Popen([sys.executable, __file__, "--child", "--lines", str(a.lines), "--every", str(a.every)],
                       stdout=subprocess.PIPE, text=True)
expect = 1
for line in kid.stdout:
    if line.strip() != f"child {expect}":
        print(f"out of order: got {line.strip()!r}, wanted 'child {expect}'", flush=True)
        sys.exit(1)
    print(f"step {expect} t={time.time():.6f}", flush=True)
    expect += 1
rc = kid.wait()
if rc != 0 or expect != a.lines + 1:
    print(f"the child ended with {rc} after {expect - 1} of {a.lines} lines", flush=True)
    sys.exit(1)
print(f"done in order n={a.lines}", flush=True)
