/* The shim's control block (ctl.h): made on first use, shared with the agent through a memfd the
 * agent finds in /proc/PID/maps, and the notes the shim leaves in it for the operator.
 *
 * Its own unit, below both the loader's side (dl.c, which meets libraries it cannot stand in
 * front of) and the communicators' side (shim.c): each reaches the block and the refusal here,
 * and neither reaches into the other for them. */
#define _GNU_SOURCE
#include "block.h"

#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

struct pitstop_ctl *pitstop_ctl;
uint32_t pitstop_seen;
pthread_mutex_t pitstop_real_lock = PTHREAD_MUTEX_INITIALIZER;
__thread struct pitstop_lib *pitstop_in __attribute__((tls_model("initial-exec")));

struct pitstop_ctl *pitstop_ctl_get(void) {
  static pthread_mutex_t made = PTHREAD_MUTEX_INITIALIZER;
  if (pitstop_ctl) return pitstop_ctl;
  pthread_mutex_lock(&made); /* a thread of its own may meet something unmovable (dl.c) */
  if (pitstop_ctl) { pthread_mutex_unlock(&made); return pitstop_ctl; }
  int fd = memfd_create("pitstop-ctl", MFD_CLOEXEC);
  void *p = MAP_FAILED;
  if (fd >= 0 && ftruncate(fd, sizeof(struct pitstop_ctl)) == 0)
    p = mmap(NULL, sizeof(struct pitstop_ctl), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (fd >= 0) close(fd);
  if (p == MAP_FAILED) { /* still correct, just not movable: the agent will find no block */
    static struct pitstop_ctl fallback;
    p = &fallback;
  }
  struct pitstop_ctl *c = p;
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  memcpy(c->magic, PITSTOP_CTL_MAGIC, sizeof PITSTOP_CTL_MAGIC);
  c->version = 5;
  c->lost_comm = -1;
  /* unique to this process's start: its pid and the time, mixed (a restored copy keeps it) */
  uint64_t ns = (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
  c->token = ((uint64_t)getpid() ^ (ns + 0x9e3779b97f4a7c15ull)) * 0xff51afd7ed558ccdull;
  c->parked_comm = -1;
  __atomic_store_n(&pitstop_ctl, c, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&made);
  return c;
}

int pitstop_first_time(const char *call) {
  static char said[64][48];
  static int nsaid;
  for (int i = 0; i < nsaid; i++) if (!strcmp(said[i], call)) return 0;
  if (nsaid < 64) snprintf(said[nsaid++], sizeof said[0], "%s", call);
  return 1;
}

/* The first note stays in the block: the agent reports the worker unmovable with it, and the cut
 * refuses it. */
void pitstop_refuse(const char *note) {
  struct pitstop_ctl *c = pitstop_ctl_get();
  if (__atomic_fetch_add(&c->refused, 1, __ATOMIC_RELAXED) == 0)
    snprintf(c->refused_note, sizeof c->refused_note, "%s", note);
  if (pitstop_first_time(note))
    fprintf(stderr, "pitstop shim: %s (the job runs, but pitstop cannot move it)\n", note);
}
