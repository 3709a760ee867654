"""A worker one of whose threads waits with its stack pointer exactly on a page boundary.

That is what makes CRIU mark no page lazy (memory/lazyrule.py): about one worker process in 256
hits it; this one always does.  The thread runs twelve bytes of machine
code (x86-64): `mov rsp, rdi`, then `pause()` forever, on a stack of its own whose top is
page-aligned.  The main thread holds MB MiB of anonymous memory, every page numbered, and
checks all of it each step: "step N ok" or "BAD ..." (exit 3).

Usage: aligned_stack.py STEPS [MB] [--no-park] (without the thread: the plain control)."""

import ctypes
import mmap
import signal
import struct
import sys
import threading
import time

PAGE = 4096
# mov rsp, rdi ; 1: mov eax, 34 (pause) ; syscall ; jmp 1b
CODE = bytes.fromhex("4889fc" "b822000000" "0f05" "ebf7")
STACK = 64 << 10

args = [a for a in sys.argv[1:] if not a.startswith("--")]
steps = int(args[0]) if args else 100
mb = int(args[1]) if len(args) > 1 else 64


def park() -> None:
    """Never returns: the thread stays in pause(2) with rsp == the top of its own stack."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())  # no handler frame on that stack
    code = mmap.mmap(-1, PAGE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    code.write(CODE)
    stack = mmap.mmap(-1, STACK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    top = ctypes.addressof(ctypes.c_char.from_buffer(stack)) + STACK
    entry = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ctypes.addressof(ctypes.c_char.from_buffer(code)))
    parked.set()
    entry(top)  # ctypes lets the GIL go for the call


parked = threading.Event()
if "--no-park" not in sys.argv:
    threading.Thread(target=park, daemon=True, name="aligned").start()
    parked.wait(10)
held = mmap.mmap(-1, mb << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
pages = len(held) // PAGE
for i in range(pages):
    struct.pack_into("<Q", held, i * PAGE, i + 1)
for step in range(1, steps + 1):
    bad = next((i for i in range(pages) if struct.unpack_from("<Q", held, i * PAGE)[0] != i + 1), None)
    if bad is not None:
        print(f"BAD step {step}: page {bad} reads {struct.unpack_from('<Q', held, bad * PAGE)[0]}", flush=True)
        sys.exit(3)
    print(f"step {step} ok", flush=True)
    time.sleep(0.05)
print("done", flush=True)
