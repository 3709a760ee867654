"""What the agent's state file costs per write, against how many moves the agent has seen.

    .venv/bin/python bench/state_write.py [--history 0,100,1000,5000] [--repeats 20]

Every state change rewrites <state_dir>/agent-state.json, several times inside a move's
pause.  For each history (ended captures and ended workers, as an agent accumulates them,
one of each per move) this times one write with the agent as built (ended records beyond
the newest are forgotten: agent/state.py) and with nothing forgotten (the baseline, as
before 2026-12-02), in the same run, and prints the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "service"))
from pitstop.agent import state as st  # noqa: E402
from pitstop.agent.state import AgentState, Capture, Worker  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine  # noqa: E402


def _fill(s: AgentState, n: int) -> None:
    """n moves' worth: a committed capture (as a real one records it) and a moved worker each."""
    for i in range(n):
        s.captures[f"cap-{i:06x}"] = Capture(
            id=f"cap-{i:06x}", worker_id=f"job.{i % 8}", state="committed", image_dir=f"/run/pitstop/images/op-{i}",
            dest_url="https://10.0.0.2:7070", image_id=f"op-{i:012x}-job_{i % 8}", run_id="8dad30c3-a942-4031-9e21",
            phases={k: 0.1234 for k in ("before_dump", "freeze", "dump", "frozen", "memdump", "transfer",
                                        "transfer_after_dump", "release")},
            bytes_total=1542129306, bytes_sent=10430106, updated=1000.0 + i,
            stdio=[{"key": "pipe:[1234]", "fd": 1, "writable": True}, {"key": "pipe:[1235]", "fd": 2, "writable": True}],
            keep_peers=["10.1.2.3", "10.1.2.4"], pre_copy={"parent_bytes": 1531699200, "tracked_tasks": 2, "by": "criu"})
        s.workers[f"w-{i:06x}"] = Worker(id=f"w-{i:06x}", job="job", rank=i % 8, root_pid=1000 + i, start_time=1,
                                         state="moved", moved_to={"agent": "spare-1", "url": "https://10.0.0.2:7070"},
                                         registered_at=1000.0 + i)
    s._loaded -= st.ENDED_WORKER_UNREAD_S + 1  # nobody follows the old ones any more


def _write_s(history: int, repeats: int, forget: bool) -> tuple[float, int]:
    keep = st.KEEP_ENDED
    st.KEEP_ENDED = keep if forget else 10**9
    try:
        with tempfile.TemporaryDirectory() as d:
            s = AgentState(Path(d))
            _fill(s, history)
            s.save()  # the first write forgets what it may
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                s.save()
                times.append(time.perf_counter() - t)
            return statistics.median(times), s.path.stat().st_size
    finally:
        st.KEEP_ENDED = keep


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--history", default="0,100,1000,5000", help="moves the agent has seen")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "state_write.json"))
    args = ap.parse_args()
    rows = []
    print(f"{'moves seen':>10} {'kept: ms/write':>15} {'KiB':>7} {'all kept: ms/write':>19} {'KiB':>7} {'ratio':>6}")
    for n in (int(x) for x in args.history.split(",")):
        kept, kept_b = _write_s(n, args.repeats, forget=True)
        base, base_b = _write_s(n, args.repeats, forget=False)
        rows.append({"history": n, "write_s": round(kept, 5), "bytes": kept_b,
                     "baseline_write_s": round(base, 5), "baseline_bytes": base_b, "ratio": round(base / kept, 2)})
        print(f"{n:>10} {kept * 1e3:>15.2f} {kept_b // 1024:>7} {base * 1e3:>19.2f} {base_b // 1024:>7} "
              f"{base / kept:>6.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                      time.gmtime()),
                                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
