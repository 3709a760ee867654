/* The shim's control block: the only thing the agent and a worker share.
 *
 * One memfd mapping ("pitstop-ctl") per process that uses NCCL.  The agent finds it
 * in /proc/PID/maps and reads and writes it through /proc/PID/mem; the worker
 * only loads and stores.  So the shim has no thread, makes no system call on the
 * collective path, and holds no socket that could cross a checkpoint; CRIU dumps
 * and restores the block with the rest of the process, at the same address.
 *
 * Each field has exactly one writer (A: agent, S: shim).  Layout is fixed and
 * mirrored in service/pitstop/shimctl/layout.py; change both together. */
#ifndef PITSTOP_SHIM_CTL_H
#define PITSTOP_SHIM_CTL_H
#include <stdint.h>

#define PITSTOP_CTL_MAGIC "PITSTOP-CTL-v1"
#define PITSTOP_MAX_COMMS 64
#define PITSTOP_TARGET_UNSET UINT64_MAX
#define PITSTOP_MAX_PEERS 32   /* point-to-point tracked per peer rank below this */
#define PITSTOP_TRAIL 256      /* the last operations' signatures kept (version 2) */

enum { ST_RUNNING = 0, ST_PARKED = 1, ST_DESTROYED = 2, ST_IDS_READY = 3, ST_REBUILT = 4, ST_FAILED = 5,
       ST_REBUILDING = 6 /* version 5: a rebuild under way on a thread of the shim (CMD_PREBUILD) */ };
enum { CMD_NONE = 0, CMD_DESTROY = 1, CMD_GENIDS = 2, CMD_REBUILD = 3, CMD_RESUME = 4, CMD_RELEASE = 5, CMD_TRIM = 6,
       /* version 5, the early rewire (a move's surviving ranks re-create their communicators while the
        * leaving ones are captured and restored): */
       CMD_PREBUILD = 7,   /* rebuild with newid on a thread of the shim; done as soon as it has begun */
       CMD_MAKEIDS = 8 };  /* a fresh id for each INIT communicator whose want_id the agent set */
enum { TRIM_TORCH = 1, TRIM_MEMPOOL = 2 };               /* trim_how: what was released */
enum { TRIM_OK = 0, TRIM_TIMED_OUT = 1, TRIM_RAISED = 2 }; /* trim_error */
enum { KIND_INIT = 1, KIND_SPLIT = 2 };
enum { OP_COLL = 0, OP_SEND = 1, OP_RECV = 2 };
enum { LOST_NONE = 0, LOST_PARKED = 1, LOST_GAVE_UP = 2 }; /* lost: a peer's failure (version 4) */

struct pitstop_comm_ctl {           /* 1344 bytes */
  uint64_t key;                     /* S: same on every member of the communicator */
  volatile uint64_t issued;         /* S: operations issued on it */
  volatile uint64_t target;         /* A: may issue while issued < target */
  int32_t nranks, rank;             /* S */
  int32_t kind, parent;             /* S: KIND_*, parent index for splits */
  int32_t color, key_arg;           /* S: split arguments */
  volatile int32_t alive;           /* S: 1 while the application holds it */
  volatile int32_t newid_set;       /* A: 1 when newid holds the id to rebuild with */
  uint8_t newid[128];               /* A */
  volatile int32_t myid_set;        /* S: 1 when myid holds a fresh id (rank 0 of an INIT comm; CMD_MAKEIDS: the asked) */
  volatile int32_t want_id;         /* A: 1: CMD_MAKEIDS makes this communicator's fresh id here (version 5) */
  uint8_t myid[128];                /* S */
  volatile uint64_t sent[PITSTOP_MAX_PEERS];        /* S: sends issued to each peer */
  volatile uint64_t recvd[PITSTOP_MAX_PEERS];       /* S: receives issued from each peer */
  volatile uint64_t send_target[PITSTOP_MAX_PEERS]; /* A: may send to peer while sent < this */
  volatile uint64_t recv_target[PITSTOP_MAX_PEERS]; /* A: may receive from peer while recvd < this */
};

struct pitstop_ctl {
  char magic[16];                   /* S: PITSTOP_CTL_MAGIC */
  uint32_t version;                 /* S: 5 (4: no early rewire; 3: no lost peers; 2: no refusals; 1: no trail, no pause times) */
  volatile uint32_t ncomms;         /* S */
  volatile uint32_t request;        /* A: quiesce generation; 0 = none */
  volatile uint32_t ack;            /* S: the generation the shim has seen */
  volatile uint32_t state;          /* S: ST_* */
  volatile uint32_t command;        /* A: CMD_* for the current generation */
  volatile uint32_t command_seq;    /* A: bumped with every command */
  volatile uint32_t done_seq;       /* S: the command_seq last carried out */
  volatile int32_t parked_comm;     /* S: index of the comm the parked call is on */
  volatile int32_t error;           /* S: last ncclResult_t of a rebuild, 0 if fine */
  volatile int32_t parked_op;       /* S: OP_* of the call the rank is parked at */
  volatile int32_t parked_peer;     /* S: its peer, for send and receive */
  uint64_t token;                   /* S: random, stable across restore: names this process */
  volatile int32_t in_call;         /* S: 1 while inside a real NCCL call (blocked there, perhaps) */
  volatile int32_t foreign;         /* S: calls seen on communicators the shim did not make */
  char note[176];                   /* S: last thing the shim did, for logs */
  struct pitstop_comm_ctl comms[PITSTOP_MAX_COMMS];
  /* Version 2, appended so that a version-1 block reads as before.  What the job's progress
   * shows without a change to it (service/pitstop/coordinator/progress.py): */
  volatile uint64_t trail_n;        /* S: operations signed into trail so far */
  volatile uint32_t trail[PITSTOP_TRAIL]; /* S: signature of operation i at i % PITSTOP_TRAIL
                                     * (call, communicator, peer, count, type): a training step
                                     * repeats the same run of them, so its length is a step */
  volatile uint64_t parked_ns;      /* S: CLOCK_REALTIME when the rank last parked at a cut */
  volatile uint64_t resumed_ns;     /* S: ... and when it left that park: the pause this rank saw */
  volatile uint64_t trail_ns[PITSTOP_TRAIL]; /* S: CLOCK_REALTIME when operation i was issued */
  /* CMD_TRIM (shim/trim.c): device memory that holds no live data released at the cut, before a
   * move's CUDA checkpoint, so that only live bytes travel. */
  volatile int32_t trim_how;        /* S: TRIM_* bits of what could be reached and was released */
  volatile int32_t trim_error;      /* S: TRIM_OK, or why the release did not finish */
  volatile int64_t trim_before;     /* S: device bytes the caching allocator held reserved before; -1 unknown */
  volatile int64_t trim_after;      /* S: ... and after */
  char trim_note[128];              /* S: what happened, for the operation's record */
  /* Version 3: what the shim saw that it could not re-create after a move (shim/dl.c: NCCL it
   * cannot stand in front of, a reference bound past it; a call whose state lives only in the real
   * communicator).  Sticky: the agent reports the worker unmovable, the cut refuses it. */
  volatile int32_t refused;         /* S: such things seen so far */
  int32_t pad3;
  char refused_note[512];           /* S: the first of them: what, where, what to do */
  /* Version 4: a peer's failure in a job that snapshots protect.  While `protect` is set, a
   * communicator error (ncclRemoteError, ncclSystemError) that a wrapped call returns, or that
   * ncclCommGetAsyncError reports, does not reach the program: the calling thread parks in the
   * shim until the job's recovery ends the process (and restores it from the snapshot), until
   * `protect` is cleared, or until the deadline (PITSTOP_SHIM_LOST_PEER_DEADLINE_S), when the
   * error is returned as it would have been without the shim. */
  volatile uint32_t protect;        /* A: the committed snapshot that covers this rank's job (its number); 0: none */
  volatile int32_t lost;            /* S: LOST_* */
  volatile int32_t lost_comm;       /* S: index of the communicator whose call failed; -1: a group's end */
  volatile int32_t lost_error;      /* S: the ncclResult_t that was held back */
  volatile uint64_t lost_ns;        /* S: CLOCK_REALTIME when the rank parked on it */
  volatile uint64_t lost_deadline_ns; /* S: ... and when it gives the error to the program */
  char lost_call[32];               /* S: the NCCL call that failed */
};

#endif
