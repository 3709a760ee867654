/* Internal interface between the generated wrappers (build/wrappers.c) and shim.c. */
#ifndef PITSTOP_SHIM_H
#define PITSTOP_SHIM_H
#include "../native/nccl.h"
#include "ctl.h"

#include <pthread.h>
#include <stddef.h>
#include <time.h>

#define VCOMM_MAGIC 0x70697473u /* "pits" */
#define PITSTOP_MAX_CONFIG 4096 /* bytes of a caller's ncclConfig_t kept for replay */

struct vcomm {
  uint32_t magic;
  int idx;
  ncclComm_t real;
  ncclConfig_t *config;  /* the caller's config, copied byte for byte up to its own size, for replay */
  int hasConfig;
  int scalable;          /* made by ncclCommInitRankScalable */
  int pendingInfo;       /* a nonblocking split still in progress: its size and rank are not known yet */
  int appDestroyed;
  uint64_t splits;
};

extern struct pitstop_ctl *pitstop_ctl;
/* Held while real communicators are destroyed or swapped, and by calls that may come from
 * another thread (PyTorch's watchdog polls ncclCommGetAsyncError): none sees a freed one. */
extern pthread_mutex_t pitstop_real_lock;
/* > 0 while this thread is inside the shim: NCCL's calls to its own API then pass through. */
extern __thread int pitstop_reentry __attribute__((tls_model("initial-exec"))); /* preloaded: static TLS */
extern uint32_t pitstop_seen;

ncclResult_t pitstop_init(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t *config, int withConfig);
ncclResult_t pitstop_split(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config);
ncclResult_t pitstop_destroy(ncclComm_t comm, int how); /* 0 destroy, 1 abort, 2 finalize */
ncclResult_t pitstop_async_error(ncclComm_t comm, ncclResult_t *asyncError);
ncclResult_t pitstop_init_scalable(ncclComm_t *comm, int nranks, int rank, int nId, ncclUniqueId *ids,
                                   ncclConfig_t *config);
void pitstop_foreign(const char *call, const void *comm); /* a handle the shim did not make: counted, said once */
ncclResult_t pitstop_missing(const char *call); /* a call the NCCL behind the shim lacks */
ncclResult_t pitstop_enter_slow(struct vcomm *v, int op, int peer);
ncclResult_t pitstop_quiesce_point(struct vcomm *v, int op, int peer);

/* The collective path, inline: a handle check, one load and compare, one store. */
static inline struct vcomm *pitstop_v(ncclComm_t comm) {
  struct vcomm *v = (struct vcomm *)comm;
  return (v && v->magic == VCOMM_MAGIC) ? v : NULL;
}

static inline ncclResult_t pitstop_enter(struct vcomm *v, int op, int peer) {
  if (__builtin_expect(!pitstop_ctl || pitstop_ctl->request == pitstop_seen, 1)) return ncclSuccess;
  return pitstop_enter_slow(v, op, peer);
}

/* Count the operation, and sign it into the trail: `call` names the NCCL function (a constant
 * gen_wrappers.py derives from its name), count and type are its arguments (0 where it has none). */
static inline void pitstop_count(struct vcomm *v, int op, int peer, uint32_t call, uint64_t count, int type) {
  struct pitstop_ctl *c = pitstop_ctl;
  struct pitstop_comm_ctl *cc = &c->comms[v->idx];
  if (op == OP_COLL) cc->issued++;
  else if (peer >= 0 && peer < PITSTOP_MAX_PEERS) { if (op == OP_SEND) cc->sent[peer]++; else cc->recvd[peer]++; }
  uint32_t h = call ^ ((uint32_t)v->idx * 0x9e3779b1u) ^ ((uint32_t)(peer + 1) * 0x85ebca6bu);
  h ^= (uint32_t)count * 0xc2b2ae35u ^ (uint32_t)(count >> 32) ^ ((uint32_t)type << 24);
  uint64_t n = c->trail_n;
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t); /* the vDSO: no system call */
  c->trail[n % PITSTOP_TRAIL] = h;
  c->trail_ns[n % PITSTOP_TRAIL] = (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
  c->trail_n = n + 1;
}
void pitstop_group_start(void);
void pitstop_group_end(void);
void pitstop_trim(struct pitstop_ctl *c); /* trim.c */

/* resolve.c: the real definition of an NCCL function, or NULL; said once when none. */
void *pitstop_sym(const char *name);
void pitstop_no_nccl(void);
#define PITSTOP_NO_NCCL_MSG "pitstop shim: no NCCL library found behind the shim (set PITSTOP_NCCL_LIBRARY)"

/* real_<name>: the real definition of each NCCL function (pitstop_sym), from wrappers.c */
#include "real.h" /* generated into build/ */
#endif
