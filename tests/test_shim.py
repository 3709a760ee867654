"""The shim on its own: ABI hygiene, layout agreement with the agent, transparency."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pitstop.shimctl import layout as L

from .helpers import WORKLOADS

ROOT = Path(__file__).resolve().parent.parent
SHIM = ROOT / "shim" / "build" / "libpitstop_shim.so"
pytestmark = pytest.mark.timeout(120)


def test_exports_only_nccl_names_and_wraps_the_whole_header():
    out = subprocess.run(["nm", "-D", "--defined-only", str(SHIM)], capture_output=True, text=True).stdout
    names = {ln.split()[-1] for ln in out.splitlines() if ln.strip()}
    header = (ROOT / "native" / "nccl.h").read_text().split("BEGIN API")[1].split("END API")[0]
    declared = {w.split("(")[0].split()[-1].lstrip("*") for w in header.splitlines() if "nccl" in w and "(" in w}
    assert names == declared


def test_control_block_layout_matches_the_c_compiler(tmp_path):
    src = tmp_path / "l.c"
    src.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "ctl.h"\nint main(void){printf("%zu %zu %zu %zu '
                   '%zu %zu %zu %zu %zu %zu %zu\\n", sizeof(struct pitstop_ctl), offsetof(struct pitstop_ctl, request), '
                   'offsetof(struct pitstop_ctl, command), offsetof(struct pitstop_ctl, command_seq), '
                   'offsetof(struct pitstop_ctl, comms), sizeof(struct pitstop_comm_ctl), '
                   'offsetof(struct pitstop_comm_ctl, newid_set), offsetof(struct pitstop_comm_ctl, newid), '
                   'offsetof(struct pitstop_comm_ctl, sent), offsetof(struct pitstop_comm_ctl, recv_target), '
                   'offsetof(struct pitstop_ctl, trail_n));}\n')
    subprocess.run(["cc", "-I", str(ROOT / "shim"), str(src), "-o", str(tmp_path / "l")], check=True)
    got = [int(x) for x in subprocess.run([str(tmp_path / "l")], capture_output=True, text=True).stdout.split()]
    assert got == [L.SIZE, L.OFF_REQUEST, L.OFF_COMMAND, L.OFF_COMMAND_SEQ, L.HEADER.size, L.COMM.size,
                   L.COMM_OFF_NEWID_SET, L.COMM_OFF_NEWID, L.COMM_OFF_SENT, L.COMM_OFF_RECV_TARGET, L.OFF_TAIL]


@pytest.mark.parametrize("script,nonblocking", [("nccl_dp.py", "0"), ("nccl_tp_dp.py", "0"), ("nccl_pipeline.py", "0"),
                                                ("nccl_tp_dp.py", "1")])
def test_transparent_same_results_with_and_without_the_shim(script, nonblocking):
    """nonblocking=1: communicators made with config.blocking = 0 (init and split answer
    ncclInProgress and are polled through ncclCommGetAsyncError), as PyTorch can make them."""
    outs = []
    for preload in ("", str(SHIM)):
        with tempfile.TemporaryDirectory() as d:
            rdv, out = Path(d) / "r", Path(d) / "o"
            rdv.mkdir()
            env = dict(os.environ, LD_LIBRARY_PATH=str(ROOT / "native" / "build"), PYTHONPATH=str(WORKLOADS),
                       HOSTNCCL_ADDR="127.0.0.1", WORLD_SIZE="4", LD_PRELOAD=preload, NCCLPY_NONBLOCKING=nonblocking)
            ps = [subprocess.Popen([sys.executable, str(WORKLOADS / script), "--steps", "20", "--step-sleep", "0",
                                    "--rendezvous", str(rdv), "--out", str(out)], env=dict(env, RANK=str(r)))
                  for r in range(4)]
            assert [p.wait(100) for p in ps] == [0] * 4
            outs.append([(out / f"rank{r}.sha256").read_text() for r in range(4)])
    assert outs[0] == outs[1]


def test_finds_an_nccl_loaded_in_a_local_scope_as_pytorch_loads_it():
    """libtorch_cuda.so brings libnccl.so.2 into a local scope, out of dlsym(RTLD_NEXT)'s reach
    (seen on a GPU host: every call failed).  The shim finds the loaded library itself."""
    outs = []
    for scope, preload in (("global", ""), ("local", str(SHIM))):
        with tempfile.TemporaryDirectory() as d:
            rdv, out = Path(d) / "r", Path(d) / "o"
            rdv.mkdir()
            env = dict(os.environ, LD_LIBRARY_PATH=str(ROOT / "native" / "build"), PYTHONPATH=str(WORKLOADS),
                       HOSTNCCL_ADDR="127.0.0.1", WORLD_SIZE="2", LD_PRELOAD=preload, NCCLPY_SCOPE=scope)
            ps = [subprocess.Popen([sys.executable, str(WORKLOADS / "nccl_dp.py"), "--steps", "10", "--step-sleep",
                                    "0", "--rendezvous", str(rdv), "--out", str(out)], env=dict(env, RANK=str(r)),
                                   stderr=subprocess.PIPE, text=True)
                  for r in range(2)]
            errs = [p.communicate(timeout=100)[1] for p in ps]
            assert [p.returncode for p in ps] == [0, 0], errs
            assert not any("no NCCL library" in e for e in errs), errs
            outs.append([(out / f"rank{r}.sha256").read_text() for r in range(2)])
    assert outs[0] == outs[1]


def test_without_any_nccl_calls_fail_with_a_message_never_a_null_string(tmp_path):
    """No libnccl at all: every call returns an error, a string call returns the reason
    (PyTorch builds std::string from it; NULL aborted the job on a GPU host), said once."""
    prog = ("import ctypes; api = ctypes.CDLL(None); api.ncclGetErrorString.restype = ctypes.c_char_p; "
            "api.ncclGetLastError.restype = ctypes.c_char_p; v = ctypes.c_int(); "
            "print(api.ncclGetVersion(ctypes.byref(v)), api.ncclGetVersion(ctypes.byref(v))); "
            "print(api.ncclGetErrorString(0).decode()); print(api.ncclGetLastError(None).decode())")
    p = subprocess.run([sys.executable, "-c", prog], env=dict(os.environ, LD_PRELOAD=str(SHIM)),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "2 2"  # ncclSystemError, both times
    assert all("no NCCL library found" in ln and "PITSTOP_NCCL_LIBRARY" in ln for ln in lines[1:])
    assert p.stderr.count("no NCCL library found") == 1 and "PITSTOP_NCCL_LIBRARY" in p.stderr


def test_a_communicator_the_shim_did_not_make_passes_through_and_is_counted():
    """A handle from an NCCL function the shim does not wrap goes to NCCL unchanged (the job
    runs as without the shim), is counted in the control block (a cut then refuses to move
    the job) and is named once per call on stderr."""
    # The real library's own handle: a communicator made behind the shim's back.
    prog = ("import ctypes, ncclpy; from pitstop.shimctl import blocks; real = ncclpy.lib; uid = ncclpy.UniqueId(); "
            "real.ncclGetUniqueId(ctypes.byref(uid)); c = ctypes.c_void_p(); "
            "real.ncclCommInitRank.argtypes = [ctypes.c_void_p, ctypes.c_int, ncclpy.UniqueId, ctypes.c_int]; "
            "assert real.ncclCommInitRank(ctypes.byref(c), 1, uid, 0) == 0; n = ctypes.c_int(); e = ctypes.c_int(); "
            "api = ncclpy.api; api.ncclCommCount.argtypes = [ctypes.c_void_p, ctypes.c_void_p]; "
            "print(api.ncclCommCount(c, ctypes.byref(n)), api.ncclCommCount(c, ctypes.byref(n)), n.value, "
            "api.ncclCommGetAsyncError(c, ctypes.byref(e))); import os; "
            "print(blocks(os.getpid())[0].view()['foreign'])")
    p = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, LD_PRELOAD=str(SHIM), LD_LIBRARY_PATH=str(ROOT / "native" / "build"),
                                PYTHONPATH=f"{WORKLOADS}:{ROOT / 'service'}", HOSTNCCL_ADDR="127.0.0.1"))
    assert p.returncode == 0, p.stderr
    first, second = p.stdout.splitlines()
    assert first.split() == ["0", "0", "1", "0"]  # answered by NCCL itself
    assert int(second) >= 3  # 3 calls here, and host NCCL's own check at the end of its init
    assert p.stderr.count("ncclCommCount was given a communicator the shim did not create") == 1
    assert p.stderr.count("ncclCommGetAsyncError was given a communicator the shim did not create") == 1


def test_nccl_calling_its_own_api_is_not_a_foreign_communicator():
    """NCCL's blocking init asks ncclCommGetAsyncError about the new communicator through
    the PLT, and the preloaded shim answers first (seen on an H200 with NCCL 2.28.9: the cut
    then refused a healthy PyTorch job).  Host NCCL makes the same call; the shim must pass
    it through without counting it."""
    prog = ("import ncclpy, os; from pitstop.shimctl import blocks; "
            "c = ncclpy.init(1, ncclpy.share_id(os.environ['UID_FILE'], 0), 0); s = ncclpy.split(c, 0, 0); "
            "print(blocks(os.getpid())[0].view()['foreign'])")
    with tempfile.TemporaryDirectory() as d:
        p = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, LD_PRELOAD=str(SHIM), LD_LIBRARY_PATH=str(ROOT / "native" / "build"),
                                    PYTHONPATH=f"{WORKLOADS}:{ROOT / 'service'}", HOSTNCCL_ADDR="127.0.0.1",
                                    UID_FILE=str(Path(d) / "uid")))
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["0"]
    assert "did not create" not in p.stderr


def test_a_call_the_nccl_behind_lacks_fails_with_a_reason():
    """Host NCCL has no ncclAlltoAll: the wrapper answers ncclInvalidUsage and says so, not a crash."""
    prog = ("import ctypes, ncclpy; api = ncclpy.api; api.ncclAlltoAll.argtypes = [ctypes.c_void_p] * 6; "
            "print(api.ncclAlltoAll(None, None, 0, 0, None, None))")
    p = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, LD_PRELOAD=str(SHIM), LD_LIBRARY_PATH=str(ROOT / "native" / "build"),
                                PYTHONPATH=str(WORKLOADS), HOSTNCCL_ADDR="127.0.0.1"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["5"]  # ncclInvalidUsage
    assert "has no ncclAlltoAll" in p.stderr


def test_config_smaller_than_ours_is_never_read_past_its_size():
    """An older, smaller ncclConfig_t (NVIDIA/nccl#2347): 16 bytes that end at a guard page."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(ROOT / "native" / "build"), PYTHONPATH=str(WORKLOADS),
               HOSTNCCL_ADDR="127.0.0.1", LD_PRELOAD=str(SHIM))
    p = subprocess.run([sys.executable, str(WORKLOADS / "nccl_small_config.py")], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "ok", (p.returncode, p.stderr[-500:])


@pytest.mark.timeout(180)
@pytest.mark.skipif(os.geteuid() != 0, reason="reads and writes other processes' memory (root)")
@pytest.mark.slow
def test_ranks_resume_by_themselves_when_the_agent_vanishes(tmp_path):
    """A quiesce is raised and then nobody ever speaks again: every rank parks, waits out
    PITSTOP_SHIM_DEADLINE_S and carries on; the job ends exactly as if nothing happened."""
    import time

    from pitstop import shimctl

    def run(preload_deadline: str | None) -> tuple[list[str], float]:
        rdv, out = tmp_path / f"r{preload_deadline}", tmp_path / f"o{preload_deadline}"
        rdv.mkdir()
        env = dict(os.environ, LD_LIBRARY_PATH=str(ROOT / "native" / "build"), PYTHONPATH=str(WORKLOADS),
                   HOSTNCCL_ADDR="127.0.0.1", WORLD_SIZE="4", LD_PRELOAD=str(SHIM),
                   PITSTOP_SHIM_DEADLINE_S=preload_deadline or "300")
        ps = [subprocess.Popen([sys.executable, str(WORKLOADS / "nccl_dp.py"), "--steps", "150", "--step-sleep",
                                "0.01", "--rendezvous", str(rdv), "--out", str(out)], env=dict(env, RANK=str(r)))
              for r in range(4)]
        parked_for = 0.0
        if preload_deadline:
            end = time.monotonic() + 30
            while time.monotonic() < end and not all(shimctl.blocks(p.pid) and shimctl.blocks(p.pid)[0].comms
                                                     for p in ps):
                time.sleep(0.05)
            for p in ps:
                for b in shimctl.blocks(p.pid):
                    shimctl.quiesce(b, 7)          # ... and then the "agent" is gone
            t0 = time.monotonic()
            while time.monotonic() - t0 < 10:
                states = [b.view()["state"] for p in ps for b in shimctl.blocks(p.pid)]
                if states and all(s == "parked" for s in states):
                    break
                time.sleep(0.02)
            assert all(s == "parked" for s in states), states
            while any(b.view()["state"] == "parked" for p in ps for b in shimctl.blocks(p.pid)):
                time.sleep(0.05)
            parked_for = time.monotonic() - t0
        assert [p.wait(120) for p in ps] == [0] * 4
        return [(out / f"rank{r}.sha256").read_text() for r in range(4)], parked_for

    hashes, parked = run("2")
    # Each rank waits out its own deadline from when it parked; a rank blocked inside a
    # collective parks only after a peer timed out, so the waits can follow each other:
    # at most about deadline x ranks, plus a loaded machine's slack.
    assert 1.5 < parked < 4 * 2 + 12, parked
    assert hashes == run(None)[0]
