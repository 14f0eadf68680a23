/* W10 for kiln_bench --compiled and serve.c: the LSTM layer of
 * examples/lstm.h, written with kiln_scan, eager against compiled.
 *
 *   W10_lstm_train      one training step: x (64,32,128), hidden 128, h = c = 0
 *                       at the start; loss = mean((hs - target)^2) over every
 *                       output h_t; backward; SGD p -= LR * grad_p on wx, wh,
 *                       bias; the gradients dropped: ms per step
 *   W10_lstm_fwd_T16    the forward, hs (T,32,128) of x (T,32,128), at
 *   ... _T128           T = 16, 32, 64, 128: ms per call; beside it, its
 *                       GEMMs alone (x @ wx for every step at once, one
 *                       h @ wh a step): what bounds it, eager and compiled
 *
 * kiln_bench --compiled runs the four forward rows through one compiled
 * function, x's dim 0 marked dynamic, and prints how many variants it made
 * across them: the target is one for every T (the scan captured as a loop);
 * while the scan is recorded step by step it is one per T. After the
 * training row it calls the training step at those four lengths too and
 * prints the variants it made (its backward is a reverse scan: one). serve.c opens
 * each row as a case of its own (bench/side_by_side.py).
 */
#define _POSIX_C_SOURCE 200809L
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../examples/lstm.h"
#include "bench.h"
#include "kiln.h"
#include "stats.h"

enum { LB = 32, LI = 128, LH = 128, TRAIN_T = 64, N_FWD = 4, WARMUP = 3, MIN_SAMPLES = 10, MAX_SAMPLES = 400 };
#define SAMPLE_BUDGET_S 2.0
#define LR 1e-3
static const int FWD_T[N_FWD] = {16, 32, 64, 128};
static const char *const FWD_NAMES[N_FWD] = {"W10_lstm_fwd_T16", "W10_lstm_fwd_T32", "W10_lstm_fwd_T64",
                                             "W10_lstm_fwd_T128"};

/* One row's inputs and weights. */
typedef struct lstm_case {
  lstm_cell_w w;
  kiln_tensor *x, *target; /* target NULL: the forward */
} lstm_case;

static kiln_tensor *scaled_randn(int ndim, const int64_t *shape, uint64_t seed, double scale) {
  kiln_scope_begin();
  kiln_tensor *t = kiln_keep(kiln_mul(kiln_randn(KILN_F32, ndim, shape, seed), kiln_scalar(KILN_F32, scale)));
  kiln_scope_end();
  return t;
}

static kiln_tensor *make_x(int T) { return kiln_randn(KILN_F32, 3, (int64_t[]){T, LB, LI}, 1004); }

/* Weights ~ N(0, 1/H) and x ~ N(0,1) of T steps; a target too when train. 0 or -1. */
static int case_init(lstm_case *c, int T, bool train) {
  *c = (lstm_case){.w.hidden = LH};
  c->w.wx = scaled_randn(2, (int64_t[]){LI, 4 * LH}, 1001, 0.088);
  c->w.wh = scaled_randn(2, (int64_t[]){LH, 4 * LH}, 1002, 0.088);
  c->w.bias = scaled_randn(1, (int64_t[]){4 * LH}, 1003, 0.088);
  c->x = make_x(T);
  if (train) c->target = kiln_randn(KILN_F32, 3, (int64_t[]){T, LB, LH}, 1005);
  if (!c->w.wx || !c->w.wh || !c->w.bias || !c->x || (train && !c->target)) return -1;
  kiln_requires_grad(c->w.wx, train);
  kiln_requires_grad(c->w.wh, train);
  kiln_requires_grad(c->w.bias, train);
  return 0;
}

static void case_free(lstm_case *c) {
  kiln_release(c->w.wx), kiln_release(c->w.wh), kiln_release(c->w.bias);
  kiln_release(c->x), kiln_release(c->target);
}

/* in = x (T,B,I); out = hs (T,B,H) */
static int fwd_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  lstm_case *c = ctx;
  out[0] = lstm_layer(&c->w, in[0]);
  return out[0] ? 0 : -1;
}

/* in = x (T,B,I), target (T,B,H); out = the loss before the update */
static int train_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  lstm_case *c = ctx;
  kiln_tensor *d = kiln_sub(lstm_layer(&c->w, in[0]), in[1]);
  out[0] = kiln_mean_all(kiln_mul(d, d));
  if (!out[0] || kiln_backward(out[0])) return -1;
  kiln_tensor *p[3] = {c->w.wx, c->w.wh, c->w.bias};
  bool ok = true;
  kiln_no_grad_begin();
  for (int k = 0; k < 3; k++) {
    ok = ok && kiln_sub_(p[k], kiln_mul(kiln_scalar(KILN_F32, LR), kiln_grad(p[k])));
    kiln_zero_grad(p[k]);
  }
  kiln_no_grad_end();
  return ok ? 0 : -1;
}

/* One call in its own scope: eagerly (fn NULL) or through fn. */
static int case_run(void *ctx, kiln_fn *fn) {
  lstm_case *c = ctx;
  kiln_scope_begin();
  kiln_tensor *in[2] = {c->x, c->target}, *y = NULL;
  int rc = fn ? kiln_call(fn, in, &y) : (c->target ? train_body : fwd_body)(c, in, &y);
  kiln_scope_end();
  return rc;
}

static kiln_fn *case_compile(lstm_case *c, const char *name) {
  bool train = c->target != NULL;
  kiln_options o = {.name = name, .n_in = train ? 2 : 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(train ? train_body : fwd_body, c, &o);
  if (fn && kiln_mark_dynamic(fn, 0, 0)) kiln_fn_free(fn), fn = NULL; /* T: one variant for every length is the aim */
  if (fn && train && kiln_mark_dynamic(fn, 1, 0)) kiln_fn_free(fn), fn = NULL;
  return fn;
}

/* ---- kiln_bench --compiled ------------------------------------------------ */

typedef struct lstm_result {
  const char *name;
  bool ok;
  double eager_ms, compiled_ms, compile_ms, trace_ms;
  long long variants, traces; /* of the function after this row (the forward rows share one) */
  double floor_ms;            /* the forward rows: their GEMMs alone (bench_matmuls_ms), 0 else */
  size_t eager_peak, compiled_peak; /* bytes above the inputs: a call, and a new function's first call (its arena too) */
} lstm_result;

static lstm_result results[1 + N_FWD];
static int n_results;

static bool wanted(const char *name, const char *only) {
  if (!only) return true;
  char buf[256];
  snprintf(buf, sizeof buf, "%s", only);
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
    if (!strcmp(tok, "W10") || !strcmp(tok, name)) return true;
  return false;
}

/* Times c eagerly and through fn, interleaved. fn's first call at c's T may
 * trace and compile: its compile ms is what this row added. */
static lstm_result measure(const char *name, lstm_case *c, kiln_fn *fn) {
  lstm_result r = {.name = name};
  kiln_fn_stats st0, st;
  if (!fn || kiln_fn_get_stats(fn, &st0) || case_run(c, fn) || case_run(c, fn)) return r;
  kiln_fn_get_stats(fn, &st);
  r.compile_ms = st.compile_ms - st0.compile_ms;
  r.trace_ms = st.trace_ms - st0.trace_ms;
  for (int i = 0; i < WARMUP; i++)
    if (case_run(c, NULL) || case_run(c, fn)) return r;
  if (bench_interleaved(case_run, c, fn, SAMPLE_BUDGET_S, MIN_SAMPLES, MAX_SAMPLES, 1, &r.eager_ms, &r.compiled_ms))
    return r;
  kiln_fn_get_stats(fn, &st);
  r.variants = st.variants, r.traces = st.traces;
  r.ok = st.fallbacks == 0;
  /* peaks: the body run eagerly, and a function of its own's first call
   * (which records, compiles and runs compiled code), so that the arena it
   * keeps counts as the call's */
  size_t base = kiln_mem_in_use();
  kiln_mem_reset_peak();
  if (case_run(c, NULL)) r.ok = false;
  r.eager_peak = kiln_mem_peak() - base;
  kiln_fn *own = case_compile(c, "W10_memory");
  base = kiln_mem_in_use();
  kiln_mem_reset_peak();
  if (!own || case_run(c, own)) r.ok = false;
  r.compiled_peak = kiln_mem_peak() - base;
  kiln_fn_free(own); /* a variant per T is slow to compile, not wrong: variants are reported, not required */
  return r;
}

static void print_row(const lstm_result *r) {
  if (!r->ok) {
    printf("%-18s FAILED (%s)\n", r->name, kiln_last_error());
    return;
  }
  printf("%-18s %10.3f %12.3f %7.2fx %11.1f   variants %lld, traces %lld", r->name, r->eager_ms, r->compiled_ms,
         r->eager_ms / r->compiled_ms, r->compile_ms, r->variants, r->traces);
  printf("   peak MiB: eager %.2f, compiled %.2f", r->eager_peak / 1048576.0, r->compiled_peak / 1048576.0);
  if (r->floor_ms > 0)
    printf("   GEMMs alone %.3f ms: eager %.2fx, compiled %.2fx of it", r->floor_ms, r->eager_ms / r->floor_ms,
           r->compiled_ms / r->floor_ms);
  printf("\n");
  fflush(stdout);
}

/* Runs the selected W10 rows and prints them; returns how many rows. */
int bench_lstm(const char *only) {
  if (wanted("W10_lstm_train", only)) {
    lstm_case c;
    kiln_fn *fn = NULL;
    if (!case_init(&c, TRAIN_T, true)) {
      kiln_cache_clear(); /* from nothing, whatever ran before */
      fn = case_compile(&c, "W10_train");
    }
    results[n_results] = measure("W10_lstm_train", &c, fn);
    print_row(&results[n_results++]);
    /* the same step at the forward rows' lengths: how many variants they take */
    kiln_fn_stats st;
    bool ok = fn != NULL;
    for (int k = 0; k < N_FWD && ok; k++) {
      kiln_release(c.x), kiln_release(c.target);
      c.x = make_x(FWD_T[k]);
      c.target = kiln_randn(KILN_F32, 3, (int64_t[]){FWD_T[k], LB, LH}, 1005);
      ok = c.x && c.target && !case_run(&c, fn);
    }
    if (ok && !kiln_fn_get_stats(fn, &st))
      printf("W10 train: one compiled function over T = 16, 32, 64, 128 made %lld variant%s, %lld trace%s (the target: 1)\n",
             (long long)st.variants, st.variants == 1 ? "" : "s", (long long)st.traces, st.traces == 1 ? "" : "s");
    kiln_fn_free(fn);
    case_free(&c);
  }
  /* the forward rows: one function, on one set of weights, called at every T */
  kiln_fn *fn = NULL;
  lstm_case c = {0};
  int first = n_results;
  for (int k = 0; k < N_FWD; k++) {
    if (!wanted(FWD_NAMES[k], only)) continue;
    if (!fn) {
      kiln_cache_clear();
      fn = case_init(&c, FWD_T[k], false) ? NULL : case_compile(&c, "W10_fwd");
    } else {
      kiln_release(c.x);
      c.x = make_x(FWD_T[k]);
    }
    results[n_results] = measure(FWD_NAMES[k], &c, fn);
    /* the floor: x @ wx over every step at once (compiled code's; eager's per step is no cheaper), and
     * one h @ wh a step */
    const bench_mm mm[2] = {{(int64_t)FWD_T[k] * LB, LI, 4 * LH, false, false, 1}, {LB, LH, 4 * LH, false, false, FWD_T[k]}};
    results[n_results].floor_ms = bench_matmuls_ms(mm, 2, 9);
    print_row(&results[n_results++]);
  }
  if (n_results > first + 1) {
    const lstm_result *r = &results[n_results - 1];
    printf("W10 forward: one compiled function over %d lengths made %lld variant%s (the target: 1)\n",
           n_results - first, r->variants, r->variants == 1 ? "" : "s");
  }
  kiln_fn_free(fn);
  case_free(&c);
  return n_results;
}

/* The rows of bench_lstm as objects of workloads.c's JSON array. */
void bench_lstm_json(FILE *f, int threads) {
  for (int i = 0; i < n_results; i++) {
    const lstm_result *r = &results[i];
    fprintf(f, "  {\"name\": \"%s\", \"threads\": %d, \"ok\": %s, \"eager_ms\": %.6f, \"compiled_ms\": %.6f, "
            "\"compile_ms\": %.3f, \"trace_ms\": %.3f, \"variants\": %lld, \"traces\": %lld, \"floor_ms\": %.6f, "
            "\"eager_peak_bytes\": %zu, \"compiled_peak_bytes\": %zu}%s\n",
            r->name, threads, r->ok ? "true" : "false", r->eager_ms, r->compiled_ms, r->compile_ms, r->trace_ms,
            r->variants, r->traces, r->floor_ms, r->eager_peak, r->compiled_peak, i + 1 < n_results ? "," : "");
  }
}

/* ---- W10's rows as cases, for serve.c --------------------------------------- */

static void lcase_close(void *ctx) {
  case_free(ctx);
  free(ctx);
}

int lstm_case_open(const char *id, bench_case *bc) {
  int k = -1; /* -1: not W10's; N_FWD: the training step */
  if (!strcmp(id, "W10_lstm_train")) k = N_FWD;
  for (int i = 0; i < N_FWD && k < 0; i++)
    if (!strcmp(id, FWD_NAMES[i])) k = i;
  if (k < 0) return 1;
  lstm_case *c = malloc(sizeof *c);
  if (!c) return -1;
  bool train = k == N_FWD;
  kiln_fn *fn = case_init(c, train ? TRAIN_T : FWD_T[k], train) ? NULL : case_compile(c, train ? "W10_train" : "W10_fwd");
  if (!fn) {
    lcase_close(c);
    return -1;
  }
  *bc = (bench_case){.name = train ? "W10_lstm_train" : FWD_NAMES[k], .run = case_run, .close = lcase_close, .ctx = c,
                     .fn = fn, .per = 1};
  return 0;
}

void lstm_list(FILE *f) {
  fprintf(f, "W10 W10_lstm_train\n");
  for (int i = 0; i < N_FWD; i++) fprintf(f, "W10 %s\n", FWD_NAMES[i]);
}
