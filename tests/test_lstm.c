/* An LSTM cell as the body of kiln_scan: the forward against a hand-written
 * LSTM in double, gradients through the scan against central finite
 * differences in f64, and compiled functions (a forward, a training step
 * with its backward and SGD update, and gradients by kiln_grad_of in f64
 * against finite differences) against the same code run eagerly, on the
 * interpreter and on LLVM, at several lengths including 0 and 1. The
 * gradient function must serve every length from one trace: the scan and
 * its backward (a reverse scan) are one region each. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

enum { B = 2, I = 3, H = 4, G = 4 * H, TMAX = 8 };

static void read_f64(const kiln_tensor *t, double *dst, int64_t n) {
  ck_assert_msg(t != NULL, "%s", kiln_last_error());
  ck_assert_int_eq(n, kiln_numel(t));
  ck_assert_int_eq(0, kiln_read(kiln_cast((kiln_tensor *)t, KILN_F64), dst, sizeof(double) * (size_t)n));
}

static void close_all(const double *want, const double *got, int64_t n, double tol, const char *what, int T) {
  for (int64_t i = 0; i < n; i++)
    ck_assert_msg(fabs(want[i] - got[i]) <= tol * (1 + fabs(want[i])), "T=%d, %s at %lld: expected %.12g, got %.12g", T,
                  what, (long long)i, want[i], got[i]);
}

/* deterministic values in (-1, 1), independent of kiln's generator */
static void fill(double *d, int64_t n, unsigned seed) {
  uint64_t s = seed * 2654435761u + 1;
  for (int64_t i = 0; i < n; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    d[i] = (double)(s >> 11) * 0x1.0p-53 * 2 - 1;
  }
}

/* ---- the LSTM, in double and in kiln ---- */

/* Gates in the order input, forget, update, output: g = x Wx + h Wh + bias (B,4H). */
typedef struct lstm_data {
  double wx[I * G], wh[H * G], bias[G], h0[B * H], c0[B * H], x[TMAX * B * I];
} lstm_data;

static void data_init(lstm_data *d) {
  fill(d->wx, I * G, 1);
  fill(d->wh, H * G, 2);
  fill(d->bias, G, 3);
  fill(d->h0, B * H, 4);
  fill(d->c0, B * H, 5);
  fill(d->x, TMAX * B * I, 6);
}

static double sig(double v) { return 1 / (1 + exp(-v)); }

/* T steps from (h, c), in place; hs (T,B,H) gets every h. */
static void lstm_ref(const lstm_data *d, int T, double *h, double *c, double *hs) {
  for (int t = 0; t < T; t++) {
    double nh[B * H], nc[B * H];
    for (int b = 0; b < B; b++) {
      double g[G];
      for (int j = 0; j < G; j++) {
        g[j] = d->bias[j];
        for (int k = 0; k < I; k++) g[j] += d->x[(t * B + b) * I + k] * d->wx[k * G + j];
        for (int k = 0; k < H; k++) g[j] += h[b * H + k] * d->wh[k * G + j];
      }
      for (int j = 0; j < H; j++) {
        nc[b * H + j] = sig(g[H + j]) * c[b * H + j] + sig(g[j]) * tanh(g[2 * H + j]);
        nh[b * H + j] = sig(g[3 * H + j]) * tanh(nc[b * H + j]);
      }
    }
    memcpy(h, nh, sizeof nh);
    memcpy(c, nc, sizeof nc);
    memcpy(hs + t * B * H, nh, sizeof nh);
  }
}

typedef struct lstm {
  kiln_tensor *wx, *wh, *bias; /* (I,4H), (H,4H), (4H) */
} lstm;

/* scan's body: in = (h (B,H), c (B,H), x_t (B,I)), out = (h', c', y_t = h') */
static int cell(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  lstm *m = ctx;
  kiln_tensor *g = kiln_add(kiln_add(kiln_matmul(in[2], m->wx), kiln_matmul(in[0], m->wh)), m->bias);
  kiln_tensor *i = kiln_sigmoid(kiln_slice(g, -1, 0, H, 1));
  kiln_tensor *f = kiln_sigmoid(kiln_slice(g, -1, H, 2 * H, 1));
  kiln_tensor *u = kiln_tanh(kiln_slice(g, -1, 2 * H, 3 * H, 1));
  kiln_tensor *o = kiln_sigmoid(kiln_slice(g, -1, 3 * H, 4 * H, 1));
  out[1] = kiln_add(kiln_mul(f, in[1]), kiln_mul(i, u));
  out[0] = kiln_mul(o, kiln_tanh(out[1]));
  out[2] = out[0];
  return out[0] && out[1] ? 0 : -1;
}

static kiln_tensor *from(kiln_dtype dt, int ndim, const int64_t *shape, const double *v) {
  return kiln_cast(kiln_tensor_from(KILN_F64, ndim, shape, v), dt);
}

/* The weights as new leaves of dtype dt, each requiring grad. */
static lstm lstm_make(const lstm_data *d, kiln_dtype dt) {
  lstm m = {from(dt, 2, (int64_t[]){I, G}, d->wx), from(dt, 2, (int64_t[]){H, G}, d->wh),
            from(dt, 1, (int64_t[]){G}, d->bias)};
  kiln_requires_grad(m.wx, true);
  kiln_requires_grad(m.wh, true);
  kiln_requires_grad(m.bias, true);
  return m;
}

/* in = (h0, c0, x (T,B,I)); out = (h_T, c_T, hs (T,B,H)). */
static int lstm_forward(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  return kiln_scan(cell, ctx, 2, in, 1, &in[2], out, 1, &out[2]);
}

/* ---- gradients against finite differences, f64 ---- */

/* L = sum(R1 * hs) + sum(R2 * h_T) + sum(R3 * c_T) */
static double ref_loss(const lstm_data *d, int T, const double *r) {
  double h[B * H], c[B * H], hs[TMAX * B * H], l = 0;
  memcpy(h, d->h0, sizeof h);
  memcpy(c, d->c0, sizeof c);
  lstm_ref(d, T, h, c, hs);
  for (int i = 0; i < T * B * H; i++) l += r[i] * hs[i];
  for (int i = 0; i < B * H; i++) l += r[TMAX * B * H + i] * h[i] + r[(TMAX + 1) * B * H + i] * c[i];
  return l;
}

/* Central differences of the reference loss in each of v[0..n) (a field of
 * d, restored after), into fd. */
static void fd_grad(lstm_data *d, int T, const double *r, double *v, int64_t n, double *fd) {
  for (int64_t i = 0; i < n; i++) {
    double keep = v[i];
    v[i] = keep + 1e-6;
    double lp = ref_loss(d, T, r);
    v[i] = keep - 1e-6;
    double lm = ref_loss(d, T, r);
    v[i] = keep;
    fd[i] = (lp - lm) / 2e-6;
  }
}

START_TEST(test_lstm_gradient) {
  int lengths[] = {0, 1, 5};
  lstm_data d;
  data_init(&d);
  double r[(TMAX + 2) * B * H];
  fill(r, (TMAX + 2) * B * H, 9);
  for (int li = 0; li < 3; li++) {
    int T = lengths[li];
    kiln_scope_begin();
    lstm m = lstm_make(&d, KILN_F64);
    kiln_tensor *in[3] = {from(KILN_F64, 2, (int64_t[]){B, H}, d.h0), from(KILN_F64, 2, (int64_t[]){B, H}, d.c0),
                          from(KILN_F64, 3, (int64_t[]){T, B, I}, d.x)};
    for (int i = 0; i < 3; i++) kiln_requires_grad(in[i], true);
    kiln_tensor *out[3];
    ck_assert_msg(lstm_forward(&m, in, out) == 0, "%s", kiln_last_error());
    kiln_tensor *loss = kiln_add(
        kiln_add(kiln_sum_all(kiln_mul(out[2], from(KILN_F64, 3, (int64_t[]){T, B, H}, r))),
                 kiln_sum_all(kiln_mul(out[0], from(KILN_F64, 2, (int64_t[]){B, H}, r + TMAX * B * H)))),
        kiln_sum_all(kiln_mul(out[1], from(KILN_F64, 2, (int64_t[]){B, H}, r + (TMAX + 1) * B * H))));
    double l;
    ck_assert_int_eq(0, kiln_read(loss, &l, sizeof l));
    ck_assert_msg(fabs(l - ref_loss(&d, T, r)) < 1e-12, "T=%d: loss %.15g, reference %.15g", T, l, ref_loss(&d, T, r));
    ck_assert_msg(kiln_backward(loss) == 0, "%s", kiln_last_error());
    kiln_tensor *leaves[6] = {m.wx, m.wh, m.bias, in[0], in[1], in[2]};
    double *vals[6] = {d.wx, d.wh, d.bias, d.h0, d.c0, d.x};
    int64_t ns[6] = {I * G, H * G, G, B * H, B * H, (int64_t)T * B * I};
    const char *names[6] = {"Wx", "Wh", "bias", "h0", "c0", "x"};
    for (int k = 0; k < 6; k++) {
      double g[H * G] = {0}, fd[H * G];
      /* no step ran (T = 0): autograd never reached the weights */
      if (kiln_grad(leaves[k]) || T > 0) read_f64(kiln_grad(leaves[k]), g, ns[k]);
      fd_grad(&d, T, r, vals[k], ns[k], fd);
      close_all(fd, g, ns[k], 1e-6, names[k], T);
    }
    kiln_scope_end();
  }
}
END_TEST

/* ---- compiled against eager ---- */

static const int LENGTHS[] = {0, 1, 2, 7, 1, 0, 7};
#define N_LENGTHS ((int)(sizeof LENGTHS / sizeof *LENGTHS))

START_TEST(test_lstm_compiled_forward) {
  lstm_data d;
  data_init(&d);
  for (int backend = KILN_BACKEND_INTERP; backend <= KILN_BACKEND_LLVM; backend++) {
    kiln_scope_begin();
    lstm m = lstm_make(&d, KILN_F32);
    kiln_fn *fn = kiln_compile(lstm_forward, &m,
                               &(kiln_options){.name = "lstm", .n_in = 3, .n_out = 3, .backend = backend, .max_variants = 16});
    ck_assert_msg(fn != NULL, "%s", kiln_last_error());
    for (int li = 0; li < N_LENGTHS; li++) {
      int T = LENGTHS[li];
      kiln_scope_begin();
      kiln_tensor *in[3] = {from(KILN_F32, 2, (int64_t[]){B, H}, d.h0), from(KILN_F32, 2, (int64_t[]){B, H}, d.c0),
                            from(KILN_F32, 3, (int64_t[]){T, B, I}, d.x)};
      kiln_tensor *got[3], *want[3];
      ck_assert_msg(kiln_call(fn, in, got) == 0, "T=%d: %s", T, kiln_last_error());
      ck_assert_msg(lstm_forward(&m, in, want) == 0, "%s", kiln_last_error());
      double h[B * H], c[B * H], hs[TMAX * B * H];
      memcpy(h, d.h0, sizeof h);
      memcpy(c, d.c0, sizeof c);
      lstm_ref(&d, T, h, c, hs);
      const double *ref[3] = {h, c, hs};
      int64_t ns[3] = {B * H, B * H, (int64_t)T * B * H};
      const char *names[3] = {"h_T", "c_T", "hs"};
      ck_assert_int_eq(3, kiln_ndim(got[2]));
      ck_assert_int_eq(T, kiln_size(got[2], 0));
      for (int k = 0; k < 3; k++) {
        double g[TMAX * B * H], e[TMAX * B * H];
        read_f64(got[k], g, ns[k]);
        read_f64(want[k], e, ns[k]);
        close_all(e, g, ns[k], 1e-5, names[k], T);      /* compiled against eager */
        close_all(ref[k], e, ns[k], 1e-5, names[k], T); /* eager against the reference */
      }
      kiln_scope_end();
    }
    kiln_fn_stats st;
    ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
    ck_assert_int_eq(N_LENGTHS, st.calls);
    ck_assert_int_eq(0, st.fallbacks); /* compiled code ran every call */
    ck_assert_int_ge(st.hits, 3);      /* the lengths seen twice */
    kiln_fn_free(fn);
    kiln_scope_end();
  }
}
END_TEST

/* A training step: in = (h0, c0, x (T,B,I), r (T,B,H)); the loss
 * sum(r * hs) + sum(h_T^2) + 1e-3 sum(Wh^2) (the last term keeps a loss
 * that needs grad at T = 0), its backward, then SGD on the weights in place;
 * out = the loss. */
static int train_step(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  lstm *m = ctx;
  kiln_tensor *f[3];
  if (lstm_forward(m, in, f)) return -1;
  kiln_tensor *loss = kiln_add(kiln_add(kiln_sum_all(kiln_mul(f[2], in[3])), kiln_sum_all(kiln_mul(f[0], f[0]))),
                               kiln_mul(kiln_scalar(KILN_F32, 1e-3), kiln_sum_all(kiln_mul(m->wh, m->wh))));
  if (!loss || kiln_backward(loss)) return -1;
  kiln_tensor *p[3] = {m->wx, m->wh, m->bias};
  kiln_no_grad_begin();
  for (int k = 0; k < 3; k++) {
    kiln_tensor *g = kiln_grad(p[k]); /* NULL when no step ran */
    if (g && !kiln_sub_(p[k], kiln_mul(kiln_scalar(KILN_F32, 0.1), g))) return -1;
    kiln_zero_grad(p[k]);
  }
  kiln_no_grad_end();
  out[0] = loss;
  return 0;
}

START_TEST(test_lstm_compiled_train_step) {
  lstm_data d;
  data_init(&d);
  double r[TMAX * B * H];
  fill(r, TMAX * B * H, 12);
  for (int backend = KILN_BACKEND_INTERP; backend <= KILN_BACKEND_LLVM; backend++) {
    kiln_scope_begin();
    lstm m = lstm_make(&d, KILN_F32), twin = lstm_make(&d, KILN_F32);
    kiln_fn *fn = kiln_compile(train_step, &m,
                               &(kiln_options){.name = "lstm_step", .n_in = 4, .n_out = 1, .backend = backend, .max_variants = 16});
    ck_assert_msg(fn != NULL, "%s", kiln_last_error());
    for (int li = 0; li < N_LENGTHS; li++) {
      int T = LENGTHS[li];
      kiln_scope_begin();
      kiln_tensor *in[4] = {from(KILN_F32, 2, (int64_t[]){B, H}, d.h0), from(KILN_F32, 2, (int64_t[]){B, H}, d.c0),
                            from(KILN_F32, 3, (int64_t[]){T, B, I}, d.x), from(KILN_F32, 3, (int64_t[]){T, B, H}, r)};
      kiln_tensor *got, *want;
      ck_assert_msg(kiln_call(fn, in, &got) == 0, "T=%d: %s", T, kiln_last_error());
      ck_assert_msg(train_step(&twin, in, &want) == 0, "%s", kiln_last_error());
      double lg, le;
      read_f64(got, &lg, 1);
      read_f64(want, &le, 1);
      close_all(&le, &lg, 1, 1e-5, "loss", T);
      /* the updates, compiled against eager: the weights stay twins */
      kiln_tensor *pc[3] = {m.wx, m.wh, m.bias}, *pe[3] = {twin.wx, twin.wh, twin.bias};
      const char *names[3] = {"Wx", "Wh", "bias"};
      for (int k = 0; k < 3; k++) {
        double g[H * G], e[H * G];
        int64_t n = kiln_numel(pe[k]);
        read_f64(pc[k], g, n);
        read_f64(pe[k], e, n);
        close_all(e, g, n, 1e-5, names[k], T);
        ck_assert(kiln_grad(pc[k]) == NULL); /* dropped, as eagerly */
      }
      kiln_scope_end();
    }
    /* the steps moved the weights: the comparison above compared updates */
    double w[H * G];
    read_f64(m.wh, w, H * G);
    ck_assert_msg(fabs(w[0] - d.wh[0]) > 1e-4, "Wh[0] did not move: %g", w[0]);
    kiln_fn_stats st;
    ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
    ck_assert_int_eq(0, st.fallbacks);
    kiln_fn_free(fn);
    kiln_scope_end();
  }
}
END_TEST

/* ---- gradients through the scan in a compiled function, f64 ---- */

/* in = (h0, c0, x (T,B,I), r (TMAX+2,B,H) weights of the loss); out = the
 * loss of ref_loss and its gradients by kiln_grad_of: Wx, Wh, bias, h0, c0, x. */
static int grad_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  lstm *m = ctx;
  kiln_tensor *f[3];
  if (lstm_forward(m, in, f)) return -1;
  int64_t T = kiln_size(in[2], 0);
  kiln_tensor *r_hs = kiln_slice(in[3], 0, 0, T, 1), *r_h = kiln_squeeze(kiln_slice(in[3], 0, TMAX, TMAX + 1, 1), 0),
              *r_c = kiln_squeeze(kiln_slice(in[3], 0, TMAX + 1, TMAX + 2, 1), 0);
  kiln_tensor *loss = kiln_add(kiln_add(kiln_sum_all(kiln_mul(f[2], r_hs)), kiln_sum_all(kiln_mul(f[0], r_h))),
                               kiln_sum_all(kiln_mul(f[1], r_c)));
  kiln_tensor *wrt[6] = {m->wx, m->wh, m->bias, in[0], in[1], in[2]};
  if (!loss || kiln_grad_of(loss, wrt, 6, out + 1)) return -1;
  out[0] = loss;
  return 0;
}

/* One compiled function serves every length (0 and 1 included): the scan
 * and its backward are one region each, whatever T. Its loss and gradients
 * equal eager's and central finite differences of the f64 reference, on
 * the interpreter and on LLVM. */
START_TEST(test_lstm_compiled_gradient) {
  static const int lengths[] = {5, 0, 1, 7, 8, 1, 0};
  enum { NL = sizeof lengths / sizeof *lengths };
  lstm_data d;
  data_init(&d);
  double r[(TMAX + 2) * B * H];
  fill(r, (TMAX + 2) * B * H, 9);
  int matmuls[2] = {0, 0}; /* in the graph, per scan_save policy */
  unsetenv("KILN_SCAN_SAVE"); /* each run's policy is its options' */
  for (int run = 0; run < 4; run++) {
    int backend = run % 2 ? KILN_BACKEND_LLVM : KILN_BACKEND_INTERP, save = run / 2;
    kiln_scope_begin();
    lstm m = lstm_make(&d, KILN_F64);
    kiln_fn *fn = kiln_compile(grad_body, &m,
                               &(kiln_options){.name = "lstm_grad", .n_in = 4, .n_out = 7, .backend = backend,
                                               .scan_save = save ? KILN_SCAN_SAVE_DOTS : KILN_SCAN_SAVE_CARRIES});
    ck_assert_msg(fn != NULL, "%s", kiln_last_error());
    for (int li = 0; li < NL; li++) {
      int T = lengths[li];
      kiln_scope_begin();
      kiln_tensor *in[4] = {from(KILN_F64, 2, (int64_t[]){B, H}, d.h0), from(KILN_F64, 2, (int64_t[]){B, H}, d.c0),
                            from(KILN_F64, 3, (int64_t[]){T, B, I}, d.x),
                            from(KILN_F64, 3, (int64_t[]){TMAX + 2, B, H}, r)};
      for (int i = 0; i < 3; i++) kiln_requires_grad(in[i], true);
      kiln_tensor *got[7], *want[7];
      ck_assert_msg(kiln_call(fn, in, got) == 0, "T=%d: %s", T, kiln_last_error());
      ck_assert_msg(grad_body(&m, in, want) == 0, "%s", kiln_last_error());
      double l;
      read_f64(got[0], &l, 1);
      ck_assert_msg(fabs(l - ref_loss(&d, T, r)) < 1e-12, "T=%d: loss %.15g, reference %.15g", T, l, ref_loss(&d, T, r));
      double *vals[6] = {d.wx, d.wh, d.bias, d.h0, d.c0, d.x};
      int64_t ns[6] = {I * G, H * G, G, B * H, B * H, (int64_t)T * B * I};
      const char *names[6] = {"Wx", "Wh", "bias", "h0", "c0", "x"};
      for (int k = 0; k < 6; k++) {
        double g[TMAX * B * I + H * G], e[TMAX * B * I + H * G], fd[TMAX * B * I + H * G];
        read_f64(got[1 + k], g, ns[k]);
        read_f64(want[1 + k], e, ns[k]);
        fd_grad(&d, T, r, vals[k], ns[k], fd);
        close_all(fd, g, ns[k], 1e-6, names[k], T); /* compiled against finite differences */
        close_all(e, g, ns[k], 1e-10, names[k], T); /* compiled against eager */
      }
      kiln_scope_end();
    }
    kiln_fn_stats st;
    ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
    ck_assert_int_eq(NL, st.calls);
    ck_assert_int_eq(0, st.fallbacks);
    ck_assert_int_eq(1, st.traces); /* one variant for every T */
    ck_assert_int_eq(1, st.variants);
    /* the forward scan and its reverse: two scan nodes, nothing unrolled */
    char *text = kiln_fn_graph(fn, 0);
    ck_assert_msg(text != NULL, "%s", kiln_last_error());
    int scans = 0;
    for (const char *p = text; (p = strstr(p, "= scan(")); p++) scans++;
    ck_assert_msg(scans == 2, "%d scan nodes in\n%s", scans, text);
    /* the weights' gradients are summed after the reverse loop (the sums
     * pass), not carried through it: both scans carry h and c alone */
    int two = 0;
    for (const char *p = text; (p = strstr(p, "{carry=2, ")); p++) two++;
    ck_assert_msg(two == 2, "%d of the scans carry h and c alone in\n%s", two, text);
    /* saving the forward's matmuls: the backward runs none of them again */
    matmuls[save] = 0;
    for (const char *p = text; (p = strstr(p, "= matmul(")); p++) matmuls[save]++;
    if (save) ck_assert_msg(matmuls[1] < matmuls[0], "%d matmuls saving them, %d recomputing", matmuls[1], matmuls[0]);
    free(text);
    kiln_fn_free(fn);
    kiln_scope_end();
  }
}
END_TEST

/* A scan_save that is no policy: kiln_compile says so. */
START_TEST(test_scan_save_unknown) {
  kiln_fn *fn = kiln_compile(grad_body, NULL, &(kiln_options){.n_in = 4, .scan_save = 5});
  ck_assert(fn == NULL);
  ck_assert_msg(strstr(kiln_last_error(), "unknown scan_save policy 5") != NULL, "%s", kiln_last_error());
}
END_TEST

static Suite *lstm_suite(void) {
  Suite *s = suite_create("lstm");
  TCase *tc = tcase_create("scan");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_lstm_gradient);
  tcase_add_test(tc, test_lstm_compiled_forward);
  tcase_add_test(tc, test_lstm_compiled_train_step);
  tcase_add_test(tc, test_lstm_compiled_gradient);
  tcase_add_test(tc, test_scan_save_unknown);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(lstm_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
