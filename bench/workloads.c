/* Eager benchmark: the workloads W1..W7 of docs/workloads.md, written op by op
 * with the public API, the way a user would write them. Each call runs inside
 * its own scope, so freeing the temporaries is part of the measured cost.
 *
 *   kiln_bench [--threads N] [--only W1,W3] [--json PATH]
 *   kiln_bench --overhead      (compiled call overhead, overhead.c)
 *   kiln_bench --first-call    (GPT-2 small: the first compiled call's peak against later ones, gpt.c)
 *   kiln_bench --compiled [--threads N] [--only ..] [--json PATH]   (eager vs compiled, side by side)
 *   kiln_bench --serve         (one call at a time on request, for bench/side_by_side.py; serve.c)
 *
 * Prints a table; with --json also writes one object per (workload, threads).
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>

#include "bench.h"
#include "eager/pool.h"
#include "kiln.h"
#include "stats.h"

#define GELU_C 0.7978845608 /* sqrt(2/pi) */
#define GELU_A 0.044715
#define LN_EPS 1e-5
#define LR 1e-3

#define WARMUP 5
#define MIN_SAMPLES 20
#define MAX_SAMPLES 1000
#define SAMPLE_BUDGET_S 0.6 /* aim for about this much timed work per workload */
#define MAX_INPUTS 10

typedef struct bench_state {
  kiln_tensor *t[MAX_INPUTS]; /* inputs and parameters, owned here */
} bench_state;

typedef struct workload {
  const char *id;   /* "W1" */
  const char *name; /* "W1_gelu" */
  int (*setup)(bench_state *);
  kiln_tensor *(*call)(bench_state *); /* one call; result lives in the open scope */
  int out_ndim;
  int64_t out_shape[3];
} workload;

/* ---- inputs ------------------------------------------------------------ */

/* scale * N(0,1) + shift, made in place so the result is a plain leaf. */
static kiln_tensor *input(int ndim, const int64_t *shape, uint64_t seed, double scale, double shift) {
  kiln_tensor *t = kiln_randn(KILN_F32, ndim, shape, seed);
  if (!t) return NULL;
  kiln_scope_begin();
  kiln_tensor *ok = t;
  if (scale != 1.0) ok = kiln_mul_(t, kiln_scalar(KILN_F32, scale));
  if (ok && shift != 0.0) ok = kiln_add_(t, kiln_scalar(KILN_F32, shift));
  kiln_scope_end();
  if (!ok) {
    kiln_release(t);
    return NULL;
  }
  return t;
}

static int check_inputs(const bench_state *s, int n) {
  for (int i = 0; i < n; i++)
    if (!s->t[i]) return -1;
  return 0;
}

static kiln_tensor *f32(double v) { return kiln_scalar(KILN_F32, v); }

/* ---- the formulations, op by op --------------------------------------- */

/* 0.5*x*(1 + tanh(C*(x + A*x**3))): pow, mul, add, mul, tanh, add, mul, mul. */
static kiln_tensor *gelu_ops(kiln_tensor *x) {
  kiln_tensor *x3 = kiln_pow(x, f32(3.0));
  kiln_tensor *ax3 = kiln_mul(f32(GELU_A), x3);
  kiln_tensor *inner = kiln_add(x, ax3);
  kiln_tensor *arg = kiln_mul(f32(GELU_C), inner);
  kiln_tensor *th = kiln_tanh(arg);
  kiln_tensor *one_th = kiln_add(f32(1.0), th);
  kiln_tensor *half_x = kiln_mul(f32(0.5), x);
  return kiln_mul(half_x, one_th);
}

/* max, sub, exp, sum, div over the last dim. */
static kiln_tensor *softmax_ops(kiln_tensor *x) {
  kiln_tensor *m = kiln_max(x, -1, true);
  kiln_tensor *e = kiln_exp(kiln_sub(x, m));
  kiln_tensor *s = kiln_sum(e, -1, true);
  return kiln_div(e, s);
}

static kiln_tensor *layernorm_ops(kiln_tensor *x, kiln_tensor *w, kiln_tensor *b) {
  kiln_tensor *mu = kiln_mean(x, -1, true);
  kiln_tensor *d = kiln_sub(x, mu);
  kiln_tensor *var = kiln_mean(kiln_mul(d, d), -1, true);
  kiln_tensor *r = kiln_rsqrt(kiln_add(var, f32(LN_EPS)));
  return kiln_add(kiln_mul(kiln_mul(d, r), w), b);
}

static kiln_tensor *mlp_ops(kiln_tensor *x, kiln_tensor *w1, kiln_tensor *b1, kiln_tensor *w2,
                            kiln_tensor *b2) {
  kiln_tensor *h = kiln_add(kiln_matmul(x, w1), b1);
  kiln_tensor *g = gelu_ops(h);
  return kiln_add(kiln_matmul(g, w2), b2);
}

/* x @ W^T + b with W stored (out,in). */
static kiln_tensor *linear_ops(kiln_tensor *x, kiln_tensor *w, kiln_tensor *b) {
  return kiln_add(kiln_matmul(x, kiln_transpose(w, 0, 1)), b);
}

/* ---- W1..W7 ------------------------------------------------------------ */

static int setup_w1(bench_state *s) {
  int64_t n[1] = {4194304};
  s->t[0] = input(1, n, 11, 1.0, 0.0);
  return check_inputs(s, 1);
}
static kiln_tensor *call_w1(bench_state *s) { return gelu_ops(s->t[0]); }

static int setup_w2(bench_state *s) {
  int64_t sh[2] = {4096, 1024};
  s->t[0] = input(2, sh, 21, 1.0, 0.0);
  return check_inputs(s, 1);
}
static kiln_tensor *call_w2(bench_state *s) { return softmax_ops(s->t[0]); }

static int setup_w3(bench_state *s) {
  int64_t sh[2] = {4096, 1024}, c[1] = {1024};
  s->t[0] = input(2, sh, 31, 1.0, 0.0);
  s->t[1] = input(1, c, 32, 0.1, 1.0);
  s->t[2] = input(1, c, 33, 0.1, 0.0);
  return check_inputs(s, 3);
}
static kiln_tensor *call_w3(bench_state *s) { return layernorm_ops(s->t[0], s->t[1], s->t[2]); }

/* t[0..4] = x, W1, b1, W2, b2; t[5] = target (W5 only). */
static int setup_mlp(bench_state *s, bool train) {
  int64_t xs[2] = {256, 1024}, w1s[2] = {1024, 4096}, b1s[1] = {4096}, w2s[2] = {4096, 1024},
          b2s[1] = {1024};
  s->t[0] = input(2, xs, 41, 1.0, 0.0);
  s->t[1] = input(2, w1s, 42, 0.02, 0.0);
  s->t[2] = input(1, b1s, 43, 0.02, 0.0);
  s->t[3] = input(2, w2s, 44, 0.02, 0.0);
  s->t[4] = input(1, b2s, 45, 0.02, 0.0);
  if (!train) return check_inputs(s, 5);
  s->t[5] = input(2, xs, 46, 1.0, 0.0);
  if (check_inputs(s, 6) != 0) return -1;
  for (int i = 1; i <= 4; i++) kiln_requires_grad(s->t[i], true);
  return 0;
}
static int setup_w4(bench_state *s) { return setup_mlp(s, false); }
static int setup_w5(bench_state *s) { return setup_mlp(s, true); }
static kiln_tensor *call_w4(bench_state *s) { return mlp_ops(s->t[0], s->t[1], s->t[2], s->t[3], s->t[4]); }

/* Forward, loss, backward, then SGD; returns the loss. */
static kiln_tensor *call_w5(bench_state *s) {
  kiln_tensor *y = mlp_ops(s->t[0], s->t[1], s->t[2], s->t[3], s->t[4]);
  kiln_tensor *diff = kiln_sub(y, s->t[5]);
  kiln_tensor *loss = kiln_mean_all(kiln_pow(diff, f32(2.0)));
  if (!loss || kiln_backward(loss) != 0) return NULL;
  bool ok = true;
  kiln_no_grad_begin();
  for (int i = 1; i <= 4 && ok; i++) {
    kiln_tensor *p = s->t[i];
    ok = kiln_sub_(p, kiln_mul(f32(LR), kiln_grad(p))) != NULL;
    kiln_zero_grad(p);
  }
  kiln_no_grad_end();
  return ok ? loss : NULL;
}

/* t[0] = x; t[1+2i], t[2+2i] = W_i, b_i. */
static int setup_w6(bench_state *s) {
  int64_t xs[2] = {1, 256}, ws[2] = {256, 256}, bs[1] = {256};
  s->t[0] = input(2, xs, 61, 1.0, 0.0);
  for (int i = 0; i < 3; i++) {
    s->t[1 + 2 * i] = input(2, ws, 62 + 2 * (uint64_t)i, 1.0 / 16, 0.0);
    s->t[2 + 2 * i] = input(1, bs, 63 + 2 * (uint64_t)i, 1.0 / 16, 0.0);
  }
  return check_inputs(s, 7);
}
static kiln_tensor *call_w6(bench_state *s) {
  kiln_tensor *h = kiln_relu(linear_ops(s->t[0], s->t[1], s->t[2]));
  h = kiln_relu(linear_ops(h, s->t[3], s->t[4]));
  return linear_ops(h, s->t[5], s->t[6]);
}

static int setup_w7(bench_state *s) {
  int64_t sh[3] = {8, 512, 64};
  for (int i = 0; i < 3; i++) s->t[i] = input(3, sh, 71 + (uint64_t)i, 1.0, 0.0);
  return check_inputs(s, 3);
}
static kiln_tensor *call_w7(bench_state *s) {
  kiln_tensor *sc = kiln_div(kiln_matmul(s->t[0], kiln_transpose(s->t[1], 1, 2)), f32(8.0));
  return kiln_matmul(softmax_ops(sc), s->t[2]);
}

static const workload WORKLOADS[] = {
    {"W1", "W1_gelu", setup_w1, call_w1, 1, {4194304}},
    {"W2", "W2_softmax", setup_w2, call_w2, 2, {4096, 1024}},
    {"W3", "W3_layernorm", setup_w3, call_w3, 2, {4096, 1024}},
    {"W4", "W4_mlp_fwd", setup_w4, call_w4, 2, {256, 1024}},
    {"W5", "W5_mlp_train", setup_w5, call_w5, 0, {0}},
    {"W6", "W6_batch1", setup_w6, call_w6, 2, {1, 256}},
    {"W7", "W7_attention", setup_w7, call_w7, 3, {8, 512, 64}},
};
#define N_WORKLOADS ((int)(sizeof WORKLOADS / sizeof WORKLOADS[0]))

/* ---- timing ------------------------------------------------------------ */

/* One call in its own scope; 0 or -1. */
static int run_once(const workload *w, bench_state *s) {
  kiln_scope_begin();
  kiln_tensor *out = w->call(s);
  kiln_scope_end();
  return out ? 0 : -1;
}

/* One call that also checks the output shape, so a wrong formulation is not timed. */
static int run_checked(const workload *w, bench_state *s) {
  kiln_scope_begin();
  kiln_tensor *out = w->call(s);
  int rc = out ? 0 : -1;
  if (out && kiln_ndim(out) != w->out_ndim) rc = -2;
  for (int d = 0; rc == 0 && d < w->out_ndim; d++)
    if (kiln_size(out, d) != w->out_shape[d]) rc = -2;
  kiln_scope_end();
  if (rc == -2) fprintf(stderr, "%s: output has the wrong shape\n", w->name);
  return rc;
}

typedef struct result {
  const char *name;
  int threads;
  bool ok;
  double median_ms, min_ms;
  int samples;
  size_t base_bytes, peak_bytes; /* live storage before the call, and the peak during it */
} result;

static result bench_one(const workload *w, int threads) {
  result r = {.name = w->name, .threads = threads};
  bench_state s = {{0}};
  kiln_set_num_threads(threads);
  if (w->setup(&s) != 0) {
    fprintf(stderr, "%s: setup failed: %s\n", w->name, kiln_last_error());
    goto done;
  }

  double t0 = bench_now_s();
  for (int i = 0; i < WARMUP; i++) {
    if (run_once(w, &s) != 0) {
      fprintf(stderr, "%s: %s\n", w->name, kiln_last_error());
      goto done;
    }
  }
  double per_call = (bench_now_s() - t0) / WARMUP;

  r.base_bytes = kiln_mem_in_use();
  kiln_mem_reset_peak();
  if (run_checked(w, &s) != 0) {
    fprintf(stderr, "%s: %s\n", w->name, kiln_last_error());
    goto done;
  }
  r.peak_bytes = kiln_mem_peak();

  int n = (int)(SAMPLE_BUDGET_S / (per_call > 0 ? per_call : 1e-9));
  if (n < MIN_SAMPLES) n = MIN_SAMPLES;
  if (n > MAX_SAMPLES) n = MAX_SAMPLES;
  double *ms = malloc((size_t)n * sizeof *ms);
  if (!ms) goto done;
  for (int i = 0; i < n; i++) {
    double a = bench_now_s();
    int rc = run_once(w, &s);
    ms[i] = 1e3 * (bench_now_s() - a);
    if (rc != 0) {
      fprintf(stderr, "%s: %s\n", w->name, kiln_last_error());
      free(ms);
      goto done;
    }
  }
  r.median_ms = bench_median(ms, n);
  r.min_ms = ms[0];
  r.samples = n;
  r.ok = true;
  free(ms);

done:
  for (int i = 0; i < MAX_INPUTS; i++) kiln_release(s.t[i]);
  return r;
}

/* ---- command line and output ------------------------------------------ */

static bool selected(const workload *w, const char *only) {
  if (!only) return true;
  char buf[256];
  snprintf(buf, sizeof buf, "%s", only);
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
    if (strcmp(tok, w->id) == 0 || strcmp(tok, w->name) == 0) return true;
  return false;
}

static int write_json(const char *path, const result *rs, int n) {
  FILE *f = fopen(path, "w");
  if (!f) {
    perror(path);
    return -1;
  }
  fprintf(f, "[\n");
  for (int i = 0; i < n; i++) {
    const result *r = &rs[i];
    fprintf(f, "  {\"name\": \"%s\", \"threads\": %d, ", r->name, r->threads);
    if (r->ok)
      fprintf(f, "\"kiln_eager_ms\": %.6f, \"kiln_eager_min_ms\": %.6f, \"samples\": %d, ", r->median_ms,
              r->min_ms, r->samples);
    else
      fprintf(f, "\"kiln_eager_ms\": null, \"kiln_eager_min_ms\": null, \"samples\": 0, ");
    fprintf(f, "\"eager_peak_bytes\": %zu, \"eager_base_bytes\": %zu}%s\n", r->peak_bytes, r->base_bytes,
            i + 1 < n ? "," : "");
  }
  fprintf(f, "]\n");
  return fclose(f) == 0 ? 0 : -1;
}

/* ---- compiled: the same call through kiln_compile, side by side -------- */

typedef struct cbody {
  const workload *w;
  bench_state *s;
} cbody;

/* The workload's call as a compiled body: its tensors are reached through ctx (params). */
static int compiled_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)in;
  cbody *c = ctx;
  out[0] = c->w->call(c->s);
  return out[0] ? 0 : -1;
}

static int call_compiled(kiln_fn *fn) {
  kiln_scope_begin();
  kiln_tensor *y = NULL;
  int rc = kiln_call(fn, NULL, &y);
  kiln_scope_end();
  return rc;
}

/* The machine's limits, measured in this run: one-in/one-out bandwidth (a
 * scale over 16 MiB) in GB/s, and the sgemm rate for an m,k,n GEMM. */
typedef struct scale_job {
  const float *x;
  float *y;
} scale_job;
static void scale_chunk(void *ctx, int64_t b, int64_t e) {
  scale_job *j = ctx;
  for (int64_t i = b; i < e; i++) j->y[i] = 1.5f * j->x[i];
}
static double measure_bandwidth(void) {
  int64_t n = 4194304;
  float *x = aligned_alloc(64, (size_t)n * 4), *y = aligned_alloc(64, (size_t)n * 4);
  if (!x || !y) return 0;
  for (int64_t i = 0; i < n; i++) x[i] = (float)i, y[i] = 0;
  scale_job j = {x, y};
  double best = 1e30;
  for (int r = 0; r < 20; r++) {
    double a = bench_now_s();
    pool_parallel_for(n, 1 << 15, scale_chunk, &j);
    double t = bench_now_s() - a;
    if (t < best) best = t;
  }
  free(x), free(y);
  return 2.0 * (double)n * 4 / best / 1e9;
}
static double measure_sgemm_ms(int m, int k, int n) {
  float *a = calloc((size_t)m * k, 4), *b = calloc((size_t)k * n, 4), *c = calloc((size_t)m * n, 4);
  double best = 1e30;
  for (int r = 0; a && b && c && r < 5; r++) {
    double t0 = bench_now_s();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, a, k, b, n, 0.0f, c, n);
    double t = bench_now_s() - t0;
    if (t < best) best = t;
  }
  free(a), free(b), free(c);
  return best * 1e3;
}

/* W4's floor: its two GEMMs (x @ w1, then h @ w2) alone in OpenBLAS, on
 * buffers of their own, timed in the same rounds as the workload so that
 * both see the same machine and the same caches. */
typedef struct gemm_pair {
  float *x, *w1, *h, *w2, *y;
} gemm_pair;

static bool gemm_pair_new(gemm_pair *g) {
  g->x = malloc(sizeof(float) * 256 * 1024), g->w1 = malloc(sizeof(float) * 1024 * 4096);
  g->h = malloc(sizeof(float) * 256 * 4096), g->w2 = malloc(sizeof(float) * 4096 * 1024);
  g->y = malloc(sizeof(float) * 256 * 1024);
  if (!g->x || !g->w1 || !g->h || !g->w2 || !g->y) return false;
  uint32_t r = 12345;
  float *fill[2] = {g->w1, g->w2};
  for (int f = 0; f < 2; f++)
    for (int i = 0; i < 1024 * 4096; i++) r = r * 1664525u + 1013904223u, fill[f][i] = (float)(r >> 8) / 16777216.0f - 0.5f;
  for (int i = 0; i < 256 * 1024; i++) r = r * 1664525u + 1013904223u, g->x[i] = (float)(r >> 8) / 16777216.0f - 0.5f;
  return true;
}

static void gemm_pair_free(gemm_pair *g) { free(g->x), free(g->w1), free(g->h), free(g->w2), free(g->y); }

static double gemm_pair_ms(const gemm_pair *g) {
  double t0 = bench_now_s();
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 256, 4096, 1024, 1.0f, g->x, 1024, g->w1, 4096, 0.0f, g->h, 4096);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 256, 1024, 4096, 1.0f, g->h, 4096, g->w2, 1024, 0.0f, g->y, 1024);
  return 1e3 * (bench_now_s() - t0);
}

typedef struct cresult {
  const char *name;
  bool ok;
  double eager_ms, compiled_ms, compile_ms, floor_ms, maxdiff;
  double cached_ms, trace_ms; /* compiling again with the kernels cached; the traced call */
  bench_compiles cc;          /* compile_ms is their median */
  size_t eager_peak, compiled_peak;
  int kernels_hint;
} cresult;

typedef struct cold_ctx {
  cbody *cb;
  const kiln_options *o;
} cold_ctx;

/* A new function of the same body, compiled from nothing: its compile ms. */
static double cold_compile(void *ctx) {
  cold_ctx *c = ctx;
  kiln_cache_clear();
  kiln_fn *fn = kiln_compile(compiled_body, c->cb, c->o);
  kiln_fn_stats st;
  double ms = fn && !call_compiled(fn) && !kiln_fn_get_stats(fn, &st) ? st.compile_ms : -1;
  kiln_fn_free(fn);
  return ms;
}

static cresult bench_compiled_one(const workload *w, double gbps) {
  cresult r = {.name = w->name};
  bench_state s = {{0}};
  if (w->setup(&s) != 0) return r;
  cbody cb = {w, &s};
  kiln_options o = {.name = w->id, .n_in = 0, .n_out = 1};
  kiln_cache_clear(); /* from nothing, whatever ran before */
  kiln_fn *fn = kiln_compile(compiled_body, &cb, &o);
  size_t before = kiln_mem_in_use();
  /* the first call traces and compiles; the second is the first compiled one */
  if (!fn || call_compiled(fn) || call_compiled(fn)) {
    fprintf(stderr, "%s: %s\n", w->name, kiln_last_error());
    goto done;
  }
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  r.compile_ms = st.compile_ms;
  r.trace_ms = st.trace_ms;
  for (int i = 0; i < WARMUP; i++)
    if (run_once(w, &s) || call_compiled(fn)) goto done;
  size_t base = kiln_mem_in_use();
  kiln_mem_reset_peak();
  run_once(w, &s);
  r.eager_peak = kiln_mem_peak() - base;
  /* the compiled side keeps its arena between calls: count it */
  base = kiln_mem_in_use();
  size_t kept = base > before ? base - before : 0;
  kiln_mem_reset_peak();
  call_compiled(fn);
  r.compiled_peak = kept + (kiln_mem_peak() - base);
  /* interleaved samples: both see the same machine */
  double t0 = bench_now_s();
  run_once(w, &s);
  call_compiled(fn);
  double pair = bench_now_s() - t0;
  int n = (int)(2 * SAMPLE_BUDGET_S / (pair > 0 ? pair : 1e-9));
  if (n < MIN_SAMPLES) n = MIN_SAMPLES;
  if (n > MAX_SAMPLES) n = MAX_SAMPLES;
  double *e = malloc(sizeof(double) * (size_t)n), *c = malloc(sizeof(double) * (size_t)n);
  double *fl = malloc(sizeof(double) * (size_t)n);
  gemm_pair gp = {0};
  bool gemms = !strcmp(w->id, "W4") && gemm_pair_new(&gp);
  for (int i = 0; e && c && fl && i < n; i++) {
    double a = bench_now_s();
    run_once(w, &s);
    double b = bench_now_s();
    call_compiled(fn);
    c[i] = 1e3 * (bench_now_s() - b);
    e[i] = 1e3 * (b - a);
    if (gemms) fl[i] = gemm_pair_ms(&gp);
  }
  if (e && c && fl) {
    r.eager_ms = bench_median(e, n);
    r.compiled_ms = bench_median(c, n);
    if (gemms) r.floor_ms = bench_median(fl, n);
    r.ok = true;
  }
  gemm_pair_free(&gp);
  free(e), free(c), free(fl);
  kiln_fn_get_stats(fn, &st);
  if (st.fallbacks || st.variants != 1) r.ok = false;
  cold_ctx cx = {&cb, &o};
  if (bench_cold_compiles(r.compile_ms, cold_compile, &cx, &r.cc))
    r.ok = false;
  else
    r.compile_ms = r.cc.median;
  /* a second function of the same body: its kernels come from the cache */
  kiln_fn *again = kiln_compile(compiled_body, &cb, &o);
  if (again && !call_compiled(again) && !kiln_fn_get_stats(again, &st)) r.cached_ms = st.compile_ms;
  kiln_fn_free(again);
  (void)gbps;
done:
  kiln_fn_free(fn);
  for (int i = 0; i < MAX_INPUTS; i++) kiln_release(s.t[i]);
  return r;
}

static int bench_compiled(const char *only, const char *json) {
  int threads = kiln_get_num_threads();
  double gbps = measure_bandwidth();
  double w4_gemm = measure_sgemm_ms(256, 1024, 4096) + measure_sgemm_ms(256, 4096, 1024);
  printf("machine, measured now: %.1f GB/s one-in/one-out, W4's two sgemms %.2f ms alone (%.0f GFLOP/s), %d threads\n", gbps,
         w4_gemm, 4.295e9 / (w4_gemm * 1e6), threads);
  printf("compile ms: the median of %d compiles from nothing (the kernel cache cleared), the first one among them\n",
         COLD_COMPILES);
  printf("%-14s %10s %12s %8s %11s %7s %12s %12s %9s\n", "workload", "eager ms", "compiled ms", "speedup", "compile ms",
         "cached", "eager MiB", "compiled MiB", "floor ms");
  cresult rs[N_WORKLOADS];
  int n = 0;
  for (int i = 0; i < N_WORKLOADS; i++) {
    const workload *w = &WORKLOADS[i];
    if (!selected(w, only)) continue;
    cresult r = bench_compiled_one(w, gbps);
    /* floors: bytes over bandwidth for the memory-bound ones; W4's GEMMs
     * were timed between its calls (bench_compiled_one) */
    double mb = 0;
    if (!strcmp(w->id, "W1") || !strcmp(w->id, "W2") || !strcmp(w->id, "W3")) mb = 2.0 * 16777216;
    if (!strcmp(w->id, "W7")) mb = 2.0 * 8388608;
    if (mb) r.floor_ms = mb / (gbps * 1e9) * 1e3; /* W4's was timed with it */
    rs[n++] = r;
    if (!r.ok) {
      printf("%-14s FAILED (%s)\n", w->name, kiln_last_error());
      continue;
    }
    printf("%-14s %10.3f %12.3f %7.2fx %11.1f %7.1f %12.1f %12.1f", w->name, r.eager_ms, r.compiled_ms,
           r.eager_ms / r.compiled_ms, r.compile_ms, r.cached_ms, r.eager_peak / 1048576.0, r.compiled_peak / 1048576.0);
    if (r.floor_ms > 0) printf(" %9.3f", r.floor_ms);
    printf("\n");
    fflush(stdout);
  }
  int n_gpt = bench_gpt(only); /* W8, W9: gpt.c */
  int n_ls = bench_lstm(only);  /* W10: lstm.c */
  int n_rn = bench_resnet(only);
  int n_ll = bench_llama(only); /* W11, W12, M1: llama.c */
  if (json) {
    FILE *f = fopen(json, "w");
    if (!f) return perror(json), 1;
    fprintf(f, "[\n");
    for (int i = 0; i < n; i++) {
      const cresult *r = &rs[i];
      fprintf(f, "  {\"name\": \"%s\", \"threads\": %d, \"ok\": %s, \"eager_ms\": %.6f, \"compiled_ms\": %.6f, \"compile_ms\": %.3f, "
              "\"compile_first_ms\": %.3f, \"compile_min_ms\": %.3f, \"compile_max_ms\": %.3f, "
              "\"compile_cached_ms\": %.3f, \"trace_ms\": %.3f, "
              "\"eager_peak_bytes\": %zu, \"compiled_peak_bytes\": %zu, \"floor_ms\": %.6f, "
              "\"bandwidth_gbps\": %.3f, \"sgemm_gflops\": %.3f}%s\n",
              r->name, threads, r->ok ? "true" : "false", r->eager_ms, r->compiled_ms, r->compile_ms, r->cc.first,
              r->cc.lo, r->cc.hi, r->cached_ms, r->trace_ms, r->eager_peak,
              r->compiled_peak, r->floor_ms, gbps, 4.295e9 / (w4_gemm * 1e6), i + 1 < n || n_gpt ? "," : "");
    }
    bench_gpt_json(f, threads);
    if (n_rn && (n || n_gpt)) fprintf(f, "  ,\n");
    bench_resnet_json(f, threads);
    if (n_ll && (n || n_gpt || n_rn)) fprintf(f, "  ,\n");
    bench_llama_json(f, threads);
    if (n_ls && (n || n_gpt || n_rn || n_ll)) fprintf(f, "  ,\n");
    bench_lstm_json(f, threads);
    fprintf(f, "]\n");
    fclose(f);
  }
  return 0;
}

/* ---- a workload as a case, for serve.c ----------------------------------- */

typedef struct wcase {
  const workload *w;
  bench_state s;
  cbody cb;
} wcase;

static int wcase_run(void *ctx, kiln_fn *fn) {
  wcase *c = ctx;
  return fn ? call_compiled(fn) : run_once(c->w, &c->s);
}

static void wcase_close(void *ctx) {
  wcase *c = ctx;
  for (int i = 0; i < MAX_INPUTS; i++) kiln_release(c->s.t[i]);
  free(c);
}

int workloads_case_open(const char *id, bench_case *bc) {
  const workload *w = NULL;
  for (int i = 0; i < N_WORKLOADS && !w; i++)
    if (!strcmp(id, WORKLOADS[i].id) || !strcmp(id, WORKLOADS[i].name)) w = &WORKLOADS[i];
  if (!w) return 1;
  wcase *c = calloc(1, sizeof *c);
  if (!c) return -1;
  c->w = w;
  if (w->setup(&c->s) != 0) {
    wcase_close(c);
    return -1;
  }
  c->cb = (cbody){w, &c->s};
  kiln_options o = {.name = w->id, .n_in = 0, .n_out = 1};
  *bc = (bench_case){.name = w->name, .run = wcase_run, .close = wcase_close, .ctx = c,
                     .fn = kiln_compile(compiled_body, &c->cb, &o), .per = 1};
  if (!bc->fn) {
    wcase_close(c);
    return -1;
  }
  return 0;
}

void workloads_list(FILE *f) {
  for (int i = 0; i < N_WORKLOADS; i++) fprintf(f, "%s %s\n", WORKLOADS[i].id, WORKLOADS[i].name);
}

static void usage(const char *argv0) {
  fprintf(stderr,
          "usage: %s [--threads N] [--only W1,W3] [--json PATH] [--compiled] | --overhead | --count WHAT N | "
          "--first-call | --serve | --gemm [--threads N]\n"
          "  --cpu-time (with --threads 1): time CPU seconds, not wall seconds (for a shared machine)\n",
          argv0);
}

int bench_cpu_clock;

int main(int argc, char **argv) {
  int threads_list[2] = {1, 2}, n_threads = 2;
  const char *only = NULL, *json = NULL;
  bool compiled = false, gemm = false;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      threads_list[0] = atoi(argv[++i]);
      n_threads = 1;
      if (threads_list[0] < 1) {
        usage(argv[0]);
        return 2;
      }
    } else if (strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
      only = argv[++i];
    } else if (strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
      json = argv[++i];
    } else if (strcmp(argv[i], "--overhead") == 0) {
      return bench_overhead();
    } else if (strcmp(argv[i], "--count") == 0 && i + 2 < argc) {
      return bench_overhead_count(argv[i + 1], atol(argv[i + 2]));
    } else if (strcmp(argv[i], "--first-call") == 0) {
      return bench_gpt_first_call();
    } else if (strcmp(argv[i], "--serve") == 0) {
      return bench_serve();
    } else if (strcmp(argv[i], "--compiled") == 0) {
      compiled = true;
    } else if (strcmp(argv[i], "--gemm") == 0) {
      gemm = true;
    } else if (strcmp(argv[i], "--cpu-time") == 0) {
      bench_cpu_clock = 1;
    } else {
      usage(argv[0]);
      return 2;
    }
  }

  if (bench_cpu_clock && !(n_threads == 1 && threads_list[0] == 1)) {
    fprintf(stderr, "--cpu-time needs --threads 1: CPU time adds up the threads\n");
    return 2;
  }
  if (gemm) return bench_gemm(n_threads == 1 ? threads_list[0] : 1);
  if (compiled) {
    if (n_threads == 1) kiln_set_num_threads(threads_list[0]);
    return bench_compiled(only, json);
  }

  result rs[2 * N_WORKLOADS];
  int n = 0, failed = 0;
  printf("%-14s %7s %12s %12s %8s %12s\n", "workload", "threads", "median ms", "min ms", "samples",
         "peak MiB");
  for (int w = 0; w < N_WORKLOADS; w++) {
    if (!selected(&WORKLOADS[w], only)) continue;
    for (int t = 0; t < n_threads; t++) {
      result r = bench_one(&WORKLOADS[w], threads_list[t]);
      rs[n++] = r;
      if (r.ok)
        printf("%-14s %7d %12.3f %12.3f %8d %12.1f\n", r.name, r.threads, r.median_ms, r.min_ms, r.samples,
               (double)r.peak_bytes / (1024.0 * 1024.0));
      else
        printf("%-14s %7d %12s\n", r.name, r.threads, "FAILED");
      fflush(stdout);
      failed += !r.ok;
    }
  }
  if (n == 0) {
    fprintf(stderr, "no workload matches --only %s\n", only);
    return 2;
  }
  if (json && write_json(json, rs, n) != 0) return 1;
  return failed ? 1 : 0;
}
