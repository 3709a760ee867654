"""A worker that does nothing but live: enough to register, pause and capture cheaply."""

import sys
import time

end = time.time() + float(sys.argv[1] if len(sys.argv) > 1 else 120)
n = 0
while time.time() < end:
    n += 1
    print(f"tick {n}", flush=True)
    time.sleep(0.2)
