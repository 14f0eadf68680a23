/* test_winograd.c - the Winograd F(2x2, 3x3) convolution (src/eager/winograd.c)
 * against a direct convolution in double, element by element within a bound
 * proved for it (below): odd sizes (partial tiles), padding 0, 1 and 2, and
 * unequal, channel counts that are multiples of nothing, one image and
 * several, blocks and slots enough that the pool splits them, the rotated
 * weight of an input gradient. Also: the bits do not depend on the thread
 * count (on kiln's GEMM) nor on the working memory given, too little working memory is not
 * used, and out of memory is an error. The weight gradient likewise, with
 * a bound of its own. conv2d's choice of it (KILN_CONV)
 * is covered by test_ops_ref, run by ctest with either algorithm forced. */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "eager/eager.h"
#include "eager/gemm.h"
#include "eager/pool.h"

static uint64_t rng = 88172645463325252ull;
static float unif(void) { /* xorshift64 in [-1, 1) */
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return (float)((double)(rng >> 11) / 9007199254740992.0 * 2 - 1);
}

static wino_geom geom(int64_t n, int64_t c, int64_t h, int64_t w, int64_t o, int64_t ph, int64_t pw, bool flip) {
  return (wino_geom){.n = n, .c = c, .h = h, .w = w, .o = o, .ph = ph, .pw = pw, .ho = h + 2 * ph - 2,
                     .wo = w + 2 * pw - 2, .flip = flip};
}

static int64_t out_count(const wino_geom *q) { return q->n * q->o * q->ho * q->wo; }

/* The weight of (o, c) at (a, b) as the convolution applies it. */
static double wt(const wino_geom *q, const float *w, int64_t o, int64_t c, int a, int b) {
  return q->flip ? w[(c * q->o + o) * 9 + (2 - a) * 3 + (2 - b)] : w[(o * q->c + c) * 9 + a * 3 + b];
}

static double xat(const wino_geom *q, const float *x, int64_t ni, int64_t c, int64_t iy, int64_t ix) {
  return iy < 0 || iy >= q->h || ix < 0 || ix >= q->w ? 0 : x[((ni * q->c + c) * q->h + iy) * q->w + ix];
}

/* The exact output (in double) and, per element, the bound on the error of
 * the f32 Winograd result. The computation is Y = A^T (sum over c of
 * U_c * V_c) A with U = G g G^T, V = B^T d B; the entries of A, B and G are
 * 0, +-1 and +-1/2 (exact), and each value is formed by at most: U 4
 * rounded adds, V 2, the sum over c C products and adds (in any order,
 * fused or not), Y 4. Higham's gamma_n = n u / (1 - n u) then bounds the
 * error by gamma_{C+11} times the same expression in absolute values,
 * |A|^T (sum over c of (|G||g||G|^T) * (|B|^T|d||B|)) |A|, which this
 * computes in double beside the result (with C + 12 for the rounding of
 * the reference itself). Any mistake in a transform is off by the size of
 * the result, far beyond it. */
static void reference(const wino_geom *q, const float *x, const float *w, double *y, double *bound) {
  static const double G[4][3] = {{1, 0, 0}, {.5, .5, .5}, {.5, -.5, .5}, {0, 0, 1}};
  static const double BT[4][4] = {{1, 0, -1, 0}, {0, 1, 1, 0}, {0, -1, 1, 0}, {0, 1, 0, -1}};
  static const double AT[2][4] = {{1, 1, 1, 0}, {0, 1, -1, -1}};
  double u = FLT_EPSILON / 2, nu = (double)(q->c + 12) * u, gamma = nu / (1 - nu);
  for (int64_t ni = 0; ni < q->n; ni++)
    for (int64_t o = 0; o < q->o; o++)
      for (int64_t oy = 0; oy < q->ho; oy++)
        for (int64_t ox = 0; ox < q->wo; ox++) {
          double acc = 0;
          for (int64_t c = 0; c < q->c; c++)
            for (int a = 0; a < 3; a++)
              for (int b = 0; b < 3; b++) acc += wt(q, w, o, c, a, b) * xat(q, x, ni, c, oy - q->ph + a, ox - q->pw + b);
          int64_t at = ((ni * q->o + o) * q->ho + oy) * q->wo + ox;
          y[at] = acc;
          /* the tile holding (oy, ox): rows ty0.., its element (ry, rx) */
          int64_t ty0 = oy / 2 * 2, tx0 = ox / 2 * 2;
          int ry = (int)(oy - ty0), rx = (int)(ox - tx0);
          double m[4][4] = {{0}};
          for (int64_t c = 0; c < q->c; c++) {
            double ug[4][4], vd[4][4];
            for (int i = 0; i < 4; i++)
              for (int k = 0; k < 4; k++) {
                double su = 0, sv = 0;
                for (int a = 0; a < 3; a++)
                  for (int b = 0; b < 3; b++) su += fabs(G[i][a]) * fabs(wt(q, w, o, c, a, b)) * fabs(G[k][b]);
                for (int a = 0; a < 4; a++)
                  for (int b = 0; b < 4; b++)
                    sv += fabs(BT[i][a]) * fabs(xat(q, x, ni, c, ty0 - q->ph + a, tx0 - q->pw + b)) * fabs(BT[k][b]);
                ug[i][k] = su, vd[i][k] = sv;
              }
            for (int i = 0; i < 4; i++)
              for (int k = 0; k < 4; k++) m[i][k] += ug[i][k] * vd[i][k];
          }
          double s = 0;
          for (int i = 0; i < 4; i++)
            for (int k = 0; k < 4; k++) s += fabs(AT[ry][i]) * m[i][k] * fabs(AT[rx][k]);
          bound[at] = gamma * s;
        }
}

static void fill(float *p, int64_t n) {
  for (int64_t i = 0; i < n; i++) p[i] = unif();
}

/* Runs q and checks every element against the reference and its bound; returns the output. */
static float *check_geom(wino_geom q) {
  int64_t nx = q.n * q.c * q.h * q.w, nw = q.o * q.c * 9, ny = out_count(&q);
  float *x = malloc(sizeof(float) * (size_t)(nx + 1)), *w = malloc(sizeof(float) * (size_t)(nw + 1));
  float *y = malloc(sizeof(float) * (size_t)(ny + 1));
  double *ref = malloc(sizeof(double) * (size_t)(ny + 1)), *bound = malloc(sizeof(double) * (size_t)(ny + 1));
  fill(x, nx), fill(w, nw);
  for (int64_t i = 0; i < ny; i++) y[i] = NAN; /* every element must be written */
  ck_assert_int_eq(0, wino_conv_f32(&q, x, w, y, NULL, 0));
  reference(&q, x, w, ref, bound);
  for (int64_t i = 0; i < ny; i++) {
    double err = fabs((double)y[i] - ref[i]);
    ck_assert_msg(err <= bound[i], "n%lld c%lld %lldx%lld o%lld pad %lld,%lld%s: element %lld: expected %.9g, got %.9g "
                  "(error %.3g, bound %.3g)", (long long)q.n, (long long)q.c, (long long)q.h, (long long)q.w,
                  (long long)q.o, (long long)q.ph, (long long)q.pw, q.flip ? " flipped" : "", (long long)i, ref[i],
                  (double)y[i], err, bound[i]);
  }
  free(x), free(w), free(ref), free(bound);
  return y;
}

START_TEST(test_against_direct) {
  wino_geom cases[] = {
      geom(2, 17, 15, 13, 19, 1, 1, false), /* odd: partial tiles at the right and bottom */
      geom(1, 5, 7, 6, 3, 1, 1, false),     /* few channels, one image */
      geom(3, 7, 9, 11, 6, 0, 2, false),    /* unequal padding */
      geom(2, 4, 5, 5, 9, 2, 2, true),      /* an input gradient's: rotated weight, padding 2 */
      geom(1, 6, 8, 7, 5, 1, 0, true),
      geom(2, 3, 1, 1, 4, 1, 1, false),     /* a 1x1 image: one tile, all padding but the middle */
      geom(1, 2, 3, 3, 2, 0, 0, false),     /* one output element */
      geom(3, 16, 33, 31, 16, 1, 1, false), /* 816 tiles: several blocks and slots */
      geom(1, 33, 6, 6, 40, 1, 1, false),
      geom(1, 1, 4, 4, 1, 0, 1100, false), /* a run of 512 tiles wholly in the left padding */
      geom(1, 0, 4, 4, 0, 1, 1, false),    /* no channels either way */
  };
  pool_set_num_threads(2);
  for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) free(check_geom(cases[k]));
  pool_set_num_threads(0);
}
END_TEST

/* The same bits at 1, 2 and 3 threads (blocks of other sizes, split over
 * other slots), and on working memory sized at another thread count. */
START_TEST(test_threads_same_bits) {
  wino_geom q = geom(3, 16, 33, 31, 24, 1, 1, false);
  int64_t nx = q.n * q.c * q.h * q.w, nw = q.o * q.c * 9, ny = out_count(&q);
  float *x = malloc(sizeof(float) * (size_t)nx), *w = malloc(sizeof(float) * (size_t)nw);
  float *y[4];
  fill(x, nx), fill(w, nw);
  pool_set_num_threads(1);
  size_t bytes = wino_scratch_bytes(&q);
  void *scratch = alloc_aligned((bytes + 63) / 64 * 64);
  ck_assert_ptr_nonnull(scratch);
  for (int t = 0; t < 4; t++) {
    y[t] = malloc(sizeof(float) * (size_t)ny);
    pool_set_num_threads(t < 3 ? t + 1 : 3);
    /* the last run: 3 threads on working memory sized for 1 */
    ck_assert_int_eq(0, wino_conv_f32(&q, x, w, y[t], t == 3 ? scratch : NULL, t == 3 ? bytes : 0));
  }
  pool_set_num_threads(0);
  /* OpenBLAS's bits vary with the GEMMs' widths: conv.c takes Winograd by itself only on kiln's GEMM */
  if (strcmp(gemm_kernel_name(), "blas") != 0)
    for (int t = 1; t < 4; t++) ck_assert_msg(!memcmp(y[0], y[t], sizeof(float) * (size_t)ny), "run %d differs", t);
  alloc_aligned_free(scratch, (bytes + 63) / 64 * 64);
  for (int t = 0; t < 4; t++) free(y[t]);
  free(x), free(w);
  /* 16 channels each way, 256 tiles: at 4 threads a block's GEMMs (16 x 64 x 16) are below the size
   * kiln's GEMM takes from a caller outside the pool; a block's are always its own */
  q = geom(1, 16, 32, 32, 16, 1, 1, false);
  nx = q.n * q.c * q.h * q.w, nw = q.o * q.c * 9, ny = out_count(&q);
  x = malloc(sizeof(float) * (size_t)nx), w = malloc(sizeof(float) * (size_t)nw);
  fill(x, nx), fill(w, nw);
  for (int t = 0; t < 2; t++) {
    y[t] = malloc(sizeof(float) * (size_t)ny);
    pool_set_num_threads(t ? 4 : 1);
    ck_assert_int_eq(0, wino_conv_f32(&q, x, w, y[t], NULL, 0));
  }
  pool_set_num_threads(0);
  if (strcmp(gemm_kernel_name(), "blas") != 0)
    ck_assert_msg(!memcmp(y[0], y[1], sizeof(float) * (size_t)ny), "4 threads differ from 1 on narrow blocks");
  free(y[0]), free(y[1]), free(x), free(w);
}
END_TEST

/* Working memory too small for one block is left alone; out of memory is -1. */
START_TEST(test_scratch_and_oom) {
  wino_geom q = geom(2, 8, 9, 9, 8, 1, 1, false);
  int64_t nx = q.n * q.c * q.h * q.w, nw = q.o * q.c * 9, ny = out_count(&q);
  float *x = malloc(sizeof(float) * (size_t)nx), *w = malloc(sizeof(float) * (size_t)nw);
  float *y = malloc(sizeof(float) * (size_t)ny), *y2 = malloc(sizeof(float) * (size_t)ny), guard[64];
  fill(x, nx), fill(w, nw);
  for (int i = 0; i < 64; i++) guard[i] = 7;
  ck_assert_int_eq(0, wino_conv_f32(&q, x, w, y, NULL, 0));
  ck_assert_int_eq(0, wino_conv_f32(&q, x, w, y2, guard, sizeof guard));
  for (int i = 0; i < 64; i++) ck_assert_float_eq(7, guard[i]);
  ck_assert(!memcmp(y, y2, sizeof(float) * (size_t)ny));
#ifdef KILN_TEST_BUILD
  alloc_fail_after(1);
  ck_assert_int_eq(-1, wino_conv_f32(&q, x, w, y2, NULL, 0));
  alloc_fail_after(0);
#endif
  free(x), free(w), free(y), free(y2);
}
END_TEST

/* ---- the weight gradient (wino_grad_weight_f32) ----
 *
 * gw[o][c][a][b] = sum over images and output positions of gy * x under it.
 * Computed as G^T (sum over tiles of M * V) G with M = A dy A^T (at most 2
 * rounded adds an element), V = B^T d B (2), the sum over T tiles (T
 * products and adds, in any order) and G^T . G (4): Higham's gamma_{T+9}
 * bounds the error by the same expression in absolute values, which the
 * reference computes beside the exact result (T + 12 for its own rounding). */
static void reference_gw(const wino_geom *q, const float *x, const float *gy, double *gw, double *bound) {
  static const double G[4][3] = {{1, 0, 0}, {.5, .5, .5}, {.5, -.5, .5}, {0, 0, 1}};
  static const double BT[4][4] = {{1, 0, -1, 0}, {0, 1, 1, 0}, {0, -1, 1, 0}, {0, 1, 0, -1}};
  static const double A[4][2] = {{1, 0}, {1, 1}, {1, -1}, {0, -1}};
  int64_t th = (q->ho + 1) / 2, tw = (q->wo + 1) / 2, tiles = q->n * th * tw;
  double u = FLT_EPSILON / 2, nu = (double)(tiles + 12) * u, gamma = nu / (1 - nu);
  for (int64_t o = 0; o < q->o; o++)
    for (int64_t c = 0; c < q->c; c++) {
      double s[4][4] = {{0}};
      for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++) {
          double acc = 0;
          for (int64_t ni = 0; ni < q->n; ni++)
            for (int64_t oy = 0; oy < q->ho; oy++)
              for (int64_t ox = 0; ox < q->wo; ox++)
                acc += (double)gy[((ni * q->o + o) * q->ho + oy) * q->wo + ox] * xat(q, x, ni, c, oy - q->ph + a, ox - q->pw + b);
          gw[(o * q->c + c) * 9 + a * 3 + b] = acc;
        }
      for (int64_t ni = 0; ni < q->n; ni++)
        for (int64_t ty = 0; ty < th; ty++)
          for (int64_t tx = 0; tx < tw; tx++) {
            double dy[2][2];
            for (int a = 0; a < 2; a++)
              for (int b = 0; b < 2; b++) {
                int64_t oy = 2 * ty + a, ox = 2 * tx + b;
                dy[a][b] = oy < q->ho && ox < q->wo ? fabs(gy[((ni * q->o + o) * q->ho + oy) * q->wo + ox]) : 0;
              }
            for (int i = 0; i < 4; i++)
              for (int k = 0; k < 4; k++) {
                double sm = 0, sv = 0;
                for (int a = 0; a < 2; a++)
                  for (int b = 0; b < 2; b++) sm += fabs(A[i][a]) * dy[a][b] * fabs(A[k][b]);
                for (int a = 0; a < 4; a++)
                  for (int b = 0; b < 4; b++)
                    sv += fabs(BT[i][a]) * fabs(xat(q, x, ni, c, 2 * ty - q->ph + a, 2 * tx - q->pw + b)) * fabs(BT[k][b]);
                s[i][k] += sm * sv;
              }
          }
      for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++) {
          double t = 0;
          for (int i = 0; i < 4; i++)
            for (int k = 0; k < 4; k++) t += fabs(G[i][a]) * s[i][k] * fabs(G[k][b]);
          bound[(o * q->c + c) * 9 + a * 3 + b] = gamma * t;
        }
    }
}

/* Runs the weight gradient of q at 2 threads, checks every element against
 * the reference and its bound, then 1 and 3 threads and working memory sized
 * at 1 for the same bits (on kiln's GEMM). */
static void check_gw(wino_geom q) {
  int64_t nx = q.n * q.c * q.h * q.w, nw = q.o * q.c * 9, ny = out_count(&q);
  float *x = malloc(sizeof(float) * (size_t)(nx + 1)), *gy = malloc(sizeof(float) * (size_t)(ny + 1));
  float *gw[3];
  double *ref = malloc(sizeof(double) * (size_t)(nw + 1)), *bound = malloc(sizeof(double) * (size_t)(nw + 1));
  fill(x, nx), fill(gy, ny);
  reference_gw(&q, x, gy, ref, bound);
  pool_set_num_threads(1);
  size_t bytes = wino_grad_weight_scratch_bytes(&q);
  void *scratch = alloc_aligned((bytes + 63) / 64 * 64);
  ck_assert_ptr_nonnull(scratch);
  for (int t = 0; t < 3; t++) {
    gw[t] = malloc(sizeof(float) * (size_t)(nw + 1));
    for (int64_t i = 0; i < nw; i++) gw[t][i] = NAN; /* every element must be written */
    pool_set_num_threads(t == 0 ? 2 : t == 1 ? 1 : 3);
    ck_assert_int_eq(0, wino_grad_weight_f32(&q, x, gy, gw[t], t == 2 ? scratch : NULL, t == 2 ? bytes : 0));
  }
  pool_set_num_threads(0);
  for (int64_t i = 0; i < nw; i++) {
    double err = fabs((double)gw[0][i] - ref[i]);
    ck_assert_msg(err <= bound[i], "n%lld c%lld %lldx%lld o%lld pad %lld,%lld: weight gradient element %lld: expected %.9g, "
                  "got %.9g (error %.3g, bound %.3g)", (long long)q.n, (long long)q.c, (long long)q.h, (long long)q.w,
                  (long long)q.o, (long long)q.ph, (long long)q.pw, (long long)i, ref[i], (double)gw[0][i], err, bound[i]);
  }
  if (strcmp(gemm_kernel_name(), "blas") != 0)
    for (int t = 1; t < 3; t++) ck_assert_msg(!memcmp(gw[0], gw[t], sizeof(float) * (size_t)nw), "run %d differs", t);
  alloc_aligned_free(scratch, (bytes + 63) / 64 * 64);
  for (int t = 0; t < 3; t++) free(gw[t]);
  free(x), free(gy), free(ref), free(bound);
}

/* Small integers in, every intermediate an integer or a quarter well below
 * 2^24: each element must come out exact, so that a tile lost or counted
 * twice (at a chunk's edge, say), which the rounding bound above can miss
 * over thousands of tiles, shows. */
static void check_gw_exact(wino_geom q) {
  int64_t nx = q.n * q.c * q.h * q.w, nw = q.o * q.c * 9, ny = out_count(&q);
  float *x = malloc(sizeof(float) * (size_t)(nx + 1)), *gy = malloc(sizeof(float) * (size_t)(ny + 1));
  float *gw = malloc(sizeof(float) * (size_t)(nw + 1));
  double *ref = malloc(sizeof(double) * (size_t)(nw + 1)), *bound = malloc(sizeof(double) * (size_t)(nw + 1));
  for (int64_t i = 0; i < nx; i++) x[i] = floorf(unif() * 2.5f);
  for (int64_t i = 0; i < ny; i++) gy[i] = floorf(unif() * 2.5f);
  reference_gw(&q, x, gy, ref, bound);
  pool_set_num_threads(2);
  ck_assert_int_eq(0, wino_grad_weight_f32(&q, x, gy, gw, NULL, 0));
  pool_set_num_threads(0);
  for (int64_t i = 0; i < nw; i++)
    ck_assert_msg((double)gw[i] == ref[i], "n%lld c%lld %lldx%lld o%lld: weight gradient element %lld: expected %.1f exactly, got %.9g",
                  (long long)q.n, (long long)q.c, (long long)q.h, (long long)q.w, (long long)q.o, (long long)i, ref[i],
                  (double)gw[i]);
  free(x), free(gy), free(gw), free(ref), free(bound);
}

START_TEST(test_grad_weight_against_direct) {
  wino_geom cases[] = {
      geom(2, 5, 15, 13, 7, 1, 1, false),   /* odd: partial tiles, their gradient 0 past the edge */
      geom(4, 4, 61, 59, 6, 1, 1, false),   /* 3720 tiles: two chunks, the second added to the first */
      geom(1, 3, 9, 11, 2, 0, 2, false),    /* unequal padding */
      geom(2, 3, 1, 1, 4, 1, 1, false),     /* a 1x1 image */
      geom(1, 2, 6, 1100, 2, 1, 1, false),  /* rows of 550 tiles: runs cut at 512 */
      geom(1, 17, 6, 6, 19, 1, 1, false),
  };
  for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) check_gw(cases[k]);
  check_gw_exact(geom(4, 4, 61, 59, 6, 1, 1, false)); /* two chunks */
  check_gw_exact(geom(1, 40, 33, 33, 8, 1, 1, false)); /* chunks of other sizes, a last one short */
  /* no images, or no output: zeros; no channels: nothing to write */
  wino_geom q = geom(0, 3, 5, 5, 2, 1, 1, false);
  float gw[54];
  for (int i = 0; i < 54; i++) gw[i] = NAN;
  ck_assert_int_eq(0, wino_grad_weight_f32(&q, NULL, NULL, gw, NULL, 0));
  for (int i = 0; i < 54; i++) ck_assert_float_eq(0, gw[i]);
  q = geom(1, 0, 5, 5, 0, 1, 1, false);
  ck_assert_int_eq(0, wino_grad_weight_f32(&q, NULL, NULL, gw, NULL, 0));
#ifdef KILN_TEST_BUILD
  q = geom(1, 4, 6, 6, 4, 1, 1, false);
  float x[144] = {0}, gy[144] = {0};
  alloc_fail_after(1);
  ck_assert_int_eq(-1, wino_grad_weight_f32(&q, x, gy, gw, NULL, 0));
  alloc_fail_after(0);
#endif
}
END_TEST

int main(void) {
  Suite *s = suite_create("winograd");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_against_direct);
  tcase_add_test(tc, test_threads_same_bits);
  tcase_add_test(tc, test_scratch_and_oom);
  tcase_add_test(tc, test_grad_weight_against_direct);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
