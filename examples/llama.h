/* llama.h: a Llama-2 decoder written with kiln's ops, that reads and writes
 * llama2.c's checkpoint format and reads its tokenizer, trains a step, and
 * generates token by token with a KV cache that one compiled variant serves
 * at every position. A header of static functions, shared by the example
 * (examples/llama.c), the benchmark (bench/llama.c) and the test
 * (tests/test_llama.c).
 *
 * The architecture (batch 1; tokens (T,) i64 at positions pos0 .. pos0+T-1):
 *
 *   x = tok_emb[tokens]                                     (T,D)
 *   per layer l:
 *     h = rmsnorm(x, rms_att)          rmsnorm(x, w) = x * rsqrt(mean(x*x, -1) + 1e-5) * w
 *     q = h @ wq^T (T,D), k = h @ wk^T, v = h @ wv^T (T,KV)   weights (out,in), KV = D*n_kv_heads/n_heads
 *     q, k rotated in pairs (RoPE): per head, elements (2j, 2j+1) at position p
 *       turn by p / 10000^(2j/hs), hs = D/n_heads
 *     with a cache: k, v written into rows pos0.. of the layer's (seq_len,KV)
 *       caches; keys and values are rows 0 .. pos0+T-1 of them (in
 *       llama_step_body, with the position a tensor: every row, those
 *       after it masked out)
 *     att = softmax((q @ keys^T) / sqrt(hs), causal)          head i reads kv head i / (n_heads/n_kv_heads)
 *     x = x + (att @ values) @ wo^T
 *     h = rmsnorm(x, rms_ffn)
 *     x = x + (silu(h @ w1^T) * (h @ w3^T)) @ w2^T            silu(a) = a * sigmoid(a)
 *   logits = rmsnorm(x, rms_final) @ wcls^T                   (T,V); wcls is tok_emb when tied
 *
 * The checkpoint (llama2.c's run.c format, little endian): seven int32
 * (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
 * vocab_size negative when the classifier is not tok_emb), then float32
 * arrays: tok_emb (V,D), rms_att (L,D), wq (L,D,D), wk (L,KV,D), wv (L,KV,D),
 * wo (L,D,D), rms_ffn (L,D), w1 (L,H,D), w2 (L,D,H), w3 (L,H,D), rms_final
 * (D), seq_len*hs unused floats (old RoPE tables), then wcls (V,D) if untied.
 *
 * The tokenizer (tokenizer.bin): int32 max_token_length, then per token a
 * float32 score, an int32 length and that many bytes. Token 1 is BOS.
 */
#ifndef KILN_EXAMPLES_LLAMA_H
#define KILN_EXAMPLES_LLAMA_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

typedef struct llama_config {
  int dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
  bool untied;      /* a classifier of its own, not tok_emb */
  kiln_dtype dtype; /* KILN_F32 (the file's), or KILN_F64 for gradient checks */
} llama_config;

/* stories15M's shape (llama2.c's smallest trained model) */
#define LLAMA_STORIES15M                                                                                    \
  ((llama_config){.dim = 288, .hidden_dim = 768, .n_layers = 6, .n_heads = 6, .n_kv_heads = 6,            \
                  .vocab_size = 32000, .seq_len = 256})
#define LLAMA_EPS 1e-5
#define LLAMA_BOS 1

/* per-layer parameters, in the file's order */
enum { LL_RMS_ATT, LL_WQ, LL_WK, LL_WV, LL_WO, LL_RMS_FFN, LL_W1, LL_W2, LL_W3, LL_PER_LAYER };

typedef struct llama {
  llama_config cfg;
  kiln_tensor *tok_emb, *rms_final, *wcls; /* wcls == tok_emb when tied (one reference) */
  kiln_tensor **layer;                     /* n_layers * LL_PER_LAYER */
  kiln_tensor **kc, **vc;                  /* per layer (seq_len,KV) key and value caches */
  kiln_tensor *cos, *sin;                  /* (seq_len, hs/2) RoPE turns */
  kiln_tensor *mask;                       /* (seq_len,seq_len) bool: col <= row */
  int64_t pos;                             /* where the next decoded token goes */
} llama;

static inline kiln_tensor *llama_w(const llama *m, int l, int which) { return m->layer[l * LL_PER_LAYER + which]; }
static inline int llama_kv_dim(const llama_config *c) { return c->dim * c->n_kv_heads / c->n_heads; }

/* Shape of a layer parameter. */
static inline void llama_layer_shape(const llama_config *c, int which, int *nd, int64_t *s) {
  int64_t D = c->dim, H = c->hidden_dim, KV = llama_kv_dim(c);
  *nd = 2;
  switch (which) {
  case LL_RMS_ATT:
  case LL_RMS_FFN: *nd = 1, s[0] = D; break;
  case LL_WQ:
  case LL_WO: s[0] = D, s[1] = D; break;
  case LL_WK:
  case LL_WV: s[0] = KV, s[1] = D; break;
  case LL_W1:
  case LL_W3: s[0] = H, s[1] = D; break;
  default: s[0] = D, s[1] = H; break; /* w2 */
  }
}

/* Every parameter, in the file's order (layer params grouped by kind), wcls last when untied. */
static inline int llama_params(const llama *m, kiln_tensor **out) {
  int n = 0;
  out[n++] = m->tok_emb;
  for (int w = 0; w < LL_PER_LAYER; w++)
    for (int l = 0; l < m->cfg.n_layers; l++) out[n++] = llama_w(m, l, w);
  out[n++] = m->rms_final;
  if (m->cfg.untied) out[n++] = m->wcls;
  return n;
}
static inline int llama_n_params(const llama_config *c) { return 2 + LL_PER_LAYER * c->n_layers + (c->untied ? 1 : 0); }

static inline void llama_free(llama *m) {
  if (m->layer)
    for (int i = 0; i < m->cfg.n_layers * LL_PER_LAYER; i++) kiln_release(m->layer[i]);
  for (int l = 0; l < m->cfg.n_layers; l++) {
    if (m->kc) kiln_release(m->kc[l]);
    if (m->vc) kiln_release(m->vc[l]);
  }
  if (m->wcls != m->tok_emb) kiln_release(m->wcls);
  kiln_release(m->tok_emb);
  kiln_release(m->rms_final);
  kiln_release(m->cos);
  kiln_release(m->sin);
  kiln_release(m->mask);
  free(m->layer);
  free(m->kc);
  free(m->vc);
  memset(m, 0, sizeof *m);
}

/* The model's tensors with their shapes, from `values` (the parameters in
 * llama_params' order, float32, or NULL: N(0, 0.02^2) from seed, norm
 * weights 1), plus zero caches and the RoPE tables. 0, or -1. */
static inline int llama_make(llama *m, const llama_config *cfg, const float *const *values, uint64_t seed) {
  memset(m, 0, sizeof *m);
  if (cfg->dim < 2 || cfg->n_heads < 1 || cfg->n_kv_heads < 1 || cfg->dim % cfg->n_heads || cfg->n_heads % cfg->n_kv_heads ||
      (cfg->dim / cfg->n_heads) % 2 || cfg->hidden_dim < 1 || cfg->n_layers < 1 || cfg->vocab_size < 1 || cfg->seq_len < 1 ||
      (cfg->dtype != KILN_F32 && cfg->dtype != KILN_F64)) {
    fprintf(stderr, "llama: bad config (dim %d, n_heads %d, n_kv_heads %d: heads must divide dim and kv heads the heads, "
            "head size even, sizes >= 1)\n", cfg->dim, cfg->n_heads, cfg->n_kv_heads);
    return -1;
  }
  m->cfg = *cfg;
  int L = cfg->n_layers, bad = 0, k = 0;
  kiln_dtype dt = cfg->dtype;
  m->layer = calloc((size_t)L * LL_PER_LAYER, sizeof *m->layer);
  m->kc = calloc((size_t)L, sizeof *m->kc);
  m->vc = calloc((size_t)L, sizeof *m->vc);
  if (!m->layer || !m->kc || !m->vc) return llama_free(m), -1;
  kiln_scope_begin();
  /* one tensor: from values[k], or random (a matrix) or ones (a norm weight) */
#define LLAMA_NEW(nd, shape, norm)                                                                              \
  (values ? kiln_cast(kiln_tensor_from(KILN_F32, nd, shape, values[k++]), dt)                                  \
   : (norm) ? (k++, kiln_ones(dt, nd, shape))                                                                   \
            : kiln_mul(kiln_randn(dt, nd, shape, seed + (uint64_t)k++), kiln_scalar(dt, 0.02)))
  int64_t s[2] = {cfg->vocab_size, cfg->dim};
  m->tok_emb = kiln_keep(LLAMA_NEW(2, s, false));
  for (int w = 0; w < LL_PER_LAYER; w++)
    for (int l = 0; l < L; l++) {
      int nd;
      llama_layer_shape(cfg, w, &nd, s);
      m->layer[l * LL_PER_LAYER + w] = kiln_keep(LLAMA_NEW(nd, s, w == LL_RMS_ATT || w == LL_RMS_FFN));
      bad |= !m->layer[l * LL_PER_LAYER + w];
    }
  s[0] = cfg->dim;
  m->rms_final = kiln_keep(LLAMA_NEW(1, s, true));
  s[0] = cfg->vocab_size;
  m->wcls = cfg->untied ? kiln_keep(LLAMA_NEW(2, s, false)) : m->tok_emb;
#undef LLAMA_NEW
  int64_t kv[2] = {cfg->seq_len, llama_kv_dim(cfg)};
  for (int l = 0; l < L; l++) {
    m->kc[l] = kiln_keep(kiln_zeros(dt, 2, kv));
    m->vc[l] = kiln_keep(kiln_zeros(dt, 2, kv));
    bad |= !m->kc[l] || !m->vc[l];
  }
  /* turns in double: pos / 10000^(2j/hs) */
  int64_t hs = cfg->dim / cfg->n_heads, half = hs / 2, n = cfg->seq_len * half, ms[2] = {cfg->seq_len, cfg->seq_len};
  double *c = malloc(sizeof(double) * (size_t)n), *sn = malloc(sizeof(double) * (size_t)n);
  bool *mask = malloc((size_t)(cfg->seq_len * cfg->seq_len));
  if (c && sn && mask) {
    for (int64_t p = 0; p < cfg->seq_len; p++)
      for (int64_t j = 0; j < half; j++) {
        double a = (double)p / pow(10000.0, (double)(2 * j) / (double)hs);
        c[p * half + j] = cos(a);
        sn[p * half + j] = sin(a);
      }
    for (int64_t r = 0; r < cfg->seq_len; r++)
      for (int64_t q = 0; q < cfg->seq_len; q++) mask[r * cfg->seq_len + q] = q <= r;
    int64_t ts[2] = {cfg->seq_len, half};
    m->cos = kiln_keep(kiln_cast(kiln_tensor_from(KILN_F64, 2, ts, c), dt));
    m->sin = kiln_keep(kiln_cast(kiln_tensor_from(KILN_F64, 2, ts, sn), dt));
    m->mask = kiln_keep(kiln_tensor_from(KILN_BOOL, 2, ms, mask));
  }
  free(c), free(sn), free(mask);
  kiln_scope_end();
  if (bad || !m->tok_emb || !m->rms_final || !m->wcls || !m->cos || !m->sin || !m->mask) return llama_free(m), -1;
  return 0;
}

/* A model of random weights (N(0, 0.02^2) from seed, norm weights 1). */
static inline int llama_init(llama *m, const llama_config *cfg, uint64_t seed) { return llama_make(m, cfg, NULL, seed); }

/* ---- checkpoints: llama2.c's format -------------------------------------- */

/* Reads a checkpoint; 0, or -1 with a message on stderr. */
static inline int llama_load(llama *m, const char *path, kiln_dtype dtype) {
  FILE *f = fopen(path, "rb");
  if (!f) return fprintf(stderr, "llama_load: cannot open %s\n", path), -1;
  int32_t h[7];
  llama_config c = {.dtype = dtype};
  int rc = -1, n = 0;
  float **vals = NULL;
  if (fread(h, sizeof h, 1, f) != 1) {
    fprintf(stderr, "llama_load: %s: no header\n", path);
    goto out;
  }
  c.dim = h[0], c.hidden_dim = h[1], c.n_layers = h[2], c.n_heads = h[3], c.n_kv_heads = h[4];
  c.vocab_size = h[5] < 0 ? -h[5] : h[5], c.untied = h[5] < 0, c.seq_len = h[6];
  if (c.dim < 2 || c.n_heads < 1 || c.n_kv_heads < 1 || c.n_layers < 1 || c.n_layers > 4096 || c.dim % c.n_heads ||
      c.hidden_dim < 1 || c.vocab_size < 1 || c.seq_len < 1 || c.n_heads % c.n_kv_heads) {
    fprintf(stderr, "llama_load: %s: not a checkpoint (header %d %d %d %d %d %d %d)\n", path, h[0], h[1], h[2], h[3], h[4],
            h[5], h[6]);
    goto out;
  }
  int np = llama_n_params(&c);
  vals = calloc((size_t)np, sizeof *vals);
  if (!vals) goto out;
  /* sizes in the file's order (llama_params') */
  for (int i = 0; i < np; i++) {
    int64_t s[2] = {1, 1}, cnt;
    int nd;
    if (i == 0 || (c.untied && i == np - 1)) s[0] = c.vocab_size, s[1] = c.dim;
    else if (i == 1 + LL_PER_LAYER * c.n_layers) s[0] = c.dim;
    else llama_layer_shape(&c, (i - 1) / c.n_layers, &nd, s);
    cnt = s[0] * s[1];
    if (c.untied && i == np - 1 && fseek(f, (long)(sizeof(float) * (size_t)(c.seq_len * (c.dim / c.n_heads))), SEEK_CUR)) break;
    if (!(vals[i] = malloc(sizeof(float) * (size_t)cnt)) || fread(vals[i], sizeof(float), (size_t)cnt, f) != (size_t)cnt) {
      fprintf(stderr, "llama_load: %s: truncated (parameter %d)\n", path, i);
      break;
    }
    n++;
  }
  if (n == np) rc = llama_make(m, &c, (const float *const *)vals, 0);
out:
  for (int i = 0; vals && i < n + 1 && i < llama_n_params(&c); i++) free(vals[i]);
  free(vals);
  fclose(f);
  return rc;
}

/* Writes m as a checkpoint (float32); 0 or -1. */
static inline int llama_save(const llama *m, const char *path) {
  FILE *f = fopen(path, "wb");
  if (!f) return -1;
  const llama_config *c = &m->cfg;
  int32_t h[7] = {c->dim, c->hidden_dim, c->n_layers, c->n_heads, c->n_kv_heads, c->untied ? -c->vocab_size : c->vocab_size,
                  c->seq_len};
  int bad = fwrite(h, sizeof h, 1, f) != 1;
  kiln_tensor **ps = malloc(sizeof *ps * (size_t)llama_n_params(c));
  int np = ps ? llama_params(m, ps) : 0;
  bad |= !ps;
  kiln_scope_begin();
  for (int i = 0; i < np && !bad; i++) {
    if (c->untied && i == np - 1) {
      float zero = 0;
      for (int64_t j = 0; j < (int64_t)c->seq_len * (c->dim / c->n_heads) && !bad; j++) bad |= fwrite(&zero, 4, 1, f) != 1;
    }
    size_t cnt = (size_t)kiln_numel(ps[i]);
    float *buf = malloc(sizeof(float) * cnt);
    kiln_tensor *t = kiln_cast(ps[i], KILN_F32);
    bad |= !buf || !t || kiln_read(t, buf, sizeof(float) * cnt) || fwrite(buf, sizeof(float), cnt, f) != cnt;
    free(buf);
  }
  kiln_scope_end();
  free(ps);
  bad |= fclose(f) != 0;
  return bad ? -1 : 0;
}

/* ---- the model ------------------------------------------------------------ */

static inline kiln_tensor *llama_rmsnorm(kiln_tensor *x, kiln_tensor *w) {
  kiln_dtype dt = kiln_type(x);
  kiln_tensor *ms = kiln_mean(kiln_mul(x, x), -1, true);
  return kiln_mul(kiln_mul(x, kiln_rsqrt(kiln_add(ms, kiln_scalar(dt, LLAMA_EPS)))), w);
}

static inline kiln_tensor *llama_silu(kiln_tensor *x) { return kiln_mul(x, kiln_sigmoid(x)); }

/* x (T,n,hs) turned in pairs at positions pos0 .. pos0+T-1, or at the
 * positions in at (T,) i64 when it is not NULL. */
static inline kiln_tensor *llama_rope(const llama *m, kiln_tensor *x, int64_t pos0, kiln_tensor *at) {
  int64_t T = kiln_size(x, 0), n = kiln_size(x, 1), hs = kiln_size(x, 2);
  kiln_tensor *p = kiln_reshape(x, 4, ((int64_t[]){T, n, hs / 2, 2}));
  kiln_tensor *x0 = kiln_slice(p, 3, 0, 1, 1), *x1 = kiln_slice(p, 3, 1, 2, 1); /* (T,n,hs/2,1) */
  int64_t ts[4] = {T, 1, hs / 2, 1};
  kiln_tensor *c = kiln_reshape(at ? kiln_index_select(m->cos, 0, at) : kiln_slice(m->cos, 0, pos0, pos0 + T, 1), 4, ts);
  kiln_tensor *s = kiln_reshape(at ? kiln_index_select(m->sin, 0, at) : kiln_slice(m->sin, 0, pos0, pos0 + T, 1), 4, ts);
  kiln_tensor *r0 = kiln_sub(kiln_mul(x0, c), kiln_mul(x1, s));
  kiln_tensor *r1 = kiln_add(kiln_mul(x0, s), kiln_mul(x1, c));
  return kiln_reshape(kiln_cat(KILN_TENSORS(r0, r1), 3), 3, ((int64_t[]){T, n, hs}));
}

/* Attention of layer l for h (T,D) at positions pos0..: through the caches
 * when use_cache (k, v written at rows pos0..), else over these T alone (pos0 0).
 * With at (1,) i64 (T 1, use_cache), the position is that tensor's value
 * instead: the row is written by index, and the query attends over every
 * row of the caches, those after it masked out. */
static inline kiln_tensor *llama_attention(llama *m, int l, kiln_tensor *h, int64_t pos0, bool use_cache, kiln_tensor *at) {
  const llama_config *c = &m->cfg;
  int64_t T = kiln_size(h, 0), D = c->dim, nh = c->n_heads, nkv = c->n_kv_heads, hs = D / nh, g = nh / nkv;
  int64_t KV = llama_kv_dim(c), S = at ? c->seq_len : pos0 + T;
  kiln_dtype dt = c->dtype;
  kiln_tensor *q = kiln_matmul(h, kiln_transpose(llama_w(m, l, LL_WQ), 0, 1));
  kiln_tensor *k = kiln_matmul(h, kiln_transpose(llama_w(m, l, LL_WK), 0, 1));
  kiln_tensor *v = kiln_matmul(h, kiln_transpose(llama_w(m, l, LL_WV), 0, 1));
  q = llama_rope(m, kiln_reshape(q, 3, ((int64_t[]){T, nh, hs})), pos0, at);
  k = kiln_reshape(llama_rope(m, kiln_reshape(k, 3, ((int64_t[]){T, nkv, hs})), pos0, at), 2, ((int64_t[]){T, KV}));
  kiln_tensor *keys = k, *vals = v; /* (S,KV) */
  if (at) {
    if (!kiln_index_copy_(m->kc[l], 0, at, k) || !kiln_index_copy_(m->vc[l], 0, at, v)) return NULL;
    keys = m->kc[l], vals = m->vc[l];
  } else if (use_cache) {
    if (!kiln_copy_(kiln_slice(m->kc[l], 0, pos0, S, 1), k) || !kiln_copy_(kiln_slice(m->vc[l], 0, pos0, S, 1), v)) return NULL;
    keys = kiln_slice(m->kc[l], 0, 0, S, 1);
    vals = kiln_slice(m->vc[l], 0, 0, S, 1);
  }
  keys = kiln_permute(kiln_reshape(keys, 3, ((int64_t[]){S, nkv, hs})), ((int[]){1, 0, 2})); /* (nkv,S,hs) */
  vals = kiln_permute(kiln_reshape(vals, 3, ((int64_t[]){S, nkv, hs})), ((int[]){1, 0, 2}));
  /* the g query heads that share a kv head, as g*T rows of it */
  kiln_tensor *qg = kiln_reshape(kiln_permute(q, ((int[]){1, 0, 2})), 3, ((int64_t[]){nkv, g * T, hs}));
  kiln_tensor *att = kiln_mul(kiln_matmul(qg, kiln_transpose(keys, 1, 2)), kiln_scalar(dt, 1.0 / sqrt((double)hs)));
  kiln_tensor *mask = at ? kiln_index_select(m->mask, 0, at) : kiln_slice(kiln_slice(m->mask, 0, pos0, S, 1), 1, 0, S, 1); /* (T,S) */
  att = kiln_reshape(att, 4, ((int64_t[]){nkv, g, T, S}));
  att = kiln_softmax(kiln_where(mask, att, kiln_scalar(dt, -INFINITY)), -1);
  kiln_tensor *y = kiln_matmul(kiln_reshape(att, 3, ((int64_t[]){nkv, g * T, S})), vals); /* (nkv,g*T,hs) */
  y = kiln_permute(kiln_reshape(y, 3, ((int64_t[]){nh, T, hs})), ((int[]){1, 0, 2}));   /* (T,nh,hs) */
  y = kiln_reshape(kiln_contiguous(y), 2, ((int64_t[]){T, D}));
  return kiln_matmul(y, kiln_transpose(llama_w(m, l, LL_WO), 0, 1));
}

/* Logits (T,V) of tokens (T,) i64 at positions pos0 ..; use_cache: through
 * (and into) the KV caches, else attending over these tokens alone. at:
 * one token's position as a (1,) i64 tensor instead of pos0 (llama_step_body). */
static inline kiln_tensor *llama_forward(llama *m, kiln_tensor *tokens, int64_t pos0, bool use_cache, kiln_tensor *at) {
  kiln_tensor *x = kiln_embedding(m->tok_emb, tokens);
  for (int l = 0; l < m->cfg.n_layers; l++) {
    x = kiln_add(x, llama_attention(m, l, llama_rmsnorm(x, llama_w(m, l, LL_RMS_ATT)), pos0, use_cache, at));
    kiln_tensor *h = llama_rmsnorm(x, llama_w(m, l, LL_RMS_FFN));
    kiln_tensor *a = kiln_matmul(h, kiln_transpose(llama_w(m, l, LL_W1), 0, 1));
    kiln_tensor *b = kiln_matmul(h, kiln_transpose(llama_w(m, l, LL_W3), 0, 1));
    x = kiln_add(x, kiln_matmul(kiln_mul(llama_silu(a), b), kiln_transpose(llama_w(m, l, LL_W2), 0, 1)));
  }
  return kiln_matmul(llama_rmsnorm(x, m->rms_final), kiln_transpose(m->wcls, 0, 1));
}

/* Mean cross entropy of next-token prediction over tokens (T+1,) i64. */
static inline kiln_tensor *llama_loss(llama *m, kiln_tensor *tokens) {
  int64_t n = kiln_size(tokens, 0);
  kiln_tensor *logits = llama_forward(m, kiln_slice(tokens, 0, 0, n - 1, 1), 0, false, NULL);
  return kiln_cross_entropy(logits, kiln_slice(tokens, 0, 1, n, 1));
}

/* One SGD step p -= lr * grad on every parameter: the loss before it, or NULL.
 * Parameters must require grad (llama_requires_grad). */
static inline kiln_tensor *llama_train_step(llama *m, kiln_tensor *tokens, double lr) {
  kiln_tensor *ps[4 + LL_PER_LAYER * 64], **p = ps;
  int np = llama_n_params(&m->cfg);
  if (np > (int)(sizeof ps / sizeof *ps) && !(p = malloc(sizeof *p * (size_t)np))) return NULL;
  llama_params(m, p);
  kiln_scope_begin();
  kiln_tensor *loss = llama_loss(m, tokens);
  int bad = !loss || kiln_backward(loss) != 0;
  if (!bad) kiln_keep(loss);
  kiln_scope_end();
  kiln_no_grad_begin();
  kiln_tensor *step = kiln_scalar(m->cfg.dtype, lr);
  for (int i = 0; i < np && !bad; i++) {
    kiln_tensor *g = kiln_grad(p[i]);
    bad |= !g || !kiln_sub_(p[i], kiln_mul(g, step));
  }
  kiln_no_grad_end();
  for (int i = 0; i < np; i++) kiln_zero_grad(p[i]);
  if (p != ps) free(p);
  return bad ? NULL : loss;
}

static inline void llama_requires_grad(llama *m, bool on) {
  kiln_tensor *ps[4 + LL_PER_LAYER * 64];
  if (llama_n_params(&m->cfg) > (int)(sizeof ps / sizeof *ps)) return;
  int np = llama_params(m, ps);
  for (int i = 0; i < np; i++) kiln_requires_grad(ps[i], on);
}

/* Bodies for kiln_compile; ctx is the llama. */

/* in: one token (1,) i64; out: its logits (1,V), after writing its k and v at
 * row m->pos of the caches. The caller moves m->pos on after the call: a C
 * number the compiled variant takes as an argument, so one serves every position. */
static inline int llama_decode_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  llama *m = ctx;
  kiln_no_grad_begin();
  out[0] = llama_forward(m, in[0], m->pos, true, NULL);
  kiln_no_grad_end();
  return out[0] ? 0 : -1;
}

/* in: one token (1,) i64 and its position (1,) i64; out: its logits (1,V),
 * after writing its k and v at that row of the caches. The position is data:
 * every step has one graph, which reads no C number that changes, so it may
 * be compiled with .capture = KILN_CAPTURE_GUARDS and calls skip running
 * the body. Attention reads every row of the caches (those past the
 * position masked out), where llama_decode_body reads rows 0..pos. */
static inline int llama_step_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kiln_no_grad_begin();
  out[0] = llama_forward(ctx, in[0], 0, true, in[1]);
  kiln_no_grad_end();
  return out[0] ? 0 : -1;
}

/* in: tokens (T,) i64; out: logits (T,V), no cache */
static inline int llama_forward_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kiln_no_grad_begin();
  out[0] = llama_forward(ctx, in[0], 0, false, NULL);
  kiln_no_grad_end();
  return out[0] ? 0 : -1;
}

/* Greedy generation: n tokens after `prompt` (np tokens, from position 0),
 * each decoded through fn (or eagerly by llama_decode_body when fn is NULL)
 * into out[0..np+n). fn gets the token and its position (llama_step_body
 * reads both, llama_decode_body the token). 0 or -1. */
static inline int llama_generate(llama *m, kiln_fn *fn, const int64_t *prompt, int np, int n, int64_t *out) {
  if (np < 1 || np + n > m->cfg.seq_len) return fprintf(stderr, "llama_generate: %d + %d tokens do not fit seq_len %d\n", np, n, m->cfg.seq_len), -1;
  memcpy(out, prompt, sizeof *out * (size_t)np);
  m->pos = 0;
  for (int i = 0; i + 1 < np + n; i++) {
    kiln_scope_begin();
    int64_t pos = m->pos;
    kiln_tensor *in[2] = {kiln_tensor_from(KILN_I64, 1, ((int64_t[]){1}), &out[i]),
                          kiln_tensor_from(KILN_I64, 1, ((int64_t[]){1}), &pos)}, *logits = NULL;
    int rc = fn ? kiln_call(fn, in, &logits) : llama_decode_body(m, in, &logits);
    if (rc == 0 && i + 1 >= np) {
      kiln_tensor *best = kiln_argmax(logits, -1, false);
      rc = best && kiln_read(best, &out[i + 1], sizeof out[i + 1]) == 0 ? 0 : -1;
    }
    kiln_scope_end();
    if (rc) return -1;
    m->pos++;
  }
  return 0;
}

/* ---- the tokenizer ---------------------------------------------------------- */

typedef struct llama_tokenizer {
  char **piece;
  float *score;
  int n;
} llama_tokenizer;

static inline void llama_tokenizer_free(llama_tokenizer *t) {
  for (int i = 0; t->piece && i < t->n; i++) free(t->piece[i]);
  free(t->piece);
  free(t->score);
  memset(t, 0, sizeof *t);
}

/* Reads tokenizer.bin for a vocabulary of n tokens; 0, or -1 with a message. */
static inline int llama_tokenizer_load(llama_tokenizer *t, const char *path, int n) {
  memset(t, 0, sizeof *t);
  FILE *f = fopen(path, "rb");
  if (!f) return fprintf(stderr, "llama_tokenizer_load: cannot open %s\n", path), -1;
  int32_t max_len, len;
  t->piece = calloc((size_t)n, sizeof *t->piece);
  t->score = calloc((size_t)n, sizeof *t->score);
  int bad = !t->piece || !t->score || fread(&max_len, 4, 1, f) != 1;
  for (int i = 0; i < n && !bad; i++, t->n++) {
    bad = fread(&t->score[i], 4, 1, f) != 1 || fread(&len, 4, 1, f) != 1 || len < 0 || len > 1 << 16 ||
          !(t->piece[i] = calloc((size_t)len + 1, 1)) || (len && fread(t->piece[i], (size_t)len, 1, f) != 1);
  }
  fclose(f);
  if (bad) {
    fprintf(stderr, "llama_tokenizer_load: %s: truncated or not a tokenizer\n", path);
    llama_tokenizer_free(t);
    return -1;
  }
  return 0;
}

/* The text of token tok after token prev: a piece like "<0x0A>" is that
 * byte; after BOS a leading space is dropped. Points into buf or the table. */
static inline const char *llama_decode_piece(const llama_tokenizer *t, int prev, int tok, char *buf) {
  if (tok < 0 || tok >= t->n) return "";
  const char *p = t->piece[tok];
  if (prev == LLAMA_BOS && p[0] == ' ') p++;
  unsigned byte;
  if (sscanf(p, "<0x%02X>", &byte) == 1 && strlen(p) == 6) {
    buf[0] = (char)byte, buf[1] = 0;
    return buf;
  }
  return p;
}

#endif
