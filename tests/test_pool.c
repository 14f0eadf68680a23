/* test_pool.c - the thread pool: every index is covered exactly once, the
 * split follows the documented rule (and is the same on every run), the
 * caller runs chunk 0 and the chunks of workers that have not started,
 * nested calls run inline, several user threads may
 * call it at once, KILN_NUM_THREADS sets the default, a forked child gets
 * a working pool, and after shutdown every call runs inline. */
#include <check.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "eager/pool.h"

enum { MAX_CALLS = 260 }; /* more than the pool's most threads */

typedef struct cover {
  _Atomic int *hits;       /* hits[i]: how many chunks contained index i */
  _Atomic int ncalls;
  int64_t begin[MAX_CALLS], end[MAX_CALLS];
  pthread_t who[MAX_CALLS];
} cover;

static void cover_fn(void *ctx, int64_t b, int64_t e) {
  cover *c = ctx;
  int k = atomic_fetch_add(&c->ncalls, 1);
  if (k < MAX_CALLS) {
    c->begin[k] = b;
    c->end[k] = e;
    c->who[k] = pthread_self();
  }
  for (int64_t i = b; i < e; i++) atomic_fetch_add(&c->hits[i], 1);
}

/* The split the header promises: min(threads, n / grain) chunks, at least one. */
static int64_t expected_chunks(int64_t n, int64_t grain, int threads) {
  if (grain < 1) grain = 1;
  int64_t k = n / grain;
  if (k > threads) k = threads;
  return k < 1 ? 1 : k;
}

static int cmp_begin(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* Run one (n, grain, threads) case; check coverage, chunk count and sizes,
 * and return the sorted chunk begins in out (for the determinism check). */
static void run_case(int64_t n, int64_t grain, int threads, int64_t *out, int64_t *nout) {
  pool_set_num_threads(threads);
  cover *c = calloc(1, sizeof *c);
  c->hits = calloc((size_t)n + 1, sizeof *c->hits);
  pool_parallel_for(n, grain, cover_fn, c);
  int64_t want = n <= 0 ? 0 : expected_chunks(n, grain, threads);
  int calls = atomic_load(&c->ncalls);
  ck_assert_msg(calls == want, "n=%lld grain=%lld threads=%d: %d chunks, expected %lld",
                (long long)n, (long long)grain, threads, calls, (long long)want);
  /* Check asserts are slow (each one reports through a pipe): test in plain
   * code and assert on the first bad index only. */
  int64_t bad = -1;
  for (int64_t i = 0; i < n && bad < 0; i++)
    if (atomic_load(&c->hits[i]) != 1) bad = i;
  ck_assert_msg(bad < 0, "n=%lld grain=%lld threads=%d: index %lld hit %d times", (long long)n,
                (long long)grain, threads, (long long)bad, bad < 0 ? 1 : atomic_load(&c->hits[bad]));
  int64_t g = grain < 1 ? 1 : grain;
  for (int k = 0; k < calls; k++) {
    int64_t len = c->end[k] - c->begin[k];
    /* near-equal split: sizes differ by at most one, each at least grain */
    bool ok = len > 0 && (calls == 1 || len >= g) && len >= n / calls && len <= n / calls + 1;
    ck_assert_msg(ok, "n=%lld grain=%lld threads=%d: chunk [%lld,%lld)", (long long)n, (long long)grain,
                  threads, (long long)c->begin[k], (long long)c->end[k]);
    if (c->begin[k] == 0) ck_assert(pthread_equal(c->who[k], pthread_self()));
    out[k] = c->begin[k];
  }
  qsort(out, (size_t)calls, sizeof *out, cmp_begin);
  *nout = calls;
  free(c->hits);
  free(c);
}

START_TEST(test_cover_every_index_once) {
  static const int64_t ns[] = {0, 1, 2, 3, 5, 7, 8, 31, 100, 1000, 1023, 4097, 100003};
  static const int64_t grains[] = {0, 1, 2, 3, 7, 64, 1000, 5000, 1 << 20};
  static const int threads[] = {1, 2, 3, 4, 7, 16};
  for (size_t a = 0; a < sizeof ns / sizeof *ns; a++)
    for (size_t b = 0; b < sizeof grains / sizeof *grains; b++)
      for (size_t t = 0; t < sizeof threads / sizeof *threads; t++) {
        int64_t first[MAX_CALLS], second[MAX_CALLS], n1, n2;
        run_case(ns[a], grains[b], threads[t], first, &n1);
        run_case(ns[a], grains[b], threads[t], second, &n2);
        ck_assert_int_eq(n1, n2);
        ck_assert(memcmp(first, second, (size_t)n1 * sizeof *first) == 0);
      }
}
END_TEST

/* A worker that has not taken its chunk by the time the caller is done with
 * chunk 0 does not hold the job up: the caller runs that chunk itself. With
 * more threads than CPUs the workers sleep between jobs, and a tiny job is
 * usually over before they wake, so over many jobs the caller must have run
 * another chunk; every index is still covered exactly once, in the same
 * split. Under ThreadSanitizer on a busy machine the workers can win 300
 * jobs in a row, so the jobs go on until the caller has run one (at most
 * 20,000: the old pool, whose caller never does, still fails). */
START_TEST(test_late_chunks_run_by_caller) {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  int t = cpus < 1 ? 2 : cpus >= 255 ? 256 : (int)cpus + 1; /* oversubscribed: the workers sleep */
  int by_caller = 0, jobs = 0;
  for (int job = 0; job < 20000 && (job < 300 || !by_caller); job++, jobs++) {
    pool_set_num_threads(t);
    cover *c = calloc(1, sizeof *c);
    c->hits = calloc((size_t)t, sizeof *c->hits);
    pool_parallel_for(t, 1, cover_fn, c);
    int calls = atomic_load(&c->ncalls), bad = calls != t;
    for (int i = 0; i < t; i++) bad += atomic_load(&c->hits[i]) != 1;
    for (int k = 0; k < calls && k < MAX_CALLS; k++) {
      bad += c->end[k] - c->begin[k] != 1;
      by_caller += c->begin[k] > 0 && pthread_equal(c->who[k], pthread_self());
    }
    ck_assert_msg(!bad, "job %d over %d threads: %d chunks, coverage or split wrong", job, t, calls);
    free(c->hits);
    free(c);
  }
  ck_assert_msg(by_caller > 0, "in %d jobs over %d threads the caller never ran a worker's chunk", jobs, t);
}
END_TEST

/* Hand-derived splits: 10 items over 3 threads is [0,4) [4,7) [7,10). */
START_TEST(test_split_by_hand) {
  int64_t begins[MAX_CALLS], nb;
  run_case(10, 1, 3, begins, &nb);
  ck_assert_int_eq(3, nb);
  ck_assert_int_eq(0, begins[0]);
  ck_assert_int_eq(4, begins[1]);
  ck_assert_int_eq(7, begins[2]);
  /* grain 4 allows only 2 chunks of 10: [0,5) [5,10) */
  run_case(10, 4, 3, begins, &nb);
  ck_assert_int_eq(2, nb);
  ck_assert_int_eq(5, begins[1]);
  /* n == grain runs inline as one call */
  run_case(64, 64, 4, begins, &nb);
  ck_assert_int_eq(1, nb);
}
END_TEST

typedef struct nested {
  _Atomic int outer_calls, inner_calls, inner_not_inline;
  _Atomic int *hits;       /* (outer index) * 16 + inner index */
} nested;

typedef struct inner_ctx {
  nested *s;
  int64_t row;
  pthread_t self;
  int calls;
} inner_ctx;

static void inner_fn(void *ctx, int64_t b, int64_t e) {
  inner_ctx *ic = ctx;
  ic->calls++;
  if (b != 0 || e != 16 || !pthread_equal(ic->self, pthread_self()))
    atomic_fetch_add(&ic->s->inner_not_inline, 1);
  for (int64_t j = b; j < e; j++) atomic_fetch_add(&ic->s->hits[ic->row * 16 + j], 1);
}

static void outer_fn(void *ctx, int64_t b, int64_t e) {
  nested *s = ctx;
  atomic_fetch_add(&s->outer_calls, 1);
  for (int64_t i = b; i < e; i++) {
    inner_ctx ic = {s, i, pthread_self(), 0};
    pool_parallel_for(16, 1, inner_fn, &ic);
    atomic_fetch_add(&s->inner_calls, ic.calls);
  }
}

START_TEST(test_nested_runs_inline) {
  pool_set_num_threads(4);
  nested s = {0};
  s.hits = calloc(64 * 16, sizeof *s.hits);
  pool_parallel_for(64, 1, outer_fn, &s);
  int outer = atomic_load(&s.outer_calls), inner = atomic_load(&s.inner_calls);
  int not_inline = atomic_load(&s.inner_not_inline);
  ck_assert_int_eq(4, outer);
  ck_assert_int_eq(64, inner); /* one inline call per row */
  ck_assert_int_eq(0, not_inline);
  int bad = 0;
  for (int i = 0; i < 64 * 16; i++) bad += atomic_load(&s.hits[i]) != 1;
  ck_assert_int_eq(0, bad);
  free(s.hits);
}
END_TEST

typedef struct sum_ctx {
  const int64_t *x;
  _Atomic int64_t total;
} sum_ctx;

static void sum_fn(void *ctx, int64_t b, int64_t e) {
  sum_ctx *s = ctx;
  int64_t acc = 0;
  for (int64_t i = b; i < e; i++) acc += s->x[i];
  atomic_fetch_add(&s->total, acc);
}

typedef struct user_thread {
  int id, bad;
} user_thread;

static void *user_main(void *arg) {
  user_thread *u = arg;
  enum { N = 5000 };
  int64_t *x = malloc(N * sizeof *x);
  for (int64_t i = 0; i < N; i++) x[i] = (i + 1) * (u->id + 1);
  int64_t want = (int64_t)N * (N + 1) / 2 * (u->id + 1);
  for (int rep = 0; rep < 300; rep++) {
    sum_ctx s = {x, 0};
    pool_parallel_for(N - rep, 7 + rep % 50, sum_fn, &s);
    int64_t m = N - rep;
    if (atomic_load(&s.total) != m * (m + 1) / 2 * (u->id + 1)) u->bad++;
  }
  sum_ctx s = {x, 0};
  pool_parallel_for(N, 1, sum_fn, &s);
  if (atomic_load(&s.total) != want) u->bad++;
  free(x);
  return NULL;
}

START_TEST(test_concurrent_callers) {
  pool_set_num_threads(3);
  pthread_t th[4];
  user_thread u[4];
  for (int i = 0; i < 4; i++) {
    u[i] = (user_thread){i, 0};
    ck_assert_int_eq(0, pthread_create(&th[i], NULL, user_main, &u[i]));
  }
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 4; i++) ck_assert_int_eq(0, u[i].bad);
}
END_TEST

START_TEST(test_thread_count) {
  /* main() sets KILN_NUM_THREADS=3 before any pool use */
  ck_assert_int_eq(3, pool_num_threads());
  pool_set_num_threads(5);
  ck_assert_int_eq(5, pool_num_threads());
  pool_set_num_threads(0);
  ck_assert_int_eq(3, pool_num_threads());
  pool_set_num_threads(-7);
  ck_assert_int_eq(3, pool_num_threads());
  pool_set_num_threads(1);
  ck_assert_int_eq(1, pool_num_threads());
}
END_TEST

START_TEST(test_shutdown_then_inline) {
  int64_t begins[MAX_CALLS], nb;
  run_case(1000, 1, 4, begins, &nb);
  ck_assert_int_eq(4, nb);
  pool_shutdown();
  pool_shutdown();
  /* after shutdown every call is one inline call on the caller, still complete */
  cover c = {0};
  c.hits = calloc(1000, sizeof *c.hits);
  pool_parallel_for(1000, 1, cover_fn, &c);
  int calls = atomic_load(&c.ncalls);
  ck_assert_int_eq(1, calls);
  ck_assert(pthread_equal(c.who[0], pthread_self()));
  int bad = 0;
  for (int i = 0; i < 1000; i++) bad += atomic_load(&c.hits[i]) != 1;
  ck_assert_int_eq(0, bad);
  free(c.hits);
}
END_TEST

/* A forked child (Check's own fork mode, for one) gets a working pool even
 * when the parent had started workers. TSan cannot start threads in a
 * forked child, so a TSan build leaves this out. */
#ifndef __SANITIZE_THREAD__
START_TEST(test_fork_child) {
  int64_t begins[MAX_CALLS], nb;
  run_case(1000, 1, 3, begins, &nb);
  ck_assert_int_eq(3, nb);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    cover c = {0};
    _Atomic int hits[1000] = {0};
    c.hits = hits;
    pool_parallel_for(1000, 1, cover_fn, &c);
    int bad = atomic_load(&c.ncalls) != 3;
    for (int i = 0; i < 1000; i++) bad += atomic_load(&hits[i]) != 1;
    _exit(bad ? 1 : 0);
  }
  int status = 0;
  ck_assert_int_eq(pid, waitpid(pid, &status, 0));
  ck_assert(WIFEXITED(status));
  ck_assert_int_eq(0, WEXITSTATUS(status));
}
END_TEST

/* A task that forks on the calling thread: in the child the job returns
 * (its workers are gone) and a fresh pool job covers every index. */
static void fork_in_chunk0(void *ctx, int64_t b, int64_t e) {
  (void)e;
  pid_t *child = ctx;
  if (b == 0) *child = fork();
}

START_TEST(test_fork_in_task) {
  pool_set_num_threads(3);
  pid_t child = -1;
  pool_parallel_for(3, 1, fork_in_chunk0, &child);
  if (child == 0) {
    cover c = {0};
    _Atomic int hits[100] = {0};
    c.hits = hits;
    pool_parallel_for(100, 1, cover_fn, &c);
    int bad = 0;
    for (int i = 0; i < 100; i++) bad += atomic_load(&hits[i]) != 1;
    _exit(bad ? 1 : 0);
  }
  ck_assert_int_gt(child, 0);
  int status = 0;
  ck_assert_int_eq(child, waitpid(child, &status, 0));
  ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child %s", WIFEXITED(status) ? "found a bad index" : "crashed");
}
END_TEST
#endif

static Suite *pool_suite(void) {
  Suite *s = suite_create("pool");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_thread_count);
  tcase_add_test(tc, test_split_by_hand);
  tcase_add_test(tc, test_cover_every_index_once);
  tcase_add_test(tc, test_nested_runs_inline);
  tcase_add_test(tc, test_concurrent_callers);
  tcase_add_test(tc, test_late_chunks_run_by_caller);
#ifndef __SANITIZE_THREAD__
  tcase_add_test(tc, test_fork_child);
  tcase_add_test(tc, test_fork_in_task);
#endif
  suite_add_tcase(s, tc);
  /* shutdown is final for the process, so it gets its own case (and fork) */
  TCase *end = tcase_create("shutdown");
  tcase_add_test(end, test_shutdown_then_inline);
  suite_add_tcase(s, end);
  return s;
}

int main(void) {
  setenv("KILN_NUM_THREADS", "3", 1);
  SRunner *sr = srunner_create(pool_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed;
}
