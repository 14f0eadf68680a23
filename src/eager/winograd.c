/* winograd.c - 3x3 stride-1 f32 convolutions as Winograd F(2x2, 3x3)
 * (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", 2015),
 * which conv.c runs where they beat its im2col GEMM.
 *
 * Each 2x2 block of output (a tile) is computed from the 4x4 block of input
 * under it: with the weight of (o, c) transformed once into U = G g G^T and
 * the input block of c into V = B^T d B (both 4x4), the tile is
 * A^T (sum over c of U * V) A, products taken elementwise. For each of the
 * 16 elements xi of the 4x4 the sum over c is a GEMM, M[xi] (O, tiles) =
 * U[xi] (O, C) @ V[xi] (C, tiles): 16 multiplies where a direct tile takes
 * 36, the 2.25x fewer of the title, paid for with the transforms, which are
 * adds only, and with a larger rounding error (see docs/guide.md).
 *
 * The tiles are cut into blocks small enough that a block's V and M stay in
 * L2 from the input transform through the GEMMs to the output transform;
 * the blocks are split across the pool in contiguous runs, each with its own
 * V and M, and each GEMM runs on its thread. Every tile sums in one order
 * whatever the thread count, so results do not depend on threads. */
#include <string.h>

#include "eager/eager.h"
#include "eager/gemm.h"
#include "eager/pool.h"

enum {
  BLOCK_BYTES = 1 << 20, /* a block's V and M: half the L2 of a current core */
  MIN_TILES = 64,        /* narrower GEMMs reread U from L3 too often for their work */
  MAX_TILES = 512,
  RUN_FLOATS = 8 * (MAX_TILES + 16) /* input_run's rows of a run, in whole vectors */
};

static int64_t tiles_of(const wino_geom *q) { return q->n * ((q->ho + 1) / 2) * ((q->wo + 1) / 2); }

/* Tiles per block: as many as fit BLOCK_BYTES, a multiple of 16, no more
 * than each thread's share of them, but at least MIN_TILES where the share
 * allows (wide layers' V and M then spill to L3, which costs less than
 * rereading U for narrow GEMMs). */
static int64_t block_tiles(const wino_geom *q) {
  int64_t co = q->c + q->o;
  int64_t t = co > 0 ? BLOCK_BYTES / (16 * (int64_t)sizeof(float) * co) : MAX_TILES;
  int64_t share = (tiles_of(q) + pool_num_threads() - 1) / pool_num_threads();
  if (t > share) t = share;
  if (t < MIN_TILES) t = MIN_TILES < share ? MIN_TILES : share;
  t = (t + 15) / 16 * 16;
  return t < 16 ? 16 : t > MAX_TILES ? MAX_TILES : t;
}

/* The 16 matrices of U, V and M lie this many floats apart: a line more
 * than their size, so that the 16 streams a transform writes do not land
 * in the same L1 sets (their sizes are often multiples of 4 KiB); that
 * line also takes what input_run writes past V[xi]'s end. */
static int64_t stride16(int64_t floats) { return (floats + 15) / 16 * 16 + 16; }
static size_t u_bytes(const wino_geom *q) { return (size_t)(16 * stride16(q->o * q->c)) * sizeof(float); }
static size_t slot_bytes(const wino_geom *q, int64_t tb) {
  return (size_t)(16 * (stride16(q->c * tb) + stride16(q->o * tb))) * sizeof(float);
}

/* Blocks of V and M that run at once: one a thread, no more than there are blocks. */
static int64_t slots_for(const wino_geom *q, int64_t tb) {
  int64_t blocks = (tiles_of(q) + tb - 1) / tb, s = pool_num_threads();
  return s < blocks ? s : blocks < 1 ? 1 : blocks;
}

size_t wino_scratch_bytes(const wino_geom *q) {
  int64_t tb = block_tiles(q);
  return u_bytes(q) + (size_t)slots_for(q, tb) * slot_bytes(q, tb);
}

size_t wino_prepared_scratch_bytes(const wino_geom *q) {
  int64_t tb = block_tiles(q);
  return (size_t)slots_for(q, tb) * slot_bytes(q, tb);
}

size_t wino_weight_bytes(const wino_geom *q) { return u_bytes(q); }

typedef struct wino_job {
  const wino_geom *q;
  const float *x, *w, *u; /* u: the transformed weight the GEMMs read */
  float *y, *uw;          /* uw: where weight_chunk writes it */
  char *slots;
  int64_t tb, blocks, nslots, tw, th;
  int64_t ldu, ldv, ldm; /* floats between U[xi] and U[xi + 1], likewise V and M */
} wino_job;

/* ---- the three transforms ---- */

/* U[xi][o][c] = (G g G^T)[xi] for output channels [o0, o1), g the 3x3 of (o, c). */
static void weight_chunk(void *ctx, int64_t o0, int64_t o1) {
  const wino_job *j = ctx;
  const wino_geom *q = j->q;
  int64_t ld = j->ldu;
  for (int64_t o = o0; o < o1; o++)
    for (int64_t c = 0; c < q->c; c++) {
      float g[3][3], t[4][3];
      for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++)
          g[a][b] = q->flip ? j->w[(c * q->o + o) * 9 + (2 - a) * 3 + (2 - b)] : j->w[(o * q->c + c) * 9 + a * 3 + b];
      for (int b = 0; b < 3; b++) {
        t[0][b] = g[0][b];
        t[1][b] = 0.5f * (g[0][b] + g[1][b] + g[2][b]);
        t[2][b] = 0.5f * (g[0][b] - g[1][b] + g[2][b]);
        t[3][b] = g[2][b];
      }
      float *u = j->uw + o * q->c + c;
      for (int a = 0; a < 4; a++) {
        u[(a * 4 + 0) * ld] = t[a][0];
        u[(a * 4 + 1) * ld] = 0.5f * (t[a][0] + t[a][1] + t[a][2]);
        u[(a * 4 + 2) * ld] = 0.5f * (t[a][0] - t[a][1] + t[a][2]);
        u[(a * 4 + 3) * ld] = t[a][2];
      }
    }
}

/* Row a of (B^T d) B for the tiles [0, nt) rounded up to whole vectors:
 * tile k's columns are even k, odd k, even k+1, odd k+1. A function of its
 * own, so that restrict tells the compiler nothing aliases. */
static inline void input_columns(const float *restrict ev, const float *restrict od, float *restrict v0,
                                 float *restrict v1, float *restrict v2, float *restrict v3, int64_t nt) {
  for (int64_t k0 = 0; k0 < nt; k0 += 16)
    for (int64_t k = k0; k < k0 + 16; k++) {
      v0[k] = ev[k] - ev[k + 1];
      v1[k] = od[k] + ev[k + 1];
      v2[k] = ev[k + 1] - od[k];
      v3[k] = od[k] - od[k + 1];
    }
}

/* V[xi][k] = (B^T d B)[xi] for the tiles k of a run of nt in one row of
 * tiles of one input plane, whose rows start at iy0 and columns at ix0
 * (maybe in the padding); V[xi] are ld apart. r: RUN_FLOATS. The columns
 * are taken apart into even and odd ones, so that every loop over the
 * tiles reads and writes with stride 1; the last loop runs in whole
 * vectors of 16 tiles, writing up to 15 floats past the run: what the
 * caller writes next (the next run, the next channel's row), or the spare
 * line after V[xi] (stride16). */
static KILN_HOT void input_run(const wino_geom *q, const float *plane, int64_t iy0, int64_t ix0, int64_t nt,
                               float *v, int64_t ld, float *r) {
  int64_t n1 = (nt + 15) / 16 * 16 + 16; /* floats per array: whole vectors, and the column after */
  /* row a of the 4 under the tiles: even columns at r[2a], odd at r[2a+1], 0 in the padding */
  for (int a = 0; a < 4; a++) {
    float *restrict ev = r + 2 * a * n1, *restrict od = ev + n1;
    int64_t iy = iy0 + a, n = nt + 1;
    if (iy < 0 || iy >= q->h) {
      memset(ev, 0, sizeof(float) * (size_t)(2 * n1));
      continue;
    }
    /* pairs [lo, hi) lie inside the row; those before and after touch the padding */
    const float *src = plane + iy * q->w;
    int64_t lo = ix0 < 0 ? (-ix0 + 1) / 2 : 0, hi = (q->w - ix0) / 2;
    if (lo > n) lo = n; /* a run wholly in a wide left padding */
    if (hi > n) hi = n;
    if (hi < lo) hi = lo;
    for (int64_t e = 0; e < lo; e++) {
      int64_t i = ix0 + 2 * e;
      ev[e] = i >= 0 && i < q->w ? src[i] : 0;
      od[e] = i + 1 >= 0 && i + 1 < q->w ? src[i + 1] : 0;
    }
    for (int64_t e = lo; e < hi; e++) ev[e] = src[ix0 + 2 * e], od[e] = src[ix0 + 2 * e + 1];
    for (int64_t e = hi; e < n; e++) {
      int64_t i = ix0 + 2 * e;
      ev[e] = i >= 0 && i < q->w ? src[i] : 0;
      od[e] = i + 1 >= 0 && i + 1 < q->w ? src[i + 1] : 0;
    }
    for (int64_t e = n; e < n1; e++) ev[e] = od[e] = 0;
  }
  /* B^T d: the rows combined, in place (each column on its own) */
  for (int64_t e = 0; e < 2 * n1; e++) {
    float d0 = r[e], d1 = r[2 * n1 + e], d2 = r[4 * n1 + e], d3 = r[6 * n1 + e];
    r[e] = d0 - d2;
    r[2 * n1 + e] = d1 + d2;
    r[4 * n1 + e] = d2 - d1;
    r[6 * n1 + e] = d1 - d3;
  }
  /* (B^T d) B */
  for (int a = 0; a < 4; a++) {
    const float *ev = r + 2 * a * n1, *od = ev + n1;
    float *v0 = v + (4 * a) * ld, *v1 = v0 + ld, *v2 = v1 + ld, *v3 = v2 + ld;
    input_columns(ev, od, v0, v1, v2, v3, nt);
  }
}

/* A^T m A for the tiles [0, nt): m[xi][k] at s + xi * ld + k; the even and
 * odd columns of the tiles' two output rows into e0, o0, e1, o1. */
static inline void output_columns(const float *restrict s, int64_t ld, float *restrict e0, float *restrict o0,
                                  float *restrict e1, float *restrict o1, int64_t nt) {
  for (int64_t k = 0; k < nt; k++) {
    float t0[4], t1[4];
    for (int b = 0; b < 4; b++) {
      float s0 = s[b * ld + k], s1 = s[(4 + b) * ld + k], s2 = s[(8 + b) * ld + k], s3 = s[(12 + b) * ld + k];
      t0[b] = s0 + s1 + s2;
      t1[b] = s1 - s2 - s3;
    }
    e0[k] = t0[0] + t0[1] + t0[2];
    o0[k] = t0[1] - t0[2] - t0[3];
    e1[k] = t1[0] + t1[1] + t1[2];
    o1[k] = t1[1] - t1[2] - t1[3];
  }
}

/* The output of a run of nt tiles in one row of tiles, from M[xi][o][k]
 * (M[xi] ld apart, rows tb): A^T m A into y at row oy, column ox of every
 * output plane, clipped at the edge. r: 4 * nt floats. */
static KILN_HOT void output_run(const wino_geom *q, const float *m, int64_t oy, int64_t ox, int64_t nt, float *planes,
                                int64_t ld, int64_t tb, float *r) {
  int64_t cols = 2 * nt < q->wo - ox ? 2 * nt : q->wo - ox, rows = q->ho - oy < 2 ? q->ho - oy : 2;
  for (int64_t o = 0; o < q->o; o++) {
    float *e0 = r, *o0 = r + nt, *e1 = r + 2 * nt, *o1 = r + 3 * nt;
    output_columns(m + o * tb, ld, e0, o0, e1, o1, nt);
    float *yp = planes + (o * q->ho + oy) * q->wo + ox;
    for (int row = 0; row < rows; row++, yp += q->wo) {
      const float *ev = row ? e1 : e0, *od = row ? o1 : o0;
      for (int64_t k = 0; k < cols / 2; k++) yp[2 * k] = ev[k], yp[2 * k + 1] = od[k];
      if (cols % 2) yp[cols - 1] = ev[cols / 2];
    }
  }
}

/* BODY for each run of tiles in [t0, t1) that lies in one row of tiles
 * (tw a row, th rows an image), of at most MAX_TILES: image ni, row ty, nt
 * tiles from column tx0, the first of them off from t0. */
#define FOR_ROWS(tw, th, t0, t1, BODY)                                        \
  for (int64_t t_ = (t0); t_ < (t1);) {                                       \
    int64_t ni = t_ / ((th) * (tw)), ty = t_ / (tw) % (th), tx0 = t_ % (tw);  \
    int64_t nt = (tw) - tx0 < (t1) - t_ ? (tw) - tx0 : (t1) - t_, off = t_ - (t0); \
    if (nt > MAX_TILES) nt = MAX_TILES;                                       \
    BODY;                                                                     \
    t_ += nt;                                                                 \
  }

/* Blocks of slots [s0, s1): slot s runs its share of the blocks in order on its own V and M. */
static void block_chunk(void *ctx, int64_t s0, int64_t s1) {
  const wino_job *j = ctx;
  const wino_geom *q = j->q;
  int64_t tiles = tiles_of(q), tb = j->tb;
  float r[RUN_FLOATS];
  for (int64_t s = s0; s < s1; s++) {
    float *v = (float *)(j->slots + (size_t)s * slot_bytes(q, tb)), *m = v + 16 * j->ldv;
    int64_t b0 = s * j->blocks / j->nslots, b1 = (s + 1) * j->blocks / j->nslots;
    for (int64_t b = b0; b < b1; b++) {
      int64_t t0 = b * tb, t1 = t0 + tb < tiles ? t0 + tb : tiles;
      /* channel by channel, so that what a run writes past its end is written again after */
      for (int64_t c = 0; c < q->c; c++)
        FOR_ROWS(j->tw, j->th, t0, t1,
                 input_run(q, j->x + (ni * q->c + c) * q->h * q->w, 2 * ty - q->ph, 2 * tx0 - q->pw, nt,
                           v + c * tb + off, j->ldv, r));
      for (int xi = 0; xi < 16; xi++)
        gemm_sgemm_task(q->o, t1 - t0, q->c, j->u + xi * j->ldu, q->c, v + xi * j->ldv, tb, m + xi * j->ldm, tb);
      FOR_ROWS(j->tw, j->th, t0, t1,
               output_run(q, m + off, 2 * ty, 2 * tx0, nt, j->y + ni * q->o * q->ho * q->wo, j->ldm, tb, r));
    }
  }
}

/* wino_conv_f32, or with u (wino_weight_prepare's) the transform of w done already. */
static int conv_with(const wino_geom *q, const float *x, const float *w, const float *u, float *y, void *scratch,
                     size_t bytes) {
  int64_t tb = block_tiles(q), tiles = tiles_of(q);
  if (tiles == 0 || q->o == 0) return 0;
  if (q->c == 0) {
    memset(y, 0, sizeof(float) * (size_t)(q->n * q->o * q->ho * q->wo));
    return 0;
  }
  wino_job j = {.q = q, .x = x, .w = w, .y = y, .tb = tb, .blocks = (tiles + tb - 1) / tb,
                .tw = (q->wo + 1) / 2, .th = (q->ho + 1) / 2, .ldu = stride16(q->o * q->c),
                .ldv = stride16(q->c * tb), .ldm = stride16(q->o * tb)};
  void *own = NULL;
  size_t ub = u ? 0 : u_bytes(q); /* the working memory's part for U */
  /* as many slots as the working memory holds, up to one a thread */
  int64_t fit = scratch && bytes > ub ? (int64_t)((bytes - ub) / slot_bytes(q, tb)) : 0;
  j.nslots = slots_for(q, tb);
  if (fit < 1) {
    bytes = ub + (size_t)j.nslots * slot_bytes(q, tb);
    if (!(scratch = own = alloc_aligned(bytes))) return -1;
  } else if (fit < j.nslots) {
    j.nslots = fit;
  }
  j.u = u ? u : (const float *)scratch;
  j.uw = scratch;
  j.slots = (char *)scratch + ub;
  if (!u) pool_parallel_for(q->o, 1 + 4096 / q->c, weight_chunk, &j); /* 4K weights or more a chunk */
  pool_parallel_for(j.nslots, 1, block_chunk, &j);
  if (own) alloc_aligned_free(own, bytes);
  return 0;
}

int wino_conv_f32(const wino_geom *q, const float *x, const float *w, float *y, void *scratch, size_t bytes) {
  return conv_with(q, x, w, NULL, y, scratch, bytes);
}

void wino_weight_prepare(const wino_geom *q, const float *w, float *u) {
  if (q->o == 0 || q->c == 0) return;
  wino_job j = {.q = q, .w = w, .uw = u, .ldu = stride16(q->o * q->c)};
  pool_parallel_for(q->o, 1 + 4096 / q->c, weight_chunk, &j);
}

int wino_conv_prepared_f32(const wino_geom *q, const float *x, const float *u, float *y, void *scratch, size_t bytes) {
  return conv_with(q, x, NULL, u, y, scratch, bytes);
}

/* ---- the weight gradient ----
 *
 * With y = A^T (U * V) A per tile and U = G g G^T, the gradient of U is the
 * sum over tiles of (A dy A^T) * V, dy the tile's 2x2 of the output's
 * gradient (0 past the output's edge), and that of g is G^T dU G. For each
 * of the 16 elements xi the sum over tiles is a GEMM: dU[xi] (O, C) =
 * M[xi] (O, tiles) @ V[xi]^T, M[xi] = (A dy A^T)[xi]. The tiles run in
 * chunks small enough that a chunk's V and M stay in cache from their
 * transforms to the GEMMs (but of 256 tiles at least, so that reading and
 * writing dU costs little beside a GEMM's work); each chunk's 16 GEMMs are
 * spread over the pool (one a task, on kiln's kernel) and add to the sums
 * of the chunks before, in chunk order: the order of every sum follows the
 * geometry, never the thread count nor the working memory given. */

enum { GW_CHUNK_BYTES = 2 << 20, GW_MIN_TILES = 256 };

typedef struct wgw_geom {
  int64_t tw, th, per_image, tiles; /* tiles a row, rows, an image, in all */
  int64_t tb;                       /* tiles a chunk */
  int64_t ldr;                      /* floats between the rows of V[xi] and M[xi] (a chunk, and a line for input_run's spill) */
  int64_t ldv, ldm, ldu;            /* floats between V[xi], M[xi], dU[xi] */
} wgw_geom;

static wgw_geom wgw_of(const wino_geom *q) {
  wgw_geom g = {.tw = (q->wo + 1) / 2, .th = (q->ho + 1) / 2};
  g.per_image = g.tw * g.th;
  g.tiles = q->n * g.per_image;
  int64_t co = q->c + q->o;
  g.tb = co > 0 ? GW_CHUNK_BYTES / (16 * (int64_t)sizeof(float) * co) : GW_MIN_TILES;
  if (g.tb < GW_MIN_TILES) g.tb = GW_MIN_TILES;
  if (g.tb > g.tiles) g.tb = g.tiles;
  g.tb = (g.tb + 15) / 16 * 16;
  g.ldr = g.tb + 16;
  g.ldv = stride16(q->c * g.ldr);
  g.ldm = stride16(q->o * g.ldr);
  g.ldu = stride16(q->c * q->o);
  return g;
}

/* V, M and dU. */
static size_t wgw_bytes(const wgw_geom *g) { return (size_t)(16 * (g->ldv + g->ldm + g->ldu)) * sizeof(float); }

size_t wino_grad_weight_scratch_bytes(const wino_geom *q) {
  wgw_geom g = wgw_of(q);
  return wgw_bytes(&g);
}

typedef struct wgw_job {
  const wino_geom *q;
  const wgw_geom *g;
  const float *x, *gy;
  float *gw, *v, *m, *du;
  int64_t t0, t1; /* the chunk's tiles */
} wgw_job;

/* V[xi][c] for channels [c0, c1), the chunk's runs in order (a run writes up
 * to 15 floats past its end, which the next run writes again; the last
 * one's land in the row's spare line). */
static void wgw_input_chunk(void *ctx, int64_t c0, int64_t c1) {
  const wgw_job *j = ctx;
  const wino_geom *q = j->q;
  float r[RUN_FLOATS];
  for (int64_t c = c0; c < c1; c++)
    FOR_ROWS(j->g->tw, j->g->th, j->t0, j->t1, input_run(q, j->x + (ni * q->c + c) * q->h * q->w, 2 * ty - q->ph, 2 * tx0 - q->pw, nt,
                          j->v + c * j->g->ldr + off, j->g->ldv, r));
}

/* M[xi][o] = (A dy A^T)[xi] of a run of nt tiles of one plane of dy, whose
 * rows start at oy and columns at ox: the even and odd columns of its two
 * rows taken apart first, so that the loop over the tiles reads and writes
 * with stride 1. r: 4 * MAX_TILES floats. */
static KILN_HOT void grad_run(const wino_geom *q, const float *plane, int64_t oy, int64_t ox, int64_t nt, float *m,
                              int64_t ld, float *r) {
  float *restrict e0 = r, *restrict o0 = r + MAX_TILES, *restrict e1 = r + 2 * MAX_TILES, *restrict o1 = r + 3 * MAX_TILES;
  int64_t cols = q->wo - ox; /* the run's columns inside the output */
  for (int row = 0; row < 2; row++) {
    float *ev = row ? e1 : e0, *od = row ? o1 : o0;
    if (oy + row >= q->ho) {
      memset(ev, 0, sizeof(float) * (size_t)nt), memset(od, 0, sizeof(float) * (size_t)nt);
      continue;
    }
    const float *src = plane + (oy + row) * q->wo + ox;
    for (int64_t k = 0; k < nt; k++) {
      ev[k] = 2 * k < cols ? src[2 * k] : 0;
      od[k] = 2 * k + 1 < cols ? src[2 * k + 1] : 0;
    }
  }
  for (int64_t k = 0; k < nt; k++) {
    /* A d down the rows: d0, d0 + d1, d0 - d1, -d1; then the same along the columns */
    float t[4][2] = {{e0[k], o0[k]}, {e0[k] + e1[k], o0[k] + o1[k]}, {e0[k] - e1[k], o0[k] - o1[k]}, {-e1[k], -o1[k]}};
    for (int a = 0; a < 4; a++) {
      m[(a * 4 + 0) * ld + k] = t[a][0];
      m[(a * 4 + 1) * ld + k] = t[a][0] + t[a][1];
      m[(a * 4 + 2) * ld + k] = t[a][0] - t[a][1];
      m[(a * 4 + 3) * ld + k] = -t[a][1];
    }
  }
}

/* M[xi][o] for output channels [o0, o1), the chunk's runs. */
static void wgw_grad_chunk(void *ctx, int64_t o0, int64_t o1) {
  const wgw_job *j = ctx;
  const wino_geom *q = j->q;
  float r[4 * MAX_TILES];
  for (int64_t o = o0; o < o1; o++)
    FOR_ROWS(j->g->tw, j->g->th, j->t0, j->t1, grad_run(q, j->gy + (ni * q->o + o) * q->ho * q->wo, 2 * ty, 2 * tx0, nt,
                         j->m + o * j->g->ldr + off, j->g->ldm, r));
}

/* dU[xi] (O, C) for xi in [x0, x1): M[xi] @ V[xi]^T, one GEMM each, written
 * by the first chunk and added to by the later ones. */
static void wgw_gemm_chunk(void *ctx, int64_t x0, int64_t x1) {
  const wgw_job *j = ctx;
  const wino_geom *q = j->q;
  const wgw_geom *g = j->g;
  for (int64_t xi = x0; xi < x1; xi++)
    gemm_sgemm_task_bt(q->o, q->c, j->t1 - j->t0, j->m + xi * g->ldm, g->ldr, j->v + xi * g->ldv, g->ldr,
                       j->t0 == 0 ? 0 : 1, j->du + xi * g->ldu, q->c);
}

/* gw (O, C, 3, 3) = G^T dU G for output channels [o0, o1). */
static void wgw_weight_chunk(void *ctx, int64_t o0, int64_t o1) {
  const wgw_job *j = ctx;
  const wino_geom *q = j->q;
  const wgw_geom *g = j->g;
  for (int64_t o = o0; o < o1; o++)
    for (int64_t c = 0; c < q->c; c++) {
      float s[4][4], t[4][3];
      for (int xi = 0; xi < 16; xi++) s[xi / 4][xi % 4] = j->du[xi * g->ldu + o * q->c + c];
      /* dU G: columns s0 + (s1 + s2)/2, (s1 - s2)/2, (s1 + s2)/2 + s3; then G^T the same down the rows */
      for (int a = 0; a < 4; a++) {
        float h = 0.5f * (s[a][1] + s[a][2]);
        t[a][0] = s[a][0] + h;
        t[a][1] = 0.5f * (s[a][1] - s[a][2]);
        t[a][2] = h + s[a][3];
      }
      float *w = j->gw + (o * q->c + c) * 9;
      for (int b = 0; b < 3; b++) {
        float h = 0.5f * (t[1][b] + t[2][b]);
        w[0 * 3 + b] = t[0][b] + h;
        w[1 * 3 + b] = 0.5f * (t[1][b] - t[2][b]);
        w[2 * 3 + b] = h + t[3][b];
      }
    }
}

int wino_grad_weight_f32(const wino_geom *q, const float *x, const float *gy, float *gw, void *scratch, size_t bytes) {
  int64_t nw = q->o * q->c * 9;
  if (nw == 0) return 0;
  wgw_geom g = wgw_of(q);
  if (g.tiles == 0) {
    memset(gw, 0, sizeof(float) * (size_t)nw);
    return 0;
  }
  size_t need = wgw_bytes(&g);
  void *own = NULL;
  if (!scratch || bytes < need) {
    if (!(scratch = own = alloc_aligned(need))) return -1;
  }
  wgw_job j = {.q = q, .g = &g, .x = x, .gy = gy, .gw = gw, .v = scratch};
  j.m = j.v + 16 * g.ldv, j.du = j.m + 16 * g.ldm;
  for (j.t0 = 0; j.t0 < g.tiles; j.t0 += g.tb) {
    j.t1 = j.t0 + g.tb < g.tiles ? j.t0 + g.tb : g.tiles;
    int64_t per = (j.t1 - j.t0) * 16; /* floats a channel writes */
    pool_parallel_for(q->c, 1 + 4096 / per, wgw_input_chunk, &j);
    pool_parallel_for(q->o, 1 + 4096 / per, wgw_grad_chunk, &j);
    pool_parallel_for(16, 1, wgw_gemm_chunk, &j);
  }
  pool_parallel_for(q->o, 1 + 4096 / (q->c * 16 + 1), wgw_weight_chunk, &j);
  if (own) alloc_aligned_free(own, need);
  return 0;
}
