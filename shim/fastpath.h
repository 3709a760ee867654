/* The collective path, inline in every generated wrapper (build/wrappers.c, and nothing else): a
 * handle check, one load and compare, and the count of the operation.  Its slow halves are in
 * shim.c (a quiesce under way; a reduction operator the program made). */
#ifndef PITSTOP_FASTPATH_H
#define PITSTOP_FASTPATH_H
#include "nccl_shim.h"

/* The reduction operator to give NCCL for the program's: built-in ones as they are (one compare);
 * one the program made, NCCL's current value for it. */
static inline ncclRedOp_t pitstop_redop(struct vcomm *v, ncclRedOp_t op) {
  return __builtin_expect((int)op < (int)ncclNumOps, 1) ? op : pitstop_redop_slow(v, op);
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

#endif
