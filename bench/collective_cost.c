/* Time N tiny allreduces (world of 1, host NCCL): the per-call cost of the stack below the
 * application.  Run with and without LD_PRELOAD=libpitstop_shim.so; the difference is the shim.
 * Built with -DVIA_DLOPEN, the program loads libnccl.so.2 itself (dlopen RTLD_LOCAL) and calls
 * the functions dlsym hands it: the route of ctypes and plugins (shim/dl.c). */
#include "../native/nccl.h"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#ifdef VIA_DLOPEN
#include <dlfcn.h>
static __typeof__(&ncclGetUniqueId) getId;
static __typeof__(&ncclCommInitRank) initRank;
static __typeof__(&ncclAllReduce) allReduce;
static __typeof__(&ncclCommDestroy) destroy;
#define ncclGetUniqueId getId
#define ncclCommInitRank initRank
#define ncclAllReduce allReduce
#define ncclCommDestroy destroy
#endif

int main(int argc, char **argv) {
  long n = argc > 1 ? atol(argv[1]) : 200000;
#ifdef VIA_DLOPEN
  void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (!h || !(getId = dlsym(h, "ncclGetUniqueId")) || !(initRank = dlsym(h, "ncclCommInitRank")) ||
      !(allReduce = dlsym(h, "ncclAllReduce")) || !(destroy = dlsym(h, "ncclCommDestroy"))) {
    fprintf(stderr, "libnccl.so.2: %s\n", dlerror());
    return 1;
  }
#endif
  ncclUniqueId id;
  ncclComm_t comm;
  if (ncclGetUniqueId(&id) || ncclCommInitRank(&comm, 1, id, 0)) { fprintf(stderr, "init failed\n"); return 1; }
  float x = 1.0f;
  for (long i = 0; i < 1000; i++) ncclAllReduce(&x, &x, 1, ncclFloat32, ncclSum, comm, NULL);
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  for (long i = 0; i < n; i++) ncclAllReduce(&x, &x, 1, ncclFloat32, ncclSum, comm, NULL);
  clock_gettime(CLOCK_MONOTONIC, &b);
  printf("%.1f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
  ncclCommDestroy(comm);
  return 0;
}
