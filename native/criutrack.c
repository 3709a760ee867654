/* libpitstop_criutrack.so: lets CRIU's own incremental dump use the pre-copy's write tracking.
 * Preloaded into CRIU (never into a worker) for the dump of a pre-copied worker only
 * (criu/criutrack.py writes the wrapper that does it).
 *
 * Why: after a pre-copy, only the pages written since must travel in the pause.  pitstop
 * tracks those writes with an async userfaultfd (memory/writetrack.py), but CRIU knows only
 * soft-dirty, which this kernel lacks (CONFIG_MEM_SOFT_DIRTY off), so CRIU dumped all of a
 * rank's memory into its images during the pause and pitstop then cut the delta out of that
 * copy.  With `--track-mem --prev-images-dir`, CRIU itself writes only the pages it believes
 * dirty and records the rest as "in the parent" (the pre-copy's images): no full copy.  This
 * library tells CRIU the truth it asks for in the words it understands: a page is "soft-dirty"
 * exactly when the kernel's PAGEMAP_SCAN reports it PAGE_IS_WRITTEN, i.e. when it is not
 * write-protected by the tracking.  Memory that was never registered with the tracking
 * (mapped later, moved, a child's) carries no protection and so reads as written: every error
 * this can make is toward dumping a page again.
 *
 * What it changes in the process it is loaded into, and nothing else:
 * - ioctl(PAGEMAP_SCAN) asking for PAGE_IS_SOFT_DIRTY: asks for PAGE_IS_WRITTEN as well and
 *   reports it as PAGE_IS_SOFT_DIRTY (CRIU >= 4.0 reads pagemaps this way where it can);
 * - pread() of a /proc/<pid>/pagemap: bit 55 (soft-dirty) of each present or swapped entry is
 *   set to the negation of bit 57 (write-protected by userfaultfd); CRIU's other way in;
 * - read() of 8 bytes of its own /proc/<pid>/pagemap: bit 55 set, so CRIU's start-up probe
 *   (kerndat_get_dirty_track) finds dirty tracking;
 * - write() of "4" to a /proc/<pid>/clear_refs: a no-op that succeeds.  Clearing soft-dirty
 *   means nothing here; the tracking is reset by the agent, not by CRIU;
 * - open()/rename()/unlink() of CRIU's kernel-facts cache /run/criu.kdat*: redirected to
 *   /run/pitstop/criu-writetracked.kdat*, so that what this library makes CRIU believe never
 *   reaches a CRIU run without it (which would then trust soft-dirty bits that are always 0).
 *
 * Each hook first tests the cheap things (sizes, the request number) and only then looks at
 * what a descriptor names (readlink of /proc/self/fd/N); errno is kept. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/types.h>
#include <unistd.h>

/* include/uapi/linux/fs.h (Linux 6.7+); spelled out: the build host's headers may be older */
struct pm_scan_arg {
  uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages;
  uint64_t category_inverted, category_mask, category_anyof_mask, return_mask;
};
struct page_region {
  uint64_t start, end, categories;
};
#define PT_PAGEMAP_SCAN _IOWR('f', 16, struct pm_scan_arg)
#define PT_PAGE_IS_WRITTEN (1ULL << 1)
#define PT_PAGE_IS_SOFT_DIRTY (1ULL << 7)
/* Documentation/admin-guide/mm/pagemap.rst */
#define PM_SOFT_DIRTY (1ULL << 55)
#define PM_UFFD_WP (1ULL << 57)
#define PM_SWAP (1ULL << 62)
#define PM_PRESENT (1ULL << 63)

static const char KDAT[] = "/run/criu.kdat";
static const char KDAT_HERE[] = "/run/pitstop/criu-writetracked.kdat";

typedef int (*open_fn)(const char *, int, ...);
typedef int (*rename_fn)(const char *, const char *);
typedef int (*unlink_fn)(const char *);
typedef ssize_t (*read_fn)(int, void *, size_t);
typedef ssize_t (*pread_fn)(int, void *, size_t, off_t);
typedef ssize_t (*write_fn)(int, const void *, size_t);
typedef int (*ioctl_fn)(int, unsigned long, ...);

/* The next definition of `name` (libc's), looked up once */
#define REAL(name, type) \
  static type real_##name; \
  if (!real_##name) real_##name = (type)dlsym(RTLD_NEXT, #name)

/* The path an open file descriptor names, or "" */
static const char *fd_path(int fd, char *buf, size_t n) {
  char link[40];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t k = readlink(link, buf, n - 1);
  buf[k > 0 ? k : 0] = 0;
  return buf;
}

/* "/proc/<digits>/<leaf>" */
static int is_proc_file(const char *path, const char *leaf) {
  if (strncmp(path, "/proc/", 6)) return 0;
  const char *p = path + 6;
  if (*p < '0' || *p > '9') return 0;
  while (*p >= '0' && *p <= '9') p++;
  return *p == '/' && strcmp(p + 1, leaf) == 0;
}

static const char *kdat_path(const char *path, char *buf, size_t n) {
  if (path && strncmp(path, KDAT, sizeof KDAT - 1) == 0) {
    snprintf(buf, n, "%s%s", KDAT_HERE, path + sizeof KDAT - 1);
    return buf;
  }
  return path;
}

int open64(const char *path, int flags, ...) {
  REAL(open64, open_fn);
  mode_t mode = 0;
  if (flags & (O_CREAT | O_TMPFILE)) {
    va_list ap;
    va_start(ap, flags);
    mode = va_arg(ap, mode_t);
    va_end(ap);
  }
  char b[256];
  return real_open64(kdat_path(path, b, sizeof b), flags, mode);
}

/* On 64-bit, open and open64 are one call (O_LARGEFILE is implied) */
int open(const char *path, int flags, ...) __attribute__((alias("open64")));

int rename(const char *from, const char *to) {
  REAL(rename, rename_fn);
  char a[256], b[256];
  return real_rename(kdat_path(from, a, sizeof a), kdat_path(to, b, sizeof b));
}

int unlink(const char *path) {
  REAL(unlink, unlink_fn);
  char a[256];
  return real_unlink(kdat_path(path, a, sizeof a));
}

ssize_t read(int fd, void *buf, size_t n) {
  REAL(read, read_fn);
  ssize_t r = real_read(fd, buf, n);
  if (r == 8 && n == 8) {
    int e = errno;
    char p[64], own[40];
    snprintf(own, sizeof own, "/proc/%d/pagemap", (int)getpid());
    if (strcmp(fd_path(fd, p, sizeof p), own) == 0) *(uint64_t *)buf |= PM_SOFT_DIRTY;
    errno = e;
  }
  return r;
}

static void pagemap_entries(uint64_t *e, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (e[i] & (PM_PRESENT | PM_SWAP)) e[i] = (e[i] & PM_UFFD_WP) ? (e[i] & ~PM_SOFT_DIRTY) : (e[i] | PM_SOFT_DIRTY);
}

ssize_t pread64(int fd, void *buf, size_t n, off_t off) {
  REAL(pread64, pread_fn);
  ssize_t r = real_pread64(fd, buf, n, off);
  if (r >= 8 && off % 8 == 0) {
    int e = errno;
    char p[64];
    if (is_proc_file(fd_path(fd, p, sizeof p), "pagemap")) pagemap_entries(buf, (size_t)r / 8);
    errno = e;
  }
  return r;
}

ssize_t pread(int fd, void *buf, size_t n, off_t off) { return pread64(fd, buf, n, off); }

ssize_t write(int fd, const void *buf, size_t n) {
  REAL(write, write_fn);
  if ((n == 1 || n == 2) && ((const char *)buf)[0] == '4' && (n == 1 || ((const char *)buf)[1] == 0)) {
    int e = errno;
    char p[64];
    if (is_proc_file(fd_path(fd, p, sizeof p), "clear_refs")) {
      errno = e;
      return (ssize_t)n;
    }
    errno = e;
  }
  return real_write(fd, buf, n);
}

int ioctl(int fd, unsigned long req, ...) {
  REAL(ioctl, ioctl_fn);
  va_list ap;
  va_start(ap, req);
  void *arg = va_arg(ap, void *);
  va_end(ap);
  if (req != PT_PAGEMAP_SCAN || !arg) return real_ioctl(fd, req, arg);
  struct pm_scan_arg *a = arg;
  uint64_t asked = a->return_mask;
  if (!(asked & PT_PAGE_IS_SOFT_DIRTY)) return real_ioctl(fd, req, arg);
  a->return_mask = asked | PT_PAGE_IS_WRITTEN;
  int r = real_ioctl(fd, req, arg);
  int e = errno;
  a->return_mask = asked;
  struct page_region *v = (struct page_region *)(uintptr_t)a->vec;
  for (int i = 0; i < r; i++) {
    uint64_t c = v[i].categories;
    c = (c & PT_PAGE_IS_WRITTEN) ? (c | PT_PAGE_IS_SOFT_DIRTY) : (c & ~PT_PAGE_IS_SOFT_DIRTY);
    v[i].categories = (asked & PT_PAGE_IS_WRITTEN) ? c : (c & ~PT_PAGE_IS_WRITTEN);
  }
  errno = e;
  return r;
}
