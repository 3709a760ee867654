/* Where the real NCCL functions behind the shim's exported names are (slot 0, shim.h).
 *
 * PITSTOP_NCCL_LIBRARY, when set, names the library.  Else, first, the next definition in the
 * global scope (libc's dlsym(RTLD_NEXT), called from here): the case of a program linked
 * against libnccl or one that loads it RTLD_GLOBAL, and of an interposer between the shim and
 * libnccl.  PyTorch is not that case: Python dlopens libtorch_cuda.so RTLD_LOCAL, and the
 * libnccl.so.2 it needs is loaded into that local scope, out of RTLD_NEXT's reach, while
 * libtorch_cuda's own calls still bind to the preloaded shim first.  So, second, a libnccl that
 * is already loaded (dl.c recognises one by its name and its symbols): soname libnccl.so.2
 * first, else the first in load order, its functions read from its own symbol table.  Other
 * copies the program reaches through a handle of its own get slots of their own (dl.c).  A
 * definition inside the shim itself is never taken (that would recurse). */
#define _GNU_SOURCE
#include "shim.h"

#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct pitstop_lib pitstop_libs[PITSTOP_MAX_LIBS];

static const void *objectOf(const void *addr) {
  Dl_info info;
  struct link_map *m = NULL;
  return dladdr1(addr, &info, (void **)&m, RTLD_DL_LINKMAP) && m ? (const void *)m->l_addr : NULL;
}

static int inShim(const void *addr) { return addr && objectOf(addr) == objectOf((const void *)pitstop_resolve); }

static void *nextSym(void *ctx, const char *name) {
  void *p = pitstop_dl.dlsym(ctx, name);
  return p && !inShim(p) ? p : NULL;
}

static void *baseSym(void *ctx, const char *name) { return pitstop_elf_sym(ctx, name); }

struct pick { const void *base; int exact; };

static int pickCb(struct dl_phdr_info *info, size_t size, void *data) {
  struct pick *p = data;
  const char *n = info->dlpi_name, *b;
  if (!n || !*n || !info->dlpi_addr) return 0;
  b = strrchr(n, '/');
  b = b ? b + 1 : n;
  if (strncmp(b, "libnccl", 7) != 0) return 0; /* a cheap first cut; dl.c checks symbols below */
  int exact = !strcmp(b, "libnccl.so.2");
  if (!p->base || (exact && !p->exact)) { p->base = (const void *)info->dlpi_addr; p->exact = exact; }
  return 0;
}

/* A libnccl already loaded: soname libnccl.so.2 first, else the first in load order. */
static const void *loadedNccl(void) {
  struct pick p = {NULL, 0};
  dl_iterate_phdr(pickCb, &p);
  return p.base && pitstop_is_libnccl(p.base) ? p.base : NULL;
}

int pitstop_resolve(struct pitstop_lib *L) {
  if (pitstop_resolve_quiet(L) == 0) return 0;
  pitstop_no_nccl();
  return -1;
}

int pitstop_resolve_quiet(struct pitstop_lib *L) {
  if (__atomic_load_n(&L->ready, __ATOMIC_ACQUIRE)) return 0;
  if (L != &pitstop_libs[0]) return -1; /* other slots are filled when they are met (dl.c) */
  if (!pitstop_dl.dlsym) pitstop_dl_init();
  const char *named = getenv("PITSTOP_NCCL_LIBRARY");
  int ok = -1;
  if (named && *named) {
    void *h = pitstop_dl.dlopen(named, RTLD_LAZY | RTLD_LOCAL);
    if (h) ok = pitstop_fill(L, nextSym, h);
  } else {
    ok = pitstop_fill(L, nextSym, RTLD_NEXT);
    const void *b;
    if (ok != 0 && (b = loadedNccl())) ok = pitstop_fill(L, baseSym, (void *)b);
  }
  if (ok != 0) return -1;
  L->base = objectOf((const void *)L->fn.ncclCommInitRank);
  Dl_info info;
  if (dladdr((const void *)L->fn.ncclCommInitRank, &info) && info.dli_fname)
    snprintf(L->path, sizeof L->path, "%s", info.dli_fname);
  __atomic_store_n(&L->ready, 1, __ATOMIC_RELEASE);
  return 0;
}

void pitstop_no_nccl(void) {
  static int said;
  if (said++) return;
  fprintf(stderr, "pitstop shim: no NCCL library found behind the shim: none is loaded (global scope, soname "
                  "libnccl.so.2, or a loaded libnccl.so*); set PITSTOP_NCCL_LIBRARY to its path\n");
}
