/* pitstop's NCCL shim (LD_PRELOAD): virtual communicators, a consistent cut, rewiring.
 *
 * The application gets virtual handles (struct vcomm *) and never sees a real one.
 * Per communicator the shim counts issued operations.  When the agent raises a
 * quiesce request in the control block (ctl.h), each call entry compares its
 * communicator's count with the target the coordinator set: below it, the call
 * proceeds; at it, the rank parks there (between collectives, a group kept whole)
 * and carries out the agent's commands: destroy the real communicators (so nothing
 * of NCCL crosses the checkpoint), generate fresh unique ids, rebuild every
 * communicator in creation order (splits replayed), resume.  The handles never
 * change; the application sees no error.  In a move's early rewire the ranks that stay
 * rebuild on a thread of the shim while the leaving ones are captured and restored
 * (CMD_PREBUILD, with ids one of them made: CMD_MAKEIDS); NCCL's init waits in its
 * bootstrap until the restored ranks join with the same ids.
 *
 * Every wait has a deadline (PITSTOP_SHIM_DEADLINE_S, default 300 s): a parked rank
 * whose agent vanished resumes on its own if its communicators still exist, and
 * otherwise returns ncclRemoteError rather than hang (cf. NVIDIA/nccl#2349).
 *
 * A peer's failure in a job that snapshots protect (the agent sets `protect` in the block):
 * a communicator error from an operation or from ncclCommGetAsyncError parks the calling
 * thread instead of reaching the program, which would end the process (PyTorch's watchdog
 * aborts it); the job's recovery then rolls the live process back to the snapshot.  Past
 * PITSTOP_SHIM_LOST_PEER_DEADLINE_S (default 120 s), or once `protect` is cleared, the error
 * goes to the program as it would have without the shim: a job never hangs for good.
 * Idle cost: one load and compare per call; per issued operation, its count, its signature and
 * its time in the trail (ctl.h): four stores and a vDSO clock read, some 20 ns against the
 * microseconds an NCCL launch takes. */
#define _GNU_SOURCE
#include "nccl_shim.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static struct vcomm *vcomms[PITSTOP_MAX_COMMS];
static int nvcomms;
static __thread int groupDepth, groupChecked;

struct event { int kind; int idx; int parent; int color, key; }; /* creation order, NOCOLOR splits too */
static struct event events[4 * PITSTOP_MAX_COMMS];
static int nevents;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
/* Wall-clock time, for the pause a rank saw: its park and its resume may be on different hosts. */
static uint64_t wallNs(void) { struct timespec t; clock_gettime(CLOCK_REALTIME, &t); return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec; }
static double deadlineS(void) { const char *e = getenv("PITSTOP_SHIM_DEADLINE_S"); double v = e ? atof(e) : 300; return v > 0 ? v : 300; }
static double lostDeadlineS(void) {
  const char *e = getenv("PITSTOP_SHIM_LOST_PEER_DEADLINE_S");
  double v = e ? atof(e) : 120;
  return v > 0 ? v : 120;
}
static void sayInBlock(const char *fmt, const char *a, long b) {
  if (pitstop_ctl) snprintf(pitstop_ctl->note, sizeof pitstop_ctl->note, fmt, a, b);
}

static struct vcomm *newVcomm(struct pitstop_lib *L, int kind, int nranks, int rank, uint64_t key, int parent,
                              int color, int keyArg, const ncclConfig_t *config) {
  if (nvcomms >= PITSTOP_MAX_COMMS) return NULL;
  struct pitstop_ctl *c = pitstop_ctl_get();
  struct vcomm *v = calloc(1, sizeof *v);
  v->magic = VCOMM_MAGIC;
  v->idx = nvcomms;
  v->lib = L;
  if (config) { /* never read past the caller's struct (NVIDIA/nccl#2347), and keep all of it */
    size_t n = config->size < PITSTOP_MAX_CONFIG ? config->size : PITSTOP_MAX_CONFIG;
    if (n >= sizeof(size_t) && (v->config = malloc(n))) {
      memcpy(v->config, config, n);
      v->config->size = n;
      v->hasConfig = 1;
    }
  }
  struct pitstop_comm_ctl *cc = &c->comms[v->idx];
  memset(cc, 0, sizeof *cc);
  cc->key = key; cc->nranks = nranks; cc->rank = rank; cc->kind = kind; cc->parent = parent;
  cc->color = color; cc->key_arg = keyArg; cc->target = PITSTOP_TARGET_UNSET; cc->alive = 1;
  for (int i = 0; i < PITSTOP_MAX_PEERS; i++) cc->send_target[i] = cc->recv_target[i] = PITSTOP_TARGET_UNSET;
  vcomms[nvcomms++] = v;
  c->ncomms = (uint32_t)nvcomms;
  return v;
}

/* ---- lifecycle ---------------------------------------------------------------------- */
/* A top-level communicator NCCL made (r: ncclSuccess, or ncclInProgress for a nonblocking
 * one, whose handle is already valid: the application polls ncclCommGetAsyncError on ours),
 * behind a handle of ours keyed on its unique ids. */
static ncclResult_t adoptInit(struct pitstop_lib *L, ncclComm_t *comm, ncclComm_t real, ncclResult_t r, int nranks,
                              int rank, const ncclUniqueId *ids, int nId, ncclConfig_t *config, int scalable) {
  if (r != ncclSuccess && r != ncclInProgress) return r;
  pitstop_scan_now(); /* the process uses NCCL: anything loaded it cannot see, and lazy bindings since */
  uint64_t key = scalable ? 0x2ull : 0x1ull;
  for (int j = 0; j < nId; j++)
    for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) key = pitstop_mix(key, (uint8_t)ids[j].internal[i]);
  struct vcomm *v = newVcomm(L, KIND_INIT, nranks, rank, key, -1, 0, 0, config);
  if (!v) { L->fn.ncclCommDestroy(real); return ncclInternalError; }
  v->real = real;
  v->scalable = scalable;
  events[nevents++] = (struct event){KIND_INIT, v->idx, -1, 0, 0};
  *comm = (ncclComm_t)v;
  return r;
}

ncclResult_t pitstop_init(struct pitstop_lib *L, ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                          ncclConfig_t *config, int withConfig) {
  ncclComm_t real = NULL;
  ncclResult_t r = withConfig ? L->fn.ncclCommInitRankConfig(&real, nranks, id, rank, config)
                              : L->fn.ncclCommInitRank(&real, nranks, id, rank);
  return adoptInit(L, comm, real, r, nranks, rank, &id, 1, withConfig ? config : NULL, 0);
}

/* ncclCommInitRankScalable: the same communicator as InitRankConfig, bootstrapped from
 * nId roots.  Re-created with one fresh id (nId = 1): the members and config are what
 * define it; the roots only spread the bootstrap's load. */
ncclResult_t pitstop_init_scalable(struct pitstop_lib *L, ncclComm_t *comm, int nranks, int rank, int nId,
                                   ncclUniqueId *ids, ncclConfig_t *config) {
  ncclComm_t real = NULL;
  ncclResult_t r = L->fn.ncclCommInitRankScalable(&real, nranks, rank, nId, ids, config);
  return adoptInit(L, comm, real, r, nranks, rank, ids, nId, config, 1);
}

ncclResult_t pitstop_split(struct pitstop_lib *L, ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                           ncclConfig_t *config) {
  struct vcomm *p = pitstop_v(comm);
  if (!p) {
    struct pitstop_lib *T = pitstop_foreign("ncclCommSplit", comm, L);
    return T->fn.ncclCommSplit(comm, color, key, newcomm, config);
  }
  L = pitstop_in = p->lib; /* a split is made by its parent's library */
  ncclComm_t real = NULL;
  ncclResult_t r = L->fn.ncclCommSplit(p->real, color, key, &real, config);
  if (r != ncclSuccess && r != ncclInProgress) return r;
  p->splits++;
  if (nevents >= (int)(sizeof events / sizeof *events)) return ncclInternalError;
  if (!real) { /* NCCL_SPLIT_NOCOLOR: no communicator, but the split is replayed too */
    events[nevents++] = (struct event){KIND_SPLIT, -1, p->idx, color, key};
    *newcomm = NULL;
    return ncclSuccess;
  }
  int nranks = 0, rank = 0;
  if (r == ncclSuccess) { L->fn.ncclCommCount(real, &nranks); L->fn.ncclCommUserRank(real, &rank); }
  uint64_t k = pitstop_mix(pitstop_mix(pitstop_mix(pitstop_ctl->comms[p->idx].key, p->splits), (uint64_t)(uint32_t)color), 0x5b);
  struct vcomm *v = newVcomm(L, KIND_SPLIT, nranks, rank, k, p->idx, color, key, config);
  if (!v) { L->fn.ncclCommDestroy(real); return ncclInternalError; }
  v->real = real;
  v->pendingInfo = r == ncclInProgress; /* size and rank are filled in once it is ready */
  events[nevents++] = (struct event){KIND_SPLIT, v->idx, p->idx, color, key};
  *newcomm = (ncclComm_t)v;
  return r;
}

/* ---- a peer's failure, in a job that snapshots protect ------------------------------------- */
static const char *resultName(ncclResult_t r) {
  return r == ncclRemoteError ? "ncclRemoteError" : r == ncclSystemError ? "ncclSystemError" : "an error";
}

/* A communicator error (ncclRemoteError, ncclSystemError: a peer's process or host died, or the
 * network between them) while the agent says a committed snapshot covers the job: the thread
 * parks here, as at a cut, and the block says so (which call, which communicator, which error,
 * until when); the job's recovery ends the process and restores it from the snapshot.  The error
 * reaches the program at the deadline, or at once once `protect` is cleared (the job's snapshots
 * were dropped: no recovery is coming).  Any other result, or no protection: r, unchanged. */
ncclResult_t pitstop_peer_lost(struct vcomm *v, ncclResult_t r, const char *call) {
  struct pitstop_ctl *c = pitstop_ctl;
  if (!c || !c->protect || (r != ncclRemoteError && r != ncclSystemError)) return r;
  double limit = lostDeadlineS(), end = now() + limit;
  if (__atomic_load_n(&c->lost, __ATOMIC_ACQUIRE) != LOST_PARKED) { /* the first thread to park says why */
    uint64_t at = wallNs();
    c->lost_comm = v ? v->idx : -1;
    c->lost_error = (int32_t)r;
    snprintf(c->lost_call, sizeof c->lost_call, "%s", call);
    c->lost_ns = at;
    c->lost_deadline_ns = at + (uint64_t)(limit * 1e9);
    __atomic_store_n(&c->lost, LOST_PARKED, __ATOMIC_RELEASE);
    sayInBlock("%s failed after a peer was lost: parked for the job's recovery (%ld s at most)", call, (long)limit);
  }
  int withdrawn = 0;
  while (now() < end) {
    if (!c->protect) { withdrawn = 1; break; }
    struct timespec ts = {0, 5000000};
    nanosleep(&ts, NULL);
  }
  __atomic_store_n(&c->lost, LOST_GAVE_UP, __ATOMIC_RELEASE);
  if (withdrawn)
    fprintf(stderr, "pitstop shim: %s returned %s after a peer was lost; the job's snapshots no longer cover it, "
                    "so the error goes to the program\n", call, resultName(r));
  else
    fprintf(stderr, "pitstop shim: %s returned %s after a peer was lost; the rank waited %.0f s "
                    "(PITSTOP_SHIM_LOST_PEER_DEADLINE_S) for the job's recovery, which did not come, and the "
                    "error goes to the program\n", call, resultName(r), limit);
  return r;
}

ncclResult_t pitstop_async_error(struct pitstop_lib *L, ncclComm_t comm, ncclResult_t *asyncError) {
  struct vcomm *v = pitstop_v(comm);
  if (!v) {
    struct pitstop_lib *T = pitstop_foreign("ncclCommGetAsyncError", comm, L);
    return T->fn.ncclCommGetAsyncError(comm, asyncError);
  }
  L = pitstop_in = v->lib;
  pthread_mutex_lock(&pitstop_real_lock);
  ncclResult_t r = ncclSuccess;
  if (!v->real) *asyncError = ncclSuccess; /* between destroy and rebuild: parked, not failed */
  else r = L->fn.ncclCommGetAsyncError(v->real, asyncError);
  if (r == ncclSuccess && *asyncError == ncclSuccess && v->pendingInfo) {
    struct pitstop_comm_ctl *cc = &pitstop_ctl->comms[v->idx];
    int n = 0, me = 0;
    if (L->fn.ncclCommCount(v->real, &n) == ncclSuccess && L->fn.ncclCommUserRank(v->real, &me) == ncclSuccess) {
      cc->nranks = n; cc->rank = me; v->pendingInfo = 0;
    }
  }
  int ready = !v->pendingInfo;
  pthread_mutex_unlock(&pitstop_real_lock);
  /* A communicator that was up reports a peer's failure (PyTorch's watchdog polls this, and aborts
   * the process on an error): held back while the job is protected, outside the lock. */
  if (r == ncclSuccess && ready && *asyncError != ncclSuccess && *asyncError != ncclInProgress)
    *asyncError = pitstop_peer_lost(v, *asyncError, "ncclCommGetAsyncError");
  return r;
}

/* A communicator the shim did not make (an NCCL call it does not wrap made it): the call
 * goes to NCCL unchanged, so the job runs as it would without the shim, and the control
 * block counts it, so that a cut refuses to move a job whose communicators it cannot
 * re-create. */
struct pitstop_lib *pitstop_foreign(const char *call, const void *comm, struct pitstop_lib *L) {
  if (!comm) return L; /* NULL is no communicator: NCCL answers it as it would without the shim */
  for (int i = 0; i < nvcomms; i++) /* one of ours, seen from a thread of NCCL's own */
    if (vcomms[i]->real == (ncclComm_t)comm) return vcomms[i]->lib;
  struct pitstop_ctl *c = pitstop_ctl_get();
  if (c) __atomic_add_fetch(&c->foreign, 1, __ATOMIC_RELAXED);
  if (pitstop_first_time(call))
    fprintf(stderr, "pitstop shim: %s was given a communicator the shim did not create (%p); passing it to NCCL "
                    "unchanged (the job runs, but pitstop cannot move it)\n", call, comm);
  return L;
}

void pitstop_unmovable(const char *call, const char *why) {
  char note[512];
  snprintf(note, sizeof note, "the program called %s: %s", call, why);
  pitstop_refuse(note);
}

ncclResult_t pitstop_missing(const char *call) {
  if (pitstop_first_time(call))
    fprintf(stderr, "pitstop shim: the NCCL library behind the shim has no %s (older than the caller expects); "
                    "returning ncclInvalidUsage\n", call);
  return ncclInvalidUsage;
}

/* ---- reduction operators the program makes (ncclRedOpCreatePreMulSum) ------------------------ */
/* PyTorch makes a PREMUL_SUM operator, issues one collective with it and destroys it, so at a cut
 * (between collectives) none is usually alive; a program may also keep one across collectives.
 * Either way each live one is recorded with its creation arguments and made again on the rebuilt
 * communicator, and the value the program holds is translated to NCCL's new one in the calls that
 * take an operator: nothing to refuse. */
static size_t scalarSize(ncclDataType_t t) {
  switch ((int)t) {
    case ncclInt8: case ncclUint8: case 10: case 11: return 1; /* 10, 11: NCCL 2.24's 8-bit floats */
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

static struct pitstop_redop *findRedop(struct vcomm *v, ncclRedOp_t virt) {
  if (!v->redops) return NULL;
  for (int i = 0; i < PITSTOP_MAX_REDOPS; i++)
    if (v->redops[i].alive && v->redops[i].virt == virt) return &v->redops[i];
  return NULL;
}

ncclRedOp_t pitstop_redop_slow(struct vcomm *v, ncclRedOp_t op) {
  struct pitstop_redop *e = findRedop(v, op);
  return e ? e->real : op; /* not one the shim recorded: NCCL answers it as it would */
}

/* Record an operator NCCL just made (its value in *op): the value the program gets is NCCL's,
 * unless that is already the program's value for another live operator (NCCL's values change at a
 * rebuild), then one of the shim's. */
static void recordRedop(struct vcomm *v, ncclRedOp_t *op, const void *scalar, ncclDataType_t type,
                        ncclScalarResidence_t residence) {
  size_t size = scalarSize(type);
  if (!size || (residence != ncclScalarDevice && residence != ncclScalarHostImmediate)) {
    pitstop_unmovable("ncclRedOpCreatePreMulSum", "an operator of a datatype or residence the shim does not know, "
                                                  "which it could not make again after a move");
    return;
  }
  if (!v->redops && !(v->redops = calloc(PITSTOP_MAX_REDOPS, sizeof *v->redops))) {
    pitstop_unmovable("ncclRedOpCreatePreMulSum", "no memory to record the operator, which a move would lose");
    return;
  }
  struct pitstop_redop *e = NULL;
  for (int i = 0; i < PITSTOP_MAX_REDOPS && !e; i++) if (!v->redops[i].alive) e = &v->redops[i];
  if (!e) {
    pitstop_unmovable("ncclRedOpCreatePreMulSum", "more live reduction operators on one communicator than the shim "
                                                  "records (64): a move could not make them all again");
    return;
  }
  ncclRedOp_t virt = *op;
  while (findRedop(v, virt)) virt = (ncclRedOp_t)((int)virt < 0x7ffffffe ? (int)virt + 1 : (int)ncclNumOps);
  memset(e, 0, sizeof *e);
  e->virt = virt; e->real = *op; e->type = type; e->residence = residence;
  if (residence == ncclScalarHostImmediate) memcpy(e->value, scalar, size);
  else e->ptr = (void *)scalar;
  e->alive = 1;
  *op = virt;
}

ncclResult_t pitstop_redop_create(struct pitstop_lib *L, ncclRedOp_t *op, void *scalar, ncclDataType_t datatype,
                                  ncclScalarResidence_t residence, ncclComm_t comm) {
  struct vcomm *v = pitstop_v(comm);
  if (!v) {
    struct pitstop_lib *T = pitstop_foreign("ncclRedOpCreatePreMulSum", comm, L);
    return T->fn.ncclRedOpCreatePreMulSum ? T->fn.ncclRedOpCreatePreMulSum(op, scalar, datatype, residence, comm)
                                          : pitstop_missing("ncclRedOpCreatePreMulSum");
  }
  L = pitstop_in = v->lib;
  if (!L->fn.ncclRedOpCreatePreMulSum) return pitstop_missing("ncclRedOpCreatePreMulSum");
  pthread_mutex_lock(&pitstop_real_lock);
  ncclResult_t r = v->real ? L->fn.ncclRedOpCreatePreMulSum(op, scalar, datatype, residence, v->real)
                           : ncclInvalidUsage; /* between a cut's destroy and its rebuild */
  if (r == ncclSuccess && op && scalar) recordRedop(v, op, scalar, datatype, residence);
  pthread_mutex_unlock(&pitstop_real_lock);
  return r;
}

ncclResult_t pitstop_redop_destroy(struct pitstop_lib *L, ncclRedOp_t op, ncclComm_t comm) {
  struct vcomm *v = pitstop_v(comm);
  if (!v) {
    struct pitstop_lib *T = pitstop_foreign("ncclRedOpDestroy", comm, L);
    return T->fn.ncclRedOpDestroy ? T->fn.ncclRedOpDestroy(op, comm) : pitstop_missing("ncclRedOpDestroy");
  }
  L = pitstop_in = v->lib;
  if (!L->fn.ncclRedOpDestroy) return pitstop_missing("ncclRedOpDestroy");
  pthread_mutex_lock(&pitstop_real_lock);
  struct pitstop_redop *e = findRedop(v, op);
  /* between a cut's destroy and its rebuild the operator died with its communicator: only forgotten */
  ncclResult_t r = v->real ? L->fn.ncclRedOpDestroy(e ? e->real : op, v->real) : e ? ncclSuccess : ncclInvalidUsage;
  if (r == ncclSuccess && e) e->alive = 0;
  pthread_mutex_unlock(&pitstop_real_lock);
  return r;
}

/* Make every live operator of v again on its rebuilt communicator `real`. */
static ncclResult_t remakeRedops(struct vcomm *v, ncclComm_t real) {
  if (!v->redops) return ncclSuccess;
  for (int i = 0; i < PITSTOP_MAX_REDOPS; i++) {
    struct pitstop_redop *e = &v->redops[i];
    if (!e->alive) continue;
    pitstop_in = v->lib;
    ncclRedOp_t made;
    ncclResult_t r = v->lib->fn.ncclRedOpCreatePreMulSum(
        &made, e->residence == ncclScalarDevice ? e->ptr : (void *)e->value, e->type, e->residence, real);
    if (r != ncclSuccess) return r;
    e->real = made;
  }
  return ncclSuccess;
}

ncclResult_t pitstop_destroy(struct pitstop_lib *L, ncclComm_t comm, int how) {
  struct vcomm *v = pitstop_v(comm);
  if (!v) {
    struct pitstop_lib *T =
        pitstop_foreign(how == 2 ? "ncclCommFinalize" : how == 1 ? "ncclCommAbort" : "ncclCommDestroy", comm, L);
    return how == 2 ? T->fn.ncclCommFinalize(comm) : how == 1 ? T->fn.ncclCommAbort(comm) : T->fn.ncclCommDestroy(comm);
  }
  L = pitstop_in = v->lib;
  ncclResult_t r = ncclSuccess;
  if (how == 2) return v->real ? L->fn.ncclCommFinalize(v->real) : ncclSuccess;
  pthread_mutex_lock(&pitstop_real_lock);
  if (v->real) r = how == 1 ? L->fn.ncclCommAbort(v->real) : L->fn.ncclCommDestroy(v->real);
  v->real = NULL;
  pthread_mutex_unlock(&pitstop_real_lock);
  v->appDestroyed = 1;
  if (v->redops) memset(v->redops, 0, PITSTOP_MAX_REDOPS * sizeof *v->redops); /* its operators end with it */
  pitstop_ctl->comms[v->idx].alive = 0;
  return r;
}

/* ---- the consistent cut --------------------------------------------------------------- */
static void destroyAll(void) {
  pthread_mutex_lock(&pitstop_real_lock);
  for (int i = 0; i < nvcomms; i++)
    if (vcomms[i]->real) {
      pitstop_in = vcomms[i]->lib;
      vcomms[i]->lib->fn.ncclCommDestroy(vcomms[i]->real);
      vcomms[i]->real = NULL;
    }
  pthread_mutex_unlock(&pitstop_real_lock);
}

/* A nonblocking communicator being re-created: wait until NCCL says it is ready (the
 * next one may be split from it), within the shim's deadline. */
static ncclResult_t commReady(struct pitstop_lib *L, ncclComm_t c) {
  double end = now() + deadlineS();
  ncclResult_t st = ncclInProgress;
  while (now() < end) {
    ncclResult_t r = L->fn.ncclCommGetAsyncError(c, &st);
    if (r != ncclSuccess) return r;
    if (st != ncclInProgress) return st;
    struct timespec ms = {0, 1000000};
    nanosleep(&ms, NULL);
  }
  sayInBlock("a re-created communicator was not ready within %s (%ld s)", "the deadline", (long)deadlineS());
  return ncclRemoteError;
}

typedef uint8_t newids_t[PITSTOP_MAX_COMMS][128];

static void dropAll(ncclComm_t *tmp) {
  for (int i = 0; i < nvcomms; i++)
    if (tmp[i]) { pitstop_in = vcomms[i]->lib; vcomms[i]->lib->fn.ncclCommDestroy(tmp[i]); tmp[i] = NULL; }
}

/* Every communicator made again into tmp, in creation order (splits replayed on their re-created
 * parents), INIT ones with the given ids.  On a failure nothing is left made. */
static ncclResult_t makeAll(newids_t ids, ncclComm_t *tmp) {
  struct pitstop_ctl *c = pitstop_ctl;
  int n = nevents;
  for (int e = 0; e < n; e++) {
    struct event ev = events[e];
    ncclResult_t r;
    if (ev.kind == KIND_INIT) {
      struct vcomm *v = vcomms[ev.idx];
      struct pitstop_lib *L = pitstop_in = v->lib;
      struct pitstop_comm_ctl *cc = &c->comms[ev.idx];
      ncclUniqueId id;
      memcpy(id.internal, ids[ev.idx], sizeof id.internal);
      r = v->scalable ? L->fn.ncclCommInitRankScalable(&tmp[ev.idx], cc->nranks, cc->rank, 1, &id, v->config)
        : v->hasConfig ? L->fn.ncclCommInitRankConfig(&tmp[ev.idx], cc->nranks, id, cc->rank, v->config)
                       : L->fn.ncclCommInitRank(&tmp[ev.idx], cc->nranks, id, cc->rank);
      if (r == ncclInProgress) r = commReady(L, tmp[ev.idx]);
    } else {
      struct pitstop_lib *L = pitstop_in = vcomms[ev.parent]->lib; /* the parent's library makes its splits */
      ncclComm_t out = NULL;
      r = L->fn.ncclCommSplit(tmp[ev.parent], ev.color, ev.key, &out,
                              ev.idx >= 0 && vcomms[ev.idx]->hasConfig ? vcomms[ev.idx]->config : NULL);
      if (r == ncclInProgress) r = out ? commReady(L, out) : ncclSuccess;
      if (ev.idx >= 0) tmp[ev.idx] = out;
      else if (out) L->fn.ncclCommDestroy(out);
    }
    if (r != ncclSuccess) {
      dropAll(tmp);
      return r;
    }
  }
  return ncclSuccess;
}

/* The made communicators behind the program's handles, with its live reduction operators made
 * again on them; on a failure nothing is left made. */
static ncclResult_t installAll(ncclComm_t *tmp) {
  for (int i = 0; i < nvcomms; i++) { /* the program's reduction operators, on the new communicators */
    if (vcomms[i]->appDestroyed || !tmp[i]) continue;
    ncclResult_t r = remakeRedops(vcomms[i], tmp[i]);
    if (r != ncclSuccess) {
      sayInBlock("re-creating a reduction operator failed (%s %ld)", "ncclResult_t", (long)r);
      dropAll(tmp);
      return r;
    }
  }
  pthread_mutex_lock(&pitstop_real_lock);
  for (int i = 0; i < nvcomms; i++) {
    if (vcomms[i]->appDestroyed) {
      if (tmp[i]) { pitstop_in = vcomms[i]->lib; vcomms[i]->lib->fn.ncclCommDestroy(tmp[i]); }
      continue;
    }
    vcomms[i]->real = tmp[i]; /* the application's handle now points at the new communicator */
  }
  pthread_mutex_unlock(&pitstop_real_lock);
  return ncclSuccess;
}

/* The ids the agent wrote for this rebuild, copied once as it begins. */
static void takeIds(newids_t ids) {
  for (int i = 0; i < nvcomms; i++) memcpy(ids[i], pitstop_ctl->comms[i].newid, sizeof ids[i]);
}

static void rebuilt(ncclResult_t r) {
  struct pitstop_ctl *c = pitstop_ctl;
  c->error = (int32_t)r;
  c->state = r == ncclSuccess ? ST_REBUILT : ST_FAILED;
  sayInBlock("rebuilt communicators: %s (%ld)", r == ncclSuccess ? "ok" : "FAILED", (long)r);
}

/* ---- the early rewire: a rebuild on a thread of the shim (CMD_PREBUILD) ----------------------
 * A move's surviving ranks re-create their communicators while the leaving ranks are captured and
 * restored: each NCCL init waits in its bootstrap until the restored ranks join with the same ids.
 * On a thread, so that the parked thread keeps its deadline and its command loop: a destroy
 * abandons the rebuild (an NCCL init cannot be called off; what it makes once it returns is
 * destroyed, never installed), and a rank whose agent vanished still gives the program
 * ncclRemoteError at PITSTOP_SHIM_DEADLINE_S instead of waiting in NCCL's bootstrap for good.
 * NCCL creates a communicator on the calling thread's current CUDA device: the thread is given
 * the parked thread's current context (CUDA's driver, where it is loaded already). */
struct rebuild {
  newids_t ids;  /* its own copy: ids written for a later rebuild never reach an abandoned one */
  void *cuctx;
  int abandoned; /* under rebuildLock */
};
static pthread_mutex_t rebuildLock = PTHREAD_MUTEX_INITIALIZER;
static struct rebuild *underWay; /* the rebuild the parked thread waits for (under rebuildLock) */

typedef int (*cuctx_get_fn)(void **);
typedef int (*cuctx_set_fn)(void *);

/* The CUDA driver's entry point `name`, where libcuda is loaded already (never loaded for this). */
static void *cudaDriver(const char *name) {
  void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  void *f = h ? dlsym(h, name) : NULL;
  if (h) dlclose(h);
  return f;
}

static void *rebuildMain(void *arg) {
  struct rebuild *job = arg;
  if (job->cuctx) {
    cuctx_set_fn set = (cuctx_set_fn)cudaDriver("cuCtxSetCurrent");
    if (set) set(job->cuctx);
  }
  ncclComm_t tmp[PITSTOP_MAX_COMMS] = {0};
  ncclResult_t r = makeAll(job->ids, tmp);
  pthread_mutex_lock(&rebuildLock);
  if (job->abandoned) { /* the parked thread gave up on it: nothing of it reaches the program */
    dropAll(tmp);
  } else {
    if (r == ncclSuccess) r = installAll(tmp);
    rebuilt(r);
    underWay = NULL;
  }
  pthread_mutex_unlock(&rebuildLock);
  free(job);
  return NULL;
}

static void prebuild(void) {
  struct pitstop_ctl *c = pitstop_ctl;
  struct rebuild *job = calloc(1, sizeof *job);
  if (!job) { rebuilt(ncclSystemError); return; }
  takeIds(job->ids);
  cuctx_get_fn get = (cuctx_get_fn)cudaDriver("cuCtxGetCurrent");
  if (get && get(&job->cuctx) != 0) job->cuctx = NULL;
  pthread_mutex_lock(&rebuildLock);
  underWay = job;
  c->state = ST_REBUILDING;
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
  pthread_t t;
  int made = pthread_create(&t, &at, rebuildMain, job) == 0;
  pthread_attr_destroy(&at);
  if (made) sayInBlock("rebuilding communicators on a thread of the %s (%ld of them)", "shim", nvcomms);
  else underWay = NULL;
  pthread_mutex_unlock(&rebuildLock);
  if (!made) { /* no thread to be had: the same rebuild on this one */
    ncclComm_t tmp[PITSTOP_MAX_COMMS] = {0};
    ncclResult_t r = makeAll(job->ids, tmp);
    rebuilt(r == ncclSuccess ? installAll(tmp) : r);
    free(job);
  }
}

/* Give up on the rebuild under way, if one is: the block says DESTROYED at once (no real
 * communicator behind the program's handles, nothing pending), and what the thread makes is
 * destroyed when NCCL returns it.  1 if one was under way. */
static int abandonRebuild(void) {
  pthread_mutex_lock(&rebuildLock);
  struct rebuild *job = underWay;
  if (job) {
    job->abandoned = 1;
    underWay = NULL;
    pitstop_ctl->state = ST_DESTROYED;
  }
  pthread_mutex_unlock(&rebuildLock);
  return job != NULL;
}

static void makeIds(int asked) {
  struct pitstop_ctl *c = pitstop_ctl;
  for (int i = 0; i < nvcomms; i++) {
    struct pitstop_comm_ctl *cc = &c->comms[i];
    cc->myid_set = 0;
    if (cc->kind != KIND_INIT || (asked ? !cc->want_id : cc->rank != 0)) continue;
    ncclUniqueId id;
    struct pitstop_lib *L = pitstop_in = vcomms[i]->lib; /* an id of the library that rebuilds it */
    if (L->fn.ncclGetUniqueId(&id) == ncclSuccess) { memcpy(cc->myid, id.internal, sizeof cc->myid); cc->myid_set = 1; }
  }
  c->state = ST_IDS_READY;
}

static void runCommand(uint32_t cmd) {
  struct pitstop_ctl *c = pitstop_ctl;
  switch (cmd) {
    case CMD_DESTROY:
      if (abandonRebuild()) sayInBlock("abandoned the rebuild under %s (%ld communicators)", "way", nvcomms);
      destroyAll();
      c->state = ST_DESTROYED;
      sayInBlock("destroyed %s communicators (%ld)", "all", nvcomms);
      break;
    case CMD_GENIDS: /* rank 0 of each INIT communicator */
      makeIds(0);
      break;
    case CMD_MAKEIDS: /* those the coordinator chose: a member that stays, in an early rewire */
      makeIds(1);
      break;
    case CMD_TRIM:
      pitstop_trim(c);
      break;
    case CMD_REBUILD:
    case CMD_PREBUILD: {
      if (c->state == ST_REBUILT) break; /* rebuilt already, with these ids (an early rewire's survivor) */
      if (cmd == CMD_PREBUILD) { prebuild(); break; }
      newids_t ids;
      ncclComm_t tmp[PITSTOP_MAX_COMMS] = {0};
      takeIds(ids);
      ncclResult_t r = makeAll(ids, tmp);
      rebuilt(r == ncclSuccess ? installAll(tmp) : r);
      break;
    }
    default:
      break;
  }
}

/* May this call go ahead under the current targets?  Collectives: while below the
 * communicator's target.  Sends and receives: while below the per-peer allowance the
 * coordinator derived from the peer's own counts (the channel a->b is balanced when
 * a's sends to b equal b's receives from a). */
static int allowed(struct pitstop_comm_ctl *cc, int op, int peer) {
  if (op == OP_COLL) return cc->target != PITSTOP_TARGET_UNSET && cc->issued < cc->target;
  if (peer < 0 || peer >= PITSTOP_MAX_PEERS) return 1; /* untracked peer: never blocks the cut */
  uint64_t t = op == OP_SEND ? cc->send_target[peer] : cc->recv_target[peer];
  uint64_t n = op == OP_SEND ? cc->sent[peer] : cc->recvd[peer];
  return t != PITSTOP_TARGET_UNSET && n < t;
}

/* A call entry during a quiesce: proceed while allowed, else park and obey. */
ncclResult_t pitstop_quiesce_point(struct vcomm *v, int op, int peer) {
  struct pitstop_ctl *c = pitstop_ctl;
  uint32_t gen = c->request;
  if (gen == pitstop_seen) return ncclSuccess;
  static uint32_t looked;
  if (looked != gen) { /* once per cut, before this rank parks: a reference bound past the shim since? */
    looked = gen;
    pitstop_scan_now();
  }
  c->ack = gen;
  int idx = v ? v->idx : -1;
  double start = now(), limit = deadlineS();
  int parked = 0;
  for (;;) {
    if (c->request != gen) { gen = c->request; c->ack = gen; start = now(); }
    uint32_t seq = c->command_seq;
    /* While a rebuild runs on the shim's thread, a command waits for its end; a destroy alone
     * abandons it. */
    if (seq != c->done_seq && (c->state != ST_REBUILDING || c->command == CMD_DESTROY)) {
      uint32_t cmd = c->command;
      if (cmd == CMD_RESUME || cmd == CMD_RELEASE) {
        if (cmd == CMD_RELEASE && c->state == ST_DESTROYED) { c->done_seq = seq; continue; } /* needs a rebuild */
        if (parked) c->resumed_ns = wallNs();
        c->done_seq = seq;
        pitstop_seen = gen;
        c->state = ST_RUNNING;
        c->parked_comm = -1;
        return ncclSuccess;
      }
      runCommand(cmd);
      c->done_seq = seq;
      start = now();
      continue;
    }
    int destroyed = c->state == ST_DESTROYED || c->state == ST_IDS_READY || c->state == ST_FAILED ||
                    c->state == ST_REBUILDING;
    if (!destroyed && c->state != ST_REBUILT && idx >= 0 && allowed(&c->comms[idx], op, peer)) {
      /* Publish "leaving" before trusting the allowance (Dekker with the coordinator, which
       * writes final targets and then re-reads states): either it sees us leave, or we see
       * its new targets and stay. */
      uint32_t was = c->state;
      c->state = ST_RUNNING;
      __atomic_thread_fence(__ATOMIC_SEQ_CST);
      if (allowed(&c->comms[idx], op, peer)) { c->parked_comm = -1; return ncclSuccess; } /* the cut is further on */
      c->state = was;
      continue;
    }
    if (!parked) {
      c->parked_ns = wallNs();
      c->resumed_ns = 0;
      c->parked_op = op; c->parked_peer = peer; c->parked_comm = idx;
      if (!destroyed && c->state != ST_REBUILT) c->state = ST_PARKED;
      parked = 1;
    }
    if (now() - start > limit) {
      if (c->state == ST_REBUILDING) { /* the restored ranks never joined: the program is told */
        if (!abandonRebuild()) continue; /* it ended just now: look again */
        sayInBlock("quiesce %s: the early rebuild did not finish within %ld s; abandoned", "failed", (long)limit);
        fprintf(stderr, "pitstop shim: the communicators' rebuild did not finish within %.0f s "
                        "(PITSTOP_SHIM_DEADLINE_S): no word from the agent and no rank joined; returning "
                        "ncclRemoteError\n", limit);
        return ncclRemoteError;
      }
      if (!destroyed) { /* the agent vanished: carry on as if nothing happened */
        pitstop_seen = gen; c->state = ST_RUNNING; c->parked_comm = -1;
        sayInBlock("quiesce %s: no word from the agent for %ld s; resumed", "timed out", (long)limit);
        return ncclSuccess;
      }
      sayInBlock("quiesce %s: communicators gone and no rebuild for %ld s", "failed", (long)limit);
      return ncclRemoteError;
    }
    struct timespec ts = {0, 500000};
    nanosleep(&ts, NULL);
  }
}

/* The slow half of pitstop_enter (fastpath.h): a quiesce is requested.  Groups are checked
 * once, at their first operation, so they stay whole. */
ncclResult_t pitstop_enter_slow(struct vcomm *v, int op, int peer) {
  if (groupDepth > 0) {
    if (groupChecked) return ncclSuccess;
    groupChecked = 1;
  }
  return pitstop_quiesce_point(v, op, peer);
}

void pitstop_group_start(void) { if (groupDepth++ == 0) groupChecked = 0; }
void pitstop_group_end(void) { if (groupDepth > 0) groupDepth--; }
