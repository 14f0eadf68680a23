/* The fused attention kernel: out = softmax(scale * q @ k^T, masked) @ v over
 * the last two dims, for q (...,T,D), k (...,S,D), v (...,S,E) and an
 * optional mask that broadcasts to (...,T,S): bool (an entry equal to
 * attrs.flag is dropped, its score -inf) or of q's dtype (added to the
 * scores). No user calls it: the compiler's attention pass
 * (src/tracer/fuse_attention.c) puts it in place of the ops that spell it out.
 *
 * Flash attention on the CPU: a task is one batch entry's block of
 * ATTN_BR query rows; it walks the keys a tile of BC columns at a time,
 * keeping the tile's scores, each row's running max and sum (the online
 * softmax) and the (BR,E) output rows in the chunk's working memory, so
 * the (T,S) scores are never in memory and everything a tile touches stays
 * in L1/L2. A tile whose mask drops every entry (above a causal diagonal)
 * is skipped; one whose mask keeps every entry is not masked. Tasks run
 * over the thread pool. */
#include <math.h>
#include <string.h>

#include "eager/eager.h"
#include "eager/iter.h"
#include "eager/pool.h"
#include "eager/vmath.h"

enum { ATTN_BR = 64 };              /* query rows of a task (a multiple of 4) */
enum { ATTN_TASK_GRAIN = 1 << 20 }; /* multiply-adds a pool chunk should have at least */
enum { ATTN_TILE_VECS = 8 };        /* vectors across a key tile (a multiple of 4) */
enum { ATTN_DEC_T = 4 };            /* fewer query rows than this: the decode form (no packing) */
enum { ATTN_DEC_BLK = 16 };         /* key columns the decode form's mask test skips at once */
enum { ATTN_DEC_GRAIN = 1 << 14 };  /* k and v elements a decode chunk should read at least */
enum { ATTN_DEC_GROUP = 8 };        /* decode rows that walk the key blocks together */
enum { TILE_SKIP, TILE_PLAIN, TILE_MASK, TILE_ADD };

enum { J_Q, J_K, J_V, J_MASK, J_OUT, J_O, J_DO, J_N }; /* the tensors of a job, in bstride */

typedef struct attn_job {
  const void *q, *k, *v, *mask;
  const void *o, *dout;        /* the backward's: attention's result and its gradient */
  void *out;
  int64_t T, S, D, E, Dp, Ep;  /* Dp, Ep: D and E rounded up to whole vectors */
  int64_t qrs, krs, vrs;       /* row strides (the last dims are unit-stride) */
  int64_t mrs, mcs, ors, ocs;  /* the mask's row and column strides (0: broadcast), out's */
  int64_t o_rs, do_rs;         /* the backward's o and do row strides */
  int nbd;                     /* batch dims */
  int64_t nb;                  /* batch entries */
  int64_t bshape[MAXD];
  int64_t bstride[J_N][MAXD];  /* per batch dim, per J_* tensor */
  int64_t nrb;                 /* row blocks per batch entry */
  int64_t ntiles;              /* key tiles per batch entry */
  void *kp, *vp;               /* k and v packed for the tiles (attn_pack) */
  double scale;
  bool mask_bool, drop;        /* a bool mask, and the value that drops an entry */
  bool has_mask, f64;
  bool failed;                 /* a chunk could not get its working memory */
  int vb;                      /* the bytes of a vector in the loops that run (attn_vb) */
} attn_job;

/* Element offsets of batch entry bh in q, k, v, mask and out. */
static void attn_offsets(const attn_job *j, int64_t bh, int64_t off[J_N]) {
  for (int x = 0; x < J_N; x++) off[x] = 0;
  for (int d = j->nbd - 1; d >= 0; d--) {
    int64_t i = bh % j->bshape[d];
    bh /= j->bshape[d];
    for (int x = 0; x < J_N; x++) off[x] += i * j->bstride[x][d];
  }
}

/* Elements of one decode row's working memory (attn_dec_rows): q scaled,
 * the scores, the output, and a byte a key block. */
static int64_t attn_dec_row_elems(const attn_job *j) {
  return j->D + j->S + j->E + (j->S + ATTN_DEC_BLK - 1) / ATTN_DEC_BLK + 1;
}

/* How the mask treats the tile rows [r0, r0+nr) x cols [c0, c0+nc) of the
 * entry at mask offset mo: skipped when it drops every entry. */
static int attn_tile_mode(const attn_job *j, int64_t mo, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
  if (!j->has_mask) return TILE_PLAIN;
  int64_t dropped = 0;
  for (int64_t r = r0; r < r0 + nr; r++) {
    int64_t at = mo + r * j->mrs + c0 * j->mcs;
    if (j->mask_bool && j->mcs == 1) { /* the usual (T,S) bool mask: a loop that vectorizes */
      const uint8_t *mk = (const uint8_t *)j->mask + at, drop = j->drop;
      int64_t n = 0;
      for (int64_t c = 0; c < nc; c++) n += mk[c] == drop;
      dropped += n;
      continue;
    }
    for (int64_t c = 0; c < nc; c++, at += j->mcs)
      dropped += j->mask_bool ? ((const bool *)j->mask)[at] == j->drop
                 : j->f64     ? ((const double *)j->mask)[at] == -INFINITY
                              : ((const float *)j->mask)[at] == -INFINITY;
  }
  if (dropped == nr * nc) return TILE_SKIP;
  return !j->mask_bool ? TILE_ADD : dropped ? TILE_MASK : TILE_PLAIN;
}

/* Each type once per vector width: 64, 32 and 16 bytes for AVX-512, AVX2
 * and the rest where kiln picks the x86-64 level at run time, else the
 * one the compiler targets (16 bytes for NEON). */
#if defined(KILN_CPU_DISPATCH)
#define AT_ISA v4
#define AT_VB 64
#define AT_TARGET __attribute__((target("arch=x86-64-v4")))
#include "eager/attention_types.h"
#undef AT_ISA
#undef AT_VB
#undef AT_TARGET
#define AT_ISA v3
#define AT_VB 32
#define AT_TARGET __attribute__((target("arch=x86-64-v3")))
#include "eager/attention_types.h"
#undef AT_ISA
#undef AT_VB
#undef AT_TARGET
#define AT_ISA base
#define AT_VB 16
#define AT_TARGET
#include "eager/attention_types.h"
#undef AT_ISA
#undef AT_VB
#undef AT_TARGET
/* The vector bytes of the instantiation this CPU runs (an AVX2 machine's
 * when AVX-512 is turned off, as for the JIT's kernels). */
static int attn_vb(void) {
  return __builtin_cpu_supports("x86-64-v4") && !cpu_avx512_turned_off() ? 64
         : __builtin_cpu_supports("x86-64-v3")                          ? 32
                                                                         : 16;
}
#define ATTN_CALL(vb, name, sfx, ...)                                        \
  ((vb) == 64 ? name##_##sfx##_v4(__VA_ARGS__) : (vb) == 32 ? name##_##sfx##_v3(__VA_ARGS__) \
                                                          : name##_##sfx##_base(__VA_ARGS__))
#else
#define AT_ISA one
#if defined(__AVX512F__)
#define AT_VB 64
#elif defined(__AVX2__)
#define AT_VB 32
#else
#define AT_VB 16
#endif
#define AT_TARGET
#include "eager/attention_types.h"
static int attn_vb(void) { return AT_VB; }
#define ATTN_CALL(vb, name, sfx, ...) ((void)(vb), name##_##sfx##_one(__VA_ARGS__))
#undef AT_ISA
#undef AT_VB
#undef AT_TARGET
#endif

/* Elements of a chunk's working memory: q rows, the tile's scores, the
 * output rows, the running max and sum. */
static int64_t attn_ws_elems(const attn_job *j, int64_t lanes) {
  return ATTN_BR * j->D + ATTN_BR * ATTN_TILE_VECS * lanes + ATTN_BR * j->Ep + 2 * ATTN_BR;
}

/* A pool chunk of a kernel's tasks (the forward's, the backward's): its
 * working memory of ELEMS elements, then TASKS at the job's width and dtype. */
#define ATTN_CHUNK_FN(NAME, ELEMS, TASKS)                                   \
  static void NAME(void *c, int64_t b, int64_t e) {                         \
    attn_job *j = c;                                                        \
    size_t esz = j->f64 ? sizeof(double) : sizeof(float);                   \
    int64_t n = ELEMS(j, j->vb / (int64_t)esz);                             \
    void *ws = alloc_malloc((size_t)n * esz);                               \
    if (!ws) {                                                              \
      __atomic_store_n(&j->failed, true, __ATOMIC_RELAXED);                 \
      return;                                                               \
    }                                                                       \
    if (j->f64) ATTN_CALL(j->vb, TASKS, f64, j, b, e, ws);                  \
    else ATTN_CALL(j->vb, TASKS, f32, j, b, e, ws);                         \
    alloc_free(ws);                                                         \
  }
ATTN_CHUNK_FN(attn_chunk, attn_ws_elems, attn_tasks)

/* Elements of a decode chunk's working memory: per row of a group, q's
 * row, the scores, the output, and a byte a key block (attn_dec_rows). */
static int64_t attn_dec_ws_elems(const attn_job *j, int64_t lanes) {
  (void)lanes;
  return ATTN_DEC_GROUP * attn_dec_row_elems(j);
}

ATTN_CHUNK_FN(attn_dec_chunk, attn_dec_ws_elems, attn_dec_rows)

static void pack_chunk(void *c, int64_t b, int64_t e) {
  attn_job *j = c;
  if (j->f64) ATTN_CALL(j->vb, attn_pack, f64, j, b, e);
  else ATTN_CALL(j->vb, attn_pack, f32, j, b, e);
}

/* t itself when its last dim is unit-stride, else a contiguous copy in *own. */
static const kiln_tensor *unit_rows(const kiln_tensor *t, kiln_tensor **own) {
  int nd = t->ndim;
  if (t->shape[nd - 1] <= 1 || t->stride[nd - 1] == 1) return t;
  if ((*own = tensor_new(t->dtype, nd, t->shape))) pw_copy(*own, t);
  return *own;
}

/* The job's fields for q, k, v (unit-stride rows) and the optional mask:
 * sizes, strides, the batch dims (q's, which k and v share) and the tiles. */
static void attn_setup(attn_job *j, const kiln_tensor *q, const kiln_tensor *k, const kiln_tensor *v,
                       const kiln_tensor *mask, const op_attrs *a) {
  int nd = q->ndim;
  *j = (attn_job){.q = tensor_data(q), .k = tensor_data(k), .v = tensor_data(v), .T = q->shape[nd - 2],
                  .S = k->shape[nd - 2], .D = q->shape[nd - 1], .E = v->shape[nd - 1], .qrs = q->stride[nd - 2],
                  .krs = k->stride[nd - 2], .vrs = v->stride[nd - 2], .nbd = nd - 2, .scale = a->value,
                  .f64 = q->dtype == KILN_F64, .drop = a->flag, .nb = 1};
  j->vb = attn_vb();
  int64_t lanes = j->vb / (j->f64 ? 8 : 4);
  j->Dp = (j->D + lanes - 1) / lanes * lanes;
  j->Ep = (j->E + lanes - 1) / lanes * lanes;
  const kiln_tensor *ts[J_MASK + 1] = {q, k, v, mask};
  for (int d = 0; d < j->nbd; d++) {
    j->bshape[d] = q->shape[d];
    j->nb *= q->shape[d];
    for (int x = 0; x <= J_MASK; x++) {
      const kiln_tensor *t = ts[x];
      int td = t ? d - (nd - t->ndim) : -1; /* the mask lines up on the right */
      j->bstride[x][d] = td >= 0 && t->shape[td] > 1 ? t->stride[td] : 0;
    }
  }
  if (mask) {
    j->mask = tensor_data(mask);
    j->has_mask = true;
    j->mask_bool = mask->dtype == KILN_BOOL;
    int md = mask->ndim;
    j->mrs = md >= 2 && mask->shape[md - 2] > 1 ? mask->stride[md - 2] : 0;
    j->mcs = md >= 1 && mask->shape[md - 1] > 1 ? mask->stride[md - 1] : 0;
  }
  j->nrb = (j->T + ATTN_BR - 1) / ATTN_BR;
  j->ntiles = (j->S + ATTN_TILE_VECS * lanes - 1) / (ATTN_TILE_VECS * lanes);
}

/* The batch strides of t (of q's rank) in j->bstride[x]. */
static void attn_batch_strides(attn_job *j, int x, const kiln_tensor *t) {
  for (int d = 0; d < j->nbd; d++) j->bstride[x][d] = t->shape[d] > 1 ? t->stride[d] : 0;
}

int k_attention(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op;
  kiln_tensor *own[3] = {0};
  const kiln_tensor *q = unit_rows(in[0], &own[0]), *k = unit_rows(in[1], &own[1]), *v = unit_rows(in[2], &own[2]);
  const kiln_tensor *mask = n > 3 ? in[3] : NULL;
  int rc = -1, nd = out->ndim;
  size_t kbytes, vbytes, pack_bytes = 0;
  attn_job j = {0};
  if (!q || !k || !v) goto done;
  attn_setup(&j, q, k, v, mask, a);
  j.out = tensor_data(out);
  j.ors = out->stride[nd - 2];
  j.ocs = out->stride[nd - 1];
  attn_batch_strides(&j, J_OUT, out);
  int64_t lanes = j.vb / (j.f64 ? 8 : 4), nb = j.nb;
  /* k and v once in the tiles' layout: every row block of an entry reads them */
  size_t esz = j.f64 ? sizeof(double) : sizeof(float), per = (size_t)(j.ntiles * ATTN_TILE_VECS * lanes);
  kbytes = (size_t)nb * per * (size_t)j.D * esz;
  vbytes = (size_t)nb * per * (size_t)j.Ep * esz;
  if (nb * j.nrb == 0 || j.E == 0) {
    rc = 0;
    goto done;
  }
  if (j.T < ATTN_DEC_T) { /* a token of generation: a task a query row, k and v read in place */
    int64_t task = j.S * (j.D + j.E) + 1;
    pool_parallel_for(nb * j.T, task >= ATTN_DEC_GRAIN ? 1 : ATTN_DEC_GRAIN / task, attn_dec_chunk, &j);
    rc = j.failed ? -1 : 0;
    goto done;
  }
  /* one block for both, from the storage allocator: it keeps large blocks
   * for the next call instead of faulting in fresh pages every time */
  pack_bytes = (kbytes + vbytes + 63) / 64 * 64;
  if (!(j.kp = alloc_aligned(pack_bytes ? pack_bytes : 64))) goto done;
  j.vp = (char *)j.kp + kbytes;
  int64_t per_entry = (int64_t)per * (j.D + j.Ep); /* elements an entry's pack writes: small ones run inline */
  pool_parallel_for(nb, per_entry >= PARALLEL_GRAIN ? 1 : PARALLEL_GRAIN / (per_entry ? per_entry : 1), pack_chunk, &j);
  /* a task's multiply-adds: tasks of a small attention (a token of generation) run inline,
   * where waking a worker would cost more than the work */
  int64_t task_fma = (j.T < ATTN_BR ? j.T : ATTN_BR) * j.S * (j.D + j.E) + 1;
  pool_parallel_for(nb * j.nrb, task_fma >= ATTN_TASK_GRAIN ? 1 : ATTN_TASK_GRAIN / task_fma, attn_chunk, &j);
  rc = j.failed ? -1 : 0;
done:
  alloc_aligned_free(j.kp, pack_bytes ? pack_bytes : 64);
  for (int x = 0; x < 3; x++) kiln_release(own[x]);
  return rc;
}

/* Elements of a backward task's working memory (attn_bwd_tasks): k and v
 * packed, k's rows, dk and dv of the entry; a row block's q, do, dq, its
 * probabilities and their gradients for a tile, and three numbers a row. */
static int64_t attn_bwd_ws_elems(const attn_job *j, int64_t lanes) {
  int64_t Sp = j->ntiles * ATTN_TILE_VECS * lanes;
  return Sp * (j->D + j->E + 2 * j->Dp + j->Ep) + ATTN_BR * (2 * j->Dp + j->Ep) +
         2 * ATTN_BR * ATTN_TILE_VECS * lanes + 3 * ATTN_BR;
}

ATTN_CHUNK_FN(attn_bwd_chunk, attn_bwd_ws_elems, attn_bwd_tasks)

/* The backward is threaded over batch entries: one task walks all of an
 * entry's row blocks in order and sums its dk and dv in that order, so the
 * bits do not depend on how many threads share the entries. */
int k_attention_grad(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op;
  kiln_tensor *own[5] = {0};
  const kiln_tensor *t[5];
  for (int x = 0; x < 5; x++) t[x] = unit_rows(in[x], &own[x]);
  int rc = -1;
  attn_job j = {0};
  for (int x = 0; x < 5; x++)
    if (!t[x]) goto done;
  attn_setup(&j, t[0], t[1], t[2], n > 5 ? in[5] : NULL, a);
  int nd = t[0]->ndim;
  j.o = tensor_data(t[3]);
  j.dout = tensor_data(t[4]);
  j.o_rs = t[3]->stride[nd - 2];
  j.do_rs = t[4]->stride[nd - 2];
  attn_batch_strides(&j, J_O, t[3]);
  attn_batch_strides(&j, J_DO, t[4]);
  j.out = tensor_data(out);
  if (j.nb * j.T * j.S == 0) { /* no scores: dq, dk and dv are 0 */
    memset(j.out, 0, (size_t)shape_numel(out->ndim, out->shape) * (j.f64 ? sizeof(double) : sizeof(float)));
    rc = 0;
    goto done;
  }
  int64_t task_fma = j.T * j.S * (3 * j.D + 2 * j.E) + 1;
  pool_parallel_for(j.nb, task_fma >= ATTN_TASK_GRAIN ? 1 : ATTN_TASK_GRAIN / task_fma, attn_bwd_chunk, &j);
  rc = j.failed ? -1 : 0;
done:
  for (int x = 0; x < 5; x++) kiln_release(own[x]);
  return rc;
}
