/* Diagnostic interposer for tests/gpu (LD_PRELOAD): logs every /proc and /dev path a
 * program opens, reads as a link, lists or tests, with the result, to stderr.  It shows
 * which /proc file a library expects to find, e.g. when CUDA fails in a pid namespace
 * whose /proc is the parent's.  Build: cc -shared -fPIC -o proctrace.so proctrace.c -ldl */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int watched(const char *p) { return p && (!strncmp(p, "/proc", 5) || !strncmp(p, "/dev/nvidia", 11)); }
static void logp(const char *call, const char *p, long r, int err) {
  if (!watched(p)) return;
  char b[600];
  int n = snprintf(b, sizeof b, "proctrace: %s(%s) = %ld%s%s\n", call, p, r, r < 0 ? " " : "", r < 0 ? strerror(err) : "");
  if (n > 0) (void)!write(2, b, (size_t)n < sizeof b ? (size_t)n : sizeof b - 1);
}
#define REAL(ret, name, ...) static ret (*real)(__VA_ARGS__); if (!real) real = (ret (*)(__VA_ARGS__))dlsym(RTLD_NEXT, name)

static int openv(const char *name, int dirfd, const char *p, int flags, va_list ap) {
  mode_t m = (flags & (O_CREAT | O_TMPFILE)) ? va_arg(ap, mode_t) : 0;
  int r;
  if (dirfd == -1000) { REAL(int, name, const char *, int, ...); r = real(p, flags, m); }
  else { REAL(int, name, int, const char *, int, ...); r = real(dirfd, p, flags, m); }
  logp(name, p, r, errno);
  return r;
}
int open(const char *p, int f, ...) { va_list ap; va_start(ap, f); int r = openv("open", -1000, p, f, ap); va_end(ap); return r; }
int open64(const char *p, int f, ...) { va_list ap; va_start(ap, f); int r = openv("open64", -1000, p, f, ap); va_end(ap); return r; }
int openat(int d, const char *p, int f, ...) { va_list ap; va_start(ap, f); int r = openv("openat", d, p, f, ap); va_end(ap); return r; }
int openat64(int d, const char *p, int f, ...) { va_list ap; va_start(ap, f); int r = openv("openat64", d, p, f, ap); va_end(ap); return r; }
FILE *fopen(const char *p, const char *m) { REAL(FILE *, "fopen", const char *, const char *); FILE *f = real(p, m); logp("fopen", p, f ? 0 : -1, errno); return f; }
FILE *fopen64(const char *p, const char *m) { REAL(FILE *, "fopen64", const char *, const char *); FILE *f = real(p, m); logp("fopen64", p, f ? 0 : -1, errno); return f; }
ssize_t readlink(const char *p, char *b, size_t n) { REAL(ssize_t, "readlink", const char *, char *, size_t); ssize_t r = real(p, b, n); logp("readlink", p, r, errno); return r; }
DIR *opendir(const char *p) { REAL(DIR *, "opendir", const char *); DIR *d = real(p); logp("opendir", p, d ? 0 : -1, errno); return d; }
int access(const char *p, int m) { REAL(int, "access", const char *, int); int r = real(p, m); logp("access", p, r, errno); return r; }
int stat(const char *p, struct stat *s) { REAL(int, "stat", const char *, struct stat *); int r = real(p, s); logp("stat", p, r, errno); return r; }
