/* W13, W14 and R50 for kiln_bench --compiled: the ResNets of
 * examples/resnet.h, eager against compiled, side by side.
 *
 *   W13_resnet18_b1    ResNet-18 (CIFAR variant, width 64) inference in eval
 *   W13_resnet18_b32   mode on (1|32, 3, 32, 32) images: ms per call
 *   W14_resnet18_train one training step on 32 images (forward, cross
 *                      entropy, backward, SGD with momentum, the running
 *                      statistics): ms per step
 *   R50_resnet50_b1    ResNet-50 inference in eval mode on (1, 3, 224, 224):
 *                      ms per call. Run only when named (--only R50): the
 *                      article's claim, kiln against kiln (docs/perf.md)
 *
 * The images come from the synthetic dataset of resnet.h (the time does not
 * depend on them). The eager and compiled sides run interleaved, sample by
 * sample, on one model, as the other workloads do. W13 and W14 are also
 * cases for serve.c (bench/side_by_side.py), opened by name.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../examples/resnet.h"
#include "bench.h"
#include "kiln.h"
#include "stats.h"

enum { WARMUP = 2, MIN_SAMPLES = 5, MAX_SAMPLES = 100 };
#define SAMPLE_BUDGET_S 10.0

typedef struct rn_result {
  const char *name;
  bool ok;
  double eager_ms, compiled_ms, compile_ms, trace_ms;
  size_t eager_peak, compiled_peak;
} rn_result;

static rn_result results[4];
static int n_results;

static bool wanted(const char *id, const char *name, const char *only, bool by_default) {
  if (!only) return by_default;
  char buf[256];
  snprintf(buf, sizeof buf, "%s", only);
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
    if (!strcmp(tok, id) || !strcmp(tok, name)) return true;
  return false;
}

typedef struct run_ctx {
  resnet *m;
  kiln_tensor *x, *labels; /* labels NULL: inference */
} run_ctx;

/* One sample: eagerly (fn NULL) or compiled. */
static int run(run_ctx *c, kiln_fn *fn) {
  kiln_scope_begin();
  kiln_tensor *in[2] = {c->x, c->labels}, *y = NULL;
  int rc;
  if (fn) rc = kiln_call(fn, in, &y);
  else if (c->labels) rc = resnet_train_step(c->m, c->x, c->labels) ? 0 : -1;
  else rc = resnet_forward(c->m, c->x) ? 0 : -1;
  kiln_scope_end();
  return rc;
}

static int run_any(void *c, kiln_fn *fn) { return run(c, fn); } /* run, as bench_interleaved calls it */

/* Times c eagerly and through fn (its first call traces and compiles), interleaved. */
static rn_result measure(const char *name, run_ctx *c, kiln_fn *fn) {
  rn_result r = {.name = name};
  size_t before = kiln_mem_in_use();
  if (!fn || run(c, fn) || run(c, fn)) return r; /* the trace, then the first compiled call */
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  r.compile_ms = st.compile_ms;
  r.trace_ms = st.trace_ms;
  for (int i = 0; i < WARMUP; i++)
    if (run(c, NULL) || run(c, fn)) return r;
  size_t base = kiln_mem_in_use();
  kiln_mem_reset_peak();
  run(c, NULL);
  r.eager_peak = kiln_mem_peak() - base;
  base = kiln_mem_in_use();
  size_t kept = base > before ? base - before : 0; /* the compiled variant's arena */
  kiln_mem_reset_peak();
  run(c, fn);
  r.compiled_peak = kept + (kiln_mem_peak() - base);
  if (bench_interleaved(run_any, c, fn, SAMPLE_BUDGET_S, MIN_SAMPLES, MAX_SAMPLES, 1, &r.eager_ms,
                        &r.compiled_ms))
    return r;
  kiln_fn_get_stats(fn, &st);
  r.ok = st.traces == 1 && st.variants == 1 && st.fallbacks == 0;
  return r;
}

static void print_row(const rn_result *r) {
  if (!r->ok) {
    printf("%-18s FAILED (%s)\n", r->name, kiln_last_error());
    return;
  }
  printf("%-18s %10.3f %12.3f %7.2fx %11.1f %7s %12.1f %12.1f\n", r->name, r->eager_ms, r->compiled_ms,
         r->eager_ms / r->compiled_ms, r->compile_ms, "-", r->eager_peak / 1048576.0, r->compiled_peak / 1048576.0);
  fflush(stdout);
}

/* One row: model m on a batch of n images of hw x hw, inference or a training step. */
static void one(const char *name, resnet *m, int64_t n, int hw, bool train) {
  kiln_scope_begin();
  uint64_t rng = 11;
  kiln_tensor *templates = rn_templates(m->classes, hw), *x = NULL, *labels = NULL;
  rn_result r = {.name = name};
  if (templates && rn_batch(templates, n, &rng, &x, &labels) == 0) {
    m->training = train;
    kiln_options o = {.name = name, .n_in = train ? 2 : 1, .n_out = 1};
    kiln_cache_clear(); /* from nothing, whatever ran before */
    kiln_fn *fn = kiln_compile(train ? resnet_train_body : resnet_forward_body, m, &o);
    run_ctx c = {m, x, train ? labels : NULL};
    r = measure(name, &c, fn);
    kiln_fn_free(fn);
  }
  kiln_scope_end(); /* frees the templates and the batch */
  results[n_results++] = r;
  print_row(&r);
}

/* Runs the selected ResNet workloads and prints their rows; returns how many rows. */
int bench_resnet(const char *only) {
  bool b1 = wanted("W13", "W13_resnet18_b1", only, true), b32 = wanted("W13", "W13_resnet18_b32", only, true);
  bool train = wanted("W14", "W14_resnet18_train", only, true), r50 = wanted("R50", "R50_resnet50_b1", only, false);
  if (b1 || b32 || train) {
    resnet m;
    if (resnet18_cifar_init(&m, 64, 10, 1) != 0) {
      fprintf(stderr, "resnet: %s\n", kiln_last_error());
      return n_results;
    }
    if (b1) one("W13_resnet18_b1", &m, 1, 32, false);
    if (b32) one("W13_resnet18_b32", &m, 32, 32, false);
    if (train) one("W14_resnet18_train", &m, 32, 32, true);
    resnet_free(&m);
  }
  if (r50) {
    resnet m;
    if (resnet50_init(&m, 1000, 1) != 0) {
      fprintf(stderr, "resnet: %s\n", kiln_last_error());
      return n_results;
    }
    one("R50_resnet50_b1", &m, 1, 224, false);
    resnet_free(&m);
  }
  return n_results;
}

/* The rows of bench_resnet as objects of workloads.c's JSON array, after its own. */
void bench_resnet_json(FILE *f, int threads) {
  for (int i = 0; i < n_results; i++) {
    const rn_result *r = &results[i];
    fprintf(f, "  {\"name\": \"%s\", \"threads\": %d, \"ok\": %s, \"eager_ms\": %.6f, \"compiled_ms\": %.6f, "
            "\"compile_ms\": %.3f, \"trace_ms\": %.3f, \"eager_peak_bytes\": %zu, \"compiled_peak_bytes\": %zu, "
            "\"floor_ms\": 0}%s\n",
            r->name, threads, r->ok ? "true" : "false", r->eager_ms, r->compiled_ms, r->compile_ms, r->trace_ms,
            r->eager_peak, r->compiled_peak, i + 1 < n_results ? "," : "");
  }
}

/* ---- W13 and W14 as cases, for serve.c ------------------------------------- */

static const struct {
  const char *id, *name;
  int64_t n;
  bool train;
} RN_CASES[] = {
    {"W13", "W13_resnet18_b1", 1, false},
    {"W13", "W13_resnet18_b32", 32, false},
    {"W14", "W14_resnet18_train", 32, true},
};

typedef struct rcase {
  resnet m;
  run_ctx c;
  kiln_tensor *x, *labels;
} rcase;

static int rcase_run(void *ctx, kiln_fn *fn) { return run(&((rcase *)ctx)->c, fn); }

static void rcase_close(void *ctx) {
  rcase *r = ctx;
  kiln_release(r->x);
  kiln_release(r->labels);
  resnet_free(&r->m);
  free(r);
}

/* The same model and batch as bench_resnet's rows. Opened by name: W13 has two. */
int resnet_case_open(const char *id, bench_case *bc) {
  int k = -1;
  for (int i = 0; i < (int)(sizeof RN_CASES / sizeof RN_CASES[0]) && k < 0; i++)
    if (!strcmp(id, RN_CASES[i].name) || (!strcmp(id, RN_CASES[i].id) && strcmp(id, "W13"))) k = i;
  if (k < 0) return 1;
  rcase *r = calloc(1, sizeof *r);
  if (!r) return -1;
  if (resnet18_cifar_init(&r->m, 64, 10, 1) != 0) {
    free(r);
    return -1;
  }
  bool train = RN_CASES[k].train;
  uint64_t rng = 11;
  kiln_scope_begin();
  kiln_tensor *templates = rn_templates(r->m.classes, 32), *x = NULL, *labels = NULL;
  if (templates && rn_batch(templates, RN_CASES[k].n, &rng, &x, &labels) == 0) {
    r->x = kiln_keep(x);
    r->labels = kiln_keep(labels);
  }
  kiln_scope_end();
  kiln_fn *fn = NULL;
  if (r->x && r->labels) {
    r->m.training = train;
    r->c = (run_ctx){&r->m, r->x, train ? r->labels : NULL};
    kiln_options o = {.name = RN_CASES[k].name, .n_in = train ? 2 : 1, .n_out = 1};
    fn = kiln_compile(train ? resnet_train_body : resnet_forward_body, &r->m, &o);
  }
  if (!fn) {
    rcase_close(r);
    return -1;
  }
  *bc = (bench_case){.name = RN_CASES[k].name, .run = rcase_run, .close = rcase_close, .ctx = r, .fn = fn, .per = 1};
  return 0;
}

void resnet_list(FILE *f) {
  for (size_t i = 0; i < sizeof RN_CASES / sizeof RN_CASES[0]; i++) fprintf(f, "%s %s\n", RN_CASES[i].id, RN_CASES[i].name);
}
