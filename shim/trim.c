/* Release the device memory a parked rank holds reserved but not in use (CMD_TRIM), so that a
 * move's CUDA checkpoint carries live bytes only.
 *
 * Why: PyTorch's caching allocator keeps the blocks a step freed (activations, temporaries) for
 * the next step, and a rank between steps may hold several times its live data reserved; the
 * CUDA checkpoint copies every reserved byte out to host memory, across the network and back in.
 * The rank is parked at the cut, its communicators destroyed, so nothing runs on its streams: the
 * same moment `torch.cuda.empty_cache()` is safe in the job itself.  The rank grows its cache
 * again after the resume, as after an empty_cache() of its own.
 *
 * What is reachable, without a change to the job and without linking anything:
 *   - PyTorch's caching allocator, through the interpreter already in the process: a short
 *     Python call (torch.cuda.empty_cache, with memory_reserved before and after) under the GIL,
 *     made only where `torch` is imported already and CUDA initialized;
 *   - the CUDA runtime's default memory pools of every device (cudaMemPoolTrimTo to 0), where
 *     libcudart is loaded already (RTLD_NOLOAD: never loaded for this).
 * Neither reachable: nothing is released and the move goes on as before (trim_how 0).
 *
 * The call runs on a thread of its own, waited for until PITSTOP_SHIM_TRIM_DEADLINE_S (30 s):
 * a GIL held elsewhere for longer must not hold the move; the coordinator then rolls the move
 * back with the job running (trim_error).  Results go into the control block (ctl.h). */
#define _GNU_SOURCE
#include "nccl_shim.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*gil_ensure_fn)(void);
typedef void (*gil_release_fn)(int);
typedef int (*run_fn)(const char *);
typedef int (*isinit_fn)(void);

/* The Python side: one function, removed from __main__ again; it writes its results straight
 * into the control block's fields, whose addresses it is given. */
static const char TRIM_PY[] =
    "def __pitstop_trim(how, err, before, after, note):\n"
    "    import ctypes, sys\n"
    "    t = sys.modules.get('torch')\n"
    "    cuda = getattr(t, 'cuda', None)\n"
    "    if cuda is None or not cuda.is_initialized():\n"
    "        return\n"
    "    try:\n"
    "        devs = range(cuda.device_count())\n"
    "        b = sum(cuda.memory_reserved(d) for d in devs)\n"
    "        cuda.empty_cache()\n"
    "        a = sum(cuda.memory_reserved(d) for d in devs)\n"
    "    except BaseException as e:\n"
    "        ctypes.c_int32.from_address(err).value = %d\n"
    "        ctypes.memmove(note, (repr(e)[:126] + '\\0').encode(), min(len(repr(e)[:126]) + 1, 127))\n"
    "        return\n"
    "    ctypes.c_int64.from_address(before).value = b\n"
    "    ctypes.c_int64.from_address(after).value = a\n"
    "    ctypes.c_int32.from_address(how).value |= %d\n"
    "try:\n"
    "    __pitstop_trim(%lu, %lu, %lu, %lu, %lu)\n"
    "finally:\n"
    "    del __pitstop_trim\n";

static void trim_torch(struct pitstop_ctl *c) {
  isinit_fn isinit = (isinit_fn)dlsym(RTLD_DEFAULT, "Py_IsInitialized");
  gil_ensure_fn ensure = (gil_ensure_fn)dlsym(RTLD_DEFAULT, "PyGILState_Ensure");
  gil_release_fn release = (gil_release_fn)dlsym(RTLD_DEFAULT, "PyGILState_Release");
  run_fn run = (run_fn)dlsym(RTLD_DEFAULT, "PyRun_SimpleString");
  if (!isinit || !ensure || !release || !run || !isinit()) return; /* no interpreter here */
  char code[sizeof TRIM_PY + 160];
  snprintf(code, sizeof code, TRIM_PY, TRIM_RAISED, TRIM_TORCH, (unsigned long)&c->trim_how,
           (unsigned long)&c->trim_error, (unsigned long)&c->trim_before, (unsigned long)&c->trim_after,
           (unsigned long)c->trim_note);
  int g = ensure();
  if (run(code) != 0 && c->trim_error == TRIM_OK) { /* the snippet itself failed: say so */
    c->trim_error = TRIM_RAISED;
    snprintf(c->trim_note, sizeof c->trim_note, "the release's Python call failed (see the rank's stderr)");
  }
  release(g);
}

static void trim_mempools(struct pitstop_ctl *c) {
  void *rt = dlopen("libcudart.so.12", RTLD_LAZY | RTLD_NOLOAD);
  if (!rt) rt = dlopen("libcudart.so", RTLD_LAZY | RTLD_NOLOAD);
  if (!rt) return;
  int (*count)(int *) = (int (*)(int *))dlsym(rt, "cudaGetDeviceCount");
  int (*pool)(void **, int) = (int (*)(void **, int))dlsym(rt, "cudaDeviceGetDefaultMemPool");
  int (*trim)(void *, size_t) = (int (*)(void *, size_t))dlsym(rt, "cudaMemPoolTrimTo");
  int n = 0;
  if (count && pool && trim && count(&n) == 0) {
    int trimmed = 0;
    for (int d = 0; d < n; d++) {
      void *p = NULL;
      if (pool(&p, d) == 0 && p && trim(p, 0) == 0) trimmed++;
    }
    if (trimmed) c->trim_how |= TRIM_MEMPOOL;
  }
  dlclose(rt);
}

static void *worker(void *arg) {
  struct pitstop_ctl *c = arg;
  trim_torch(c);
  if (c->trim_error == TRIM_OK) trim_mempools(c);
  return NULL;
}

static double deadline_s(void) {
  const char *e = getenv("PITSTOP_SHIM_TRIM_DEADLINE_S");
  double v = e ? atof(e) : 30;
  return v > 0 ? v : 30;
}

void pitstop_trim(struct pitstop_ctl *c) {
  c->trim_how = 0;
  c->trim_error = TRIM_OK;
  c->trim_before = c->trim_after = -1;
  c->trim_note[0] = 0;
  /* A timed-out call is left to finish on its own thread: a release of unused cache is harmless
   * whenever it lands, and the control block it writes lives as long as the process. */
  pthread_t t;
  if (pthread_create(&t, NULL, worker, c) != 0) {
    c->trim_error = TRIM_RAISED;
    snprintf(c->trim_note, sizeof c->trim_note, "cannot start the release's thread");
    return;
  }
  struct timespec end;
  clock_gettime(CLOCK_REALTIME, &end);
  double d = deadline_s();
  end.tv_sec += (time_t)d;
  end.tv_nsec += (long)((d - (double)(time_t)d) * 1e9);
  if (end.tv_nsec >= 1000000000L) { end.tv_sec++; end.tv_nsec -= 1000000000L; }
  if (pthread_timedjoin_np(t, NULL, &end) == 0) return;
  pthread_detach(t);
  c->trim_error = TRIM_TIMED_OUT;
  snprintf(c->trim_note, sizeof c->trim_note, "the release did not finish within %.0f s "
           "(the interpreter's lock held elsewhere?)", d);
}
