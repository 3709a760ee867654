"""The host NCCL on its own: results against numpy, the ABI, refusals, deadlines."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from .helpers import WORKLOADS

ROOT = Path(__file__).resolve().parent.parent
LIB = ROOT / "native" / "build"
pytestmark = pytest.mark.timeout(120)


def _env(rank: int, world: int) -> dict:
    return dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LD_LIBRARY_PATH=str(LIB),
                PYTHONPATH=str(WORKLOADS), HOSTNCCL_ADDR="127.0.0.1", HOSTNCCL_TIMEOUT_S="30")


def _run(script: str, world: int, *args: str) -> list[str]:
    with tempfile.TemporaryDirectory() as rdv:
        procs = [subprocess.Popen([sys.executable, str(WORKLOADS / script), *(a.replace("{rdv}", rdv) for a in args)],
                                  env=_env(r, world), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(world)]
        outs = [p.communicate(timeout=100)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, outs
    return outs


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_type_and_op_matches_numpy(world):
    outs = _run("nccl_ops_check.py", world, "{rdv}")
    assert all(o.strip().endswith("ok 40") for o in outs), outs


def test_exports_only_nccl_names():
    out = subprocess.run(["nm", "-D", "--defined-only", str(LIB / "libnccl.so.2")], capture_output=True,
                         text=True).stdout
    names = [ln.split()[-1] for ln in out.splitlines() if ln.strip()]
    assert names and all(n.startswith("nccl") for n in names), names
    assert "ncclCommSplit" in names and "ncclGroupEnd" in names


@pytest.mark.parametrize("script", ["nccl_dp.py", "nccl_pipeline.py", "nccl_tp_dp.py"])
def test_workloads_are_deterministic(script, tmp_path):
    hashes = []
    for i in range(2):
        out = tmp_path / f"o{i}"
        _run(script, 4, "--steps", "15", "--step-sleep", "0", "--rendezvous", "{rdv}", "--out", str(out))
        hashes.append([(out / f"rank{r}.sha256").read_text() for r in range(4)])
    assert hashes[0] == hashes[1]


@pytest.mark.slow
def test_a_peer_that_never_comes_is_an_error_not_a_hang(tmp_path):
    """Rank 1 of 2 never starts: rank 0 must fail within HOSTNCCL_TIMEOUT_S, saying why."""
    env = dict(_env(0, 2), HOSTNCCL_TIMEOUT_S="2")
    p = subprocess.run([sys.executable, str(WORKLOADS / "nccl_dp.py"), "--steps", "1", "--rendezvous", str(tmp_path),
                        "--out", str(tmp_path / "o")], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "ncclCommInitRank failed" in p.stderr


def test_foreign_unique_id_is_refused_without_connecting(tmp_path):
    (tmp_path / "world.id").write_bytes(b"HTTP/1.1 400 Bad Request".ljust(128, b"\0"))
    p = subprocess.run([sys.executable, str(WORKLOADS / "nccl_dp.py"), "--steps", "1", "--rendezvous", str(tmp_path),
                        "--out", str(tmp_path / "o")], env=_env(1, 2), capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "not a host-NCCL unique id" in p.stderr
