/* pool.c - persistent pthread workers behind pool_parallel_for.
 *
 * Worker i (1-based) is offered chunk i of every job it is handed; the
 * caller runs chunk 0. Each worker has its own slot (a generation counter,
 * its bounds, a ticket and a condvar), so a job wakes only the workers it
 * needs and a worker never reads another job's fields. A worker takes its
 * chunk by moving the ticket from open to running; the caller, done with
 * its own chunk, closes every ticket still open and runs those chunks
 * itself. A worker the OS has not run yet (on a shared machine that can be
 * tens of microseconds) then costs the caller nothing but the parallelism:
 * it waits only for chunks a worker started. One job runs at a time: a
 * second caller that finds the pool busy, or any nested call, runs its
 * range inline. */
#include "eager/pool.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <unistd.h>

#ifdef KILN_RT_NO_BLAS
/* libkiln_rt built without OpenBLAS (a cross build, docs/deploy.md): no BLAS threads to set */
static void openblas_set_num_threads(int n) { (void)n; }
#else
void openblas_set_num_threads(int);
#endif

enum { MAX_THREADS = 256, SPIN = 2000 };

/* A ticket is the job's generation times 4 plus its state: the worker's
 * stale view of an earlier job can never take a later job's chunk. */
enum { OPEN, RUNNING, DONE, CLOSED };
#define TICKET(g, state) ((g) << 2 | (uint64_t)(state))

typedef struct slot {
  pthread_t thread;
  pthread_cond_t wake;         /* signalled when gen moves on or at shutdown */
  _Atomic uint64_t gen;        /* bumped once per job handed to this worker */
  _Atomic uint64_t ticket;     /* who runs this worker's chunk of job gen */
  int64_t begin, end;          /* this worker's chunk of the current job */
  int idx;                     /* its index in workers[] */
} slot;

static pthread_once_t once = PTHREAD_ONCE_INIT;
static pthread_mutex_t run_mu = PTHREAD_MUTEX_INITIALIZER;  /* held by the one running job */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;      /* guards sleeping and waking */
static pthread_cond_t done = PTHREAD_COND_INITIALIZER;      /* signalled when a worker finishes a chunk */
static slot *workers[MAX_THREADS];                          /* [0] unused: chunk 0 is the caller's */
static int nworkers;                                        /* workers started (under run_mu) */
static _Atomic int nthreads;
static _Atomic int spin;                                    /* SPIN, or 0 when threads > CPUs */
static int ncpus;
static _Atomic bool stopping;
static bool closed;                                         /* after shutdown (under run_mu) */
static pool_fn job_fn;                                      /* written only while no ticket is running */
static void *job_ctx;
static _Thread_local __attribute__((tls_model("initial-exec"))) bool in_pool;                         /* this thread is running a pool task */
static _Atomic unsigned forks;                              /* bumped in a forked child */
static _Atomic int started;                                 /* workers started */
static _Atomic bool asleep[MAX_THREADS];                    /* worker i asleep on its condvar */

/* Spin step i of a wait: mostly a pause, with a yield now and then so that an
 * oversubscribed machine runs the thread being waited for instead. */
static inline void spin_step(int i) {
  if ((i & 63) == 63) {
    sched_yield();
    return;
  }
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

/* KILN_NUM_THREADS if a positive integer, else the online CPU count. */
static int default_threads(void) {
  const char *s = getenv("KILN_NUM_THREADS");
  if (s && *s) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (!errno && *end == '\0' && v > 0) return v < MAX_THREADS ? (int)v : MAX_THREADS;
  }
  return ncpus;
}

/* Spinning only pays when every thread has a core; oversubscribed, it steals
 * the core from the thread being waited for. */
static void set_threads(int n) {
  atomic_store(&nthreads, n);
  atomic_store(&spin, n <= ncpus ? SPIN : 0);
}

/* In a forked child the workers are gone: forget them and reset the locks,
 * so the child (a Check test case, say) starts a fresh set on first use. */
static void after_fork_child(void) {
  atomic_fetch_add(&forks, 1);
  for (int i = 1; i <= nworkers; i++) {
    free(workers[i]);
    workers[i] = NULL;
  }
  nworkers = 0;
  atomic_store(&started, 0);
  for (int i = 0; i < MAX_THREADS; i++) atomic_store(&asleep[i], false);
  pthread_mutex_init(&run_mu, NULL);
  pthread_mutex_init(&mu, NULL);
  pthread_cond_init(&done, NULL);
}

static void init(void) {
  long c = sysconf(_SC_NPROCESSORS_ONLN);
  ncpus = c < 1 ? 1 : c < MAX_THREADS ? (int)c : MAX_THREADS;
  set_threads(default_threads());
  pthread_atfork(NULL, NULL, after_fork_child);
  if (getenv("KILN_NUM_THREADS")) openblas_set_num_threads(atomic_load(&nthreads));
  atexit(pool_shutdown);
}

/* Worker loop: spin briefly for the next job, then sleep on its own condvar. */
static void *worker_main(void *arg) {
  slot *s = arg;
  uint64_t seen = 0;
  in_pool = true;
  for (;;) {
    uint64_t g = atomic_load_explicit(&s->gen, memory_order_acquire);
    for (int i = 0, lim = atomic_load(&spin); i < lim && g == seen && !atomic_load(&stopping); i++) {
      spin_step(i);
      g = atomic_load_explicit(&s->gen, memory_order_acquire);
    }
    if (g == seen) {
      pthread_mutex_lock(&mu);
      atomic_store(&asleep[s->idx], true);
      while ((g = atomic_load(&s->gen)) == seen && !atomic_load(&stopping))
        pthread_cond_wait(&s->wake, &mu);
      atomic_store(&asleep[s->idx], false);
      pthread_mutex_unlock(&mu);
    }
    if (g == seen) return NULL;  /* stopping with no job left */
    seen = g;
    uint64_t open = TICKET(g, OPEN);
    if (!atomic_compare_exchange_strong_explicit(&s->ticket, &open, TICKET(g, RUNNING), memory_order_acq_rel,
                                                 memory_order_acquire))
      continue; /* the caller ran this chunk itself */
    job_fn(job_ctx, s->begin, s->end);
    atomic_store_explicit(&s->ticket, TICKET(g, DONE), memory_order_release);
    pthread_mutex_lock(&mu);
    pthread_cond_signal(&done);
    pthread_mutex_unlock(&mu);
  }
}

/* Start workers until there are `want` of them (under run_mu); returns how
 * many of those wanted exist (fewer if a thread could not be started). */
static int grow(int want) {
  while (nworkers < want) {
    slot *s = calloc(1, sizeof *s);
    if (!s) break;
    pthread_cond_init(&s->wake, NULL);
    s->idx = nworkers + 1;
    if (pthread_create(&s->thread, NULL, worker_main, s) != 0) {
      pthread_cond_destroy(&s->wake);
      free(s);
      break;
    }
    workers[++nworkers] = s;
    atomic_store(&started, nworkers);
  }
  return nworkers < want ? nworkers : want;
}

/* Is the worker's chunk of job g finished: run by the worker, or closed and
 * run by the caller? */
static bool chunk_over(slot *w, uint64_t g) {
  uint64_t t = atomic_load_explicit(&w->ticket, memory_order_acquire);
  return t == TICKET(g, DONE) || t == TICKET(g, CLOSED);
}

/* Bounds of chunk c of n items split into k nearly equal parts. */
static void chunk(int64_t n, int64_t k, int64_t c, int64_t *b, int64_t *e) {
  int64_t q = n / k, r = n % k;
  *b = c * q + (c < r ? c : r);
  *e = *b + q + (c < r);
}

bool pool_workers_awake(void) {
  int need = pool_num_threads() - 1; /* the workers a full-width job hands chunks */
  if (need < 1 || atomic_load_explicit(&started, memory_order_relaxed) < need) return false;
  for (int i = 1; i <= need; i++)
    if (atomic_load_explicit(&asleep[i], memory_order_relaxed)) return false;
  return true;
}

void pool_parallel_for(int64_t n, int64_t grain, pool_fn fn, void *ctx) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  int64_t k = n / grain;
  int t = pool_num_threads();
  if (k > t) k = t;
  if (k <= 1 || in_pool || pthread_mutex_trylock(&run_mu) != 0) {
    fn(ctx, 0, n);
    return;
  }
  if (closed) {
    pthread_mutex_unlock(&run_mu);
    fn(ctx, 0, n);
    return;
  }
  int have = grow((int)k - 1);  /* chunks without a worker fall back to the caller */
  unsigned forked = atomic_load(&forks);
  job_fn = fn;
  job_ctx = ctx;
  /* Bump under mu so a worker about to sleep cannot miss it; signal after
   * unlocking so the woken worker does not block on mu at once. */
  pthread_mutex_lock(&mu);
  for (int i = 1; i <= have; i++) {
    slot *w = workers[i];
    chunk(n, k, i, &w->begin, &w->end);
    uint64_t g = atomic_load_explicit(&w->gen, memory_order_relaxed) + 1;
    atomic_store_explicit(&w->ticket, TICKET(g, OPEN), memory_order_release);
    atomic_store_explicit(&w->gen, g, memory_order_release);
  }
  pthread_mutex_unlock(&mu);
  for (int i = 1; i <= have; i++) pthread_cond_signal(&workers[i]->wake);

  in_pool = true;
  int64_t b, e;
  for (int64_t c = 0; c < k; c = (c == 0 ? have + 1 : c + 1)) {
    chunk(n, k, c, &b, &e);
    fn(ctx, b, e);
  }
  if (atomic_load(&forks) != forked) {
    /* a task forked and this is the child: its workers and their slots are
     * gone, and with them what they had done; its pool starts afresh */
    in_pool = false;
    return;
  }
  /* the chunks no worker has taken yet are the caller's (a slot's gen is
   * written only here, under run_mu: the caller reads its own value) */
  for (int i = 1; i <= have; i++) {
    uint64_t g = atomic_load_explicit(&workers[i]->gen, memory_order_relaxed), open = TICKET(g, OPEN);
    if (atomic_compare_exchange_strong_explicit(&workers[i]->ticket, &open, TICKET(g, CLOSED), memory_order_acq_rel,
                                                memory_order_acquire)) {
      chunk(n, k, i, &b, &e);
      fn(ctx, b, e);
    }
  }
  in_pool = false;

  for (int i = 1; i <= have; i++) {
    slot *w = workers[i];
    uint64_t g = atomic_load_explicit(&w->gen, memory_order_relaxed);
    for (int j = 0, lim = atomic_load(&spin); j < lim && !chunk_over(w, g); j++) spin_step(j);
    if (!chunk_over(w, g)) {
      pthread_mutex_lock(&mu);
      while (!chunk_over(w, g)) pthread_cond_wait(&done, &mu);
      pthread_mutex_unlock(&mu);
    }
  }
  pthread_mutex_unlock(&run_mu);
}

int pool_num_threads(void) {
  pthread_once(&once, init);
  return atomic_load(&nthreads);
}

void pool_set_num_threads(int n) {
  pthread_once(&once, init);
  if (n < 1) n = default_threads();
  if (n > MAX_THREADS) n = MAX_THREADS;
  set_threads(n);
  openblas_set_num_threads(n);
}

void pool_shutdown(void) {
  /* A job still running (exit() called from a task or another thread) keeps
   * its workers: the process is going away and joining them could hang. */
  if (pthread_mutex_trylock(&run_mu) != 0) return;
  pthread_mutex_lock(&mu);
  atomic_store(&stopping, true);
  for (int i = 1; i <= nworkers; i++) pthread_cond_signal(&workers[i]->wake);
  pthread_mutex_unlock(&mu);
  for (int i = 1; i <= nworkers; i++) {
    pthread_join(workers[i]->thread, NULL);
    pthread_cond_destroy(&workers[i]->wake);
    free(workers[i]);
    workers[i] = NULL;
  }
  nworkers = 0;
  atomic_store(&started, 0);
  closed = true;
  pthread_mutex_unlock(&run_mu);
}
