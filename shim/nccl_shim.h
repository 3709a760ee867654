/* The shim's internal interface: its types, limits and calls, shared by shim.c, dl.c, trim.c and
 * the generated wrappers (build/wrappers.c).  The collective path's inline half is fastpath.h,
 * which only the wrappers include; the control block and the shim's shared state are block.h. */
#ifndef PITSTOP_SHIM_H
#define PITSTOP_SHIM_H
#include "../native/nccl.h"
#include "block.h"
#include "ctl.h"

#include <pthread.h>
#include <stddef.h>
#include <time.h>

#define VCOMM_MAGIC 0x70697473u /* "pits" */
#define PITSTOP_MAX_CONFIG 4096 /* bytes of a caller's ncclConfig_t kept for replay */
#define PITSTOP_MAX_LIBS 4      /* NCCL libraries one process may reach (gen_wrappers.py MAX_LIBS) */

/* struct pitstop_nccl: one library's real function per NCCL call, from wrappers.c */
#include "real.h" /* generated into build/ */
#if PITSTOP_GEN_MAX_LIBS != PITSTOP_MAX_LIBS
#error "nccl_shim.h and gen_wrappers.py disagree on PITSTOP_MAX_LIBS"
#endif

/* One NCCL library the program reaches.  Slot 0 answers the calls that reach the shim by name
 * (the PLT, dlsym(RTLD_DEFAULT)): the next definition in the global scope, else the loaded
 * libnccl (dl.c, slot 0).  Further slots are other copies the program reached through dlsym on a
 * handle of its own (dl.c).  A communicator remembers its library: its calls go there. */
struct pitstop_lib {
  struct pitstop_nccl fn;
  int ready;                /* fn filled: read with acquire, written with release */
  const void *base;         /* the library's load address (dladdr's dli_fbase); NULL: not known */
  char path[256];
};
extern struct pitstop_lib pitstop_libs[PITSTOP_MAX_LIBS];

#define PITSTOP_MAX_REDOPS 64 /* live reduction operators per communicator the shim re-creates */

/* A reduction operator the program made on a communicator (ncclRedOpCreatePreMulSum): how, so
 * that a rebuild makes it again on the new communicator.  The program keeps the value it was
 * given (virt); NCCL's value on the current real communicator (real) may differ after a rebuild
 * (NCCL numbers operators per communicator and mangles them with its address). */
struct pitstop_redop {
  int alive;
  ncclRedOp_t virt, real;
  ncclDataType_t type;
  ncclScalarResidence_t residence;
  unsigned char value[8]; /* ncclScalarHostImmediate: the scalar as it was at creation */
  void *ptr;              /* ncclScalarDevice: its address (device memory keeps its address across a move) */
};

struct vcomm {
  uint32_t magic;
  int idx;
  ncclComm_t real;
  struct pitstop_lib *lib; /* the library that made it (and makes it again) */
  ncclConfig_t *config;  /* the caller's config, copied byte for byte up to its own size, for replay */
  int hasConfig;
  int scalable;          /* made by ncclCommInitRankScalable */
  int pendingInfo;       /* a nonblocking split still in progress: its size and rank are not known yet */
  int appDestroyed;
  uint64_t splits;
  struct pitstop_redop *redops; /* PITSTOP_MAX_REDOPS of them once the first is made; never moved */
};

ncclResult_t pitstop_init(struct pitstop_lib *L, ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                          ncclConfig_t *config, int withConfig);
ncclResult_t pitstop_split(struct pitstop_lib *L, ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                           ncclConfig_t *config);
ncclResult_t pitstop_destroy(struct pitstop_lib *L, ncclComm_t comm, int how); /* 0 destroy, 1 abort, 2 finalize */
ncclResult_t pitstop_async_error(struct pitstop_lib *L, ncclComm_t comm, ncclResult_t *asyncError);
ncclResult_t pitstop_init_scalable(struct pitstop_lib *L, ncclComm_t *comm, int nranks, int rank, int nId,
                                   ncclUniqueId *ids, ncclConfig_t *config);
/* A handle the shim did not make: counted, said once; the library to pass it to (that of the
 * communicator of ours it is the real handle of, when NCCL's own thread asks, else L). */
struct pitstop_lib *pitstop_foreign(const char *call, const void *comm, struct pitstop_lib *L);
ncclResult_t pitstop_missing(const char *call); /* a call the NCCL behind the shim lacks */
/* A call that leaves state in the real communicator a rebuild would not re-create: the process
 * is marked unmovable (sticky), the call named once. */
void pitstop_unmovable(const char *call, const char *why);
/* A 64-bit mix of two values (a communicator's key, from its unique ids or its split). */
static inline uint64_t pitstop_mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdull;
}
/* A call's communicator error in a job that snapshots protect (ctl.h, version 4): the thread parks
 * until the recovery ends the process, the protection is withdrawn or the deadline passes; then,
 * or for any other result, r.  v: NULL for a group's end. */
ncclResult_t pitstop_peer_lost(struct vcomm *v, ncclResult_t r, const char *call);
ncclResult_t pitstop_quiesce_point(struct vcomm *v, int op, int peer);

ncclResult_t pitstop_redop_create(struct pitstop_lib *L, ncclRedOp_t *op, void *scalar, ncclDataType_t datatype,
                                  ncclScalarResidence_t residence, ncclComm_t comm);
ncclResult_t pitstop_redop_destroy(struct pitstop_lib *L, ncclRedOp_t op, ncclComm_t comm);
/* The slow halves of the collective path (fastpath.h): a quiesce is requested; a reduction
 * operator the program made.  Declared here, where shim.c that defines them sees them too. */
ncclResult_t pitstop_enter_slow(struct vcomm *v, int op, int peer);
ncclRedOp_t pitstop_redop_slow(struct vcomm *v, ncclRedOp_t op);

/* One of the shim's handles, or NULL (a handle the shim did not make). */
static inline struct vcomm *pitstop_v(ncclComm_t comm) {
  struct vcomm *v = (struct vcomm *)comm;
  return (v && v->magic == VCOMM_MAGIC) ? v : NULL;
}

void pitstop_group_start(void);
void pitstop_group_end(void);
void pitstop_trim(struct pitstop_ctl *c); /* trim.c */

/* dl.c: fill slot 0 (the library behind the shim's exported names) on first use; 0 when
 * some NCCL lies behind the shim, else -1 and said once. */
int pitstop_resolve(struct pitstop_lib *L);
int pitstop_resolve_quiet(struct pitstop_lib *L); /* ... and says nothing when none */
void pitstop_no_nccl(void);
#define PITSTOP_NO_NCCL_MSG "pitstop shim: no NCCL library found behind the shim (set PITSTOP_NCCL_LIBRARY)"

/* dl.c: the dynamic loader's side. */
struct pitstop_real_dl {
  void *(*dlsym)(void *, const char *);
  void *(*dlvsym)(void *, const char *, const char *);
  void *(*dlopen)(const char *, int);
};
extern struct pitstop_real_dl pitstop_dl; /* libc's own, found in its symbol table (never the shim's) */
void pitstop_dl_init(void);
/* The slot of the loaded NCCL library whose code holds addr, registering it if it is a libnccl
 * the shim has not met yet; NULL if addr is in the shim or in no libnccl. */
struct pitstop_lib *pitstop_lib_at(const void *addr);
/* Look at the objects loaded since the last look: NCCL the shim cannot stand in front of marks the
 * process unmovable; references to NCCL bound past the shim are bound to it. */
void pitstop_scan(void);
void pitstop_scan_now(void); /* ... whatever the loader's counts say (lazy bindings made since) */
/* Is the object loaded at this address a libnccl the shim stands in front of? */
int pitstop_is_libnccl(const void *base);
/* A loaded object's definition of name (its dynamic symbol table, default version), or NULL. */
void *pitstop_elf_sym(const void *base, const char *name);
#endif
