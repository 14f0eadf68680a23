/* Ahead-of-time export (src/codegen/export.c, src/rt/rt.c): a compiled MLP
 * is exported, linked into a C program with libkiln_rt alone
 * (tests/export/app.c; no libkiln, no LLVM: ldd shows neither) and run at
 * several batch sizes through one export. Its outputs must equal kiln's
 * compiled outputs and a plain C reference in double; calls its guards
 * refuse must be errors that say why; params as inputs, variant choice,
 * caller's output buffers and the refusals of what the runtime cannot run.
 *
 * The build passes the compiler, flags and libkiln_rt (KILN_TEST_*); with
 * KILN_CROSS_CC and KILN_CROSS_RUN set (make test-cross) the same calls also
 * run on AArch64 under qemu. KEEP=1 leaves the files in /tmp/kiln_export.*. */
#include <check.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../examples/gpt.h"
#include "kiln.h"

#define NELEM(a) ((int)(sizeof(a) / sizeof((a)[0])))

enum { IN = 16, HID = 32, OUT = 8 };

/* ---- the model, and its reference in double ---- */

typedef struct mlp {
  float w1[IN * HID], b1[HID], w2[HID * OUT], b2[OUT];
  kiln_tensor *t[4];
} mlp;

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float uniform(void) { /* in [-1, 1) */
  rng = rng * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((double)(rng >> 11) / (double)(1ull << 53) * 2 - 1);
}

static void mlp_init(mlp *m) {
  for (int i = 0; i < IN * HID; i++) m->w1[i] = uniform() * 0.3f;
  for (int i = 0; i < HID; i++) m->b1[i] = uniform() * 0.1f;
  for (int i = 0; i < HID * OUT; i++) m->w2[i] = uniform() * 0.3f;
  for (int i = 0; i < OUT; i++) m->b2[i] = uniform() * 0.1f;
  m->t[0] = kiln_tensor_from(KILN_F32, 2, (int64_t[]){IN, HID}, m->w1);
  m->t[1] = kiln_tensor_from(KILN_F32, 1, (int64_t[]){HID}, m->b1);
  m->t[2] = kiln_tensor_from(KILN_F32, 2, (int64_t[]){HID, OUT}, m->w2);
  m->t[3] = kiln_tensor_from(KILN_F32, 1, (int64_t[]){OUT}, m->b2);
  for (int i = 0; i < 4; i++) ck_assert_ptr_nonnull(m->t[i]);
}

static void mlp_free(mlp *m) {
  for (int i = 0; i < 4; i++) kiln_release(m->t[i]);
}

/* y = gelu(x @ w1 + b1) @ w2 + b2 and softmax(y) over the last dim. MLP_LINE
 * is the line that first uses w2 and b2: unnamed, they are named after it. */
enum { MLP_LINE = __LINE__ + 4 };
static int mlp_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  mlp *m = ctx;
  kiln_tensor *h = kiln_gelu(kiln_add(kiln_matmul(in[0], m->t[0]), m->t[1]));
  kiln_tensor *y = kiln_add(kiln_matmul(h, m->t[2]), m->t[3]);
  out[0] = y;
  out[1] = kiln_softmax(y, -1);
  return y && out[1] ? 0 : -1;
}

static void mlp_ref(const mlp *m, const float *x, int64_t b, double *y, double *sm) {
  for (int64_t r = 0; r < b; r++) {
    double h[HID];
    for (int j = 0; j < HID; j++) {
      double a = m->b1[j];
      for (int i = 0; i < IN; i++) a += (double)x[r * IN + i] * m->w1[i * HID + j];
      h[j] = 0.5 * a * (1 + tanh(sqrt(2 / M_PI) * (a + 0.044715 * a * a * a)));
    }
    double mx = -INFINITY, s = 0;
    for (int j = 0; j < OUT; j++) {
      double a = m->b2[j];
      for (int i = 0; i < HID; i++) a += h[i] * m->w2[i * OUT + j];
      y[r * OUT + j] = a;
      mx = a > mx ? a : mx;
    }
    for (int j = 0; j < OUT; j++) s += exp(y[r * OUT + j] - mx);
    for (int j = 0; j < OUT; j++) sm[r * OUT + j] = exp(y[r * OUT + j] - mx) / s;
  }
}

/* ---- building and running the app ---- */

static char dir[64];

static void make_dir(void) {
  snprintf(dir, sizeof dir, "/tmp/kiln_export.XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(dir));
}

static void remove_dir(void) {
  const char *keep = getenv("KEEP");
  if (keep && !strcmp(keep, "1")) {
    fprintf(stderr, "kept %s\n", dir);
    return;
  }
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  ck_assert_int_eq(0, system(cmd));
}

static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...) {
  char cmd[4096];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof cmd, fmt, ap);
  va_end(ap);
  int rc = system(cmd);
  if (rc) fprintf(stderr, "failed (%d): %s\n", rc, cmd);
  return rc;
}

/* Builds dir/app_<name> from model dir/<name>.o with the host's compiler. */
static void build_app(const char *name) {
  ck_assert_int_eq(0, sh("%s %s -I%s -I%s -DMODEL_H='\"%s.h\"' -DRUN=%s_run -DERROR=%s_error %s %s/%s.o %s %s -lm -lpthread "
                         "-o %s/app_%s",
                         KILN_TEST_CC, KILN_TEST_SAN, dir, KILN_TEST_INCLUDE, name, name, name, KILN_TEST_APP, dir, name,
                         KILN_TEST_RT_LIB, KILN_TEST_BLAS, dir, name));
}

/* Builds dir/app_<name> with cc, compiling libkiln_rt from its sources
 * without OpenBLAS (as a cross build does: docs/deploy.md). */
static void build_app_src(const char *name, const char *cc, const char *flags) {
  const char *src = KILN_TEST_SRC;
  ck_assert_int_eq(0, sh("%s %s -O2 -std=c17 -D_DEFAULT_SOURCE -DKILN_RT_NO_BLAS -I%s -I%s/include -I%s/src "
                         "-DMODEL_H='\"%s.h\"' -DRUN=%s_run -DERROR=%s_error %s %s/src/rt/rt.c %s/src/rt/arena.c "
                         "%s/src/rt/loop.c %s/src/eager/pool.c %s/%s.o -lm -lpthread -o %s/app_%s",
                         cc, flags, dir, src, src, name, name, name, KILN_TEST_APP, src, src, src, src, dir, name, dir,
                         name));
}

/* What runs the app: "" natively, qemu for a cross build. */
static const char *runner = "";

/* A request's calls. */
typedef struct call {
  int n_in;
  const void *data[6];
  int ndim[6];
  int64_t shape[6][4];
  int es[6]; /* element sizes; 0: 4 */
} call;

/* Runs dir/app_<name> on calls (n_out f32 outputs each); the reply's path. */
static void run_app(const char *name, const call *calls, int n, int n_out, const char *env) {
  char req[128], rep[128];
  snprintf(req, sizeof req, "%s/req", dir);
  snprintf(rep, sizeof rep, "%s/rep", dir);
  FILE *f = fopen(req, "wb");
  ck_assert_ptr_nonnull(f);
  int64_t w = n;
  fwrite(&w, 8, 1, f);
  for (int c = 0; c < n; c++) {
    int64_t h[2] = {calls[c].n_in, n_out};
    fwrite(h, 8, 2, f);
    for (int i = 0; i < calls[c].n_in; i++) {
      int64_t es = calls[c].es[i] ? calls[c].es[i] : 4, nd = calls[c].ndim[i], numel = 1;
      fwrite(&es, 8, 1, f), fwrite(&nd, 8, 1, f);
      for (int d = 0; d < nd; d++) fwrite(&calls[c].shape[i][d], 8, 1, f), numel *= calls[c].shape[i][d];
      fwrite(calls[c].data[i], (size_t)es, (size_t)numel, f);
    }
    for (int i = 0; i < n_out; i++) {
      int64_t es = 4;
      fwrite(&es, 8, 1, f);
    }
  }
  ck_assert_int_eq(0, fclose(f));
  ck_assert_int_eq(0, sh("cd %s && %s %s ./app_%s req rep", dir, env ? env : "", runner, name));
}

/* The next reply of f: rc, then (rc 0) the outputs into out[i] (malloc'ed,
 * shape in shapes[i]) or (rc -1) the message into msg. */
static int64_t next_reply(FILE *f, int n_out, float **out, int64_t (*shapes)[4], int *ndim, char *msg, size_t mn) {
  int64_t rc;
  ck_assert_int_eq(1, (int)fread(&rc, 8, 1, f));
  if (rc) {
    int64_t len;
    ck_assert_int_eq(1, (int)fread(&len, 8, 1, f));
    ck_assert(len >= 0 && (size_t)len < mn);
    ck_assert_int_eq(len, (int64_t)fread(msg, 1, (size_t)len, f));
    msg[len] = 0;
    return rc;
  }
  ck_assert_msg(out != NULL, "the call succeeded where an error was expected");
  for (int i = 0; i < n_out; i++) {
    int64_t nd, numel = 1;
    ck_assert_int_eq(1, (int)fread(&nd, 8, 1, f));
    ndim[i] = (int)nd;
    for (int d = 0; d < nd; d++) {
      ck_assert_int_eq(1, (int)fread(&shapes[i][d], 8, 1, f));
      numel *= shapes[i][d];
    }
    out[i] = malloc((size_t)numel * 4 + 4);
    ck_assert_int_eq(numel, (int64_t)fread(out[i], 4, (size_t)numel, f));
  }
  return 0;
}

static FILE *open_reply(void) {
  char rep[128];
  snprintf(rep, sizeof rep, "%s/rep", dir);
  FILE *f = fopen(rep, "rb");
  ck_assert_ptr_nonnull(f);
  return f;
}

/* max |a - b| / (1 + |b|) over n values, with the first bad index */
static void expect_close(const char *what, const float *a, const double *b, int64_t n, double tol) {
  double worst = 0;
  int64_t at = -1;
  for (int64_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - b[i]) / (1 + fabs(b[i]));
    if (!(d <= worst)) worst = d, at = i;
  }
  ck_assert_msg(worst <= tol, "%s: max relative error %g at %lld (%g vs %g)", what, worst, (long long)at,
                at >= 0 ? (double)a[at] : 0.0, at >= 0 ? b[at] : 0.0);
}

/* kiln's compiled outputs for x (b rows), as doubles. */
static void kiln_outputs(kiln_fn *fn, const float *x, int64_t b, double *y, double *sm) {
  kiln_scope_begin();
  kiln_tensor *in = kiln_tensor_from(KILN_F32, 2, (int64_t[]){b, IN}, x), *out[2] = {0};
  ck_assert_int_eq(0, kiln_call(fn, &in, out));
  float *t = malloc((size_t)b * OUT * 4);
  ck_assert_int_eq(0, kiln_read(out[0], t, (size_t)b * OUT * 4));
  for (int64_t i = 0; i < b * OUT; i++) y[i] = t[i];
  ck_assert_int_eq(0, kiln_read(out[1], t, (size_t)b * OUT * 4));
  for (int64_t i = 0; i < b * OUT; i++) sm[i] = t[i];
  free(t);
  kiln_scope_end();
}

static float *random_x(int64_t b) {
  float *x = malloc((size_t)(b * IN) * 4 + 4);
  for (int64_t i = 0; i < b * IN; i++) x[i] = uniform();
  return x;
}

/* A compiled MLP whose batch is symbolic from the first call (at batch 3). */
static kiln_fn *mlp_fn(mlp *m) {
  kiln_fn *fn = kiln_compile(mlp_body, m, &(kiln_options){.name = "mlp", .n_in = 1, .n_out = 2});
  ck_assert_ptr_nonnull(fn);
  ck_assert_int_eq(0, kiln_mark_dynamic(fn, 0, 0));
  float *x = random_x(3);
  double y[3 * OUT], sm[3 * OUT];
  kiln_outputs(fn, x, 3, y, sm);
  free(x);
  return fn;
}

/* ---- cases ---- */

START_TEST(test_mlp_sizes) {
  mlp m;
  mlp_init(&m);
  kiln_fn *fn = mlp_fn(&m);
  make_dir();
  char prefix[128];
  snprintf(prefix, sizeof prefix, "%s/mlp", dir);
  ck_assert_msg(kiln_export(fn, prefix, &(kiln_export_options){.name = "mlp"}) == 0, "%s", kiln_last_error());
  build_app("mlp");
  /* no libkiln, no LLVM in what the program loads */
  ck_assert_int_eq(0, sh("ldd %s/app_mlp > %s/ldd.txt && ! grep -i -e llvm -e 'libkiln\\.' %s/ldd.txt", dir, dir, dir));
  /* batch 2, 7 and 64 run; the wrong feature count, rank and a NULL input are errors */
  int64_t sizes[3] = {2, 7, 64};
  float *xs[3], *bad = random_x(4);
  call calls[6];
  for (int c = 0; c < 3; c++) {
    xs[c] = random_x(sizes[c]);
    calls[c] = (call){1, {xs[c]}, {2}, {{sizes[c], IN}}, {0}};
  }
  calls[3] = (call){1, {bad}, {2}, {{4, IN - 1}}, {0}};
  calls[4] = (call){1, {bad}, {3}, {{2, 2, IN}}, {0}};
  calls[5] = (call){1, {bad}, {2}, {{0, IN}}, {0}}; /* batch 0: below s0's bound or an empty result */
  run_app("mlp", calls, 6, 2, NULL);
  FILE *f = open_reply();
  for (int c = 0; c < 3; c++) {
    float *out[2];
    int64_t shapes[2][4];
    int ndim[2];
    char msg[512];
    int64_t b = sizes[c];
    ck_assert_msg(next_reply(f, 2, out, shapes, ndim, msg, sizeof msg) == 0, "batch %lld: %s", (long long)b, msg);
    ck_assert_int_eq(2, ndim[0]);
    ck_assert_int_eq(b, shapes[0][0]);
    ck_assert_int_eq(OUT, shapes[0][1]);
    double *y = malloc((size_t)(b * OUT) * 8), *sm = malloc((size_t)(b * OUT) * 8);
    mlp_ref(&m, xs[c], b, y, sm);
    expect_close("y against the reference", out[0], y, b * OUT, 1e-5);
    expect_close("softmax against the reference", out[1], sm, b * OUT, 1e-5);
    kiln_outputs(fn, xs[c], b, y, sm);
    expect_close("y against kiln", out[0], y, b * OUT, 1e-6);
    expect_close("softmax against kiln", out[1], sm, b * OUT, 1e-6);
    free(y), free(sm), free(out[0]), free(out[1]);
  }
  const char *want[2] = {"dim 1 is 15, the model takes 16", "has rank 3, the model takes 2"};
  for (int c = 0; c < 2; c++) {
    char msg[512];
    ck_assert_int_eq(-1, next_reply(f, 2, NULL, NULL, NULL, msg, sizeof msg));
    ck_assert_msg(strstr(msg, "mlp_run: ") == msg && strstr(msg, want[c]), "message: %s", msg);
  }
  /* batch 0: the symbol's bounds decide; either an error that names s0 or an empty output */
  {
    float *out[2] = {0};
    int64_t shapes[2][4];
    int ndim[2];
    char msg[512];
    if (next_reply(f, 2, out, shapes, ndim, msg, sizeof msg)) ck_assert_msg(strstr(msg, "s0"), "message: %s", msg);
    else ck_assert_int_eq(0, shapes[0][0]);
    free(out[0]), free(out[1]);
  }
  fclose(f);
  for (int c = 0; c < 3; c++) free(xs[c]);
  free(bad);
  remove_dir();
  kiln_fn_free(fn);
  mlp_free(&m);
}
END_TEST

/* The params as inputs after x: the same numbers from weights the caller passes. */
START_TEST(test_params_as_inputs) {
  mlp m;
  mlp_init(&m);
  kiln_fn *fn = mlp_fn(&m);
  make_dir();
  char prefix[128];
  snprintf(prefix, sizeof prefix, "%s/mlpp", dir);
  ck_assert_msg(kiln_export(fn, prefix, &(kiln_export_options){.name = "mlpp", .params_as_inputs = 1}) == 0, "%s",
                kiln_last_error());
  build_app("mlpp");
  char hdr[160];
  snprintf(hdr, sizeof hdr, "%s/mlpp.h", dir);
  /* b2, the second param first used at test_export.c:MLP_LINE, is named so */
  ck_assert_int_eq(0, sh("grep -q 'in\\[4\\]  test_export_c_%d_1 *f32\\[8\\]' %s && grep -q 'in\\[0\\]  in0 *f32\\[s0, 16\\]' %s",
                         MLP_LINE, hdr, hdr));
  float *x = random_x(5);
  mlp m2 = m; /* other weights: the export must use the ones passed */
  for (int i = 0; i < IN * HID; i++) m2.w1[i] = uniform() * 0.3f;
  call c = {5, {x, m2.w1, m2.b1, m2.w2, m2.b2}, {2, 2, 1, 2, 1}, {{5, IN}, {IN, HID}, {HID}, {HID, OUT}, {OUT}}, {0}};
  /* the params in the wrong order: shapes that do not fit, an error */
  call wrong = {5, {x, m2.w2, m2.b1, m2.w1, m2.b2}, {2, 2, 1, 2, 1}, {{5, IN}, {HID, OUT}, {HID}, {IN, HID}, {OUT}}, {0}};
  call both[2] = {c, wrong};
  run_app("mlpp", both, 2, 2, NULL);
  FILE *f = open_reply();
  float *out[2];
  int64_t shapes[2][4];
  int ndim[2];
  char msg[512];
  ck_assert_msg(next_reply(f, 2, out, shapes, ndim, msg, sizeof msg) == 0, "%s", msg);
  double y[5 * OUT], sm[5 * OUT];
  mlp_ref(&m2, x, 5, y, sm);
  expect_close("y with the weights passed", out[0], y, 5 * OUT, 1e-5);
  expect_close("softmax with the weights passed", out[1], sm, 5 * OUT, 1e-5);
  free(out[0]), free(out[1]);
  ck_assert_int_eq(-1, next_reply(f, 2, NULL, NULL, NULL, msg, sizeof msg));
  char want[128];
  snprintf(want, sizeof want, "input 1 (test_export_c_%d) dim 0 is 32, the model takes 16", MLP_LINE - 1);
  ck_assert_msg(strstr(msg, want), "message: %s", msg);
  fclose(f);
  free(x);
  remove_dir();
  kiln_fn_free(fn);
  mlp_free(&m);
}
END_TEST

/* Every size its own variant: variant 1 (batch 3) refuses batch 5, the
 * newest (batch 5) runs it; the caller's own output buffers. */
START_TEST(test_variants) {
  mlp m;
  mlp_init(&m);
  kiln_fn *fn = kiln_compile(mlp_body, &m, &(kiln_options){.name = "mlp", .n_in = 1, .n_out = 2, .dynamic = KILN_DYNAMIC_STATIC});
  ck_assert_ptr_nonnull(fn);
  float *x3 = random_x(3), *x5 = random_x(5);
  double y[5 * OUT], sm[5 * OUT];
  kiln_outputs(fn, x3, 3, y, sm);
  kiln_outputs(fn, x5, 5, y, sm);
  make_dir();
  char prefix[128];
  snprintf(prefix, sizeof prefix, "%s/first", dir);
  ck_assert_msg(kiln_export(fn, prefix, &(kiln_export_options){.name = "first", .variant = 1}) == 0, "%s", kiln_last_error());
  snprintf(prefix, sizeof prefix, "%s/newest", dir);
  ck_assert_msg(kiln_export(fn, prefix, &(kiln_export_options){.name = "newest"}) == 0, "%s", kiln_last_error());
  ck_assert_int_eq(-1, kiln_export(fn, prefix, &(kiln_export_options){.name = "x", .variant = 3}));
  ck_assert_msg(strstr(kiln_last_error(), "test_export.c:") && strstr(kiln_last_error(), "variant 3 is not one"), "%s",
                kiln_last_error());
  build_app("first");
  build_app("newest");
  /* kiln_save_variant picks the same way: the first variant's graph is batch 3, the newest batch 5 */
  char path[128];
  snprintf(path, sizeof path, "%s/first.kiln", dir);
  ck_assert_int_eq(0, kiln_save_variant(fn, path, 1));
  ck_assert_int_eq(0, sh("head -1 %s | grep -qx 'version 1' && grep -q 'f32\\[3,16\\]' %s", path, path));
  ck_assert_int_eq(0, kiln_save(fn, path));
  ck_assert_int_eq(0, sh("grep -q 'f32\\[5,16\\]' %s && ! grep -q 'f32\\[3,16\\]' %s", path, path));
  ck_assert_int_eq(-1, kiln_save_variant(fn, path, 3));
  ck_assert_msg(strstr(kiln_last_error(), "variant 3 is not one"), "%s", kiln_last_error());
  call c[2] = {{1, {x3}, {2}, {{3, IN}}, {0}}, {1, {x5}, {2}, {{5, IN}}, {0}}};
  char msg[512];
  float *out[2];
  int64_t shapes[2][4];
  int ndim[2];
  run_app("first", c, 2, 2, NULL);
  FILE *f = open_reply();
  ck_assert_int_eq(0, next_reply(f, 2, out, shapes, ndim, msg, sizeof msg));
  free(out[0]), free(out[1]);
  ck_assert_int_eq(-1, next_reply(f, 2, NULL, NULL, NULL, msg, sizeof msg));
  ck_assert_msg(strstr(msg, "first_run: input 0 (in0) dim 0 is 5, the model takes 3"), "message: %s", msg);
  fclose(f);
  /* the caller's buffers: the first call's shape is kept, so batch 3 after 5 is an error */
  call c2[2] = {c[1], c[0]};
  run_app("newest", c2, 2, 2, "KILN_APP_OUT_BUFFERS=1");
  f = open_reply();
  ck_assert_int_eq(0, next_reply(f, 2, out, shapes, ndim, msg, sizeof msg));
  mlp_ref(&m, x5, 5, y, sm);
  expect_close("newest", out[0], y, 5 * OUT, 1e-5);
  free(out[0]), free(out[1]);
  ck_assert_int_eq(-1, next_reply(f, 2, NULL, NULL, NULL, msg, sizeof msg));
  ck_assert_msg(strstr(msg, "newest_run: input 0 (in0) dim 0 is 3, the model takes 5"), "message: %s", msg);
  fclose(f);
  free(x3), free(x5);
  remove_dir();
  kiln_fn_free(fn);
  mlp_free(&m);
}
END_TEST

/* The GPT's next-byte logits (examples/gpt.h), its length symbolic: one
 * export serves lengths 3 .. 8, equal to kiln compiled and eager; a length
 * past the mask's 8 and a byte past the vocabulary are errors. */
static void gpt_forward(const char *target, const char *cc) {
  gpt_config c = {.n_layer = 2, .n_head = 2, .n_embd = 16, .block_size = 8, .vocab_size = 64, .dtype = KILN_F32,
                  .opt = GPT_ADAMW_DEFAULT};
  gpt g;
  ck_assert_int_eq(0, gpt_init(&g, &c, 8));
  kiln_fn *fn = kiln_compile(gpt_next_body, &g, &(kiln_options){.name = "next", .n_in = 1, .n_out = 1});
  ck_assert_ptr_nonnull(fn);
  ck_assert_int_eq(0, kiln_mark_dynamic(fn, 0, 1));
  int64_t tok[4][9];
  uint64_t seed = 5;
  for (int i = 0; i < 4; i++)
    for (int t = 0; t < 9; t++) tok[i][t] = (int64_t)(gpt_rand(&seed) % 64);
  tok[3][2] = 64; /* past the vocabulary */
  kiln_scope_begin();
  kiln_tensor *idx = kiln_tensor_from(KILN_I64, 2, ((int64_t[]){1, 5}), tok[0]), *got = NULL;
  ck_assert_msg(kiln_call(fn, &idx, &got) == 0, "%s", kiln_last_error());
  kiln_scope_end();
  make_dir();
  char prefix[128];
  snprintf(prefix, sizeof prefix, "%s/gpt", dir);
  ck_assert_msg(kiln_export(fn, prefix, &(kiln_export_options){.name = "gpt", .target = target}) == 0, "%s",
                kiln_last_error());
  if (cc) build_app_src("gpt", cc, "");
  else build_app("gpt");
  int64_t lens[3] = {3, 8, 5};
  call calls[5];
  for (int i = 0; i < 3; i++) calls[i] = (call){1, {tok[i]}, {2}, {{1, lens[i]}}, {8}};
  calls[3] = (call){1, {tok[0]}, {2}, {{1, 9}}, {8}};
  calls[4] = (call){1, {tok[3]}, {2}, {{1, 4}}, {8}};
  run_app("gpt", calls, 5, 1, NULL);
  FILE *f = open_reply();
  for (int i = 0; i < 3; i++) {
    float *out[1];
    int64_t shapes[1][4];
    int ndim[1];
    char msg[512];
    ck_assert_msg(next_reply(f, 1, out, shapes, ndim, msg, sizeof msg) == 0, "T %lld: %s", (long long)lens[i], msg);
    ck_assert_int_eq(2, ndim[0]);
    ck_assert_int_eq(64, shapes[0][1]);
    kiln_scope_begin();
    kiln_tensor *x = kiln_tensor_from(KILN_I64, 2, ((int64_t[]){1, lens[i]}), tok[i]), *jit = NULL;
    ck_assert_int_eq(0, kiln_call(fn, &x, &jit));
    kiln_tensor *eager = gpt_next_logits(&g, x);
    float a[64], b[64];
    double da[64], db[64];
    ck_assert_int_eq(0, kiln_read(jit, a, sizeof a));
    ck_assert_int_eq(0, kiln_read(eager, b, sizeof b));
    for (int j = 0; j < 64; j++) da[j] = a[j], db[j] = b[j];
    expect_close("logits against kiln", out[0], da, 64, 1e-5);
    expect_close("logits against eager", out[0], db, 64, 1e-5);
    kiln_scope_end();
    free(out[0]);
  }
  char msg[512];
  ck_assert_int_eq(-1, next_reply(f, 1, NULL, NULL, NULL, msg, sizeof msg));
  ck_assert_msg(strstr(msg, "gpt_run: the inputs break the guard s0 <= 8") && strstr(msg, "s0 = 9"), "message: %s", msg);
  ck_assert_int_eq(-1, next_reply(f, 1, NULL, NULL, NULL, msg, sizeof msg));
  ck_assert_msg(strstr(msg, "index_select (") && strstr(msg, "gpt.h:") && strstr(msg, "index 64 (at 2) is out of range"),
                "message: %s", msg);
  fclose(f);
  remove_dir();
  kiln_fn_free(fn);
  gpt_free(&g);
}

START_TEST(test_gpt_forward) { gpt_forward(NULL, NULL); }
END_TEST

/* The MLP through an export whose program has libkiln_rt compiled without
 * BLAS (its own loops for the matmuls), at two sizes; with cc a cross
 * compiler and target its triple, the same run on another machine (qemu). */
static void mlp_elsewhere(const char *cc, const char *flags, const char *target) {
  mlp m;
  mlp_init(&m);
  kiln_fn *fn = mlp_fn(&m);
  make_dir();
  char prefix[128];
  snprintf(prefix, sizeof prefix, "%s/mlpx", dir);
  ck_assert_msg(kiln_export(fn, prefix, &(kiln_export_options){.name = "mlpx", .target = target}) == 0, "%s",
                kiln_last_error());
  build_app_src("mlpx", cc, flags);
  float *x4 = random_x(4), *x9 = random_x(9);
  /* the third call: 4 rows of 17 features, read from x9 (which holds that many) */
  call calls[3] = {{1, {x4}, {2}, {{4, IN}}, {0}}, {1, {x9}, {2}, {{9, IN}}, {0}}, {1, {x9}, {2}, {{4, IN + 1}}, {0}}};
  run_app("mlpx", calls, 3, 2, NULL);
  FILE *f = open_reply();
  for (int c = 0; c < 2; c++) {
    float *out[2];
    int64_t shapes[2][4], b = c ? 9 : 4;
    int ndim[2];
    char msg[512];
    ck_assert_msg(next_reply(f, 2, out, shapes, ndim, msg, sizeof msg) == 0, "%s", msg);
    double y[9 * OUT], sm[9 * OUT];
    kiln_outputs(fn, c ? x9 : x4, b, y, sm);
    expect_close("y against the host's JIT", out[0], y, b * OUT, 1e-5);
    expect_close("softmax against the host's JIT", out[1], sm, b * OUT, 1e-5);
    free(out[0]), free(out[1]);
  }
  char msg[512];
  ck_assert_int_eq(-1, next_reply(f, 2, NULL, NULL, NULL, msg, sizeof msg));
  ck_assert_msg(strstr(msg, "dim 1 is 17, the model takes 16"), "message: %s", msg);
  fclose(f);
  free(x4), free(x9);
  remove_dir();
  kiln_fn_free(fn);
  mlp_free(&m);
}

START_TEST(test_no_blas) { mlp_elsewhere(KILN_TEST_CC, KILN_TEST_SAN, NULL); }
END_TEST

static void cf_exports(const char *cc, const char *flags, const char *target);

/* KILN_CROSS_CC (aarch64-linux-gnu-gcc), KILN_CROSS_RUN (qemu-aarch64 -L
 * /usr/aarch64-linux-gnu) and KILN_CROSS_TARGET (default aarch64-linux-gnu):
 * make test-cross sets them; without them this case checks only that the
 * AArch64 object is written. */
START_TEST(test_cross) {
  const char *cc = getenv("KILN_CROSS_CC"), *run = getenv("KILN_CROSS_RUN"), *target = getenv("KILN_CROSS_TARGET");
  if (!target || !*target) target = "aarch64-linux-gnu";
  if (cc && *cc && run) {
    runner = run;
    mlp_elsewhere(cc, "", target);
    gpt_forward(target, cc);
    cf_exports(cc, "", target);
    runner = "";
    return;
  }
  mlp m;
  mlp_init(&m);
  kiln_fn *fn = mlp_fn(&m);
  make_dir();
  char prefix[128];
  snprintf(prefix, sizeof prefix, "%s/arm", dir);
  ck_assert_msg(kiln_export(fn, prefix, &(kiln_export_options){.name = "arm", .target = target}) == 0, "%s",
                kiln_last_error());
  /* an ELF object for AArch64: e_machine 183 */
  snprintf(prefix, sizeof prefix, "%s/arm.o", dir);
  FILE *f = fopen(prefix, "rb");
  ck_assert_ptr_nonnull(f);
  unsigned char h[20];
  ck_assert_int_eq(20, (int)fread(h, 1, 20, f));
  fclose(f);
  ck_assert(h[0] == 0x7f && h[1] == 'E' && h[4] == 2 && h[5] == 1);
  ck_assert_int_eq(183, h[18] | h[19] << 8);
  remove_dir();
  kiln_fn_free(fn);
  mlp_free(&m);
}
END_TEST

/* ---- control flow: regions through libkiln_rt ---- */

enum { CB = 3, CI = 4, CH = 5, CMAXT = 11 };

/* The weights of the cells below: per LSTM gate (i, f, g, o) x @ wx + h @ wh + b. */
typedef struct cfm {
  kiln_tensor *wx[4], *wh[4], *b[4], *bound;
} cfm;

static float *rand_floats(int64_t n) {
  float *d = malloc((size_t)n * 4 + 4);
  for (int64_t i = 0; i < n; i++) d[i] = uniform();
  return d;
}

static void cfm_init(cfm *m) {
  for (int g = 0; g < 4; g++) {
    float *a = rand_floats(CI * CH), *b = rand_floats(CH * CH), *c = rand_floats(CH);
    m->wx[g] = kiln_tensor_from(KILN_F32, 2, (int64_t[]){CI, CH}, a);
    m->wh[g] = kiln_tensor_from(KILN_F32, 2, (int64_t[]){CH, CH}, b);
    m->b[g] = kiln_tensor_from(KILN_F32, 1, (int64_t[]){CH}, c);
    free(a), free(b), free(c);
  }
  m->bound = kiln_scalar(KILN_F32, 100);
}

static void cfm_free(cfm *m) {
  for (int g = 0; g < 4; g++) kiln_release(m->wx[g]), kiln_release(m->wh[g]), kiln_release(m->b[g]);
  kiln_release(m->bound);
}

static kiln_tensor *gate(const cfm *m, int g, kiln_tensor *x, kiln_tensor *h) {
  return kiln_add(kiln_add(kiln_matmul(x, m->wx[g]), kiln_matmul(h, m->wh[g])), m->b[g]);
}

/* in = h, c, x_t; out = h', c', y_t = h' */
static int lstm_cell(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const cfm *m = ctx;
  kiln_tensor *i = kiln_sigmoid(gate(m, 0, in[2], in[0])), *f = kiln_sigmoid(gate(m, 1, in[2], in[0]));
  kiln_tensor *g = kiln_tanh(gate(m, 2, in[2], in[0])), *o = kiln_sigmoid(gate(m, 3, in[2], in[0]));
  out[1] = kiln_add(kiln_mul(f, in[1]), kiln_mul(i, g));
  out[0] = kiln_mul(o, kiln_tanh(out[1]));
  out[2] = out[0];
  return !out[0] || !out[1];
}

/* in = xs [T, CB, CI], h0, c0 [CB, CH]; out = h, c, ys [T, CB, CH] */
static int lstm_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  return kiln_scan(lstm_cell, ctx, 2, (kiln_tensor *[]){in[1], in[2]}, 1, &in[0], out, 1, &out[2]);
}

/* then: tanh(x @ wh0 + b0), else: x / 2 - b1; in = x [CB, CH], the pred from x's sum */
static int then_fn(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const cfm *m = ctx;
  return !(out[0] = kiln_tanh(kiln_add(kiln_matmul(in[0], m->wh[0]), m->b[0])));
}
static int else_fn(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const cfm *m = ctx;
  return !(out[0] = kiln_sub(kiln_mul(in[0], kiln_scalar(KILN_F32, 0.5)), m->b[1]));
}
static int cond_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kiln_tensor *p = kiln_gt(kiln_sum_all(in[0]), kiln_scalar(KILN_F32, 0)), *r = NULL;
  if (kiln_cond(p, then_fn, else_fn, ctx, 1, in, 1, &r)) return -1;
  return !(out[0] = kiln_add(r, kiln_scalar(KILN_F32, 1)));
}

/* carry x [CH], n []: while sum(x) < 100: x <- 2x, n <- n + 1 */
static int below_fn(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const cfm *m = ctx;
  return !(out[0] = kiln_lt(kiln_sum_all(in[0]), m->bound));
}
static int twice_fn(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_add(in[0], in[0]);
  out[1] = kiln_add(in[1], kiln_scalar(KILN_F32, 1));
  return !out[0] || !out[1];
}
static int while_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  return kiln_while_loop(below_fn, twice_fn, ctx, 2, in, out);
}

/* a scan step with a cond inside on the sign of sum(x_t): in = h, x_t; out = h', y = h' * h' */
static int cond_then(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const cfm *m = ctx;
  return !(out[0] = kiln_tanh(kiln_add(kiln_matmul(in[0], m->wh[0]), kiln_matmul(in[1], m->wx[0]))));
}
static int cond_else(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const cfm *m = ctx;
  return !(out[0] = kiln_add(kiln_mul(in[0], kiln_scalar(KILN_F32, 0.5)), kiln_sin(kiln_matmul(in[1], m->wx[1]))));
}
static int cond_step(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kiln_tensor *p = kiln_gt(kiln_sum_all(in[1]), kiln_scalar(KILN_F32, 0));
  if (!p || kiln_cond(p, cond_then, cond_else, ctx, 2, in, 1, out)) return -1;
  return !(out[1] = kiln_mul(out[0], out[0]));
}
/* in = xs [T, CB, CI], h0 [CB, CH]; out = h, ys; a scan in the step's else would nest deeper */
static int cond_scan_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  return kiln_scan(cond_step, ctx, 1, &in[1], 1, &in[0], &out[0], 1, &out[1]);
}

/* The LSTM's training graph: loss = sum(ys^2)/2 + sum(c), and its gradients
 * with respect to wx[1], wh[2] and b[3] (kiln_grad_of: no .grad written, so
 * the backward's reverse scan is part of the exported graph). */
static int lstm_grad_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  cfm *m = ctx;
  kiln_tensor *r[3];
  if (lstm_body(ctx, in, r)) return -1;
  out[0] = kiln_add(kiln_mul(kiln_sum_all(kiln_mul(r[2], r[2])), kiln_scalar(KILN_F32, 0.5)), kiln_sum_all(r[1]));
  /* plus 0 * the weights: eagerly at T = 0 (no step) the loss must still reach them (gradients 0) */
  kiln_tensor *z = kiln_add(kiln_add(kiln_sum_all(m->wx[1]), kiln_sum_all(m->wh[2])), kiln_sum_all(m->b[3]));
  out[0] = kiln_add(out[0], kiln_mul(z, kiln_scalar(KILN_F32, 0)));
  if (!out[0]) return -1;
  return kiln_grad_of(out[0], (kiln_tensor *[]){m->wx[1], m->wh[2], m->b[3]}, 3, out + 1);
}

/* a scan inside a scan's step: z <- tanh(z @ wh0 + row @ wx0) over the rows of x_t, from h */
static int row_step(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const cfm *m = ctx;
  return !(out[0] = kiln_tanh(kiln_add(kiln_matmul(in[0], m->wh[0]), kiln_matmul(in[1], m->wx[0]))));
}
static int nest_step(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  if (kiln_scan(row_step, ctx, 1, &in[0], 1, &in[1], &out[0], 0, NULL)) return -1;
  return !(out[1] = kiln_mul(out[0], out[0]));
}
/* in = x (CB, T, CI), its steps along dim 1 (a strided xs), h0 (CB, CH); out = h, ys */
static int nest_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kiln_tensor *xs = kiln_transpose(in[0], 0, 1);
  return !xs || kiln_scan(nest_step, ctx, 1, &in[1], 1, &xs, &out[0], 1, &out[1]);
}

/* A case: a body, its inputs per call and their shapes (dyn: input 0's dim
 * marked dynamic before the first call, when not 0). */
typedef struct cf_case {
  const char *name;
  kiln_body body;
  int n_in, n_out, dyn;
} cf_case;

/* body run eagerly (no compile) on c's inputs: its outputs as doubles, malloc'ed, and their element counts */
static void eager_outputs(const cf_case *k, cfm *m, const call *c, double **y, int64_t *n) {
  kiln_scope_begin();
  kiln_tensor *in[6], *out[6] = {0};
  for (int i = 0; i < k->n_in; i++) in[i] = kiln_tensor_from(KILN_F32, c->ndim[i], c->shape[i], c->data[i]);
  ck_assert_msg(k->body(m, in, out) == 0, "%s eagerly: %s", k->name, kiln_last_error());
  for (int i = 0; i < k->n_out; i++) {
    n[i] = kiln_numel(out[i]);
    float *t = malloc((size_t)n[i] * 4 + 4);
    ck_assert_int_eq(0, kiln_read(out[i], t, (size_t)n[i] * 4));
    y[i] = malloc((size_t)n[i] * 8 + 8);
    for (int64_t e = 0; e < n[i]; e++) y[i][e] = t[e];
    free(t);
  }
  kiln_scope_end();
}

/* Compiles k, calls it once on c[0] (the trace), exports it and runs every
 * call of c through libkiln_rt: each output equals eager's. */
static void cf_export_case(const cf_case *k, cfm *m, const call *c, int n_calls, const char *cc, const char *flags,
                           const char *target) {
  kiln_fn *fn = kiln_compile(k->body, m, &(kiln_options){.name = k->name, .n_in = k->n_in, .n_out = k->n_out});
  ck_assert_ptr_nonnull(fn);
  if (k->dyn) ck_assert_int_eq(0, kiln_mark_dynamic(fn, 0, k->dyn));
  kiln_scope_begin();
  kiln_tensor *in[6], *out[6] = {0};
  for (int i = 0; i < k->n_in; i++) in[i] = kiln_tensor_from(KILN_F32, c[0].ndim[i], c[0].shape[i], c[0].data[i]);
  ck_assert_msg(kiln_call(fn, in, out) == 0, "%s", kiln_last_error());
  kiln_scope_end();
  char prefix[128];
  snprintf(prefix, sizeof prefix, "%s/%s", dir, k->name);
  ck_assert_msg(kiln_export(fn, prefix, &(kiln_export_options){.name = k->name, .target = target}) == 0, "%s",
                kiln_last_error());
  if (cc) build_app_src(k->name, cc, flags);
  else build_app(k->name);
  run_app(k->name, c, n_calls, k->n_out, NULL);
  FILE *f = open_reply();
  for (int ci = 0; ci < n_calls; ci++) {
    float *got[6];
    int64_t shapes[6][4], n[6];
    int ndim[6];
    char msg[512], what[128];
    ck_assert_msg(next_reply(f, k->n_out, got, shapes, ndim, msg, sizeof msg) == 0, "%s call %d: %s", k->name, ci, msg);
    double *want[6];
    eager_outputs(k, m, &c[ci], want, n);
    for (int i = 0; i < k->n_out; i++) {
      int64_t numel = 1;
      for (int d = 0; d < ndim[i]; d++) numel *= shapes[i][d];
      ck_assert_msg(numel == n[i], "%s call %d output %d: %lld elements, eager has %lld", k->name, ci, i,
                    (long long)numel, (long long)n[i]);
      snprintf(what, sizeof what, "%s call %d output %d against eager", k->name, ci, i);
      expect_close(what, got[i], want[i], n[i], 1e-5);
      free(got[i]), free(want[i]);
    }
  }
  fclose(f);
  kiln_fn_free(fn);
}

/* scan (an LSTM), the LSTM's training graph (the backward's reverse scan),
 * cond, while and a cond inside a scan, exported and run through libkiln_rt
 * at lengths 0, 1 and 7 (one export serves every T; the first call traced at
 * T = 11) and trip counts 0, 1 and 7; with cc, libkiln_rt from its sources
 * without BLAS (a cross compiler for target, with runner set). */
static void cf_exports(const char *cc, const char *flags, const char *target) {
  cfm m;
  cfm_init(&m);
  make_dir();
  /* traced at 11: at 3, the batch's size, the training graph's trace took a
   * size of 15 for 5 * T and guarded T == 3 */
  int64_t lens[4] = {CMAXT, 0, 1, 7};
  float *xs = rand_floats(CMAXT * CB * CI), *h0 = rand_floats(CB * CH), *c0 = rand_floats(CB * CH);
  call sc[4];
  for (int c = 0; c < 4; c++)
    sc[c] = (call){3, {xs, h0, c0}, {3, 2, 2}, {{lens[c], CB, CI}, {CB, CH}, {CB, CH}}, {0}};
  cf_export_case(&(cf_case){"lstm", lstm_body, 3, 3, 0}, &m, sc, 4, cc, flags, target);
  /* the training graph: the reverse scan of the backward runs through libkiln_rt too */
  for (int g = 0; g < 4; g++)
    kiln_requires_grad(m.wx[g], true), kiln_requires_grad(m.wh[g], true), kiln_requires_grad(m.b[g], true);
  cf_export_case(&(cf_case){"lstm_grad", lstm_grad_body, 3, 4, 0}, &m, sc, 4, cc, flags, target);
  for (int g = 0; g < 4; g++)
    kiln_requires_grad(m.wx[g], false), kiln_requires_grad(m.wh[g], false), kiln_requires_grad(m.b[g], false);
  for (int c = 0; c < 4; c++) sc[c].n_in = 2;
  cf_export_case(&(cf_case){"cscan", cond_scan_body, 2, 2, 0}, &m, sc, 4, cc, flags, target);
  /* a scan in a scan, over x's dim 1 (T, marked dynamic: from 1, where a
   * scan's own symbol starts at 0): the operand is a strided view */
  float *xt = rand_floats(CB * CMAXT * CI);
  call nc[3];
  for (int c = 0; c < 3; c++) nc[c] = (call){2, {xt, h0}, {3, 2}, {{CB, c ? lens[c + 1] : CMAXT, CI}, {CB, CH}}, {0}};
  cf_export_case(&(cf_case){"nest", nest_body, 2, 2, 1}, &m, nc, 3, cc, flags, target);
  free(xt);
  /* both branches: x of either sign of sum */
  float *xp = rand_floats(CB * CH), *xn = malloc(CB * CH * 4);
  for (int i = 0; i < CB * CH; i++) xp[i] = fabsf(xp[i]) + 0.1f, xn[i] = -xp[i];
  call cc2[3] = {{1, {xp}, {2}, {{CB, CH}}, {0}}, {1, {xn}, {2}, {{CB, CH}}, {0}}, {1, {xp}, {2}, {{CB, CH}}, {0}}};
  cf_export_case(&(cf_case){"cnd", cond_body, 1, 1, 0}, &m, cc2, 3, cc, flags, target);
  /* sum(x) 60, 200 and 1: 1, 0 and 7 doublings to reach 100 */
  float w1[CH] = {20, 10, 10, 10, 10}, w0[CH] = {40, 40, 40, 40, 40}, w7[CH] = {0.2f, 0.2f, 0.2f, 0.2f, 0.2f}, zero = 0;
  call wc[3] = {{2, {w1, &zero}, {1, 0}, {{CH}, {0}}, {0}}, {2, {w0, &zero}, {1, 0}, {{CH}, {0}}, {0}},
                {2, {w7, &zero}, {1, 0}, {{CH}, {0}}, {0}}};
  cf_export_case(&(cf_case){"grow", while_body, 2, 2, 0}, &m, wc, 3, cc, flags, target);
  /* the trip counts are the ones meant: n comes back as 1, 0, 7 */
  run_app("grow", wc, 3, 2, NULL);
  FILE *f = open_reply();
  for (int c = 0; c < 3; c++) {
    float *out[2];
    int64_t shapes[2][4];
    int ndim[2];
    char msg[512];
    ck_assert_int_eq(0, next_reply(f, 2, out, shapes, ndim, msg, sizeof msg));
    ck_assert_int_eq(ndim[1], 0);
    ck_assert_msg(out[1][0] == (float)(c == 0 ? 1 : c == 1 ? 0 : 7), "call %d: %g steps", c, out[1][0]);
    free(out[0]), free(out[1]);
  }
  fclose(f);
  free(xs), free(h0), free(c0), free(xp), free(xn);
  remove_dir();
  cfm_free(&m);
}

START_TEST(test_control_flow) { cf_exports(NULL, NULL, NULL); }
END_TEST

/* The heap blocks a run of dir/app_<name> on calls makes, by valgrind's count. */
static long heap_allocs(const char *name, const call *calls, int n, int n_out) {
  run_app(name, calls, n, n_out, NULL);
  ck_assert_int_eq(0, sh("cd %s && valgrind --log-file=vg.txt ./app_%s req rep", dir, name));
  char path[128], line[512];
  snprintf(path, sizeof path, "%s/vg.txt", dir);
  FILE *f = fopen(path, "r");
  ck_assert_ptr_nonnull(f);
  long allocs = -1;
  while (fgets(line, sizeof line, f)) {
    const char *at = strstr(line, "total heap usage: ");
    if (at) allocs = strtol(at + strlen("total heap usage: "), NULL, 10);
  }
  fclose(f);
  ck_assert_msg(allocs > 0, "no heap summary from valgrind in %s", path);
  return allocs;
}

/* The region outputs the runs of dir/app_<name> (built with
 * KILN_RT_TEST_COUNTS) copied out on calls. */
static long rt_copies(const char *name, const call *calls, int n, int n_out) {
  run_app(name, calls, n, n_out, NULL);
  char path[128];
  snprintf(path, sizeof path, "%s/copies", dir);
  FILE *f = fopen(path, "r");
  ck_assert_ptr_nonnull(f);
  long copies = -1;
  ck_assert_int_eq(1, fscanf(f, "%ld", &copies));
  fclose(f);
  return copies;
}

/* The LSTM and the while loop exported (the app built with flags, without
 * BLAS), outputs against eager, and what count says of one call: the LSTM
 * at T = 1 and CMAXT in lstm[], the while at 1 and 7 trips in grow[]. */
static void loop_counts(const char *flags, long (*count)(const char *, const call *, int, int), long lstm[2], long grow[2]) {
  cfm m;
  cfm_init(&m);
  make_dir();
  float *xs = rand_floats(CMAXT * CB * CI), *h0 = rand_floats(CB * CH), *c0 = rand_floats(CB * CH);
  call sc[2];
  for (int c = 0; c < 2; c++)
    sc[c] = (call){3, {xs, h0, c0}, {3, 2, 2}, {{c ? CMAXT : 1, CB, CI}, {CB, CH}, {CB, CH}}, {0}};
  cf_export_case(&(cf_case){"lstm", lstm_body, 3, 3, 0}, &m, sc, 2, KILN_TEST_CC, flags, NULL);
  lstm[0] = count("lstm", &sc[0], 1, 3), lstm[1] = count("lstm", &sc[1], 1, 3);
  float w1[CH] = {20, 10, 10, 10, 10}, w7[CH] = {0.2f, 0.2f, 0.2f, 0.2f, 0.2f}, zero = 0;
  call wc[2] = {{2, {w1, &zero}, {1, 0}, {{CH}, {0}}, {0}}, {2, {w7, &zero}, {1, 0}, {{CH}, {0}}, {0}}};
  cf_export_case(&(cf_case){"grow", while_body, 2, 2, 0}, &m, wc, 2, KILN_TEST_CC, flags, NULL);
  grow[0] = count("grow", &wc[0], 1, 2), grow[1] = count("grow", &wc[1], 1, 2);
  free(xs), free(h0), free(c0);
  remove_dir();
  cfm_free(&m);
}

/* libkiln_rt runs a scan's steps without allocating: a call of the LSTM at
 * T = 1 and at T = 11 make as many heap blocks (the units and the carry
 * buffers are made once per call), and so does the while loop at 1 and 7
 * trips. Built without sanitizers or BLAS, run under valgrind. */
START_TEST(test_control_flow_allocs) {
  if (system("valgrind --version > /dev/null 2>&1")) return; /* no valgrind: nothing to count with */
  long a[2], w[2];
  loop_counts("", heap_allocs, a, w);
  ck_assert_msg(a[0] == a[1], "heap blocks of a call at T = 1: %ld, at T = 11: %ld", a[0], a[1]);
  /* (at 0 trips the body's unit is never prepared: a call makes fewer blocks) */
  ck_assert_msg(w[0] == w[1], "heap blocks of a while at 1 trip: %ld, at 7: %ld", w[0], w[1]);
}
END_TEST

/* A loop's step stores its next carry and its y[t] straight into the
 * buffers the loop swaps and the stacked ys' rows: libkiln_rt copies no
 * output per step but one that is no whole buffer of its own. The LSTM's
 * step yields h' twice (the carry and y[t]): one copy per step, where each
 * of its three outputs was copied before; the while loop's cond and body
 * copy none at 1 and at 7 trips. */
START_TEST(test_control_flow_step_copies) {
  long a[2], w[2];
  loop_counts("-DKILN_RT_TEST_COUNTS", rt_copies, a, w);
  ck_assert_msg(a[1] - a[0] == CMAXT - 1, "outputs copied by a call at T = 1: %ld, at T = %d: %ld", a[0], CMAXT, a[1]);
  ck_assert_msg(w[0] == 0 && w[1] == 0, "outputs copied by a while at 1 trip: %ld, at 7: %ld", w[0], w[1]);
}
END_TEST

START_TEST(test_control_flow_no_blas) { cf_exports(KILN_TEST_CC, KILN_TEST_SAN, NULL); }
END_TEST


/* kilnc: a saved graph to an object on the command line; a loaded graph's
 * params are inputs, so the weights come with the call. Bad files are an
 * exit status of 1 and the reason. */
START_TEST(test_kilnc) {
  mlp m;
  mlp_init(&m);
  kiln_fn *fn = mlp_fn(&m);
  make_dir();
  ck_assert_int_eq(0, sh("cd %s && echo 'version 9' > future.kiln", dir));
  char path[128];
  snprintf(path, sizeof path, "%s/mlp.kiln", dir);
  ck_assert_int_eq(0, kiln_save(fn, path));
  ck_assert_int_eq(0, sh("cd %s && %s mlp.kiln -o saved.o --name saved", dir, KILN_TEST_KILNC));
  build_app("saved");
  float *x = random_x(6);
  call c = {5, {x, m.w1, m.b1, m.w2, m.b2}, {2, 2, 1, 2, 1}, {{6, IN}, {IN, HID}, {HID}, {HID, OUT}, {OUT}}, {0}};
  run_app("saved", &c, 1, 2, NULL);
  FILE *f = open_reply();
  float *out[2];
  int64_t shapes[2][4];
  int ndim[2];
  char msg[512];
  ck_assert_msg(next_reply(f, 2, out, shapes, ndim, msg, sizeof msg) == 0, "%s", msg);
  double y[6 * OUT], sm[6 * OUT];
  mlp_ref(&m, x, 6, y, sm);
  expect_close("y from kilnc's object", out[0], y, 6 * OUT, 1e-5);
  expect_close("softmax from kilnc's object", out[1], sm, 6 * OUT, 1e-5);
  free(out[0]), free(out[1]);
  fclose(f);
  ck_assert_int_ne(0, sh("cd %s && %s future.kiln -o f.o 2> err.txt", dir, KILN_TEST_KILNC));
  ck_assert_int_eq(0, sh("grep -q 'graph format version 9 is newer than this kiln reads' %s/err.txt", dir));
  ck_assert_int_ne(0, sh("cd %s && %s missing.kiln -o f.o 2> err.txt", dir, KILN_TEST_KILNC));
  ck_assert_int_eq(0, sh("grep -q 'kilnc: .*missing.kiln' %s/err.txt", dir));
  ck_assert_int_ne(0, sh("cd %s && %s mlp.kiln -o f.obj 2> err.txt", dir, KILN_TEST_KILNC));
  free(x);
  remove_dir();
  kiln_fn_free(fn);
  mlp_free(&m);
}
END_TEST

/* A model and a runtime of different plan versions: every call is refused
 * with both versions named, never run on a plan read wrongly. */
START_TEST(test_plan_version) {
  mlp m;
  mlp_init(&m);
  kiln_fn *fn = mlp_fn(&m);
  make_dir();
  char prefix[128];
  snprintf(prefix, sizeof prefix, "%s/mlpv", dir);
  ck_assert_msg(kiln_export(fn, prefix, &(kiln_export_options){.name = "mlpv"}) == 0, "%s", kiln_last_error());
  char flags[256];
  snprintf(flags, sizeof flags, "%s -DRT_PLAN_VERSION=7", KILN_TEST_SAN);
  build_app_src("mlpv", KILN_TEST_CC, flags);
  float *x = random_x(2);
  call c = {1, {x}, {2}, {{2, IN}}, {0}};
  run_app("mlpv", &c, 1, 2, NULL);
  FILE *f = open_reply();
  char msg[512];
  ck_assert_int_eq(-1, next_reply(f, 2, NULL, NULL, NULL, msg, sizeof msg));
  ck_assert_msg(strstr(msg, "exported for runtime plan version 2, this libkiln_rt reads version 7"), "message: %s", msg);
  fclose(f);
  free(x);
  remove_dir();
  kiln_fn_free(fn);
  mlp_free(&m);
}
END_TEST

/* x*a - b; AXB_LINE is the line of its ops, where a and b are first used */
enum { AXB_LINE = __LINE__ + 3 };
static int axb_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kiln_tensor **ab = ctx;
  out[0] = kiln_sub(kiln_mul(in[0], ab[0]), ab[1]);
  return out[0] ? 0 : -1;
}

/* Params named with kiln_param_name: the saved graph carries the names, a
 * function loaded from it refuses two same-shaped params passed in the
 * wrong order, and an export's header calls them by name. */
START_TEST(test_param_names) {
  make_dir();
  kiln_scope_begin();
  kiln_tensor *ab[2] = {kiln_tensor_from(KILN_F32, 1, (int64_t[]){4}, (float[]){1, 2, 3, 4}),
                        kiln_tensor_from(KILN_F32, 1, (int64_t[]){4}, (float[]){10, 20, 30, 40})};
  ck_assert_int_eq(0, kiln_param_name(ab[0], "layer.0/a"));
  ck_assert_int_eq(0, kiln_param_name(ab[1], "b"));
  ck_assert_int_eq(-1, kiln_param_name(ab[1], "not a name"));
  ck_assert_msg(strstr(kiln_last_error(), "test_export.c:") && strstr(kiln_last_error(), "is not a name"), "%s",
                kiln_last_error());
  ck_assert_int_eq(-1, kiln_param_name(NULL, "x"));
  kiln_fn *fn = kiln_compile(axb_body, ab, &(kiln_options){.name = "axb", .n_in = 1, .n_out = 1});
  kiln_tensor *x = kiln_tensor_from(KILN_F32, 1, (int64_t[]){4}, (float[]){1, 1, 2, 2}), *out[1];
  ck_assert_int_eq(0, kiln_call(fn, &x, out));
  char path[128];
  snprintf(path, sizeof path, "%s/axb.kiln", dir);
  ck_assert_int_eq(0, kiln_save(fn, path));
  ck_assert_int_eq(0, sh("grep -q '%%1: f32\\[4\\] @param(layer.0/a), %%2: f32\\[4\\] @param(b)' %s", path));
  kiln_fn *loaded = kiln_load(path);
  ck_assert_msg(loaded != NULL, "%s", kiln_last_error());
  /* x*a - b = [1-10, 2-20, 6-30, 8-40] */
  ck_assert_int_eq(0, kiln_call(loaded, (kiln_tensor *[]){x, ab[0], ab[1]}, out));
  float y[4];
  ck_assert_int_eq(0, kiln_read(out[0], y, sizeof y));
  ck_assert(y[0] == -9 && y[1] == -18 && y[2] == -24 && y[3] == -32);
  ck_assert_int_eq(-1, kiln_call(loaded, (kiln_tensor *[]){x, ab[1], ab[0]}, out));
  ck_assert_msg(strstr(kiln_last_error(), "the tensor named 'b' is passed where the graph takes 'layer.0/a'"), "%s",
                kiln_last_error());
  snprintf(path, sizeof path, "%s/axb", dir);
  ck_assert_msg(kiln_export(loaded, path, NULL) == 0, "%s", kiln_last_error());
  ck_assert_int_eq(0, sh("grep -q 'in\\[1\\]  layer.0/a ' %s.h && grep -q 'in\\[2\\]  b ' %s.h", path, path));
  kiln_fn_free(loaded);
  kiln_fn_free(fn);
  kiln_scope_end();
  remove_dir();
}
END_TEST

/* Params never named: the capture site names them (the file's base name, the
 * line, then _1 ... for more params first used on that line), the names are
 * the same for fresh tensors traced again, and a loaded graph refuses the
 * two same-shaped params in the wrong order, naming both, where without
 * names it gave a wrong answer. */
START_TEST(test_param_site_names) {
  make_dir();
  kiln_scope_begin();
  char a_name[64], b_name[64], path[2][128], want[256];
  snprintf(a_name, sizeof a_name, "test_export_c_%d", AXB_LINE);
  snprintf(b_name, sizeof b_name, "test_export_c_%d_1", AXB_LINE);
  kiln_tensor *x = kiln_tensor_from(KILN_F32, 1, (int64_t[]){4}, (float[]){1, 1, 2, 2}), *out[1];
  kiln_tensor *ab[2][2];
  for (int k = 0; k < 2; k++) {
    ab[k][0] = kiln_tensor_from(KILN_F32, 1, (int64_t[]){4}, (float[]){1, 2, 3, 4});
    ab[k][1] = kiln_tensor_from(KILN_F32, 1, (int64_t[]){4}, (float[]){10, 20, 30, 40});
    kiln_fn *fn = kiln_compile(axb_body, ab[k], &(kiln_options){.name = "axb", .n_in = 1, .n_out = 1});
    ck_assert_int_eq(0, kiln_call(fn, &x, out));
    snprintf(path[k], sizeof path[k], "%s/axb%d.kiln", dir, k);
    ck_assert_int_eq(0, kiln_save(fn, path[k]));
    kiln_fn_free(fn);
  }
  ck_assert_int_eq(0, sh("grep -q '%%1: f32\\[4\\] @param(%s), %%2: f32\\[4\\] @param(%s)' %s", a_name, b_name, path[0]));
  ck_assert_int_eq(0, sh("cmp -s %s %s", path[0], path[1]));
  kiln_fn *loaded = kiln_load(path[0]);
  ck_assert_msg(loaded != NULL, "%s", kiln_last_error());
  /* x*a - b = [1-10, 2-20, 6-30, 8-40], with either pair of tensors */
  for (int k = 0; k < 2; k++) {
    ck_assert_int_eq(0, kiln_call(loaded, (kiln_tensor *[]){x, ab[k][0], ab[k][1]}, out));
    float y[4];
    ck_assert_int_eq(0, kiln_read(out[0], y, sizeof y));
    ck_assert(y[0] == -9 && y[1] == -18 && y[2] == -24 && y[3] == -32);
  }
  ck_assert_int_eq(-1, kiln_call(loaded, (kiln_tensor *[]){x, ab[0][1], ab[0][0]}, out));
  snprintf(want, sizeof want, "input 1: the tensor named '%s' is passed where the graph takes '%s'", b_name, a_name);
  ck_assert_msg(strstr(kiln_last_error(), want), "%s", kiln_last_error());
  /* a name kiln_param_name gives later wins over the site's */
  ck_assert_int_eq(0, kiln_param_name(ab[1][0], "a"));
  ck_assert_int_eq(-1, kiln_call(loaded, (kiln_tensor *[]){x, ab[1][0], ab[1][1]}, out));
  ck_assert_msg(strstr(kiln_last_error(), "the tensor named 'a' is passed where"), "%s", kiln_last_error());
  kiln_fn_free(loaded);
  /* a text without names (before them) loads, and takes the tensors by position */
  loaded = kiln_load_string("graph axb(%0: f32[4], %1: f32[4] @param, %2: f32[4] @param) -> (%4)\n"
                            "  %3: f32[4] = mul(%0, %1)\n  %4: f32[4] = sub(%3, %2)\n");
  ck_assert_msg(loaded != NULL, "%s", kiln_last_error());
  ck_assert_int_eq(0, kiln_call(loaded, (kiln_tensor *[]){x, ab[0][1], ab[0][0]}, out));
  float y[4];
  ck_assert_int_eq(0, kiln_read(out[0], y, sizeof y));
  ck_assert(y[0] == 9 && y[1] == 18 && y[2] == 57 && y[3] == 76); /* x*b - a */
  kiln_fn_free(loaded);
  kiln_scope_end();
  remove_dir();
}
END_TEST

static int argmax_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = kiln_argmax(kiln_exp(in[0]), -1, false);
  return out[0] ? 0 : -1;
}

static int step_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kiln_tensor *w = ctx;
  out[0] = kiln_sum(kiln_mul(in[0], w), -1, false);
  return kiln_add_(w, in[0]) && out[0] ? 0 : -1;
}

/* What the runtime cannot run, and bad arguments: errors naming the caller's line and why. */
START_TEST(test_refusals) {
  make_dir();
  char prefix[128];
  snprintf(prefix, sizeof prefix, "%s/r", dir);
  kiln_scope_begin();
  kiln_fn *am = kiln_compile(argmax_body, NULL, &(kiln_options){.name = "am", .n_in = 1, .n_out = 1});
  kiln_tensor *x = kiln_randn(KILN_F32, 2, (int64_t[]){3, 4}, 1), *out[1];
  ck_assert_int_eq(-1, kiln_export(am, prefix, NULL)); /* no variant yet */
  ck_assert_msg(strstr(kiln_last_error(), "no compiled variant"), "%s", kiln_last_error());
  ck_assert_int_eq(0, kiln_call(am, &x, out));
  ck_assert_int_eq(-1, kiln_export(am, prefix, NULL));
  ck_assert_msg(strstr(kiln_last_error(), "test_export.c:") && strstr(kiln_last_error(), "argmax (") && strstr(kiln_last_error(), "test_export.c:") &&
                    strstr(kiln_last_error(), "eager kernel"),
                "%s", kiln_last_error());
  ck_assert_int_eq(-1, kiln_export(am, prefix, &(kiln_export_options){.name = "not an identifier"}));
  ck_assert_msg(strstr(kiln_last_error(), "not a C identifier"), "%s", kiln_last_error());
  ck_assert_int_eq(-1, kiln_export(am, NULL, NULL));
  ck_assert_int_eq(-1, kiln_export(NULL, prefix, NULL));
  ck_assert_int_eq(-1, kiln_export(am, prefix, &(kiln_export_options){.target = "no-such-target"}));
  ck_assert_msg(strstr(kiln_last_error(), "no-such-target"), "%s", kiln_last_error());
  kiln_fn_free(am);
  kiln_tensor *w = kiln_zeros(KILN_F32, 1, (int64_t[]){4});
  kiln_fn *st = kiln_compile(step_body, w, &(kiln_options){.name = "step", .n_in = 1, .n_out = 1});
  kiln_tensor *v = kiln_randn(KILN_F32, 1, (int64_t[]){4}, 2);
  ck_assert_int_eq(0, kiln_call(st, &v, out));
  ck_assert_int_eq(-1, kiln_export(st, prefix, NULL));
  ck_assert_msg(strstr(kiln_last_error(), "writes back"), "%s", kiln_last_error());
  kiln_fn_free(st);
  kiln_scope_end();
  remove_dir();
}
END_TEST

int main(void) {
  Suite *s = suite_create("export");
  struct {
    const char *name;
    const TTest *test;
  } cases[] = {
      {"mlp_sizes", test_mlp_sizes},
      {"params_as_inputs", test_params_as_inputs},
      {"variants", test_variants},
      {"gpt_forward", test_gpt_forward},
      {"no_blas", test_no_blas},
      {"kilnc", test_kilnc},
      {"param_names", test_param_names},
      {"param_site_names", test_param_site_names},
      {"plan_version", test_plan_version},
      {"cross", test_cross},
      {"refusals", test_refusals},
      {"control_flow", test_control_flow},
      {"control_flow_no_blas", test_control_flow_no_blas},
      {"control_flow_allocs", test_control_flow_allocs},
      {"control_flow_step_copies", test_control_flow_step_copies},
  };
  for (int k = 0; k < NELEM(cases); k++) {
    TCase *tc = tcase_create(cases[k].name);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, cases[k].test);
    suite_add_tcase(s, tc);
  }
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
