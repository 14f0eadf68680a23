/* resnet.h: ResNets written with kiln's ops, their SGD step and a synthetic
 * image dataset. A header of static functions, so that the example
 * (examples/resnet.c), the benchmark (bench/resnet.c) and the tests share
 * one model.
 *
 * The architectures, exactly (so that another framework can reproduce them;
 * bench/torch_resnet.py does):
 *
 *   conv_bn(x, c)  = batch_norm(conv2d(x, c.w, no bias, stride c.s, padding k/2), c.bn)
 *                    momentum 0.1, eps 1e-5; training: batch statistics
 *   ResNet-18, CIFAR variant (x (N,3,32,32)), width w (64 in the paper):
 *     h = relu(conv_bn(x, 3x3 3->w))                     no max pool
 *     4 stages of 2 basic blocks, channels w, 2w, 4w, 8w; the first block of
 *     stages 2-4 has stride 2 (in its first conv) and a 1x1 conv_bn shortcut:
 *       o = relu(conv_bn(h, 3x3)); o = conv_bn(o, 3x3); h = relu(o + shortcut(h))
 *   ResNet-50, ImageNet variant (x (N,3,224,224)), width 64:
 *     h = maxpool3x3/2 pad 1(relu(conv_bn(x, 7x7/2 pad 3, 3->64)))
 *     4 stages of 3, 4, 6, 3 bottleneck blocks of width 64, 128, 256, 512
 *     (out 4x that); stride 2 on the 3x3 conv of the first block of stages
 *     2-4; a 1x1 conv_bn shortcut on every first block:
 *       o = relu(conv_bn(h, 1x1)); o = relu(conv_bn(o, 3x3 stride s));
 *       o = conv_bn(o, 1x1 to 4x); h = relu(o + shortcut(h))
 *   then logits = mean over H,W (adaptive_avg_pool2d to 1x1) @ fc_w + fc_b,
 *   fc_w (C, classes) stored (in, out).
 *
 * Init: conv weights N(0, 2/(out_channels*kh*kw)) (Kaiming, fan out), batch
 * norm weight 1 and bias 0, except the weight of the last batch norm of each
 * block's residual branch, 0 (torch's zero_init_residual: every block starts
 * as the identity, which keeps early training calm); running mean 0 and var
 * 1; fc_w N(0, 1/C), fc_b 0.
 * Values come from kiln_randn with the model's seed plus the parameter's
 * index.
 *
 * Training step: loss = cross_entropy(logits, labels); backward; then SGD
 * with momentum (torch's: v = 0.9 v + grad; p -= lr v, v starting at 0, lr
 * 0.05) for every parameter (conv and fc weights, batch norm weights and
 * biases, fc bias), the gradients dropped after it.
 *
 * Data: class k has a fixed random template image T_k: a 4x4 grid of
 * N(0,1) values per channel (kiln_randn seed 7, shape (classes,3,4,4)), each
 * value filling a (hw/4)x(hw/4) square; a sample of class k is T_k plus
 * N(0,1) noise per pixel, its class drawn uniformly. A network learns it in
 * a few dozen steps.
 */
#ifndef KILN_EXAMPLES_RESNET_H
#define KILN_EXAMPLES_RESNET_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kiln.h"

enum { RN_MAX_CONVS = 64 };

/* A conv without bias and the batch norm after it. */
typedef struct rn_conv {
  kiln_tensor *w;          /* (out, in, k, k) */
  kiln_tensor *g, *b;      /* batch norm weight and bias (out,) */
  kiln_tensor *rm, *rv;    /* running mean and variance (out,) */
  int stride, pad;
} rn_conv;

/* A block: basic (c[0], c[1]) or bottleneck (c[0..3)), and its shortcut conv (down >= 0). */
typedef struct rn_block {
  int c[3], n_c, down;
} rn_block;

typedef struct resnet {
  rn_conv conv[RN_MAX_CONVS];
  int n_conv;
  rn_block block[16];
  int n_block;
  bool imagenet;            /* 7x7 stem and max pool */
  kiln_tensor *fc_w, *fc_b; /* (C, classes), (classes,) */
  kiln_tensor *params[3 * RN_MAX_CONVS + 2]; /* every tensor SGD updates */
  kiln_tensor *velocity[3 * RN_MAX_CONVS + 2]; /* SGD's momentum buffer of each */
  int n_params;
  int classes;
  bool training;            /* batch statistics, running statistics updated */
  double lr;
  uint64_t seed;
} resnet;

/* Adds a conv of out x in x k x k; its index, or -1. */
static inline int rn_add_conv(resnet *m, int in, int out, int k, int stride) {
  if (m->n_conv == RN_MAX_CONVS) return -1;
  rn_conv *c = &m->conv[m->n_conv];
  uint64_t seed = m->seed + (uint64_t)m->n_params;
  kiln_scope_begin();
  c->w = kiln_keep(kiln_mul(kiln_randn(KILN_F32, 4, ((int64_t[]){out, in, k, k}), seed),
                            kiln_scalar(KILN_F32, sqrt(2.0 / (out * k * k)))));
  c->g = kiln_keep(kiln_ones(KILN_F32, 1, ((int64_t[]){out})));
  c->b = kiln_keep(kiln_zeros(KILN_F32, 1, ((int64_t[]){out})));
  c->rm = kiln_keep(kiln_zeros(KILN_F32, 1, ((int64_t[]){out})));
  c->rv = kiln_keep(kiln_ones(KILN_F32, 1, ((int64_t[]){out})));
  kiln_scope_end();
  c->stride = stride;
  c->pad = k / 2;
  if (!c->w || !c->g || !c->b || !c->rm || !c->rv) return -1;
  m->params[m->n_params++] = c->w;
  m->params[m->n_params++] = c->g;
  m->params[m->n_params++] = c->b;
  return m->n_conv++;
}

static inline void resnet_free(resnet *m) {
  for (int i = 0; i < m->n_conv; i++) {
    rn_conv *c = &m->conv[i];
    kiln_release(c->w), kiln_release(c->g), kiln_release(c->b), kiln_release(c->rm), kiln_release(c->rv);
  }
  kiln_release(m->fc_w), kiln_release(m->fc_b);
  for (int i = 0; i < m->n_params; i++) kiln_release(m->velocity[i]);
  m->n_conv = m->n_params = 0;
  m->fc_w = m->fc_b = NULL;
}

/* The last batch norm weight of every residual branch to 0; 0 or -1. */
static inline int rn_zero_residual(resnet *m) {
  for (int i = 0; i < m->n_block; i++) {
    const rn_block *b = &m->block[i];
    if (b->c[b->n_c - 1] < 0 || !kiln_zero_(m->conv[b->c[b->n_c - 1]].g)) return -1;
  }
  return 0;
}

static inline int rn_add_head(resnet *m, int c) {
  kiln_scope_begin();
  m->fc_w = kiln_keep(kiln_mul(kiln_randn(KILN_F32, 2, ((int64_t[]){c, m->classes}), m->seed + 1000),
                               kiln_scalar(KILN_F32, 1 / sqrt((double)c))));
  m->fc_b = kiln_keep(kiln_zeros(KILN_F32, 1, ((int64_t[]){m->classes})));
  kiln_scope_end();
  if (!m->fc_w || !m->fc_b) return -1;
  m->params[m->n_params++] = m->fc_w;
  m->params[m->n_params++] = m->fc_b;
  for (int i = 0; i < m->n_params; i++) {
    kiln_requires_grad(m->params[i], true);
    kiln_tensor *p = m->params[i];
    int64_t shape[4];
    for (int d = 0; d < kiln_ndim(p); d++) shape[d] = kiln_size(p, d);
    if (!(m->velocity[i] = kiln_zeros(KILN_F32, kiln_ndim(p), shape))) return -1;
  }
  return 0;
}

/* ResNet-18 for 32x32 images with base width w (64 in the paper); 0 or -1. */
static inline int resnet18_cifar_init(resnet *m, int width, int classes, uint64_t seed) {
  *m = (resnet){.classes = classes, .training = true, .lr = 0.05, .seed = seed};
  int bad = rn_add_conv(m, 3, width, 3, 1) < 0, in = width;
  for (int s = 0; s < 4; s++) {
    int out = width << s;
    for (int b = 0; b < 2; b++) {
      int stride = s > 0 && b == 0 ? 2 : 1;
      rn_block *bl = &m->block[m->n_block++];
      bl->n_c = 2;
      bl->c[0] = rn_add_conv(m, in, out, 3, stride);
      bl->c[1] = rn_add_conv(m, out, out, 3, 1);
      bl->down = stride != 1 || in != out ? rn_add_conv(m, in, out, 1, stride) : -1;
      bad |= bl->c[0] < 0 || bl->c[1] < 0 || (bl->down < 0 && (stride != 1 || in != out));
      in = out;
    }
  }
  bad |= rn_zero_residual(m) || rn_add_head(m, in) < 0;
  if (bad) resnet_free(m);
  return bad ? -1 : 0;
}

/* ResNet-50 for 224x224 images; 0 or -1. */
static inline int resnet50_init(resnet *m, int classes, uint64_t seed) {
  *m = (resnet){.classes = classes, .training = false, .lr = 0.05, .seed = seed, .imagenet = true};
  static const int blocks[4] = {3, 4, 6, 3};
  int bad = rn_add_conv(m, 3, 64, 7, 2) < 0, in = 64;
  for (int s = 0; s < 4; s++) {
    int width = 64 << s, out = 4 * width;
    for (int b = 0; b < blocks[s]; b++) {
      int stride = s > 0 && b == 0 ? 2 : 1;
      rn_block *bl = &m->block[m->n_block++];
      bl->n_c = 3;
      bl->c[0] = rn_add_conv(m, in, width, 1, 1);
      bl->c[1] = rn_add_conv(m, width, width, 3, stride);
      bl->c[2] = rn_add_conv(m, width, out, 1, 1);
      bl->down = b == 0 ? rn_add_conv(m, in, out, 1, stride) : -1;
      bad |= bl->c[0] < 0 || bl->c[1] < 0 || bl->c[2] < 0 || (b == 0 && bl->down < 0);
      in = out;
    }
  }
  bad |= rn_zero_residual(m) || rn_add_head(m, in) < 0;
  if (bad) resnet_free(m);
  return bad ? -1 : 0;
}

static inline kiln_tensor *rn_conv_bn(resnet *m, int i, kiln_tensor *x, bool relu) {
  rn_conv *c = &m->conv[i];
  int s[2] = {c->stride, c->stride}, p[2] = {c->pad, c->pad};
  kiln_tensor *y = kiln_batch_norm(kiln_conv2d(x, c->w, NULL, s, p, NULL, 1), c->rm, c->rv, c->g, c->b, m->training, 0.1, 1e-5);
  return relu ? kiln_relu(y) : y;
}

/* logits (N, classes) for images x (N,3,H,W). */
static inline kiln_tensor *resnet_forward(resnet *m, kiln_tensor *x) {
  kiln_tensor *h = rn_conv_bn(m, 0, x, true);
  if (m->imagenet) h = kiln_max_pool2d(h, (int[]){3, 3}, (int[]){2, 2}, (int[]){1, 1});
  for (int i = 0; i < m->n_block; i++) {
    const rn_block *b = &m->block[i];
    kiln_tensor *o = h;
    for (int j = 0; j < b->n_c; j++) o = rn_conv_bn(m, b->c[j], o, j + 1 < b->n_c);
    kiln_tensor *sc = b->down >= 0 ? rn_conv_bn(m, b->down, h, false) : h;
    h = kiln_relu(kiln_add(o, sc));
  }
  h = kiln_adaptive_avg_pool2d(h, (int[]){1, 1});
  h = kiln_reshape(h, 2, ((int64_t[]){-1, kiln_size(m->fc_w, 0)}));
  return kiln_add(kiln_matmul(h, m->fc_w), m->fc_b);
}

/* Forward, cross entropy, backward, SGD: the loss before the update, or
 * NULL. Call it in an open scope, which owns the loss. */
static inline kiln_tensor *resnet_train_step(resnet *m, kiln_tensor *x, kiln_tensor *labels) {
  kiln_scope_begin();
  kiln_tensor *loss = kiln_cross_entropy(resnet_forward(m, x), labels);
  int rc = loss && kiln_backward(loss) == 0 ? 0 : -1;
  if (rc == 0) kiln_keep(loss);
  kiln_scope_end();
  if (rc) return NULL;
  kiln_no_grad_begin();
  kiln_tensor *lr = kiln_scalar(KILN_F32, m->lr), *mu = kiln_scalar(KILN_F32, 0.9);
  for (int i = 0; i < m->n_params && rc == 0; i++) {
    kiln_tensor *g = kiln_grad(m->params[i]), *v = m->velocity[i];
    rc = g && kiln_add_(kiln_mul_(v, mu), g) && kiln_sub_(m->params[i], kiln_mul(v, lr)) ? 0 : -1;
  }
  kiln_no_grad_end();
  for (int i = 0; i < m->n_params; i++) kiln_zero_grad(m->params[i]);
  return rc == 0 ? loss : NULL;
}

/* Bodies for kiln_compile; ctx is the resnet. */

/* in: images (N,3,H,W), labels (N,) i64; out: the loss before the update */
static inline int resnet_train_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  out[0] = resnet_train_step(ctx, in[0], in[1]);
  return out[0] ? 0 : -1;
}

/* in: images; out: logits (the model's training flag decides the batch norm's mode) */
static inline int resnet_forward_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  out[0] = resnet_forward(ctx, in[0]);
  return out[0] ? 0 : -1;
}

/* Copies every parameter and running statistic of src into dst (same architecture). */
static inline int resnet_copy_state(resnet *dst, const resnet *src) {
  int bad = 0;
  kiln_no_grad_begin();
  for (int i = 0; i < src->n_params; i++)
    bad |= !kiln_copy_(dst->params[i], src->params[i]) || !kiln_copy_(dst->velocity[i], src->velocity[i]);
  for (int i = 0; i < src->n_conv; i++)
    bad |= !kiln_copy_(dst->conv[i].rm, src->conv[i].rm) || !kiln_copy_(dst->conv[i].rv, src->conv[i].rv);
  kiln_no_grad_end();
  return bad ? -1 : 0;
}

/* ---- data ---- */

/* The class templates (classes,3,hw,hw), hw a multiple of 4, owned by the caller. */
static inline kiln_tensor *rn_templates(int classes, int hw) {
  int64_t q = hw / 4;
  kiln_scope_begin();
  kiln_tensor *t = kiln_randn(KILN_F32, 6, ((int64_t[]){classes, 3, 4, 1, 4, 1}), 7);
  t = kiln_contiguous(kiln_expand(t, 6, ((int64_t[]){classes, 3, 4, q, 4, q})));
  t = kiln_keep(kiln_reshape(t, 4, ((int64_t[]){classes, 3, hw, hw})));
  kiln_scope_end();
  return t;
}

/* A batch of n samples: images (n,3,hw,hw) and labels (n,) i64, both owned
 * by the open scope; *rng moves on. 0 or -1. */
static inline int rn_batch(kiln_tensor *templates, int64_t n, uint64_t *rng, kiln_tensor **x, kiln_tensor **labels) {
  int64_t classes = kiln_size(templates, 0), hw = kiln_size(templates, 2);
  int64_t *lab = malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
  if (!lab) return -1;
  for (int64_t i = 0; i < n; i++) {
    *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
    lab[i] = (int64_t)((*rng >> 33) % (uint64_t)classes);
  }
  *labels = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){n}), lab);
  free(lab);
  kiln_tensor *noise = kiln_randn(KILN_F32, 4, ((int64_t[]){n, 3, hw, hw}), *rng);
  *x = kiln_add(kiln_index_select(templates, 0, *labels), kiln_mul(noise, kiln_scalar(KILN_F32, 1.0)));
  return *x && *labels ? 0 : -1;
}

#endif
