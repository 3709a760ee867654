/* The dynamic loader's side of the shim: every way a program reaches NCCL.
 *
 * The PLT is one way.  A program may also load libnccl itself (Python's ctypes.CDLL, cffi, a C
 * dlopen, by soname or by path, RTLD_LOCAL or RTLD_DEEPBIND) and take its functions with dlsym or
 * dlvsym, or a library may be loaded with RTLD_DEEPBIND and bind its NCCL references inside its own
 * scope, past the preloaded shim.  So:
 *
 * - dlsym and dlvsym are the shim's.  A name that is not NCCL's, or RTLD_NEXT (an interposer
 *   looking for the next definition), goes to libc's by a tail call, so the loader still sees the
 *   program's own call site (RTLD_NEXT and RTLD_DEFAULT are relative to the caller).  An NCCL name
 *   is looked up as asked; if it resolves inside a libnccl, the program gets the shim's wrapper for
 *   that library (its own slot, nccl_shim.h: a second copy from another path gets a second table).
 *   dlopen is not the shim's: its search (the caller's RUNPATH, $ORIGIN) belongs to the caller,
 *   and a library is recognised by the address its symbols resolve to, however and whenever it
 *   was loaded (before the shim, through dlmopen).
 * - Each object loaded since the last look (on every dlsym, at each new communicator, at a cut)
 *   is examined once: one that defines NCCL's API but is not a libnccl (NCCL linked statically
 *   into another library, a copy under another name) makes the process unmovable, with the reason
 *   and what to do; an object's references to NCCL (GOT entries) bound into a libnccl instead of
 *   the shim (RTLD_DEEPBIND, libnccl preloaded ahead of the shim) are bound to the shim, and where
 *   lazy binding shows a call already went past, the process is unmovable.
 *
 * libc's own dlsym, dlvsym and dlopen are found by reading its dynamic symbol table, never
 * through dlsym (the shim's would answer).  No thread, no system call on the collective path. */
#define _GNU_SOURCE
#include "nccl_shim.h"

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>
#include <sys/mman.h>
#include <unistd.h>

struct pitstop_real_dl pitstop_dl;

/* ---- a loaded object's dynamic section ---------------------------------------------------- */
struct elfobj {
  ElfW(Addr) base, lo, hi, relroLo, relroHi;
  const char *name, *soname;
  const ElfW(Dyn) *dyn;
  const ElfW(Sym) *symtab;
  const char *strtab;
  const uint32_t *gnuhash;
  const ElfW(Word) *hash;
  const ElfW(Half) *versym;
  const ElfW(Rela) *jmprel, *rela;
  size_t jmprelsz, relasz, relacount;
  int pltIsRela, bindNow;
};

static ElfW(Addr) dynPtr(const struct elfobj *o, ElfW(Addr) p) {
  /* glibc relocates the dynamic section in place where it is writable; the vDSO's is not */
  return p < o->base ? o->base + p : p;
}

static int elfOpen(ElfW(Addr) base, const char *name, const ElfW(Phdr) *phdr, int phnum, struct elfobj *o) {
  memset(o, 0, sizeof *o);
  o->base = base;
  o->name = name ? name : "";
  o->lo = ~(ElfW(Addr))0;
  for (int i = 0; i < phnum; i++) {
    const ElfW(Phdr) *p = &phdr[i];
    if (p->p_type == PT_DYNAMIC) o->dyn = (const ElfW(Dyn) *)(base + p->p_vaddr);
    else if (p->p_type == PT_GNU_RELRO) {
      long pg = sysconf(_SC_PAGESIZE);
      o->relroLo = (base + p->p_vaddr) & ~(ElfW(Addr))(pg - 1);
      o->relroHi = (base + p->p_vaddr + p->p_memsz) & ~(ElfW(Addr))(pg - 1);
    } else if (p->p_type == PT_LOAD) {
      if (base + p->p_vaddr < o->lo) o->lo = base + p->p_vaddr;
      if (base + p->p_vaddr + p->p_memsz > o->hi) o->hi = base + p->p_vaddr + p->p_memsz;
    }
  }
  if (!o->dyn) return -1;
  ElfW(Addr) soname = 0;
  int hasSoname = 0;
  for (const ElfW(Dyn) *d = o->dyn; d->d_tag != DT_NULL; d++) {
    switch (d->d_tag) {
      case DT_SYMTAB: o->symtab = (const ElfW(Sym) *)dynPtr(o, d->d_un.d_ptr); break;
      case DT_STRTAB: o->strtab = (const char *)dynPtr(o, d->d_un.d_ptr); break;
      case DT_GNU_HASH: o->gnuhash = (const uint32_t *)dynPtr(o, d->d_un.d_ptr); break;
      case DT_HASH: o->hash = (const ElfW(Word) *)dynPtr(o, d->d_un.d_ptr); break;
      case DT_VERSYM: o->versym = (const ElfW(Half) *)dynPtr(o, d->d_un.d_ptr); break;
      case DT_JMPREL: o->jmprel = (const ElfW(Rela) *)dynPtr(o, d->d_un.d_ptr); break;
      case DT_PLTRELSZ: o->jmprelsz = d->d_un.d_val; break;
      case DT_PLTREL: o->pltIsRela = d->d_un.d_val == DT_RELA; break;
      case DT_RELA: o->rela = (const ElfW(Rela) *)dynPtr(o, d->d_un.d_ptr); break;
      case DT_RELASZ: o->relasz = d->d_un.d_val; break;
      case DT_RELACOUNT: o->relacount = d->d_un.d_val; break;
      case DT_SONAME: soname = d->d_un.d_val; hasSoname = 1; break;
      case DT_FLAGS: if (d->d_un.d_val & DF_BIND_NOW) o->bindNow = 1; break;
      case DT_FLAGS_1: if (d->d_un.d_val & DF_1_NOW) o->bindNow = 1; break;
      default: break;
    }
  }
  if (!o->symtab || !o->strtab) return -1;
  if (hasSoname) o->soname = o->strtab + soname;
  const char *bn = getenv("LD_BIND_NOW");
  if (bn && *bn) o->bindNow = 1;
  return 0;
}

static int defined(const struct elfobj *o, uint32_t i, const char *name) {
  const ElfW(Sym) *s = &o->symtab[i];
  if (s->st_shndx == SHN_UNDEF || strcmp(o->strtab + s->st_name, name)) return 0;
  int t = ELF64_ST_TYPE(s->st_info);
  if (t != STT_FUNC && t != STT_GNU_IFUNC && t != STT_OBJECT) return 0;
  return !(o->versym && (o->versym[i] & 0x8000)); /* a hidden (non-default) version */
}

/* The object's own definition of name (default version), or NULL. */
static const ElfW(Sym) *lookup(const struct elfobj *o, const char *name) {
  if (o->gnuhash) {
    const uint32_t *h = o->gnuhash;
    uint32_t nbuckets = h[0], symoffset = h[1], bloomSize = h[2], bloomShift = h[3];
    const ElfW(Addr) *bloom = (const ElfW(Addr) *)&h[4];
    const uint32_t *buckets = (const uint32_t *)&bloom[bloomSize];
    const uint32_t *chain = &buckets[nbuckets];
    uint32_t hv = 5381;
    for (const unsigned char *c = (const unsigned char *)name; *c; c++) hv = hv * 33 + *c;
    const unsigned bits = sizeof(ElfW(Addr)) * 8;
    ElfW(Addr) word = bloom[(hv / bits) % bloomSize];
    ElfW(Addr) mask = ((ElfW(Addr))1 << (hv % bits)) | ((ElfW(Addr))1 << ((hv >> bloomShift) % bits));
    if ((word & mask) != mask || !nbuckets) return NULL;
    uint32_t i = buckets[hv % nbuckets];
    if (i < symoffset) return NULL;
    for (;; i++) {
      uint32_t h2 = chain[i - symoffset];
      if ((hv | 1) == (h2 | 1) && defined(o, i, name)) return &o->symtab[i];
      if (h2 & 1) return NULL;
    }
  }
  if (o->hash) {
    const ElfW(Word) *h = o->hash;
    ElfW(Word) nbucket = h[0];
    const ElfW(Word) *bucket = &h[2], *chain = &bucket[nbucket];
    unsigned long hv = 0, g;
    for (const unsigned char *c = (const unsigned char *)name; *c; c++) {
      hv = (hv << 4) + *c;
      if ((g = hv & 0xf0000000)) hv ^= g >> 24;
      hv &= ~g;
    }
    if (!nbucket) return NULL;
    for (ElfW(Word) i = bucket[hv % nbucket]; i; i = chain[i])
      if (defined(o, i, name)) return &o->symtab[i];
  }
  return NULL;
}

static void *address(const struct elfobj *o, const ElfW(Sym) *s) {
  void *p = (void *)(o->base + s->st_value);
  if (ELF64_ST_TYPE(s->st_info) == STT_GNU_IFUNC) p = ((void *(*)(void))p)();
  return p;
}

/* ---- the loaded objects ------------------------------------------------------------------- */
/* dl_iterate_phdr's callbacks run under the loader's lock: they read memory and call nothing of
 * the loader's (dladdr would take another lock, in the opposite order to dlopen's). */
struct objref { ElfW(Addr) base; const char *name; const ElfW(Phdr) *phdr; int phnum; };
struct collect { struct objref *out; int max, n; unsigned long long adds, subs; };

static int collectCb(struct dl_phdr_info *info, size_t size, void *data) {
  struct collect *c = data;
  if (c->n == 0) { c->adds = info->dlpi_adds; c->subs = info->dlpi_subs; }
  if (c->n < c->max) c->out[c->n] = (struct objref){info->dlpi_addr, info->dlpi_name, info->dlpi_phdr, info->dlpi_phnum};
  c->n++;
  return c->max == 0; /* max 0: only the counts, from the first object */
}

struct byBase { ElfW(Addr) base; struct elfobj *o; int found; };

static int byBaseCb(struct dl_phdr_info *info, size_t size, void *data) {
  struct byBase *b = data;
  if (info->dlpi_addr != b->base) return 0;
  b->found = elfOpen(info->dlpi_addr, info->dlpi_name, info->dlpi_phdr, info->dlpi_phnum, b->o) == 0;
  return 1;
}

static int objByBase(ElfW(Addr) base, struct elfobj *o) {
  struct byBase b = {base, o, 0};
  if (!base) return -1; /* the main program of a fixed address: never a library */
  dl_iterate_phdr(byBaseCb, &b);
  return b.found ? 0 : -1;
}

void *pitstop_elf_sym(const void *base, const char *name) {
  struct elfobj o;
  if (objByBase((ElfW(Addr))base, &o) != 0) return NULL;
  const ElfW(Sym) *s = lookup(&o, name);
  return s ? address(&o, s) : NULL;
}

static ElfW(Addr) shimBase(void) {
  static ElfW(Addr) b;
  if (!b) {
    Dl_info info;
    struct link_map *m = NULL;
    if (dladdr1((void *)shimBase, &info, (void **)&m, RTLD_DL_LINKMAP) && m) b = m->l_addr;
  }
  return b;
}

/* libc's dlsym, dlvsym, dlopen: the first definition after the shim in load order, as RTLD_NEXT
 * would find it (libc.so.6 since glibc 2.34, libdl.so.2 before), else before it. */
#define NREAL 3
static const char *const realNames[NREAL] = {"dlsym", "dlvsym", "dlopen"};
struct realFind { ElfW(Addr) me; int passed; void *after[NREAL], *before[NREAL]; };

static int realCb(struct dl_phdr_info *info, size_t size, void *data) {
  struct realFind *f = data;
  if (info->dlpi_addr == f->me) { f->passed = 1; return 0; }
  struct elfobj o;
  if (elfOpen(info->dlpi_addr, info->dlpi_name, info->dlpi_phdr, info->dlpi_phnum, &o) != 0) return 0;
  void **into = f->passed ? f->after : f->before;
  for (int k = 0; k < NREAL; k++) {
    const ElfW(Sym) *s;
    if (!into[k] && (s = lookup(&o, realNames[k]))) into[k] = address(&o, s);
  }
  return 0;
}

void pitstop_dl_init(void) {
  struct realFind f = {shimBase(), 0, {0}, {0}};
  dl_iterate_phdr(realCb, &f);
  void *found[NREAL];
  for (int k = 0; k < NREAL; k++) found[k] = f.after[k] ? f.after[k] : f.before[k];
  if (!found[0] || !found[1] || !found[2]) {
    fprintf(stderr, "pitstop shim: libc's dlsym, dlvsym or dlopen not found in any loaded object; the shim "
                    "cannot work in this process\n");
    abort();
  }
  __atomic_store_n(&pitstop_dl.dlvsym, (void *(*)(void *, const char *, const char *))found[1], __ATOMIC_RELEASE);
  __atomic_store_n(&pitstop_dl.dlopen, (void *(*)(const char *, int))found[2], __ATOMIC_RELEASE);
  __atomic_store_n(&pitstop_dl.dlsym, (void *(*)(void *, const char *))found[0], __ATOMIC_RELEASE);
}

/* ---- which libraries are libnccl ------------------------------------------------------------ */
static const char *baseName(const char *p) { const char *s = strrchr(p, '/'); return s ? s + 1 : p; }

static int namedNccl(const struct elfobj *o) {
  const char *named = getenv("PITSTOP_NCCL_LIBRARY");
  if (named && *named && (!strcmp(named, o->name) || !strcmp(baseName(named), baseName(o->name)))) return 1;
  return !strncmp(baseName(o->name), "libnccl", 7) || (o->soname && !strncmp(o->soname, "libnccl", 7));
}

/* NCCL's core calls, the ones pitstop_fill needs too. */
static int definesNccl(const struct elfobj *o) {
  return lookup(o, "ncclCommInitRank") && lookup(o, "ncclAllReduce") && lookup(o, "ncclGetVersion");
}

int pitstop_is_libnccl(const void *base) {
  struct elfobj o;
  if (objByBase((ElfW(Addr))base, &o) != 0) return 0;
  return namedNccl(&o) && definesNccl(&o);
}

static void *elfSymCb(void *ctx, const char *name) {
  const struct elfobj *o = ctx;
  const ElfW(Sym) *s = lookup(o, name);
  return s ? address(o, s) : NULL;
}

static pthread_mutex_t libLock = PTHREAD_MUTEX_INITIALIZER;

struct pitstop_lib *pitstop_lib_at(const void *addr) {
  Dl_info info;
  struct link_map *m = NULL;
  if (!dladdr1(addr, &info, (void **)&m, RTLD_DL_LINKMAP) || !m || m->l_addr == shimBase()) return NULL;
  struct pitstop_lib *L0 = &pitstop_libs[0];
  if (!__atomic_load_n(&L0->ready, __ATOMIC_ACQUIRE)) pitstop_resolve_quiet(L0);
  for (int k = 0; k < PITSTOP_MAX_LIBS; k++)
    if (__atomic_load_n(&pitstop_libs[k].ready, __ATOMIC_ACQUIRE) && pitstop_libs[k].base == (void *)m->l_addr)
      return &pitstop_libs[k];
  struct elfobj o;
  if (objByBase(m->l_addr, &o) != 0 || !namedNccl(&o) || !definesNccl(&o)) return NULL;
  struct pitstop_lib *L = NULL;
  pthread_mutex_lock(&libLock); /* no loader call under it: a thread inside dlopen may want it */
  for (int k = 0; k < PITSTOP_MAX_LIBS && !L; k++) {
    struct pitstop_lib *c = &pitstop_libs[k];
    if (c->ready && c->base == (void *)m->l_addr) L = c;
    else if (!c->ready) { /* slot 0 too, when nothing lay behind the exported names */
      if (pitstop_fill(c, elfSymCb, &o) != 0) break;
      c->base = (void *)m->l_addr;
      snprintf(c->path, sizeof c->path, "%s", o.name);
      __atomic_store_n(&c->ready, 1, __ATOMIC_RELEASE);
      L = c;
    }
  }
  pthread_mutex_unlock(&libLock);
  if (!L) {
    char note[512];
    snprintf(note, sizeof note, "the program reached a libnccl the shim had no room for (%s; it stands in front "
             "of %d copies at most): load one copy of NCCL", o.name, PITSTOP_MAX_LIBS);
    pitstop_refuse(note);
  }
  return L;
}

/* ---- the shim's dlsym and dlvsym ------------------------------------------------------------ */
static int apiIndex(const char *name) {
  for (int i = 0; i < PITSTOP_NFUNCS; i++) if (!strcmp(pitstop_api_names[i], name)) return i;
  return -1;
}

static int ncclName(const char *n) { return n && n[0] == 'n' && n[1] == 'c' && n[2] == 'c' && n[3] == 'l'; }

static void *ncclLookup(void *handle, const char *name, const char *version) {
  void *p = version ? pitstop_dl.dlvsym(handle, name, version) : pitstop_dl.dlsym(handle, name);
  if (!p) return NULL; /* as the loader said, dlerror() included */
  int i = apiIndex(name);
  if (i < 0) return p; /* an NCCL call the shim does not know: what it makes, the shim counts as foreign */
  struct pitstop_lib *L = pitstop_lib_at(p);
  return L ? pitstop_entries[L - pitstop_libs][i] : p;
}

/* Tail calls to libc's: the loader then sees the program's call site, which RTLD_NEXT and
 * RTLD_DEFAULT are relative to (the Makefile builds this file with sibling calls on). */
__attribute__((visibility("default"))) void *dlsym(void *handle, const char *name) {
  if (__builtin_expect(!__atomic_load_n(&pitstop_dl.dlsym, __ATOMIC_ACQUIRE), 0)) pitstop_dl_init();
  pitstop_scan();
  if (handle != RTLD_NEXT && ncclName(name)) return ncclLookup(handle, name, NULL);
  return pitstop_dl.dlsym(handle, name);
}

__attribute__((visibility("default"))) void *dlvsym(void *handle, const char *name, const char *version) {
  if (__builtin_expect(!__atomic_load_n(&pitstop_dl.dlsym, __ATOMIC_ACQUIRE), 0)) pitstop_dl_init();
  pitstop_scan();
  if (handle != RTLD_NEXT && ncclName(name)) return ncclLookup(handle, name, version);
  return pitstop_dl.dlvsym(handle, name, version);
}

/* ---- the look at loaded objects ------------------------------------------------------------- */
#define MAX_OBJS 2048
#define MAX_GOTS 1024
struct seen { ElfW(Addr) base; const char *name; };
struct instance { ElfW(Addr) base, lo, hi; const char *name, *soname; };
struct got {
  ElfW(Addr) *slot;
  int api;               /* index into pitstop_api_names */
  int jumpSlot;          /* a PLT entry: lazily bound at its first call unless bindNow */
  int obj;               /* index into users */
  int looked;            /* checked once already */
};
struct user { ElfW(Addr) lo, hi, relroLo, relroHi; const char *name; int bindNow; const char *needs; };

static pthread_mutex_t scanLock = PTHREAD_MUTEX_INITIALIZER;
static unsigned long long lastAdds = ~0ull, lastSubs = ~0ull;
static struct objref scanObjs[MAX_OBJS];
static struct seen seenObjs[MAX_OBJS];
static int nseen;
static struct instance instances[16];
static int ninstances;
static struct got gots[MAX_GOTS];
static int ngots;
static struct user users[256];
static int nusers;

static int wasSeen(ElfW(Addr) base, const char *name) {
  for (int i = 0; i < nseen; i++) if (seenObjs[i].base == base && seenObjs[i].name == name) return 1;
  return 0;
}

static int instanceAt(ElfW(Addr) a) {
  for (int i = 0; i < ninstances; i++) if (a >= instances[i].lo && a < instances[i].hi) return i;
  return -1;
}

#if defined(__x86_64__)
#define R_JUMP_SLOT R_X86_64_JUMP_SLOT
#define R_GLOB_DAT R_X86_64_GLOB_DAT
#elif defined(__aarch64__)
#define R_JUMP_SLOT R_AARCH64_JUMP_SLOT
#define R_GLOB_DAT R_AARCH64_GLOB_DAT
#endif

/* Record the object's GOT entries for NCCL calls the shim wraps. */
static void recordGots(const struct elfobj *o) {
#ifdef R_JUMP_SLOT
  int u = -1;
  for (int part = 0; part < 2; part++) {
    const ElfW(Rela) *r = part ? o->rela : o->jmprel;
    size_t n = part ? o->relasz / sizeof *r : (o->pltIsRela ? o->jmprelsz / sizeof *r : 0);
    if (!r) continue;
    for (size_t i = part ? o->relacount : 0; i < n; i++) {
      unsigned long type = ELF64_R_TYPE(r[i].r_info), sym = ELF64_R_SYM(r[i].r_info);
      if ((type != R_JUMP_SLOT && type != R_GLOB_DAT) || !sym) continue;
      const char *nm = o->strtab + o->symtab[sym].st_name;
      if (!ncclName(nm)) continue;
      int api = apiIndex(nm);
      if (api < 0 || ngots >= MAX_GOTS) continue;
      if (u < 0) {
        if (nusers >= (int)(sizeof users / sizeof *users)) return;
        u = nusers++;
        const char *needs = NULL; /* the libnccl it names in DT_NEEDED, by soname */
        for (const ElfW(Dyn) *d = o->dyn; d->d_tag != DT_NULL && !needs; d++)
          if (d->d_tag == DT_NEEDED && !strncmp(o->strtab + d->d_un.d_val, "libnccl", 7)) needs = o->strtab + d->d_un.d_val;
        users[u] = (struct user){o->lo, o->hi, o->relroLo, o->relroHi, o->name, o->bindNow, needs};
      }
      gots[ngots++] = (struct got){(ElfW(Addr) *)(o->base + r[i].r_offset), api, type == R_JUMP_SLOT, u, 0};
    }
  }
#else
  (void)o;
#endif
}

static void setGot(const struct user *u, ElfW(Addr) *slot, void *to) {
  long pg = sysconf(_SC_PAGESIZE);
  ElfW(Addr) a = (ElfW(Addr))slot;
  void *page = (void *)(a & ~(ElfW(Addr))(pg - 1));
  int ro = a >= u->relroLo && a < u->relroHi;
  if (ro && mprotect(page, (size_t)pg, PROT_READ | PROT_WRITE) != 0) return;
  __atomic_store_n(slot, (ElfW(Addr))to, __ATOMIC_RELEASE);
  if (ro) mprotect(page, (size_t)pg, PROT_READ);
}

/* The slot whose entries a user's references should name: the library behind the shim's exported
 * names where one libnccl is loaded (what binding to the shim gives), else the copy it names. */
static struct pitstop_lib *slotFor(int inst, const struct user *u) {
  if (ninstances <= 1) {
    struct pitstop_lib *L0 = &pitstop_libs[0];
    if (!__atomic_load_n(&L0->ready, __ATOMIC_ACQUIRE) && pitstop_resolve_quiet(L0) != 0) return NULL;
    return L0;
  }
  if (inst < 0 && u->needs)
    for (int i = 0; i < ninstances && inst < 0; i++)
      if (instances[i].soname && !strcmp(instances[i].soname, u->needs)) inst = i;
  if (inst < 0) return NULL;
  return pitstop_lib_at(pitstop_elf_sym((const void *)instances[inst].base, "ncclCommInitRank"));
}

/* Each recorded reference: bound to the shim, fine; not bound yet (lazy), bound to the shim now,
 * before its object's first call could bind it past the shim; bound into a libnccl, rebound to the
 * shim.  The first look at an object comes before its first call (a program reaches a library it
 * loaded through dlsym, and the shim looks at every dlsym), so a reference bound past the shim then
 * was bound by the loader (RTLD_NOW, BIND_NOW, RTLD_DEEPBIND), not used; one bound past it at a
 * later look was bound by a call the shim did not see, and the process is unmovable. */
static void checkGots(void) {
  for (int i = 0; i < ngots; i++) {
    struct got *g = &gots[i];
    const struct user *u = &users[g->obj];
    ElfW(Addr) v = __atomic_load_n(g->slot, __ATOMIC_ACQUIRE);
    int inst = instanceAt(v), first = !g->looked;
    int unbound = v >= u->lo && v < u->hi && g->jumpSlot && !u->bindNow; /* still its own PLT stub */
    g->looked = 1;
    if (inst < 0 && !unbound) continue; /* the shim, or another object's definition: left as it is */
    struct pitstop_lib *L = slotFor(inst, u);
    if (!L) continue;
    if (inst >= 0 && !first && !pitstop_api_passes[g->api]) {
      char note[512];
      snprintf(note, sizeof note, "%s called %s past the shim, straight into %s (its reference was bound there: "
               "RTLD_DEEPBIND, or libnccl preloaded ahead of the shim): load it without RTLD_DEEPBIND",
               *u->name ? u->name : "the program", pitstop_api_names[g->api], instances[inst].name);
      pitstop_refuse(note);
    }
    setGot(u, g->slot, pitstop_entries[L - pitstop_libs][g->api]);
  }
}

static void examine(const struct objref *r) {
  struct elfobj o;
  if (r->base == shimBase() || elfOpen(r->base, r->name, r->phdr, r->phnum, &o) != 0) return;
  if (definesNccl(&o)) {
    if (namedNccl(&o)) {
      if (ninstances < (int)(sizeof instances / sizeof *instances))
        instances[ninstances++] = (struct instance){o.base, o.lo, o.hi, o.name, o.soname};
      return;
    }
    char note[512];
    snprintf(note, sizeof note, "NCCL is inside %s (soname %s), not a libnccl the shim can stand in front of "
             "(NCCL linked into another library, or a copy under another name): link it against libnccl.so.2, "
             "or name it in PITSTOP_NCCL_LIBRARY if it is a plain copy of NCCL",
             *o.name ? o.name : "the program", o.soname ? o.soname : "none");
    pitstop_refuse(note);
    return;
  }
  recordGots(&o);
}

void pitstop_scan(void) {
  struct collect c = {scanObjs, 0, 0, 0, 0}; /* max 0: the counts alone, cheap */
  dl_iterate_phdr(collectCb, &c);
  if (c.adds == __atomic_load_n(&lastAdds, __ATOMIC_RELAXED) && c.subs == __atomic_load_n(&lastSubs, __ATOMIC_RELAXED))
    return;
  pitstop_scan_now();
}

/* Look now, whatever the counts say (a new communicator, a cut: lazy bindings made since). */
void pitstop_scan_now(void) {
  if (pthread_mutex_trylock(&scanLock) != 0) return; /* another thread is looking (or this one, from inside) */
  struct collect c = {scanObjs, MAX_OBJS, 0, 0, 0};
  dl_iterate_phdr(collectCb, &c);
  if (c.subs != lastSubs) { nseen = ninstances = ngots = nusers = 0; } /* something was unloaded: look again at all */
  int n = c.n < MAX_OBJS ? c.n : MAX_OBJS;
  for (int pass = 0; pass < 2; pass++) /* libnccl instances first: the references are checked against them */
    for (int i = 0; i < n; i++) {
      struct objref *r = &scanObjs[i];
      if (wasSeen(r->base, r->name)) continue;
      struct elfobj o;
      int isInstance = elfOpen(r->base, r->name, r->phdr, r->phnum, &o) == 0 && definesNccl(&o) && namedNccl(&o);
      if (isInstance != (pass == 0)) continue;
      examine(r);
      if (nseen < MAX_OBJS) seenObjs[nseen++] = (struct seen){r->base, r->name};
    }
  checkGots();
  __atomic_store_n(&lastSubs, c.subs, __ATOMIC_RELAXED);
  __atomic_store_n(&lastAdds, c.adds, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&scanLock);
}

/* The objects a program starts with: looked at before main, before any of their calls. */
__attribute__((constructor)) static void atLoad(void) {
  if (!pitstop_dl.dlsym) pitstop_dl_init();
  pitstop_scan_now();
}

/* ---- slot 0: where the real NCCL functions behind the shim's exported names are ------------
 *
 * PITSTOP_NCCL_LIBRARY, when set, names the library.  Else, first, the next definition in the
 * global scope (libc's dlsym(RTLD_NEXT), called from here): the case of a program linked
 * against libnccl or one that loads it RTLD_GLOBAL, and of an interposer between the shim and
 * libnccl.  PyTorch is not that case: Python dlopens libtorch_cuda.so RTLD_LOCAL, and the
 * libnccl.so.2 it needs is loaded into that local scope, out of RTLD_NEXT's reach, while
 * libtorch_cuda's own calls still bind to the preloaded shim first.  So, second, a libnccl that
 * is already loaded (recognised by its name and its symbols, above): soname libnccl.so.2
 * first, else the first in load order, its functions read from its own symbol table.  Other
 * copies the program reaches through a handle of its own get slots of their own (above).  A
 * definition inside the shim itself is never taken (that would recurse). */

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
  if (strncmp(b, "libnccl", 7) != 0) return 0; /* a cheap first cut; its symbols are checked below */
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
  if (L != &pitstop_libs[0]) return -1; /* other slots are filled when they are met (slotFor) */
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
