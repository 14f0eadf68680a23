/* Codegen against eager: fusion asserted on the plan (GELU is one kernel,
 * softmax one row kernel, matmul+bias+relu a GEMM and one epilogue), the
 * three ways (eager, interpreter, LLVM) on every op, and a seeded random
 * program generator: 2-D and 3-D inputs with lower-rank operands, pointwise
 * chains, compare/where/cast, reductions over one, several or all axes (keepdim
 * or not, broadcast back), views and reshapes sized from kiln_size, matmuls
 * (GEMM, batched, a few constant rows), softmax, layer_norm, cross_entropy,
 * in-place ops on tensors made in the body, several outputs (views, inputs
 * as they are) and sometimes the gradients w.r.t. the inputs; f32 or f64;
 * compiled and compared with eager at several sizes (1, and sizes equal to C
 * and to each other) and thread counts. KILN_FUZZ_PROGRAMS=N runs N programs
 * (default 100), from seed KILN_FUZZ_FIRST (default 1000), and half as many
 * again with every light kernel on the quick code generator (KILN_QUICK=1);
 * a failure prints its seed, sizes, output, error and the program's IR. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <llvm-c/ErrorHandling.h>

#include "codegen/codegen.h"
#include "kiln.h"

#include "fuzz/randprog.h" /* the random programs, and maxdiff_rel and same_shape */
#include "stderr_catch.h"

/* ---- the plan ---- */

/* The kernels of fn's newest variant after fusion. */
static cg_program *plan_of(kiln_fn *fn) {
  char *text = kiln_fn_graph(fn, 0);
  ck_assert_ptr_nonnull(text);
  char err[256];
  ir_graph *g = ir_parse(text, err, sizeof err);
  free(text);
  ck_assert_msg(g != NULL, "%s", err);
  cg_program *p = fuse_graph(g, err, sizeof err);
  ck_assert_msg(p != NULL, "%s", err);
  /* the program points at g: keep g alive as long as p; freed by the caller through free_plan */
  return p;
}

static void free_plan(cg_program *p) {
  ir_graph *g = (ir_graph *)p->g;
  cg_program_free(p);
  ir_free(g);
}

static int count_kind(const cg_program *p, cg_kernel_kind k) {
  int n = 0;
  for (int i = 0; i < p->n_k; i++) n += p->k[i].kind == k;
  return n;
}

static int gelu_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *x = in[0];
  kiln_tensor *in3 = kiln_add(x, kiln_mul(kiln_scalar(KILN_F32, 0.044715), kiln_pow(x, kiln_scalar(KILN_F32, 3))));
  kiln_tensor *t = kiln_tanh(kiln_mul(kiln_scalar(KILN_F32, 0.7978845608), in3));
  out[0] = kiln_mul(kiln_mul(kiln_scalar(KILN_F32, 0.5), x), kiln_add(kiln_scalar(KILN_F32, 1), t));
  return 0;
}

static int softmax_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *e = kiln_exp(kiln_sub(in[0], kiln_max(in[0], -1, true)));
  out[0] = kiln_div(e, kiln_sum(e, -1, true));
  return 0;
}

static int layernorm_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_layer_norm(in[0], in[1], in[2], 1e-5);
  return 0;
}

static int matvec_relu_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_relu(kiln_add(kiln_matmul(in[0], kiln_transpose(in[1], 0, 1)), in[2]));
  return 0;
}

static int linear_relu_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_relu(kiln_add(kiln_matmul(in[0], in[1]), in[2]));
  return 0;
}

/* two layers: the relu between them can run in place over the first GEMM's buffer */
static int two_layer_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *h = kiln_relu(kiln_add(kiln_matmul(in[0], in[1]), in[2]));
  out[0] = kiln_matmul(h, kiln_transpose(in[1], 0, 1));
  return 0;
}

typedef int (*body_fn)(void *, kiln_tensor *const *, kiln_tensor **);

static kiln_fn *compile_once(body_fn body, int n_in, kiln_tensor *const *in) {
  kiln_options o = {.name = "plan", .n_in = n_in, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kcache_forget(); /* so that LLVM compiles, whatever ran before, and its phases are timed below */
  kiln_fn *fn = kiln_compile(body, NULL, &o);
  kiln_tensor *y = NULL, *ref = NULL;
  ck_assert_int_eq(0, kiln_call(fn, in, &y));
  ck_assert_int_eq(0, kiln_call(fn, in, &y)); /* compiled */
  ck_assert_int_eq(0, body(NULL, in, &ref));
  int64_t bad;
  ck_assert(same_shape(y, ref));
  double d = maxdiff_rel(y, ref, &bad);
  ck_assert_msg(d <= 1e-5, "max rel diff %g at %lld", d, (long long)bad);
  /* compile time splits into its phases */
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_double_gt(st.llvm_opt_ms, 0);
  ck_assert_double_gt(st.llvm_codegen_ms, 0);
  ck_assert_double_le(st.passes_ms + st.fuse_ms + st.llvm_opt_ms + st.llvm_codegen_ms, st.compile_ms + 1e-6);
  return fn;
}

/* Bytes of the arena p's plan takes (every shape constant). */
static size_t arena_of(const cg_program *p) {
  size_t bytes[64] = {0}, off[64];
  ck_assert_int_le(p->n_buf, 64);
  for (int b = 0; b < p->n_buf; b++) {
    if (p->buf[b].kind != CG_BUF_TEMP || p->buf[b].alias_of >= 0) continue; /* an alias takes its buffer's memory */
    bytes[b] = kiln_dtype_size(p->buf[b].dtype);
    for (int d = 0; d < p->buf[b].ndim; d++) bytes[b] *= (size_t)p->buf[b].shape[d].c;
  }
  return plan_arena(p, bytes, off);
}

/* A large product of small operands, made first and read last: u @ v is
 * (256,256), 256 KB, from a (256,4) and a (4,256); three GEMM layers over
 * x run before its one reader. */
static int late_product_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *big = kiln_matmul(in[0], in[1]);
  kiln_tensor *t = in[2];
  for (int i = 0; i < 3; i++) t = kiln_tanh(kiln_matmul(t, in[3]));
  out[0] = kiln_matmul(big, t);
  return 0;
}

/* The product runs just before its reader rather than first (sink_results):
 * it no longer shares the arena with the layers' temps. By hand, the
 * layers need two (256,128) temps at once (128 KB each) and the last GEMM
 * the product and one temp, so 384 KB; made first, the product would sit
 * beside the layers' two temps, 512 KB. The results are eager's to the bit:
 * every kernel computes what it did. */
START_TEST(test_large_result_made_late) {
  kiln_scope_begin();
  kiln_tensor *in[4] = {kiln_randn(KILN_F32, 2, ((int64_t[]){256, 4}), 1), kiln_randn(KILN_F32, 2, ((int64_t[]){4, 256}), 2),
                        kiln_randn(KILN_F32, 2, ((int64_t[]){256, 128}), 3),
                        kiln_mul(kiln_randn(KILN_F32, 2, ((int64_t[]){128, 128}), 4), kiln_scalar(KILN_F32, 0.1))};
  kiln_fn *fn = compile_once(late_product_body, 4, in);
  cg_program *p = plan_of(fn);
  size_t arena = arena_of(p);
  ck_assert_msg(arena <= 384 * 1024, "arena %zu bytes, by hand 384 KB", arena);
  ck_assert_int_eq(5, count_kind(p, CG_K_MATMUL));
  const cg_kernel *prod = NULL;
  int at = -1;
  for (int ki = 0; ki < p->n_k; ki++)
    if (p->k[ki].kind == CG_K_MATMUL && p->k[ki].in_buf[0] >= 0 && p->buf[p->k[ki].in_buf[0]].kind == CG_BUF_INPUT &&
        p->buf[p->k[ki].in_buf[0]].shape[1].c == 4)
      prod = &p->k[ki], at = ki;
  ck_assert_ptr_nonnull(prod);
  ck_assert_int_eq(p->n_k - 2, at); /* right before the last GEMM, its reader */
  free_plan(p);
  kiln_tensor *y = NULL, *ref = NULL;
  ck_assert_int_eq(0, kiln_call(fn, in, &y));
  ck_assert_int_eq(0, late_product_body(NULL, in, &ref));
  static float got[256 * 128], want[256 * 128];
  ck_assert_int_eq(0, kiln_read(y, got, sizeof got));
  ck_assert_int_eq(0, kiln_read(ref, want, sizeof want));
  ck_assert_mem_eq(got, want, sizeof got);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* The same, with a temp operand (tanh(u), 64 KB, which dies in the
 * product) and a second large result from small operands, e @ f, made
 * just before the one kernel that reads both. */
static int late_pair_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *big = kiln_matmul(kiln_tanh(in[0]), in[1]);
  kiln_tensor *t = in[2];
  for (int i = 0; i < 3; i++) t = kiln_tanh(kiln_matmul(t, in[3]));
  kiln_tensor *j = kiln_matmul(in[4], in[5]);
  out[0] = kiln_add(kiln_sum_all(kiln_mul(big, j)), kiln_sum_all(t));
  return 0;
}

/* The product also goes ahead of e @ f. The layers' sum is taken as the
 * last layer runs, so only the two results and tanh(u) matter: made after
 * e @ f, the product would have tanh(u) beside both 256 KB results, 576
 * KB; made before it, the peak is the two results, 512 KB (and the sum's
 * 64-byte slot). */
START_TEST(test_large_result_before_its_peer) {
  kiln_scope_begin();
  kiln_tensor *in[6] = {kiln_randn(KILN_F32, 2, ((int64_t[]){256, 64}), 1), kiln_randn(KILN_F32, 2, ((int64_t[]){64, 256}), 2),
                        kiln_randn(KILN_F32, 2, ((int64_t[]){256, 128}), 3),
                        kiln_mul(kiln_randn(KILN_F32, 2, ((int64_t[]){128, 128}), 4), kiln_scalar(KILN_F32, 0.1)),
                        kiln_randn(KILN_F32, 2, ((int64_t[]){256, 4}), 5), kiln_randn(KILN_F32, 2, ((int64_t[]){4, 256}), 6)};
  kiln_fn *fn = compile_once(late_pair_body, 6, in);
  cg_program *p = plan_of(fn);
  size_t arena = arena_of(p);
  ck_assert_msg(arena <= 512 * 1024 + 64, "arena %zu bytes, by hand 512 KB and a scalar", arena);
  free_plan(p);
  kiln_tensor *y = NULL, *ref = NULL;
  ck_assert_int_eq(0, kiln_call(fn, in, &y));
  ck_assert_int_eq(0, late_pair_body(NULL, in, &ref));
  /* a whole-tensor sum adds in fixed blocks compiled and in one eagerly,
   * so the last bit may differ (the previous test checks bits) */
  float got, want;
  ck_assert_int_eq(0, kiln_read(y, &got, sizeof got));
  ck_assert_int_eq(0, kiln_read(ref, &want, sizeof want));
  ck_assert_msg(fabsf(got - want) <= 1e-5f * fabsf(want), "%.9g compiled, %.9g eagerly", got, want);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

START_TEST(test_fusion_plans) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){33, 70}), 1);
  kiln_tensor *w = kiln_randn(KILN_F32, 1, ((int64_t[]){70}), 2), *b = kiln_randn(KILN_F32, 1, ((int64_t[]){70}), 3);
  kiln_tensor *m = kiln_randn(KILN_F32, 2, ((int64_t[]){70, 20}), 4), *c = kiln_randn(KILN_F32, 1, ((int64_t[]){20}), 5);

  kiln_fn *fn = compile_once(gelu_body, 1, &x);
  cg_program *p = plan_of(fn);
  ck_assert_int_eq(1, p->n_k); /* GELU: one loop */
  ck_assert_int_eq(CG_K_LOOP, p->k[0].kind);
  ck_assert_int_eq(p->k[0].ndim, p->k[0].n_outer); /* pointwise: no inner loop */
  free_plan(p);
  kiln_fn_free(fn);

  fn = compile_once(softmax_body, 1, &x);
  p = plan_of(fn);
  ck_assert_int_eq(1, p->n_k); /* softmax: one row kernel */
  int reduces = 0;
  for (int s = 0; s < p->k[0].n_stage; s++) reduces += p->k[0].stage[s].kind == CG_REDUCE;
  ck_assert_int_eq(2, reduces);
  free_plan(p);
  kiln_fn_free(fn);

  kiln_tensor *ln[3] = {x, w, b};
  fn = compile_once(layernorm_body, 3, ln);
  p = plan_of(fn);
  ck_assert_int_eq(1, p->n_k); /* layer norm: one row kernel */
  free_plan(p);
  kiln_fn_free(fn);

  kiln_tensor *lr[3] = {x, m, c};
  fn = compile_once(linear_relu_body, 3, lr);
  p = plan_of(fn);
  ck_assert_int_eq(2, p->n_k); /* a GEMM and one epilogue */
  ck_assert_int_eq(1, count_kind(p, CG_K_MATMUL));
  ck_assert_int_eq(CG_K_MATMUL, p->k[0].kind);
  ck_assert_int_eq(CG_K_LOOP, p->k[1].kind);
  free_plan(p);
  kiln_fn_free(fn);

  kiln_tensor *tl[3] = {x, kiln_randn(KILN_F32, 2, ((int64_t[]){70, 70}), 8), kiln_randn(KILN_F32, 1, ((int64_t[]){70}), 9)};
  fn = compile_once(two_layer_body, 3, tl);
  p = plan_of(fn);
  ck_assert_int_eq(3, p->n_k); /* GEMM, epilogue, GEMM */
  ck_assert_int_eq(CG_K_LOOP, p->k[1].kind);
  ck_assert_int_eq(p->k[0].out_buf, p->k[1].out_buf); /* the epilogue stores in place */
  free_plan(p);
  kiln_fn_free(fn);

  /* batch 1 (and up to 8 constant rows): the matmul is our own dot-product loop */
  kiln_tensor *row = kiln_randn(KILN_F32, 2, ((int64_t[]){1, 70}), 6);
  kiln_tensor *lr1[3] = {row, kiln_randn(KILN_F32, 2, ((int64_t[]){20, 70}), 7), c};
  fn = compile_once(matvec_relu_body, 3, lr1); /* x @ W^T, W (out,in): each dot product reads a row */
  p = plan_of(fn);
  ck_assert_int_eq(0, count_kind(p, CG_K_MATMUL));
  ck_assert_int_eq(1, p->n_k); /* the dot products, bias and relu behind them per output */
  ck_assert(strstr(p->k[0].name, "matvec") != NULL);
  free_plan(p);
  kiln_fn_free(fn);

  /* weights (in,out), one row: a column kernel (panels of outputs along K), bias and relu behind it */
  kiln_tensor *lr2[3] = {row, kiln_randn(KILN_F32, 2, ((int64_t[]){70, 20}), 7), c};
  fn = compile_once(linear_relu_body, 3, lr2);
  p = plan_of(fn);
  ck_assert_int_eq(0, count_kind(p, CG_K_MATMUL));
  ck_assert_int_eq(1, p->n_k);
  ck_assert(strstr(p->k[0].name, "matvec") != NULL);
  ck_assert(lower_is_column(&p->k[0]));
  free_plan(p);
  kiln_fn_free(fn);

  /* (in,out) with two rows: a dot-product loop would walk columns; the row-walking gemv runs instead */
  kiln_tensor *lr3[3] = {kiln_randn(KILN_F32, 2, ((int64_t[]){2, 70}), 6), lr2[1], c};
  fn = compile_once(linear_relu_body, 3, lr3);
  p = plan_of(fn);
  ck_assert_int_eq(1, count_kind(p, CG_K_MATMUL));
  ck_assert(strstr(p->k[0].name, "matvec") == NULL);
  free_plan(p);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* Outer dims that every access walks as one range merge into one loop dim;
 * a broadcast or a transposed read keeps the dims apart, and a dim of size
 * 1 goes. Each plan's result is checked against eager by compile_once. */
static int bias_add_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_add(in[0], in[1]);
  return 0;
}

static int transposed_add_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_add(kiln_transpose(in[0], 0, 1), in[1]);
  return 0;
}

static int row_sum_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_sum(kiln_exp(in[0]), -1, false);
  return 0;
}

static void same_at_1_and_2_threads(kiln_fn *fn, kiln_tensor *const *in);

/* The one loop kernel of fn's plan: its ndim and n_outer. */
static void loops_of(kiln_fn *fn, int *ndim, int *n_outer) {
  cg_program *p = plan_of(fn);
  ck_assert_int_eq(1, p->n_k);
  ck_assert_int_eq(CG_K_LOOP, p->k[0].kind);
  *ndim = p->k[0].ndim, *n_outer = p->k[0].n_outer;
  free_plan(p);
}

START_TEST(test_coalesced_loops) {
  kiln_scope_begin();
  int nd, no;
  kiln_tensor *x = kiln_randn(KILN_F32, 3, ((int64_t[]){4, 6, 8}), 1), *y = kiln_randn(KILN_F32, 3, ((int64_t[]){4, 6, 8}), 2);
  kiln_tensor *b = kiln_randn(KILN_F32, 1, ((int64_t[]){8}), 3), *t = kiln_randn(KILN_F32, 3, ((int64_t[]){6, 4, 8}), 4);
  kiln_tensor *one = kiln_randn(KILN_F32, 3, ((int64_t[]){1, 5, 8}), 5), *one_y = kiln_randn(KILN_F32, 3, ((int64_t[]){1, 5, 8}), 6);

  kiln_fn *fn = compile_once(bias_add_body, 2, (kiln_tensor *[]){x, y}); /* same shapes: one range */
  loops_of(fn, &nd, &no);
  ck_assert_int_eq(1, nd);
  kiln_fn_free(fn);
  fn = compile_once(bias_add_body, 2, (kiln_tensor *[]){x, b}); /* a bias along rows: rows, then the row */
  loops_of(fn, &nd, &no);
  ck_assert_int_eq(2, nd);
  kiln_fn_free(fn);
  fn = compile_once(transposed_add_body, 2, (kiln_tensor *[]){x, t}); /* a transposed read: nothing merges */
  loops_of(fn, &nd, &no);
  ck_assert_int_eq(3, nd);
  kiln_fn_free(fn);
  fn = compile_once(bias_add_body, 2, (kiln_tensor *[]){one, one_y}); /* the size-1 dim goes */
  loops_of(fn, &nd, &no);
  ck_assert_int_eq(1, nd);
  kiln_fn_free(fn);
  fn = compile_once(row_sum_body, 1, &x); /* [4,6 | 8] -> [24 | 8] */
  loops_of(fn, &nd, &no);
  ck_assert_int_eq(2, nd);
  ck_assert_int_eq(1, no);
  same_at_1_and_2_threads(fn, &x);
  kiln_fn_free(fn);
  /* a dynamic batch merges too (one loop of s0*48), and the one variant
   * serves other batches */
  kiln_options o = {.name = "dyn", .n_in = 2, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  fn = kiln_compile(bias_add_body, NULL, &o);
  ck_assert_int_eq(0, kiln_mark_dynamic(fn, 0, 0));
  ck_assert_int_eq(0, kiln_mark_dynamic(fn, 1, 0));
  for (int64_t batch = 4; batch <= 9; batch += 5) {
    kiln_tensor *in[2] = {kiln_randn(KILN_F32, 3, ((int64_t[]){batch, 6, 8}), 7),
                          kiln_randn(KILN_F32, 3, ((int64_t[]){batch, 6, 8}), 8)};
    kiln_tensor *got = NULL, *want = NULL;
    for (int call = 0; call < 2; call++) ck_assert_int_eq(0, kiln_call(fn, in, &got));
    ck_assert_int_eq(0, bias_add_body(NULL, in, &want));
    int64_t bad;
    ck_assert(same_shape(got, want));
    ck_assert_double_le(maxdiff_rel(got, want, &bad), 0);
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(1, st.variants);
  loops_of(fn, &nd, &no);
  ck_assert_int_eq(1, nd);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* ---- random programs (the generator: tests/fuzz/randprog.h) ---- */

/* How many calls each size of a random program gets (the later ones with
 * other data: a call after one of its shapes replays), and the replays
 * counted so far. */
static int program_reps = 1;
static long long program_replays;

static int run_program(uint64_t seed, int mode, int threads, bool cmode, char *why, size_t whyn) {
  prog pg;
  prog_init(&pg, seed);
  pg.mode = mode;
  pg.cmode = cmode;
  kiln_options o = {.name = "rand", .n_in = N_IN, .n_out = pg.n_out, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(random_body, &pg, &o);
  int C = pg.C;
  /* sizes of (B, T): 1, and sizes equal to C and to each other; the first call traces */
  int64_t sz2[5][2] = {{5, 1}, {C, 1}, {1, 1}, {16, 1}, {7, 1}};
  int64_t sz3[5][2] = {{3, 5}, {C, 2}, {1, C}, {5, 1}, {4, 4}};
  int64_t(*sz)[2] = pg.nd_x == 3 ? sz3 : sz2;
  kiln_dtype ft = pg.f64 ? KILN_F64 : KILN_F32;
  int rc = 0, bad_out = -1;
  int64_t bt[2] = {0, 0};
  kiln_set_num_threads(threads);
  for (int k = 0; k < 5 * program_reps && !rc; k++) {
    int i = (k / program_reps + pg.rot) % 5;
    int64_t b = sz[i][0], t = sz[i][1];
    bt[0] = b, bt[1] = t;
    kiln_scope_begin();
    uint64_t sd = seed * 16 + (uint64_t)i + 1000 * (uint64_t)(k % program_reps);
    kiln_tensor *in[N_IN];
    if (pg.nd_x == 2) {
      in[0] = kiln_randn(ft, 2, ((int64_t[]){b, C}), sd);
      in[2] = kiln_randn(ft, 2, ((int64_t[]){1, C}), seed + 101);
      in[3] = kiln_randn(ft, 2, ((int64_t[]){b, 1}), sd + 7);
    } else {
      in[0] = kiln_randn(ft, 3, ((int64_t[]){b, t, C}), sd);
      in[2] = kiln_randn(ft, 2, ((int64_t[]){t, C}), sd + 5);
      in[3] = kiln_randn(ft, 3, ((int64_t[]){b, 1, C}), sd + 7);
    }
    in[1] = kiln_randn(ft, 1, ((int64_t[]){C}), seed + 100);
    in[4] = kiln_randn(ft, 2, ((int64_t[]){8, C}), seed + 102);
    if (pg.grad)
      for (int j = 0; j < N_IN; j++) kiln_requires_grad(in[j], true);
    kiln_tensor *y[16] = {0}, *ref[16] = {0};
    pg.call_no = k;
    kiln_manual_seed(seed + (uint64_t)k); /* the same draws for both runs, new ones each call */
    int r2 = random_body(&pg, in, ref);
    kiln_manual_seed(seed + (uint64_t)k);
    if (r2) {
      snprintf(why, whyn, "B=%lld T=%lld: the program fails eagerly (a generator bug): %s", (long long)b, (long long)t,
               body_err);
      rc = -1;
    }
    int r1 = rc ? 0 : kiln_call(fn, in, y);
    if (!rc && r1) {
      snprintf(why, whyn, "B=%lld T=%lld: compiled call failed: %s", (long long)b, (long long)t, kiln_last_error());
      rc = -1;
    }
    for (int j = 0; j < pg.n_out && !rc; j++) {
      int64_t bad = -1;
      bool grad_out = j >= pg.n_val;
      double tol = pg.f64 ? (grad_out ? 1e-8 : 1e-9) : (grad_out ? 1e-4 : 2e-5);
      if (!same_shape(y[j], ref[j])) {
        char s1[128], s2[128];
        snprintf(why, whyn, "B=%lld T=%lld: output %d%s has shape %s, eager %s", (long long)b, (long long)t, j,
                 grad_out ? " (a gradient)" : "", kiln_describe(y[j], s1, sizeof s1), kiln_describe(ref[j], s2, sizeof s2));
        rc = -1, bad_out = j;
        break;
      }
      double dd = maxdiff_rel(y[j], ref[j], &bad);
      if (!(dd <= tol)) {
        snprintf(why, whyn, "B=%lld T=%lld: output %d%s: max rel diff %g (tolerance %g) at element %lld", (long long)b,
                 (long long)t, j, grad_out ? " (a gradient)" : "", dd, tol, (long long)bad);
        rc = -1, bad_out = j;
      }
    }
    kiln_scope_end();
  }
  (void)bad_out;
  if (rc) {
    int nv = 0;
    while (1) {
      char *t = kiln_fn_graph(fn, nv);
      if (!t) break;
      free(t), nv++;
    }
    char *text = nv ? kiln_fn_graph(fn, nv - 1) : NULL;
    fprintf(stderr,
            "random program seed %llu (mode %d) failed (threads %d, C=%d, x %s, %s%s, %d outputs, sizes from #%d): %s\n"
            "its graph (variant %d of %d):\n%s\n",
            (unsigned long long)seed, mode, threads, C, pg.nd_x == 3 ? "(B,T,C)" : "(B,C)", pg.f64 ? "f64" : "f32",
            pg.grad ? ", with grads" : "", pg.n_out, pg.rot, why, nv - 1, nv, text ? text : "(none)");
    free(text);
  }
  (void)bt;
  kiln_fn_stats st;
  if (kiln_fn_get_stats(fn, &st) == 0) program_replays += st.replays;
  kiln_fn_free(fn);
  kiln_set_num_threads(0);
  return rc;
}

/* Runs random program seed of mode (C mode if cmode); a failure counts in *failed (the first's seed in *first_bad). */
static void run_seed_in(uint64_t seed, int mode, bool cmode, int *failed, uint64_t *first_bad) {
  if (getenv("KILN_FUZZ_TRACE_SEEDS")) fprintf(stderr, "seed %llu\n", (unsigned long long)seed);
  char why[512];
  if (run_program(seed, mode, 1 + (int)(seed % 2), cmode, why, sizeof why)) {
    if (!*failed) *first_bad = seed;
    ++*failed;
  }
}
static void run_seed(uint64_t seed, int *failed, uint64_t *first_bad) { run_seed_in(seed, 0, false, failed, first_bad); }

START_TEST(test_random_programs) {
  const char *env = getenv("KILN_FUZZ_PROGRAMS");
  const char *first = getenv("KILN_FUZZ_FIRST"); /* the first seed (to rerun one: KILN_FUZZ_FIRST=seed KILN_FUZZ_PROGRAMS=1) */
  int n = env ? atoi(env) : 100;
  uint64_t base = first ? strtoull(first, NULL, 10) : 1000;
  /* seeds that found bugs, run every time: 7305 a traced size left unguarded,
   * 30706 an instcombine that ended the process (no fixpoint in one run) */
  static const uint64_t found[] = {7305, 30706};
  int n_found = (int)(sizeof found / sizeof found[0]);
  int failed = 0;
  uint64_t first_bad = 0;
  for (int i = 0; i < n + n_found; i++) run_seed(i < n ? base + (uint64_t)i : found[i - n], &failed, &first_bad);
  ck_assert_msg(failed == 0, "%d of %d random programs differ from eager; the first is seed %llu", failed, n + n_found,
                (unsigned long long)first_bad);
}
END_TEST

/* 100 seeds from 70000 (KILN_FUZZ_PROGRAMS, KILN_FUZZ_FIRST move them) of
 * the generator in mode, in C mode if cmode; every one must agree with eager. */
static void run_seeds(int mode, bool cmode, const char *what) {
  const char *env = getenv("KILN_FUZZ_PROGRAMS");
  const char *first = getenv("KILN_FUZZ_FIRST");
  int n = env ? atoi(env) : 100;
  uint64_t base = first ? strtoull(first, NULL, 10) : 70000;
  int failed = 0;
  uint64_t first_bad = 0;
  for (int i = 0; i < n; i++) run_seed_in(base + (uint64_t)i, mode, cmode, &failed, &first_bad);
  ck_assert_msg(failed == 0, "%d of %d random programs %s differ from eager; the first is seed %llu", failed, n, what,
                (unsigned long long)first_bad);
}

/* The generator in C mode: branches on sizes and on values read back, C
 * numbers that change between calls, numbers made from sizes, dropout. Every
 * compiled call must give the body's eager answer. */
START_TEST(test_random_programs_c) { run_seeds(0, true, "in C mode"); }
END_TEST

/* C mode and mode 1, each size called twice with other data, so that
 * calls replay the call before (replay.c) and part from it where the C
 * numbers change: every call must give the body's eager answer. */
START_TEST(test_random_programs_replayed) {
  program_reps = 2;
  program_replays = 0;
  run_seeds(0, true, "in C mode, each size twice");
  run_seeds(1, false, "of mode 1, each size twice");
  ck_assert_msg(program_replays > 0, "no call replayed");
  program_reps = 1;
}
END_TEST

/* Mode 1: programs that use the newer ops as well (clamp, silu, ..., topk,
 * split, group_norm). */
START_TEST(test_random_programs_more_ops) { run_seeds(1, false, "of mode 1"); }
END_TEST

/* Mode 2: the newer ops and control flow (scan, cond, while_loop), which a
 * compiled body records as regions (or, with grads, as before). */
START_TEST(test_random_programs_regions) { run_seeds(2, false, "of mode 2 (control flow)"); }
END_TEST

/* The same generator with every light kernel on the quick code generator
 * (KILN_QUICK=1), and so in vectors of lowering's own where it can, which
 * otherwise only compiles of many kernels use. KILN_FUZZ_FIRST moves its
 * seeds too. */
START_TEST(test_random_programs_quick) {
  const char *env = getenv("KILN_FUZZ_PROGRAMS");
  const char *first = getenv("KILN_FUZZ_FIRST");
  int n = env ? atoi(env) / 2 : 50;
  uint64_t base = first ? strtoull(first, NULL, 10) : 50000;
  ck_assert_int_eq(0, setenv("KILN_QUICK", "1", 1));
  int failed = 0;
  uint64_t first_bad = 0;
  for (int i = 0; i < n; i++) run_seed(base + (uint64_t)i, &failed, &first_bad);
  unsetenv("KILN_QUICK");
  ck_assert_msg(failed == 0, "%d of %d random programs (KILN_QUICK=1) differ from eager; the first is seed %llu", failed, n,
                (unsigned long long)first_bad);
}
END_TEST

static void host_handler(const char *reason) { fprintf(stderr, "host handler: %s\n", reason); }

/* Compiles a small graph in a child under a pipeline that names plain
 * instcombine, which ends the process on it (LLVM's fatal error), with the
 * host's own handler installed first when keep_host; returns what the
 * child wrote to stderr (to free) and whether it ended with an error. */
static char *fatal_child(bool keep_host, bool *failed) {
  int fd[2];
  ck_assert_int_eq(0, pipe(fd));
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    dup2(fd[1], 2);
    close(fd[0]);
    setenv("KILN_LLVM_PASSES", "function(instcombine,loop-vectorize,instcombine)", 1);
    if (keep_host) {
      setenv("KILN_LLVM_FATAL_HANDLER", "0", 1);
      LLVMInstallFatalErrorHandler(host_handler);
    }
    /* a kernel (from the random program of seed 30706) whose instcombine
     * does not settle in one round under this pipeline */
    kiln_fn *fn = kiln_load_string("graph fatal(%0: f32[12]) -> (%8)\n"
                                   "  %1: i64[] = argmax(%0) {axes=[0], keepdim=false}\n"
                                   "  %2: f32[] = cast(%1) {dtype=f32}\n"
                                   "  %3: f32[] = sub(%2, %2)\n"
                                   "  %4: f32[] = mul(%3, %3)\n"
                                   "  %5: f32[] = mean(%4) {axes=[], keepdim=false}\n"
                                   "  %6: f32[] = sub(%2, %5)\n"
                                   "  %7: f32[] = mean(%5) {axes=[], keepdim=false}\n"
                                   "  %8: f32[] = add(%6, %7)\n");
    kiln_tensor *x = kiln_randn(KILN_F32, 1, ((int64_t[]){12}), 1), *y = NULL;
    if (fn) kiln_call(fn, &x, &y);
    _exit(0);
  }
  close(fd[1]);
  char *text = calloc(1, 1 << 16);
  size_t n = 0;
  char rest[4096];
  for (ssize_t r; (r = n + 1 < (1 << 16) ? read(fd[0], text + n, (1 << 16) - 1 - n) : read(fd[0], rest, sizeof rest)) > 0;)
    if (n + 1 < (1 << 16)) n += (size_t)r; /* the rest is read to the end, so the child never blocks */
  close(fd[0]);
  int st;
  ck_assert_int_eq(pid, waitpid(pid, &st, 0));
  *failed = !WIFEXITED(st) || WEXITSTATUS(st) != 0;
  return text;
}

/* LLVM ends the process on a fatal error; kiln's handler names the graph
 * first, and KILN_LLVM_FATAL_HANDLER=0 leaves the host's handler alone. */
START_TEST(test_llvm_fatal_error) {
  bool failed;
  char *text = fatal_child(false, &failed);
  ck_assert_msg(failed, "the child did not fail:\n%s", text);
  ck_assert_msg(strstr(text, "kiln: LLVM failed fatally while compiling") && strstr(text, "KILN_BACKEND=interp"),
                "no kiln message:\n%s", text);
  free(text);
  text = fatal_child(true, &failed);
  ck_assert_msg(failed, "the child did not fail:\n%s", text);
  ck_assert_msg(strstr(text, "host handler: ") && !strstr(text, "kiln: LLVM failed fatally"),
                "the host's handler was replaced:\n%s", text);
  free(text);
}
END_TEST

/* compiled results are bitwise equal at 1 and 2 threads */
START_TEST(test_threads_bitwise) {
  body_fn bodies[] = {gelu_body, softmax_body, layernorm_body};
  for (int k = 0; k < 3; k++) {
    static float out[2][512 * 300];
    for (int t = 1; t <= 2; t++) {
      kiln_set_num_threads(t);
      kiln_scope_begin();
      kiln_tensor *in[3] = {kiln_randn(KILN_F32, 2, ((int64_t[]){512, 300}), 7), kiln_randn(KILN_F32, 1, ((int64_t[]){300}), 8),
                            kiln_randn(KILN_F32, 1, ((int64_t[]){300}), 9)};
      kiln_options o = {.name = "bits", .n_in = k == 2 ? 3 : 1, .n_out = 1, .backend = KILN_BACKEND_LLVM};
      kiln_fn *fn = kiln_compile(bodies[k], NULL, &o);
      kiln_tensor *y;
      ck_assert_int_eq(0, kiln_call(fn, in, &y));
      ck_assert_int_eq(0, kiln_call(fn, in, &y));
      ck_assert_int_eq(0, kiln_read(y, out[t - 1], sizeof out[0]));
      kiln_fn_free(fn);
      kiln_scope_end();
    }
    ck_assert_msg(!memcmp(out[0], out[1], sizeof out[0]), "body %d differs between 1 and 2 threads", k);
  }
  kiln_set_num_threads(0);
}
END_TEST

/* Batch-1 matvecs (x @ W^T: the jammed dot-product kernel) split over
 * threads at a finer grain than other kernels in runs that come back to
 * back (rt/loop.c; every run here, through runtime_set_hot_gap): 330 x 200
 * in one fixed share of rows a thread, 1030 x 600 (past RT_DOT_STATIC) in
 * blocks taken in turn; rows not a multiple of RT_JAM in both. At 2
 * threads each gives the 1-thread bits, and both eager's sums. */
static int64_t saved_gap;
static void hot_setup(void) { saved_gap = runtime_set_hot_gap(INT64_MAX); }
/* a checked teardown: it runs after a failed assertion too, also unforked (TSan's build) */
static void hot_teardown(void) {
  runtime_set_hot_gap(saved_gap);
  kiln_set_num_threads(0);
}

START_TEST(test_matvec_threads) {
  static const int64_t sizes[2][2] = {{330, 200}, {1030, 600}};
  ck_assert_int_lt(sizes[0][0] * sizes[0][1], RT_DOT_STATIC);
  ck_assert_int_gt(sizes[1][0] * sizes[1][1], RT_DOT_STATIC);
  for (int c = 0; c < 2; c++) {
    int64_t rows = sizes[c][0], cols = sizes[c][1];
    float *out[2] = {malloc(sizeof(float) * (size_t)rows), malloc(sizeof(float) * (size_t)rows)};
    kiln_scope_begin();
    kiln_tensor *in[3] = {kiln_randn(KILN_F32, 2, ((int64_t[]){1, cols}), 3),
                          kiln_randn(KILN_F32, 2, ((int64_t[]){rows, cols}), 4),
                          kiln_randn(KILN_F32, 1, ((int64_t[]){rows}), 5)};
    kiln_tensor *ref = NULL;
    ck_assert_int_eq(0, matvec_relu_body(NULL, in, &ref));
    for (int t = 1; t <= 2; t++) {
      kiln_set_num_threads(t);
      kiln_options o = {.name = "mv", .n_in = 3, .n_out = 1, .backend = KILN_BACKEND_LLVM};
      kiln_fn *fn = kiln_compile(matvec_relu_body, NULL, &o);
      kiln_tensor *y;
      ck_assert_int_eq(0, kiln_call(fn, in, &y));
      ck_assert_int_eq(0, kiln_call(fn, in, &y));
      /* the one kernel runs the dot-product schedule the finer grain is for */
      cg_program *p = plan_of(fn);
      ck_assert_int_eq(1, p->n_k);
      ck_assert_msg(lower_is_jammed(&p->k[0]), "%s is not jammed", p->k[0].name);
      free_plan(p);
      int64_t bad;
      ck_assert_msg(maxdiff_rel(y, ref, &bad) < 1e-5, "%lld x %lld, threads %d: element %lld", (long long)rows,
                    (long long)cols, t, (long long)bad);
      ck_assert_int_eq(0, kiln_read(y, out[t - 1], sizeof(float) * (size_t)rows));
      kiln_fn_free(fn);
    }
    kiln_set_num_threads(0);
    ck_assert_msg(!memcmp(out[0], out[1], sizeof(float) * (size_t)rows), "%lld x %lld differs between 1 and 2 threads",
                  (long long)rows, (long long)cols);
    kiln_scope_end();
    free(out[0]), free(out[1]);
  }
}
END_TEST

static int full_reduce_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_sum_all(kiln_mul(in[0], in[0]));
  out[1] = kiln_max_axes(kiln_exp(in[0]), ((int[]){0, 1}), 2, false);
  out[2] = kiln_mean_all(in[1]); /* f64 */
  return 0;
}

/* Reductions over every dim run in fixed blocks across threads: the same
 * bits at 1 and 2 threads, close to eager's. */
/* A .grad accumulated across calls: grad = old grad + x^T @ dy folds the add
 * into the GEMM (a prefill, then beta 1); the folded product's buffer must
 * not lend its (absent) memory to the sum. */
static int accum_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kiln_tensor *w = ctx;
  kiln_tensor *y = kiln_matmul(in[0], w);
  out[0] = kiln_mean_all(kiln_mul(y, y));
  return out[0] && kiln_backward(out[0]) == 0 ? 0 : -1;
}

START_TEST(test_grad_accumulates_into_gemm) {
  kiln_tensor *wa = kiln_keep(kiln_randn(KILN_F32, 2, ((int64_t[]){16, 8}), 40));
  kiln_tensor *wb = kiln_keep(kiln_randn(KILN_F32, 2, ((int64_t[]){16, 8}), 40));
  kiln_requires_grad(wa, true), kiln_requires_grad(wb, true);
  kiln_options o = {.name = "accum", .n_in = 1, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(accum_body, wa, &o);
  for (int i = 0; i < 4; i++) {
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){4, 16}), 50 + (uint64_t)i), *y = NULL, *ye = NULL;
    ck_assert_int_eq(0, kiln_call(fn, &x, &y));
    ck_assert_int_eq(0, accum_body(wb, &x, &ye));
    int64_t bad;
    ck_assert_double_le(maxdiff_rel(y, ye, &bad), 1e-5);
    ck_assert_msg(maxdiff_rel(kiln_grad(wa), kiln_grad(wb), &bad) <= 1e-5, "call %d: grads differ at %lld", i, (long long)bad);
    kiln_scope_end();
  }
  kiln_fn_free(fn);
  kiln_release(wa), kiln_release(wb);
}
END_TEST

/* A tied embedding trained by SGD: w's gradient is the head's (a GEMM's
 * product, read transposed) plus the embedding's rows, an index_add into
 * zeros. The accumulate pass adds the rows into the product's own buffer
 * (index_add_to), so the arena holds one (V, C) gradient, not two; the
 * weights stay eager's to the bit, repeated and absent indices included. */
/* Backward from loss, then w -= 0.5 * grad(w) and the grad dropped: a
 * training body's last lines. 0 or -1. */
static int sgd_step(kiln_tensor *loss, kiln_tensor *w) {
  if (!loss || kiln_backward(loss)) return -1;
  kiln_no_grad_begin();
  bool bad = !kiln_sub_(w, kiln_mul_scalar(kiln_grad(w), 0.5));
  kiln_no_grad_end();
  kiln_zero_grad(w);
  return bad ? -1 : 0;
}

enum { TV = 96, TC = 40, TN = 12 };
static int tied_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kiln_tensor *w = ctx;
  kiln_tensor *h = kiln_add(kiln_embedding(w, in[0]), in[1]);                   /* (TN, TC) */
  kiln_tensor *logits = kiln_matmul(h, kiln_transpose(w, 0, 1));                /* (TN, TV) */
  out[0] = kiln_mean_all(kiln_mul(logits, logits));
  return sgd_step(out[0], w);
}

/* The op itself against index_add into zeros and an add, to the bit:
 * repeated rows summed before they meet x, -0 in x made +0 where no row
 * lands (as x + 0 does), along dim 0 and 1, f32 and f64. */
START_TEST(test_index_add_to_bits) {
  for (int dt = 0; dt < 2; dt++)
    for (int dim = 0; dim < 2; dim++) {
      kiln_scope_begin();
      kiln_dtype t = dt ? KILN_F64 : KILN_F32;
      int64_t shape[2] = {9, 7}, sshape[2] = {9, 7};
      sshape[dim] = 6;
      kiln_tensor *x = kiln_contiguous(kiln_mul_scalar(kiln_randn(t, 2, shape, 3), 1e3));
      kiln_tensor *src = kiln_randn(t, 2, sshape, 4);
      for (int64_t i = 0; i < 9 * 7; i += 4) /* -0 on rows hit and missed */
        elem_store(t, tensor_data(x), i, -0.0);
      kiln_tensor *idx = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){6}), ((int64_t[]){2, 5, 2, 0, 2, 5}));
      op_attrs a = {.dim = dim};
      kiln_tensor *z = kiln_zeros(t, 2, shape);
      kiln_tensor *sum = op_dispatch(OP_INDEX_ADD_TO, (kiln_tensor *[]){x, idx, src}, 3, &a, __FILE__, __LINE__);
      kiln_tensor *rows = op_dispatch(OP_INDEX_ADD, (kiln_tensor *[]){z, idx, src}, 3, &a, __FILE__, __LINE__);
      kiln_tensor *ref = kiln_contiguous(kiln_add(x, rows));
      ck_assert_ptr_nonnull(sum);
      ck_assert_mem_eq(tensor_data(sum), tensor_data(ref), kiln_dtype_size(t) * 63);
      kiln_scope_end();
    }
}
END_TEST

START_TEST(test_tied_rows_added_in_place) {
  kiln_tensor *w[2];
  for (int k = 0; k < 2; k++) {
    kiln_scope_begin();
    w[k] = kiln_keep(kiln_mul_scalar(kiln_randn(KILN_F32, 2, ((int64_t[]){TV, TC}), 7), 0.3));
    kiln_scope_end();
    kiln_requires_grad(w[k], true);
  }
  /* rows 0..TV-1 of w start as -0 in one column: where no index lands, eager's x + 0 makes them +0 */
  float *wd = tensor_data(w[0]);
  for (int r = 0; r < TV; r++) wd[r * TC + 3] = -0.0f;
  memcpy(tensor_data(w[1]), wd, sizeof(float) * TV * TC);
  kiln_options o = {.name = "tied", .n_in = 2, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(tied_body, w[0], &o);
  for (int call = 0; call < 3; call++) {
    kiln_scope_begin();
    int64_t ix[TN];
    for (int i = 0; i < TN; i++) ix[i] = (i * 7 + call) % 5 * 11; /* rows 0, 11, .., 44, each several times */
    kiln_tensor *in[2] = {kiln_tensor_from(KILN_I64, 1, ((int64_t[]){TN}), ix),
                          kiln_randn(KILN_F32, 2, ((int64_t[]){TN, TC}), 30 + (uint64_t)call)};
    kiln_tensor *y = NULL, *ye = NULL;
    ck_assert_int_eq(0, kiln_call(fn, in, &y));
    ck_assert_int_eq(0, tied_body(w[1], in, &ye));
    ck_assert_mem_eq(tensor_data(w[0]), tensor_data(w[1]), sizeof(float) * TV * TC);
    kiln_scope_end();
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(0, st.fallbacks);
  ck_assert_int_ge(st.hits, 2);
  char *text = kiln_fn_graph(fn, 0);
  ck_assert_ptr_nonnull(text);
  ck_assert_msg(strstr(text, "index_add_to(") && strstr(text, "{dim=1}") && !strstr(text, "index_add("), "%s", text);
  free(text);
  /* one (TV, TC) gradient in the arena: the head's product, the rows added into it */
  cg_program *p = plan_of(fn);
  size_t arena = arena_of(p), grad = sizeof(float) * TV * TC;
  ck_assert_msg(arena < 2 * grad, "arena %zu bytes, a gradient %zu", arena, grad);
  free_plan(p);
  kiln_fn_free(fn);
  kiln_release(w[0]), kiln_release(w[1]);
}
END_TEST

/* A loss's exponentials take the logits' memory: cross_entropy's row
 * kernel reads the logits last where it stores exp(x - max), so the arena
 * holds one (N, C) buffer (the logits, then the exponentials, then the
 * logits' gradient). A hand-written log_softmax picked by a mask reads the
 * logits again after that store: there the logits keep their buffer, and
 * the result is still eager's (to rounding). */
enum { CN = 24, CC = 300, CK = 16 };
typedef struct ce_ctx {
  kiln_tensor *w;
  bool hand; /* the hand-written form */
} ce_ctx;
static int ce_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const ce_ctx *c = ctx;
  kiln_tensor *w = c->w, *logits = kiln_matmul(in[0], w);
  if (c->hand) {
    kiln_tensor *hot = kiln_cast(kiln_eq(kiln_unsqueeze(in[1], 1), kiln_arange(KILN_I64, 0, CC, 1)), KILN_F32);
    out[0] = kiln_neg(kiln_mean_all(kiln_sum(kiln_mul(kiln_log_softmax(logits, 1), hot), 1, false)));
  } else {
    out[0] = kiln_cross_entropy(logits, in[1]);
  }
  return sgd_step(out[0], w);
}

START_TEST(test_loss_exps_take_logits) {
  for (int hand = 0; hand < 2; hand++) {
    kiln_tensor *w[2];
    for (int k = 0; k < 2; k++) {
      kiln_scope_begin();
      w[k] = kiln_keep(kiln_randn(KILN_F32, 2, ((int64_t[]){CK, CC}), 5));
      kiln_scope_end();
      kiln_requires_grad(w[k], true);
    }
    ce_ctx c[2] = {{w[0], hand}, {w[1], hand}};
    kiln_options o = {.name = "ce", .n_in = 2, .n_out = 1, .backend = KILN_BACKEND_LLVM};
    kiln_fn *fn = kiln_compile(ce_body, &c[0], &o);
    for (int call = 0; call < 3; call++) {
      kiln_scope_begin();
      int64_t t[CN];
      for (int i = 0; i < CN; i++) t[i] = (i * 37 + call) % CC;
      kiln_tensor *in[2] = {kiln_randn(KILN_F32, 2, ((int64_t[]){CN, CK}), 60 + (uint64_t)call),
                            kiln_tensor_from(KILN_I64, 1, ((int64_t[]){CN}), t)};
      kiln_tensor *y = NULL, *ye = NULL;
      ck_assert_int_eq(0, kiln_call(fn, in, &y));
      ck_assert_int_eq(0, ce_body(&c[1], in, &ye));
      /* a row's sum of exponentials adds in another order compiled: ulps apart */
      int64_t bad;
      ck_assert_msg(maxdiff_rel(y, ye, &bad) <= 1e-6, "hand %d call %d: loss", hand, call);
      ck_assert_msg(maxdiff_rel(w[0], w[1], &bad) <= 1e-5, "hand %d call %d: weights differ at %lld", hand, call,
                    (long long)bad);
      kiln_scope_end();
    }
    kiln_fn_stats st;
    ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
    ck_assert_int_eq(0, st.fallbacks);
    cg_program *p = plan_of(fn);
    size_t arena = arena_of(p), rows = sizeof(float) * CN * CC;
    if (hand) ck_assert_msg(arena >= 2 * rows, "arena %zu bytes: the logits must outlive their exponentials", arena);
    else ck_assert_msg(arena < 2 * rows, "arena %zu bytes, a (N, C) buffer %zu", arena, rows);
    free_plan(p);
    kiln_fn_free(fn);
    kiln_release(w[0]), kiln_release(w[1]);
  }
}
END_TEST

/* A chain of residual adds read by two row reductions is stored once
 * instead of being recomputed (reading every addend) in each. */
static int residual_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *h = in[0];
  for (int i = 1; i < 5; i++) h = kiln_add(h, in[i]);
  out[0] = kiln_sum(h, -1, false);
  out[1] = kiln_max(h, -1, false);
  return 0;
}

/* x + y, reduced by *users (2 or 3) row reductions */
static int pair_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  int users = *(const int *)ctx;
  kiln_tensor *h = kiln_add(in[0], in[1]);
  out[0] = kiln_sum(h, -1, false);
  out[1] = kiln_max(h, -1, false);
  if (users > 2) out[2] = kiln_min(h, -1, false);
  return 0;
}

START_TEST(test_residual_chain_stored) {
  kiln_scope_begin();
  kiln_tensor *in[5];
  for (int i = 0; i < 5; i++) in[i] = kiln_randn(KILN_F32, 2, ((int64_t[]){64, 96}), 20 + (uint64_t)i);
  kiln_options o = {.name = "residual", .n_in = 5, .n_out = 2, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(residual_body, NULL, &o);
  kiln_tensor *y[2], *ref[2];
  ck_assert_int_eq(0, kiln_call(fn, in, y));
  ck_assert_int_eq(0, kiln_call(fn, in, y));
  ck_assert_int_eq(0, residual_body(NULL, in, ref));
  for (int i = 0; i < 2; i++) {
    int64_t bad;
    ck_assert_double_le(maxdiff_rel(y[i], ref[i], &bad), 1e-5);
  }
  cg_program *p = plan_of(fn);
  /* the chain in one pointwise kernel, then the two reductions reading it */
  ck_assert_int_eq(3, count_kind(p, CG_K_LOOP));
  free_plan(p);
  kiln_fn_free(fn);
  /* one add of two inputs: read by two reductions it is recomputed (4 reads
   * against 2 reads, a write and 2 reads stored); by three the memory
   * traffic is the same either way (6 reads), and it is stored, which
   * leaves smaller kernels to compile and more of them alike */
  for (int users = 2; users <= 3; users++) {
    o.n_out = users;
    fn = kiln_compile(pair_body, &users, &o);
    kiln_tensor *py[3], *pref[3];
    ck_assert_int_eq(0, kiln_call(fn, in, py));
    ck_assert_int_eq(0, kiln_call(fn, in, py));
    ck_assert_int_eq(0, pair_body(&users, in, pref));
    for (int i = 0; i < users; i++) {
      int64_t bad;
      ck_assert_double_le(maxdiff_rel(py[i], pref[i], &bad), 1e-5);
    }
    p = plan_of(fn);
    ck_assert_int_eq((users == 2 ? 2 : 4), count_kind(p, CG_K_LOOP));
    free_plan(p);
    kiln_fn_free(fn);
  }
  kiln_scope_end();
}
END_TEST

/* A chain of six steps, each stored, all joined by one cat: the cat's
 * fourth and later operands must stay alive until it runs, or the next
 * step's in-place store overwrites one (as an unrolled RNN's stacked
 * outputs showed). */
static int chain_cat_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *h = in[0], *parts[6];
  for (int t = 0; t < 6; t++) parts[t] = h = kiln_tanh(kiln_add(h, in[1]));
  out[0] = kiln_cat(parts, 6, 0);
  return out[0] ? 0 : -1;
}

START_TEST(test_cat_keeps_every_operand) {
  kiln_scope_begin();
  kiln_tensor *in[2] = {kiln_randn(KILN_F32, 1, ((int64_t[]){5}), 31), kiln_randn(KILN_F32, 1, ((int64_t[]){5}), 32)};
  kiln_fn *fn = kiln_compile(chain_cat_body, NULL,
                             &(kiln_options){.name = "chain_cat", .n_in = 2, .n_out = 1, .backend = KILN_BACKEND_LLVM});
  kiln_tensor *y[1], *ref[1];
  ck_assert_int_eq(0, kiln_call(fn, in, y));
  ck_assert_int_eq(0, chain_cat_body(NULL, in, ref));
  int64_t bad;
  double d = maxdiff_rel(y[0], ref[0], &bad);
  ck_assert_msg(d <= 1e-6, "max difference %g at %lld", d, (long long)bad);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* Kernels of the same code share one compiled function: two equal chains
 * over inputs of one shape compile once, and so does one over a contiguous
 * input of another length (its 1-D loop has no size in its code), or over
 * another range of one buffer; each still gives its own answer. */
static int twin_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  for (int i = 0; i < 3; i++)
    out[i] = kiln_tanh(kiln_add(kiln_mul(in[i], kiln_scalar(KILN_F32, 2)), kiln_scalar(KILN_F32, 1)));
  return 0;
}

/* The same chain over three column ranges of one input (the q, k and v of
 * a projection): they start at other offsets in one buffer. */
static int thirds_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  for (int i = 0; i < 3; i++)
    out[i] = kiln_tanh(kiln_mul(kiln_slice(in[0], 1, 24 * i, 24 * (i + 1), 1), kiln_scalar(KILN_F32, 2)));
  return 0;
}

/* What compiling fn's newest variant on LLVM dumps (KILN_DUMP_* flags in what). */
static char *dump_of(kiln_fn *fn, unsigned what) {
  cg_program *p = plan_of(fn);
  char err[256], *dump = NULL;
  size_t dn = 0;
  FILE *f = open_memstream(&dump, &dn);
  backend_exec *e = backend_llvm.compile(p->g, what, f, err, sizeof err);
  ck_assert_msg(e != NULL, "%s", err);
  backend_llvm.free(e);
  fclose(f);
  free_plan(p);
  return dump;
}

START_TEST(test_shared_kernels) {
  kiln_scope_begin();
  kiln_tensor *in[3] = {kiln_randn(KILN_F32, 2, ((int64_t[]){40, 33}), 1), kiln_randn(KILN_F32, 2, ((int64_t[]){40, 33}), 2),
                        kiln_randn(KILN_F32, 2, ((int64_t[]){5, 7}), 3)};
  kiln_options o = {.name = "twins", .n_in = 3, .n_out = 3, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(twin_body, NULL, &o);
  kiln_tensor *y[3], *ref[3];
  ck_assert_int_eq(0, kiln_call(fn, in, y));
  ck_assert_int_eq(0, kiln_call(fn, in, y));
  ck_assert_int_eq(0, twin_body(NULL, in, ref));
  for (int i = 0; i < 3; i++) {
    int64_t bad;
    ck_assert(same_shape(y[i], ref[i]));
    ck_assert_double_le(maxdiff_rel(y[i], ref[i], &bad), 1e-6);
  }
  cg_program *p = plan_of(fn);
  ck_assert_int_eq(3, count_kind(p, CG_K_LOOP));
  free_plan(p);
  char *dump = dump_of(fn, KILN_DUMP_KERNELS);
  ck_assert_msg(strstr(dump, "shared code: 2 of 3 loop kernels") != NULL, "%s", dump);
  free(dump);
  kiln_fn_free(fn);
  /* where a kernel starts in its buffer is in the pointer it is given, not its code */
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){40, 72}), 4);
  o.n_in = 1;
  fn = kiln_compile(thirds_body, NULL, &o);
  ck_assert_int_eq(0, kiln_call(fn, &x, y));
  ck_assert_int_eq(0, kiln_call(fn, &x, y));
  ck_assert_int_eq(0, thirds_body(NULL, &x, ref));
  for (int i = 0; i < 3; i++) {
    int64_t bad;
    ck_assert(same_shape(y[i], ref[i]));
    ck_assert_double_le(maxdiff_rel(y[i], ref[i], &bad), 1e-6);
  }
  dump = dump_of(fn, KILN_DUMP_KERNELS);
  ck_assert_msg(strstr(dump, "shared code: 2 of 3 loop kernels") != NULL, "%s", dump);
  free(dump);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* Kernels that differ only in an op's numbers (clamp's bounds, a slope)
 * run different code: the numbers are part of a kernel's signature. */
static int clamp_twins_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const double *b = ctx;
  out[0] = kiln_clamp(in[0], b[0], b[1]);
  out[1] = kiln_clamp(in[1], b[2], b[3]);
  out[2] = kiln_leaky_relu(in[2], b[4]);
  out[3] = kiln_leaky_relu(in[3], b[5]);
  return 0;
}

/* Each output of fn(in) against the body run eagerly, and on the interpreter. */
/* tol: the largest relative difference allowed (0: bit equal) */
static void three_ways(body_fn body, void *ctx, int n_in, int n_out, kiln_tensor *const *in, double tol) {
  kiln_tensor *y[8], *yi[8], *ref[8];
  kiln_options o = {.name = "three", .n_in = n_in, .n_out = n_out, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(body, ctx, &o);
  ck_assert_int_eq(0, kiln_call(fn, in, y));
  ck_assert_int_eq(0, kiln_call(fn, in, y)); /* compiled */
  o.backend = KILN_BACKEND_INTERP;
  kiln_fn *fi = kiln_compile(body, ctx, &o);
  ck_assert_int_eq(0, kiln_call(fi, in, yi));
  ck_assert_int_eq(0, kiln_call(fi, in, yi));
  ck_assert_int_eq(0, body(ctx, in, ref));
  for (int i = 0; i < n_out; i++) {
    int64_t bad;
    ck_assert(same_shape(y[i], ref[i]));
    double d = maxdiff_rel(y[i], ref[i], &bad), di = maxdiff_rel(yi[i], ref[i], &bad);
    ck_assert_msg(d <= tol && di <= tol, "output %d: compiled %g, interpreter %g from eager", i, d, di);
  }
  kiln_fn_free(fn);
  kiln_fn_free(fi);
}

START_TEST(test_op_numbers_in_signature) {
  kiln_scope_begin();
  kiln_tensor *in[4];
  for (int i = 0; i < 4; i++) in[i] = kiln_mul(kiln_randn(KILN_F32, 2, ((int64_t[]){16, 24}), 40 + i), kiln_scalar(KILN_F32, 2));
  double b[6] = {-0.5, 0.5, -0.1, 0.2, 0.3, 0.01};
  three_ways(clamp_twins_body, b, 4, 4, in, 0);
  kiln_options o = {.name = "twins", .n_in = 4, .n_out = 4, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(clamp_twins_body, b, &o);
  kiln_tensor *y[4];
  ck_assert_int_eq(0, kiln_call(fn, in, y));
  char *dump = dump_of(fn, KILN_DUMP_KERNELS);
  ck_assert_msg(strstr(dump, "shared code") == NULL, "%s", dump);
  free(dump);
  kiln_fn_free(fn);
  /* a second function, the same code but for the bounds (the kernel cache keys them too) */
  double b2[6] = {-1.5, 0.0, -0.1, 0.2, 0.3, 0.01};
  three_ways(clamp_twins_body, b2, 4, 4, in, 0);
  kiln_scope_end();
}
END_TEST

/* The newer pointwise ops, compiled, against eager and the interpreter, per dtype. */
static int new_pointwise_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *x = in[0], *i = in[1];
  out[0] = kiln_add(kiln_silu(x), kiln_softplus(kiln_mul_scalar(x, 12.0)));
  out[1] = kiln_mul(kiln_expm1(x), kiln_log1p(kiln_abs(x)));
  out[2] = kiln_add(kiln_add(kiln_floor(x), kiln_ceil(x)), kiln_add(kiln_round(kiln_mul_scalar(x, 2.0)), kiln_sign(x)));
  out[3] = kiln_add(kiln_clamp(i, -3, 2), kiln_sign(kiln_round(kiln_floor(kiln_ceil(i)))));
  out[4] = kiln_clamp(i, -2.5, 1.5); /* a fraction on i64: f32 */
  out[5] = kiln_div_scalar(kiln_sub_scalar(kiln_leaky_relu(x, 0.2), 1.0), 3.0);
  return 0;
}

START_TEST(test_new_pointwise_compiled) {
  kiln_scope_begin();
  for (int dt = 0; dt < 2; dt++) {
    kiln_dtype t = dt ? KILN_F64 : KILN_F32;
    /* halves for round's ties, and values beyond softplus's threshold */
    kiln_tensor *x = kiln_mul(kiln_round(kiln_mul(kiln_randn(t, 2, ((int64_t[]){9, 37}), 7), kiln_scalar(t, 6))),
                              kiln_scalar(t, 0.25));
    kiln_tensor *i = kiln_cast(kiln_mul(kiln_randn(KILN_F32, 1, ((int64_t[]){41}), 8), kiln_scalar(KILN_F32, 4)), KILN_I64);
    three_ways(new_pointwise_body, NULL, 2, 6, (kiln_tensor *[]){x, i}, 0);
  }
  kiln_scope_end();
}
END_TEST

/* The reductions and norms written with primitives, compiled: the sums may
 * run in another order, so to a relative 1e-5; indices exactly. */
static int norms_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *x = in[0], *w = in[1]; /* x (N, 6, L), w (6,) */
  out[0] = kiln_logsumexp(x, -1, false);
  out[1] = kiln_rms_norm(kiln_transpose(x, 1, 2), w, 1e-5);
  out[2] = kiln_group_norm(x, 3, w, w, 1e-5);
  out[3] = kiln_masked_fill(x, kiln_reshape(kiln_gt(w, kiln_scalar(KILN_F32, 0)), 2, (int64_t[]){6, 1}), 2.0);
  out[4] = kiln_add(kiln_cast(kiln_argmin(x, 1, false), KILN_F32), kiln_max_all(x));
  out[5] = kiln_min_all(x);
  return 0;
}

START_TEST(test_norms_compiled) {
  kiln_scope_begin();
  kiln_tensor *w = kiln_randn(KILN_F32, 1, ((int64_t[]){6}), 3);
  for (int l = 5; l <= 9; l += 4) {
    kiln_tensor *x = kiln_randn(KILN_F32, 3, ((int64_t[]){2, 6, l}), 4);
    three_ways(norms_body, NULL, 2, 6, (kiln_tensor *[]){x, w}, 1e-5);
  }
  kiln_scope_end();
}
END_TEST

/* Data movement as eager kernels in compiled code, next to fused ops. in:
 * x (B,N,N), a gather index (B,N,2), a scatter source (B,N,2), an
 * index_copy index (2,) and source (2,N,N). */
static int data_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *x = kiln_mul_scalar(in[0], 2.0);
  out[0] = kiln_exp(kiln_gather(x, 2, in[1]));
  out[1] = kiln_scatter_add(x, 2, in[1], in[2]);
  out[2] = kiln_index_copy(x, 0, in[3], in[4]);
  out[3] = kiln_add(kiln_tril(x, 0), kiln_mul_scalar(kiln_triu(x, 1), 3.0));
  out[4] = kiln_pad(x, 4, ((int64_t[]){1, 0, -1, 2}), 3.0);
  out[5] = kiln_cumsum(kiln_tanh(x), 1);
  return 0;
}

/* Inputs of data_body at size n (b = 2). */
static void data_inputs(int64_t n, kiln_tensor **in) {
  in[0] = kiln_randn(KILN_F32, 3, ((int64_t[]){2, n, n}), (uint64_t)n);
  in[1] = kiln_cast(kiln_mul_scalar(kiln_rand(KILN_F32, 3, ((int64_t[]){2, n, 2}), 5), (double)n - 0.01), KILN_I64);
  in[2] = kiln_randn(KILN_F32, 3, ((int64_t[]){2, n, 2}), 6);
  in[3] = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){2}), ((int64_t[]){1, 1}));
  in[4] = kiln_randn(KILN_F32, 3, ((int64_t[]){2, n, n}), 7);
}

START_TEST(test_data_movement_compiled) {
  kiln_scope_begin();
  kiln_tensor *in[5];
  data_inputs(5, in);
  three_ways(data_body, NULL, 5, 6, in, 0);
  /* one function at several sizes: the dims become symbols, each call matches eager */
  kiln_options o = {.name = "data", .n_in = 5, .n_out = 6, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(data_body, NULL, &o);
  for (int64_t n = 3; n <= 7; n++) {
    data_inputs(n, in);
    kiln_tensor *y[6], *ref[6];
    ck_assert_int_eq(0, kiln_call(fn, in, y));
    ck_assert_int_eq(0, data_body(NULL, in, ref));
    for (int i = 0; i < 6; i++) {
      int64_t bad;
      ck_assert(same_shape(y[i], ref[i]));
      ck_assert_msg(maxdiff_rel(y[i], ref[i], &bad) == 0, "n %d output %d differs at %lld", (int)n, i, (long long)bad);
    }
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_le(st.variants, 3); /* the sizes after the second share a symbolic variant */
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* index_copy_ into an input, compiled: written back to the caller's tensor. */
static int index_copy_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  if (!kiln_index_copy_(in[0], 1, in[1], kiln_mul_scalar(in[2], 2.0))) return -1;
  out[0] = kiln_sum_all(in[0]);
  return 0;
}

START_TEST(test_index_copy_inplace_compiled) {
  kiln_scope_begin();
  kiln_options o = {.name = "index_copy_", .n_in = 3, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(index_copy_body, NULL, &o);
  for (int call = 0; call < 3; call++) {
    kiln_tensor *idx = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){3}), ((int64_t[]){call, 4, call}));
    kiln_tensor *src = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 3}), (uint64_t)call + 1);
    kiln_tensor *a = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 5}), 9), *b = kiln_contiguous(kiln_add_scalar(a, 0.0));
    kiln_tensor *y, *ref;
    ck_assert_int_eq(0, kiln_call(fn, (kiln_tensor *[]){a, idx, src}, &y));
    ck_assert_int_eq(0, index_copy_body(NULL, (kiln_tensor *[]){b, idx, src}, &ref));
    int64_t bad;
    ck_assert_msg(maxdiff_rel(a, b, &bad) == 0, "call %d: the written input differs at %lld", call, (long long)bad);
    ck_assert_double_le(maxdiff_rel(y, ref, &bad), 1e-6);
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(0, st.fallbacks);
  ck_assert_int_ge(st.hits, 1);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* body (one input (3,n), n_out outputs) compiled and called at n = 4..8
 * twice over: every output as eager's, bit for bit, and compiled every time
 * (a number is a constant of its kernel: a new one compiles a variant), never
 * eager. */
static void sizes_as_eager(body_fn body, int n_out) {
  kiln_options o = {.name = "sizes", .n_in = 1, .n_out = n_out, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(body, NULL, &o);
  for (int rep = 0; rep < 2; rep++)
    for (int64_t n = 4; n <= 8; n++) {
      kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){3, n}), (uint64_t)n), *y[4], *ref[4];
      ck_assert_int_eq(0, kiln_call(fn, &x, y));
      ck_assert_int_eq(0, body(NULL, &x, ref));
      for (int i = 0; i < n_out; i++) {
        int64_t bad;
        ck_assert_msg(same_shape(y[i], ref[i]), "n %d output %d: shape", (int)n, i);
        ck_assert_msg(maxdiff_rel(y[i], ref[i], &bad) == 0, "n %d output %d differs at %lld", (int)n, i, (long long)bad);
      }
    }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(0, st.fallbacks);
  ck_assert_int_eq(st.calls, st.hits + st.traces);
  kiln_fn_free(fn);
}

/* topk, one_hot, repeat and split compiled; topk's k from a size the body read. */
static int select_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *x = in[0], *v, *i;
  if (kiln_topk(kiln_tanh(x), kiln_size(x, 1) / 2, 1, true, &v, &i)) return -1;
  out[0] = kiln_mul_scalar(v, 3.0);
  out[1] = kiln_one_hot(i, kiln_size(x, 1));
  out[2] = kiln_exp(kiln_repeat(x, 3, ((int64_t[]){2, 1, 2})));
  return 0;
}

START_TEST(test_select_compiled) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){3, 6}), 1);
  three_ways(select_body, NULL, 1, 3, &x, 0);
  sizes_as_eager(select_body, 3);
  kiln_scope_end();
}
END_TEST

/* The piece count of a split follows the size of every call: a traced body
 * that loops over the pieces is never replayed with another call's count. */
static int split_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *p[8];
  int n = kiln_split_n(in[0], 2, 0, p, 8);
  if (n < 0) return -1;
  /* the sum of the pieces' squared sums: it depends on where the pieces end
   * (no C numbers here, which would make the call record on their own) */
  kiln_tensor *s = kiln_sum_all(p[0]), *acc = kiln_mul(s, s);
  for (int i = 1; i < n; i++) {
    s = kiln_sum_all(p[i]);
    acc = kiln_add(acc, kiln_mul(s, s));
  }
  out[0] = acc;
  out[1] = kiln_cat(p, n, 0); /* the pieces back together */
  return 0;
}

START_TEST(test_split_dynamic) {
  kiln_scope_begin();
  kiln_options o = {.name = "split", .n_in = 1, .n_out = 2, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(split_body, NULL, &o);
  static const int64_t sizes[] = {4, 5, 6, 7, 8, 5, 4, 9, 6};
  for (int k = 0; k < (int)(sizeof sizes / sizeof *sizes); k++) {
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){sizes[k], 3}), (uint64_t)k + 1), *y[2], *ref[2];
    ck_assert_int_eq(0, kiln_call(fn, &x, y));
    ck_assert_int_eq(0, split_body(NULL, &x, ref));
    for (int i = 0; i < 2; i++) {
      int64_t bad;
      ck_assert_msg(same_shape(y[i], ref[i]), "size %d output %d: shape", (int)sizes[k], i);
      ck_assert_msg(maxdiff_rel(y[i], ref[i], &bad) <= 1e-6, "size %d output %d differs", (int)sizes[k], i);
    }
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(0, st.fallbacks);
  ck_assert_int_ge(st.hits, 1); /* 5, 4 and 6 again: compiled code */
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* Integer attributes computed from a size the body read: each call's own
 * numbers, never the first trace's. */
static int sized_attrs_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *x = in[0];
  int64_t n = kiln_size(x, 1);
  out[0] = kiln_tril(x, n - 4);
  out[1] = kiln_pad(x, 2, ((int64_t[]){n / 2, 1}), 0.0);
  return 0;
}

START_TEST(test_attrs_from_sizes) {
  kiln_scope_begin();
  sizes_as_eager(sized_attrs_body, 2);
  kiln_scope_end();
}
END_TEST

/* The optimized LLVM module of fn's newest variant. */
static char *llvm_dump_of(kiln_fn *fn) {
  char *dump = dump_of(fn, KILN_DUMP_LLVM);
  ck_assert_msg(strstr(dump, "define ") != NULL, "no kernel in the LLVM dump:\n%.500s", dump); /* not vacuous */
  return dump;
}

/* A row sum over short known rows runs four rows per pass, each with one
 * vector of partial sums, and the rows left over (at most three a call)
 * one at a time with one vector too, not the vectorizer's four: less code
 * to compile for a loop that runs little. A sum of a costly term runs one
 * row at a time. The accumulators are the loop phis that start from a
 * constant vector. */
static int plain_row_sum_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_sum(in[0], -1, false);
  return 0;
}

/* The loop phis of fn's LLVM code that start from a constant vector. */
static int vector_accumulators(kiln_fn *fn) {
  char *dump = llvm_dump_of(fn);
  int chains = 0;
  for (const char *l = dump; (l = strstr(l, "= phi <")) != NULL; l++) {
    const char *eol = strchr(l, '\n');
    const char *init = strstr(l, "[ <");
    chains += init && (!eol || init < eol);
  }
  free(dump);
  return chains;
}

START_TEST(test_short_rows_one_chain_each) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){7, 256}), 3);
  kiln_fn *fn = compile_once(plain_row_sum_body, 1, &x);
  int chains = vector_accumulators(fn);
  ck_assert_msg(chains == CG_JAM + 1, "%d vector accumulators, want %d", chains, CG_JAM + 1);
  same_at_1_and_2_threads(fn, &x);
  kiln_fn_free(fn);
  /* a row count that is a multiple of the group: no rows are left over in
   * any call, at one thread or in the blocks of two (2048 rows of 256 split
   * into blocks), and the loop for the rest is not made */
  kiln_tensor *whole = kiln_randn(KILN_F32, 2, ((int64_t[]){2048, 256}), 4);
  fn = compile_once(plain_row_sum_body, 1, &whole);
  chains = vector_accumulators(fn);
  ck_assert_msg(chains == CG_JAM, "%d vector accumulators, want %d", chains, CG_JAM);
  same_at_1_and_2_threads(fn, &whole);
  kiln_fn_free(fn);
  /* a sum of exp(x) is not grouped: one row loop, with the vectorizer's
   * own chains, not a group's four and the rest's one */
  fn = compile_once(row_sum_body, 1, &x);
  chains = vector_accumulators(fn);
  ck_assert_msg(chains >= 1 && chains <= CG_JAM, "%d vector accumulators for a sum of exp", chains);
  same_at_1_and_2_threads(fn, &x);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* A compile of many distinct kernels gives the light ones (cheap arithmetic
 * per element) LLVM's quick code generator: twenty row sums of x + i (the
 * constant makes each its own code), a sum of products and the add of
 * their results are light; a sum of exp is not. */
enum { N_LIGHT_SUMS = 20 };
static kiln_tensor *light_sums(kiln_tensor *x) {
  kiln_tensor *acc = kiln_sum(kiln_sub(x, kiln_scalar(KILN_F32, 0.5)), -1, true);
  for (int i = 0; i < N_LIGHT_SUMS; i++) acc = kiln_add(acc, kiln_sum(kiln_add(x, kiln_scalar(KILN_F32, i + 1)), -1, true));
  return acc;
}

static int light_sums_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = light_sums(in[0]);
  return 0;
}

static int scalar_exp_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_exp(in[0]);
  return 0;
}

static int many_sums_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *x = in[0];
  out[0] = kiln_add(light_sums(x), kiln_add(kiln_sum(kiln_exp(x), -1, true), kiln_sum(kiln_mul(x, x), -1, true)));
  return 0;
}

/* The kernels of an LLVM dump whose attributes hold optnone (the quick code generator's mark). */
static int optnone_kernels(const char *dump) {
  int n = 0;
  for (const char *l = dump; (l = strstr(l, "\ndefine ")) != NULL; l++) {
    const char *eol = strchr(l + 1, '\n'), *hash = strstr(l, ") #");
    if (!eol || !hash || hash > eol) continue;
    char want[32];
    snprintf(want, sizeof want, "\nattributes #%d = {", atoi(hash + 3));
    const char *attrs = strstr(dump, want);
    ck_assert_msg(attrs != NULL, "no %s in the dump", want + 1);
    const char *end = strchr(attrs + 1, '\n');
    const char *on = strstr(attrs, "optnone");
    n += on && (!end || on < end);
  }
  return n;
}

/* fn's output for in, made by a fresh compile under KILN_QUICK=mode. */
static kiln_tensor *run_with_quick(body_fn body, kiln_tensor *x, const char *mode) {
  ck_assert_int_eq(0, setenv("KILN_QUICK", mode, 1));
  kiln_fn *fn = compile_once(body, 1, &x);
  kiln_tensor *y = NULL;
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  kiln_fn_free(fn);
  unsetenv("KILN_QUICK");
  return y;
}

START_TEST(test_quick_codegen) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){37, 45}), 11);
  unsetenv("KILN_QUICK");
  kiln_fn *fn = compile_once(many_sums_body, 1, &x); /* against eager */
  char *dump = dump_of(fn, KILN_DUMP_KERNELS | KILN_DUMP_LLVM);
  char want[128];
  /* the 21 sums and the sum of products are light, the add of the row sums
   * runs in the kernel of the last of them (merge_rows); the sum of exp is not */
  snprintf(want, sizeof want, "quick code generator: %d of %d distinct kernels", N_LIGHT_SUMS + 2, N_LIGHT_SUMS + 3);
  ck_assert_msg(strstr(dump, want) != NULL, "no \"%s\" in\n%.3000s", want, dump);
  ck_assert_int_eq(N_LIGHT_SUMS + 2, optnone_kernels(dump));
  ck_assert_msg(strstr(dump, "optnone in one module with the others") != NULL, "%.3000s", dump);
  free(dump);
  /* without an LLVM dump the light kernels get modules of their own, made at level None */
  dump = dump_of(fn, KILN_DUMP_KERNELS);
  ck_assert_msg(strstr(dump, "in modules of their own at level None") != NULL, "%.3000s", dump);
  free(dump);
  same_at_1_and_2_threads(fn, &x);
  kiln_fn_free(fn);

  /* KILN_QUICK=0: none */
  ck_assert_int_eq(0, setenv("KILN_QUICK", "0", 1));
  fn = compile_once(many_sums_body, 1, &x);
  dump = dump_of(fn, KILN_DUMP_KERNELS | KILN_DUMP_LLVM);
  ck_assert_msg(strstr(dump, "quick code generator") == NULL, "%.2000s", dump);
  ck_assert_int_eq(0, optnone_kernels(dump));
  free(dump);
  kiln_fn_free(fn);
  unsetenv("KILN_QUICK");

  /* a compile of one kernel keeps the full code generator, unless KILN_QUICK=1 */
  fn = compile_once(plain_row_sum_body, 1, &x);
  dump = dump_of(fn, KILN_DUMP_LLVM);
  ck_assert_int_eq(0, optnone_kernels(dump));
  free(dump);
  kiln_fn_free(fn);
  ck_assert_int_eq(0, setenv("KILN_QUICK", "1", 1));
  fn = compile_once(plain_row_sum_body, 1, &x);
  dump = dump_of(fn, KILN_DUMP_LLVM);
  ck_assert_int_eq(1, optnone_kernels(dump));
  free(dump);
  kiln_fn_free(fn);
  /* a kernel of one element is light whatever it computes: it has no loop to make fast */
  kiln_tensor *s = kiln_scalar(KILN_F32, 0.75);
  fn = compile_once(scalar_exp_body, 1, &s);
  dump = dump_of(fn, KILN_DUMP_KERNELS);
  ck_assert_msg(strstr(dump, "quick code generator: 1 of 1 distinct kernels") != NULL, "%.2000s", dump);
  free(dump);
  kiln_fn_free(fn);
  unsetenv("KILN_QUICK");

  /* light code without products gives the same bits from either code
   * generator: the quick one's own vectors keep the partial sums LLVM's
   * vectorizer keeps, at the 16 lanes both take with AVX-512 (elsewhere
   * the vectorizer may choose another width: a few ulp); a sum of
   * products rounds each product once (an FMA) in the full one and twice
   * in the quick one, as eager does */
  double same = __builtin_cpu_supports("avx512f") ? 0 : 1e-6;
  kiln_tensor *full = run_with_quick(light_sums_body, x, "0"), *quick = run_with_quick(light_sums_body, x, "1");
  int64_t bad;
  ck_assert_double_le(maxdiff_rel(full, quick, &bad), same);
  full = run_with_quick(plain_row_sum_body, x, "0"), quick = run_with_quick(plain_row_sum_body, x, "1");
  ck_assert_double_le(maxdiff_rel(full, quick, &bad), same);
  full = run_with_quick(many_sums_body, x, "0"), quick = run_with_quick(many_sums_body, x, "1");
  ck_assert_double_le(maxdiff_rel(full, quick, &bad), 1e-6);
  kiln_scope_end();
}
END_TEST

/* A row of a length the kernel does not know (here the softmax of a growing
 * sequence) is vectorized with a masked tail, or rows shorter than the
 * vectorizer's step would run scalar; known rows of whole vectors are not
 * masked. Results match eager at lengths on both sides of the vector steps.
 * KILN_PERF_MAP=1 names the kernels for perf. */
START_TEST(test_masked_tails) {
  kiln_scope_begin();
  ck_assert_int_eq(0, setenv("KILN_PERF_MAP", "1", 1));
  kiln_options o = {.name = "rows", .n_in = 1, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(softmax_body, NULL, &o);
  ck_assert_int_eq(0, kiln_mark_dynamic(fn, 0, 1));
  const int64_t len[] = {37, 5, 16, 64, 65, 1, 100};
  for (int i = 0; i < 7; i++) {
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){3, len[i]}), (uint64_t)i + 1), *y = NULL, *ref = NULL;
    ck_assert_int_eq(0, kiln_call(fn, &x, &y));
    ck_assert_int_eq(0, softmax_body(NULL, &x, &ref));
    int64_t bad;
    ck_assert(same_shape(y, ref));
    double d = maxdiff_rel(y, ref, &bad);
    ck_assert_msg(d <= 1e-6, "row length %lld: max rel diff %g at %lld", (long long)len[i], d, (long long)bad);
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(1, st.variants);
  unsetenv("KILN_PERF_MAP");
  char path[64], line[256];
  snprintf(path, sizeof path, "/tmp/perf-%ld.map", (long)getpid());
  FILE *m = fopen(path, "r");
  ck_assert_msg(m != NULL, "KILN_PERF_MAP=1 wrote no %s", path);
  bool named = false;
  while (fgets(line, sizeof line, m)) named |= strstr(line, "_row") != NULL;
  fclose(m);
  remove(path);
  ck_assert_msg(named, "no row kernel in %s", path);

  char *dump = llvm_dump_of(fn);
  ck_assert_msg(strstr(dump, "llvm.masked.load") != NULL, "no masked tail for a symbolic row:\n%.1500s", dump);
  free(dump);
  kiln_fn_free(fn);

  /* rows of 1024: whole vectors, no masks */
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){4, 1024}), 9);
  fn = compile_once(softmax_body, 1, &x);
  dump = llvm_dump_of(fn);
  ck_assert_msg(strstr(dump, "llvm.masked") == NULL, "rows of 1024 masked:\n%.1500s", strstr(dump, "llvm.masked"));
  free(dump);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* ---- own vectors: light kernels' loops as vectors lowering emits ---- */

/* Row statistics then a map over the rows: a mean and a max per row, and
 * the rows less both, where > 0, else halved. */
static int own_rows_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *x = in[0], *c = kiln_sub(x, kiln_add(kiln_mean(x, -1, true), kiln_max(x, -1, true)));
  out[0] = kiln_where(kiln_gt(c, kiln_scalar(KILN_F32, 0)), c, kiln_mul(c, kiln_scalar(KILN_F32, 0.5)));
  return out[0] ? 0 : -1;
}

/* A bias gradient: column sums of (R, C). */
static int own_columns_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_sum(kiln_mul(in[0], kiln_scalar(KILN_F32, 3)), 0, false);
  return out[0] ? 0 : -1;
}

/* A flat update with a broadcast per row (x[:, :1] along the last dim). */
static int own_flat_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *x = in[0], *first = kiln_slice(x, 1, 0, 1, 1);
  out[0] = kiln_add(kiln_mul(x, kiln_scalar(KILN_F32, 0.25)), first);
  return out[0] ? 0 : -1;
}

/* Occurrences of needle in hay. */
static int count_of(const char *hay, const char *needle) {
  int n = 0;
  for (const char *q = hay; (q = strstr(q, needle)) != NULL; q++) n++;
  return n;
}

/* Under the quick code generator (KILN_QUICK=1), a light kernel's loops
 * are vectors of lowering's own, marked so that LLVM's vectorizer leaves
 * them: its blocks (vector.body) are not in the code, while with
 * KILN_VECTORIZE=llvm they are. Rows of 45 and 37 columns end in a masked
 * vector. Results: equal to eager within a few ulp (bitwise for the
 * pointwise map and for the column sums, which add in eager's order), to
 * LLVM's vectorizer's code likewise, and bitwise the same at 1 and 2
 * threads. */
START_TEST(test_own_vectors) {
  kiln_scope_begin();
  /* negative rows: a max that took the masked tail's missing lanes as zeros would show */
  kiln_tensor *rows = kiln_sub(kiln_randn(KILN_F32, 2, ((int64_t[]){37, 45}), 61), kiln_scalar(KILN_F32, 6));
  kiln_tensor *cols = kiln_randn(KILN_F32, 2, ((int64_t[]){300, 37}), 62);
  kiln_tensor *flat = kiln_randn(KILN_F32, 2, ((int64_t[]){301, 77}), 63);
  struct {
    body_fn body;
    kiln_tensor *x;
    double tol;
    const char *name;
  } cases[] = {{own_rows_body, rows, 1e-6, "rows"}, {own_columns_body, cols, 0, "columns"}, {own_flat_body, flat, 0, "flat"}};
  for (int c = 0; c < 3; c++) {
    kiln_tensor *ref = NULL, *got[2];
    ck_assert_int_eq(0, cases[c].body(NULL, &cases[c].x, &ref));
    for (int mode = 0; mode < 2; mode++) { /* own vectors, then LLVM's vectorizer */
      ck_assert_int_eq(0, setenv("KILN_QUICK", "1", 1));
      if (mode) ck_assert_int_eq(0, setenv("KILN_VECTORIZE", "llvm", 1));
      kiln_fn *fn = compile_once(cases[c].body, 1, &cases[c].x);
      ck_assert_int_eq(0, kiln_call(fn, &cases[c].x, &got[mode]));
      int64_t bad;
      double d = maxdiff_rel(got[mode], ref, &bad);
      ck_assert_msg(d <= cases[c].tol || mode, "%s: %g from eager at %lld", cases[c].name, d, (long long)bad);
      same_at_1_and_2_threads(fn, &cases[c].x);
      char *dump = llvm_dump_of(fn);
      if (!mode) {
        ck_assert_msg(count_of(dump, "llvm.loop.isvectorized") > 0, "%s: no loop of its own vectors:\n%.3000s", cases[c].name, dump);
        ck_assert_msg(count_of(dump, "vector.body") == 0, "%s: LLVM vectorized:\n%.3000s", cases[c].name, dump);
        ck_assert_msg(c == 2 || count_of(dump, "llvm.masked.") > 0, "%s: no masked tail:\n%.3000s", cases[c].name, dump);
      } else {
        ck_assert_msg(count_of(dump, "vector.body") > 0, "%s: KILN_VECTORIZE=llvm did not vectorize:\n%.3000s", cases[c].name,
                      dump);
      }
      free(dump);
      kiln_fn_free(fn);
      unsetenv("KILN_VECTORIZE");
      unsetenv("KILN_QUICK");
    }
    int64_t bad;
    double d = maxdiff_rel(got[0], got[1], &bad);
    ck_assert_msg(d <= cases[c].tol, "%s: own vectors and LLVM's differ by %g at %lld", cases[c].name, d, (long long)bad);
  }
  kiln_set_num_threads(0);
  kiln_scope_end();
}
END_TEST

static int mean_scale_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_tanh(kiln_mul(kiln_sum(kiln_mul(in[0], in[0]), 1, false), in[1]));
  return 0;
}

static void same_at_1_and_2_threads(kiln_fn *fn, kiln_tensor *const *in) {
  kiln_tensor *y1 = NULL, *y2 = NULL;
  kiln_set_num_threads(1);
  ck_assert_int_eq(0, kiln_call(fn, in, &y1));
  kiln_set_num_threads(2);
  ck_assert_int_eq(0, kiln_call(fn, in, &y2));
  int64_t bad;
  ck_assert_double_eq(0, maxdiff_rel(y1, y2, &bad));
}

static int empty_gemm_sum_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_sum(kiln_matmul(in[0], in[1]), 0, false);
  return 0;
}

/* A GEMM over zero rows leaves an empty temporary, whose buffer is NULL:
 * the sum of its columns is zeros. (Nothing may be added to that pointer,
 * not even 0: clang's UBSan, in the fuzz build, flags it from this graph in
 * fuzz_irtext's seeds; gcc's, in the test build, does not check it.) */
START_TEST(test_empty_temporary) {
  kiln_scope_begin();
  kiln_tensor *in[2] = {kiln_randn(KILN_F32, 2, ((int64_t[]){0, 4}), 1), kiln_randn(KILN_F32, 2, ((int64_t[]){4, 3}), 2)};
  kiln_fn *fn = compile_once(empty_gemm_sum_body, 2, in);
  kiln_tensor *y = NULL;
  ck_assert_int_eq(0, kiln_call(fn, in, &y));
  float v[3] = {1, 1, 1};
  ck_assert_int_eq(0, kiln_read(y, v, sizeof v));
  for (int i = 0; i < 3; i++) ck_assert_float_eq(0, v[i]);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* A pointwise kernel over rows of a constant length loops over whole rows
 * of that length (no division of each run's start by it): a range of
 * elements runs the rows that end in it. 3001 rows of 45 with a bias
 * along them split into blocks of 65536 elements at two threads, which
 * start inside rows; both thread counts give eager's sums. */
START_TEST(test_whole_rows) {
  kiln_scope_begin();
  kiln_tensor *in[2] = {kiln_randn(KILN_F32, 2, ((int64_t[]){3001, 45}), 1), kiln_randn(KILN_F32, 1, ((int64_t[]){45}), 2)};
  kiln_fn *fn = compile_once(bias_add_body, 2, in);
  int nd, no;
  loops_of(fn, &nd, &no);
  ck_assert_int_eq(2, nd);
  char *dump = llvm_dump_of(fn);
  ck_assert_msg(strstr(dump, "srem") == NULL, "%.3000s", dump);
  free(dump);
  kiln_tensor *ref = NULL;
  ck_assert_int_eq(0, bias_add_body(NULL, in, &ref));
  for (int t = 1; t <= 2; t++) {
    kiln_set_num_threads(t);
    kiln_tensor *y = NULL;
    ck_assert_int_eq(0, kiln_call(fn, in, &y));
    int64_t bad;
    ck_assert_double_eq(0, maxdiff_rel(y, ref, &bad));
  }
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* A layer norm whose statistics are outputs too, as a training step keeps
 * them for the backward: mean, variance, rsqrt and the normalized rows. */
static int ln_stats_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *x = in[0], *mean = kiln_mean(x, -1, true), *xc = kiln_sub(x, mean);
  kiln_tensor *rstd = kiln_rsqrt(kiln_add(kiln_mean(kiln_mul(xc, xc), -1, true), kiln_scalar(KILN_F32, 1e-5)));
  out[0] = kiln_mul(xc, rstd);
  out[1] = mean;
  out[2] = rstd;
  return 0;
}

/* Row sums without keepdim, kept, and a pointwise op of them. */
static int row_sums_kept_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_sum(in[0], -1, false);
  out[1] = kiln_add(kiln_mul(out[0], kiln_scalar(KILN_F32, 2)), kiln_scalar(KILN_F32, 1));
  return 0;
}

/* The rows less the first row's mean: not row by row. */
static int first_row_mean_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *mean = kiln_mean(in[0], -1, true);
  out[0] = kiln_sub(in[0], kiln_slice(mean, 0, 0, 1, 1));
  out[1] = mean;
  return 0;
}

static kiln_fn *compile_outs(body_fn body, int n_out, kiln_tensor *x, kiln_tensor **y) {
  kiln_options o = {.name = "rows", .n_in = 1, .n_out = n_out, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(body, NULL, &o);
  ck_assert_int_eq(0, kiln_call(fn, &x, y));
  ck_assert_int_eq(0, kiln_call(fn, &x, y)); /* compiled */
  return fn;
}

/* A kernel that reads what a row kernel before it stored, row by row, runs
 * as its next stages (merge_rows in fuse.c): the layer norm above is one
 * loop kernel that stores all three outputs, against the statistics taken
 * here in double; one and two threads agree bitwise. Row sums kept as they
 * are and scaled are one kernel too. A kernel that reads another row's
 * value (the first row's mean) stays a kernel of its own. */
START_TEST(test_row_merges) {
  kiln_scope_begin();
  const int64_t rows[] = {67, 3001}, cols = 45;
  for (int t = 0; t < 2; t++) {
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){rows[t], cols}), 7 + t), *y[3];
    kiln_fn *fn = compile_outs(ln_stats_body, 3, x, y);
    cg_program *p = plan_of(fn);
    ck_assert_int_eq(1, p->n_k);
    ck_assert_int_eq(CG_K_LOOP, p->k[0].kind);
    int reduces = 0, stores = 0;
    for (int s = 0; s < p->k[0].n_stage; s++) {
      reduces += p->k[0].stage[s].kind == CG_REDUCE;
      stores += p->k[0].stage[s].kind == CG_MAP;
    }
    ck_assert_int_eq(2, reduces);
    ck_assert_int_ge(stores, 3); /* the three outputs (and the variance, a temp of its own) */
    free_plan(p);
    float *xs = malloc(sizeof(float) * (size_t)(rows[t] * cols)), *ys = malloc(sizeof(float) * (size_t)(rows[t] * cols));
    float *ms = malloc(sizeof(float) * (size_t)rows[t]), *rs = malloc(sizeof(float) * (size_t)rows[t]);
    ck_assert_int_eq(0, kiln_read(x, xs, sizeof(float) * (size_t)(rows[t] * cols)));
    ck_assert_int_eq(0, kiln_read(y[0], ys, sizeof(float) * (size_t)(rows[t] * cols)));
    ck_assert_int_eq(0, kiln_read(y[1], ms, sizeof(float) * (size_t)rows[t]));
    ck_assert_int_eq(0, kiln_read(y[2], rs, sizeof(float) * (size_t)rows[t]));
    for (int64_t r = 0; r < rows[t]; r++) {
      double m = 0, v = 0;
      for (int64_t c = 0; c < cols; c++) m += xs[r * cols + c];
      m /= (double)cols;
      for (int64_t c = 0; c < cols; c++) v += (xs[r * cols + c] - m) * (xs[r * cols + c] - m);
      double rstd = 1 / sqrt(v / (double)cols + 1e-5);
      ck_assert_msg(fabs(ms[r] - m) <= 1e-6 * (1 + fabs(m)), "row %lld: mean %.9g, want %.9g", (long long)r, ms[r], m);
      ck_assert_msg(fabs(rs[r] - rstd) <= 1e-5 * rstd, "row %lld: rstd %.9g, want %.9g", (long long)r, rs[r], rstd);
      for (int64_t c = 0; c < cols; c++) {
        double want = (xs[r * cols + c] - m) * rstd;
        ck_assert_msg(fabs(ys[r * cols + c] - want) <= 1e-5 * (1 + fabs(want)), "row %lld col %lld: %.9g, want %.9g",
                      (long long)r, (long long)c, ys[r * cols + c], want);
      }
    }
    free(xs), free(ys), free(ms), free(rs);
    kiln_tensor *y1[3], *y2[3];
    kiln_set_num_threads(1);
    ck_assert_int_eq(0, kiln_call(fn, &x, y1));
    kiln_set_num_threads(2);
    ck_assert_int_eq(0, kiln_call(fn, &x, y2));
    for (int i = 0; i < 3; i++) {
      int64_t bad;
      ck_assert_double_eq(0, maxdiff_rel(y1[i], y2[i], &bad));
    }
    kiln_fn_free(fn);
  }
  /* the sums kept: the pointwise op over the outer dims alone runs once per row behind them;
   * the first row's mean: two kernels */
  const body_fn bodies[] = {row_sums_kept_body, first_row_mean_body};
  const int want_loops[] = {1, 2};
  for (int t = 0; t < 2; t++) {
    kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){67, cols}), 9), *y[2], *ref[2];
    kiln_fn *fn = compile_outs(bodies[t], 2, x, y);
    cg_program *p = plan_of(fn);
    ck_assert_int_eq(want_loops[t], count_kind(p, CG_K_LOOP));
    free_plan(p);
    ck_assert_int_eq(0, bodies[t](NULL, &x, ref));
    for (int i = 0; i < 2; i++) {
      int64_t bad;
      ck_assert(same_shape(y[i], ref[i]));
      ck_assert_double_le(maxdiff_rel(y[i], ref[i], &bad), 1e-6);
    }
    kiln_fn_free(fn);
  }
  kiln_scope_end();
}
END_TEST

/* Pointwise consumers behind a reduction run in the reduction's kernel, once
 * per outer element: batch-1 linear + bias + relu is one loop kernel, and so
 * is tanh(sum(x*x, 1) * s). Row counts that are not multiples of the
 * grouped dot products (lower.c) leave a remainder; 1 and 2 threads agree
 * bitwise. */
START_TEST(test_reduce_epilogues) {
  kiln_scope_begin();
  for (int64_t n = 1; n <= 13; n += 6) {
    kiln_tensor *in[3] = {kiln_randn(KILN_F32, 2, ((int64_t[]){1, 70}), 1), kiln_randn(KILN_F32, 2, ((int64_t[]){n + 32, 70}), 2),
                          kiln_randn(KILN_F32, 1, ((int64_t[]){n + 32}), 3)};
    kiln_fn *fn = compile_once(matvec_relu_body, 3, in);
    cg_program *p = plan_of(fn);
    ck_assert_int_eq(1, p->n_k);
    ck_assert_int_eq(CG_K_LOOP, p->k[0].kind);
    ck_assert_int_eq(3, p->k[0].n_nodes); /* matmul, add, relu */
    free_plan(p);
    same_at_1_and_2_threads(fn, in);
    kiln_fn_free(fn);
  }
  kiln_tensor *in[2] = {kiln_randn(KILN_F32, 2, ((int64_t[]){4101, 37}), 4), kiln_randn(KILN_F32, 1, ((int64_t[]){4101}), 5)};
  kiln_fn *fn = compile_once(mean_scale_body, 2, in);
  cg_program *p = plan_of(fn);
  ck_assert_int_eq(1, p->n_k);
  ck_assert_int_eq(1, count_kind(p, CG_K_LOOP));
  free_plan(p);
  same_at_1_and_2_threads(fn, in);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* A matvec's sum of products adds each product with one rounding (the
 * multiply and add carry `contract`, an FMA on hosts that have one), four
 * rows per pass without interleaving. Each output is checked against the
 * exact dot product (double) within the bound of a sum of n terms, at row
 * lengths with and without a vector tail. The FMA is the full code
 * generator's, so this test keeps to it whatever KILN_QUICK says. */
START_TEST(test_dot_products_fused) {
  ck_assert_int_eq(0, setenv("KILN_QUICK", "0", 1));
  kiln_scope_begin();
  const int64_t cols[] = {256, 70};
  for (int c = 0; c < 2; c++) {
    int64_t n = cols[c], rows = 37;
    kiln_tensor *in[3] = {kiln_randn(KILN_F32, 2, ((int64_t[]){1, n}), 21), kiln_randn(KILN_F32, 2, ((int64_t[]){rows, n}), 22),
                          kiln_zeros(KILN_F32, 1, ((int64_t[]){rows}))};
    kiln_fn *fn = compile_once(matvec_relu_body, 3, in);
    kiln_tensor *y = NULL;
    ck_assert_int_eq(0, kiln_call(fn, in, &y));
    static float x[256], w[37 * 256], got[37];
    ck_assert_int_eq(0, kiln_read(in[0], x, sizeof(float) * (size_t)n));
    ck_assert_int_eq(0, kiln_read(in[1], w, sizeof(float) * (size_t)(rows * n)));
    ck_assert_int_eq(0, kiln_read(y, got, sizeof got));
    for (int64_t j = 0; j < rows; j++) {
      double exact = 0, mag = 0;
      for (int64_t i = 0; i < n; i++) exact += (double)w[j * n + i] * x[i], mag += fabs((double)w[j * n + i] * x[i]);
      double want = exact > 0 ? exact : 0, bound = (double)n * 0x1p-24 * mag;
      ck_assert_msg(fabs(got[j] - want) <= bound, "n %lld row %lld: %.9g, exact %.9g (bound %g)", (long long)n, (long long)j,
                    got[j], want, bound);
    }
    char *dump = llvm_dump_of(fn);
    ck_assert_msg(strstr(dump, "fmul contract") != NULL && strstr(dump, "fadd reassoc contract") != NULL,
                  "the products and their sums are not contractible:\n%.2000s", dump);
    free(dump);
#if defined(__x86_64__) && defined(__FMA__)
    dump = dump_of(fn, KILN_DUMP_ASM);
    ck_assert_msg(strstr(dump, "vfmadd") != NULL, "no FMA in the machine code:\n%.2000s", dump);
    free(dump);
#endif
    kiln_fn_free(fn);
  }
  kiln_scope_end();
  unsetenv("KILN_QUICK");
}
END_TEST

/* Two sums of one row in one kernel run grouped too (lower.c, jammable):
 * SwiGLU's silu(x @ W1^T) * (x @ W3^T) at batch 1, and a row's variance,
 * whose second sum reads the first (the mean) of its own row. Each output
 * against the exact value in double within the bound of its sums; row
 * counts with a remainder of the groups, and enough rows for the runtime
 * to split them between threads, which must not change a bit. */
static int swiglu_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *a = kiln_matmul(in[0], kiln_transpose(in[1], 0, 1)), *b = kiln_matmul(in[0], kiln_transpose(in[2], 0, 1));
  out[0] = kiln_mul(kiln_mul(a, kiln_sigmoid(a)), b);
  return out[0] ? 0 : -1;
}

static int row_var_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *d = kiln_sub(in[0], kiln_mean(in[0], 1, true));
  out[0] = kiln_mean(kiln_mul(d, d), 1, false);
  return out[0] ? 0 : -1;
}

/* Compiled for the LLVM backend, without compile_once's comparison with
 * eager: the test holds each output to the exact value instead. */
static kiln_fn *compile_llvm(body_fn body, int n_in) {
  kiln_options o = {.name = "plan", .n_in = n_in, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kcache_forget();
  return kiln_compile(body, NULL, &o);
}

/* Sum stages of fn's one loop kernel. */
static int reduce_stages_of(kiln_fn *fn) {
  cg_program *p = plan_of(fn);
  ck_assert_int_eq(1, p->n_k);
  ck_assert_int_eq(CG_K_LOOP, p->k[0].kind);
  int nr = 0;
  for (int s = 0; s < p->k[0].n_stage; s++) nr += p->k[0].stage[s].kind == CG_REDUCE;
  free_plan(p);
  return nr;
}

START_TEST(test_two_sums_grouped) {
  kiln_scope_begin();
  enum { K = 70 };
  const int64_t row_counts[] = {37, 2003};
  for (int c = 0; c < 2; c++) {
    int64_t rows = row_counts[c];
    kiln_tensor *in[3] = {kiln_randn(KILN_F32, 2, ((int64_t[]){1, K}), 31), kiln_randn(KILN_F32, 2, ((int64_t[]){rows, K}), 32),
                          kiln_randn(KILN_F32, 2, ((int64_t[]){rows, K}), 33)};
    kiln_fn *fn = compile_llvm(swiglu_body, 3);
    kiln_tensor *y = NULL;
    ck_assert_int_eq(0, kiln_call(fn, in, &y));
    ck_assert_int_eq(2, reduce_stages_of(fn));
    same_at_1_and_2_threads(fn, in);
    ck_assert_int_eq(0, kiln_call(fn, in, &y));
    float *x = malloc(sizeof(float) * K), *w1 = malloc(sizeof(float) * (size_t)(rows * K)),
          *w3 = malloc(sizeof(float) * (size_t)(rows * K)), *got = malloc(sizeof(float) * (size_t)rows);
    ck_assert_int_eq(0, kiln_read(in[0], x, sizeof(float) * K));
    ck_assert_int_eq(0, kiln_read(in[1], w1, sizeof(float) * (size_t)(rows * K)));
    ck_assert_int_eq(0, kiln_read(in[2], w3, sizeof(float) * (size_t)(rows * K)));
    ck_assert_int_eq(0, kiln_read(y, got, sizeof(float) * (size_t)rows));
    for (int64_t j = 0; j < rows; j++) {
      double a = 0, b = 0, ma = 0, mb = 0;
      for (int i = 0; i < K; i++) {
        a += (double)w1[j * K + i] * x[i], ma += fabs((double)w1[j * K + i] * x[i]);
        b += (double)w3[j * K + i] * x[i], mb += fabs((double)w3[j * K + i] * x[i]);
      }
      double ea = K * 0x1p-24 * ma, eb = K * 0x1p-24 * mb, silu = a / (1 + exp(-a)), want = silu * b;
      /* |silu'| < 1.1; then the sigmoid's few ulp and the two products' roundings */
      double bound = 1.1 * ea * (fabs(b) + eb) + (fabs(silu) + 1.1 * ea) * eb + 1e-6 * fabs(want) + 1e-30;
      ck_assert_msg(fabs(got[j] - want) <= bound, "rows %lld, row %lld: %.9g, exact %.9g (bound %g)", (long long)rows,
                    (long long)j, got[j], want, bound);
    }
    free(x), free(w1), free(w3), free(got);
    kiln_fn_free(fn);

    kiln_tensor *xs = kiln_add(kiln_randn(KILN_F32, 2, ((int64_t[]){rows, K}), 34), kiln_scalar(KILN_F32, 3.0));
    fn = compile_llvm(row_var_body, 1);
    ck_assert_int_eq(0, kiln_call(fn, &xs, &y));
    ck_assert_int_eq(2, reduce_stages_of(fn));
    same_at_1_and_2_threads(fn, &xs);
    ck_assert_int_eq(0, kiln_call(fn, &xs, &y));
    float *xv = malloc(sizeof(float) * (size_t)(rows * K)), *v = malloc(sizeof(float) * (size_t)rows);
    ck_assert_int_eq(0, kiln_read(xs, xv, sizeof(float) * (size_t)(rows * K)));
    ck_assert_int_eq(0, kiln_read(y, v, sizeof(float) * (size_t)rows));
    for (int64_t j = 0; j < rows; j++) {
      double m = 0, var = 0, mag = 0;
      for (int i = 0; i < K; i++) m += xv[j * K + i], mag += fabs(xv[j * K + i]);
      m /= K;
      for (int i = 0; i < K; i++) var += (xv[j * K + i] - m) * (xv[j * K + i] - m);
      var /= K;
      /* the mean's error (K terms) moves every deviation by it; then K squares summed */
      double em = K * 0x1p-24 * mag / K + 0x1p-24 * fabs(m);
      double bound = 2 * em * sqrt(var) * 2 + em * em + (K + 4) * 0x1p-24 * var * 2;
      ck_assert_msg(fabs(v[j] - var) <= bound, "rows %lld, row %lld: variance %.9g, exact %.9g (bound %g)", (long long)rows,
                    (long long)j, v[j], var, bound);
    }
    free(xv), free(v);
    kiln_fn_free(fn);
  }
  kiln_scope_end();
}
END_TEST


START_TEST(test_full_reduce_blocks) {
  double got[2][3];
  for (int t = 1; t <= 2; t++) {
    kiln_set_num_threads(t);
    kiln_scope_begin();
    kiln_tensor *in[2] = {kiln_randn(KILN_F32, 2, ((int64_t[]){700, 300}), 11), kiln_randn(KILN_F64, 1, ((int64_t[]){300001}), 12)};
    kiln_options o = {.name = "full", .n_in = 2, .n_out = 3, .backend = KILN_BACKEND_LLVM};
    kiln_fn *fn = kiln_compile(full_reduce_body, NULL, &o);
    kiln_tensor *y[3], *ref[3];
    ck_assert_int_eq(0, kiln_call(fn, in, y));
    ck_assert_int_eq(0, kiln_call(fn, in, y));
    ck_assert_int_eq(0, full_reduce_body(NULL, in, ref));
    for (int i = 0; i < 3; i++) {
      got[t - 1][i] = kiln_item(y[i]);
      double want = kiln_item(ref[i]);
      ck_assert_msg(fabs(got[t - 1][i] - want) <= 1e-5 * fabs(want), "output %d: %.9g, eager %.9g", i, got[t - 1][i], want);
    }
    cg_program *p = plan_of(fn);
    ck_assert_int_eq(3, p->n_k);
    cg_module m;
    char err[256];
    ck_assert_int_eq(0, jit_module_new(&m, "full", err, sizeof err));
    for (int k = 0; k < 3; k++) {
      ck_assert_int_eq(0, p->k[k].n_outer); /* one reduction kernel per output */
      ck_assert_int_eq(0, lower_kernel(p, &p->k[k], m.mod, err, sizeof err));
      ck_assert(p->k[k].split); /* lowered in blocks */
    }
    jit_module_dispose(&m);
    free_plan(p);
    kiln_fn_free(fn);
    kiln_scope_end();
  }
  ck_assert_msg(!memcmp(got[0], got[1], sizeof got[0]), "full reductions differ between 1 and 2 threads");
  kiln_set_num_threads(0);
}
END_TEST

/* ---- batch-1 matvec against (in,out) weights: column panels ---- */

static int plain_matmul_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_matmul(in[0], in[1]);
  return 0;
}

static int linear_gelu_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_gelu(kiln_add(kiln_matmul(in[0], in[1]), in[2]));
  return 0;
}

/* y = x @ W with W (K,N) and one row of x runs as one column kernel whose
 * panels keep vectors of outputs in registers down K (lower.c). Output
 * counts cover under a vector (5), vectors and a masked rest (70), whole
 * panels (288), panels, single vectors and a rest (277), and enough to be
 * split over two threads (4005). Checked against a sum in f64 written
 * here, bitwise against eager's gemv (which adds in the same order), and
 * for the same bits at 1 and 2 threads; bf16 weights are read narrow. */
START_TEST(test_matvec_in_out_panels) {
  static const int64_t sizes[][2] = {{37, 5}, {70, 70}, {288, 288}, {41, 277}, {37, 4005}};
  for (int i = 0; i < 5; i++) {
    for (int narrow = 0; narrow < 2; narrow++) {
      kiln_scope_begin();
      int64_t k = sizes[i][0], n = sizes[i][1];
      kiln_tensor *w = kiln_randn(KILN_F32, 2, ((int64_t[]){k, n}), 70 + (uint64_t)i);
      if (narrow) w = kiln_cast(kiln_cast(w, KILN_BF16), KILN_F32); /* exact in bf16, so the f64 sum below holds */
      kiln_tensor *in[3] = {kiln_randn(KILN_F32, 2, ((int64_t[]){1, k}), 80 + (uint64_t)i), narrow ? kiln_cast(w, KILN_BF16) : w,
                            kiln_randn(KILN_F32, 1, ((int64_t[]){n}), 90 + (uint64_t)i)};
      kiln_fn *fn = compile_once(narrow ? linear_relu_body : linear_gelu_body, 3, in);
      cg_program *p = plan_of(fn);
      ck_assert_int_eq(0, count_kind(p, CG_K_MATMUL));
      ck_assert_int_eq(1, p->n_k);
      ck_assert(lower_is_column(&p->k[0]));
      free_plan(p);
      /* (288,288) is too little work to split over threads: on a host of
       * 16-lane vectors its 18 vectors of outputs are one panel (18 phis of
       * sums, besides the single vector's and the masked one's), and W is
       * read row after row; other shapes keep panels of at most 8 vectors
       * (plus the single vector and the masked one after them) */
      int accs = 0;
      char *code = llvm_dump_of(fn);
      for (const char *l = code; (l = strstr(l, "%panel")) != NULL; l++) accs += strncmp(strchr(l, ' '), " = phi <", 8) == 0;
      free(code);
      if (n == 288 && jit_wide_vectors()) ck_assert_msg(accs >= 18, "[288,288]: %d vector accumulators, want a panel of 18", accs);
      else ck_assert_msg(accs <= 8 + 2, "[%lld,%lld]: %d vector accumulators", (long long)k, (long long)n, accs);
      char *dump = llvm_dump_of(fn);
      ck_assert_msg(strstr(dump, "%panel") != NULL, "[%lld,%lld]: no panel accumulators:\n%.3000s", (long long)k, (long long)n, dump);
      ck_assert_msg(strstr(dump, "gather") == NULL, "[%lld,%lld]: gathers", (long long)k, (long long)n);
      free(dump);
      kiln_tensor *y = NULL;
      ck_assert_int_eq(0, kiln_call(fn, in, &y));
      static float xs[300], ws[300 * 300], bs[300], ys[300];
      ck_assert_int_eq(0, kiln_read(in[0], xs, sizeof(float) * (size_t)k));
      if (n < 300) {
        ck_assert_int_eq(0, kiln_read(w, ws, sizeof(float) * (size_t)(k * n)));
        ck_assert_int_eq(0, kiln_read(in[2], bs, sizeof(float) * (size_t)n));
        ck_assert_int_eq(0, kiln_read(y, ys, sizeof(float) * (size_t)n));
      }
      for (int64_t j = 0; j < n && n < 300; j++) {
        double acc = bs[j];
        for (int64_t q = 0; q < k; q++) acc += (double)xs[q] * ws[q * n + j];
        double want = narrow ? (acc > 0 ? acc : 0) : 0.5 * acc * (1 + tanh(0.7978845608028654 * (acc + 0.044715 * acc * acc * acc))); /* the tanh form */
        ck_assert_msg(fabs(ys[j] - want) <= 1e-5 * (1 + fabs(want)), "[%lld,%lld] at %lld: %g, want %g", (long long)k,
                      (long long)n, (long long)j, ys[j], want);
      }
      /* eager's gemv adds x[q] * W[q, j] in q's order, without an FMA: the same bits */
      kiln_tensor *ref = kiln_matmul(in[0], narrow ? w : in[1]), *got = NULL;
      kiln_fn *bare = compile_once(plain_matmul_body, 2, (kiln_tensor *[]){in[0], narrow ? in[1] : w});
      ck_assert_int_eq(0, kiln_call(bare, (kiln_tensor *[]){in[0], narrow ? in[1] : w}, &got));
      int64_t bad;
      ck_assert_msg(maxdiff_rel(got, ref, &bad) == 0, "[%lld,%lld]: differs from eager at %lld", (long long)k, (long long)n,
                    (long long)bad);
      same_at_1_and_2_threads(fn, in);
      kiln_fn_free(bare);
      kiln_fn_free(fn);
      kiln_scope_end();
    }
  }
}
END_TEST

/* ---- column reductions: over the leading (outer-in-memory) axes ---- */

enum { COL_SUM, COL_MEAN, COL_MAX, COL_MIN, COL_TANH, COL_VAR, COL_N };
static const char *const col_name[COL_N] = {"sum(a*b)", "mean", "max", "min", "tanh(sum)*2", "var"};

typedef struct col_case {
  int op;    /* COL_* */
  int naxes; /* reduces axes [0, naxes): 1 of (R,C), 2 of (R0,R1,C) */
} col_case;

static int column_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const col_case *c = ctx;
  const int axes[2] = {0, 1};
  kiln_tensor *x = in[0];
  switch (c->op) {
  case COL_SUM: out[0] = kiln_sum_axes(kiln_mul(x, in[1]), axes, c->naxes, false); break;
  case COL_MEAN: out[0] = kiln_mean_axes(x, axes, c->naxes, false); break;
  case COL_MAX: out[0] = kiln_max_axes(x, axes, c->naxes, false); break;
  case COL_MIN: out[0] = kiln_min_axes(x, axes, c->naxes, false); break;
  case COL_TANH: out[0] = kiln_mul(kiln_tanh(kiln_sum_axes(x, axes, c->naxes, false)), kiln_scalar(KILN_F32, 2)); break;
  case COL_VAR: out[0] = kiln_var_axes(x, axes, c->naxes, 0, false); break; /* a mean, then a sum of squares */
  }
  return out[0] ? 0 : -1;
}

/* fn (LLVM) on in, against the interpreter and eager: within tol of eager
 * (0: bitwise), the interpreter bitwise (it runs eager's kernels), and the
 * same bits at 1 and 2 threads. */
static void column_three_ways(kiln_fn *fn, kiln_fn *interp, const col_case *c, kiln_tensor *const *in, double tol,
                              const char *what) {
  kiln_tensor *y = NULL, *yi = NULL, *ref = NULL;
  ck_assert_int_eq(0, kiln_call(fn, in, &y));
  ck_assert_int_eq(0, kiln_call(interp, in, &yi));
  ck_assert_int_eq(0, column_body((void *)c, in, &ref));
  ck_assert(same_shape(y, ref) && same_shape(yi, ref));
  int64_t bad;
  double d = maxdiff_rel(yi, ref, &bad);
  ck_assert_msg(d == 0, "%s: interpreter differs from eager by %g at %lld", what, d, (long long)bad);
  d = maxdiff_rel(y, ref, &bad);
  ck_assert_msg(d <= tol, "%s: max rel diff %g from eager (tolerance %g) at %lld", what, d, tol, (long long)bad);
  same_at_1_and_2_threads(fn, in);
}

/* Reductions over the leading axes (a bias gradient sum(dy, 0)) run in
 * column blocks (lower.c): the reduced loops outside, a block of outputs in
 * the unit-stride inner loop, so no gathers. Each output adds in the
 * reduced index's order, eager's order: f32 sums over a known count of at
 * most 8192 are bitwise eager's; a symbolic count sums in f64. Sizes cross
 * the block (300 and 1000 outputs) and stay under a vector (5, 37). */
START_TEST(test_column_reductions) {
  static const int64_t sz2[][2] = {{3, 37}, {257, 5}, {1000, 300}, {7, 1000}};
  static const int64_t sz3[][3] = {{3, 4, 37}, {20, 13, 5}, {10, 100, 300}};
  for (int nd = 2; nd <= 3; nd++) {
    int nsz = nd == 2 ? 4 : 3;
    for (int op = 0; op < COL_N; op++)
      for (int i = 0; i < nsz; i++) {
        kiln_scope_begin();
        col_case c = {op, nd - 1};
        const int64_t *shape = nd == 2 ? sz2[i] : sz3[i];
        kiln_tensor *in[2] = {kiln_randn(KILN_F32, nd, shape, 30 + (uint64_t)i), kiln_randn(KILN_F32, nd, shape, 40 + (uint64_t)i)};
        kiln_options o = {.name = "column", .n_in = op == COL_SUM ? 2 : 1, .n_out = 1, .backend = KILN_BACKEND_LLVM};
        kiln_fn *fn = kiln_compile(column_body, &c, &o);
        o.backend = KILN_BACKEND_INTERP;
        kiln_fn *interp = kiln_compile(column_body, &c, &o);
        kiln_tensor *y;
        ck_assert_int_eq(0, kiln_call(fn, in, &y)); /* traced */
        char what[96];
        snprintf(what, sizeof what, "%s over %d axes of [%lld,%lld%s]", col_name[op], nd - 1, (long long)shape[0],
                 (long long)shape[1], nd == 3 ? ",..." : "");
        /* tanh is eager's within a few ulp; the rest in eager's order */
        column_three_ways(fn, interp, &c, in, op == COL_TANH ? 1e-6 : 0, what);
        cg_program *p = plan_of(fn);
        ck_assert_int_eq(1, p->n_k);
        ck_assert_int_eq(1, p->k[0].n_outer);
        int reduces = 0;
        for (int s = 0; s < p->k[0].n_stage; s++) reduces += p->k[0].stage[s].kind == CG_REDUCE;
        ck_assert_int_eq(op == COL_VAR ? 2 : 1, reduces);
        free_plan(p);
        char *dump = llvm_dump_of(fn);
        ck_assert_msg(strstr(dump, "masked.gather") == NULL, "%s: gathers:\n%.2000s", what, strstr(dump, "masked.gather"));
        free(dump);
        kiln_fn_free(interp);
        kiln_fn_free(fn);
        kiln_scope_end();
      }
  }
  /* a symbolic leading dim: one variant for every row count, summed in f64 */
  for (int op = 0; op < COL_N; op++) {
    col_case c = {op, 1};
    kiln_options o = {.name = "column_dyn", .n_in = op == COL_SUM ? 2 : 1, .n_out = 1, .backend = KILN_BACKEND_LLVM};
    kiln_fn *fn = kiln_compile(column_body, &c, &o);
    ck_assert_int_eq(0, kiln_mark_dynamic(fn, 0, 0));
    if (op == COL_SUM) ck_assert_int_eq(0, kiln_mark_dynamic(fn, 1, 0));
    o.backend = KILN_BACKEND_INTERP;
    kiln_fn *interp = kiln_compile(column_body, &c, &o);
    const int64_t rows[] = {9, 1, 300, 1000, 64};
    for (int i = 0; i < 5; i++) {
      kiln_scope_begin();
      int64_t shape[2] = {rows[i], 300};
      kiln_tensor *in[2] = {kiln_randn(KILN_F32, 2, shape, 50 + (uint64_t)i), kiln_randn(KILN_F32, 2, shape, 60 + (uint64_t)i)};
      kiln_tensor *y;
      if (i == 0) ck_assert_int_eq(0, kiln_call(fn, in, &y)); /* traced */
      char what[96];
      snprintf(what, sizeof what, "%s over the symbolic axis 0 of [%lld,300]", col_name[op], (long long)rows[i]);
      /* max and min do not depend on the order */
      column_three_ways(fn, interp, &c, in, op == COL_MAX || op == COL_MIN ? 0 : 1e-4, what);
      kiln_scope_end();
    }
    kiln_fn_stats st;
    ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
    ck_assert_int_eq(1, st.variants);
    char *dump = llvm_dump_of(fn);
    ck_assert_msg(strstr(dump, "masked.gather") == NULL, "%s symbolic: gathers:\n%.2000s", col_name[op], strstr(dump, "masked.gather"));
    free(dump);
    kiln_fn_free(interp);
    kiln_fn_free(fn);
  }
  kiln_set_num_threads(0);
}
END_TEST

#ifdef KILN_TEST_BUILD
/* Faults forced in the test build: LLVM refusing a graph falls back to the
 * interpreter with a warning and the right answer; a corrupted kernel is
 * named by check mode, with its nodes' lines, and eager's answer returned. */
START_TEST(test_forced_faults) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){33, 70}), 1), *y = NULL, *ref = NULL;
  ck_assert_int_eq(0, softmax_body(NULL, &x, &ref));
  int64_t bad;

  setenv("KILN_TEST_FAIL_LLVM", "1", 1);
  kiln_options o = {.name = "fallback", .n_in = 1, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(softmax_body, NULL, &o);
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  ck_assert_int_eq(0, kiln_call(fn, &x, &y)); /* the interpreter runs the variant */
  unsetenv("KILN_TEST_FAIL_LLVM");
  ck_assert_double_le(maxdiff_rel(y, ref, &bad), 1e-6);
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(1, st.hits);
  kiln_fn_free(fn);

  setenv("KILN_TEST_CORRUPT_KERNEL", "k0_row", 1);
  o = (kiln_options){.name = "checked", .n_in = 1, .n_out = 1, .backend = KILN_BACKEND_LLVM, .check = 1};
  fn = kiln_compile(softmax_body, NULL, &o);
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  int saved;
  FILE *log = stderr_catch(&saved);
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  char text[4096] = "";
  stderr_release(log, saved, text, sizeof text);
  unsetenv("KILN_TEST_CORRUPT_KERNEL");
  ck_assert_double_le(maxdiff_rel(y, ref, &bad), 1e-6); /* eager's answer, not the corrupted one */
  /* the report names the kernel that went wrong, with its nodes */
  ck_assert_msg(strstr(text, "kernel k0_row differs from the interpreter") && strstr(text, "its nodes:"), "%s", text);
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(1, st.check_fails);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST
#endif

#ifdef KILN_TEST_BUILD
/* Twenty-four light row sums of ten or so ops each and a sum of exp: with
 * the quick code generator on two threads, the costly kernel's group
 * compiles while the light kernels are lowered. */
static int many_light_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *x = in[0], *acc = kiln_sum(kiln_exp(x), -1, true);
  for (int i = 0; i < 24; i++) {
    kiln_tensor *c = kiln_scalar(KILN_F32, i + 1), *t = kiln_mul(kiln_add(x, c), kiln_sub(x, c));
    acc = kiln_add(acc, kiln_sum(kiln_add(kiln_mul(t, kiln_scalar(KILN_F32, 0.5)), kiln_div(x, c)), -1, true));
  }
  out[0] = acc;
  return 0;
}

/* A light kernel that fails to lower after the costly kernels' group began
 * compiling on another thread: that thread is stopped and joined, the
 * variant runs on the interpreter with eager's answer (no LLVM time is
 * counted), and nothing leaks (ASan) or races (TSan). */
START_TEST(test_failed_lowering_stops_threads) {
  kiln_scope_begin();
  kiln_set_num_threads(2);
  ck_assert_int_eq(0, setenv("KILN_QUICK", "1", 1));
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){37, 45}), 71), *y = NULL, *ref = NULL;
  ck_assert_int_eq(0, many_light_body(NULL, &x, &ref));
  for (int forced = 0; forced < 2; forced++) {
    if (forced) ck_assert_int_eq(0, setenv("KILN_TEST_FAIL_LOWERING", "light", 1));
    kiln_options o = {.name = "stopped", .n_in = 1, .n_out = 1, .backend = KILN_BACKEND_LLVM};
    kcache_forget();
    kiln_fn *fn = kiln_compile(many_light_body, NULL, &o);
    ck_assert_int_eq(0, kiln_call(fn, &x, &y));
    ck_assert_int_eq(0, kiln_call(fn, &x, &y));
    unsetenv("KILN_TEST_FAIL_LOWERING");
    int64_t bad;
    ck_assert_double_le(maxdiff_rel(y, ref, &bad), 1e-5);
    kiln_fn_stats st;
    ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
    ck_assert_int_eq(1, st.hits);
    /* compiled by LLVM without the fault, by nothing with it */
    if (forced) ck_assert_double_eq(0, st.llvm_opt_ms);
    else ck_assert_double_gt(st.llvm_opt_ms, 0);
    kiln_fn_free(fn);
  }
  unsetenv("KILN_QUICK");
  kiln_set_num_threads(0);
  kiln_scope_end();
}
END_TEST
#endif

#ifdef KILN_TEST_BUILD
static int tanh_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_add(kiln_mul(kiln_tanh(in[0]), in[0]), in[0]);
  return out[0] ? 0 : -1;
}

/* An op that ops.def gives no emitter (as a new op's row may): the kernel
 * holding it fails to lower, the variant runs on the interpreter with
 * eager's answer, and the warning names the op. */
START_TEST(test_op_without_emitter) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){33, 17}), 5), *y = NULL, *ref = NULL;
  ck_assert_int_eq(0, tanh_body(NULL, &x, &ref));
  cg_test_drop_emitter(OP_TANH, true);
  kiln_options o = {.name = "noemit", .n_in = 1, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kcache_forget();
  kiln_fn *fn = kiln_compile(tanh_body, NULL, &o);
  /* what the compile says goes to stderr: caught in a file */
  int saved;
  FILE *log = stderr_catch(&saved);
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  ck_assert_int_eq(0, kiln_call(fn, &x, &y));
  char text[2048] = "";
  stderr_release(log, saved, text, sizeof text);
  cg_test_drop_emitter(OP_TANH, false);
  ck_assert_msg(strstr(text, "no emitter for the op 'tanh'") != NULL, "the warning does not name the op: \"%s\"", text);
  int64_t bad;
  ck_assert_double_eq(0, maxdiff_rel(y, ref, &bad)); /* the interpreter runs eager's kernels */
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(1, st.hits);
  ck_assert_double_eq(0, st.llvm_opt_ms);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST
#endif

/* KILN_JIT_FEATURES=-avx512f gives the kernels of an AVX2 machine (ctest
 * runs this file once more with it): the vector width follows it. */
START_TEST(test_jit_features_env) {
  const char *f = getenv("KILN_JIT_FEATURES");
  if (f && strstr(f, "-avx512f")) ck_assert(!jit_wide_vectors());
  else ck_assert_int_eq(jit_wide_vectors(), __builtin_cpu_supports("avx512f") != 0);
}
END_TEST

/* A sum of 70 rows as a chain of adds (an unrolled loop's gradient sum):
 * one fused kernel would read 70 buffers, past what the lowering takes, and
 * the variant used to run on the interpreter. The fuser cuts the chain. */
enum { CHAIN_ROWS = 70 };
static int chain_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *acc = kiln_slice(in[0], 0, 0, 1, 1);
  for (int i = 1; i < CHAIN_ROWS; i++) acc = kiln_add(acc, kiln_mul(kiln_slice(in[0], 0, i, i + 1, 1), in[1]));
  out[0] = acc;
  return out[0] ? 0 : -1;
}

START_TEST(test_long_chain_lowers) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F64, 2, ((int64_t[]){CHAIN_ROWS, 33}), 3), *s = kiln_scalar(KILN_F64, 0.5), *y = NULL;
  kiln_options o = {.name = "chain", .n_in = 2, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(chain_body, NULL, &o);
  int saved;
  FILE *log = stderr_catch(&saved);
  ck_assert_int_eq(0, kiln_call(fn, (kiln_tensor *[]){x, s}, &y));
  ck_assert_int_eq(0, kiln_call(fn, (kiln_tensor *[]){x, s}, &y));
  char text[2048] = "";
  stderr_release(log, saved, text, sizeof text);
  ck_assert_msg(strstr(text, "interpreter") == NULL, "the variant did not lower: \"%s\"", text);
  /* the reference: row 0 plus half of every other row, summed in double by hand */
  double xd[CHAIN_ROWS * 33], yd[33];
  ck_assert_int_eq(0, kiln_read(x, xd, sizeof xd));
  ck_assert_int_eq(0, kiln_read(y, yd, sizeof yd));
  for (int j = 0; j < 33; j++) {
    double want = xd[j];
    for (int i = 1; i < CHAIN_ROWS; i++) want += 0.5 * xd[i * 33 + j];
    ck_assert_double_eq_tol(yd[j], want, 1e-12 * (1 + fabs(want)));
  }
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* Found by fuzzing (tests/fuzz/fuzz_irtext.c): compiled index_select and
 * index_add check the call's indices as eager does; they used to read and
 * write out of bounds. */
static int gather_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_index_select(in[0], 0, in[1]);
  return out[0] ? 0 : -1;
}

START_TEST(test_index_bounds) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_F32, 2, ((int64_t[]){4, 3}), 1), *y = NULL;
  kiln_tensor *ok = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){2}), ((int64_t[]){3, 0}));
  kiln_tensor *bad = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){2}), ((int64_t[]){1, 4}));
  kiln_tensor *neg = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){2}), ((int64_t[]){-1, 0}));
  kiln_options o = {.name = "gather", .n_in = 2, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(gather_body, NULL, &o);
  ck_assert_int_eq(0, kiln_call(fn, ((kiln_tensor *[]){x, ok}), &y)); /* traced */
  ck_assert_int_eq(0, kiln_call(fn, ((kiln_tensor *[]){x, ok}), &y)); /* compiled */
  ck_assert_int_eq(-1, kiln_call(fn, ((kiln_tensor *[]){x, bad}), &y));
  ck_assert_msg(strstr(kiln_last_error(), "kiln_index_select: index 4 at position 1 is out of range [0, 4)"), "%s",
                kiln_last_error());
  ck_assert_int_eq(-1, kiln_call(fn, ((kiln_tensor *[]){x, neg}), &y));
  ck_assert_msg(strstr(kiln_last_error(), "index -1 at position 0"), "%s", kiln_last_error());
  ck_assert_int_eq(0, kiln_call(fn, ((kiln_tensor *[]){x, ok}), &y)); /* still works */
  kiln_fn_stats st;
  kiln_fn_get_stats(fn, &st);
  ck_assert_int_eq(1, st.traces);
  kiln_fn_free(fn);

  /* a loaded graph: index_add's indices too */
  fn = kiln_load_string("graph g(%0: f32[4,3], %1: i64[2], %2: f32[2,3]) -> (%3)\n"
                        "  %3: f32[4,3] = index_add(%0, %1, %2) {dim=0}  # g.c:7\n");
  ck_assert_msg(fn != NULL, "%s", kiln_last_error());
  kiln_tensor *src = kiln_ones(KILN_F32, 2, ((int64_t[]){2, 3}));
  ck_assert_int_eq(0, kiln_call(fn, ((kiln_tensor *[]){x, ok, src}), &y));
  ck_assert_int_eq(-1, kiln_call(fn, ((kiln_tensor *[]){x, bad, src}), &y));
  ck_assert_msg(strstr(kiln_last_error(), "g.c:7: kiln_index_add: index 4"), "%s", kiln_last_error());
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* An update in place before a kernel that can fail on the call's data (the
 * gather's indices): the update is stored after it, so a call that fails
 * there leaves the argument as it was, data and version (an eager node
 * that saved the weight for its backward still runs it). Stored before
 * it, the weight had changed in a call that failed. The body passes no
 * number, so that the call takes the guard-only path: a recording would
 * bump the version itself. */
static int update_then_gather(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  if (kiln_sub_(in[0], kiln_mul(in[1], in[1])) == NULL) return -1;
  out[0] = kiln_index_select(kiln_exp(in[1]), 0, in[2]);
  return out[0] ? 0 : -1;
}

START_TEST(test_failed_call_leaves_updated) {
  kiln_scope_begin();
  kiln_tensor *w = kiln_randn(KILN_F32, 2, ((int64_t[]){4, 3}), 1), *x = kiln_randn(KILN_F32, 2, ((int64_t[]){4, 3}), 2);
  kiln_tensor *ok = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){2}), ((int64_t[]){3, 0}));
  kiln_tensor *bad = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){2}), ((int64_t[]){1, 4}));
  kiln_options o = {.name = "upd_gather", .n_in = 3, .n_out = 1, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(update_then_gather, NULL, &o);
  kiln_tensor *y = NULL;
  ck_assert_int_eq(0, kiln_call(fn, ((kiln_tensor *[]){w, x, ok}), &y)); /* traced */
  ck_assert_int_eq(0, kiln_call(fn, ((kiln_tensor *[]){w, x, ok}), &y)); /* compiled */
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(1, st.guard_hits); /* the body did not run: no recording moved the version */
  kiln_tensor *a = kiln_ones(KILN_F32, 2, ((int64_t[]){4, 3}));
  kiln_requires_grad(a, true);
  kiln_tensor *saved = kiln_sum_all(kiln_mul(a, w)); /* saves w for a's gradient */
  unsigned long v0 = atomic_load(&w->st->version);
  float before[12], after[12], xs[12];
  ck_assert_int_eq(0, kiln_read(w, before, sizeof before));
  ck_assert_int_eq(0, kiln_read(x, xs, sizeof xs));
  ck_assert_int_eq(-1, kiln_call(fn, ((kiln_tensor *[]){w, x, bad}), &y));
  ck_assert_msg(strstr(kiln_last_error(), "index 4 at position 1 is out of range"), "%s", kiln_last_error());
  ck_assert_int_eq(0, kiln_read(w, after, sizeof after));
  for (int i = 0; i < 12; i++) ck_assert_float_eq(before[i], after[i]);
  ck_assert_msg(atomic_load(&w->st->version) == v0, "w kept its data in a failed call, its version changed");
  ck_assert_int_eq(0, kiln_backward(saved));
  /* the update stored in place when the call goes through */
  ck_assert_int_eq(0, kiln_call(fn, ((kiln_tensor *[]){w, x, ok}), &y));
  ck_assert_int_eq(0, kiln_read(w, after, sizeof after));
  for (int i = 0; i < 12; i++) ck_assert_float_eq_tol(before[i] - xs[i] * xs[i], after[i], 1e-6f);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* Found by fuzzing (tests/fuzz/fuzz_irtext.c): a product over zero rows, or
 * a sum over zero terms, between temporaries of no bytes, whose buffers are
 * NULL (clang's UBSan, in the fuzz build, flagged the GEMM kernel's pointer
 * arithmetic on them: tests/fuzz/corpus keeps that input). The
 * results: an empty sum (zeros) and a product over nothing (zeros). */
START_TEST(test_matmul_empty_temps) {
  const char *texts[] = {"graph e(%0: f32[0,4], %1: f32[4,3]) -> (%4)\n"
                         "  %2: f32[0,4] = neg(%0)  # e.c:1\n"
                         "  %3: f32[0,3] = matmul(%2, %1)  # e.c:2\n"
                         "  %4: f32[3] = sum(%3) {axes=[0], keepdim=false}  # e.c:3\n",
                         "graph e(%0: f32[3,0], %1: f32[0,5]) -> (%5)\n"
                         "  %2: f32[3,0] = neg(%0)  # e.c:1\n"
                         "  %3: f32[0,5] = neg(%1)  # e.c:2\n"
                         "  %4: f32[3,5] = matmul(%2, %3)  # e.c:3\n"
                         "  %5: f32[3,5] = exp(%4)  # e.c:4\n"};
  int64_t sa[2][2] = {{0, 4}, {3, 0}}, sb[2][2] = {{4, 3}, {0, 5}}, ny[2] = {3, 15};
  for (int i = 0; i < 2; i++) {
    kiln_scope_begin();
    kiln_fn *fn = kiln_load_string(texts[i]);
    ck_assert_msg(fn != NULL, "%s", kiln_last_error());
    kiln_tensor *in[2] = {kiln_ones(KILN_F32, 2, sa[i]), kiln_ones(KILN_F32, 2, sb[i])}, *y = NULL;
    for (int rep = 0; rep < 2; rep++) { /* the second call reuses the buffers */
      ck_assert_msg(kiln_call(fn, in, &y) == 0, "%s", kiln_last_error());
      float v[15];
      ck_assert_int_eq(0, kiln_read(y, v, sizeof(float) * (size_t)ny[i]));
      for (int k = 0; k < ny[i]; k++) ck_assert_float_eq(v[k], i == 0 ? 0.0f : 1.0f); /* exp(0) */
    }
    kiln_fn_free(fn);
    kiln_scope_end();
  }
}
END_TEST

/* Found by fuzzing (tests/fuzz/fuzz_irtext.c, LLVM against the interpreter):
 * a node no one reads (a loaded graph is not pruned) had a buffer that lived
 * nowhere, so the planner laid it over a live one (here index_select's result). */
START_TEST(test_dead_node_buffer) {
  kiln_scope_begin();
  kiln_fn *fn = kiln_load_string("graph g(%0: f32[s0,8], %1: i64[s1], %2: f32[s0,8]) -> (%6)\n"
                                 "  sym s0 in [4, 4096]\n"
                                 "  sym s1 in [1, 64]\n"
                                 "  %3: f32[s1,8] = index_select(%0, %1) {dim=0}\n"
                                 "  %4: f32[s0,4] = slice(%0) {dim=1, start=0, end=8, step=2}\n"
                                 "  %5: f32[s0,8] = slice_scatter(%2, %4) {dim=1, start=0, end=8, step=2}\n"
                                 "  %6: f32[s0,8] = index_add(%2, %1, %3) {dim=0}\n");
  ck_assert_msg(fn != NULL, "%s", kiln_last_error());
  float a[32], b[32], y[32];
  for (int i = 0; i < 32; i++) a[i] = (float)i, b[i] = 100.0f + (float)i;
  kiln_tensor *in[3] = {kiln_tensor_from(KILN_F32, 2, ((int64_t[]){4, 8}), a),
                        kiln_tensor_from(KILN_I64, 1, ((int64_t[]){2}), ((int64_t[]){1, 1})),
                        kiln_tensor_from(KILN_F32, 2, ((int64_t[]){4, 8}), b)};
  kiln_tensor *out;
  ck_assert_int_eq(0, kiln_call(fn, in, &out));
  ck_assert_int_eq(0, kiln_read(out, y, sizeof y));
  for (int i = 0; i < 32; i++) /* row 1 gets row 1 of a twice */
    ck_assert_msg(y[i] == b[i] + (i / 8 == 1 ? 2 * a[i] : 0), "element %d: %g", i, y[i]);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* Found by fuzzing (tests/fuzz/fuzz_irtext.c, clang's UBSan): the eager
 * kernels the compiled code calls (slice_scatter, index_add here) got a
 * temporary of no bytes as a storage whose data was NULL, which eager's own
 * storage never is, and added its offset to it. The graphs: a dead
 * slice_scatter into an empty temporary (the fuzzer's input), and both ops
 * reading one, summed over zero rows (zeros). gcc's UBSan, in the test build,
 * does not check null + 0; the fuzz build's does. */
START_TEST(test_eager_kernel_empty_temps) {
  const char *texts[] = {"graph e(%0: f32[0,8], %1: f32[0,4]) -> (%0)\n"
                         "  %2: f32[0,8] = slice_scatter(%0, %1) {dim=1, start=0, end=8, step=2}  # e.c:1\n",
                         "graph e(%0: f32[0,8], %1: f32[0,4]) -> (%4)\n"
                         "  %2: f32[0,8] = neg(%0)  # e.c:1\n"
                         "  %3: f32[0,8] = slice_scatter(%2, %1) {dim=1, start=0, end=8, step=2}  # e.c:2\n"
                         "  %4: f32[8] = sum(%3) {axes=[0], keepdim=false}  # e.c:3\n",
                         "graph e(%0: f32[0,8], %1: f32[0,4], %2: i64[0]) -> (%5)\n"
                         "  %3: f32[0,8] = neg(%0)  # e.c:1\n"
                         "  %4: f32[0,8] = index_add(%3, %2, %3) {dim=0}  # e.c:2\n"
                         "  %5: f32[8] = sum(%4) {axes=[0], keepdim=false}  # e.c:3\n"};
  for (int i = 0; i < 3; i++) {
    kiln_scope_begin();
    kiln_fn *fn = kiln_load_string(texts[i]);
    ck_assert_msg(fn != NULL, "graph %d: %s", i, kiln_last_error());
    kiln_tensor *in[3] = {kiln_ones(KILN_F32, 2, ((int64_t[]){0, 8})), kiln_ones(KILN_F32, 2, ((int64_t[]){0, 4})),
                          kiln_zeros(KILN_I64, 1, ((int64_t[]){0}))};
    kiln_tensor *y = NULL;
    for (int rep = 0; rep < 2; rep++) { /* the second call reuses the buffers */
      ck_assert_msg(kiln_call(fn, in, &y) == 0, "graph %d: %s", i, kiln_last_error());
      int64_t n = kiln_numel(y);
      ck_assert_int_eq(i == 0 ? 0 : 8, n);
      float v[8] = {1, 1, 1, 1, 1, 1, 1, 1};
      ck_assert_int_eq(0, kiln_read(y, v, sizeof(float) * (size_t)n));
      for (int k = 0; k < n; k++) ck_assert_float_eq(0.0f, v[k]);
    }
    kiln_fn_free(fn);
    kiln_scope_end();
  }
}
END_TEST

/* ---- GEMM epilogues folded into the GEMM's beta ---- */

static int bias_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_add(in[2], kiln_matmul(in[0], kiln_transpose(in[1], 0, 1)));
  return 0;
}

/* one SGD step on in[1] with the gradient in[0]^T @ in[2], and a loss-like output */
static int sgd_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *grad = kiln_matmul(kiln_transpose(in[0], 0, 1), in[2]);
  out[0] = kiln_sub_(in[1], kiln_mul(kiln_scalar(KILN_F32, 0.1), grad)) ? kiln_sum_all(in[2]) : NULL;
  return out[0] ? 0 : -1;
}

START_TEST(test_gemm_folds) {
  kiln_scope_begin();
  /* x @ w^T + b: the bias fills the output first, the GEMM adds into it (beta 1) */
  kiln_tensor *lb[3] = {kiln_randn(KILN_F32, 2, ((int64_t[]){33, 70}), 1), kiln_randn(KILN_F32, 2, ((int64_t[]){20, 70}), 2),
                        kiln_randn(KILN_F32, 1, ((int64_t[]){20}), 3)};
  kiln_fn *fn = compile_once(bias_body, 3, lb);
  cg_program *p = plan_of(fn);
  ck_assert_int_eq(2, p->n_k);
  ck_assert_int_eq(CG_K_LOOP, p->k[0].kind); /* the bias, broadcast into the output */
  ck_assert_int_eq(CG_K_MATMUL, p->k[1].kind);
  ck_assert(p->k[1].beta == 1.0 && p->k[1].alpha == 1.0);
  ck_assert_int_eq(p->k[0].out_buf, p->k[1].out_buf);
  ck_assert_int_eq(CG_BUF_OUTPUT, p->buf[p->k[1].out_buf].kind); /* no buffer for the bare product */
  free_plan(p);
  kiln_fn_free(fn);

  /* w -= 0.1 * x^T @ dy: one GEMM into w (alpha -0.1, beta 1), no update kernel, nothing copied back */
  int64_t xs[2] = {16, 12}, ws[2] = {12, 5}, ds[2] = {16, 5}; /* 12 rows: BLAS, not dot products */
  {
    /* with check mode too, which runs the kernels twice from the same start */
    for (int check = 0; check < 2; check++) {
      kiln_tensor *x = kiln_randn(KILN_F32, 2, xs, 4), *dy = kiln_randn(KILN_F32, 2, ds, 5);
      kiln_tensor *wc = kiln_randn(KILN_F32, 2, ws, 6);
      kiln_tensor *we = kiln_mul(wc, kiln_scalar(KILN_F32, 1)); /* a copy for eager */
      kiln_options o = {.name = "sgd", .n_in = 3, .n_out = 1, .backend = KILN_BACKEND_LLVM, .check = check};
      fn = kiln_compile(sgd_body, NULL, &o);
      for (int step = 0; step < 3; step++) {
        kiln_tensor *y = NULL, *ref = NULL;
        ck_assert_int_eq(0, kiln_call(fn, ((kiln_tensor *[]){x, wc, dy}), &y));
        ck_assert_int_eq(0, sgd_body(NULL, ((kiln_tensor *[]){x, we, dy}), &ref));
        int64_t bad;
        double d = maxdiff_rel(wc, we, &bad);
        ck_assert_msg(d <= 1e-5, "check %d step %d: w differs by %g at %lld", check, step, d, (long long)bad);
      }
      kiln_fn_stats st;
      ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
      ck_assert_int_eq(2, st.hits);
      ck_assert_int_eq(0, st.check_fails);
      p = plan_of(fn);
      ck_assert_int_eq(1, count_kind(p, CG_K_MATMUL));
      ck_assert_int_eq(2, p->n_k); /* the GEMM and the sum */
      for (int k = 0; k < p->n_k; k++)
        if (p->k[k].kind == CG_K_MATMUL) {
          ck_assert(p->k[k].beta == 1.0 && p->k[k].alpha == -(double)0.1f);
          int ob = p->k[k].out_buf;
          ck_assert_int_ge(p->buf[ob].alias_of, 0);
          ck_assert_int_eq(CG_BUF_INPUT, p->buf[p->buf[ob].alias_of].kind); /* stored in w itself */
        }
      free_plan(p);
      kiln_fn_free(fn);
    }
  }
  kiln_scope_end();
}
END_TEST

/* ---- write-backs stored in place ---- */

#define F32(x) kiln_scalar(KILN_F32, x)

/* a moment and a weight updated from a gradient (in[0]): m = 0.9 m + 0.1 g^2, w -= 0.01 m */
static int moment_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *g2 = kiln_mul(in[0], in[0]);
  bool ok = kiln_mul_(in[2], F32(0.9)) && kiln_add_(in[2], kiln_mul(g2, F32(0.1))) &&
            kiln_sub_(in[1], kiln_mul(in[2], F32(0.01)));
  out[0] = ok ? kiln_sum_all(in[0]) : NULL;
  return out[0] ? 0 : -1;
}

/* w's old value, read by a sum that fusion may place after the update */
static int stale_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  kiln_tensor *y = kiln_mul(in[1], in[0]);
  out[0] = kiln_sub_(in[1], kiln_mul(in[0], F32(0.1))) ? kiln_sum_all(y) : NULL;
  return out[0] ? 0 : -1;
}

/* The writes whose value a kernel stores in the argument itself; each such
 * kernel is the last to touch the argument, and reads it only where it stores. */
static int writes_in_place(const cg_program *p) {
  const ir_graph *g = p->g;
  int n = 0;
  for (int i = 0; i < g->n_writes; i++) {
    int b = p->node_buf[g->writes[i].target];
    if (g->writes[i].kind != IR_WRITE_DATA || p->views[g->writes[i].value].buf != b) continue;
    ck_assert(p->buf[b].kind == CG_BUF_INPUT && p->buf[b].updated);
    int last = -1;
    for (int k = 0; k < p->n_k; k++) {
      for (int a = 0; a < p->k[k].n_acc; a++)
        if (p->k[k].acc[a].buf == b) last = k;
      for (int j = 0; j < 3; j++)
        if (p->k[k].in_buf[j] == b || p->k[k].out_buf == b) last = k;
    }
    ck_assert_int_ge(last, 0);
    const cg_kernel *k = &p->k[last];
    ck_assert_int_eq(CG_K_LOOP, k->kind);
    for (int a = 0; a < k->n_acc; a++)
      if (k->acc[a].buf == b) ck_assert(sym_same(k->acc[a].offset, k->acc[k->stage[0].store].offset));
    n++;
  }
  return n;
}

/* A param's new value is stored into it by the kernel that makes it (no temp
 * kept to the end and copied over it), in check mode too, which runs the
 * kernels before the real call and so must update a copy; a kernel that
 * reads the old value after the update keeps it out of place. Three steps
 * against eager on copies. */
START_TEST(test_write_back_in_place) {
  kiln_scope_begin();
  int64_t s[2] = {7, 33};
  for (int which = 0; which < 2; which++)
    for (int check = 0; check < 2; check++) {
      body_fn body = which ? stale_body : moment_body;
      kiln_tensor *x = kiln_randn(KILN_F32, 2, s, 1), *wc = kiln_randn(KILN_F32, 2, s, 2), *mc = kiln_randn(KILN_F32, 2, s, 3);
      kiln_tensor *we = kiln_mul(wc, F32(1)), *me = kiln_mul(mc, F32(1)); /* copies for eager */
      kiln_options o = {.name = "update", .n_in = which ? 2 : 3, .n_out = 1, .backend = KILN_BACKEND_LLVM, .check = check,
                        .capture = KILN_CAPTURE_GUARDS}; /* the path whose check runs the kernels */
      kiln_fn *fn = kiln_compile(body, NULL, &o);
      for (int step = 0; step < 3; step++) {
        kiln_tensor *y = NULL, *ref = NULL;
        ck_assert_int_eq(0, kiln_call(fn, ((kiln_tensor *[]){x, wc, mc}), &y));
        ck_assert_int_eq(0, body(NULL, ((kiln_tensor *[]){x, we, me}), &ref));
        int64_t bad;
        ck_assert_msg(maxdiff_rel(y, ref, &bad) <= 1e-5, "body %d check %d step %d: output", which, check, step);
        ck_assert_msg(maxdiff_rel(wc, we, &bad) <= 1e-6, "body %d check %d step %d: w at %lld", which, check, step,
                      (long long)bad);
        ck_assert_msg(maxdiff_rel(mc, me, &bad) <= 1e-6, "body %d check %d step %d: m at %lld", which, check, step,
                      (long long)bad);
      }
      kiln_fn_stats st;
      ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
      ck_assert_int_eq(2, st.hits);
      ck_assert_int_eq(0, st.check_fails);
      cg_program *p = plan_of(fn);
      int n = writes_in_place(p);
      if (!which) {
        ck_assert_int_eq(2, n); /* m and w */
        for (int b = 0; b < p->n_buf; b++) /* no temp as large as a weight */
          ck_assert(p->buf[b].kind != CG_BUF_TEMP || p->buf[b].alias_of >= 0 || p->buf[b].first < 0 || p->buf[b].ndim < 2);
      }
      free_plan(p);
      kiln_fn_free(fn);
    }
  kiln_scope_end();
}
END_TEST

#undef F32

static Suite *suite(void) {
  Suite *s = suite_create("codegen");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 900);
  tcase_add_test(tc, test_fusion_plans);
  tcase_add_test(tc, test_large_result_made_late);
  tcase_add_test(tc, test_large_result_before_its_peer);
  tcase_add_test(tc, test_threads_bitwise);
  tcase_add_test(tc, test_random_programs);
  tcase_add_test(tc, test_random_programs_quick);
  tcase_add_test(tc, test_random_programs_c);
  tcase_add_test(tc, test_random_programs_replayed);
  tcase_add_test(tc, test_random_programs_more_ops);
  tcase_add_test(tc, test_random_programs_regions);
  tcase_add_test(tc, test_llvm_fatal_error);
  tcase_add_test(tc, test_index_bounds);
  tcase_add_test(tc, test_failed_call_leaves_updated);
  tcase_add_test(tc, test_long_chain_lowers);
  tcase_add_test(tc, test_jit_features_env);
  tcase_add_test(tc, test_dead_node_buffer);
  tcase_add_test(tc, test_matmul_empty_temps);
  tcase_add_test(tc, test_eager_kernel_empty_temps);
  tcase_add_test(tc, test_gemm_folds);
  tcase_add_test(tc, test_write_back_in_place);
  tcase_add_test(tc, test_full_reduce_blocks);
  tcase_add_test(tc, test_masked_tails);
  tcase_add_test(tc, test_dot_products_fused);
  tcase_add_test(tc, test_two_sums_grouped);
  tcase_add_test(tc, test_reduce_epilogues);
  tcase_add_test(tc, test_column_reductions);
  tcase_add_test(tc, test_matvec_in_out_panels);
  tcase_add_test(tc, test_shared_kernels);
  tcase_add_test(tc, test_op_numbers_in_signature);
  tcase_add_test(tc, test_new_pointwise_compiled);
  tcase_add_test(tc, test_norms_compiled);
  tcase_add_test(tc, test_data_movement_compiled);
  tcase_add_test(tc, test_attrs_from_sizes);
  tcase_add_test(tc, test_index_copy_inplace_compiled);
  tcase_add_test(tc, test_tied_rows_added_in_place);
  tcase_add_test(tc, test_index_add_to_bits);
  tcase_add_test(tc, test_loss_exps_take_logits);
  tcase_add_test(tc, test_select_compiled);
  tcase_add_test(tc, test_split_dynamic);
  tcase_add_test(tc, test_coalesced_loops);
  tcase_add_test(tc, test_short_rows_one_chain_each);
  tcase_add_test(tc, test_quick_codegen);
  tcase_add_test(tc, test_own_vectors);
  tcase_add_test(tc, test_row_merges);
  tcase_add_test(tc, test_whole_rows);
  tcase_add_test(tc, test_empty_temporary);
  tcase_add_test(tc, test_residual_chain_stored);
  tcase_add_test(tc, test_cat_keeps_every_operand);
  tcase_add_test(tc, test_grad_accumulates_into_gemm);
#ifdef KILN_TEST_BUILD
  tcase_add_test(tc, test_forced_faults);
  tcase_add_test(tc, test_failed_lowering_stops_threads);
  tcase_add_test(tc, test_op_without_emitter);
#endif
  suite_add_tcase(s, tc);
  TCase *hot = tcase_create("hot");
  tcase_set_timeout(hot, 300);
  tcase_add_checked_fixture(hot, hot_setup, hot_teardown);
  tcase_add_test(hot, test_matvec_threads);
  suite_add_tcase(s, hot);
  return s;
}

int main(void) {
  SRunner *r = srunner_create(suite());
  srunner_run_all(r, CK_NORMAL);
  int failed = srunner_ntests_failed(r);
  srunner_free(r);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
