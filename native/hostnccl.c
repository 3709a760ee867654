/* Host NCCL: the NCCL 2.x API over TCP on host memory.
 *
 * Lets CPU jobs and pitstop's tests run real multi-rank NCCL call streams (and so
 * exercise the shim) without a GPU.  Kept small and correct rather than fast:
 *  - a communicator is a full mesh of TCP connections, set up through a rendezvous
 *    root named by the 128-byte unique id (the process that called ncclGetUniqueId
 *    serves it from a short-lived thread, as NCCL's bootstrap root does);
 *  - every collective is one "exchange" (all sends and receives of a rank driven by
 *    poll until done, so no ordering can deadlock), and reductions run in rank order
 *    on every rank, so results are deterministic and identical bit for bit;
 *  - every wait has a deadline (HOSTNCCL_TIMEOUT_S, default 300 s): a peer that never
 *    comes returns ncclRemoteError, never a hang;
 *  - streams are ignored: each call completes before it returns;
 *  - when a communicator is destroyed, all of its sockets are closed: nothing of it
 *    survives into a checkpoint.
 * Environment: HOSTNCCL_ADDR (the IPv4 address to advertise; default: the first
 * non-loopback interface address, else 127.0.0.1), HOSTNCCL_TIMEOUT_S. */
#define _GNU_SOURCE
#include "nccl.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define ID_MAGIC 0x4c434e48u /* "HNCL" */
#define HELLO_MAGIC 0x4f4c4548u
#define TABLE_MAGIC 0x4c425454u /* the root's reply: a table follows */

struct idinfo { uint32_t magic; uint32_t addr; uint16_t port; uint16_t pad; uint32_t pad2; uint64_t nonce; };
struct endpoint { uint32_t addr; uint16_t port; uint16_t pad; };
struct hello { uint32_t magic; uint32_t rank; uint32_t nranks; uint32_t pad; uint64_t nonce; struct endpoint ep; };
struct tablehdr { uint32_t magic; uint32_t nranks; uint64_t nonce; };

/* A reduction operator made by ncclRedOpCreatePreMulSum: each rank's input times the scalar,
 * then summed.  Its value is ncclNumOps + its index, the lowest free one (as NCCL numbers them
 * before mangling them with the communicator's address): so an operator re-created on a new
 * communicator may get another value than the program holds. */
struct userOp {
  int used;
  ncclDataType_t type;
  ncclScalarResidence_t residence;
  unsigned char value[8];  /* ncclScalarHostImmediate: the scalar as it was at creation */
  const void *ptr;         /* ncclScalarDevice: where it is read at each collective ("device" memory is host memory here) */
};

struct ncclComm {
  int nranks, rank;
  int *fds;             /* fds[p]: connection to rank p; -1 for self */
  uint64_t nonce;
  uint64_t splits;      /* splits made from this comm, for child nonces */
  ncclResult_t asyncErr;
  int pending;          /* a nonblocking communicator: GetAsyncError says ncclInProgress this often */
  struct userOp *ops;   /* its reduction operators (ncclRedOpCreatePreMulSum) */
  int nops;
};

static __thread char lastError[512];
static double timeoutS(void) {
  const char *e = getenv("HOSTNCCL_TIMEOUT_S");
  double v = e ? atof(e) : 300.0;
  return v > 0 ? v : 300.0;
}
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static ncclResult_t fail(ncclResult_t r, const char *fmt, ...) {
  va_list ap; va_start(ap, fmt); vsnprintf(lastError, sizeof lastError, fmt, ap); va_end(ap);
  return r;
}

static uint32_t localAddr(void) {
  const char *e = getenv("HOSTNCCL_ADDR");
  struct in_addr a;
  if (e && inet_pton(AF_INET, e, &a) == 1) return a.s_addr;
  struct ifaddrs *ifs = NULL, *i;
  uint32_t found = htonl(INADDR_LOOPBACK);
  if (getifaddrs(&ifs) == 0) {
    for (i = ifs; i; i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
      uint32_t v = ((struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr;
      if ((ntohl(v) >> 24) == 127) continue;
      found = v; break;
    }
    freeifaddrs(ifs);
  }
  return found;
}

static uint64_t randomNonce(void) {
  uint64_t v = 0; FILE *f = fopen("/dev/urandom", "rb");
  if (f) { if (fread(&v, sizeof v, 1, f) != 1) v = 0; fclose(f); }
  return v ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(now() * 1e9);
}

static int listenOn(uint32_t addr, struct endpoint *ep) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY), .sin_port = 0};
  socklen_t len = sizeof sa;
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(fd, 1024) < 0 ||
      getsockname(fd, (struct sockaddr *)&sa, &len) < 0) { close(fd); return -1; }
  ep->addr = addr; ep->port = sa.sin_port;
  return fd;
}

/* Wait for fd to be ready for `events` until the absolute deadline. */
static int waitFd(int fd, short events, double deadline) {
  for (;;) {
    double left = deadline - now();
    if (left <= 0) return -1;
    struct pollfd p = {.fd = fd, .events = events};
    int r = poll(&p, 1, (int)(left * 1000) + 1);
    if (r > 0) return 0;
    if (r < 0 && errno != EINTR) return -1;
  }
}

static int ioAll(int fd, void *buf, size_t n, int sending, double deadline) {
  char *p = buf;
  while (n) {
    if (waitFd(fd, sending ? POLLOUT : POLLIN, deadline) < 0) return -1;
    ssize_t k = sending ? send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) : recv(fd, p, n, MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (k <= 0) return -1;
    p += k; n -= (size_t)k;
  }
  return 0;
}

static int connectTo(struct endpoint ep, double deadline) {
  while (now() < deadline) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = ep.addr, .sin_port = ep.port};
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) {
      int one = 1; setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return fd;
    }
    close(fd);
    usleep(10000);
  }
  return -1;
}

static int acceptBy(int lfd, double deadline) {
  if (waitFd(lfd, POLLIN, deadline) < 0) return -1;
  int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
  if (fd >= 0) { int one = 1; setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); }
  return fd;
}

/* ---- the rendezvous root, served by the process that made the unique id ---- */
struct rootArgs { int lfd; uint64_t nonce; };

static void *rootMain(void *arg) {
  struct rootArgs a = *(struct rootArgs *)arg; free(arg);
  double deadline = now() + timeoutS();
  int nranks = -1, got = 0, *fds = NULL;
  struct endpoint *table = NULL;
  while (nranks < 0 || got < nranks) {
    int fd = acceptBy(a.lfd, deadline);
    if (fd < 0) goto out;
    struct hello h;
    if (ioAll(fd, &h, sizeof h, 0, deadline) < 0 || h.magic != HELLO_MAGIC || h.nonce != a.nonce) { close(fd); continue; }
    if (nranks < 0) {
      nranks = (int)h.nranks;
      fds = calloc(nranks, sizeof *fds); table = calloc(nranks, sizeof *table);
      for (int i = 0; i < nranks; i++) fds[i] = -1;
    }
    if ((int)h.nranks != nranks || (int)h.rank >= nranks || fds[h.rank] >= 0) { close(fd); continue; }
    fds[h.rank] = fd; table[h.rank] = h.ep; got++;
  }
  struct tablehdr th = {.magic = TABLE_MAGIC, .nranks = (uint32_t)nranks, .nonce = a.nonce};
  for (int i = 0; i < nranks; i++)
    if (ioAll(fds[i], &th, sizeof th, 1, deadline) == 0) ioAll(fds[i], table, nranks * sizeof *table, 1, deadline);
out:
  if (fds) for (int i = 0; i < nranks; i++) if (fds[i] >= 0) close(fds[i]);
  free(fds); free(table);
  close(a.lfd);
  return NULL;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId) {
  if (!uniqueId) return fail(ncclInvalidArgument, "ncclGetUniqueId: NULL id");
  struct idinfo info = {.magic = ID_MAGIC, .nonce = randomNonce()};
  struct endpoint ep;
  int lfd = listenOn(localAddr(), &ep);
  if (lfd < 0) return fail(ncclSystemError, "ncclGetUniqueId: cannot listen: %s", strerror(errno));
  info.addr = ep.addr; info.port = ep.port;
  struct rootArgs *a = malloc(sizeof *a); a->lfd = lfd; a->nonce = info.nonce;
  pthread_t t; pthread_attr_t at; pthread_attr_init(&at); pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
  if (pthread_create(&t, &at, rootMain, a) != 0) { close(lfd); free(a); return fail(ncclSystemError, "ncclGetUniqueId: no thread"); }
  memset(uniqueId, 0, sizeof *uniqueId);
  memcpy(uniqueId->internal, &info, sizeof info);
  return ncclSuccess;
}

/* Connect a full mesh among `nranks` endpoints; this rank listens on lfd. */
static ncclResult_t mesh(struct ncclComm *c, const struct endpoint *table, int lfd, double deadline) {
  c->fds = malloc(c->nranks * sizeof *c->fds);
  for (int i = 0; i < c->nranks; i++) c->fds[i] = -1;
  for (int j = 0; j < c->rank; j++) {
    int fd = connectTo(table[j], deadline);
    struct hello h = {.magic = HELLO_MAGIC, .rank = (uint32_t)c->rank, .nranks = (uint32_t)c->nranks, .nonce = c->nonce};
    if (fd < 0 || ioAll(fd, &h, sizeof h, 1, deadline) < 0) {
      if (fd >= 0) close(fd);
      return fail(ncclRemoteError, "rank %d could not connect to rank %d", c->rank, j);
    }
    c->fds[j] = fd;
  }
  for (int k = c->rank + 1; k < c->nranks;) {
    int fd = acceptBy(lfd, deadline);
    if (fd < 0) return fail(ncclRemoteError, "rank %d: peers did not connect in time", c->rank);
    struct hello h;
    if (ioAll(fd, &h, sizeof h, 0, deadline) < 0 || h.magic != HELLO_MAGIC || h.nonce != c->nonce ||
        (int)h.rank <= c->rank || (int)h.rank >= c->nranks || c->fds[h.rank] >= 0) { close(fd); continue; }
    c->fds[h.rank] = fd; k++;
  }
  return ncclSuccess;
}

static void freeComm(struct ncclComm *c) {
  if (!c) return;
  if (c->fds) for (int i = 0; i < c->nranks; i++) if (c->fds[i] >= 0) close(c->fds[i]);
  free(c->fds); free(c->ops); free(c);
}

static ncclResult_t initRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  struct idinfo info; memcpy(&info, id.internal, sizeof info);
  if (!comm || nranks < 1 || rank < 0 || rank >= nranks) return fail(ncclInvalidArgument, "ncclCommInitRank: bad arguments (nranks %d, rank %d)", nranks, rank);
  /* An id that is not ours must never make us connect anywhere. */
  if (info.magic != ID_MAGIC || info.addr == 0 || info.port == 0)
    return fail(ncclInvalidArgument, "ncclCommInitRank: not a host-NCCL unique id (was it passed by value, whole?)");
  double deadline = now() + timeoutS();
  struct ncclComm *c = calloc(1, sizeof *c);
  c->nranks = nranks; c->rank = rank; c->nonce = info.nonce;
  struct endpoint me, *table = calloc(nranks, sizeof *table);
  int lfd = listenOn(localAddr(), &me);
  ncclResult_t r = ncclSuccess;
  int rfd = -1;
  if (lfd < 0) { r = fail(ncclSystemError, "ncclCommInitRank: cannot listen"); goto done; }
  struct endpoint root = {.addr = info.addr, .port = info.port};
  rfd = connectTo(root, deadline);
  struct hello h = {.magic = HELLO_MAGIC, .rank = (uint32_t)rank, .nranks = (uint32_t)nranks, .nonce = info.nonce, .ep = me};
  if (rfd < 0) { r = fail(ncclRemoteError, "ncclCommInitRank: cannot reach the rendezvous root (rank %d of %d): %s", rank, nranks, strerror(errno)); goto done; }
  struct tablehdr th;
  if (ioAll(rfd, &h, sizeof h, 1, deadline) < 0 || ioAll(rfd, &th, sizeof th, 0, deadline) < 0) {
    r = fail(ncclRemoteError, "ncclCommInitRank: rendezvous with the root failed (rank %d of %d)", rank, nranks); goto done;
  }
  if (th.magic != TABLE_MAGIC || th.nonce != info.nonce || (int)th.nranks != nranks) {
    r = fail(ncclRemoteError, "ncclCommInitRank: the rendezvous root answered with something else (rank %d of %d)", rank, nranks); goto done;
  }
  if (ioAll(rfd, table, nranks * sizeof *table, 0, deadline) < 0) {
    r = fail(ncclRemoteError, "ncclCommInitRank: rendezvous with the root failed (rank %d of %d)", rank, nranks); goto done;
  }
  for (int i = 0; i < nranks; i++) if (table[i].addr == 0 || table[i].port == 0) {
    r = fail(ncclRemoteError, "ncclCommInitRank: bad endpoint for rank %d from the root", i); goto done;
  }
  r = mesh(c, table, lfd, deadline);
done:
  if (rfd >= 0) close(rfd);
  if (lfd >= 0) close(lfd);
  free(table);
  if (r != ncclSuccess) { freeComm(c); *comm = NULL; return r; }
  *comm = c;
  return ncclSuccess;
}

/* config.blocking == 0 asks for a nonblocking communicator.  Host NCCL does the work at
 * once but answers as NCCL does: ncclInProgress, then ncclCommGetAsyncError reports
 * ncclInProgress twice before ncclSuccess, so callers must poll as they would on a GPU.
 * Only the bytes the caller's `size` covers are read. */
static ncclResult_t nonblocking(struct ncclComm *c, const ncclConfig_t *config) {
  if (!c || !config || config->size < offsetof(ncclConfig_t, blocking) + sizeof(int) || config->blocking != 0) {
    /* As NCCL does at the end of a blocking init: ask its own public API, through the
     * PLT, whether the communicator is ready; a preloaded shim sees this call first. */
    ncclResult_t e = ncclSuccess;
    ncclResult_t r = c ? ncclCommGetAsyncError(c, &e) : ncclSuccess;
    return r != ncclSuccess ? r : e;
  }
  c->pending = 2;
  return ncclInProgress;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  ncclResult_t r = initRank(comm, nranks, id, rank);
  return r == ncclSuccess ? nonblocking(*comm, NULL) : r;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t *config) {
  ncclResult_t r = initRank(comm, nranks, id, rank);
  return r == ncclSuccess ? nonblocking(*comm, config) : r;
}

/* ---- the exchange: all of one rank's sends and receives, progressed together ---- */
struct xfer { char *buf; size_t len, done; };

static ncclResult_t exchange(struct ncclComm *c, struct xfer *snd, struct xfer *rcv) {
  double deadline = now() + timeoutS();
  int n = c->nranks;
  struct pollfd *p = calloc(n, sizeof *p);
  for (;;) {
    int active = 0;
    for (int i = 0; i < n; i++) {
      p[i].fd = -1; p[i].events = 0; p[i].revents = 0;
      if (i == c->rank) continue;
      if (snd[i].done < snd[i].len) p[i].events |= POLLOUT;
      if (rcv[i].done < rcv[i].len) p[i].events |= POLLIN;
      if (p[i].events) { p[i].fd = c->fds[i]; active++; }
    }
    if (!active) break;
    double left = deadline - now();
    if (left <= 0) { free(p); c->asyncErr = ncclRemoteError; return fail(ncclRemoteError, "rank %d: a peer did not take part in the collective within %.0f s", c->rank, timeoutS()); }
    int r = poll(p, n, (int)(left * 1000) + 1);
    if (r < 0 && errno != EINTR) { free(p); return fail(ncclSystemError, "poll: %s", strerror(errno)); }
    for (int i = 0; i < n; i++) {
      if (p[i].fd < 0 || !p[i].revents) continue;
      if ((p[i].revents & (POLLERR | POLLHUP)) && !(p[i].revents & POLLIN)) {
        free(p); c->asyncErr = ncclRemoteError; return fail(ncclRemoteError, "rank %d: connection to rank %d lost", c->rank, i);
      }
      if ((p[i].revents & POLLOUT) && snd[i].done < snd[i].len) {
        ssize_t k = send(p[i].fd, snd[i].buf + snd[i].done, snd[i].len - snd[i].done, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) snd[i].done += (size_t)k;
        else if (k < 0 && errno != EAGAIN && errno != EINTR) { free(p); c->asyncErr = ncclRemoteError; return fail(ncclRemoteError, "rank %d: send to %d: %s", c->rank, i, strerror(errno)); }
      }
      if ((p[i].revents & (POLLIN | POLLHUP)) && rcv[i].done < rcv[i].len) {
        ssize_t k = recv(p[i].fd, rcv[i].buf + rcv[i].done, rcv[i].len - rcv[i].done, MSG_DONTWAIT);
        if (k > 0) rcv[i].done += (size_t)k;
        else if (k == 0 || (errno != EAGAIN && errno != EINTR)) { free(p); c->asyncErr = ncclRemoteError; return fail(ncclRemoteError, "rank %d: connection to rank %d closed", c->rank, i); }
      }
    }
  }
  free(p);
  return ncclSuccess;
}

/* ---- element types and reductions ---- */
static size_t typeSize(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

static float halfToFloat(uint16_t h) {
  uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, f;
  if (e == 0) {
    if (m == 0) f = s;
    else { e = 127 - 15 + 1; while (!(m & 0x400)) { m <<= 1; e--; } m &= 0x3ff; f = s | (e << 23) | (m << 13); }
  } else if (e == 31) f = s | 0x7f800000 | (m << 13);
  else f = s | ((e - 15 + 127) << 23) | (m << 13);
  float out; memcpy(&out, &f, 4); return out;
}
static uint16_t floatToHalf(float x) { /* round to nearest even */
  uint32_t f; memcpy(&f, &x, 4);
  uint32_t s = (f >> 16) & 0x8000; int32_t e = (int32_t)((f >> 23) & 0xff) - 127 + 15; uint32_t m = f & 0x7fffff;
  if (((f >> 23) & 0xff) == 0xff) return (uint16_t)(s | 0x7c00 | (m ? 0x200 : 0));
  if (e >= 31) return (uint16_t)(s | 0x7c00);
  if (e <= 0) {
    if (e < -10) return (uint16_t)s;
    m |= 0x800000; uint32_t shift = (uint32_t)(14 - e); uint32_t hm = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (hm & 1))) hm++;
    return (uint16_t)(s | hm);
  }
  uint32_t hm = m >> 13, rem = m & 0x1fff;
  uint16_t out = (uint16_t)(s | ((uint32_t)e << 10) | hm);
  if (rem > 0x1000 || (rem == 0x1000 && (hm & 1))) out++;
  return out;
}
static float bf16ToFloat(uint16_t b) { uint32_t f = (uint32_t)b << 16; float o; memcpy(&o, &f, 4); return o; }
static uint16_t floatToBf16(float x) {
  uint32_t f; memcpy(&f, &x, 4);
  if ((f & 0x7f800000) == 0x7f800000 && (f & 0x7fffff)) return (uint16_t)((f >> 16) | 0x40);
  f += 0x7fff + ((f >> 16) & 1);
  return (uint16_t)(f >> 16);
}

#define REDUCE_LOOP(T) { T *a = (T *)acc; const T *b = (const T *)in; \
  switch (op) { case ncclSum: case ncclAvg: for (size_t i = 0; i < n; i++) a[i] = a[i] + b[i]; break; \
    case ncclProd: for (size_t i = 0; i < n; i++) a[i] = a[i] * b[i]; break; \
    case ncclMax: for (size_t i = 0; i < n; i++) a[i] = b[i] > a[i] ? b[i] : a[i]; break; \
    case ncclMin: for (size_t i = 0; i < n; i++) a[i] = b[i] < a[i] ? b[i] : a[i]; break; default: break; } }

#define REDUCE16(TOF, FROMF) { uint16_t *a = (uint16_t *)acc; const uint16_t *b = (const uint16_t *)in; \
  for (size_t i = 0; i < n; i++) { float x = TOF(a[i]), y = TOF(b[i]), r; \
    switch (op) { case ncclProd: r = x * y; break; case ncclMax: r = y > x ? y : x; break; \
      case ncclMin: r = y < x ? y : x; break; default: r = x + y; } a[i] = FROMF(r); } }

/* acc = acc (op) in, elementwise; 16-bit floats are combined in float and rounded each step. */
static void reduceInto(void *acc, const void *in, size_t n, ncclDataType_t t, ncclRedOp_t op) {
  switch (t) {
    case ncclInt8: REDUCE_LOOP(int8_t) break;
    case ncclUint8: REDUCE_LOOP(uint8_t) break;
    case ncclInt32: REDUCE_LOOP(int32_t) break;
    case ncclUint32: REDUCE_LOOP(uint32_t) break;
    case ncclInt64: REDUCE_LOOP(int64_t) break;
    case ncclUint64: REDUCE_LOOP(uint64_t) break;
    case ncclFloat32: REDUCE_LOOP(float) break;
    case ncclFloat64: REDUCE_LOOP(double) break;
    case ncclFloat16: REDUCE16(halfToFloat, floatToHalf) break;
    case ncclBfloat16: REDUCE16(bf16ToFloat, floatToBf16) break;
    default: break;
  }
}

#define DIV_LOOP(T) { T *a = (T *)acc; for (size_t i = 0; i < n; i++) a[i] = (T)(a[i] / (T)k); }
static void divideBy(void *acc, size_t n, ncclDataType_t t, int k) {
  switch (t) {
    case ncclInt8: DIV_LOOP(int8_t) break; case ncclUint8: DIV_LOOP(uint8_t) break;
    case ncclInt32: DIV_LOOP(int32_t) break; case ncclUint32: DIV_LOOP(uint32_t) break;
    case ncclInt64: DIV_LOOP(int64_t) break; case ncclUint64: DIV_LOOP(uint64_t) break;
    case ncclFloat32: DIV_LOOP(float) break; case ncclFloat64: DIV_LOOP(double) break;
    case ncclFloat16: { uint16_t *a = acc; for (size_t i = 0; i < n; i++) a[i] = floatToHalf(halfToFloat(a[i]) / (float)k); } break;
    case ncclBfloat16: { uint16_t *a = acc; for (size_t i = 0; i < n; i++) a[i] = floatToBf16(bf16ToFloat(a[i]) / (float)k); } break;
    default: break;
  }
}

#define MUL_LOOP(T) { T *a = (T *)acc, k; memcpy(&k, scalar, sizeof k); for (size_t i = 0; i < n; i++) a[i] = (T)(a[i] * k); }
/* acc *= scalar elementwise, the scalar of the same type; 16-bit floats in float, rounded. */
static void scaleBy(void *acc, size_t n, ncclDataType_t t, const void *scalar) {
  switch (t) {
    case ncclInt8: MUL_LOOP(int8_t) break; case ncclUint8: MUL_LOOP(uint8_t) break;
    case ncclInt32: MUL_LOOP(int32_t) break; case ncclUint32: MUL_LOOP(uint32_t) break;
    case ncclInt64: MUL_LOOP(int64_t) break; case ncclUint64: MUL_LOOP(uint64_t) break;
    case ncclFloat32: MUL_LOOP(float) break; case ncclFloat64: MUL_LOOP(double) break;
    case ncclFloat16: { uint16_t *a = acc, k; memcpy(&k, scalar, 2); float f = halfToFloat(k);
      for (size_t i = 0; i < n; i++) a[i] = floatToHalf(halfToFloat(a[i]) * f); } break;
    case ncclBfloat16: { uint16_t *a = acc, k; memcpy(&k, scalar, 2); float f = bf16ToFloat(k);
      for (size_t i = 0; i < n; i++) a[i] = floatToBf16(bf16ToFloat(a[i]) * f); } break;
    default: break;
  }
}

/* A communicator's own operator: each of the nranks blocks (copies, ours to change) is multiplied
 * by its scalar, which leaves a sum to do. */
static ncclRedOp_t premul(struct ncclComm *c, ncclRedOp_t op, char *blocks, size_t count, size_t bytes, ncclDataType_t t) {
  if ((int)op < (int)ncclNumOps) return op;
  struct userOp *u = &c->ops[(int)op - (int)ncclNumOps];
  const void *k = u->residence == ncclScalarDevice ? u->ptr : u->value;
  for (int p = 0; p < c->nranks; p++) scaleBy(blocks + (size_t)p * bytes, count, t, k);
  return ncclSum;
}

/* Reduce nranks blocks of `bytes` in rank order into out. */
static void reduceBlocks(void *out, const char *blocks, size_t count, size_t bytes, int nranks, ncclDataType_t t, ncclRedOp_t op) {
  memmove(out, blocks, bytes);
  for (int p = 1; p < nranks; p++) reduceInto(out, blocks + (size_t)p * bytes, count, t, op);
  if (op == ncclAvg) divideBy(out, count, t, nranks);
}

static ncclResult_t check(struct ncclComm *c, ncclDataType_t t, int op) {
  if (!c) return fail(ncclInvalidArgument, "NULL communicator");
  if (!typeSize(t)) return fail(ncclInvalidArgument, "unsupported datatype %d", (int)t);
  if (op >= (int)ncclNumOps) {
    int ix = op - (int)ncclNumOps;
    if (ix >= c->nops || !c->ops[ix].used)
      return fail(ncclInvalidArgument, "reduction op %d is not one of this communicator's", op);
    if (c->ops[ix].type != t)
      return fail(ncclInvalidArgument, "reduction op %d was made for datatype %d, not %d", op, (int)c->ops[ix].type, (int)t);
  }
  return ncclSuccess;
}

static struct xfer *xfers(int n) { return calloc((size_t)n, sizeof(struct xfer)); }

static ncclResult_t allReduce(const void *sb, void *rb, size_t count, ncclDataType_t t, ncclRedOp_t op, struct ncclComm *c) {
  size_t bytes = count * typeSize(t);
  char *tmp = malloc(bytes * c->nranks + 1);
  struct xfer *s = xfers(c->nranks), *r = xfers(c->nranks);
  for (int p = 0; p < c->nranks; p++) {
    if (p == c->rank) { memcpy(tmp + (size_t)p * bytes, sb, bytes); continue; }
    s[p] = (struct xfer){(char *)sb, bytes, 0}; r[p] = (struct xfer){tmp + (size_t)p * bytes, bytes, 0};
  }
  ncclResult_t res = exchange(c, s, r);
  if (res == ncclSuccess) reduceBlocks(rb, tmp, count, bytes, c->nranks, t, premul(c, op, tmp, count, bytes, t));
  free(tmp); free(s); free(r);
  return res;
}

static ncclResult_t broadcast(const void *sb, void *rb, size_t count, ncclDataType_t t, int root, struct ncclComm *c) {
  size_t bytes = count * typeSize(t);
  if (root < 0 || root >= c->nranks) return fail(ncclInvalidArgument, "broadcast: bad root %d", root);
  struct xfer *s = xfers(c->nranks), *r = xfers(c->nranks);
  if (c->rank == root) {
    for (int p = 0; p < c->nranks; p++) if (p != root) s[p] = (struct xfer){(char *)sb, bytes, 0};
    if (rb != sb) memmove(rb, sb, bytes);
  } else r[root] = (struct xfer){rb, bytes, 0};
  ncclResult_t res = exchange(c, s, r);
  free(s); free(r);
  return res;
}

static ncclResult_t reduce(const void *sb, void *rb, size_t count, ncclDataType_t t, ncclRedOp_t op, int root, struct ncclComm *c) {
  size_t bytes = count * typeSize(t);
  if (root < 0 || root >= c->nranks) return fail(ncclInvalidArgument, "reduce: bad root %d", root);
  struct xfer *s = xfers(c->nranks), *r = xfers(c->nranks);
  char *tmp = NULL;
  if (c->rank == root) {
    tmp = malloc(bytes * c->nranks + 1);
    for (int p = 0; p < c->nranks; p++) {
      if (p == root) memcpy(tmp + (size_t)p * bytes, sb, bytes);
      else r[p] = (struct xfer){tmp + (size_t)p * bytes, bytes, 0};
    }
  } else s[root] = (struct xfer){(char *)sb, bytes, 0};
  ncclResult_t res = exchange(c, s, r);
  if (res == ncclSuccess && tmp) reduceBlocks(rb, tmp, count, bytes, c->nranks, t, premul(c, op, tmp, count, bytes, t));
  free(tmp); free(s); free(r);
  return res;
}

static ncclResult_t allGather(const void *sb, void *rb, size_t count, ncclDataType_t t, struct ncclComm *c) {
  size_t bytes = count * typeSize(t);
  struct xfer *s = xfers(c->nranks), *r = xfers(c->nranks);
  char *mine = (char *)rb + (size_t)c->rank * bytes;
  if (mine != sb) memmove(mine, sb, bytes);
  for (int p = 0; p < c->nranks; p++) {
    if (p == c->rank) continue;
    s[p] = (struct xfer){mine, bytes, 0}; r[p] = (struct xfer){(char *)rb + (size_t)p * bytes, bytes, 0};
  }
  ncclResult_t res = exchange(c, s, r);
  free(s); free(r);
  return res;
}

static ncclResult_t reduceScatter(const void *sb, void *rb, size_t count, ncclDataType_t t, ncclRedOp_t op, struct ncclComm *c) {
  size_t bytes = count * typeSize(t);
  char *tmp = malloc(bytes * c->nranks + 1);
  struct xfer *s = xfers(c->nranks), *r = xfers(c->nranks);
  for (int p = 0; p < c->nranks; p++) {
    if (p == c->rank) { memcpy(tmp + (size_t)p * bytes, (const char *)sb + (size_t)c->rank * bytes, bytes); continue; }
    s[p] = (struct xfer){(char *)sb + (size_t)p * bytes, bytes, 0};
    r[p] = (struct xfer){tmp + (size_t)p * bytes, bytes, 0};
  }
  ncclResult_t res = exchange(c, s, r);
  if (res == ncclSuccess) reduceBlocks(rb, tmp, count, bytes, c->nranks, t, premul(c, op, tmp, count, bytes, t));
  free(tmp); free(s); free(r);
  return res;
}

/* ---- groups: point-to-point calls inside a group are batched per communicator ---- */
enum { OP_SEND, OP_RECV };
struct p2p { int kind; char *buf; size_t bytes; int peer; struct ncclComm *comm; };
static __thread int groupDepth;
static __thread struct p2p *pending;
static __thread int npending, cappending;

static ncclResult_t runP2P(struct p2p *ops, int n) {
  ncclResult_t res = ncclSuccess;
  for (int i = 0; i < n && res == ncclSuccess; i++) {
    struct ncclComm *c = ops[i].comm;
    if (!c) continue;
    /* Gather this communicator's ops; per peer, concatenate in issue order. */
    size_t *sl = calloc(c->nranks, sizeof *sl), *rl = calloc(c->nranks, sizeof *rl);
    for (int j = i; j < n; j++) if (ops[j].comm == c) (ops[j].kind == OP_SEND ? sl : rl)[ops[j].peer] += ops[j].bytes;
    struct xfer *s = xfers(c->nranks), *r = xfers(c->nranks);
    char **sbuf = calloc(c->nranks, sizeof *sbuf), **rbuf = calloc(c->nranks, sizeof *rbuf);
    for (int p = 0; p < c->nranks; p++) {
      if (sl[p]) { sbuf[p] = malloc(sl[p]); s[p] = (struct xfer){sbuf[p], sl[p], 0}; }
      if (rl[p]) { rbuf[p] = malloc(rl[p]); r[p] = (struct xfer){rbuf[p], rl[p], 0}; }
    }
    size_t *so = calloc(c->nranks, sizeof *so), *ro = calloc(c->nranks, sizeof *ro);
    for (int j = i; j < n; j++) if (ops[j].comm == c && ops[j].kind == OP_SEND) {
      memcpy(sbuf[ops[j].peer] + so[ops[j].peer], ops[j].buf, ops[j].bytes); so[ops[j].peer] += ops[j].bytes;
    }
    /* self send/recv: copy directly */
    if (sl[c->rank]) { r[c->rank].done = 0; memcpy(rbuf[c->rank], sbuf[c->rank], rl[c->rank] < sl[c->rank] ? rl[c->rank] : sl[c->rank]); s[c->rank].len = 0; r[c->rank].len = 0; }
    res = exchange(c, s, r);
    for (int j = i; j < n; j++) if (ops[j].comm == c) {
      if (res == ncclSuccess && ops[j].kind == OP_RECV) { memcpy(ops[j].buf, rbuf[ops[j].peer] + ro[ops[j].peer], ops[j].bytes); ro[ops[j].peer] += ops[j].bytes; }
      ops[j].comm = NULL;
    }
    for (int p = 0; p < c->nranks; p++) { free(sbuf[p]); free(rbuf[p]); }
    free(sbuf); free(rbuf); free(s); free(r); free(sl); free(rl); free(so); free(ro);
  }
  return res;
}

static ncclResult_t p2p(int kind, const void *buf, size_t count, ncclDataType_t t, int peer, struct ncclComm *c) {
  ncclResult_t r = check(c, t, -1);
  if (r) return r;
  if (peer < 0 || peer >= c->nranks) return fail(ncclInvalidArgument, "bad peer %d", peer);
  struct p2p op = {kind, (char *)buf, count * typeSize(t), peer, c};
  if (groupDepth == 0) return runP2P(&op, 1);
  if (npending == cappending) { cappending = cappending ? 2 * cappending : 16; pending = realloc(pending, cappending * sizeof *pending); }
  pending[npending++] = op;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart(void) { groupDepth++; return ncclSuccess; }
ncclResult_t ncclGroupEnd(void) {
  if (groupDepth <= 0) return fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--groupDepth > 0) return ncclSuccess;
  ncclResult_t r = runP2P(pending, npending);
  npending = 0;
  return r;
}

/* ---- public entry points ---- */
ncclResult_t ncclGetVersion(int *version) { if (!version) return ncclInvalidArgument; *version = NCCL_VERSION_CODE; return ncclSuccess; }

const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}
const char *ncclGetLastError(ncclComm_t comm) { (void)comm; return lastError; }

ncclResult_t ncclAllReduce(const void *sb, void *rb, size_t count, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c, cudaStream_t s) {
  (void)s; ncclResult_t r = check(c, t, op); return r ? r : allReduce(sb, rb, count, t, op, c);
}
ncclResult_t ncclBroadcast(const void *sb, void *rb, size_t count, ncclDataType_t t, int root, ncclComm_t c, cudaStream_t s) {
  (void)s; ncclResult_t r = check(c, t, -1); return r ? r : broadcast(sb, rb, count, t, root, c);
}
ncclResult_t ncclReduce(const void *sb, void *rb, size_t count, ncclDataType_t t, ncclRedOp_t op, int root, ncclComm_t c, cudaStream_t s) {
  (void)s; ncclResult_t r = check(c, t, op); return r ? r : reduce(sb, rb, count, t, op, root, c);
}
ncclResult_t ncclAllGather(const void *sb, void *rb, size_t count, ncclDataType_t t, ncclComm_t c, cudaStream_t s) {
  (void)s; ncclResult_t r = check(c, t, -1); return r ? r : allGather(sb, rb, count, t, c);
}
ncclResult_t ncclReduceScatter(const void *sb, void *rb, size_t count, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c, cudaStream_t s) {
  (void)s; ncclResult_t r = check(c, t, op); return r ? r : reduceScatter(sb, rb, count, t, op, c);
}
ncclResult_t ncclSend(const void *sb, size_t count, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t s) {
  (void)s; return p2p(OP_SEND, sb, count, t, peer, c);
}
ncclResult_t ncclRecv(void *rb, size_t count, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t s) {
  (void)s; return p2p(OP_RECV, rb, count, t, peer, c);
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
  if (!comm || !newcomm) return fail(ncclInvalidArgument, "ncclCommSplit: NULL argument");
  struct entry { int32_t color, key; struct endpoint ep; } me = {color, key, {0}}, *all = calloc(comm->nranks, sizeof *all);
  struct endpoint ep;
  int lfd = color == NCCL_SPLIT_NOCOLOR ? -1 : listenOn(localAddr(), &ep);
  if (lfd >= 0) me.ep = ep;
  ncclResult_t r = allGather(&me, all, sizeof me, ncclUint8, comm);
  uint64_t seq = ++comm->splits;
  *newcomm = NULL;
  if (r != ncclSuccess || color == NCCL_SPLIT_NOCOLOR) { if (lfd >= 0) close(lfd); free(all); return r; }
  /* members: same color, ordered by (key, old rank) */
  int n = 0, myNew = 0;
  int *members = malloc(comm->nranks * sizeof *members);
  for (int p = 0; p < comm->nranks; p++) if (all[p].color == color) members[n++] = p;
  for (int i = 1; i < n; i++) for (int j = i; j > 0; j--) {
    int a = members[j - 1], b = members[j];
    if (all[a].key > all[b].key || (all[a].key == all[b].key && a > b)) { members[j - 1] = b; members[j] = a; }
  }
  struct endpoint *table = malloc(n * sizeof *table);
  for (int i = 0; i < n; i++) { table[i] = all[members[i]].ep; if (members[i] == comm->rank) myNew = i; }
  struct ncclComm *c = calloc(1, sizeof *c);
  c->nranks = n; c->rank = myNew;
  c->nonce = comm->nonce * 1000003u + seq * 7919u + (uint64_t)(uint32_t)color;
  r = mesh(c, table, lfd, now() + timeoutS());
  close(lfd); free(table); free(members); free(all);
  if (r != ncclSuccess) { freeComm(c); return r; }
  *newcomm = c;
  return nonblocking(c, config);
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) { return comm ? ncclSuccess : ncclInvalidArgument; }
ncclResult_t ncclCommDestroy(ncclComm_t comm) { if (!comm) return ncclInvalidArgument; freeComm(comm); return ncclSuccess; }
ncclResult_t ncclCommAbort(ncclComm_t comm) { if (!comm) return ncclInvalidArgument; freeComm(comm); return ncclSuccess; }
ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) { if (!comm || !count) return ncclInvalidArgument; *count = comm->nranks; return ncclSuccess; }
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) { if (!comm || !rank) return ncclInvalidArgument; *rank = comm->rank; return ncclSuccess; }
ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) { if (!comm || !device) return ncclInvalidArgument; *device = 0; return ncclSuccess; }
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *e) {
  if (!comm || !e) return ncclInvalidArgument;
  if (comm->pending > 0) { comm->pending--; *e = ncclInProgress; return ncclSuccess; }
  *e = comm->asyncErr;
  return ncclSuccess;
}

/* Buffer registration (NCCL 2.19): zero-copy for device buffers in real NCCL; host memory needs
 * nothing, so a registration here is a handle naming the buffer and its communicator, checked
 * when it is given back.  The shim's tests use it: a registration lives only in the communicator
 * that made it, so it makes a job unmovable (shim/gen_wrappers.py). */
struct registration { ncclComm_t comm; void *buff; size_t size; };

ncclResult_t ncclCommRegister(const ncclComm_t comm, void *buff, size_t size, void **handle) {
  if (!comm || !handle) return ncclInvalidArgument;
  struct registration *r = malloc(sizeof *r);
  if (!r) return ncclSystemError;
  *r = (struct registration){comm, buff, size};
  *handle = r;
  return ncclSuccess;
}

ncclResult_t ncclCommDeregister(const ncclComm_t comm, void *handle) {
  struct registration *r = handle;
  if (!comm || !r || r->comm != comm) return ncclInvalidArgument;
  free(r);
  return ncclSuccess;
}

/* Reduction operators (NCCL 2.11): PreMulSum, each rank's input times a scalar, then summed.  The
 * scalar is read now (ncclScalarHostImmediate) or at each collective (ncclScalarDevice: a pointer,
 * host memory here). */
ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar, ncclDataType_t datatype,
                                      ncclScalarResidence_t residence, ncclComm_t comm) {
  if (!comm || !op || !scalar) return fail(ncclInvalidArgument, "ncclRedOpCreatePreMulSum: NULL argument");
  size_t size = typeSize(datatype);
  if (!size) return fail(ncclInvalidArgument, "ncclRedOpCreatePreMulSum: unsupported datatype %d", (int)datatype);
  if (residence != ncclScalarDevice && residence != ncclScalarHostImmediate)
    return fail(ncclInvalidArgument, "ncclRedOpCreatePreMulSum: bad residence %d", (int)residence);
  int ix = 0;
  while (ix < comm->nops && comm->ops[ix].used) ix++;
  if (ix == comm->nops) {
    struct userOp *more = realloc(comm->ops, (size_t)(comm->nops + 1) * sizeof *more);
    if (!more) return fail(ncclSystemError, "ncclRedOpCreatePreMulSum: out of memory");
    comm->ops = more;
    comm->nops++;
  }
  struct userOp *u = &comm->ops[ix];
  memset(u, 0, sizeof *u);
  u->used = 1; u->type = datatype; u->residence = residence;
  if (residence == ncclScalarHostImmediate) memcpy(u->value, scalar, size);
  else u->ptr = scalar;
  *op = (ncclRedOp_t)((int)ncclNumOps + ix);
  return ncclSuccess;
}

ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm) {
  int ix = (int)op - (int)ncclNumOps;
  if (!comm || ix < 0 || ix >= comm->nops || !comm->ops[ix].used)
    return fail(ncclInvalidArgument, "ncclRedOpDestroy: %d is not a reduction op of this communicator", (int)op);
  comm->ops[ix].used = 0;
  return ncclSuccess;
}
