/* libpitstop_criufill.so: CRIU's restore fills a worker's memory without zeroing it first.
 * Preloaded by the destination agent into CRIU (never into a worker) for an eager restore
 * (criu/criufill.py writes the wrapper that does it).
 *
 * Why: the restore dominates a pre-copied move's pause, and most of it is CRIU copying each
 * rank's pages from its images into fresh anonymous memory: preadv() into a premapped area
 * takes one page fault per 4 KiB page, and the kernel zeroes every page before the copy
 * overwrites it (2.3-2.7 GB/s on the reference VM).  UFFDIO_COPY puts the same bytes into
 * new pages in one call per range, without the faults and without zeroing them first
 * (3.0-3.3 GB/s for 770 MB on one thread, same VM, 2026-12-03; docs/benchmarks.md).
 *
 * Where it applies: CRIU (4.x, criu/pagemap.c) reads an image with a parent (pitstop's
 * pre-copy and its delta) through libc's preadv() into memory premapped in the restoring task,
 * which its restorer later moves into place with mremap().  Images without a parent are read
 * by the restorer's own raw syscalls and never come here.  Only a read that is all of this is
 * taken:
 * - the descriptor is a regular file named pages-<n>.img, and the file holds every byte asked;
 * - the file offset, each buffer and each length are page multiples, and the request is at
 *   least MIN_BYTES (smaller ones are single pages CRIU compares, cheaper as they are);
 * - transparent huge pages are not `always` on this host: there, a fault can map a 2 MiB page
 *   at once and UFFDIO_COPY, which makes 4 KiB pages, would be slower;
 * - each buffer it copies into is writable anonymous memory, as the kernel says (PROCMAP_QUERY,
 *   Linux 6.11+): UFFDIO_COPY would fill read-only memory that libc's read refuses.
 * Anything else, and any buffer or part of one it cannot copy (a page already present, a
 * private file mapping's data), goes to libc's preadv(): the fast path may be missing, never
 * wrong.  The registration is undone before returning, so the mapping CRIU moves is the one
 * it made (the test checks that it stays one mapping).
 *
 * The copy is cut into 4 MiB pieces that threads take one at a time, as many threads as there
 * are idle CPUs (threads_wanted()): while the job is paused a restore usually has idle cores
 * beside it (2 threads: 0.15-0.17 s for 770 MB against 0.25-0.29 s with one, 2 cores).  The
 * threads block every signal and are joined before the read returns.
 *
 * PITSTOP_CRIUFILL_REPORT, if set, names a file to which each taken read appends one line
 * "pid copied_bytes fallback_bytes threads": the agent adds them up into the restore's phases,
 * so a benchmark and the tests can see the path was used. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define MIN_BYTES (256u << 10)
#define MAX_IOVS 1024 /* CRIU batches at most IOV_MAX */
#define CHUNK (4u << 20) /* what one thread copies at a time */
#define MAX_THREADS 8

typedef ssize_t (*preadv_fn)(int, const struct iovec *, int, off_t);

static preadv_fn real_preadv(void) {
  static preadv_fn f;
  if (!f) f = (preadv_fn)dlsym(RTLD_NEXT, "preadv64");
  if (!f) f = (preadv_fn)dlsym(RTLD_NEXT, "preadv");
  return f;
}

static long page_size(void) {
  static long p;
  if (!p) p = sysconf(_SC_PAGESIZE);
  return p;
}

/* 1 where THP is `always` (the fast path would lose huge pages), else 0; read once */
static int thp_always(void) {
  static int v = -1;
  if (v < 0) {
    char b[128] = {0};
    int fd = open("/sys/kernel/mm/transparent_hugepage/enabled", O_RDONLY | O_CLOEXEC);
    v = 0;
    if (fd >= 0) {
      if (read(fd, b, sizeof b - 1) > 0 && strstr(b, "[always]")) v = 1;
      close(fd);
    }
  }
  return v;
}

/* A regular file named pages-<n>.img of at least `end` bytes */
static int is_pages_image(int fd, off_t end) {
  struct stat st;
  if (fstat(fd, &st) || !S_ISREG(st.st_mode) || st.st_size < end) return 0;
  char link[40], path[512];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t k = readlink(link, path, sizeof path - 1);
  if (k <= 0) return 0;
  path[k] = 0;
  const char *base = strrchr(path, '/');
  base = base ? base + 1 : path;
  size_t n = strlen(base);
  return strncmp(base, "pages-", 6) == 0 && n > 10 && strcmp(base + n - 4, ".img") == 0;
}

static void report(size_t copied, size_t fallback, int threads) {
  const char *where = getenv("PITSTOP_CRIUFILL_REPORT");
  if (!where || !*where) return;
  int fd = open(where, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return;
  char line[112];
  int n = snprintf(line, sizeof line, "%d %zu %zu %d\n", (int)getpid(), copied, fallback, threads);
  if (write(fd, line, n) < 0) { /* a lost line loses a figure, not the restore */ }
  close(fd);
}

/* include/uapi/linux/fs.h (Linux 6.11+); spelled out: the build host's headers may be older */
struct procmap_query {
  uint64_t size, query_flags, query_addr, vma_start, vma_end, vma_flags, vma_page_size, vma_offset, inode;
  uint32_t dev_major, dev_minor, vma_name_size, build_id_size;
  uint64_t vma_name_addr, build_id_addr;
};
#define PROCMAP_QUERY _IOWR('f', 17, struct procmap_query)
#define PROCMAP_QUERY_VMA_WRITABLE 0x02

/* 1 where [p, p+len) is all writable anonymous memory (what libc's read could write and
 * UFFDIO_COPY takes; UFFDIO_COPY itself would also fill read-only memory), asked of `maps`
 * (/proc/self/maps) with PROCMAP_QUERY; 0 otherwise or where the kernel cannot say */
static int writable_anon(int maps, uintptr_t p, size_t len) {
  uintptr_t end = p + len;
  while (p < end) {
    struct procmap_query q = {.size = sizeof q, .query_addr = p};
    if (ioctl(maps, PROCMAP_QUERY, &q) || !(q.vma_flags & PROCMAP_QUERY_VMA_WRITABLE) || q.inode ||
        q.vma_start > p || q.vma_end <= p)
      return 0;
    p = q.vma_end;
  }
  return 1;
}

/* A piece of one buffer, copied by whichever thread takes it; `done` says how much went */
struct piece {
  char *dst;
  const char *src;
  size_t len, done;
  off_t off; /* in the file */
};

struct job {
  struct piece *pieces;
  size_t n;
  atomic_size_t next;
  int u;
};

/* Copies a piece with UFFDIO_COPY up to its end or the first refusal (a page already present) */
static void copy_piece(int u, struct piece *p) {
  size_t at = 0;
  while (at < p->len) {
    struct uffdio_copy c = {.dst = (uintptr_t)p->dst + at, .src = (uintptr_t)p->src + at, .len = p->len - at};
    if (ioctl(u, UFFDIO_COPY, &c) == 0)
      at = p->len;
    else if (c.copy > 0)
      at += (size_t)c.copy; /* partial (a signal, EAGAIN): go on from there */
    else if (errno != EAGAIN && errno != EINTR)
      break; /* EEXIST or anything else: the rest by read */
  }
  p->done = at;
}

static void *copy_pieces(void *arg) {
  struct job *j = arg;
  for (;;) {
    size_t i = atomic_fetch_add(&j->next, 1);
    if (i >= j->n) return NULL;
    copy_piece(j->u, &j->pieces[i]);
  }
}

/* Threads that copy at once: PITSTOP_CRIUFILL_THREADS, else the CPUs this process may run on
 * that nothing else wants now (the kernel's count of runnable tasks, /proc/loadavg, this one
 * included), at least 1 and at most MAX_THREADS.  While a job is paused its restores have the
 * host to themselves: one restore on 2 cores gets 2 threads; of two at once, the first to
 * start gets 2 and the second 1 (more threads than idle cores only took turns, and twice in six
 * such runs both restores took 0.9 s against 0.4-0.5 s, docs/benchmarks.md). */
static int threads_wanted(void) {
  const char *e = getenv("PITSTOP_CRIUFILL_THREADS");
  if (e && *e) {
    int v = atoi(e);
    return v < 1 ? 1 : v > MAX_THREADS ? MAX_THREADS : v;
  }
  cpu_set_t set;
  int n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
  int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    char b[128] = {0};
    /* "0.52 0.58 0.59 3/245 1234": the fourth field's first number is runnable tasks */
    if (read(fd, b, sizeof b - 1) > 0) {
      const char *p = b;
      for (int f = 0; f < 3 && p; f++) p = strchr(p, ' '), p = p ? p + 1 : NULL;
      if (p) n -= atoi(p) - 1;
    }
    close(fd);
  }
  return n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : n;
}

/* Runs the job on this thread and up to `want - 1` more, all signals blocked in those (CRIU
 * handles its own signals on its own thread); returns when every piece is done */
static int run_job(struct job *j, int want) {
  pthread_t t[MAX_THREADS];
  int started = 0;
  if (want > 1 && j->n > 1) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setstacksize(&a, 64 << 10);
    for (; started < want - 1 && (size_t)started + 1 < j->n; started++)
      if (pthread_create(&t[started], &a, copy_pieces, j)) break; /* fewer threads, same result */
    pthread_attr_destroy(&a);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
  }
  copy_pieces(j);
  for (int i = 0; i < started; i++) pthread_join(t[i], NULL);
  return started + 1;
}

/* Reads exactly `len` bytes at `off` into `buf` with libc's preadv; 0, or -1 with errno */
static int read_rest(preadv_fn real, int fd, char *buf, size_t len, off_t off) {
  while (len) {
    struct iovec one = {buf, len};
    ssize_t r = real(fd, &one, 1, off);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      if (r == 0) errno = EIO; /* the file was checked to hold it: it shrank meanwhile */
      return -1;
    }
    buf += r, len -= (size_t)r, off += r;
  }
  return 0;
}

ssize_t preadv64(int fd, const struct iovec *iov, int n, off_t off) {
  preadv_fn real = real_preadv();
  if (n <= 0 || n > MAX_IOVS || off < 0 || thp_always()) return real(fd, iov, n, off);
  long ps = page_size();
  size_t total = 0;
  for (int i = 0; i < n; i++) {
    if (((uintptr_t)iov[i].iov_base | iov[i].iov_len) & (uintptr_t)(ps - 1) || !iov[i].iov_len)
      return real(fd, iov, n, off);
    total += iov[i].iov_len;
  }
  if (total < MIN_BYTES || (off & (ps - 1))) return real(fd, iov, n, off);
  int saved = errno;
  if (!is_pages_image(fd, off + (off_t)total)) {
    errno = saved;
    return real(fd, iov, n, off);
  }
  /* Not populated: the copying threads fault the file's pages in as they read them, at once */
  const char *src = mmap(NULL, total, PROT_READ, MAP_SHARED, fd, off);
  int u = src == MAP_FAILED ? -1 : (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
  struct uffdio_api api = {.api = UFFD_API};
  if (u >= 0 && ioctl(u, UFFDIO_API, &api)) {
    close(u);
    u = -1;
  }
  int maps = u >= 0 ? open("/proc/self/maps", O_RDONLY | O_CLOEXEC) : -1;
  char taken[MAX_IOVS] = {0};
  struct job j = {.pieces = NULL, .n = 0, .u = u};
  if (maps >= 0) j.pieces = malloc((total / CHUNK + (size_t)n) * sizeof *j.pieces);
  size_t at = 0;
  for (int i = 0; i < n && j.pieces; at += iov[i].iov_len, i++) {
    if (!writable_anon(maps, (uintptr_t)iov[i].iov_base, iov[i].iov_len)) continue;
    struct uffdio_register reg = {.range = {(uintptr_t)iov[i].iov_base, iov[i].iov_len},
                                  .mode = UFFDIO_REGISTER_MODE_MISSING};
    if (ioctl(u, UFFDIO_REGISTER, &reg)) continue;
    taken[i] = 1;
    for (size_t k = 0; k < iov[i].iov_len; k += CHUNK)
      j.pieces[j.n++] = (struct piece){.dst = (char *)iov[i].iov_base + k, .src = src + at + k,
                                       .len = iov[i].iov_len - k < CHUNK ? iov[i].iov_len - k : CHUNK,
                                       .off = off + (off_t)(at + k)};
  }
  atomic_init(&j.next, 0);
  int threads = j.n ? run_job(&j, threads_wanted()) : 0;
  for (int i = 0; i < n; i++)
    if (taken[i]) {
      struct uffdio_range r = {(uintptr_t)iov[i].iov_base, iov[i].iov_len};
      ioctl(u, UFFDIO_UNREGISTER, &r);
    }
  /* what was not copied: the buffers not taken, and the rest of each piece cut short */
  size_t copied = 0;
  int failed = 0;
  at = 0;
  for (int i = 0; i < n && !failed; at += iov[i].iov_len, i++)
    if (!taken[i] && read_rest(real, fd, iov[i].iov_base, iov[i].iov_len, off + (off_t)at)) failed = 1;
  for (size_t k = 0; k < j.n && !failed; k++) {
    struct piece *p = &j.pieces[k];
    copied += p->done;
    if (p->done < p->len && read_rest(real, fd, p->dst + p->done, p->len - p->done, p->off + (off_t)p->done))
      failed = 1;
  }
  int err = errno;
  free(j.pieces);
  if (maps >= 0) close(maps);
  if (u >= 0) close(u);
  if (src != MAP_FAILED) munmap((void *)src, total);
  report(copied, total - copied, threads);
  if (failed) {
    errno = err; /* CRIU reports the error and the restore fails, as with its own read */
    return -1;
  }
  errno = saved;
  return (ssize_t)total;
}

/* On 64-bit, preadv and preadv64 are one call */
ssize_t preadv(int fd, const struct iovec *iov, int n, off_t off) __attribute__((alias("preadv64")));
