/* bench.h - what the parts of kiln_bench share: a workload opened as a case
 * that runs one call eagerly or compiled (workloads.c for W1..W7, gpt.c for
 * W8 and W9, lstm.c for W10, resnet.c for W13 and W14), which serve.c hands to
 * bench/side_by_side.py sample by sample. */
#ifndef KILN_BENCH_H
#define KILN_BENCH_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "kiln.h"
#include "stats.h"

/* One workload, ready to run: its inputs made, its compiled function made
 * (traced and compiled on its first compiled call). */
typedef struct bench_case {
  const char *name;                   /* "W1_gelu" */
  int (*run)(void *ctx, kiln_fn *fn); /* one call in its own scope; fn NULL: eager; 0 or -1 */
  void (*close)(void *ctx);           /* frees ctx and what it holds */
  void *ctx;
  kiln_fn *fn;
  int per; /* calls a sample stands for (W9: the bytes one generation makes) */
} bench_case;

/* Times run(ctx, NULL) (eager) and run(ctx, fn) (compiled) interleaved,
 * sample by sample, so that both see the same machine: as many pairs as fit
 * budget_s by the time of one pair, at least lo and at most hi. The medians,
 * in ms per call divided by per, go to *eager_ms and *compiled_ms. 0, or -1
 * when a call failed. */
static inline int bench_interleaved(int (*run)(void *ctx, kiln_fn *fn), void *ctx, kiln_fn *fn, double budget_s,
                                    int lo, int hi, double per, double *eager_ms, double *compiled_ms) {
  double t0 = bench_now_s();
  if (run(ctx, NULL) || run(ctx, fn)) return -1;
  double pair = bench_now_s() - t0;
  int n = (int)(budget_s / (pair > 0 ? pair : 1e-9));
  n = n < lo ? lo : n > hi ? hi : n;
  double *e = malloc(sizeof(double) * (size_t)n), *c = malloc(sizeof(double) * (size_t)n);
  int rc = e && c ? 0 : -1;
  for (int i = 0; !rc && i < n; i++) {
    double a = bench_now_s();
    rc = run(ctx, NULL);
    double b = bench_now_s();
    rc = rc || run(ctx, fn);
    c[i] = 1e3 * (bench_now_s() - b) / per;
    e[i] = 1e3 * (b - a) / per;
  }
  if (!rc) *eager_ms = bench_median(e, n), *compiled_ms = bench_median(c, n);
  free(e), free(c);
  return rc;
}

/* A GEMM-bound workload's floor: its matmuls alone, eagerly through
 * kiln_matmul on operands of their own (x (m,k) @ w, w (k,n), or w^T with w
 * (n,k) when wt), count times each (distinct weights when distinct, else
 * one reused, as a recurrence reuses it), one after another with nothing
 * between them: the median over rounds of their summed time, ms; 0 on
 * failure. The same kernels the workload's eager and compiled code run. */
typedef struct bench_mm {
  int64_t m, k, n;
  bool wt, distinct;
  int count;
} bench_mm;

static inline double bench_matmuls_ms(const bench_mm *mm, int n_mm, int rounds) {
  int total = 0;
  for (int i = 0; i < n_mm; i++) total += mm[i].distinct ? mm[i].count : 1;
  kiln_tensor **x = calloc((size_t)n_mm, sizeof *x), **w = calloc((size_t)total, sizeof *w);
  double *t = malloc(sizeof(double) * (size_t)(rounds > 0 ? rounds : 1)), ms = 0;
  bool ok = x && w && t && rounds > 0;
  for (int i = 0, at = 0; ok && i < n_mm; i++) {
    ok = (x[i] = kiln_randn(KILN_F32, 2, ((int64_t[]){mm[i].m, mm[i].k}), 7 + (uint64_t)i)) != NULL;
    for (int c = 0; ok && c < (mm[i].distinct ? mm[i].count : 1); c++, at++) {
      int64_t ws[2] = {mm[i].wt ? mm[i].n : mm[i].k, mm[i].wt ? mm[i].k : mm[i].n};
      ok = (w[at] = kiln_randn(KILN_F32, 2, ws, 100 + (uint64_t)at)) != NULL;
    }
  }
  for (int r = 0; ok && r <= rounds; r++) { /* round 0 warms up */
    double a = bench_now_s();
    for (int i = 0, at = 0; ok && i < n_mm; at += mm[i].distinct ? mm[i].count : 1, i++)
      for (int c = 0; ok && c < mm[i].count; c++) {
        kiln_tensor *wi = w[at + (mm[i].distinct ? c : 0)];
        kiln_scope_begin();
        ok = kiln_matmul(x[i], mm[i].wt ? kiln_transpose(wi, 0, 1) : wi) != NULL;
        kiln_scope_end();
      }
    if (r) t[r - 1] = 1e3 * (bench_now_s() - a);
  }
  if (ok) ms = bench_median(t, rounds);
  for (int i = 0; x && i < n_mm; i++) kiln_release(x[i]);
  for (int i = 0; w && i < total; i++) kiln_release(w[i]);
  free(x), free(w), free(t);
  return ms;
}

/* Open workload id ("W1" or "W1_gelu") into c: 0, -1 on failure (message in
 * kiln_last_error), 1 when the id is not theirs. */
int workloads_case_open(const char *id, bench_case *c);
int gpt_case_open(const char *id, bench_case *c);    /* W9_gpt_generate_kv by name: W9 has two rows */
int resnet_case_open(const char *id, bench_case *c); /* by name: W13 has two rows */
int lstm_case_open(const char *id, bench_case *c);   /* by name: W10 has five rows */
int llama_case_open(const char *id, bench_case *c);  /* W11 and W12 (f32) */
void bench_case_close(bench_case *c);

/* Every workload's id and name, in order, one per line: "W1 W1_gelu". */
void workloads_list(FILE *f);
void gpt_list(FILE *f);
void resnet_list(FILE *f);
void lstm_list(FILE *f);
void llama_list(FILE *f);

int bench_serve(void);                      /* serve.c */
int bench_overhead(void);                   /* overhead.c */
int bench_gemm(int threads);                /* gemm.c: kiln's GEMM against OpenBLAS, --gemm */
int bench_overhead_count(const char *what, long calls); /* overhead.c: --count, one path under callgrind */
void bench_toggle_collect(void);            /* overhead.c: callgrind's collection on or off */
int bench_gpt_count(const char *path, long steps, void (*toggle)(void)); /* gpt.c: W8 steps on one path, for --count */
int bench_gpt_paths(void);                  /* gpt.c: W8 on both capture paths, for --overhead */
int bench_decode_paths(void);               /* gpt.c: W9_kv decode on both capture paths, for --overhead */
int bench_gpt_first_call(void);             /* gpt.c: GPT-2 small first call against later ones, --first-call */
int bench_gpt(const char *only);            /* gpt.c: rows it printed */
void bench_gpt_json(FILE *f, int threads);  /* gpt.c: those rows as JSON objects */
int bench_resnet(const char *only);         /* resnet.c: W13, W14 (and R50 when named) */
void bench_resnet_json(FILE *f, int threads);
int bench_llama(const char *only);          /* llama.c: W11, W12, M1 */
void bench_llama_json(FILE *f, int threads);
int bench_lstm(const char *only);           /* lstm.c: W10 */
void bench_lstm_json(FILE *f, int threads);

#endif
