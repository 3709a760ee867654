"""A worker with an unrelated TCP connection: one HTTP keep-alive connection to a server
(--url), one request per step on it.  When the connection is reset it says so and
reconnects, as a careful program does; it must never hang."""

import argparse
import http.client
import time
import urllib.parse

p = argparse.ArgumentParser()
p.add_argument("--url", required=True)
p.add_argument("--steps", type=int, default=100)
p.add_argument("--step-sleep", type=float, default=0.05)
a = p.parse_args()
u = urllib.parse.urlparse(a.url)
conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
connections = 1
for step in range(1, a.steps + 1):
    try:
        conn.request("GET", f"/step/{step}")
        body = conn.getresponse().read()
    except (ConnectionError, http.client.HTTPException, OSError) as e:
        print(f"reset at step {step}: {type(e).__name__}: {e}", flush=True)
        conn.close()
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        connections += 1
        conn.request("GET", f"/step/{step}")
        body = conn.getresponse().read()
    assert body == f"ok {step}".encode(), body
    print(f"step {step} t={time.time():.6f} connections={connections}", flush=True)
    time.sleep(a.step_sleep)
print(f"done connections={connections}", flush=True)
