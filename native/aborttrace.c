/*
 * A diagnostic for test and bench jobs: when a thread of the process aborts, print that
 * thread's native stack to stderr, then die of the abort as before.
 *
 * Why: a rank of the test suite's DDP job (tests/workloads/ddp_train.py) has been seen to
 * abort at exit, "terminate called without an active exception", about once in four full
 * runs (docs/reliability.md).  faulthandler showed the main thread with no Python frame left
 * and the aborting thread not a Python thread; torch's all-threads handler lost its signals
 * in the exiting process.  This prints only the thread the kernel delivered SIGABRT to, from
 * inside it, which needs nothing from the rest of the process.
 *
 * Loaded with ctypes before faulthandler is enabled, so faulthandler's handler runs first
 * and, when it is done, re-raises the signal into this one (it restores the handler it
 * replaced).  The job's exit status stays 134.
 */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static struct sigaction previous;

static void on_abort(int sig, siginfo_t *si, void *uc)
{
	void *frames[64];
	char head[128];
	int n = backtrace(frames, 64);
	int len = snprintf(head, sizeof head, "pitstop-aborttrace: thread %ld received signal %d; its native stack:\n",
			   (long)syscall(SYS_gettid), sig);
	if (len > 0 && write(2, head, (size_t)len) < 0)
		return;
	backtrace_symbols_fd(frames, n, 2);
	sigaction(SIGABRT, &previous, NULL);
	raise(sig);
}

__attribute__((constructor)) static void install(void)
{
	void *warm[1];
	struct sigaction sa;

	backtrace(warm, 1); /* loads the unwinder now: not inside the handler */
	memset(&sa, 0, sizeof sa);
	sa.sa_sigaction = on_abort;
	sa.sa_flags = SA_SIGINFO;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGABRT, &sa, &previous);
}
