/* libpitstop_writetrack.so: lets the host's agent learn which pages a worker writes while its
 * memory is pre-copied.  `pitstop run` preloads it into every worker.
 *
 * Why: a pre-copy sends a running worker's memory ahead; at the pause only what changed since
 * must travel.  The kernel's own answer to "which pages were written" is soft-dirty, which this
 * kernel lacks, so the agent otherwise hashes every page of the dump during the pause
 * (memory/precopy.py).  Linux 6.7+ has a second answer: userfaultfd write-protection in async
 * mode (UFFD_FEATURE_WP_ASYNC), read back with the PAGEMAP_SCAN ioctl on /proc/<pid>/pagemap.
 * The kernel resolves each first write itself (no fault reaches anybody) and clears the page's
 * protection bit; PAGEMAP_SCAN lists the pages whose bit is gone.
 *
 * A userfaultfd serves the memory of the process that creates it, and only that process can
 * create it: that is all this library does.  The agent registers the memory and scans it from
 * outside through its own copy of the descriptor (memory/writetrack.py).
 *
 * The protocol: the agent binds a unix socket at WT_DIR/<16 hex digits>.sock and queues signal
 * SIGRTMAX-6 with that number as the signal's value (sigqueue).  The handler connects, checks
 * that the peer is root (only root can bind in WT_DIR, and only root may hold a descriptor that
 * can write-protect this process), makes the userfaultfd, sends it over the socket and closes
 * its own copy.  The descriptor is in this process for the microseconds of the handler only:
 * CRIU refuses to dump a process holding one ("Can't dump file of that type [600]").  If the
 * socket is gone (the agent gave up, or this process was restored elsewhere with the signal
 * still pending) the handler connects nowhere and makes nothing.
 *
 * Not installed over a handler the program already has for that signal.  Everything in the
 * handler is a system call (async-signal-safe); errno is kept. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>
#include <linux/userfaultfd.h>

#define WT_DIR "/run/pitstop/writetrack/"
#define WT_MAGIC 0x70737477u /* "pstw": first bytes of the message that carries the descriptor */
#ifndef UFFD_FEATURE_WP_UNPOPULATED
#define UFFD_FEATURE_WP_UNPOPULATED (1 << 13)
#endif
#ifndef UFFD_FEATURE_WP_ASYNC
#define UFFD_FEATURE_WP_ASYNC (1 << 15)
#endif
#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif

static int wtSignal(void) { return SIGRTMAX - 6; }

/* The socket's path for `nonce`: WT_DIR + 16 lowercase hex digits + ".sock". */
static void socketPath(struct sockaddr_un *a, uint64_t nonce) {
  static const char hex[] = "0123456789abcdef";
  size_t n = sizeof WT_DIR - 1;
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  memcpy(a->sun_path, WT_DIR, n);
  for (int i = 15; i >= 0; i--) { a->sun_path[n + (size_t)i] = hex[nonce & 15]; nonce >>= 4; }
  memcpy(a->sun_path + n + 16, ".sock", 5);
}

/* Status sent with the descriptor (or without one): 0 ok, else the errno of what failed. */
static void reply(int sock, int fd, int status) {
  uint32_t msg[2] = {WT_MAGIC, (uint32_t)status};
  struct iovec iov = {msg, sizeof msg};
  union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } u;
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
  if (fd >= 0) {
    mh.msg_control = u.buf;
    mh.msg_controllen = sizeof u.buf;
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  (void)sendmsg(sock, &mh, MSG_NOSIGNAL);
}

static void onSignal(int sig, siginfo_t *si, void *ctx) {
  (void)sig; (void)ctx;
  if (si->si_code != SI_QUEUE) return; /* only the agent's sigqueue, never a stray kill */
  int saved = errno;
  struct sockaddr_un a;
  socketPath(&a, (uint64_t)(uintptr_t)si->si_value.sival_ptr);
  int sock = (int)syscall(SYS_socket, AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (sock < 0) goto out;
  if (connect(sock, (struct sockaddr *)&a, sizeof a) != 0) goto close_sock;
  struct ucred peer;
  socklen_t len = sizeof peer;
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &peer, &len) != 0 || peer.uid != 0) goto close_sock;
  int uffd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY);
  if (uffd < 0) { reply(sock, -1, errno); goto close_sock; }
  struct uffdio_api api = {.api = UFFD_API, .features = UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED};
  if (ioctl(uffd, UFFDIO_API, &api) != 0) reply(sock, -1, errno);
  else reply(sock, uffd, 0);
  close(uffd);
close_sock:
  close(sock);
out:
  errno = saved;
}

__attribute__((constructor)) static void installWriteTrack(void) {
  struct sigaction old;
  if (sigaction(wtSignal(), NULL, &old) != 0) return;
  if ((old.sa_flags & SA_SIGINFO) ? old.sa_sigaction != NULL : old.sa_handler != SIG_DFL) return;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = onSignal;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  (void)sigaction(wtSignal(), &sa, NULL);
}
