/* libpitstop_procself.so: /proc paths that name the caller by its pid-namespace id,
 * made to name the caller again.  `pitstop run` preloads it into every worker.
 *
 * Why: `pitstop run` starts each worker as init of a pid namespace of its own (so CRIU
 * can restore its pids on any host) but leaves it in the host's mount namespace, whose
 * /proc belongs to the parent pid namespace.  There /proc/self is right, but a path
 * built from getpid() or gettid() names another process or none.  libcuda's cuInit
 * opens /proc/self/task/<gettid()>/comm and fails with CUDA_ERROR_OPERATING_SYSTEM (304)
 * when it is missing: seen on an H200 (driver 580), where CUDA initialised under
 * `unshare --pid --fork --mount-proc` and plainly, but not under `unshare --pid --fork`.
 *
 * Why not a mount namespace with its own /proc: CRIU would then dump the whole mount
 * tree of that namespace and re-create it on the spare, which needs container-style
 * root file systems the jobs pitstop moves do not have.
 *
 * What it rewrites, only while /proc/self is not getpid() (so never outside such a
 * namespace, and with live numbers after a restore on another host):
 *   /proc/self/task/<tid>/...   -> /proc/thread-self/... (the caller's own thread) or
 *                                  /proc/self/task/<outer tid>/... (another thread of it)
 *   /proc/<getpid()>/...        -> /proc/self/... (and its task/<tid> as above)
 *   /proc/<tid>/... (a thread)  -> /proc/<outer tid>/...
 * Every other path passes unchanged.  Interposed: the open family, fopen, access,
 * readlink, opendir, stat and lstat; a call made by a raw system call is not seen. */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PROC_PATH_MAX 4096

static long numberAt(const char *s, const char **end) {
  long v = 0;
  const char *p = s;
  if (*p < '0' || *p > '9') return -1;
  while (*p >= '0' && *p <= '9') { v = v * 10 + (*p - '0'); if (v > 1L << 30) return -1; p++; }
  if (*p && *p != '/') return -1;
  *end = p;
  return v;
}

/* The id /proc knows us by; -1 when it cannot be read. */
static long procSelf(void) {
  char b[32];
  long n = syscall(SYS_readlinkat, AT_FDCWD, "/proc/self", b, sizeof b - 1);
  if (n <= 0) return -1;
  b[n] = 0;
  return strtol(b, NULL, 10);
}

/* The outer id of our thread whose id in our pid namespace is `inner` (NSpid's last
 * field), read from /proc/self/task/<id>/status; -1 when no thread of ours has it. */
static long outerTid(long inner) {
  char path[320], line[256];
  long found = -1;
  int dfd = (int)syscall(SYS_openat, AT_FDCWD, "/proc/self/task", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return -1;
  DIR *d = fdopendir(dfd);
  if (!d) { close(dfd); return -1; }
  struct dirent *e;
  while (found < 0 && (e = readdir(d))) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    snprintf(path, sizeof path, "/proc/self/task/%s/status", e->d_name);
    int fd = (int)syscall(SYS_openat, AT_FDCWD, path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    FILE *f = fdopen(fd, "r");
    if (!f) { close(fd); continue; }
    while (fgets(line, sizeof line, f)) {
      if (strncmp(line, "NSpid:", 6) != 0) continue;
      char *last = strrchr(line, '\t');
      if (last && strtol(last + 1, NULL, 10) == inner) found = strtol(e->d_name, NULL, 10);
      break;
    }
    fclose(f);
  }
  closedir(d);
  return found;
}

/* `path`, or `buf` holding the path that names what the caller meant. */
static const char *fix(const char *path, char *buf) {
  const char *rest, *p;
  long id, self, outer;
  int task;
  if (!path || strncmp(path, "/proc/", 6) != 0) return path;
  p = path + 6;
  task = strncmp(p, "self/task/", 10) == 0;
  if ((id = numberAt(task ? p + 10 : p, &rest)) < 0) return path;
  if ((self = procSelf()) < 0 || self == getpid()) return path;
  if (task && id == syscall(SYS_gettid)) snprintf(buf, PROC_PATH_MAX, "/proc/thread-self%s", rest);
  else if (!task && id == getpid()) {
    snprintf(buf, PROC_PATH_MAX, "/proc/self%s", rest);
    if (strncmp(rest, "/task/", 6) == 0) { /* /proc/<pid>/task/<tid>: the thread by its own id too */
      char inner[PROC_PATH_MAX];
      const char *t = fix(buf, inner);
      if (t == inner) snprintf(buf, PROC_PATH_MAX, "%s", inner);
    }
  }
  else if ((outer = outerTid(id)) < 0) return path;
  else if (task) snprintf(buf, PROC_PATH_MAX, "/proc/self/task/%ld%s", outer, rest);
  else snprintf(buf, PROC_PATH_MAX, "/proc/%ld%s", outer, rest);
  return buf;
}

#define REAL(name) static __typeof__(&name) real; if (!real) real = (__typeof__(&name))dlsym(RTLD_NEXT, #name)
#define MODE(flags) mode_t m = 0; if ((flags) & (O_CREAT | O_TMPFILE)) { va_list ap; va_start(ap, flags); m = va_arg(ap, mode_t); va_end(ap); }

int open(const char *p, int f, ...) { MODE(f); char b[PROC_PATH_MAX]; REAL(open); return real(fix(p, b), f, m); }
int open64(const char *p, int f, ...) { MODE(f); char b[PROC_PATH_MAX]; REAL(open64); return real(fix(p, b), f, m); }
int openat(int d, const char *p, int f, ...) { MODE(f); char b[PROC_PATH_MAX]; REAL(openat); return real(d, fix(p, b), f, m); }
int openat64(int d, const char *p, int f, ...) { MODE(f); char b[PROC_PATH_MAX]; REAL(openat64); return real(d, fix(p, b), f, m); }
int __open_2(const char *p, int f) { char b[PROC_PATH_MAX]; REAL(__open_2); return real(fix(p, b), f); }
int __open64_2(const char *p, int f) { char b[PROC_PATH_MAX]; REAL(__open64_2); return real(fix(p, b), f); }
FILE *fopen(const char *p, const char *m) { char b[PROC_PATH_MAX]; REAL(fopen); return real(fix(p, b), m); }
FILE *fopen64(const char *p, const char *m) { char b[PROC_PATH_MAX]; REAL(fopen64); return real(fix(p, b), m); }
int access(const char *p, int m) { char b[PROC_PATH_MAX]; REAL(access); return real(fix(p, b), m); }
ssize_t readlink(const char *p, char *o, size_t n) { char b[PROC_PATH_MAX]; REAL(readlink); return real(fix(p, b), o, n); }
DIR *opendir(const char *p) { char b[PROC_PATH_MAX]; REAL(opendir); return real(fix(p, b)); }
int stat(const char *p, struct stat *s) { char b[PROC_PATH_MAX]; REAL(stat); return real(fix(p, b), s); }
int lstat(const char *p, struct stat *s) { char b[PROC_PATH_MAX]; REAL(lstat); return real(fix(p, b), s); }
