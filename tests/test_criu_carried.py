"""The CRIU pitstop carries (criu/patches/, scripts/build-criu.sh) on a real process tree, and
CRIU's own test suite against it (scripts/criu-zdtm.sh).

A parent with forked children that share most of its memory copy-on-write: the carried CRIU
writes the shared pages once, in the parent's image (the children's pagemaps say PE_COW), every
process gets its own bytes back, and the restored tree shares memory as it did before the dump
(PSS).  The pitstop side of PE_COW (lazy views, the refusal of a stock CRIU) is tested without
CRIU in tests/test_cowpages.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pitstop.criu import runtime
from pitstop.memory import cowpages
from pitstop.memory.dumpview import PE_COW, PE_PRESENT, task_images
from pitstop.proc import proctree

from .helpers import until

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")]

MIB = 32
# A parent maps MIB MiB and gives every page its own bytes; child 0 then writes nothing, child 1
# a quarter of the pages, and the parent an eighth (after the forks).  On SIGUSR1 each checks its
# memory against the digest it took before the dump and appends a line to argv[2].  Each waits
# for the signal by polling a flag: with signal.pause(), a restored task resumed just before its
# pause (CRIU restarts the interrupted call) could take the signal first and then wait for ever
# (seen once on a loaded machine: "no results").
TREE = r"""
import hashlib, mmap, os, signal, sys, time
N = %d << 20
m = mmap.mmap(-1, N, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(0, N, 4096):
    m[i:i + 8] = i.to_bytes(8, "little")
go = []
signal.signal(signal.SIGUSR1, lambda *_: go.append(1))
def wait_and_check(name, digest):
    while not go:  # polled, not signal.pause(): a SIGUSR1 that lands before the pause would be waited for again
        time.sleep(0.02)
    ok = hashlib.sha256(m).hexdigest() == digest
    with open(sys.argv[2], "a") as f:
        f.write(f"{name} {'ok' if ok else 'bad'}\n")
    return ok
r, w = os.pipe()
kids = []
for k in range(2):
    pid = os.fork()
    if pid == 0:
        os.close(r)
        if k == 1:
            for i in range(0, N // 4, 4096):
                m[i + 100] = 0xee
        d = hashlib.sha256(m).hexdigest()
        os.write(w, b"k")
        os._exit(0 if wait_and_check(f"child{k}", d) else 1)
    kids.append(pid)
os.close(w)
for i in range(N // 2, N // 2 + N // 8, 4096):
    m[i + 200] = 0xaa
d = hashlib.sha256(m).hexdigest()
got = b""
while len(got) < 2:  # both children have written what they write
    got += os.read(r, 2)
open(sys.argv[1], "w").close()
while not go:
    time.sleep(0.02)
for k in kids:
    os.kill(k, signal.SIGUSR1)
bad = sum(os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) != 0 for k in kids)
with open(sys.argv[2], "a") as f:
    f.write(f"parent {'ok' if hashlib.sha256(m).hexdigest() == d else 'bad'} children {'bad' if bad else 'ok'}\n")
""" % MIB


def _carried() -> runtime.CriuRuntime:
    try:
        rt = runtime.locate()
    except Exception as e:  # noqa: BLE001 - no CRIU at all
        pytest.skip(f"no CRIU: {e}")
    if not rt.carried:
        pytest.skip(f"the carried CRIU is not built here ({rt.source} CRIU runs): scripts/build-criu.sh")
    return rt


def _children(pid: int) -> list[int]:
    return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _pss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1])
    return total


def _kill_tree(pid: int) -> None:
    for p in [*_children(pid), pid] if Path(f"/proc/{pid}").exists() else []:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _start_tree(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    ready = tmp_path / "ready"
    holder = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", sys.executable, "-c", TREE, str(ready),
                               str(tmp_path / "results")], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    end = time.monotonic() + 60
    while not ready.exists():
        assert holder.poll() is None and time.monotonic() < end, "the tree did not start"
        time.sleep(0.05)
    (root,) = _children(holder.pid)
    return holder, root


def _results(tmp_path: Path, restored: int) -> list[str]:
    results = tmp_path / "results"
    os.kill(restored, signal.SIGUSR1)
    end = time.monotonic() + 60
    while "parent" not in (results.read_text() if results.exists() else ""):
        assert time.monotonic() < end, results.read_text() if results.exists() else "no results"
        time.sleep(0.05)
    return sorted(ln for ln in results.read_text().split("\n") if ln)


def _stop(pids: list[int]) -> None:
    """SIGSTOP each and wait until the kernel says stopped (state T)."""
    proctree.stop(pids)
    until(lambda: all(proctree.state(p) == "T" for p in pids), 10, "the tree stopped")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("state", ["running", "stopped"])
def test_children_share_pages_dumped_once_restored_shared_and_bitwise(tmp_path, state):
    """stopped: the tree SIGSTOPped before the dump, as an agent pauses a job for a snapshot or a
    move.  CRIU then records each task as stopped, not alive; the shared pages were dumped once
    per process for such trees until the patch took a stopped parent for what it is (a whole
    snapshot of a rank with 2 loader workers: 1,317 MiB, 475 MiB since)."""
    rt = _carried()
    imgs = tmp_path / "images"
    imgs.mkdir()
    holder, root = _start_tree(tmp_path)
    restored = 0
    try:
        tree = [root, *_children(root)]
        assert len(tree) == 3
        pss_before = _pss_kib(tree)
        if state == "stopped":
            _stop(tree)

        p = subprocess.run([rt.binary, "dump", "-t", str(root), "-D", str(imgs), "-o", "dump.log", "-v4"],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (imgs / "dump.log").read_text()[-3000:]

        pycriu = rt.import_pycriu()
        tasks = {t.pid: t for t in task_images(imgs, pycriu)}
        parents = cowpages.parents_of(imgs, pycriu)
        (top,) = [pid for pid, ppid in parents.items() if ppid == 0]
        pages = {pid: sum(int(e["nr_pages"]) for e in t.entries if int(e["flags"]) & PE_PRESENT)
                 for pid, t in tasks.items()}
        shared = {pid: sum(int(e["nr_pages"]) for e in t.entries if int(e["flags"]) & PE_COW)
                  for pid, t in tasks.items()}
        n = MIB << 20 >> 12
        assert shared[top] == 0 and pages[top] >= n
        kids = sorted((pid for pid in tasks if pid != top), key=lambda pid: pages[pid])
        # child 0 differs from the parent only where the parent wrote (an eighth); child 1 also
        # where it wrote itself (a quarter): everything else is the parent's, not dumped again
        assert shared[kids[0]] >= n * 7 // 8 - 64 and pages[kids[0]] <= n // 8 + 256, (pages, shared)
        assert shared[kids[1]] >= n * 5 // 8 - 64 and pages[kids[1]] <= n * 3 // 8 + 256, (pages, shared)
        assert cowpages.needs_carried_criu(imgs, pycriu) == kids

        p = subprocess.run([rt.binary, "restore", "-D", str(imgs), "-d", "--pidfile", str(tmp_path / "pid"),
                            "-o", "restore.log", "-v4"], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (imgs / "restore.log").read_text()[-3000:]
        restored = int((tmp_path / "pid").read_text().split()[0])
        after = [restored, *_children(restored)]
        assert len(after) == 3
        if state == "stopped":  # restored as it was dumped: stopped
            for pid in after:
                os.kill(pid, signal.SIGCONT)
        pss_after = _pss_kib(after)
        # as much memory shared as before the dump (not a copy per process), give or take the
        # pages CRIU's own restore touches
        assert pss_after < pss_before * 1.1 + 2048, (pss_before, pss_after)

        assert _results(tmp_path, restored) == ["child0 ok", "child1 ok", "parent ok children ok"]
        restored_log = (imgs / "restore.log").read_text()
        assert "nr_shared_pages" in restored_log
    finally:
        if restored:
            _kill_tree(restored)
        _kill_tree(holder.pid)
        holder.kill()
        holder.wait(10)


# Preloaded into `criu lazy-pages`: keeps a second descriptor of every file it receives (each
# task's userfaultfd), and at exit writes "entries stale" for its epoll sets to $DUPFD_REPORT:
# stale entries name a descriptor the daemon has closed.
DUPFD = r"""
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
ssize_t recvmsg(int fd, struct msghdr *msg, int flags) {
  static ssize_t (*real)(int, struct msghdr *, int);
  if (!real) real = (ssize_t (*)(int, struct msghdr *, int))dlsym(RTLD_NEXT, "recvmsg");
  ssize_t n = real(fd, msg, flags);
  if (n >= 0 && msg->msg_controllen)
    for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c))
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
        for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); i++) (void)dup(((int *)CMSG_DATA(c))[i]);
  return n;
}
__attribute__((destructor)) static void report(void) {
  const char *out = getenv("DUPFD_REPORT");
  int stale = 0, entries = 0;
  DIR *d = opendir("/proc/self/fdinfo");
  struct dirent *e;
  while (out && d && (e = readdir(d))) {
    char p[300], line[256];
    snprintf(p, sizeof p, "/proc/self/fdinfo/%s", e->d_name);
    FILE *f = fopen(p, "r");
    while (f && fgets(line, sizeof line, f)) {
      int tfd; unsigned long ino; struct stat st;
      char *t = strstr(line, "tfd:"), *i = strstr(line, "ino:");
      if (!t || !i || sscanf(t, "tfd: %d", &tfd) != 1 || sscanf(i, "ino:%lx", &ino) != 1) continue;
      entries++;
      if (fstat(tfd, &st) || st.st_ino != ino) stale++;
    }
    if (f) fclose(f);
  }
  if (d) closedir(d);
  FILE *o = out ? fopen(out, "w") : NULL;
  if (o) { fprintf(o, "%d %d\n", entries, stale); fclose(o); }
}
"""


@pytest.mark.timeout(180)
def test_lazy_pages_daemon_drops_finished_tasks_from_its_epoll_set(tmp_path):
    """criu/patches/0004: a task's userfaultfd leaves the daemon's epoll set when the daemon is done
    with it, even while someone else holds a copy of it (before: one stale entry per task, whose
    events the daemon would handle with freed memory).  The dump is restored lazily as CRIU wrote
    it: the daemon serves the children's PE_COW pages from their parent's pagemap, every byte right."""
    rt = _carried()
    lib = tmp_path / "dupfd.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(lib), "-x", "c", "-", "-ldl"], input=DUPFD,
                   text=True, check=True, timeout=60)
    imgs, report = tmp_path / "images", tmp_path / "epoll-report"
    imgs.mkdir()
    holder, root = _start_tree(tmp_path)
    restored, daemon = 0, None
    try:
        p = subprocess.run([rt.binary, "dump", "-t", str(root), "-D", str(imgs), "-o", "dump.log", "-v4"],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (imgs / "dump.log").read_text()[-3000:]
        daemon = subprocess.Popen([rt.binary, "lazy-pages", "-D", str(imgs), "-o", "lazy-pages.log", "-v4"],
                                  cwd=imgs, env={**os.environ, "LD_PRELOAD": str(lib), "DUPFD_REPORT": str(report)},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 30
        while not (imgs / "lazy-pages.socket").exists():
            assert daemon.poll() is None and time.monotonic() < end, (imgs / "lazy-pages.log").read_text()[-2000:]
            time.sleep(0.05)
        p = subprocess.run([rt.binary, "restore", "-D", str(imgs), "--lazy-pages", "-d", "--pidfile",
                            str(tmp_path / "pid"), "-o", "restore.log", "-v4"], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, (imgs / "restore.log").read_text()[-3000:]
        restored = int((tmp_path / "pid").read_text().split()[0])
        assert daemon.wait(60) == 0, (imgs / "lazy-pages.log").read_text()[-3000:]
        entries, stale = (int(x) for x in report.read_text().split())
        assert stale == 0, f"{stale} of {entries} epoll entries name userfaultfds the daemon closed"
        assert _results(tmp_path, restored) == ["child0 ok", "child1 ok", "parent ok children ok"]
    finally:
        if daemon and daemon.poll() is None:
            daemon.kill()
            daemon.wait(10)
        if restored:
            _kill_tree(restored)
        _kill_tree(holder.pid)
        holder.kill()
        holder.wait(10)


@pytest.mark.timeout(900)
def test_criu_zdtm_suite_passes_against_the_carried_build(tmp_path):
    """CRIU's own tests of copy-on-write, forks, mappings and lazy restore, and those the patches
    add (criu/zdtm.list), in zdtm's host flavour, eager and lazy."""
    rt = _carried()
    p = subprocess.run([str(ROOT / "scripts" / "criu-zdtm.sh")], capture_output=True, text=True, timeout=840,
                       env={**os.environ, "OUT": str(tmp_path / "zdtm"), "PY": sys.executable})
    assert p.returncode == 0, f"{rt.binary}: {p.stdout[-3000:]}\n{p.stderr[-2000:]}"
    assert " 0 failed" in p.stdout, p.stdout
