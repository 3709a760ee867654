"""NCCL programs and libraries the shim's tests build as their users would, each from sources in
tests/workloads or native/ with the system's C compiler: a C program linked to libnccl or loading
it itself, a framework plugin with its own link to it, a copy of the host NCCL at another path (or
with versioned symbols), and NCCL linked into another library (what the shim cannot see)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "native"
HOST_NCCL = NATIVE / "build" / "libnccl.so.2"
WORKLOADS = ROOT / "tests" / "workloads"


def _cc(*args: str) -> None:
    subprocess.run(["cc", "-O2", "-Wall", *args], check=True, timeout=120)


def fsdp_program(into: Path, dlopen: bool = False) -> Path:
    """tests/workloads/nccl_fsdp.c, linked to libnccl, or (dlopen) loading it itself (-DNCCL_DLOPEN)."""
    exe = into / ("nccl_fsdp_dlopen" if dlopen else "nccl_fsdp")
    link = ["-DNCCL_DLOPEN", "-ldl"] if dlopen else [f"-L{NATIVE / 'build'}", "-l:libnccl.so.2"]
    _cc(f"-I{NATIVE}", "-o", str(exe), str(WORKLOADS / "nccl_fsdp.c"), *link, "-lm")
    return exe


def plugin_library(into: Path) -> Path:
    """tests/workloads/nccl_plugin.c: a library with its own DT_NEEDED on libnccl.so.2."""
    lib = into / "libnccl_plugin.so"
    _cc("-fPIC", "-shared", f"-I{NATIVE}", "-o", str(lib), str(WORKLOADS / "nccl_plugin.c"),
        f"-L{NATIVE / 'build'}", "-l:libnccl.so.2")
    return lib


def nccl_copy(into: Path) -> Path:
    """The host NCCL, copied to another directory under its own name: a second copy when a program
    loads it by path beside the one it finds by soname."""
    into.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy2(HOST_NCCL, into / "libnccl.so.2"))


def versioned_nccl(into: Path) -> Path:
    """The host NCCL with its names under a symbol version (NCCL_2.29), as a distribution might build
    it: reached with dlvsym."""
    into.mkdir(parents=True, exist_ok=True)
    script = into / "versions.map"
    script.write_text("NCCL_2.29 { global: nccl*; local: *; };\n")
    lib = into / "libnccl.so.2"
    _cc("-fPIC", "-shared", "-Wl,-soname,libnccl.so.2", f"-Wl,--version-script={script}", "-o", str(lib),
        str(NATIVE / "hostnccl.c"), "-lpthread")
    return lib


def static_nccl_library(into: Path) -> Path:
    """The host NCCL linked into another library (libtrainer.so), binding its own calls to itself
    (-Bsymbolic), as a framework that builds NCCL in does: what the shim cannot stand in front of."""
    lib = into / "libtrainer.so"
    _cc("-fPIC", "-shared", "-Wl,-soname,libtrainer.so", "-Wl,-Bsymbolic",
        f"-Wl,--version-script={NATIVE / 'exports.map'}", "-o", str(lib), str(NATIVE / "hostnccl.c"), "-lpthread")
    return lib
