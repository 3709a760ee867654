/* A library that uses NCCL through its own link to libnccl, as a framework's plugin does: a
 * program loads it with dlopen(..., RTLD_DEEPBIND), so that its references to NCCL bind inside
 * its own scope, to its libnccl, past a preloaded library.  No pitstop code.
 *
 * plugin_train(rank, world, rendezvous, steps, sleep_s) makes a world communicator (the unique id
 * shared through rendezvous/plugin.id) and a split of it (rank % 2), all-reduces a vector on the
 * world and a scalar on the split each step (then sleeps sleep_s), and returns an FNV-1a digest of
 * the final vector (0 if a call failed). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nccl.h"

static int shareId(const char *dir, int rank, ncclUniqueId *id) {
  char path[4096], tmp[4200];
  snprintf(path, sizeof path, "%s/plugin.id", dir);
  if (rank == 0) {
    if (ncclGetUniqueId(id) != ncclSuccess) return -1;
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f || fwrite(id, sizeof *id, 1, f) != 1 || fclose(f) != 0 || rename(tmp, path) != 0) return -1;
    return 0;
  }
  for (int i = 0; i < 60000; i++) {
    FILE *f = fopen(path, "rb");
    if (f) {
      size_t n = fread(id, sizeof *id, 1, f);
      fclose(f);
      if (n == 1) return 0;
    }
    struct timespec t = {0, 5000000};
    nanosleep(&t, NULL);
  }
  return -1;
}

uint64_t plugin_train(int rank, int world, const char *rdv, int steps, double sleep_s) {
  ncclUniqueId id;
  ncclComm_t comm, sub;
  if (shareId(rdv, rank, &id) != 0 || ncclCommInitRank(&comm, world, id, rank) != ncclSuccess ||
      ncclCommSplit(comm, rank % 2, rank, &sub, NULL) != ncclSuccess)
    return 0;
  float v[64], s[1];
  for (int i = 0; i < 64; i++) v[i] = (float)(rank + 1) * 0.01f * (float)i;
  for (int step = 1; step <= steps; step++) {
    if (ncclAllReduce(v, v, 64, ncclFloat32, ncclSum, comm, NULL) != ncclSuccess) return 0;
    for (int i = 0; i < 64; i++) v[i] = v[i] / (float)world + 0.001f * (float)step;
    s[0] = v[step % 64];
    if (ncclAllReduce(s, s, 1, ncclFloat32, ncclMax, sub, NULL) != ncclSuccess) return 0;
    v[0] += s[0] * 1e-3f;
    struct timespec t = {(time_t)sleep_s, (long)((sleep_s - (double)(time_t)sleep_s) * 1e9)};
    if (sleep_s > 0) nanosleep(&t, NULL);
  }
  ncclCommDestroy(sub);
  ncclCommDestroy(comm);
  uint64_t h = 1469598103934665603ull;
  const unsigned char *b = (const unsigned char *)v;
  for (size_t i = 0; i < sizeof v; i++) { h ^= b[i]; h *= 1099511628211ull; }
  return h;
}
