/* Where the real NCCL functions are.
 *
 * First the next definition in the global scope (dlsym RTLD_NEXT): the case of a
 * program linked against libnccl or one that loads it RTLD_GLOBAL.  PyTorch is not
 * that case: Python dlopens libtorch_cuda.so RTLD_LOCAL, and the libnccl.so.2 it
 * needs is loaded into that local scope, out of RTLD_NEXT's reach, while
 * libtorch_cuda's own calls still bind to the preloaded shim first.  So, second, the
 * libnccl that is already loaded: by its soname, else by any loaded object named
 * libnccl.so*, and looked up in its own scope.  PITSTOP_NCCL_LIBRARY names the
 * library when neither finds one.  A definition inside the shim itself is never
 * taken (that would recurse). */
#define _GNU_SOURCE
#include "shim.h"

#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *lib;
static char libPath[4096];

static int inShim(const void *addr) {
  Dl_info a, b;
  return dladdr(addr, &a) && dladdr((const void *)pitstop_sym, &b) && a.dli_fbase == b.dli_fbase;
}

static int namedNccl(struct dl_phdr_info *info, size_t size, void *data) {
  const char *name = info->dlpi_name, *base;
  if (!name || !*name) return 0;
  base = strrchr(name, '/');
  base = base ? base + 1 : name;
  if (strncmp(base, "libnccl.so", 10) != 0) return 0;
  snprintf(libPath, sizeof libPath, "%s", name);
  return 1;
}

static void *loadedNccl(void) {
  const char *named = getenv("PITSTOP_NCCL_LIBRARY");
  if (lib) return lib;
  if (named && *named) return lib = dlopen(named, RTLD_LAZY | RTLD_LOCAL);
  lib = dlopen("libnccl.so.2", RTLD_LAZY | RTLD_NOLOAD);
  if (!lib && dl_iterate_phdr(namedNccl, NULL)) lib = dlopen(libPath, RTLD_LAZY | RTLD_NOLOAD);
  return lib;
}

void *pitstop_sym(const char *name) {
  void *p = dlsym(RTLD_NEXT, name), *h;
  if (p && !inShim(p)) return p;
  h = loadedNccl();
  p = h ? dlsym(h, name) : NULL;
  return (p && !inShim(p)) ? p : NULL;
}

void pitstop_no_nccl(void) {
  static int said;
  if (said++) return;
  fprintf(stderr, "pitstop shim: no NCCL library found behind the shim: none is loaded (global scope, soname "
                  "libnccl.so.2, or a loaded libnccl.so*); set PITSTOP_NCCL_LIBRARY to its path\n");
}
