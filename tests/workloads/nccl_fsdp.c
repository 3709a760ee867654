/* An FSDP-style sharded SGD through the NCCL C API, with no pitstop code: the kind of unchanged
 * program a user brings.  The world communicator comes from ncclCommInitRank with an id shared by
 * a file; a second one from ncclCommSplit(world, rank % 2, rank, &sub, NULL) (a NULL config).
 * Each step: rank 0 broadcasts the step's learning rate; every rank all-gathers the parameter
 * shards, computes a gradient of the whole model on its own data, reduce-scatters the gradients
 * back into shards, and all-reduces a loss on its split communicator.  At the end each rank
 * writes a digest (64-bit FNV-1a, hex) of its shard to OUT/rankR.sha256, the file name the test
 * harness reads for every workload.
 *
 * Arguments as the Python workloads (nccl_common.py): --steps N --step-sleep S --pace-file F
 * --rendezvous DIR --out DIR; RANK and WORLD_SIZE from the environment.
 *
 * Built with -DNCCL_DLOPEN it is the same program reaching NCCL the way plugins and launchers
 * do: not linked to libnccl, it dlopens the library itself (NCCL_SO_PATH, a soname or a path;
 * libnccl.so.2 if unset) RTLD_NOW | RTLD_LOCAL, or with --dlopen deepbind also RTLD_DEEPBIND, and
 * takes every function from that handle with dlsym. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "nccl.h"

#ifdef NCCL_DLOPEN
#include <dlfcn.h>
#define NCCL_FUNCS(X) X(ncclGetUniqueId) X(ncclCommInitRank) X(ncclCommSplit) X(ncclCommDestroy) X(ncclBroadcast) \
  X(ncclAllGather) X(ncclReduceScatter) X(ncclAllReduce)
#define NCCL_POINTER(f) static __typeof__(&f) p_##f;
NCCL_FUNCS(NCCL_POINTER)
static void loadNccl(int deep) {
  const char *name = getenv("NCCL_SO_PATH");
  if (!name || !*name) name = "libnccl.so.2";
  void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL | (deep ? RTLD_DEEPBIND : 0));
  if (!h) { fprintf(stderr, "dlopen %s: %s\n", name, dlerror()); exit(1); }
#define NCCL_LOAD(f) if (!(p_##f = (__typeof__(&f))dlsym(h, #f))) { fprintf(stderr, "dlsym %s: %s\n", #f, dlerror()); exit(1); }
  NCCL_FUNCS(NCCL_LOAD)
}
#define ncclGetUniqueId p_ncclGetUniqueId
#define ncclCommInitRank p_ncclCommInitRank
#define ncclCommSplit p_ncclCommSplit
#define ncclCommDestroy p_ncclCommDestroy
#define ncclBroadcast p_ncclBroadcast
#define ncclAllGather p_ncclAllGather
#define ncclReduceScatter p_ncclReduceScatter
#define ncclAllReduce p_ncclAllReduce
#endif

#define SHARD 4096

static void check(ncclResult_t r, const char *what) {
  if (r != ncclSuccess) { fprintf(stderr, "%s failed: %d\n", what, (int)r); exit(1); }
}

static void nap(double s) {
  if (s <= 0) return;
  struct timespec t = {(time_t)s, (long)((s - (time_t)s) * 1e9)};
  nanosleep(&t, NULL);
}

static double pace(double dflt, const char *file) {
  if (!file) return dflt;
  FILE *f = fopen(file, "r");
  if (!f) return dflt;
  double v = dflt;
  if (fscanf(f, "%lf", &v) != 1) v = dflt;
  fclose(f);
  return v;
}

static void shareId(const char *dir, int rank, ncclUniqueId *id) {
  char path[4096], tmp[4200];
  snprintf(path, sizeof path, "%s/world.id", dir);
  if (rank == 0) {
    check(ncclGetUniqueId(id), "ncclGetUniqueId");
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f || fwrite(id, sizeof *id, 1, f) != 1 || fclose(f) != 0 || rename(tmp, path) != 0) {
      perror("write the unique id"); exit(1);
    }
    return;
  }
  for (int i = 0; i < 60000; i++) {
    FILE *f = fopen(path, "rb");
    if (f) {
      size_t n = fread(id, sizeof *id, 1, f);
      fclose(f);
      if (n == 1) return;
    }
    nap(0.005);
  }
  fprintf(stderr, "no unique id at %s\n", path);
  exit(1);
}

int main(int argc, char **argv) {
  int steps = 60;
  double sleepS = 0.05;
  const char *paceFile = NULL, *rdv = NULL, *out = NULL, *how = "local";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--dlopen")) how = argv[i + 1];
    if (!strcmp(argv[i], "--steps")) steps = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--step-sleep")) sleepS = atof(argv[i + 1]);
    else if (!strcmp(argv[i], "--pace-file")) paceFile = argv[i + 1];
    else if (!strcmp(argv[i], "--rendezvous")) rdv = argv[i + 1];
    else if (!strcmp(argv[i], "--out")) out = argv[i + 1];
  }
  const char *re = getenv("RANK"), *we = getenv("WORLD_SIZE");
  if (!rdv || !out || !re || !we) { fprintf(stderr, "usage: RANK= WORLD_SIZE= %s --rendezvous D --out D\n", argv[0]); return 2; }
  int rank = atoi(re), world = atoi(we);
#ifdef NCCL_DLOPEN
  loadNccl(!strcmp(how, "deepbind"));
#else
  (void)how;
#endif

  ncclUniqueId id;
  shareId(rdv, rank, &id);
  ncclComm_t comm, sub;
  check(ncclCommInitRank(&comm, world, id, rank), "ncclCommInitRank");
  check(ncclCommSplit(comm, rank % 2, rank, &sub, NULL), "ncclCommSplit");

  size_t n = (size_t)SHARD * world;
  float *shard = malloc(SHARD * sizeof(float)), *full = malloc(n * sizeof(float));
  float *grad = malloc(n * sizeof(float)), *gshard = malloc(SHARD * sizeof(float));
  for (int i = 0; i < SHARD; i++) shard[i] = (float)sin(0.001 * (rank * SHARD + i));
  float lossSum[1];
  double lr[1];
  for (int step = 1; step <= steps; step++) {
    lr[0] = 0.01 / (1.0 + 0.001 * step);
    check(ncclBroadcast(lr, lr, 1, ncclFloat64, 0, comm, NULL), "ncclBroadcast");
    check(ncclAllGather(shard, full, SHARD, ncclFloat32, comm, NULL), "ncclAllGather");
    /* this rank's data: a target the model is pulled toward, different on every rank */
    double loss = 0;
    for (size_t i = 0; i < n; i++) {
      float target = (float)cos(0.0007 * (double)i + 0.3 * rank + 0.01 * step);
      float d = full[i] - target;
      grad[i] = d / (float)world;
      loss += (double)d * d;
    }
    check(ncclReduceScatter(grad, gshard, SHARD, ncclFloat32, ncclSum, comm, NULL), "ncclReduceScatter");
    for (int i = 0; i < SHARD; i++) shard[i] -= (float)lr[0] * gshard[i];
    lossSum[0] = (float)loss;
    check(ncclAllReduce(lossSum, lossSum, 1, ncclFloat32, ncclSum, sub, NULL), "ncclAllReduce");
    printf("step %d loss=%.6f\n", step, lossSum[0]);
    fflush(stdout);
    nap(pace(sleepS, paceFile));
  }
  check(ncclCommDestroy(sub), "ncclCommDestroy");
  check(ncclCommDestroy(comm), "ncclCommDestroy");

  uint64_t h = 1469598103934665603ull;
  const unsigned char *b = (const unsigned char *)shard;
  for (size_t i = 0; i < SHARD * sizeof(float); i++) { h ^= b[i]; h *= 1099511628211ull; }
  mkdir(out, 0755);
  char path[4096];
  snprintf(path, sizeof path, "%s/rank%d.sha256", out, rank);
  FILE *f = fopen(path, "w");
  if (!f) { perror(path); return 1; }
  fprintf(f, "fnv1a64:%016llx\n", (unsigned long long)h);
  fclose(f);
  printf("done rank=%d fnv1a64=%016llx\n", rank, (unsigned long long)h);
  return 0;
}
