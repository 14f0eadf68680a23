/* Threads: eager results do not depend on the thread count (reductions and
 * pointwise ops are bitwise equal at 1, 2 and 3 threads), and several user
 * threads may run eager ops at once (each with its own scopes and errors). */
#include <check.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

/* Runs a fixed mix of big ops at n threads; returns a malloc'd copy of the results. */
static float *run_mix(int n, size_t *count) {
  kiln_set_num_threads(n);
  kiln_scope_begin();
  int64_t s[3] = {37, 129, 211};
  kiln_tensor *x = kiln_randn(KILN_F32, 3, s, 11);
  int ax01[2] = {0, 1}, ax02[2] = {0, 2};
  kiln_tensor *r[] = {
      kiln_sum(x, 2, false),          kiln_sum(x, 0, false),
      kiln_sum_axes(x, ax01, 2, false), kiln_sum_axes(x, ax02, 2, false),
      kiln_mean_all(x),               kiln_max(x, 1, false),
      kiln_reshape(kiln_tanh(kiln_transpose(x, 0, 2)), 1, ((int64_t[]){-1})),
      kiln_reshape(kiln_softmax(x, 1), 1, ((int64_t[]){-1})),
  };
  size_t total = 0;
  for (size_t i = 0; i < sizeof r / sizeof *r; i++) {
    ck_assert_msg(r[i] != NULL, "%s", kiln_last_error());
    total += (size_t)kiln_numel(r[i]);
  }
  float *out = malloc(total * sizeof *out), *p = out;
  for (size_t i = 0; i < sizeof r / sizeof *r; i++) {
    size_t k = (size_t)kiln_numel(r[i]);
    ck_assert_int_eq(0, kiln_read(r[i], p, k * sizeof *p));
    p += k;
  }
  kiln_scope_end();
  kiln_set_num_threads(0);
  *count = total;
  return out;
}

START_TEST(test_bitwise_across_thread_counts) {
  size_t n1, n2, n3;
  float *a = run_mix(1, &n1), *b = run_mix(2, &n2), *c = run_mix(3, &n3);
  ck_assert_uint_eq(n1, n2);
  ck_assert_uint_eq(n1, n3);
  for (size_t i = 0; i < n1; i++) {
    ck_assert_msg(memcmp(&a[i], &b[i], sizeof *a) == 0, "element %zu: 1 thread %a, 2 threads %a", i, a[i], b[i]);
    ck_assert_msg(memcmp(&a[i], &c[i], sizeof *a) == 0, "element %zu: 1 thread %a, 3 threads %a", i, a[i], c[i]);
  }
  free(a), free(b), free(c);
}
END_TEST

/* Each thread computes sum(x * k) for its own k; the answer is k * sum(x),
 * with sum(x) known exactly because x holds small integers. */
static void *worker(void *arg) {
  long k = (long)arg;
  long bad = 0;
  for (int it = 0; it < 20; it++) {
    kiln_scope_begin();
    kiln_tensor *x = kiln_arange(KILN_F32, 0, 200000, 1); /* sum = 199999*200000/2 */
    kiln_tensor *y = kiln_sum_all(kiln_mul(x, kiln_scalar(KILN_F32, (double)k)));
    double got = y ? kiln_item(y) : -1;
    double want = 199999.0 * 200000.0 / 2.0 * (double)k;
    if (got != want && (got - want > want * 1e-6 || want - got > want * 1e-6)) bad++;
    /* an error on this thread must not show up on another */
    kiln_tensor *e = kiln_add(x, kiln_zeros(KILN_F32, 1, ((int64_t[]){3})));
    if (e || !strstr(kiln_last_error(), "kiln_add")) bad++;
    kiln_clear_error();
    kiln_scope_end();
  }
  return (void *)bad;
}

START_TEST(test_concurrent_user_threads) {
  pthread_t th[4];
  for (long i = 0; i < 4; i++) ck_assert_int_eq(0, pthread_create(&th[i], NULL, worker, (void *)(i + 1)));
  for (int i = 0; i < 4; i++) {
    void *r;
    pthread_join(th[i], &r);
    ck_assert_msg(r == NULL, "thread %d: %ld wrong results", i, (long)r);
  }
}
END_TEST

int main(void) {
  Suite *s = suite_create("threads");
  TCase *tc = tcase_create("threads");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_bitwise_across_thread_counts);
  tcase_add_test(tc, test_concurrent_user_threads);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
