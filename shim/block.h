/* The shim's control block (ctl.h) and the state every part of the shim shares, defined in
 * block.c, which needs nothing else of the shim. */
#ifndef PITSTOP_BLOCK_H
#define PITSTOP_BLOCK_H
#include "ctl.h"

#include <pthread.h>
#include <stdint.h>

struct pitstop_lib;

extern struct pitstop_ctl *pitstop_ctl;
/* the quiesce generation this rank has finished with */
extern uint32_t pitstop_seen;
/* Held while real communicators are destroyed or swapped, and by calls that may come from
 * another thread (PyTorch's watchdog polls ncclCommGetAsyncError): none sees a freed one. */
extern pthread_mutex_t pitstop_real_lock;
/* Non-NULL while this thread is inside the shim: the library whose call is under way.  NCCL's
 * calls to its own API (through the PLT, back into the shim) then go straight to it. */
extern __thread struct pitstop_lib *pitstop_in __attribute__((tls_model("initial-exec"))); /* preloaded: static TLS */

/* The control block, made on first use. */
struct pitstop_ctl *pitstop_ctl_get(void);
/* Whether a note is said for the first time (the application's stderr is the operator's only view). */
int pitstop_first_time(const char *call);
/* Something the shim cannot stand in front of (dl.c), or a call that leaves state a rebuild would
 * not re-create: the process is marked unmovable (sticky) with this note, said once. */
void pitstop_refuse(const char *note);
#endif
