/* gpt.h: a GPT-2-style decoder written with kiln's ops, plus its AdamW step,
 * byte-level data and sampling. A header of static functions, so that the
 * example (examples/gpt.c), the benchmark (bench/gpt.c) and the test
 * (tests/test_gpt.c) share one model.
 *
 * The architecture, exactly (so that another framework can reproduce it):
 *
 *   idx (B,T) i64 byte values, targets (B,T) i64
 *   x = wte[idx] + wpe[0:T]                                  (B,T,C)
 *   per layer l (pre-norm):
 *     a   = layer_norm(x, ln1_w, ln1_b, eps 1e-5)            biased variance
 *     qkv = a @ attn_w + attn_b                              attn_w (C,3C): q | k | v
 *     q,k,v: (B,T,3C) -> (B,T,3,H,hs) -> (3,B,H,T,hs)        hs = C/H
 *     att = (q @ k^T) * (1/sqrt(hs))                         (B,H,T,T)
 *     att = where(col <= row, att, -inf); softmax over the last dim
 *     y   = (att @ v) -> (B,T,H,hs) -> (B,T,C)
 *     x   = x + (y @ proj_w + proj_b)                        proj_w (C,C)
 *     m   = layer_norm(x, ln2_w, ln2_b, eps 1e-5)
 *     x   = x + (gelu(m @ fc_w + fc_b) @ fc2_w + fc2_b)      fc_w (C,4C), fc2_w (4C,C)
 *   h = layer_norm(x, lnf_w, lnf_b, eps 1e-5)
 *   logits = h @ wte^T                                       tied output projection (B,T,V)
 *   loss = cross_entropy(logits (B*T,V), targets (B*T,))     mean over the B*T rows
 *
 *   gelu is the tanh form: 0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x^3))).
 *   Weights are stored (in,out) and applied as x @ W (a torch nn.Linear
 *   holds W^T). No dropout.
 *
 * Init (GPT-2): every matrix and both embeddings N(0, 0.02^2), except the two
 * residual projections (proj_w, fc2_w) N(0, (0.02/sqrt(2*n_layer))^2); biases
 * 0, layer norm weights 1. Values come from kiln_randn with the seed
 * gpt_init is given plus the parameter's index (the order of gpt_param_name).
 *
 * AdamW (PyTorch's formulas, decoupled weight decay), step t counted from 1:
 *
 *   p -= lr*wd*p                          only for 2-D params (matrices, wte, wpe)
 *   m  = beta1*m + (1-beta1)*g
 *   v  = beta2*v + (1-beta2)*g*g
 *   p -= (lr/(1 - beta1^t)) * m / (sqrt(v)/sqrt(1 - beta2^t) + eps)
 *
 * with lr 1e-3, beta1 0.9, beta2 0.95, eps 1e-8, wd 0.1 (GPT_ADAMW_DEFAULT; the
 * demo's config raises lr to 3e-3).
 * t lives in a 0-d tensor of the model that the step increments in place, so
 * one trace of the step serves every step: a C number would be a constant of
 * the trace.
 */
#ifndef KILN_EXAMPLES_GPT_H
#define KILN_EXAMPLES_GPT_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

typedef struct gpt_adamw {
  double lr, beta1, beta2, eps, weight_decay;
} gpt_adamw;

#define GPT_ADAMW_DEFAULT ((gpt_adamw){.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1})

typedef struct gpt_config {
  int n_layer;     /* blocks */
  int n_head;      /* attention heads; n_embd % n_head == 0 */
  int n_embd;      /* channels C */
  int block_size;  /* longest sequence T (rows of wpe) */
  int vocab_size;  /* V: 256 for bytes */
  kiln_dtype dtype; /* KILN_F32 or KILN_F64 */
  gpt_adamw opt;
} gpt_config;

#define GPT_LN_EPS 1e-5
#define GPT_INIT_STD 0.02

/* The demo's model: small enough to train eagerly in seconds on two cores. */
#define GPT_DEMO_CONFIG                                                                               \
  ((gpt_config){.n_layer = 2, .n_head = 4, .n_embd = 64, .block_size = 32, .vocab_size = 256,        \
                .dtype = KILN_F32, .opt = {.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8,       \
                                           .weight_decay = 0.1}})
#define GPT_DEMO_BATCH 8

/* The benchmark's model (bench/gpt.c, W8 and W9): 834,304 parameters; one
 * training step on GPT_BENCH_BATCH windows of block_size bytes is about 2.7
 * GFLOP of matmuls (forward and backward). */
#define GPT_BENCH_CONFIG                                                                              \
  ((gpt_config){.n_layer = 4, .n_head = 4, .n_embd = 128, .block_size = 64, .vocab_size = 256,       \
                .dtype = KILN_F32, .opt = GPT_ADAMW_DEFAULT})
#define GPT_BENCH_BATCH 8
/* W9 generates GPT_BENCH_GEN_TOKENS bytes greedily, batch 1, from a prompt of
 * GPT_BENCH_PROMPT_LEN bytes: the full forward over the last (up to
 * block_size) bytes for each new byte (no key/value cache), then the logits of
 * the last position (gpt_next_logits). */
#define GPT_BENCH_PROMPT_LEN 12
#define GPT_BENCH_GEN_TOKENS 64

/* Parameters in one flat array: wte, wpe, then GPT_PER_LAYER per block, then
 * lnf_w, lnf_b. */
enum { GPT_WTE, GPT_WPE, GPT_FIRST_LAYER };
enum {
  GPT_LN1_W, GPT_LN1_B, GPT_ATTN_W, GPT_ATTN_B, GPT_PROJ_W, GPT_PROJ_B,
  GPT_LN2_W, GPT_LN2_B, GPT_FC_W, GPT_FC_B, GPT_FC2_W, GPT_FC2_B, GPT_PER_LAYER
};

typedef struct gpt {
  gpt_config cfg;
  int n_params;
  kiln_tensor **p;     /* parameters, require grad */
  kiln_tensor **m, **v; /* AdamW moments, one per parameter, zeros at init */
  kiln_tensor *step;   /* 0-d: AdamW steps taken so far */
  kiln_tensor *mask;   /* (block_size,block_size) bool: col <= row */
  kiln_tensor **kc, **vc; /* per layer (block_size,C) key and value caches of generation (gpt_cache_init), or NULL */
  int64_t pos;            /* the cache row the next decoded byte writes (gpt_decode_step) */
  bool keep_grads;        /* gpt_adamw_step leaves the .grads set (PyTorch's order drops them before a step) */
} gpt;

static inline int gpt_n_params(const gpt_config *c) { return GPT_FIRST_LAYER + GPT_PER_LAYER * c->n_layer + 2; }

static inline kiln_tensor *gpt_layer_param(const gpt *g, int layer, int which) {
  return g->p[GPT_FIRST_LAYER + GPT_PER_LAYER * layer + which];
}

/* "wte", "h1.attn_w", "lnf_b": the name of parameter i, in buf. */
static inline const char *gpt_param_name(const gpt_config *c, int i, char *buf, size_t n) {
  static const char *const per_layer[GPT_PER_LAYER] = {"ln1_w",  "ln1_b", "attn_w", "attn_b", "proj_w", "proj_b",
                                                       "ln2_w",  "ln2_b", "fc_w",   "fc_b",   "fc2_w",  "fc2_b"};
  int last = gpt_n_params(c) - 2;
  if (i == GPT_WTE) snprintf(buf, n, "wte");
  else if (i == GPT_WPE) snprintf(buf, n, "wpe");
  else if (i >= last) snprintf(buf, n, i == last ? "lnf_w" : "lnf_b");
  else snprintf(buf, n, "h%d.%s", (i - GPT_FIRST_LAYER) / GPT_PER_LAYER, per_layer[(i - GPT_FIRST_LAYER) % GPT_PER_LAYER]);
  return buf;
}

/* Shape of parameter i into shape[0..2); returns its rank. */
static inline int gpt_param_shape(const gpt_config *c, int i, int64_t *shape) {
  int64_t C = c->n_embd;
  if (i == GPT_WTE) return shape[0] = c->vocab_size, shape[1] = C, 2;
  if (i == GPT_WPE) return shape[0] = c->block_size, shape[1] = C, 2;
  if (i >= gpt_n_params(c) - 2) return shape[0] = C, 1;
  switch ((i - GPT_FIRST_LAYER) % GPT_PER_LAYER) {
  case GPT_ATTN_W: return shape[0] = C, shape[1] = 3 * C, 2;
  case GPT_ATTN_B: return shape[0] = 3 * C, 1;
  case GPT_PROJ_W: return shape[0] = C, shape[1] = C, 2;
  case GPT_FC_W: return shape[0] = C, shape[1] = 4 * C, 2;
  case GPT_FC_B: return shape[0] = 4 * C, 1;
  case GPT_FC2_W: return shape[0] = 4 * C, shape[1] = C, 2;
  default: return shape[0] = C, 1; /* layer norms, proj_b, fc2_b */
  }
}

/* How parameter i starts: std > 0 normal, else the constant `fill`. */
static inline double gpt_param_init(const gpt_config *c, int i, double *fill) {
  *fill = 0;
  if (i == GPT_WTE || i == GPT_WPE) return GPT_INIT_STD;
  if (i >= gpt_n_params(c) - 2) return *fill = (i == gpt_n_params(c) - 2), 0; /* lnf: w 1, b 0 */
  switch ((i - GPT_FIRST_LAYER) % GPT_PER_LAYER) {
  case GPT_ATTN_W:
  case GPT_FC_W: return GPT_INIT_STD;
  case GPT_PROJ_W:
  case GPT_FC2_W: return GPT_INIT_STD / sqrt(2.0 * c->n_layer);
  case GPT_LN1_W:
  case GPT_LN2_W: return *fill = 1, 0;
  default: return 0; /* biases */
  }
}

static inline void gpt_free(gpt *g) {
  for (int i = 0; g->p && i < g->n_params; i++) {
    kiln_release(g->p[i]);
    kiln_release(g->m[i]);
    kiln_release(g->v[i]);
  }
  free(g->p);
  free(g->m);
  free(g->v);
  kiln_release(g->step);
  kiln_release(g->mask);
  for (int l = 0; g->kc && l < g->cfg.n_layer; l++) kiln_release(g->kc[l]), kiln_release(g->vc[l]);
  free(g->kc);
  free(g->vc);
  memset(g, 0, sizeof *g);
}

/* Zero key and value caches for generation with gpt_decode_logits; 0, or -1. */
static inline int gpt_cache_init(gpt *g) {
  const gpt_config *c = &g->cfg;
  if (g->kc) return 0;
  g->kc = calloc((size_t)c->n_layer, sizeof *g->kc);
  g->vc = calloc((size_t)c->n_layer, sizeof *g->vc);
  int bad = !g->kc || !g->vc;
  for (int l = 0; l < c->n_layer && !bad; l++) {
    int64_t shape[2] = {c->block_size, c->n_embd};
    g->kc[l] = kiln_keep(kiln_zeros(c->dtype, 2, shape));
    g->vc[l] = kiln_keep(kiln_zeros(c->dtype, 2, shape));
    bad = !g->kc[l] || !g->vc[l];
  }
  g->pos = 0;
  return bad ? -1 : 0;
}

/* A new model with GPT-2's init from seed; 0, or -1 with kiln's error set
 * (or a message on stderr for a bad config). */
static inline int gpt_init(gpt *g, const gpt_config *cfg, uint64_t seed) {
  memset(g, 0, sizeof *g);
  if (cfg->n_layer < 1 || cfg->n_head < 1 || cfg->n_embd % cfg->n_head || cfg->block_size < 1 || cfg->vocab_size < 1 ||
      (cfg->dtype != KILN_F32 && cfg->dtype != KILN_F64)) {
    fprintf(stderr, "gpt_init: bad config (n_embd %d must be a multiple of n_head %d, sizes >= 1, dtype f32 or f64)\n",
            cfg->n_embd, cfg->n_head);
    return -1;
  }
  g->cfg = *cfg;
  g->n_params = gpt_n_params(cfg);
  g->p = calloc((size_t)g->n_params, sizeof *g->p);
  g->m = calloc((size_t)g->n_params, sizeof *g->m);
  g->v = calloc((size_t)g->n_params, sizeof *g->v);
  if (!g->p || !g->m || !g->v) {
    gpt_free(g);
    return -1;
  }
  kiln_dtype dt = cfg->dtype;
  int bad = 0;
  kiln_scope_begin();
  for (int i = 0; i < g->n_params; i++) {
    int64_t shape[2];
    int nd = gpt_param_shape(cfg, i, shape);
    double fill, std = gpt_param_init(cfg, i, &fill);
    kiln_tensor *t = std > 0 ? kiln_mul(kiln_randn(dt, nd, shape, seed + (uint64_t)i), kiln_scalar(dt, std))
                             : kiln_full(dt, nd, shape, fill);
    g->p[i] = kiln_keep(t);
    g->m[i] = kiln_keep(kiln_zeros(dt, nd, shape));
    g->v[i] = kiln_keep(kiln_zeros(dt, nd, shape));
    if (!g->p[i] || !g->m[i] || !g->v[i]) bad = 1;
    else kiln_requires_grad(g->p[i], true);
  }
  g->step = kiln_keep(kiln_zeros(dt, 0, NULL));
  /* allowed[row][col] = col <= row */
  kiln_tensor *pos = kiln_arange(KILN_I64, 0, cfg->block_size, 1);
  g->mask = kiln_keep(kiln_le(kiln_unsqueeze(pos, 0), kiln_unsqueeze(pos, 1)));
  kiln_scope_end();
  if (bad || !g->step || !g->mask) {
    gpt_free(g);
    return -1;
  }
  return 0;
}

/* Copies every parameter and optimizer state of src into dst (same config). */
static inline int gpt_copy_state(gpt *dst, const gpt *src) {
  int bad = 0;
  kiln_scope_begin();
  kiln_no_grad_begin();
  for (int i = 0; i < src->n_params; i++)
    bad |= !kiln_copy_(dst->p[i], src->p[i]) || !kiln_copy_(dst->m[i], src->m[i]) || !kiln_copy_(dst->v[i], src->v[i]);
  bad |= !kiln_copy_(dst->step, src->step);
  kiln_no_grad_end();
  kiln_scope_end();
  return bad ? -1 : 0;
}

/* max |a - b| over every parameter of two models, or -1 on error */
static inline double gpt_params_max_diff(const gpt *a, const gpt *b) {
  double worst = 0;
  kiln_scope_begin();
  kiln_no_grad_begin();
  for (int i = 0; i < a->n_params && worst >= 0; i++) {
    kiln_tensor *d = kiln_max_axes(kiln_abs(kiln_sub(a->p[i], b->p[i])), NULL, 0, false);
    double v = d ? kiln_item(d) : -1;
    worst = v < 0 ? -1 : fmax(worst, v);
  }
  kiln_no_grad_end();
  kiln_scope_end();
  return worst;
}

static inline kiln_tensor *gpt_linear(kiln_tensor *x, kiln_tensor *w, kiln_tensor *b) {
  return kiln_add(kiln_matmul(x, w), b);
}

/* Causal self-attention of block `layer` on a (B,T,C), T <= block_size. */
static inline kiln_tensor *gpt_attention(const gpt *g, int layer, kiln_tensor *a) {
  const gpt_config *c = &g->cfg;
  int64_t B = kiln_size(a, 0), T = kiln_size(a, 1), C = c->n_embd, H = c->n_head, hs = C / H;
  kiln_dtype dt = c->dtype;
  kiln_tensor *qkv = gpt_linear(a, gpt_layer_param(g, layer, GPT_ATTN_W), gpt_layer_param(g, layer, GPT_ATTN_B));
  qkv = kiln_reshape(qkv, 5, ((int64_t[]){B, T, 3, H, hs}));
  qkv = kiln_permute(qkv, ((int[]){2, 0, 3, 1, 4})); /* (3,B,H,T,hs) */
  kiln_tensor *q = kiln_squeeze(kiln_slice(qkv, 0, 0, 1, 1), 0);
  kiln_tensor *k = kiln_squeeze(kiln_slice(qkv, 0, 1, 2, 1), 0);
  kiln_tensor *v = kiln_squeeze(kiln_slice(qkv, 0, 2, 3, 1), 0);
  kiln_tensor *att = kiln_mul(kiln_matmul(q, kiln_transpose(k, 2, 3)), kiln_scalar(dt, 1.0 / sqrt((double)hs)));
  /* the mask sliced to T: with T symbolic the slice stays (s0,s0) */
  kiln_tensor *mask = kiln_slice(kiln_slice(g->mask, 0, 0, T, 1), 1, 0, T, 1);
  att = kiln_softmax(kiln_where(mask, att, kiln_scalar(dt, -INFINITY)), -1);
  kiln_tensor *y = kiln_permute(kiln_matmul(att, v), ((int[]){0, 2, 1, 3})); /* (B,T,H,hs) */
  y = kiln_reshape(kiln_contiguous(y), 3, ((int64_t[]){B, T, C}));
  return gpt_linear(y, gpt_layer_param(g, layer, GPT_PROJ_W), gpt_layer_param(g, layer, GPT_PROJ_B));
}

/* The final hidden state (B,T,C), after lnf, of idx (B,T) i64. */
static inline kiln_tensor *gpt_hidden(const gpt *g, kiln_tensor *idx) {
  int64_t T = kiln_size(idx, 1);
  kiln_tensor *x = kiln_add(kiln_embedding(g->p[GPT_WTE], idx), kiln_slice(g->p[GPT_WPE], 0, 0, T, 1));
  for (int l = 0; l < g->cfg.n_layer; l++) {
    kiln_tensor *a = kiln_layer_norm(x, gpt_layer_param(g, l, GPT_LN1_W), gpt_layer_param(g, l, GPT_LN1_B), GPT_LN_EPS);
    x = kiln_add(x, gpt_attention(g, l, a));
    kiln_tensor *m = kiln_layer_norm(x, gpt_layer_param(g, l, GPT_LN2_W), gpt_layer_param(g, l, GPT_LN2_B), GPT_LN_EPS);
    kiln_tensor *f = kiln_gelu(gpt_linear(m, gpt_layer_param(g, l, GPT_FC_W), gpt_layer_param(g, l, GPT_FC_B)));
    x = kiln_add(x, gpt_linear(f, gpt_layer_param(g, l, GPT_FC2_W), gpt_layer_param(g, l, GPT_FC2_B)));
  }
  int last = g->n_params - 2;
  return kiln_layer_norm(x, g->p[last], g->p[last + 1], GPT_LN_EPS);
}

/* logits = h @ wte^T: (..., C) -> (..., V) */
static inline kiln_tensor *gpt_head(const gpt *g, kiln_tensor *h) {
  return kiln_matmul(h, kiln_transpose(g->p[GPT_WTE], 0, 1));
}

/* Mean cross entropy of next-byte prediction: idx, targets (B,T) i64. */
static inline kiln_tensor *gpt_loss(const gpt *g, kiln_tensor *idx, kiln_tensor *targets) {
  int64_t V = g->cfg.vocab_size;
  kiln_tensor *logits = gpt_head(g, gpt_hidden(g, idx)); /* (B,T,V) */
  return kiln_cross_entropy(kiln_reshape(logits, 2, ((int64_t[]){-1, V})), kiln_reshape(targets, 1, ((int64_t[]){-1})));
}

/* Logits (B,V) for the byte after the last position of idx (B,T); no autograd. */
static inline kiln_tensor *gpt_next_logits(const gpt *g, kiln_tensor *idx) {
  kiln_no_grad_begin();
  kiln_tensor *h = gpt_hidden(g, idx);
  kiln_tensor *last = kiln_squeeze(kiln_slice(h, 1, -1, INT64_MAX, 1), 1); /* (B,C) */
  kiln_tensor *logits = gpt_head(g, last);
  kiln_no_grad_end();
  return logits;
}

/* Logits (1,V) of the byte after idx (1,) i64, decoded at position pos
 * (1,) i64 through the caches (gpt_cache_init): its key and value go to
 * row pos of each layer's, and its query attends over every row, those
 * after pos masked out (their stale values weigh exactly 0). The position
 * is data, not a size or a C number: every step has the same graph, so a
 * compiled call can skip running the body (gpt_decode_body). The same
 * numbers as the last row of gpt_next_logits over the bytes at positions
 * 0..pos, up to rounding. No autograd. */
static inline kiln_tensor *gpt_decode_logits(const gpt *g, kiln_tensor *idx, kiln_tensor *pos) {
  const gpt_config *c = &g->cfg;
  int64_t S = c->block_size, C = c->n_embd, H = c->n_head, hs = C / H;
  kiln_dtype dt = c->dtype;
  kiln_no_grad_begin();
  kiln_tensor *x = kiln_add(kiln_embedding(g->p[GPT_WTE], idx), kiln_embedding(g->p[GPT_WPE], pos)); /* (1,C) */
  kiln_tensor *allowed = kiln_index_select(g->mask, 0, pos); /* (1,S): col <= pos */
  for (int l = 0; l < c->n_layer && x; l++) {
    kiln_tensor *a = kiln_layer_norm(x, gpt_layer_param(g, l, GPT_LN1_W), gpt_layer_param(g, l, GPT_LN1_B), GPT_LN_EPS);
    kiln_tensor *qkv = gpt_linear(a, gpt_layer_param(g, l, GPT_ATTN_W), gpt_layer_param(g, l, GPT_ATTN_B)); /* (1,3C) */
    kiln_tensor *q = kiln_slice(qkv, 1, 0, C, 1), *k = kiln_slice(qkv, 1, C, 2 * C, 1), *v = kiln_slice(qkv, 1, 2 * C, 3 * C, 1);
    if (!kiln_index_copy_(g->kc[l], 0, pos, k) || !kiln_index_copy_(g->vc[l], 0, pos, v)) {
      x = NULL;
      break;
    }
    int64_t heads[3] = {S, H, hs};
    kiln_tensor *keys = kiln_permute(kiln_reshape(g->kc[l], 3, heads), ((int[]){1, 0, 2})); /* (H,S,hs) */
    kiln_tensor *vals = kiln_permute(kiln_reshape(g->vc[l], 3, heads), ((int[]){1, 0, 2}));
    kiln_tensor *qh = kiln_reshape(q, 3, ((int64_t[]){H, 1, hs}));
    kiln_tensor *att = kiln_mul(kiln_matmul(qh, kiln_transpose(keys, 1, 2)), kiln_scalar(dt, 1.0 / sqrt((double)hs))); /* (H,1,S) */
    att = kiln_softmax(kiln_where(allowed, att, kiln_scalar(dt, -INFINITY)), -1);
    kiln_tensor *y = kiln_matmul(att, vals);                                       /* (H,1,hs) */
    y = kiln_reshape(kiln_contiguous(y), 2, ((int64_t[]){1, C}));                  /* heads side by side, as (B,T,H,hs) */
    x = kiln_add(x, gpt_linear(y, gpt_layer_param(g, l, GPT_PROJ_W), gpt_layer_param(g, l, GPT_PROJ_B)));
    kiln_tensor *m = kiln_layer_norm(x, gpt_layer_param(g, l, GPT_LN2_W), gpt_layer_param(g, l, GPT_LN2_B), GPT_LN_EPS);
    kiln_tensor *f = kiln_gelu(gpt_linear(m, gpt_layer_param(g, l, GPT_FC_W), gpt_layer_param(g, l, GPT_FC_B)));
    x = kiln_add(x, gpt_linear(f, gpt_layer_param(g, l, GPT_FC2_W), gpt_layer_param(g, l, GPT_FC2_B)));
  }
  int last = g->n_params - 2;
  kiln_tensor *logits = x ? gpt_head(g, kiln_layer_norm(x, g->p[last], g->p[last + 1], GPT_LN_EPS)) : NULL;
  kiln_no_grad_end();
  return logits;
}

/* One AdamW update from the .grad of every parameter (then dropped, unless
 * g->keep_grads), as in the header comment. In-place ops under no-grad: a compiled step records them
 * as writes to the parameters and moments. 0 or -1. */
static inline int gpt_adamw_step(gpt *g) {
  const gpt_adamw *o = &g->cfg.opt;
  kiln_dtype dt = g->cfg.dtype;
  int bad = 0;
  kiln_no_grad_begin();
  bad |= !kiln_add_(g->step, kiln_scalar(dt, 1));
  kiln_tensor *one = kiln_scalar(dt, 1);
  kiln_tensor *bc1 = kiln_sub(one, kiln_pow(kiln_scalar(dt, o->beta1), g->step));
  kiln_tensor *bc2 = kiln_sub(one, kiln_pow(kiln_scalar(dt, o->beta2), g->step));
  kiln_tensor *step_size = kiln_div(kiln_scalar(dt, o->lr), bc1);
  kiln_tensor *bc2_sqrt = kiln_sqrt(bc2);
  kiln_tensor *beta1 = kiln_scalar(dt, o->beta1), *beta2 = kiln_scalar(dt, o->beta2);
  kiln_tensor *one_m_beta1 = kiln_scalar(dt, 1 - o->beta1), *one_m_beta2 = kiln_scalar(dt, 1 - o->beta2);
  kiln_tensor *decay = kiln_scalar(dt, 1 - o->lr * o->weight_decay), *eps = kiln_scalar(dt, o->eps);
  for (int i = 0; i < g->n_params && !bad; i++) {
    kiln_tensor *p = g->p[i], *m = g->m[i], *v = g->v[i], *gr = kiln_grad(p);
    if (!gr) {
      fprintf(stderr, "gpt_adamw_step: parameter %d has no gradient\n", i);
      bad = 1;
      break;
    }
    if (kiln_ndim(p) == 2) bad |= !kiln_mul_(p, decay);
    bad |= !kiln_mul_(m, beta1) || !kiln_add_(m, kiln_mul(gr, one_m_beta1));
    bad |= !kiln_mul_(v, beta2) || !kiln_add_(v, kiln_mul(kiln_mul(gr, gr), one_m_beta2));
    kiln_tensor *denom = kiln_add(kiln_div(kiln_sqrt(v), bc2_sqrt), eps);
    bad |= !kiln_sub_(p, kiln_mul(kiln_div(m, denom), step_size));
  }
  kiln_no_grad_end();
  for (int i = 0; i < g->n_params && !g->keep_grads; i++) kiln_zero_grad(g->p[i]);
  return bad ? -1 : 0;
}

/* Forward, backward and AdamW: the loss before the update, or NULL. Call it
 * in an open scope, which owns what it makes (as everything here). The
 * forward and backward run in a scope of their own, so that their
 * temporaries are freed before the update, in eager mode too. */
static inline kiln_tensor *gpt_train_step(gpt *g, kiln_tensor *idx, kiln_tensor *targets) {
  kiln_scope_begin();
  kiln_tensor *loss = gpt_loss(g, idx, targets);
  int rc = loss && kiln_backward(loss) == 0 ? 0 : -1;
  if (rc == 0) kiln_keep(loss);
  kiln_scope_end();
  return rc == 0 && gpt_adamw_step(g) == 0 ? loss : NULL;
}

/* Bodies for kiln_compile; ctx is the gpt. */

/* in: idx, targets (B,T) i64; out: the loss before the update */
static inline int gpt_train_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  out[0] = gpt_train_step(ctx, in[0], in[1]);
  return out[0] ? 0 : -1;
}

/* in: idx (B,T) i64; out: next-byte logits (B,V) */
static inline int gpt_next_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  out[0] = gpt_next_logits(ctx, in[0]);
  return out[0] ? 0 : -1;
}

/* in: one byte (1,) i64 and its position (1,) i64; out: next-byte logits
 * (1,V), after writing its key and value at that row of the caches. The
 * body depends on nothing but its inputs' shapes and the model's tensors
 * (the caches are params, written in place), so it may be compiled with
 * .capture = KILN_CAPTURE_GUARDS: a call then runs the compiled steps
 * without running the body. */
static inline int gpt_decode_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  out[0] = gpt_decode_logits(ctx, in[0], in[1]);
  return out[0] ? 0 : -1;
}

/* ---- data: bytes of a text, and random windows of it -------------------- */

typedef struct gpt_data {
  uint8_t *bytes;
  int64_t n;
} gpt_data;

/* Reads the whole file; 0, or -1 with a message on stderr. */
static inline int gpt_data_load(gpt_data *d, const char *path) {
  d->bytes = NULL, d->n = 0;
  FILE *f = fopen(path, "rb");
  if (!f) {
    perror(path);
    return -1;
  }
  long n = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
  if (n > 0 && fseek(f, 0, SEEK_SET) == 0 && (d->bytes = malloc((size_t)n)) &&
      fread(d->bytes, 1, (size_t)n, f) == (size_t)n)
    d->n = n;
  fclose(f);
  if (d->n == 0) {
    fprintf(stderr, "%s: cannot read (or empty)\n", path);
    free(d->bytes);
    d->bytes = NULL;
    return -1;
  }
  return 0;
}

static inline void gpt_data_free(gpt_data *d) {
  free(d->bytes);
  d->bytes = NULL, d->n = 0;
}

/* xorshift64*: the batches and the sampling are the same on every machine. */
static inline uint64_t gpt_rand(uint64_t *s) {
  *s ^= *s >> 12, *s ^= *s << 25, *s ^= *s >> 27;
  return *s * 2685821657736338717ull;
}

/* uniform in [0, 1) */
static inline double gpt_rand_unit(uint64_t *s) { return (double)(gpt_rand(s) >> 11) * 0x1.0p-53; }

/* B random windows of T+1 bytes: idx = the first T, targets = the last T,
 * as (B,T) i64 tensors (owned by the open scope). 0 or -1. */
static inline int gpt_batch(const gpt_data *d, int64_t B, int64_t T, uint64_t *rng, kiln_tensor **idx,
                            kiln_tensor **targets) {
  *idx = *targets = NULL;
  if (d->n < T + 2) return -1;
  int64_t *x = malloc(sizeof(int64_t) * (size_t)(2 * B * T));
  if (!x) return -1;
  for (int64_t b = 0; b < B; b++) {
    int64_t start = (int64_t)(gpt_rand(rng) % (uint64_t)(d->n - T - 1));
    for (int64_t t = 0; t < T; t++) {
      x[b * T + t] = d->bytes[start + t];
      x[B * T + b * T + t] = d->bytes[start + t + 1];
    }
  }
  int64_t shape[2] = {B, T};
  *idx = kiln_tensor_from(KILN_I64, 2, shape, x);
  *targets = kiln_tensor_from(KILN_I64, 2, shape, x + B * T);
  free(x);
  return *idx && *targets ? 0 : -1;
}

/* ---- sampling ------------------------------------------------------------ */

/* A byte from logits[0..V): argmax when temperature <= 0, else a draw from
 * softmax(logits / temperature). */
static inline int gpt_sample(const float *logits, int V, double temperature, uint64_t *rng) {
  int best = 0;
  for (int i = 1; i < V; i++)
    if (logits[i] > logits[best]) best = i;
  if (temperature <= 0) return best;
  double total = 0, *w = malloc(sizeof(double) * (size_t)V);
  if (!w) return best;
  for (int i = 0; i < V; i++) total += w[i] = exp((logits[i] - logits[best]) / temperature);
  double r = gpt_rand_unit(rng) * total;
  int pick = V - 1;
  for (int i = 0; i < V; i++) {
    if ((r -= w[i]) < 0) {
      pick = i;
      break;
    }
  }
  free(w);
  return pick;
}

/* Appends n bytes to text[0..*len) (room for *len + n), each sampled from the
 * logits of the last block_size bytes. fn: a kiln_fn of gpt_next_body, or
 * NULL to run gpt_next_logits eagerly. The model must be f32. 0 or -1. */
static inline int gpt_generate(const gpt *g, kiln_fn *fn, uint8_t *text, int64_t *len, int64_t n, double temperature,
                               uint64_t *rng) {
  int V = g->cfg.vocab_size;
  float *logits = malloc(sizeof(float) * (size_t)V);
  int64_t *ctx = malloc(sizeof(int64_t) * (size_t)g->cfg.block_size);
  int rc = logits && ctx ? 0 : -1;
  for (int64_t i = 0; i < n && rc == 0; i++) {
    int64_t T = *len < g->cfg.block_size ? *len : g->cfg.block_size;
    for (int64_t t = 0; t < T; t++) ctx[t] = text[*len - T + t];
    kiln_scope_begin();
    kiln_tensor *idx = kiln_tensor_from(KILN_I64, 2, ((int64_t[]){1, T}), ctx), *out = NULL;
    if (!idx) rc = -1;
    else if (fn) rc = kiln_call(fn, &idx, &out);
    else rc = (out = gpt_next_logits(g, idx)) ? 0 : -1;
    if (rc == 0) rc = kiln_read(out, logits, sizeof(float) * (size_t)V);
    kiln_scope_end();
    if (rc == 0) text[(*len)++] = (uint8_t)gpt_sample(logits, V, temperature, rng);
  }
  free(logits);
  free(ctx);
  return rc;
}

/* Decodes byte b at position g->pos through fn (gpt_decode_body, or NULL: eagerly),
 * moves g->pos on and reads the next-byte logits (V floats). 0 or -1. */
static inline int gpt_decode_step(gpt *g, kiln_fn *fn, uint8_t b, float *logits) {
  int64_t tok[2] = {b, g->pos};
  kiln_scope_begin();
  kiln_tensor *in[2] = {kiln_tensor_from(KILN_I64, 1, ((int64_t[]){1}), &tok[0]),
                        kiln_tensor_from(KILN_I64, 1, ((int64_t[]){1}), &tok[1])}, *out = NULL;
  int rc = !in[0] || !in[1] ? -1 : fn ? kiln_call(fn, in, &out) : (out = gpt_decode_logits(g, in[0], in[1])) ? 0 : -1;
  if (rc == 0) rc = kiln_read(out, logits, sizeof(float) * (size_t)g->cfg.vocab_size);
  kiln_scope_end();
  g->pos++;
  return rc;
}

/* gpt_generate through the KV caches (made here if missing): the context
 * (the last block_size bytes) is decoded a byte at a time from position 0,
 * then each new byte in one step. While the text fits block_size the bytes
 * are gpt_generate's. When the caches are full, the last block_size/2
 * bytes are decoded again from position 0 (a context shift): the model
 * then sees between block_size/2 and block_size bytes where gpt_generate
 * sees block_size. fn: a kiln_fn of gpt_decode_body, or NULL to decode
 * eagerly. The model must be f32. 0 or -1. */
static inline int gpt_generate_cached(gpt *g, kiln_fn *fn, uint8_t *text, int64_t *len, int64_t n, double temperature,
                                      uint64_t *rng) {
  int64_t B = g->cfg.block_size, keep = B / 2 > 0 ? B / 2 : 1;
  float *logits = malloc(sizeof(float) * (size_t)g->cfg.vocab_size);
  int rc = logits && *len > 0 && gpt_cache_init(g) == 0 ? 0 : -1;
  g->pos = 0;
  for (int64_t t = *len - (*len < B ? *len : B); t < *len && rc == 0; t++) rc = gpt_decode_step(g, fn, text[t], logits);
  for (int64_t i = 0; i < n && rc == 0; i++) {
    text[(*len)++] = (uint8_t)gpt_sample(logits, g->cfg.vocab_size, temperature, rng);
    if (i + 1 == n) break;
    if (g->pos < B) {
      rc = gpt_decode_step(g, fn, text[*len - 1], logits);
      continue;
    }
    g->pos = 0;
    for (int64_t t = *len - keep; t < *len && rc == 0; t++) rc = gpt_decode_step(g, fn, text[t], logits);
  }
  free(logits);
  return rc;
}

#endif
