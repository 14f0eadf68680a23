/* W11, W12 and the batch-1 matmuls for kiln_bench --compiled: the Llama-2 of
 * examples/llama.h at stories15M's shape (dim 288, hidden 768, 6 layers, 6
 * heads, 6 kv heads, vocab 32000, seq_len 256), random weights, eager
 * against compiled, side by side.
 *
 *   W11_llama_generate  greedy generation of 256 tokens from BOS through the
 *                       KV cache, one compiled variant for every position
 *                       (llama_step_body: the position an input, calls on the
 *                       guard-only path; eager runs llama_decode_body, which
 *                       attends over the rows so far): ms per token, and
 *                       tokens per second
 *   W11_llama_generate_bf16  the same with the layers' weight matrices in
 *                       bf16 (the embedding, tied to the head, stays f32):
 *                       half the bytes a decode step streams
 *   W12_llama_forward   logits of 64 tokens at once, batch 1: ms per call
 *   M1_matvec_in_out    (1,288) @ (288,288), weights (in,out): ms per call
 *   M1_matvec_out_in    (1,288) @ (288,288)^T, weights (out,in): ms per call
 *
 * Beside W11 and W12, what bounds them, timed in the same run: W11 every
 * weight read once a token (a threaded sum over as many bytes), W12 its
 * weight matmuls alone (bench_matmuls_ms), eager and compiled as multiples
 * of it.
 *
 * The eager and compiled sides run interleaved, sample by sample, as the
 * other workloads do.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../examples/llama.h"
#include "bench.h"
#include "kiln.h"
#include "stats.h"

enum { WARMUP = 2, MIN_SAMPLES = 3, MAX_SAMPLES = 200, GEN_TOKENS = 255, FWD_T = 64 };
#define SAMPLE_BUDGET_S 6.0

typedef struct ll_result {
  const char *name;
  bool ok;
  double eager_ms, compiled_ms, compile_ms, trace_ms;
  long long variants, traces;
  double per;      /* the sample divided by this: tokens for W11 */
  double floor_ms; /* W11: its weights' bytes read once; W12: its weight matmuls alone; 0 else */
  const char *floor_what;
} ll_result;

static ll_result results[6];
static int n_results;

static bool wanted(const char *id, const char *name, const char *only) {
  if (!only) return true;
  char buf[256];
  snprintf(buf, sizeof buf, "%s", only);
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
    if (!strcmp(tok, id) || !strcmp(tok, name) || !strcmp(tok, "W11_W12")) return true;
  return false;
}

typedef struct ll_ctx {
  llama *m;
  kiln_tensor *x, *w; /* M1 and W12 inputs */
  bool transposed;    /* M1: w is (out,in) */
} ll_ctx;

static int gen_run(void *ctx, kiln_fn *fn) {
  ll_ctx *c = ctx;
  int64_t out[GEN_TOKENS + 1], bos = LLAMA_BOS;
  return llama_generate(c->m, fn, &bos, 1, GEN_TOKENS, out);
}

static int fwd_run(void *ctx, kiln_fn *fn) {
  ll_ctx *c = ctx;
  kiln_scope_begin();
  kiln_tensor *y = NULL;
  int rc = fn ? kiln_call(fn, &c->x, &y) : llama_forward_body(c->m, &c->x, &y);
  kiln_scope_end();
  return rc;
}

static int mv_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  ll_ctx *c = ctx;
  out[0] = kiln_matmul(in[0], c->transposed ? kiln_transpose(c->w, 0, 1) : c->w);
  return out[0] ? 0 : -1;
}

static int mv_run(void *ctx, kiln_fn *fn) {
  ll_ctx *c = ctx;
  kiln_scope_begin();
  kiln_tensor *y = NULL;
  int rc = fn ? kiln_call(fn, &c->x, &y) : mv_body(c, &c->x, &y);
  kiln_scope_end();
  return rc;
}

static ll_result measure(const char *name, int (*run)(void *, kiln_fn *), ll_ctx *c, kiln_fn *fn, double per) {
  ll_result r = {.name = name, .per = per};
  if (!fn || run(c, fn) || run(c, fn)) return r;
  for (int i = 0; i < WARMUP; i++)
    if (run(c, NULL) || run(c, fn)) return r;
  if (bench_interleaved(run, c, fn, SAMPLE_BUDGET_S, MIN_SAMPLES, MAX_SAMPLES, per, &r.eager_ms,
                        &r.compiled_ms))
    return r;
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  r.compile_ms = st.compile_ms, r.trace_ms = st.trace_ms, r.variants = st.variants, r.traces = st.traces;
  r.ok = st.variants == 1 && st.fallbacks == 0;
  return r;
}

static void print_row(const ll_result *r) {
  if (!r->ok) {
    printf("%-14s FAILED (%s)\n", r->name, kiln_last_error());
    return;
  }
  bool tiny = r->eager_ms < 0.1; /* M1: microseconds need the digits */
  printf(tiny ? "%-14s %10.5f %12.5f %7.2fx %11.1f   variants %lld, traces %lld" : "%-14s %10.3f %12.3f %7.2fx %11.1f   variants %lld, traces %lld",
         r->name, r->eager_ms, r->compiled_ms, r->eager_ms / r->compiled_ms, r->compile_ms, r->variants, r->traces);
  if (r->per > 1) printf("   tokens/s: eager %.0f, compiled %.0f", 1e3 / r->eager_ms, 1e3 / r->compiled_ms);
  if (r->floor_ms > 0)
    printf("   %s %.3f ms: eager %.2fx, compiled %.2fx of it", r->floor_what, r->floor_ms, r->eager_ms / r->floor_ms,
           r->compiled_ms / r->floor_ms);
  printf("\n");
  fflush(stdout);
}

/* A read of `floats` f32 once, through kiln's threaded sum: the median of 9, ms
 * (a decode step's floor: every weight read once a token). 0 on failure. */
static double read_ms(int64_t floats) {
  kiln_tensor *t = kiln_randn(KILN_F32, 1, &floats, 3);
  double v[9], ms = 0;
  bool ok = t != NULL;
  for (int r = 0; ok && r <= 9; r++) { /* round 0 warms up */
    double a = bench_now_s();
    kiln_scope_begin();
    ok = kiln_sum_all(t) != NULL;
    kiln_scope_end();
    if (r) v[r - 1] = 1e3 * (bench_now_s() - a);
  }
  if (ok) ms = bench_median(v, 9);
  kiln_release(t);
  return ms;
}

/* Floors of stories15M (cfg): W11 a step's weight bytes read once (bf16
 * layers: half theirs), W12 the weight matmuls of 64 tokens alone. */
static double floor_of(const char *fn_name, const llama_config *cfg) {
  int64_t D = cfg->dim, H = cfg->hidden_dim, L = cfg->n_layers, V = cfg->vocab_size;
  int64_t layer = 4 * D * D + 3 * D * H, head = V * D;
  if (!strcmp(fn_name, "W11")) return read_ms(L * layer + head);
  if (!strcmp(fn_name, "W11_bf16")) return read_ms(L * layer / 2 + head);
  if (strcmp(fn_name, "W12")) return 0;
  const bench_mm mm[4] = {{FWD_T, D, D, true, true, (int)(4 * L)},
                          {FWD_T, D, H, true, true, (int)(2 * L)},
                          {FWD_T, H, D, true, true, (int)L},
                          {FWD_T, D, V, true, true, 1}};
  return bench_matmuls_ms(mm, 4, 9);
}

/* Compiles body (over body_ctx) as fn_name with n_in inputs (two: a decode
 * step whose position is an input, on the guard-only path), measures it
 * against eager under name and prints the row. */
static void add_row(const char *name, const char *fn_name, kiln_body body, void *body_ctx, int n_in,
                    int (*run)(void *, kiln_fn *), ll_ctx *c, double per) {
  kiln_options o = {.name = fn_name, .n_in = n_in, .n_out = 1, .capture = n_in == 2 ? KILN_CAPTURE_GUARDS : 0};
  kiln_fn *fn = kiln_compile(body, body_ctx, &o);
  ll_result r = measure(name, run, c, fn, per);
  if (r.ok && c->m) {
    r.floor_ms = floor_of(fn_name, &c->m->cfg);
    r.floor_what = strcmp(fn_name, "W12") ? "weights read once" : "weight matmuls alone";
  }
  results[n_results++] = r;
  print_row(&r);
  kiln_fn_free(fn);
}

/* Runs the selected workloads and prints their rows; returns how many rows. */
int bench_llama(const char *only) {
  bool w11 = wanted("W11", "W11_llama_generate", only), w12 = wanted("W12", "W12_llama_forward", only);
  bool m1 = wanted("M1", "M1_matvec", only);
  if (!w11 && !w12 && !m1) return 0;
  if (m1) {
    for (int t = 0; t < 2; t++) {
      ll_ctx c = {.transposed = t == 1};
      c.x = kiln_randn(KILN_F32, 2, ((int64_t[]){1, 288}), 1);
      c.w = kiln_randn(KILN_F32, 2, ((int64_t[]){288, 288}), 2);
      add_row(t ? "M1_matvec_out_in" : "M1_matvec_in_out", t ? "M1_out_in" : "M1_in_out", mv_body, &c, 1, mv_run, &c, 1);
      kiln_release(c.x), kiln_release(c.w);
    }
  }
  if (!w11 && !w12) return n_results;
  llama m;
  llama_config cfg = LLAMA_STORIES15M;
  if (llama_init(&m, &cfg, 1)) {
    fprintf(stderr, "llama: %s\n", kiln_last_error());
    return n_results;
  }
  if (w11) {
    ll_ctx c = {.m = &m};
    add_row("W11_llama_generate", "W11", llama_step_body, &m, 2, gen_run, &c, GEN_TOKENS);
  }
  if (w12) {
    int64_t t[FWD_T];
    for (int i = 0; i < FWD_T; i++) t[i] = (i * 7919 + 1) % cfg.vocab_size;
    ll_ctx c = {.m = &m, .x = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){FWD_T}), t)};
    add_row("W12_llama_forward", "W12", llama_forward_body, &m, 1, fwd_run, &c, 1);
    kiln_release(c.x);
  }
  if (w11) {
    /* bf16 weight matrices: a product of f32 activations and bf16 weights is f32 */
    int bad = 0;
    for (int l = 0; l < cfg.n_layers && !bad; l++)
      for (int w = 0; w < LL_PER_LAYER && !bad; w++) {
        kiln_tensor **p = &m.layer[l * LL_PER_LAYER + w];
        if (kiln_ndim(*p) != 2) continue;
        kiln_tensor *narrow = kiln_keep(kiln_cast(*p, KILN_BF16));
        bad = narrow == NULL;
        if (!bad) kiln_release(*p), *p = narrow;
      }
    if (bad) {
      fprintf(stderr, "llama bf16: %s\n", kiln_last_error());
    } else {
      ll_ctx c = {.m = &m};
      add_row("W11_llama_generate_bf16", "W11_bf16", llama_step_body, &m, 2, gen_run, &c, GEN_TOKENS);
    }
  }
  llama_free(&m);
  return n_results;
}

/* W11 and W12 for kiln_bench --serve (bench/side_by_side.py): the same
 * model, runs and per-token division as bench_llama's rows (f32 only). */
typedef struct ll_case {
  ll_ctx c; /* first: the runs get the case as their ll_ctx */
  llama m;
} ll_case;

static void ll_case_close(void *ctx) {
  ll_case *k = ctx;
  kiln_release(k->c.x);
  llama_free(&k->m);
  free(k);
}

int llama_case_open(const char *id, bench_case *bc) {
  bool w11 = !strcmp(id, "W11") || !strcmp(id, "W11_llama_generate");
  bool w12 = !strcmp(id, "W12") || !strcmp(id, "W12_llama_forward");
  if (!w11 && !w12) return 1;
  ll_case *k = calloc(1, sizeof *k);
  llama_config cfg = LLAMA_STORIES15M;
  if (!k || llama_init(&k->m, &cfg, 1)) return free(k), -1;
  k->c.m = &k->m;
  kiln_fn *fn = NULL;
  if (w11) {
    kiln_options o = {.name = "W11", .n_in = 2, .n_out = 1, .capture = KILN_CAPTURE_GUARDS};
    fn = kiln_compile(llama_step_body, &k->m, &o);
    *bc = (bench_case){.name = "W11_llama_generate", .run = gen_run, .per = GEN_TOKENS};
  } else {
    int64_t t[FWD_T];
    for (int i = 0; i < FWD_T; i++) t[i] = (i * 7919 + 1) % cfg.vocab_size;
    k->c.x = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){FWD_T}), t);
    kiln_options o = {.name = "W12", .n_in = 1, .n_out = 1};
    fn = k->c.x ? kiln_compile(llama_forward_body, &k->m, &o) : NULL;
    *bc = (bench_case){.name = "W12_llama_forward", .run = fwd_run, .per = 1};
  }
  if (!fn) return ll_case_close(k), -1;
  bc->close = ll_case_close, bc->ctx = k, bc->fn = fn;
  return 0;
}

void llama_list(FILE *f) { fprintf(f, "W11 W11_llama_generate\nW12 W12_llama_forward\n"); }

/* The rows of bench_llama as objects of workloads.c's JSON array. */
void bench_llama_json(FILE *f, int threads) {
  for (int i = 0; i < n_results; i++) {
    const ll_result *r = &results[i];
    fprintf(f, "  {\"name\": \"%s\", \"threads\": %d, \"ok\": %s, \"eager_ms\": %.6f, \"compiled_ms\": %.6f, "
            "\"compile_ms\": %.3f, \"trace_ms\": %.3f, \"variants\": %lld, \"floor_ms\": %.6f",
            r->name, threads, r->ok ? "true" : "false", r->eager_ms, r->compiled_ms, r->compile_ms, r->trace_ms, r->variants,
            r->floor_ms);
    if (r->per > 1)
      fprintf(f, ", \"tokens_per_s_eager\": %.3f, \"tokens_per_s_compiled\": %.3f", r->ok ? 1e3 / r->eager_ms : 0,
              r->ok ? 1e3 / r->compiled_ms : 0);
    fprintf(f, "}%s\n", i + 1 < n_results ? "," : "");
  }
}
