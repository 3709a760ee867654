"""The environment a worker starts with under `pitstop run` (launcher/run.py): the scheduler's
variables as torch.distributed reads them, less pitstop's own secrets, made dumpable (no libuv,
no io_uring), with the NCCL shim and pitstop's preloaded libraries.

Why apart from the launch: each rule is a pure function of the environment, tested alone, and
doctor.py asks the same questions (which preloads are built) without starting anything."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pitstop import nativelib
from pitstop.errors import PitstopError
from pitstop.launcher.seccomp import deny_io_uring


def shim_path() -> Path | None:
    return nativelib.built("PITSTOP_SHIM", "libpitstop_shim.so", nativelib.SHIM_DIR)


def host_nccl_dir() -> Path | None:
    p = Path(os.environ.get("PITSTOP_HOST_NCCL_DIR", nativelib.BUILD))
    return p if (p / "libnccl.so.2").exists() else None


def _preload(env: dict[str, str], lib: Path | None, missing: str) -> tuple[dict[str, str], str | None]:
    """Append `lib` to LD_PRELOAD; without it, the env as it was and the warning `missing`."""
    if lib is None:
        return env, missing
    env["LD_PRELOAD"] = ":".join(x for x in (env.get("LD_PRELOAD", ""), str(lib)) if x)
    return env, None


def procself_path() -> Path | None:
    return nativelib.built("PITSTOP_PROCSELF", "libpitstop_procself.so")


def procself_env(env: dict[str, str]) -> tuple[dict[str, str], str | None]:
    """Preload native/procself.c's fix-up: the worker is init of its own pid namespace but sees
    the host's /proc, where a path built from its own pid or tid names nobody (CUDA's cuInit
    fails with error 304 on exactly that).  Returns the env and a warning when it is missing."""
    return _preload(env, procself_path(), "native/build/libpitstop_procself.so is not built: CUDA cannot "
                                          "initialise in this worker (error 304); run `make native`")


def writetrack_path() -> Path | None:
    return nativelib.built("PITSTOP_WRITETRACK", "libpitstop_writetrack.so")


def writetrack_env(env: dict[str, str]) -> tuple[dict[str, str], str | None]:
    """Preload native/writetrack.c: the worker's half of the pre-copy's write tracking (it makes
    the userfaultfd its agent asks for).  Returns the env and a warning when it is missing."""
    return _preload(env, writetrack_path(), "native/build/libpitstop_writetrack.so is not built: a pre-copy "
                                            "of this worker hashes every page during the pause; run `make native`")


def nccl_env(env: dict[str, str], *, shim: bool, host_nccl: bool) -> dict[str, str]:
    """Preload the NCCL shim (first, so its NCCL symbols win); optionally make host NCCL the libnccl."""
    if host_nccl:
        d = host_nccl_dir()
        if d is None:
            raise PitstopError("--host-nccl: native/build/libnccl.so.2 is not built",
                               action="run `make native`, or set PITSTOP_HOST_NCCL_DIR")
        env["LD_LIBRARY_PATH"] = ":".join(x for x in (str(d), env.get("LD_LIBRARY_PATH", "")) if x)
    if shim:
        p = shim_path()
        if p is None:
            raise PitstopError("the NCCL shim is not built", action="run `make native`, or pass --no-shim")
        env["LD_PRELOAD"] = ":".join(x for x in (str(p), env.get("LD_PRELOAD", "")) if x)
    return env


SECRET_PREFIXES = ("PITSTOP_TLS_",)
SECRET_MARKS = ("TOKEN", "SECRET", "PASSWORD")


def without_secrets(env: dict[str, str]) -> dict[str, str]:
    """The worker's environment less pitstop's own credentials: the tokens (the cluster token
    amounts to root on every host) and the TLS key and certificate paths.

    Why: a worker's environment is readable in its /proc/PID/environ, copied into its image pages
    at every move, and printed by any job that logs its environment; the worker never needs them
    (the launcher talks to the agent for it).  The job's own variables pass unchanged."""
    return {k: v for k, v in env.items()
            if not (k.startswith("PITSTOP_") and (k.startswith(SECRET_PREFIXES) or any(m in k for m in SECRET_MARKS)))}


def scheduler_env(env: dict[str, str]) -> dict[str, str]:
    """Under `srun pitstop run -- python train.py`, torch.distributed's env:// finds its rank and
    world where torchrun would have put them: RANK, WORLD_SIZE and LOCAL_RANK from Slurm's
    SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID, unless they are set already."""
    for ours, slurm in (("RANK", "SLURM_PROCID"), ("WORLD_SIZE", "SLURM_NTASKS"), ("LOCAL_RANK", "SLURM_LOCALID")):
        if slurm in env and ours not in env:
            env[ours] = env[slurm]
    return env


def for_worker(extra_env: dict[str, str] | None, *, shim: bool, host_nccl: bool) -> dict[str, str]:
    """The worker's environment: the scheduler's, less pitstop's secrets, made dumpable, with the
    NCCL shim and pitstop's preloads.  PitstopError where a library asked for is missing."""
    env = scheduler_env(without_secrets(dict(os.environ)))
    env.setdefault("USE_LIBUV", "0")
    why = deny_io_uring()  # CRIU cannot dump io_uring (launcher/seccomp.py); inherited by the worker
    if why:
        print(f"pitstop run: warning: io_uring stays available to the worker ({why}); a worker that "
              "uses it cannot be moved", file=sys.stderr)
    env.update(extra_env or {})
    env = nccl_env(env, shim=shim and (host_nccl or shim_path() is not None), host_nccl=host_nccl)
    for add in (procself_env, writetrack_env):
        env, missing = add(env)
        if missing:
            print(f"pitstop run: warning: {missing}", file=sys.stderr)
    return env
