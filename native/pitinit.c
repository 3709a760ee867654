/* pitstop-init: the init of a worker's PID namespace, so that the worker's command is not.
 * `pitstop run` starts `pitstop-init --pid-namespace DIR -- CMD ARGS...`: this process makes
 * the namespace, forks its init (which leads a session of its own) and waits for it, as
 * `unshare --pid --fork setsid` did before.  Not util-linux unshare: when a move kills the
 * source's tree, unshare sees its child die of SIGKILL, tries to die of it too, fails, and prints
 * "unshare: sigprocmask unblock failed: Invalid argument" into the job's stderr (2.38).  This
 * waiter exits quietly with 128 + N instead.  Without --pid-namespace the caller has made the
 * namespace and this process is its init already.
 *
 * Why: the worker keeps the host's mount namespace, so its /proc is not its own, and CRIU's
 * parasite mounts a private one in the *root task's working directory* under a fixed name
 * ("proc.crtools", criu/pie/parasite.c get_proc_fd).  Ranks of a job on one host share a
 * working directory, so their dumps raced on that name and the agent lets the next one start
 * only once the previous one's mount point is gone again (proc/procwindow.py): 0.05-0.09 s
 * per rank on the reference VM, so the last of 8 ranks on a GPU host would start its dump
 * 7 turns late.  This init is the root task and works in DIR, a directory of its own; CMD
 * keeps the working directory it was started in.  Dumps of ranks on one host then start at
 * once.  Also: CMD is no longer the namespace's init, so a forwarded signal does what it does
 * outside a namespace (the kernel drops signals an init has no handler for), and processes
 * orphaned inside the namespace are reaped here.
 *
 * What it does: blocks the signals it forwards and SIGCHLD, moves to DIR, forks CMD (which goes
 * back to the launcher's directory by a descriptor opened before the move, and gets the mask back,
 * before exec), then waits in sigwaitinfo(): a forwarded signal goes to
 * CMD, SIGCHLD reaps every child that ended.  When CMD ends, DIR is removed and this process
 * exits with CMD's status (128 + N where CMD died of signal N); the kernel then ends the rest
 * of the namespace, as it did when CMD was its init.  Linked statically where it can be, so
 * that nothing preloaded into the worker (the NCCL shim, procself, writetrack) is loaded here:
 * its memory is a few pages.  CRIU interrupts sigwaitinfo() with EINTR when it dumps or
 * restores this process; the loop waits again. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

static const int forwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGQUIT, SIGWINCH, SIGALRM};
#define NFORWARDED (int)(sizeof forwarded / sizeof forwarded[0])

/* Make a PID namespace and fork its init.  Returns -1 in the init (PID 1 there, leading a
 * session of its own, as CRIU needs the tree's root to), else the exit code for the waiter left
 * outside: the init's, or 128 + N where it died of signal N (a move kills the source's tree). */
static int enter_pid_namespace(void) {
  if (unshare(CLONE_NEWPID) != 0) {
    fprintf(stderr, "pitstop-init: cannot make a PID namespace: unshare(CLONE_NEWPID): %s "
                    "(it needs CAP_SYS_ADMIN; `pitstop doctor` checks it)\n", strerror(errno));
    return 125;
  }
  pid_t init = fork();
  if (init < 0) { perror("pitstop-init: fork"); return 125; }
  if (init == 0) {
    if (setsid() < 0) { perror("pitstop-init: setsid"); _exit(125); }
    return -1;
  }
  /* As unshare --fork: a terminal's SIGINT or a SIGTERM to the launcher's group is the worker's
   * to act on (the launcher forwards it to the init), not a reason to stop waiting for it. */
  signal(SIGINT, SIG_IGN);
  signal(SIGTERM, SIG_IGN);
  int status;
  while (waitpid(init, &status, 0) < 0) {
    if (errno != EINTR) { perror("pitstop-init: waitpid"); return 125; }
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 125;
}

int main(int argc, char **argv) {
  int own_namespace = argc > 1 && strcmp(argv[1], "--pid-namespace") == 0;
  if (own_namespace) { argv++; argc--; }
  if (argc < 4 || strcmp(argv[2], "--") != 0) {
    fprintf(stderr, "usage: pitstop-init [--pid-namespace] DIR -- CMD [ARGS...]\n"
                    "  (started by `pitstop run`; DIR is a directory of this worker's own)\n");
    return 125;
  }
  if (own_namespace) {
    int code = enter_pid_namespace();
    if (code >= 0) return code;
  }
  const char *dir = argv[1];
  char **cmd = argv + 3;

  sigset_t waited, old;
  sigemptyset(&waited);
  for (int i = 0; i < NFORWARDED; i++) sigaddset(&waited, forwarded[i]);
  sigaddset(&waited, SIGCHLD);
  if (sigprocmask(SIG_BLOCK, &waited, &old) != 0) { perror("pitstop-init: sigprocmask"); return 125; }

  /* DIR before CMD exists: whoever finds CMD (its agent registers it and reads the init's
   * directory then) finds the init in DIR already, however late this process is scheduled. */
  int here = open(".", O_PATH | O_DIRECTORY | O_CLOEXEC);
  int moved = chdir(dir) == 0; /* still correct if not: only dumps of ranks sharing a directory take turns again */
  if (!moved)
    fprintf(stderr, "pitstop-init: cannot work in %s (%s); the worker runs on\n", dir, strerror(errno));

  pid_t child = fork();
  if (child < 0) { perror("pitstop-init: fork"); return 125; }
  if (child == 0) {
    if (moved && (here < 0 || fchdir(here) != 0)) {
      fprintf(stderr, "pitstop-init: cannot return to the directory %s was started in (%s)\n", cmd[0],
              strerror(here < 0 ? EBADF : errno));
      _exit(125);
    }
    sigprocmask(SIG_SETMASK, &old, NULL);
    execvp(cmd[0], cmd);
    int e = errno;
    fprintf(stderr, "pitstop-init: cannot run %s: %s\n", cmd[0], strerror(e));
    _exit(e == ENOENT ? 127 : 126);
  }
  if (here >= 0) close(here); /* nothing of the launcher's directory in the dumped init */

  for (;;) {
    siginfo_t si;
    int sig = sigwaitinfo(&waited, &si);
    if (sig < 0) continue; /* EINTR: a dump or restore of this process, or a stop and continue */
    if (sig != SIGCHLD) {
      kill(child, sig);
      continue;
    }
    int status;
    pid_t p;
    while ((p = waitpid(-1, &status, WNOHANG)) > 0) {
      if (p != child) continue;
      int code = WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 125;
      rmdir(dir);
      _exit(code);
    }
  }
}
