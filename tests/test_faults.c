/* Fault injection: every allocation of a representative scenario fails in
 * turn (the test build's alloc_fail_after). For each failure point the
 * scenario must report an error (or degrade to a correct answer, as a trace
 * that cannot be compiled runs eagerly), leave no tensor storage behind, and
 * leave the library usable: the same scenario run again without a failure
 * gives the clean run's results bit for bit. ASan's leak check at exit (and
 * once per scenario) catches any other leak. */
#include <check.h>
#include <glob.h>
#include <pthread.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "eager/eager.h" /* alloc_fail_after */
#include "kiln.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/lsan_interface.h>
#define LEAK_CHECK() __lsan_do_recoverable_leak_check()
#else
#define LEAK_CHECK() 0
#endif

#ifdef KILN_TEST_BUILD /* the failing allocator exists only there */

/* Results of one run, as floats (the test's own malloc, which never fails). */
typedef struct results {
  float *v;
  size_t n, cap;
} results;

/* Appends t's elements (cast to f32) to r; -1 when t is NULL or a step fails. */
static int take(results *r, kiln_tensor *t) {
  if (!t) return -1;
  if (kiln_type(t) != KILN_F32 && !(t = kiln_cast(t, KILN_F32))) return -1;
  size_t n = (size_t)kiln_numel(t);
  if (r->n + n > r->cap) {
    r->cap = (r->n + n) * 2 + 16;
    r->v = realloc(r->v, r->cap * sizeof *r->v);
    ck_assert_ptr_nonnull(r->v);
  }
  if (kiln_read(t, r->v + r->n, n * sizeof *r->v)) return -1;
  r->n += n;
  return 0;
}

/* A scenario: 0 with its results in r, or nonzero with the error set. It
 * cleans up after itself either way. */
typedef int (*scenario)(results *r);

/* ---- scenarios ---- */

static int eager_ops(results *r) {
  int rc = -1;
  kiln_scope_begin();
  kiln_tensor *a = kiln_randn(KILN_F32, 3, ((int64_t[]){4, 1, 6}), 1);
  kiln_tensor *b = kiln_randn(KILN_F32, 2, ((int64_t[]){5, 1}), 2);
  kiln_tensor *s = kiln_add(a, b);                                    /* broadcast (4,5,6) */
  kiln_tensor *t = kiln_transpose(s, 0, 2);                           /* view (6,5,4) */
  kiln_tensor *sl = kiln_slice(t, 1, 1, 5, 2);                         /* view (6,2,4) */
  kiln_tensor *flat = kiln_reshape(sl, 2, ((int64_t[]){6, 8}));        /* copies: not viewable */
  kiln_tensor *w = kiln_randn(KILN_F32, 2, ((int64_t[]){8, 3}), 3);
  kiln_tensor *mm = kiln_matmul(flat, w);                              /* (6,3) */
  kiln_tensor *bm = kiln_matmul(s, kiln_expand(kiln_randn(KILN_F32, 2, ((int64_t[]){6, 2}), 4), 3,
                                               ((int64_t[]){4, 6, 2})));  /* batched (4,5,2) */
  kiln_tensor *red = kiln_max(kiln_sum(s, 1, true), 2, false);         /* (4,1) */
  kiln_tensor *sm = kiln_softmax(mm, -1);
  kiln_tensor *ln = kiln_layer_norm(bm, NULL, NULL, 1e-5);
  kiln_tensor *parts[2] = {kiln_reshape(sm, 1, ((int64_t[]){-1})), kiln_reshape(ln, 1, ((int64_t[]){-1}))};
  kiln_tensor *cat = kiln_cat(parts, 2, 0);
  kiln_tensor *am = kiln_argmax(mm, 1, false);
  kiln_tensor *wh = kiln_where(kiln_gt(mm, kiln_scalar(KILN_F32, 0)), mm, kiln_neg(mm));
  if (!take(r, cat) && !take(r, red) && !take(r, am) && !take(r, wh)) rc = 0;
  kiln_scope_end();
  return rc;
}

static int autograd(results *r) {
  int rc = -1;
  kiln_scope_begin();
  kiln_tensor *w = kiln_randn(KILN_F32, 2, ((int64_t[]){5, 4}), 7);
  kiln_tensor *b = kiln_randn(KILN_F32, 1, ((int64_t[]){4}), 8);
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){6, 5}), 9);
  kiln_tensor *tg = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){6}), ((int64_t[]){0, 1, 2, 3, 0, 1}));
  if (w && b) kiln_requires_grad(w, true), kiln_requires_grad(b, true);
  kiln_tensor *h = kiln_tanh(kiln_add(kiln_matmul(x, w), b));
  kiln_tensor *loss = kiln_add(kiln_cross_entropy(h, tg), kiln_mean_all(kiln_mul(h, h)));
  kiln_tensor *g[2] = {NULL, NULL};
  kiln_tensor *wrt[2] = {w, b};
  if (loss && !kiln_grad_of(loss, wrt, 2, g)) {
    /* grads from grad_of belong to the scope; backward then fills .grad */
    if (!take(r, g[0]) && !take(r, g[1]) && !kiln_backward(loss) && !take(r, kiln_grad(w)) && !take(r, kiln_grad(b)))
      rc = 0;
  }
  kiln_scope_end();
  return rc;
}

/* Control flow: a scan whose step holds a cond, its backward, a while_loop. */
static int cf_then(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_tanh(kiln_add(in[0], in[1])));
}
static int cf_else(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_mul(in[0], in[1]));
}
static int cf_step(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *pred = kiln_gt(kiln_sum_all(in[1]), kiln_scalar(KILN_F32, 0));
  if (!pred || kiln_cond(pred, cf_then, cf_else, NULL, 2, in, 1, out)) return -1;
  out[1] = kiln_sum_all(out[0]);
  return out[1] ? 0 : -1;
}
static int cf_below(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_lt(kiln_sum_all(in[0]), kiln_scalar(KILN_F32, 40)));
}
static int cf_grow(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  return !(out[0] = kiln_add(kiln_mul(in[0], kiln_scalar(KILN_F32, 2)), kiln_scalar(KILN_F32, 1)));
}

static int control_flow(results *r) {
  int rc = -1;
  kiln_scope_begin();
  kiln_tensor *h0 = kiln_randn(KILN_F32, 1, ((int64_t[]){3}), 21);
  kiln_tensor *xs = kiln_randn(KILN_F32, 2, ((int64_t[]){5, 3}), 22);
  if (h0) kiln_requires_grad(h0, true);
  kiln_tensor *last = NULL, *ys = NULL, *fin = NULL;
  if (h0 && xs && !kiln_scan(cf_step, NULL, 1, &h0, 1, &xs, &last, 1, &ys)) {
    kiln_tensor *loss = kiln_add(kiln_sum_all(last), kiln_sum_all(ys));
    kiln_tensor *init = kiln_zeros(KILN_F32, 1, ((int64_t[]){2}));
    if (loss && !kiln_backward(loss) && init && !kiln_while_loop(cf_below, cf_grow, NULL, 1, &init, &fin) &&
        !take(r, last) && !take(r, ys) && !take(r, kiln_grad(h0)) && !take(r, fin))
      rc = 0;
  }
  kiln_scope_end();
  return rc;
}

typedef struct model {
  kiln_tensor *w, *b;
} model;

/* Two outputs: a softmax over a small MLP layer and a row statistic. */
static int mlp_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  model *m = ctx;
  kiln_tensor *h = kiln_gelu(kiln_add(kiln_matmul(in[0], m->w), m->b));
  out[0] = kiln_softmax(h, -1);
  out[1] = kiln_sum(kiln_mul(h, kiln_sigmoid(h)), 1, false);
  return out[0] && out[1] ? 0 : -1;
}

static int model_make(model *m) {
  kiln_scope_begin();
  m->w = kiln_keep(kiln_randn(KILN_F32, 2, ((int64_t[]){6, 5}), 11));
  m->b = kiln_keep(kiln_randn(KILN_F32, 1, ((int64_t[]){5}), 12));
  kiln_scope_end();
  if (m->w && m->b) return 0;
  kiln_release(m->w), kiln_release(m->b);
  return -1;
}

static void model_free(model *m) { kiln_release(m->w), kiln_release(m->b); }

/* Calls fn on a (rows,6) input; appends both outputs. The outputs are the
 * first tensors of their scope, so that adopting them allocates too. */
static int call_rows(kiln_fn *fn, int64_t rows, uint64_t seed, results *r) {
  int rc = -1;
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){rows, 6}), seed), *y[2] = {NULL, NULL};
  kiln_scope_begin();
  if (x && !kiln_call(fn, &x, y) && !take(r, y[0]) && !take(r, y[1])) rc = 0;
  kiln_scope_end();
  kiln_scope_end();
  return rc;
}

static int compiled(results *r, int backend) {
  model m;
  if (model_make(&m)) return -1;
  kiln_options o = {.name = "faulty", .n_in = 1, .n_out = 2, .backend = backend};
  kiln_fn *fn = kiln_compile(mlp_body, &m, &o);
  int rc = -1;
  /* trace; hit; new size (retrace with the rows symbolic); hit at a third size */
  if (fn && !call_rows(fn, 3, 21, r) && !call_rows(fn, 3, 22, r) && !call_rows(fn, 7, 23, r) && !call_rows(fn, 2, 24, r))
    rc = 0;
  kiln_fn_free(fn);
  model_free(&m);
  return rc;
}

static int traced_interp(results *r) { return compiled(r, KILN_BACKEND_INTERP); }
static int compiled_llvm(results *r) { return compiled(r, KILN_BACKEND_LLVM); }

/* Regions: the scan with a cond inside and the while loop, in a compiled
 * body (captured as regions, lowered per region): traced, hit, and at lengths 0 and 2. */
static int regions_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *last = NULL;
  if (kiln_scan(cf_step, NULL, 1, &in[0], 1, &in[1], &last, 1, &out[0])) return -1;
  return kiln_while_loop(cf_below, cf_grow, NULL, 1, &last, &out[1]);
}

static int call_len(kiln_fn *fn, int64_t T, uint64_t seed, results *r) {
  int rc = -1;
  kiln_scope_begin();
  kiln_tensor *in[2] = {kiln_randn(KILN_F32, 1, ((int64_t[]){3}), seed), kiln_randn(KILN_F32, 2, ((int64_t[]){T, 3}), seed + 1)};
  kiln_tensor *y[2] = {NULL, NULL};
  kiln_scope_begin();
  if (in[0] && in[1] && !kiln_call(fn, in, y) && !take(r, y[0]) && !take(r, y[1])) rc = 0;
  kiln_scope_end();
  kiln_scope_end();
  return rc;
}

static int regions(results *r, int backend) {
  kiln_options o = {.name = "regions", .n_in = 2, .n_out = 2, .backend = backend};
  kiln_fn *fn = kiln_compile(regions_body, NULL, &o);
  int rc = fn && !call_len(fn, 5, 31, r) && !call_len(fn, 5, 33, r) && !call_len(fn, 0, 35, r) && !call_len(fn, 2, 37, r) ? 0 : -1;
  kiln_fn_free(fn);
  return rc;
}

static int regions_interp(results *r) { return regions(r, KILN_BACKEND_INTERP); }
static int regions_llvm(results *r) { return regions(r, KILN_BACKEND_LLVM); }

static char export_prefix[64];
static kiln_fn *export_fn;

/* The regions' variant exported (traced once before, on the interpreter:
 * the export fuses, lowers and plans every region itself). */
static int regions_export(results *r) {
  (void)r;
  return kiln_export(export_fn, export_prefix, NULL);
}

static char graph_path[64];

static int save_load(results *r) {
  model m;
  if (model_make(&m)) return -1;
  /* traced on the interpreter (the LLVM scenario covers compiling a trace), loaded on LLVM */
  kiln_options o = {.name = "saved", .n_in = 1, .n_out = 2, .backend = KILN_BACKEND_INTERP};
  kiln_fn *fn = kiln_compile(mlp_body, &m, &o), *back = NULL;
  int rc = -1;
  if (!fn || call_rows(fn, 4, 31, r) || kiln_save(fn, graph_path)) goto done;
  if (!(back = kiln_load(graph_path))) goto done;
  kiln_scope_begin();
  kiln_tensor *in[3] = {kiln_randn(KILN_F32, 2, ((int64_t[]){4, 6}), 31), m.w, m.b}, *y[2] = {NULL, NULL};
  if (in[0] && !kiln_call(back, in, y) && !take(r, y[0]) && !take(r, y[1])) rc = 0;
  kiln_scope_end();
done:
  kiln_fn_free(back);
  kiln_fn_free(fn);
  model_free(&m);
  return rc;
}

static char weights_path[64];

/* Temporary files a save left beside weights_path (it must remove its own). */
static int stray_temporaries(void) {
  char pattern[96];
  snprintf(pattern, sizeof pattern, "%s.tmp.*", weights_path);
  glob_t g;
  int n = glob(pattern, 0, NULL, &g) == 0 ? (int)g.gl_pathc : 0;
  globfree(&g);
  return n;
}

/* Weights in a safetensors file: save views of every dtype with metadata,
 * open and get one, load them all, load two into existing tensors. */
static int weights(results *r) {
  ck_assert_msg(stray_temporaries() == 0, "a failed save left its temporary file");
  int rc = -1;
  kiln_tensor_file *f = NULL;
  kiln_scope_begin();
  kiln_tensor *w = kiln_randn(KILN_F32, 2, ((int64_t[]){6, 5}), 41);
  kiln_tensor *t[4] = {kiln_transpose(w, 0, 1), kiln_randn(KILN_F64, 1, ((int64_t[]){7}), 42),
                       kiln_arange(KILN_I64, 0, 5, 1), kiln_gt(w, kiln_scalar(KILN_F32, 0))};
  kiln_tensor *dst[2] = {kiln_zeros(KILN_F32, 2, ((int64_t[]){5, 6})), kiln_zeros(KILN_F64, 1, ((int64_t[]){7}))};
  kiln_tensor *loaded[4] = {NULL};
  const char *names[4] = {"w.T", "b", "idx", "mask"}, *meta[] = {"format", "pt", NULL};
  if (!t[0] || !t[1] || !t[2] || !t[3] || !dst[0] || !dst[1]) goto done;
  if (kiln_save_tensors_meta(weights_path, 4, names, t, meta) || !(f = kiln_tensors_open(weights_path))) goto done;
  if (take(r, kiln_tensors_get(f, "b")) || kiln_load_tensors(weights_path, 4, names, loaded)) goto done;
  for (int i = 0; i < 4; i++)
    if (take(r, loaded[i])) goto done;
  if (kiln_load_tensors_into(weights_path, 2, names, dst) || take(r, dst[0]) || take(r, dst[1])) goto done;
  rc = 0;
done:
  kiln_tensors_close(f);
  kiln_scope_end();
  return rc;
}

/* ---- the harness ---- */

/* |a - b| small relative to b, or both NaN: a degraded (eager instead of
 * compiled) run agrees with the compiled one to rounding. */
static bool close_to(const results *a, const results *b) {
  if (a->n != b->n) return false;
  for (size_t i = 0; i < a->n; i++)
    if (!(fabsf(a->v[i] - b->v[i]) <= 1e-4f * (1 + fabsf(b->v[i]))) && !(isnan(a->v[i]) && isnan(b->v[i])))
      return false;
  return true;
}

static void same_bits(const results *got, const results *want, const char *name, int n) {
  ck_assert_msg(got->n == want->n, "%s, after failing allocation %d: %zu results, clean run %zu", name, n, got->n,
                want->n);
  for (size_t i = 0; i < got->n; i++)
    ck_assert_msg(!memcmp(&got->v[i], &want->v[i], sizeof *got->v), "%s, after failing allocation %d: result %zu is %a, clean run %a",
                  name, n, i, got->v[i], want->v[i]);
}

/* Fails allocation 1, 2, 3, ... of s until a run completes without reaching
 * the failure; after every rerun_every-th failure point, a clean rerun (the
 * LLVM scenarios compile twice a run: every point would cost minutes).
 * Returns the number of failure points. */
static int inject(const char *name, scenario s, int rerun_every, int *degraded) {
  size_t base = kiln_mem_in_use();
  results clean = {0}, got = {0};
  ck_assert_msg(s(&clean) == 0, "%s: clean run failed: %s", name, kiln_last_error());
  ck_assert_uint_eq(base, kiln_mem_in_use());
  int n;
  *degraded = 0;
  for (n = 1;; n++) {
    ck_assert_msg(n < 100000, "%s: no end to the allocations", name);
    got.n = 0;
    kiln_clear_error();
    alloc_fail_after(n);
    int rc = s(&got);
    bool fired = alloc_fail_after(0) == 0;
    ck_assert_msg(kiln_mem_in_use() == base, "%s, failing allocation %d: %zu bytes of storage left (rc %d)", name, n,
                  kiln_mem_in_use() - base, rc);
    if (!fired) {
      ck_assert_msg(rc == 0, "%s: failed with no allocation failing: %s", name, kiln_last_error());
      same_bits(&got, &clean, name, n);
      break;
    }
    if (rc) {
      const char *e = kiln_last_error();
      ck_assert_msg(e[0] && strstr(e, "kiln_"), "%s, failing allocation %d: error without a message: '%s'", name, n, e);
      /* the test build's quarantine caught kiln handing out a freed tensor */
      ck_assert_msg(!strstr(e, "already released"), "%s, failing allocation %d: %s", name, n, e);
    } else {
      /* the failure hit something that has a fallback: the answer must still be right */
      ck_assert_msg(close_to(&got, &clean), "%s, failing allocation %d: degraded run gives wrong results", name, n);
      (*degraded)++;
    }
    if (n % rerun_every) continue;
    /* usable afterwards: a clean rerun, bit for bit */
    got.n = 0;
    kiln_clear_error();
    ck_assert_msg(s(&got) == 0, "%s, after failing allocation %d: rerun failed: %s", name, n, kiln_last_error());
    same_bits(&got, &clean, name, n);
    ck_assert_uint_eq(base, kiln_mem_in_use());
  }
  free(clean.v), free(got.v);
  kiln_clear_error();
  ck_assert_msg(LEAK_CHECK() == 0, "%s: leaks (see the report above)", name);
  printf("faults: %-14s %4d allocation failure points, %3d of them degraded to a correct answer\n", name, n - 1,
         *degraded);
  fflush(stdout);
  return n - 1;
}

START_TEST(test_eager_faults) {
  int d, points = inject("eager ops", eager_ops, 1, &d);
  ck_assert_int_ge(points, 20);
}
END_TEST

START_TEST(test_autograd_faults) {
  int d, points = inject("autograd", autograd, 1, &d);
  ck_assert_int_ge(points, 20);
}
END_TEST

START_TEST(test_control_flow_faults) {
  int d, points = inject("control flow", control_flow, 1, &d);
  ck_assert_int_ge(points, 50);
}
END_TEST

START_TEST(test_trace_faults) {
  int d, points = inject("trace (interp)", traced_interp, 1, &d);
  ck_assert_int_ge(points, 50);
}
END_TEST

START_TEST(test_region_faults) {
  int d, points = inject("regions (interp)", regions_interp, 1, &d);
  ck_assert_int_ge(points, 50);
  points = inject("regions (llvm)", regions_llvm, 4, &d);
  ck_assert_int_ge(points, 50);
}
END_TEST

START_TEST(test_export_faults) {
  snprintf(export_prefix, sizeof export_prefix, "faults_export_%d", (int)getpid());
  results r = {0};
  kiln_options o = {.name = "regions", .n_in = 2, .n_out = 2, .backend = KILN_BACKEND_INTERP};
  export_fn = kiln_compile(regions_body, NULL, &o);
  ck_assert_int_eq(0, call_len(export_fn, 5, 31, &r));
  int d, points = inject("regions (export)", regions_export, 4, &d);
  kiln_fn_free(export_fn);
  free(r.v);
  char path[80];
  snprintf(path, sizeof path, "%s.o", export_prefix);
  unlink(path);
  snprintf(path, sizeof path, "%s.h", export_prefix);
  unlink(path);
  ck_assert_int_ge(points, 50);
}
END_TEST

START_TEST(test_compile_faults) {
  int d, points = inject("compile (llvm)", compiled_llvm, 4, &d);
  ck_assert_int_ge(points, 50);
}
END_TEST

START_TEST(test_save_load_faults) {
  snprintf(graph_path, sizeof graph_path, "faults_graph_%d.txt", (int)getpid());
  int d, points = inject("save/load", save_load, 1, &d);
  unlink(graph_path);
  ck_assert_int_ge(points, 50);
}
END_TEST

START_TEST(test_weights_faults) {
  snprintf(weights_path, sizeof weights_path, "faults_weights_%d.safetensors", (int)getpid());
  int d, points = inject("weights", weights, 1, &d);
  unlink(weights_path);
  ck_assert_int_eq(0, stray_temporaries());
  ck_assert_int_ge(points, 50);
}
END_TEST

/* LLVM refusing a module: the variant runs on the interpreter, with a
 * warning, and gives what a clean LLVM run gives to rounding. (test_codegen
 * checks one softmax; this is the two-output MLP through a retrace.) */
START_TEST(test_llvm_failure_falls_back) {
  results want = {0}, got = {0};
  ck_assert_int_eq(0, compiled_llvm(&want));
  /* stderr to a file, to read the warning */
  char path[64], text[4096] = "";
  snprintf(path, sizeof path, "faults_stderr_%d.txt", (int)getpid());
  fflush(stderr);
  int saved = dup(2);
  ck_assert(freopen(path, "w", stderr) != NULL);
  setenv("KILN_TEST_FAIL_LLVM", "1", 1);
  int rc = compiled_llvm(&got);
  unsetenv("KILN_TEST_FAIL_LLVM");
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  FILE *f = fopen(path, "r");
  ck_assert_ptr_nonnull(f);
  text[fread(text, 1, sizeof text - 1, f)] = 0;
  fclose(f);
  unlink(path);
  ck_assert_int_eq(0, rc);
  ck_assert(close_to(&got, &want));
  /* one warning per variant (the first trace and the retrace) */
  const char *w = strstr(text, "kiln: warning: faulty: the llvm backend failed");
  ck_assert_msg(w && strstr(w, "runs on the interpreter") && strstr(w + 1, "kiln: warning: faulty"), "stderr: %s", text);
  free(want.v), free(got.v);
}
END_TEST


/* Storage headers a thread keeps for its next tensors (alloc_small) still
 * fail on demand, so the out-of-memory paths behind them stay reachable; and
 * a thread's kept headers are freed at its exit (the leak check). */
static void *make_and_drop(void *arg) {
  (void)arg;
  for (int i = 0; i < 200; i++) kiln_release(kiln_zeros(KILN_F32, 1, (int64_t[]){4}));
  return NULL;
}

START_TEST(test_kept_headers_fail_and_go) {
  kiln_release(kiln_zeros(KILN_F32, 1, (int64_t[]){4})); /* this thread keeps a header now */
  alloc_fail_after(1);
  void *p = alloc_small();
  ck_assert_int_eq(0, alloc_fail_after(0));
  ck_assert_ptr_null(p);
  /* a tensor whose header fails (the second allocation: its handle, then its storage) */
  alloc_fail_after(2);
  kiln_tensor *t = kiln_zeros(KILN_F32, 1, (int64_t[]){4});
  ck_assert_int_eq(0, alloc_fail_after(0));
  ck_assert_ptr_null(t);
  ck_assert_msg(strstr(kiln_last_error(), "out of memory"), "%s", kiln_last_error());
#if defined(__SANITIZE_ADDRESS__)
  /* a block is a header and no more, so ASan sees a write past one, and a
   * kept block stays poisoned until it is handed out again */
  for (int i = 0; i < 200; i++) kiln_release(kiln_zeros(KILN_F32, 1, (int64_t[]){4}));
  char *b = alloc_small();
  ck_assert_ptr_nonnull(b);
  ck_assert_ptr_null(__asan_region_is_poisoned(b, ALLOC_SMALL));
  ck_assert(__asan_address_is_poisoned(b + sizeof(storage)));
  alloc_small_free(b);
  ck_assert(__asan_address_is_poisoned(b));
#endif
  pthread_t th;
  ck_assert_int_eq(0, pthread_create(&th, NULL, make_and_drop, NULL));
  ck_assert_int_eq(0, pthread_join(th, NULL));
  ck_assert_int_eq(0, LEAK_CHECK());
}
END_TEST
#endif

int main(void) {
  Suite *s = suite_create("faults");
  TCase *tc = tcase_create("faults");
  tcase_set_timeout(tc, 900);
#ifdef KILN_TEST_BUILD
  tcase_add_test(tc, test_eager_faults);
  tcase_add_test(tc, test_autograd_faults);
  tcase_add_test(tc, test_control_flow_faults);
  tcase_add_test(tc, test_trace_faults);
  tcase_add_test(tc, test_compile_faults);
  tcase_add_test(tc, test_region_faults);
  tcase_add_test(tc, test_export_faults);
  tcase_add_test(tc, test_save_load_faults);
  tcase_add_test(tc, test_weights_faults);
  tcase_add_test(tc, test_llvm_failure_falls_back);
  tcase_add_test(tc, test_kept_headers_fail_and_go);
#endif
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
