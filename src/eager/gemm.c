/* gemm.c - kiln's own single-precision GEMM (x86-64 with AVX-512; AVX2
 * and FMA when asked for), which eager matmul, convolution and compiled
 * code all call.
 *
 * Why not only OpenBLAS: its speed depends on which kernels it picks. The
 * 0.3.21 of Debian 12 predates AMD Zen 5, and where OPENBLAS_CORETYPE or
 * its CPU table gives it Haswell kernels it runs at 256 bits, 1.5-1.8x
 * slower than this one; against its own AVX-512 kernels this one is at
 * parity, ahead on an LLM head (x @ W^T: W is read in place, never
 * transposed). It also runs on kiln's pool, with no second set of threads
 * spinning after each call, and gives the same bits at any thread count.
 *
 * The loops are BLIS's: C is cut into NC-wide column blocks and K into
 * slices of at most KC; each slice of B is packed into NR-wide panels
 * (k-major), each MC-row block of A into MR-row panels, and a micro-kernel
 * holds one MR x NR tile of C in registers across the slice. Threads split
 * the tiles of a slice, never K, so every element of C sums its products in
 * one order whatever the thread count: results do not depend on threads,
 * and eager and compiled code agree to the bit. libkiln_rt builds this file
 * too: an exported model's products run the JIT's kernel. */
#include "eager/gemm.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "eager/pool.h"
#ifdef KILN_RT_BUILD
/* libkiln_rt (exported models) has no eager allocator: plain aligned memory */
static void *alloc_aligned(size_t n) { return aligned_alloc(64, n); }
static void alloc_aligned_free(void *p, size_t n) { (void)n, free(p); }
#else
#include "eager/eager.h"
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

enum {
  KC_MAX = 384,       /* a B panel slice (KC x NR floats) stays in L1, an A block in L2 */
  MC = 96,            /* rows of A per task: its A panels (MC x KC floats) stay in L2 */
  MB = 4032,          /* rows of A packed per block (a multiple of both MRs) */
  NC = 3072,          /* columns of B packed per block (KC x NC floats in L3) */
  MR512 = 8, NR512 = 32, /* AVX-512: 16 accumulators of 16 lanes */
  MR256 = 6, NR256 = 16, /* AVX2: 12 accumulators of 8 lanes */
  MIN_ROWS = 6,       /* fewer rows of C (or of C^T) leave most of a tile idle: OpenBLAS does better */
  MIN_WORK = 1 << 15, /* m * n * k below which OpenBLAS's lower overhead wins */
  PAR_WORK = 1 << 20  /* ... below which one thread does it all */
};

typedef struct gemm_job {
  bool tb, ta;
  bool direct_a; /* A row-major: the kernel reads its rows in place, no A panels */
  bool ct;       /* the product computed is C^T: tiles are stored transposed */
  int mr, nr;
  int64_t m, n, k, lda, ldb, ldc;
  float alpha, beta;
  const float *a, *b;
  float *c;
  int64_t jc, nc, ic, mb, pc, kc; /* the block: columns [jc, jc + nc), rows [ic, ic + mb), K slice [pc, pc + kc) */
  float *bp;                       /* the slice of B packed: ceil(nc / nr) panels of kc x nr */
  float *ap;                       /* the slice of A packed: ceil(mb / mr) panels of kc x mr */
  int64_t ngroups, panels_per_group;
  bool pack_b_in_task; /* one task per panel group: each packs its own B panels */
} gemm_job;

/* ---- packing ---- */

/* dst[i * dld + j] = src[j * ld + i] for i < 16, j < rows (16 or 8), in registers */
__attribute__((target("avx512f"))) static inline void tr16(const float *src, int64_t ld, int rows, float *dst,
                                                           int64_t dld) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; i++) r[i] = i < rows ? _mm512_loadu_ps(src + i * ld) : _mm512_setzero_ps();
  for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  for (int i = 0; i < 16; i += 4) {
    __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; i++) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; i++) {
    __m512 lo = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88), hi = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    if (rows == 16) {
      _mm512_storeu_ps(dst + i * dld, lo);
      _mm512_storeu_ps(dst + (i + 8) * dld, hi);
    } else {
      _mm256_storeu_ps(dst + i * dld, _mm512_castps512_ps256(lo));
      _mm256_storeu_ps(dst + (i + 8) * dld, _mm512_castps512_ps256(hi));
    }
  }
}

/* tt[j * 8 + i] = t[i * 32 + j]: an AVX-512 tile of C^T turned to C's rows */
__attribute__((target("avx512f"))) static void transpose_tile512(const float *t, float *tt) {
  tr16(t, NR512, MR512, tt, MR512);
  tr16(t + 16, NR512, MR512, tt + 16 * MR512, MR512);
}

/* dst[kk * 32 + jj] = src[jj * ld + kk] for jj < 32: a B^T panel, 16 x 16 blocks transposed in registers */
__attribute__((target("avx512f"))) static void pack_t512(const float *src, int64_t ld, int64_t kc, float *dst) {
  int64_t kk = 0;
  for (; kk + 16 <= kc; kk += 16) {
    tr16(src + kk, ld, 16, dst + kk * 32, 32);
    tr16(src + 16 * ld + kk, ld, 16, dst + kk * 32 + 16, 32);
  }
  for (; kk < kc; kk++)
    for (int jj = 0; jj < 32; jj++) dst[kk * 32 + jj] = src[jj * ld + kk];
}

/* the same for 16 columns with AVX2 */
__attribute__((target("avx2"))) static void pack_t256(const float *src, int64_t ld, int64_t kc, float *dst) {
  __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)ld));
  const float *hi = src + 8 * ld;
  for (int64_t kk = 0; kk < kc; kk++) {
    _mm256_storeu_ps(dst + kk * 16, _mm256_i32gather_ps(src + kk, idx, 4));
    _mm256_storeu_ps(dst + kk * 16 + 8, _mm256_i32gather_ps(hi + kk, idx, 4));
  }
}

/* dst[kk * 32 + jj] = src[kk * ld + jj]: a row-major B panel */
__attribute__((target("avx512f"))) static void copy_rows512(const float *src, int64_t ld, int64_t kc, float *dst) {
  for (int64_t kk = 0; kk < kc; kk++) {
    _mm512_storeu_ps(dst + kk * 32, _mm512_loadu_ps(src + kk * ld));
    _mm512_storeu_ps(dst + kk * 32 + 16, _mm512_loadu_ps(src + kk * ld + 16));
  }
}

/* the same for 16 columns with AVX2 */
__attribute__((target("avx2"))) static void copy_rows256(const float *src, int64_t ld, int64_t kc, float *dst) {
  for (int64_t kk = 0; kk < kc; kk++) {
    _mm256_storeu_ps(dst + kk * 16, _mm256_loadu_ps(src + kk * ld));
    _mm256_storeu_ps(dst + kk * 16 + 8, _mm256_loadu_ps(src + kk * ld + 8));
  }
}

/* Panels [p0, p1) of the current B slice, zero padded past n. */
static void pack_b(void *ctx, int64_t p0, int64_t p1) {
  const gemm_job *g = ctx;
  const int nr = g->nr;
  for (int64_t p = p0; p < p1; p++) {
    float *dst = g->bp + p * g->kc * nr;
    int64_t j0 = g->jc + p * nr, w = g->jc + g->nc - j0;
    if (w > nr) w = nr;
    if (!g->tb) {
      const float *src = g->b + g->pc * g->ldb + j0;
      if (w == nr) {
        if (nr == 32) copy_rows512(src, g->ldb, g->kc, dst);
        else copy_rows256(src, g->ldb, g->kc, dst);
        continue;
      }
      for (int64_t kk = 0; kk < g->kc; kk++) {
        memcpy(dst + kk * nr, src + kk * g->ldb, (size_t)w * sizeof(float));
        if (w < nr) memset(dst + kk * nr + w, 0, (size_t)(nr - w) * sizeof(float));
      }
      continue;
    }
    /* b holds B^T: column j of B is row j of b, contiguous along k */
    const float *src = g->b + j0 * g->ldb + g->pc;
    if (w == nr && (nr == 32 || g->ldb <= INT32_MAX / nr)) {
      if (nr == 32) pack_t512(src, g->ldb, g->kc, dst);
      else pack_t256(src, g->ldb, g->kc, dst);
      continue;
    }
    for (int64_t jj = 0; jj < nr; jj++)
      for (int64_t kk = 0; kk < g->kc; kk++) dst[kk * nr + jj] = jj < w ? src[jj * g->ldb + kk] : 0;
  }
}

/* dst[kk * 8 + ii] = src[ii * ld + kk] for ii < 8: a row-major A panel (AVX-512's MR) */
__attribute__((target("avx512f"))) static void pack_a512(const float *src, int64_t ld, int64_t kc, float *dst) {
  int64_t kk = 0;
  for (; kk + 16 <= kc; kk += 16) tr16(src + kk, ld, 8, dst + kk * 8, 8);
  for (; kk < kc; kk++)
    for (int ii = 0; ii < 8; ii++) dst[kk * 8 + ii] = src[ii * ld + kk];
}

/* Panels [p0, p1) of the current A slice (MR rows each), zero padded past m. */
static void pack_a(void *ctx, int64_t p0, int64_t p1) {
  const gemm_job *g = ctx;
  const int mr = g->mr;
  int64_t sr = g->ta ? 1 : g->lda, sk = g->ta ? g->lda : 1; /* strides of a row and of k */
  for (int64_t p = p0; p < p1; p++) {
    float *dst = g->ap + p * g->kc * mr;
    int64_t i0 = g->ic + p * mr, h = g->ic + g->mb - i0 < mr ? g->ic + g->mb - i0 : mr;
    if (g->direct_a && h == mr) continue; /* read in place */
    if (g->ta && h == mr) { /* a holds A^T: the panel's rows at one k are adjacent */
      const float *src = g->a + g->pc * g->lda + i0;
      if (mr == MR512) /* sizes the compiler sees, so no calls */
        for (int64_t kk = 0; kk < g->kc; kk++) memcpy(dst + kk * MR512, src + kk * g->lda, MR512 * sizeof(float));
      else
        for (int64_t kk = 0; kk < g->kc; kk++) memcpy(dst + kk * MR256, src + kk * g->lda, MR256 * sizeof(float));
      continue;
    }
    if (!g->ta && h == mr && mr == MR512) {
      pack_a512(g->a + i0 * g->lda + g->pc, g->lda, g->kc, dst);
      continue;
    }
    for (int64_t ii = 0; ii < mr; ii++) {
      const float *src = g->a + (i0 + ii) * sr + g->pc * sk;
      for (int64_t kk = 0; kk < g->kc; kk++) dst[kk * mr + ii] = ii < h ? src[kk * sk] : 0;
    }
  }
}

/* ---- micro-kernels: the tile t (MR x NR) = A panel^T (kc x MR) times B panel (kc x NR) ---- */

/* A's element (i, kk) is ap[i * sa + kk * sk]: a packed panel (sa 1, sk MR)
 * or rows of a row-major A in place (sa its row stride, sk 1). */
/* kern512 for products of at most 16 columns (a deep conv layer at batch 1):
 * an 8 x 16 tile, one vector a row, named accumulators (see ROW256). */
#define ROW16(i)                                                     \
  {                                                                  \
    c##i = _mm512_fmadd_ps(_mm512_set1_ps(ap[(i) * sa]), b0, c##i);  \
  }
__attribute__((target("avx512f"))) static void kern512n16(int64_t kc, const float *ap, int64_t sa, int64_t sk,
                                                          const float *bp, float *t) {
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
  for (int64_t kk = 0; kk < kc; kk++) {
    __m512 b0 = _mm512_loadu_ps(bp);
    ROW16(0) ROW16(1) ROW16(2) ROW16(3) ROW16(4) ROW16(5) ROW16(6) ROW16(7)
    ap += sk, bp += 16;
  }
  _mm512_storeu_ps(t, c0), _mm512_storeu_ps(t + 16, c1), _mm512_storeu_ps(t + 32, c2);
  _mm512_storeu_ps(t + 48, c3), _mm512_storeu_ps(t + 64, c4), _mm512_storeu_ps(t + 80, c5);
  _mm512_storeu_ps(t + 96, c6), _mm512_storeu_ps(t + 112, c7);
}
#undef ROW16

__attribute__((target("avx512f"))) static void kern512(int64_t kc, const float *ap, int64_t sa, int64_t sk,
                                                       const float *bp, float *t) {
  __m512 c0[MR512], c1[MR512];
  for (int i = 0; i < MR512; i++) c0[i] = c1[i] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < kc; kk++) {
    __m512 b0 = _mm512_loadu_ps(bp), b1 = _mm512_loadu_ps(bp + 16);
    for (int i = 0; i < MR512; i++) {
      __m512 av = _mm512_set1_ps(ap[i * sa]);
      c0[i] = _mm512_fmadd_ps(av, b0, c0[i]);
      c1[i] = _mm512_fmadd_ps(av, b1, c1[i]);
    }
    ap += sk, bp += NR512;
  }
  for (int i = 0; i < MR512; i++) {
    _mm512_storeu_ps(t + i * NR512, c0[i]);
    _mm512_storeu_ps(t + i * NR512 + 16, c1[i]);
  }
}

/* Named accumulators, not arrays: GCC keeps an array of them in memory
 * and stores every one after each multiply-add. */
#define ROW256(i)                                                    \
  {                                                                  \
    __m256 av = _mm256_broadcast_ss(ap + (i) * sa);                  \
    c0##i = _mm256_fmadd_ps(av, b0, c0##i);                          \
    c1##i = _mm256_fmadd_ps(av, b1, c1##i);                          \
  }
#define OUT256(i)                                                    \
  _mm256_storeu_ps(t + (i) * NR256, c0##i), _mm256_storeu_ps(t + (i) * NR256 + 8, c1##i)
__attribute__((target("avx2,fma"))) static void kern256(int64_t kc, const float *ap, int64_t sa, int64_t sk,
                                                         const float *bp, float *t) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c04 = c00, c05 = c00;
  __m256 c10 = c00, c11 = c00, c12 = c00, c13 = c00, c14 = c00, c15 = c00;
  for (int64_t kk = 0; kk < kc; kk++) {
    __m256 b0 = _mm256_loadu_ps(bp), b1 = _mm256_loadu_ps(bp + 8);
    ROW256(0) ROW256(1) ROW256(2) ROW256(3) ROW256(4) ROW256(5)
    ap += sk, bp += NR256;
  }
  OUT256(0), OUT256(1), OUT256(2), OUT256(3), OUT256(4), OUT256(5);
}
#undef ROW256
#undef OUT256

/* The tile into C (h x w of it): C = alpha t + beta C on the first K slice, C += alpha t after. */
static void store_tile(const gemm_job *g, const float *t, int64_t i0, int64_t j0, int64_t h, int64_t w) {
  const float alpha = g->alpha, beta = g->beta;
  if (!g->ct) { /* rows of C: unit stride, so the loops vectorize */
    for (int64_t i = 0; i < h; i++) {
      float *c = g->c + (i0 + i) * g->ldc + j0;
      const float *s = t + i * g->nr;
      if (g->pc > 0)
        for (int64_t j = 0; j < w; j++) c[j] += alpha * s[j];
      else if (beta == 0 && alpha == 1)
        memcpy(c, s, (size_t)w * sizeof(float));
      else if (beta == 0)
        for (int64_t j = 0; j < w; j++) c[j] = alpha * s[j];
      else
        for (int64_t j = 0; j < w; j++) c[j] = alpha * s[j] + beta * c[j];
    }
    return;
  }
  if (g->mr == MR512 && g->nr == NR512 && h == MR512) { /* transposed in registers, then C's rows in runs of 8 */
    float tt[MR512 * NR512] __attribute__((aligned(64)));
    transpose_tile512(t, tt);
    for (int64_t j = 0; j < w; j++) {
      float *c = g->c + (j0 + j) * g->ldc + i0;
      const float *s = tt + j * MR512;
      if (g->pc > 0)
        for (int i = 0; i < MR512; i++) c[i] += alpha * s[i];
      else if (beta == 0)
        for (int i = 0; i < MR512; i++) c[i] = alpha * s[i];
      else
        for (int i = 0; i < MR512; i++) c[i] = alpha * s[i] + beta * c[i];
    }
    return;
  }
  /* element (i, j) of the product goes to c[i * si + j * sj] */
  int64_t si = 1, sj = g->ldc;
  for (int64_t i = 0; i < h; i++) {
    float *c = g->c + (i0 + i) * si + j0 * sj;
    const float *s = t + i * g->nr;
    if (g->pc > 0)
      for (int64_t j = 0; j < w; j++) c[j * sj] += g->alpha * s[j];
    else if (g->beta == 0)
      for (int64_t j = 0; j < w; j++) c[j * sj] = g->alpha * s[j];
    else
      for (int64_t j = 0; j < w; j++) c[j * sj] = g->alpha * s[j] + g->beta * c[j * sj];
  }
}

/* Tasks [t0, t1): task t is MC-row block t / ngroups of the A block against
 * panel group t % ngroups of the B block. */
static void compute(void *ctx, int64_t t0, int64_t t1) {
  const gemm_job *g = ctx;
  const int mr = g->mr, nr = g->nr;
  float tile[MR512 * NR512] __attribute__((aligned(64)));
  int64_t npanels = (g->nc + nr - 1) / nr;
  for (int64_t t = t0; t < t1; t++) {
    int64_t r_begin = t / g->ngroups * MC, r_end = r_begin + MC < g->mb ? r_begin + MC : g->mb;
    int64_t grp = t % g->ngroups, p_end = (grp + 1) * g->panels_per_group;
    if (p_end > npanels) p_end = npanels;
    if (g->pack_b_in_task) pack_b((void *)g, grp * g->panels_per_group, p_end);
    for (int64_t p = grp * g->panels_per_group; p < p_end; p++) {
      int64_t j0 = g->jc + p * nr, w = g->jc + g->nc - j0 < nr ? g->jc + g->nc - j0 : nr;
      const float *bp = g->bp + p * g->kc * nr;
      for (int64_t r = r_begin; r < r_end; r += mr) {
        int64_t h = r_end - r < mr ? r_end - r : mr, sa = 1, sk = mr;
        const float *ap = g->ap + r * g->kc; /* r is a multiple of mr: MC is */
        if (g->direct_a && h == mr) ap = g->a + (g->ic + r) * g->lda + g->pc, sa = g->lda, sk = 1;
        if (mr == MR512 && nr == NR512) kern512(g->kc, ap, sa, sk, bp, tile);
        else if (mr == MR512) kern512n16(g->kc, ap, sa, sk, bp, tile);
        else kern256(g->kc, ap, sa, sk, bp, tile);
        store_tile(g, tile, g->ic + r, j0, h, w);
      }
    }
  }
}

static _Atomic int isa_level; /* 0 not yet known, 1 none (BLAS), 2 AVX2 and FMA, 3 AVX-512 */
static _Atomic int blas512;   /* 0 not yet known, 1 OpenBLAS runs 256-bit kernels, 2 its AVX-512 ones */
static _Atomic bool force_own; /* KILN_GEMM=kiln: every product this kernel takes, none left to OpenBLAS */

char *openblas_get_corename(void);

/* OpenBLAS picks its kernels by CPU model, or by OPENBLAS_CORETYPE. Its
 * AVX-512 ones (Skylake-X, Cooper Lake, Sapphire Rapids) beat this kernel
 * by about 10% on products of several row blocks, and lose to it on one
 * row block (a batch-1 or short-sequence layer), on x @ W^T and on 16
 * columns or fewer (a deep conv layer at batch 1). */
bool gemm_blas_avx512(void) {
  int v = atomic_load_explicit(&blas512, memory_order_relaxed);
  if (!v) {
    const char *name = openblas_get_corename();
    v = 1;
    for (const char *p = name; p && *p && v == 1; p++)
      if (!strncasecmp(p, "skylakex", 8) || !strncasecmp(p, "cooperlake", 10) || !strncasecmp(p, "sapphire", 8)) v = 2;
    atomic_store_explicit(&blas512, v, memory_order_relaxed);
  }
  return v == 2;
}


/* AVX-512 runs kiln's kernel by default. On AVX2 alone OpenBLAS's Haswell
 * kernel is 3-10% faster than the 6x16 one, so that one runs only when
 * asked for (KILN_GEMM=avx2, also on an AVX-512 CPU, for tests). */
static int isa(void) {
  int l = atomic_load_explicit(&isa_level, memory_order_relaxed);
  if (l) return l;
  const char *env = getenv("KILN_GEMM");
  bool want_avx2 = env && !strcmp(env, "avx2");
  __builtin_cpu_init();
  atomic_store_explicit(&force_own, env && !strcmp(env, "kiln"), memory_order_relaxed);
  if (env && !strcmp(env, "blas")) l = 1;
  else if (__builtin_cpu_supports("avx512f") && !want_avx2) l = 3;
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && want_avx2) l = 2;
  else l = 1;
  atomic_store_explicit(&isa_level, l, memory_order_relaxed);
  return l;
}

const char *gemm_kernel_name(void) { return isa() == 3 ? "avx512" : isa() == 2 ? "avx2" : "blas"; }

/* kgemm_f32; alone: the caller is a pool task, which OpenBLAS's threads
 * would oversubscribe, so kiln's kernel runs wherever it can. */
static bool kgemm(bool alone, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                  int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  int level = isa();
  /* alone: a Winograd block's GEMMs, whose widths follow the thread count,
   * all run here even when small, so that their bits do not */
  if (level < 2 || m < MIN_ROWS || n < 1 || k < 1 || (!alone && (double)m * (double)n * (double)k < MIN_WORK))
    return false;
  bool head = tb && !ta && n >= 4 * m && m >= MR512; /* x @ W^T, W the wider: see below */
  if (level == 3 && m > MC && n > 16 && !head && !alone && !atomic_load_explicit(&force_own, memory_order_relaxed) &&
      gemm_blas_avx512())
    return false;
  gemm_job g = {.ta = ta, .tb = tb, .m = m, .n = n, .k = k, .lda = lda, .ldb = ldb, .ldc = ldc,
                .alpha = alpha, .beta = beta, .a = a, .b = b, .c = c};
  /* x @ W^T with W the big one (an LLM's head, a linear layer of (out,in)
   * weights): compute C^T = W @ x^T, so that W is read in place and only
   * x is packed, where packing W^T would stream all of W twice more. */
  if (head) {
    g.m = n, g.n = m, g.a = b, g.lda = ldb, g.b = a, g.ldb = lda, g.tb = true, g.ct = true;
    m = g.m, n = g.n;
  }
  /* A row-major: its rows are read in place, MR streams the prefetchers
   * follow, unless rows 4 KiB apart would fight over the same L1 sets. */
  g.direct_a = !g.ta && g.lda % 1024 != 0;
  g.mr = level == 3 ? MR512 : MR256;
  g.nr = level == 3 ? NR512 : NR256;
  if (level == 3 && n <= 16) g.nr = 16; /* a 32-wide tile would leave half its lanes idle */
  int64_t slices = (k + KC_MAX - 1) / KC_MAX, kc = (k + slices - 1) / slices; /* even slices: no thin tail */
  int64_t ncap = n < NC ? n : NC, mcap = m < MB ? m : MB;
  size_t bbytes = ((size_t)((ncap + g.nr - 1) / g.nr * g.nr) * (size_t)kc * sizeof(float) + 63) & ~(size_t)63;
  size_t abytes = ((size_t)((mcap + g.mr - 1) / g.mr * g.mr) * (size_t)kc * sizeof(float) + 63) & ~(size_t)63;
  g.bp = alloc_aligned(bbytes);
  g.ap = alloc_aligned(abytes);
  if (!g.bp || !g.ap) {
    alloc_aligned_free(g.bp, bbytes);
    alloc_aligned_free(g.ap, abytes);
    return false;
  }
  bool parallel = !alone && (double)m * (double)n * (double)k >= PAR_WORK;
  int threads = parallel ? pool_num_threads() : 1;
  /* Each pool job wakes threads: with one row block, the tasks pack their
   * own B panels, and a row-major A needs at most its last panel packed. */
  g.pack_b_in_task = m <= MC;
  for (g.jc = 0; g.jc < n; g.jc += NC) {
    g.nc = n - g.jc < NC ? n - g.jc : NC;
    int64_t bpanels = (g.nc + g.nr - 1) / g.nr;
    for (g.pc = 0; g.pc < k; g.pc += kc) {
      g.kc = k - g.pc < kc ? k - g.pc : kc;
      if (!g.pack_b_in_task) pool_parallel_for(bpanels, parallel ? 4 : bpanels, pack_b, &g);
      for (g.ic = 0; g.ic < m; g.ic += MB) {
        g.mb = m - g.ic < MB ? m - g.ic : MB;
        int64_t apanels = (g.mb + g.mr - 1) / g.mr, mblocks = (g.mb + MC - 1) / MC;
        if (!g.direct_a) pool_parallel_for(apanels, parallel ? 4 : apanels, pack_a, &g);
        else if (g.mb % g.mr) pack_a(&g, apanels - 1, apanels);
        /* When A is short, split the panels too, so that every thread has tiles. */
        g.ngroups = 1;
        while (mblocks * g.ngroups < 4 * threads && g.ngroups < bpanels) g.ngroups++;
        g.panels_per_group = (bpanels + g.ngroups - 1) / g.ngroups;
        g.ngroups = (bpanels + g.panels_per_group - 1) / g.panels_per_group;
        int64_t tasks = mblocks * g.ngroups;
        pool_parallel_for(tasks, parallel ? 1 : tasks, compute, &g);
      }
    }
  }
  alloc_aligned_free(g.bp, bbytes);
  alloc_aligned_free(g.ap, abytes);
  return true;
}

bool kgemm_f32(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
               const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  return kgemm(false, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

static bool kgemm_task(bool tb, int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b,
                       int64_t ldb, float beta, float *c, int64_t ldc) {
  return kgemm(true, false, tb, m, n, k, 1, a, lda, b, ldb, beta, c, ldc);
}

#else /* not x86-64: OpenBLAS does it all */

const char *gemm_kernel_name(void) { return "blas"; }

bool gemm_blas_avx512(void) { return false; }

bool kgemm_f32(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
              const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  (void)ta, (void)tb, (void)m, (void)n, (void)k, (void)alpha, (void)a, (void)lda, (void)b, (void)ldb, (void)beta;
  (void)c, (void)ldc;
  return false;
}

static bool kgemm_task(bool tb, int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b,
                       int64_t ldb, float beta, float *c, int64_t ldc) {
  (void)tb, (void)m, (void)n, (void)k, (void)a, (void)lda, (void)b, (void)ldb, (void)beta, (void)c, (void)ldc;
  return false;
}
#endif

void gemm_sgemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  if (!kgemm_f32(ta == CblasTrans, tb == CblasTrans, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))
    cblas_sgemm(CblasRowMajor, ta, tb, (int)m, (int)n, (int)k, alpha, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
}

void gemm_sgemm_task(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b, int64_t ldb,
                     float *c, int64_t ldc) {
  if (!kgemm_task(false, m, n, k, a, lda, b, ldb, 0, c, ldc))
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)n, (int)k, 1, a, (int)lda, b, (int)ldb, 0, c,
                (int)ldc);
}

void gemm_sgemm_task_bt(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b, int64_t ldb,
                        float beta, float *c, int64_t ldc) {
  if (!kgemm_task(true, m, n, k, a, lda, b, ldb, beta, c, ldc))
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)n, (int)k, 1, a, (int)lda, b, (int)ldb, beta, c,
                (int)ldc);
}
