"""The shim on its own: ABI hygiene, layout agreement with the agent, transparency."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pitstop.shimctl import layout as L

from . import nccl_builds
from .helpers import WORKLOADS, until

ROOT = Path(__file__).resolve().parent.parent
SHIM = ROOT / "shim" / "build" / "libpitstop_shim.so"
pytestmark = pytest.mark.timeout(120)


def test_exports_only_nccl_names_and_the_loaders_lookups_and_wraps_the_whole_header():
    """NCCL's names, and dlsym and dlvsym (shim/dl.c), unversioned so that they stand in for libc's
    versioned ones (a program's reference to dlsym@GLIBC_2.34 binds to the preloaded shim)."""
    out = subprocess.run(["nm", "-D", "--defined-only", "--with-symbol-versions", str(SHIM)], capture_output=True,
                         text=True).stdout
    names = {ln.split()[-1] for ln in out.splitlines() if ln.strip()}
    header = (ROOT / "native" / "nccl.h").read_text().split("BEGIN API")[1].split("END API")[0]
    declared = {w.split("(")[0].split()[-1].lstrip("*") for w in header.splitlines() if "nccl" in w and "(" in w}
    assert names == declared | {"dlsym", "dlvsym"}


def test_control_block_layout_matches_the_c_compiler(tmp_path):
    src = tmp_path / "l.c"
    src.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "ctl.h"\nint main(void){printf("%zu %zu %zu %zu '
                   '%zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu\\n", sizeof(struct pitstop_ctl), offsetof(struct pitstop_ctl, request), '
                   'offsetof(struct pitstop_ctl, command), offsetof(struct pitstop_ctl, command_seq), '
                   'offsetof(struct pitstop_ctl, comms), sizeof(struct pitstop_comm_ctl), '
                   'offsetof(struct pitstop_comm_ctl, newid_set), offsetof(struct pitstop_comm_ctl, newid), '
                   'offsetof(struct pitstop_comm_ctl, sent), offsetof(struct pitstop_comm_ctl, recv_target), '
                   'offsetof(struct pitstop_ctl, trail_n), offsetof(struct pitstop_ctl, refused), '
                   'offsetof(struct pitstop_ctl, protect), offsetof(struct pitstop_ctl, lost_ns), '
                   'offsetof(struct pitstop_comm_ctl, want_id));}\n')
    subprocess.run(["cc", "-I", str(ROOT / "shim"), str(src), "-o", str(tmp_path / "l")], check=True)
    got = [int(x) for x in subprocess.run([str(tmp_path / "l")], capture_output=True, text=True).stdout.split()]
    assert got == [L.SIZE, L.OFF_REQUEST, L.OFF_COMMAND, L.OFF_COMMAND_SEQ, L.HEADER.size, L.COMM.size,
                   L.COMM_OFF_NEWID_SET, L.COMM_OFF_NEWID, L.COMM_OFF_SENT, L.COMM_OFF_RECV_TARGET, L.OFF_TAIL,
                   L.OFF_REFUSED, L.OFF_PROTECT, L.OFF_LOST + 16, L.COMM_OFF_WANT_ID]


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


def test_a_communicator_the_shim_did_not_make_passes_through_and_is_counted(tmp_path):
    """A handle the shim did not make (here from NCCL linked into another library, which the shim
    cannot stand in front of) goes to NCCL unchanged when it reaches the shim's API (the job runs as
    without the shim), is counted in the control block (a cut then refuses to move the job) and is
    named once per call on stderr: the backstop behind what dl.c can see."""
    trainer = nccl_builds.static_nccl_library(tmp_path)
    prog = ("import ctypes, os, ncclpy; from pitstop.shimctl import blocks; "
            f"real = ctypes.CDLL({str(trainer)!r}, mode=os.RTLD_LOCAL); uid = ncclpy.UniqueId(); "
            "real.ncclGetUniqueId(ctypes.byref(uid)); c = ctypes.c_void_p(); "
            "real.ncclCommInitRank.argtypes = [ctypes.c_void_p, ctypes.c_int, ncclpy.UniqueId, ctypes.c_int]; "
            "assert real.ncclCommInitRank(ctypes.byref(c), 1, uid, 0) == 0; n = ctypes.c_int(); e = ctypes.c_int(); "
            "api = ncclpy.api; api.ncclCommCount.argtypes = [ctypes.c_void_p, ctypes.c_void_p]; "
            "print(api.ncclCommCount(c, ctypes.byref(n)), api.ncclCommCount(c, ctypes.byref(n)), n.value, "
            "api.ncclCommGetAsyncError(c, ctypes.byref(e))); "
            "print(blocks(os.getpid())[0].view()['foreign'])")
    p = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, LD_PRELOAD=str(SHIM), LD_LIBRARY_PATH=str(ROOT / "native" / "build"),
                                PYTHONPATH=f"{WORKLOADS}:{ROOT / 'service'}", HOSTNCCL_ADDR="127.0.0.1"))
    assert p.returncode == 0, p.stderr
    first, second = p.stdout.splitlines()
    assert first.split() == ["0", "0", "1", "0"]  # answered by NCCL itself
    assert int(second) == 3  # the 3 calls here (the library's own calls stay inside it: -Bsymbolic)
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


# -- every way a program reaches NCCL (shim/dl.c) ---------------------------------------------------

def _ranks(cmd: list[str], world: int, env: dict[str, str], preload: str, probe=None, steps: int = 200):  # noqa: ANN001, ANN202
    """`world` ranks of cmd over the host NCCL, run to their end; probe(pids), if given, once every
    rank's shim has a communicator with an operation counted.  (final hashes, probe's answer, stderrs)"""
    with tempfile.TemporaryDirectory() as d:
        rdv, out = Path(d) / "r", Path(d) / "o"
        rdv.mkdir()
        e = dict(os.environ, LD_LIBRARY_PATH=str(ROOT / "native" / "build"), PYTHONPATH=str(WORKLOADS),
                 HOSTNCCL_ADDR="127.0.0.1", WORLD_SIZE=str(world), LD_PRELOAD=preload, **env)
        ps = [subprocess.Popen([*cmd, "--steps", str(steps), "--step-sleep", "0.01" if probe else "0",
                                "--rendezvous", str(rdv), "--out", str(out)], env=dict(e, RANK=str(r)),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(world)]
        seen = None
        try:
            if probe:
                from pitstop import shimctl
                until(lambda: all(any(c["issued"] for b in shimctl.blocks(p.pid) for c in b.comms) for p in ps),
                      timeout=60, what="every rank's shim counting operations")
                seen = probe([p.pid for p in ps])
            errs = [p.communicate(timeout=120)[1] for p in ps]
        finally:
            for p in ps:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert [p.returncode for p in ps] == [0] * world, errs
        return [(out / f"rank{r}.sha256").read_text() for r in range(world)], seen, errs


def _blocks(pids: list[int]) -> list[dict]:
    from pitstop import shimctl
    return [{"comms": [c["kind"] for c in b.view()["comms"]], "foreign": b.view()["foreign"],
             "refused": b.view()["refused"],
             "libnccl": sorted({ln.split()[-1] for ln in Path(f"/proc/{pid}/maps").read_text().splitlines()
                                if "libnccl.so" in ln})}
            for pid in pids for b in shimctl.blocks(pid)]


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("nccl_builds")
    return {"fsdp": nccl_builds.fsdp_program(d), "fsdp_dlopen": nccl_builds.fsdp_program(d, dlopen=True),
            "plugin": nccl_builds.plugin_library(d), "copy": nccl_builds.nccl_copy(d / "other"),
            "trainer": nccl_builds.static_nccl_library(d), "versioned": nccl_builds.versioned_nccl(d / "versioned")}


PLUGIN_DRIVER = ("import ctypes, hashlib, os, sys; a = dict(zip(sys.argv[1::2], sys.argv[2::2])); "
                 "lib = ctypes.CDLL(os.environ['PLUGIN'], mode=os.RTLD_LOCAL | os.RTLD_DEEPBIND); "
                 "lib.plugin_train.restype = ctypes.c_uint64; "
                 "lib.plugin_train.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int, "
                 "ctypes.c_double]; h = lib.plugin_train(int(os.environ['RANK']), int(os.environ['WORLD_SIZE']), "
                 "a['--rendezvous'].encode(), int(a['--steps']), float(a['--step-sleep'])); assert h; "
                 "os.makedirs(a['--out'], exist_ok=True); "
                 "open(os.path.join(a['--out'], 'rank%s.sha256' % os.environ['RANK']), 'w').write('%x' % h)")


@pytest.mark.timeout(300)
@pytest.mark.slow  # each route runs its program twice, 2 s with the shim
@pytest.mark.skipif(os.geteuid() != 0, reason="reads other processes' control blocks (root)")
@pytest.mark.parametrize("route", ["ctypes_soname", "ctypes_path_beside_soname", "dlopen_local", "dlopen_deepbind",
                                   "plugin_deepbind", "plugin_deepbind_bind_now", "libnccl_preloaded_first"])
def test_every_way_a_program_reaches_nccl_is_seen(route, builds):
    """Each route a program can take to NCCL without the PLT of a normal link: its communicators
    (a world and a split) are the shim's, every operation counted, nothing foreign or refused, and
    the results are those of the same program without the shim.
    - ctypes.CDLL of libnccl by soname, or of a copy by full path beside the one found by soname
      (two copies of NCCL in one process, a communicator table each);
    - a C program's dlopen with RTLD_LOCAL, or RTLD_DEEPBIND, and dlsym;
    - a plugin with its own link to libnccl loaded with RTLD_DEEPBIND (its references bind in its own
      scope, past the shim, unless the shim binds them first), lazily or with LD_BIND_NOW;
    - libnccl preloaded ahead of the shim (the program's references bind to it first)."""
    py = [sys.executable, str(WORKLOADS / "nccl_ctypes.py")]
    env: dict[str, str] = {}
    preload_first = ""
    if route == "ctypes_soname":
        cmd, comms = py, ["init", "split"]
    elif route == "ctypes_path_beside_soname":
        cmd, comms = py, ["init", "split", "init"]
        env = {"NCCL_SO_PATH": str(builds["copy"]), "NCCL_ALSO_SONAME": "1"}
    elif route.startswith("dlopen_"):
        cmd, comms = [str(builds["fsdp_dlopen"]), "--dlopen", route.split("_")[1]], ["init", "split"]
    elif route.startswith("plugin_"):
        cmd, comms = [sys.executable, "-c", PLUGIN_DRIVER], ["init", "split"]
        env = {"PLUGIN": str(builds["plugin"]), **({"LD_BIND_NOW": "1"} if route.endswith("bind_now") else {})}
    else:
        cmd, comms = [str(builds["fsdp"])], ["init", "split"]
        preload_first = str(ROOT / "native" / "build" / "libnccl.so.2") + ":"
    plain, _, _ = _ranks(cmd, 2, env, preload_first)
    shimmed, blocks, errs = _ranks(cmd, 2, env, preload_first + str(SHIM), probe=_blocks)
    assert shimmed == plain
    assert [b["comms"] for b in blocks] == [comms] * 2, blocks
    assert all(b["foreign"] == 0 and b["refused"] is None for b in blocks), blocks
    if route == "ctypes_path_beside_soname":
        assert all(b["libnccl"] == sorted([str(ROOT / "native" / "build" / "libnccl.so.2"), str(builds["copy"])])
                   for b in blocks), blocks
    assert not any("pitstop shim" in e for e in errs), errs


def test_dlsym_answers_for_the_programs_own_call_site(tmp_path):
    """RTLD_NEXT is relative to the caller: the shim's dlsym hands it to libc's by a tail call, so an
    interposer preloaded ahead of another (and of the shim) still finds the next one, not what
    follows the shim.  A program asking for an NCCL name through RTLD_DEFAULT or RTLD_NEXT gets the
    shim's wrapper (the shim is preloaded: next after the program, first in the global scope)."""
    src = {"next_a": 'int which(void) { int (*n)(void) = dlsym(RTLD_NEXT, "which"); return n ? 100 + n() : -1; }',
           "next_b": "int which(void) { return 2; }"}
    for name, body in src.items():
        (tmp_path / f"{name}.c").write_text("#define _GNU_SOURCE\n#include <dlfcn.h>\n" + body + "\n")
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / f"lib{name}.so"), str(tmp_path / f"{name}.c"),
                        "-ldl"], check=True, timeout=60)
    (tmp_path / "ask.c").write_text(
        '#define _GNU_SOURCE\n#include <dlfcn.h>\n#include <stdio.h>\n#include <string.h>\n'
        'static const char *where(void *p) { Dl_info i; return p && dladdr(p, &i) && strstr(i.dli_fname, "pitstop_shim")'
        ' ? "shim" : p ? "elsewhere" : "none"; }\n'
        'int main(void) { printf("%s %s\\n", where(dlsym(RTLD_DEFAULT, "ncclAllReduce")), '
        'where(dlsym(RTLD_NEXT, "ncclAllReduce"))); return 0; }\n')
    subprocess.run(["cc", "-o", str(tmp_path / "ask"), str(tmp_path / "ask.c"), f"-L{ROOT / 'native' / 'build'}",
                    "-Wl,--no-as-needed", "-l:libnccl.so.2", "-ldl"], check=True, timeout=60)
    answers = []
    for shim in ("", str(SHIM)):
        preload = ":".join(x for x in (str(tmp_path / "libnext_a.so"), str(tmp_path / "libnext_b.so"), shim) if x)
        env = dict(os.environ, LD_PRELOAD=preload, LD_LIBRARY_PATH=str(ROOT / "native" / "build"))
        p = subprocess.run([sys.executable, "-c", "import ctypes; print(ctypes.CDLL(None).which())"],
                           capture_output=True, text=True, timeout=60, env=env)
        q = subprocess.run([str(tmp_path / "ask")], capture_output=True, text=True, timeout=60,
                           env=dict(env, LD_PRELOAD=shim))
        assert p.returncode == 0 and q.returncode == 0, p.stderr + q.stderr
        answers.append((p.stdout.strip(), q.stdout.strip()))
    assert answers == [("102", "elsewhere elsewhere"), ("102", "shim shim")]


IN_SHIM = ("def in_shim(a):\n"
           "    for ln in open('/proc/self/maps'):\n"
           "        lo, hi = (int(x, 16) for x in ln.split()[0].split('-'))\n"
           "        if lo <= a < hi:\n"
           "            return ln.rstrip().endswith('libpitstop_shim.so')\n"
           "    return False\n")


def test_dlvsym_on_a_versioned_libnccl_hands_back_the_shims_wrapper(builds):
    """An NCCL built with symbol versions, reached with dlvsym: the wrapper comes back for the version
    it has, nothing for one it lacks (as libc's answers), and what it makes is the shim's."""
    prog = (IN_SHIM + "import ctypes, os; from pitstop.shimctl import blocks; "
            f"lib = ctypes.CDLL({str(builds['versioned'])!r}, mode=os.RTLD_LOCAL); libc = ctypes.CDLL(None); "
            "libc.dlvsym.restype = ctypes.c_void_p; libc.dlvsym.argtypes = [ctypes.c_void_p] + [ctypes.c_char_p] * 2; "
            "init = libc.dlvsym(lib._handle, b'ncclCommInitRank', b'NCCL_2.29'); "
            "uid_fn = libc.dlvsym(lib._handle, b'ncclGetUniqueId', b'NCCL_2.29'); "
            "print(in_shim(init), libc.dlvsym(lib._handle, b'ncclCommInitRank', b'NCCL_9.9'), "
            "bool(libc.dlvsym(None, b'dlsym', b'GLIBC_2.34'))); "
            "U = type('U', (ctypes.Structure,), {'_fields_': [('internal', ctypes.c_ubyte * 128)]}); uid = U(); "
            "assert ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(uid_fn)(ctypes.byref(uid)) == 0; "
            "c = ctypes.c_void_p(); f = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, U, ctypes.c_int)"
            "(init); print(f(ctypes.byref(c), 1, uid, 0)); "
            "print(len(blocks(os.getpid())[0].comms))")
    p = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, LD_PRELOAD=str(SHIM), HOSTNCCL_ADDR="127.0.0.1",
                                PYTHONPATH=str(ROOT / "service")))
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "None", "True", "0", "1"], p.stdout + p.stderr


def test_nccl_inside_another_library_makes_the_process_unmovable_with_the_reason(builds):
    """NCCL linked into another library (its calls bound inside it) is what the shim cannot stand in
    front of: seen when the library is loaded, reported with what to do, and the job still runs."""
    prog = ("import ctypes, os; from pitstop import shimctl; import ncclpy; "
            "c = ncclpy.init(1, ncclpy.share_id(os.environ['UID_FILE'], 0), 0); "
            f"t = ctypes.CDLL({str(builds['trainer'])!r}, mode=os.RTLD_LOCAL); v = ctypes.c_int(); "
            "assert t.ncclGetVersion(ctypes.byref(v)) == 0; print(shimctl.unmovable(os.getpid()))")
    with tempfile.TemporaryDirectory() as d:
        p = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, LD_PRELOAD=str(SHIM), LD_LIBRARY_PATH=str(ROOT / "native" / "build"),
                                    PYTHONPATH=f"{WORKLOADS}:{ROOT / 'service'}", HOSTNCCL_ADDR="127.0.0.1",
                                    UID_FILE=str(Path(d) / "uid")))
    assert p.returncode == 0, p.stderr
    why = p.stdout.strip()
    assert why.startswith(f"NCCL is inside {builds['trainer']} (soname libtrainer.so)"), why
    assert "link it against libnccl.so.2" in why and "PITSTOP_NCCL_LIBRARY" in why, why
    assert p.stderr.count("NCCL is inside") == 1


def test_a_call_that_leaves_state_only_in_the_real_communicator_makes_the_process_unmovable():
    """ncclCommRegister: the registration lives in the real communicator, which a move re-creates
    without it.  The call works; the process is unmovable, and says which call made it so."""
    prog = ("import ctypes, os; from pitstop import shimctl; import ncclpy; api = ncclpy.api; "
            "c = ncclpy.init(1, ncclpy.share_id(os.environ['UID_FILE'], 0), 0); print(shimctl.unmovable(os.getpid())); "
            "buf = ctypes.create_string_buffer(4096); h = ctypes.c_void_p(); "
            "api.ncclCommRegister.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]; "
            "api.ncclCommDeregister.argtypes = [ctypes.c_void_p, ctypes.c_void_p]; "
            "print(api.ncclCommRegister(c, buf, 4096, ctypes.byref(h)), api.ncclCommDeregister(c, h)); "
            "print(shimctl.unmovable(os.getpid()))")
    with tempfile.TemporaryDirectory() as d:
        p = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, LD_PRELOAD=str(SHIM), LD_LIBRARY_PATH=str(ROOT / "native" / "build"),
                                    PYTHONPATH=f"{WORKLOADS}:{ROOT / 'service'}", HOSTNCCL_ADDR="127.0.0.1",
                                    UID_FILE=str(Path(d) / "uid")))
    assert p.returncode == 0, p.stderr
    before, calls, after = p.stdout.splitlines()
    assert before == "None" and calls.split() == ["0", "0"]
    assert after.startswith("the program called ncclCommRegister: a buffer registration lives in the real "
                            "communicator"), after


def test_the_table_of_nccl_calls_in_the_architecture_document_is_the_generated_one():
    """docs/architecture.md carries shim/gen_wrappers.py's table of every call in native/nccl.h: what
    the shim does with it and why; the wrappers are generated from the same entries."""
    got = subprocess.run([sys.executable, str(ROOT / "shim" / "gen_wrappers.py"), str(ROOT / "native" / "nccl.h"),
                          "--table"], capture_output=True, text=True, timeout=60, check=True).stdout
    doc = (ROOT / "docs" / "architecture.md").read_text()
    begin, end = "<!-- BEGIN nccl-calls (shim/gen_wrappers.py --table) -->\n", "<!-- END nccl-calls -->"
    assert begin in doc and end in doc, "docs/architecture.md lacks the table's markers"
    assert doc.split(begin, 1)[1].split(end, 1)[0] == got, "regenerate it: python3 shim/gen_wrappers.py native/nccl.h --table"


# -- a peer's failure, in a job that snapshots protect (shim/ctl.h version 4) --------------------------

def _pair(tmp_path: Path, deadline: str, steps: int = 3000) -> list[subprocess.Popen]:
    """Two ranks of nccl_dp.py with the shim, stepping slowly, the lost-peer deadline given."""
    rdv = tmp_path / "rdv"
    rdv.mkdir()
    env = dict(os.environ, LD_LIBRARY_PATH=str(ROOT / "native" / "build"), PYTHONPATH=str(WORKLOADS),
               HOSTNCCL_ADDR="127.0.0.1", WORLD_SIZE="2", LD_PRELOAD=str(SHIM),
               PITSTOP_SHIM_LOST_PEER_DEADLINE_S=deadline)
    return [subprocess.Popen([sys.executable, str(WORKLOADS / "nccl_dp.py"), "--steps", str(steps), "--step-sleep",
                              "0.01", "--rendezvous", str(rdv), "--out", str(tmp_path / "out")],
                             env=dict(env, RANK=str(r)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for r in range(2)]


def _lost(pid: int) -> dict | None:
    from pitstop import shimctl
    bs = shimctl.blocks(pid)
    return bs[0].view()["lost"] if bs else None


@pytest.mark.skipif(os.geteuid() != 0, reason="reads and writes other processes' memory (root)")
def test_a_protected_rank_parks_on_a_peers_failure_and_gets_the_error_at_its_deadline(tmp_path):
    """The agent says a committed snapshot covers the job; then a peer dies (SIGKILL: its connections
    close, and the surviving rank's all-reduce fails with ncclRemoteError).  The survivor does not
    end: it parks in the shim, alive, its block saying which call failed with which error and until
    when, for the job's recovery to roll it back.  No recovery comes here: at the deadline the error
    reaches the program, which ends as it would have without pitstop, and the shim says why."""
    import time

    from pitstop import shimctl

    ps = _pair(tmp_path, deadline="4")
    try:
        until(lambda: all(shimctl.blocks(p.pid) and any(c["issued"] for c in shimctl.blocks(p.pid)[0].comms)
                          for p in ps), timeout=60, what="both ranks' shims counting operations")
        for p in ps:
            hs = shimctl.headers(p.pid)
            assert [h.protect for h in hs] == [0]  # a version-4 block, nothing said yet
            assert shimctl.protect(hs, 7) == 1
        assert [b.view()["protect"] for p in ps for b in shimctl.blocks(p.pid)] == [7, 7]
        ps[1].kill()
        ps[1].wait(10)
        lost = until(lambda: _lost(ps[0].pid), timeout=30, what="rank 0 parked on its lost peer")
        assert lost["state"] == "parked" and lost["call"] == "ncclAllReduce" and lost["comm"] == 0, lost
        assert lost["error"] == "ncclRemoteError" and round(lost["until"] - lost["since"]) == 4, lost
        assert ps[0].poll() is None, "parked, not ended"
        said = shimctl.peer_lost(shimctl.headers(ps[0].pid))
        assert said and said.startswith("parked on a peer's failure: ncclAllReduce on communicator 0 returned "
                                        "ncclRemoteError"), said
        t0 = time.monotonic()
        err = ps[0].communicate(timeout=60)[1]
        assert ps[0].returncode != 0 and time.monotonic() - t0 < 30
        assert "ncclAllReduce failed: 6" in err, err[-2000:]  # the program's own error, as without the shim
        assert "the rank waited 4 s (PITSTOP_SHIM_LOST_PEER_DEADLINE_S) for the job's recovery" in err, err[-2000:]
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="reads and writes other processes' memory (root)")
def test_an_unprotected_rank_gets_a_peers_failure_at_once():
    """No snapshot covers the job (the agent never set `protect`): the error goes to the program at
    once, as without the shim; nothing is held back."""
    with tempfile.TemporaryDirectory() as d:
        ps = _pair(Path(d), deadline="60")
        try:
            from pitstop import shimctl
            until(lambda: all(shimctl.blocks(p.pid) and any(c["issued"] for c in shimctl.blocks(p.pid)[0].comms)
                              for p in ps), timeout=60, what="both ranks' shims counting operations")
            ps[1].kill()
            ps[1].wait(10)
            err = ps[0].communicate(timeout=30)[1]  # well inside the 60 s it would have been held
            assert ps[0].returncode != 0 and "ncclAllReduce failed: 6" in err, err[-2000:]
            assert "pitstop shim" not in err, err[-2000:]
        finally:
            for p in ps:
                if p.poll() is None:
                    p.kill()
                    p.wait()


ASYNC_POLLER = """
import ctypes, os, sys
import ncclpy
api = ncclpy.api
rank = int(os.environ["RANK"])
c = ncclpy.init(2, ncclpy.share_id(os.environ["UID_FILE"], rank), rank)
x = ncclpy.np.ones(4, dtype=ncclpy.np.float32)
ncclpy.allreduce(c, x)
if rank == 1:
    os._exit(0)  # the peer is gone: its connections close
r = api.ncclAllReduce(ncclpy._p(x), ncclpy._p(x), 4, ncclpy.FLOAT32, ncclpy.SUM, c, None)
print("allreduce", r, flush=True)  # not yet protected: the error, at once
sys.stdin.readline()  # the test protects the rank, then says go
e = ctypes.c_int(-1)
print("poll", api.ncclCommGetAsyncError(c, ctypes.byref(e)), e.value, flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="reads and writes other processes' memory (root)")
def test_an_async_error_poll_parks_too_and_a_withdrawn_protection_hands_the_error_on_at_once(tmp_path):
    """PyTorch's watchdog learns of a peer's failure from ncclCommGetAsyncError and aborts the
    process: the poll parks like an operation.  The job's snapshots are dropped meanwhile (its
    recovery failed, or an operator dropped them), the agent clears `protect`, and the held error
    reaches the program at once, not at the deadline."""
    from pitstop import shimctl

    env = dict(os.environ, LD_LIBRARY_PATH=str(ROOT / "native" / "build"), PYTHONPATH=str(WORKLOADS),
               HOSTNCCL_ADDR="127.0.0.1", LD_PRELOAD=str(SHIM), UID_FILE=str(tmp_path / "uid"),
               PITSTOP_SHIM_LOST_PEER_DEADLINE_S="300")
    ps = [subprocess.Popen([sys.executable, "-c", ASYNC_POLLER], env=dict(env, RANK=str(r)), stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        assert ps[1].wait(60) == 0
        assert ps[0].stdout.readline().split() == ["allreduce", "6"]
        assert shimctl.protect(shimctl.headers(ps[0].pid), 3) == 1
        ps[0].stdin.write("go\n")
        ps[0].stdin.flush()
        lost = until(lambda: _lost(ps[0].pid), timeout=30, what="the poll parked")
        assert lost["state"] == "parked" and lost["call"] == "ncclCommGetAsyncError", lost
        assert lost["error"] == "ncclRemoteError" and lost["comm"] == 0, lost
        assert ps[0].poll() is None
        assert shimctl.protect(shimctl.headers(ps[0].pid), 0) == 1  # the job's snapshots dropped
        out, err = ps[0].communicate(timeout=30)
        assert ps[0].returncode == 0, err
        assert out.split() == ["poll", "0", "6"], out  # the call succeeds, and reports the error
        assert "the job's snapshots no longer cover it" in err and err.count("pitstop shim:") == 1, err
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
                p.wait()


# -- reduction operators the program makes (ncclRedOpCreatePreMulSum) ---------------------------------

def _rebuild_in_place(pids: list[int], times: int = 2) -> list:
    """The cut, the real communicators destroyed, fresh unique ids, every communicator rebuilt and the
    ranks resumed, as a move does (less the capture), `times` over, through the control blocks; then
    what each rank's shim refused."""
    import time

    from pitstop import shimctl

    for _ in range(times):
        cut = _block_cut(pids)
        cut.quiesce()
        cut.destroy()
        cut.rewire()
        time.sleep(0.3)
    return [b.view()["refused"] for pid in pids for b in shimctl.blocks(pid)]


@pytest.mark.skipif(os.geteuid() != 0, reason="reads and writes other processes' control blocks (root)")
@pytest.mark.parametrize("mode", ["around", "kept"])
def test_reduction_operators_are_made_again_at_a_rebuild_behind_the_values_the_program_holds(mode):
    """PreMulSum operators (tests/workloads/nccl_premul.py).  'around': one made, used and destroyed
    around every all-reduce, as PyTorch does: none alive at a cut.  'kept': two kept across
    collectives, one reading its scalar from the job's memory at each collective, made after a third
    that was destroyed, so that on a new communicator NCCL numbers them differently from the values
    the job holds.  Rebuilt in place twice mid-run, the live ones made again and their values
    translated: nothing refused, and the job ends bitwise equal to the same program without the shim
    (without the translation, 'kept' would hand NCCL another operator's value, of another type)."""
    cmd, env = [sys.executable, str(WORKLOADS / "nccl_premul.py")], {"NCCLPY_PREMUL": mode}
    plain, _, _ = _ranks(cmd, 2, env, "", steps=400)
    shimmed, refused, errs = _ranks(cmd, 2, env, str(SHIM), probe=_rebuild_in_place, steps=400)
    assert shimmed == plain
    assert refused == [None, None], refused
    assert not any("pitstop shim" in e for e in errs), errs


# -- the early rewire: the ranks that stay rebuild while the leaving ones are away (CMD_PREBUILD) -------

def _block_cut(pids: list[int], deadline_s: float = 30):  # noqa: ANN202
    """A Cut over these processes' control blocks, as the agents would drive it (r0, r1, ...)."""
    from pitstop import shimctl
    from pitstop.coordinator.cut import Cut

    ws = {f"r{i}": pid for i, pid in enumerate(pids)}
    return Cut(list(ws), lambda w: [b.view() for b in shimctl.blocks(ws[w])],
               lambda w, step: shimctl.apply(ws[w], step), deadline_s=deadline_s)


def _views(cut) -> dict[str, dict]:  # noqa: ANN001
    return {w: bs[0] for w, bs in zip(cut.workers, [cut.get(w) for w in cut.workers])}


@pytest.mark.skipif(os.geteuid() != 0, reason="reads and writes other processes' control blocks (root)")
@pytest.mark.parametrize("groups,leaving", [("split", ("r2", "r3")), ("init", ("r2", "r3")), ("split", ("r0",))])
def test_an_early_rebuild_waits_in_nccls_bootstrap_until_the_leaving_ranks_join(groups, leaving):
    """The tensor x data parallel job (a world, and its pairs split from it or made with InitRank of
    their own), cut and its communicators destroyed.  The ranks that stay make the fresh ids (each
    communicator's lowest-ranked member that stays: rank 0's world id comes from rank 1 where rank 0
    leaves) and begin rebuilding on a thread of their shims: a second later they still wait in the
    bootstrap, their parked threads free.  Then the leaving ranks are told the same ids (a pair wholly
    among them gets its id from its own first member then) and everyone resumes: the job ends bitwise
    equal to the same program without the shim."""
    import time

    cmd = [sys.executable, str(WORKLOADS / "nccl_tp_dp.py")]
    env = {"NCCLPY_GROUPS": groups}
    away = set(leaving)

    def probe(pids: list[int]) -> dict:
        cut = _block_cut(pids)
        cut.quiesce()
        cut.destroy()
        ids = cut.early_ids(away)
        made = {w: sorted(c["key"] for c in v["comms"] if c["myid"]) for w, v in _views(cut).items()}
        cut.prebuild(ids, away)
        time.sleep(1.0)
        waiting = {w: (v["state"], v["done_seq"] == v["command_seq"]) for w, v in _views(cut).items()}
        joined: list[str] = []
        _, every = cut.finish_rewire(ids, on_join=lambda: joined.append("told"))
        return {"ids": ids, "made": made, "waiting": waiting, "every": every, "joined": joined,
                "world": next(c["key"] for c in cut.get("r0")[0]["comms"] if c["kind"] == "init")}

    plain, _, _ = _ranks(cmd, 4, env, "", steps=600)
    shimmed, seen, errs = _ranks(cmd, 4, env, str(SHIM), probe=probe, steps=600)
    assert shimmed == plain
    stay = sorted({"r0", "r1", "r2", "r3"} - away)
    assert seen["waiting"] == {w: ("destroyed" if w in away else "rebuilding", True) for w in sorted(seen["waiting"])}
    assert all(not seen["made"][w] for w in away), seen["made"]  # no id from a rank that leaves
    assert seen["world"] in seen["made"][stay[0]], seen  # the world's id from the lowest rank that stays
    inits = 5 if groups == "init" else 1  # init: the world and four pairs; split: the world alone
    assert len(seen["every"]) == inits and seen["joined"] == ["told"], seen
    # a pair wholly on the leaving ranks (init, r2 and r3) has no early id: its own first member made it
    assert len(seen["ids"]) == (4 if groups == "init" and away == {"r2", "r3"} else inits), seen["ids"]
    assert not any("pitstop shim" in e for e in errs), errs


@pytest.mark.skipif(os.geteuid() != 0, reason="reads and writes other processes' control blocks (root)")
def test_a_destroy_abandons_an_early_rebuild_and_the_rewire_is_redone_in_place():
    """A rollback whose sources cannot join (the ids were spent): the ranks that stay are waiting in
    their early rebuild's bootstrap; a destroy abandons it at once (the block says destroyed, the
    parked thread takes commands again), and the communicators are re-created in place with fresh
    ids while the abandoned NCCL inits are still waiting (they fail at the host NCCL's own timeout,
    and what they would have made is never installed).  The job ends bitwise equal."""
    import time

    cmd = [sys.executable, str(WORKLOADS / "nccl_tp_dp.py")]
    env = {"HOSTNCCL_TIMEOUT_S": "6"}

    def probe(pids: list[int]) -> list:
        cut = _block_cut(pids)
        cut.quiesce()
        cut.destroy()
        ids = cut.early_ids({"r3"})
        cut.prebuild(ids, {"r3"})
        before = sorted({v["state"] for w, v in _views(cut).items() if w != "r3"})
        t0 = time.monotonic()
        cut.redo()
        took = time.monotonic() - t0
        time.sleep(8)  # the abandoned inits end at the host NCCL's timeout meanwhile
        return [before, took]

    plain, _, _ = _ranks(cmd, 4, env, "", steps=1500)
    shimmed, (before, took), errs = _ranks(cmd, 4, env, str(SHIM), probe=probe, steps=1500)
    assert shimmed == plain
    assert before == ["rebuilding"], before
    assert took < 5, took  # not held by the inits it abandoned (they wait 6 s)
    assert not any("pitstop shim" in e for e in errs), errs


@pytest.mark.skipif(os.geteuid() != 0, reason="reads and writes other processes' control blocks (root)")
def test_an_early_rebuild_nobody_joins_ends_at_the_shims_deadline_with_an_error(tmp_path):
    """The agent vanishes once a rank that stays began its early rebuild: nobody joins, and NCCL's
    init would wait for its own timeout (120 s here).  The parked thread keeps the shim's deadline
    (PITSTOP_SHIM_DEADLINE_S, 3 s): it abandons the rebuild and the program gets ncclRemoteError,
    as when communicators are gone and no rebuild comes; it never waits in NCCL for good."""
    import time

    from pitstop import shimctl

    rdv = tmp_path / "rdv"
    rdv.mkdir()
    env = dict(os.environ, LD_LIBRARY_PATH=str(ROOT / "native" / "build"), PYTHONPATH=str(WORKLOADS),
               HOSTNCCL_ADDR="127.0.0.1", WORLD_SIZE="2", LD_PRELOAD=str(SHIM), PITSTOP_SHIM_DEADLINE_S="3",
               HOSTNCCL_TIMEOUT_S="120")
    ps = [subprocess.Popen([sys.executable, str(WORKLOADS / "nccl_dp.py"), "--steps", "100000", "--step-sleep",
                            "0.01", "--rendezvous", str(rdv), "--out", str(tmp_path / "out")],
                           env=dict(env, RANK=str(r)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
          for r in range(2)]
    try:
        until(lambda: all(shimctl.blocks(p.pid) and any(c["issued"] for c in shimctl.blocks(p.pid)[0].comms)
                          for p in ps), timeout=60, what="both ranks' shims counting operations")
        cut = _block_cut([p.pid for p in ps])
        cut.quiesce()
        cut.destroy()
        cut.prebuild(cut.early_ids({"r1"}), {"r1"})
        t0 = time.monotonic()
        err = ps[0].communicate(timeout=30)[1]
        assert ps[0].returncode != 0 and time.monotonic() - t0 < 15, (ps[0].returncode, err[-1000:])
        assert "the communicators' rebuild did not finish within 3 s (PITSTOP_SHIM_DEADLINE_S)" in err, err[-1000:]
        assert "ncclAllReduce failed: 6" in err, err[-1000:]  # ncclRemoteError, to the program
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)
