"""The bench's DDP job rewritten for torchft, so that bench/recovery.py can set torchft's own
recovery of a lost replica group beside pitstop's on the same work.

Same model, optimiser, data and extra state as tests/workloads/ddp_train.py (Linear 64-256-8,
Adam, 16 rows of seeded random data a step, --state-mb of ballast), but each rank is a torchft
replica group of one: torchft's Manager, its DistributedDataParallel and Optimizer wrappers, and
state_dict/load_state_dict callbacks that hand a healing group the model, the optimiser and the
ballast from a live peer.  Those are the code changes torchft needs; pitstop needs none.

A step line ``step N t=<unix time> loss=<float> groups=<participants>`` per step (N is torchft's
step, which a healed group takes over from its peer), and ``phase <name> t=<unix time>`` lines
for the start-up a relaunched group goes through.
"""

from __future__ import annotations

import time

T_START = time.time()  # before torch's import: a relaunched group's start-up is part of its cost

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo  # noqa: E402
from torchft.ddp import PureDistributedDataParallel  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int, required=True, help="this replica group's number")
    p.add_argument("--lighthouse", required=True, help="the torchft lighthouse's address")
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--state-mb", type=float, default=0.0, help="extra state per rank (MiB), healed like the model")
    p.add_argument("--pg-timeout-s", type=float, default=5.0, help="gloo's timeout (torchft's DDP example: 5 s)")
    p.add_argument("--ddp", choices=["pure", "reducer"], default="pure",
                   help="torchft's PureDistributedDataParallel (an allreduce per gradient, through the Manager) or its "
                        "DistributedDataParallel (torch's reducer with torchft's comm hook).  With torchft 0.2.0 and gloo "
                        "the latter kills the survivors when a peer dies: its hook asserts on the failed future "
                        "(torchft/ddp.py, _comm_hook)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="the Manager's timeout (its example: 30 s)")
    args = p.parse_args()
    print(f"phase start t={T_START:.6f}", flush=True)
    print(f"phase imported t={time.time():.6f}", flush=True)

    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 8))
    n = int(args.state_mb * 262144)
    holder = {"ballast": torch.arange(n, dtype=torch.int32) if n else torch.zeros(0)}
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict(), "ballast": holder["ballast"]}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        holder["ballast"] = sd["ballast"]

    # A replica group of one rank: its own store, which torchft's Manager joins as a client.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout_s)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"bench_{args.group}",
                      timeout=timedelta(seconds=args.timeout_s), rank=0, world_size=1,
                      store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=args.lighthouse)
    ddp = DistributedDataParallel(manager, model) if args.ddp == "reducer" else PureDistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    print(f"phase manager t={time.time():.6f}", flush=True)

    g = torch.Generator().manual_seed(100 + args.group)
    data, target = torch.randn(1024, 64, generator=g), torch.randn(1024, 8, generator=g)
    while manager.current_step() < args.steps:
        i = (manager.current_step() * 16) % 1024
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(data[i:i + 16]), target[i:i + 16])
        loss.backward()
        opt.step()
        print(f"step {manager.current_step()} t={time.time():.6f} loss={loss.item():.6f} "
              f"groups={manager.num_participants()}", flush=True)
    b = holder["ballast"]
    if b.numel():
        assert int(b[-1]) == b.numel() - 1, "ballast corrupted"
    sys.stdout.flush()
    os._exit(0)  # torchft's threads (its Manager's server, its futures) are not joined at exit


if __name__ == "__main__":
    main()
