/* How this process's OpenMP threads wait, switched at run time (kernels/cpu_threads.py decides when).
 *
 * libgomp reads its wait policy once, when it loads: a thread that finds nothing to do (at a barrier, or
 * docked between parallel regions) spins GOMP_SPINCOUNT times (300000 by default, milliseconds) before it
 * sleeps. On cores of its own that spin is what makes a decode step's hundreds of parallel regions cheap;
 * beside other work it burns the core a descheduled partner needs, at every barrier. libgomp spins far
 * less (100 times, its documented throttled count) whenever it manages more threads than the process has
 * cores; epserve_brief_waits(1) makes it so by keeping a team of cores + 1 threads alive on a thread of
 * its own, asleep; epserve_brief_waits(0) lets that thread and its team go, and the full spin is back. */
#include <omp.h>
#include <pthread.h>
#include <unistd.h>

static pthread_mutex_t holder_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t holder_wake = PTHREAD_COND_INITIALIZER;
static pthread_t holder;
static int holding, releasing;
static volatile int holder_team; /* written in the region, so the compiler keeps the region */

/* The holder: one parallel region of cores + 1 threads (its pool's threads stay, asleep, counted by
 * libgomp while this thread lives), then sleep until released; its exit frees the pool. */
static void *hold_team(void *unused) {
  (void)unused;
  const int n = (int)sysconf(_SC_NPROCESSORS_ONLN) + 1;
  #pragma omp parallel num_threads(n)
  {
    if (omp_get_thread_num() == 0) holder_team = omp_get_num_threads();
  }
  pthread_mutex_lock(&holder_lock);
  while (!releasing) pthread_cond_wait(&holder_wake, &holder_lock);
  pthread_mutex_unlock(&holder_lock);
  return NULL;
}

/* A forked child has no holder thread (fork copies only the caller). */
static void forget_holder(void) { holding = 0; }

/* Brief waits (on = 1) or libgomp's own (on = 0). Returns the holder's team size (cores + 1) while the waits
 * are brief, 0 while they are libgomp's own, -1 when the holder's thread could not start. */
int epserve_brief_waits(int on) {
  static int registered;
  if (!registered) {
    pthread_atfork(NULL, NULL, forget_holder);
    registered = 1;
  }
  if (on && !holding) {
    releasing = 0;
    holder_team = 0;
    if (pthread_create(&holder, NULL, hold_team, NULL)) return -1;
    holding = 1;
    while (!holder_team) usleep(100); /* the team exists: the waits are brief from here */
  } else if (!on && holding) {
    pthread_mutex_lock(&holder_lock);
    releasing = 1;
    pthread_cond_signal(&holder_wake);
    pthread_mutex_unlock(&holder_lock);
    pthread_join(holder, NULL);
    holding = 0;
  }
  return holding ? holder_team : 0;
}
