/* Internal interface between the generated wrappers (build/wrappers.c) and shim.c. */
#ifndef PITSTOP_SHIM_H
#define PITSTOP_SHIM_H
#include "../native/nccl.h"
#include "ctl.h"

#define VCOMM_MAGIC 0x70697473u /* "pits" */

struct vcomm {
  uint32_t magic;
  int idx;
  ncclComm_t real;
  ncclConfig_t config;   /* a copy of the caller's config, at most its own size */
  int hasConfig;
  int appDestroyed;
  uint64_t splits;
};

extern struct pitstop_ctl *pitstop_ctl;
extern uint32_t pitstop_seen;

struct vcomm *pitstop_v(ncclComm_t comm);
ncclResult_t pitstop_init(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t *config, int withConfig);
ncclResult_t pitstop_split(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config);
ncclResult_t pitstop_destroy(ncclComm_t comm, int how); /* 0 destroy, 1 abort, 2 finalize */
ncclResult_t pitstop_enter(struct vcomm *v, int op, int peer);
ncclResult_t pitstop_quiesce_point(struct vcomm *v, int op, int peer);
void pitstop_count(struct vcomm *v, int op, int peer);
void pitstop_group_start(void);
void pitstop_group_end(void);

/* real_<name>: the next definition of each NCCL function (dlsym RTLD_NEXT), from wrappers.c */
#include "real.h" /* generated into build/ */
#endif
