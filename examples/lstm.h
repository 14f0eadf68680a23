/* lstm.h: an LSTM layer written with kiln_scan, its cell the scan's body. A
 * header of static functions, shared by the example (examples/rnn.c) and
 * the benchmark (bench/lstm.c, W10).
 *
 *   g = x_t @ wx + h @ wh + bias                  (B,4H), gates in PyTorch's order:
 *   i = sigmoid(g[:, 0:H]),  f = sigmoid(g[:, H:2H]),
 *   u = tanh(g[:, 2H:3H]),   o = sigmoid(g[:, 3H:4H])
 *   c' = f * c + i * u,      h' = o * tanh(c')
 *
 * Weights (in,out): wx (I,4H), wh (H,4H), bias (4H). nn.LSTM keeps them
 * (out,in) with two biases: its weight_ih is wx^T, bias_ih + bias_hh is bias.
 */
#ifndef KILN_EXAMPLES_LSTM_H
#define KILN_EXAMPLES_LSTM_H

#include <stdint.h>

#include "kiln.h"

typedef struct lstm_cell_w {
  kiln_tensor *wx, *wh, *bias; /* (I,4H), (H,4H), (4H) */
  int64_t hidden;              /* H */
} lstm_cell_w;

/* The scan's body: ctx a lstm_cell_w; in = (h (B,H), c (B,H), x_t (B,I)),
 * out = (h', c', y_t = h'). */
static inline int lstm_cell(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const lstm_cell_w *w = ctx;
  int64_t H = w->hidden;
  kiln_tensor *g = kiln_add(kiln_add(kiln_matmul(in[2], w->wx), kiln_matmul(in[0], w->wh)), w->bias);
  kiln_tensor *i = kiln_sigmoid(kiln_slice(g, -1, 0, H, 1));
  kiln_tensor *f = kiln_sigmoid(kiln_slice(g, -1, H, 2 * H, 1));
  kiln_tensor *u = kiln_tanh(kiln_slice(g, -1, 2 * H, 3 * H, 1));
  kiln_tensor *o = kiln_sigmoid(kiln_slice(g, -1, 3 * H, 4 * H, 1));
  out[1] = kiln_add(kiln_mul(f, in[1]), kiln_mul(i, u));
  out[0] = kiln_mul(o, kiln_tanh(out[1]));
  out[2] = out[0];
  return out[0] && out[1] ? 0 : -1;
}

/* The layer over x (T,B,I) from h = c = 0: every h_t as (T,B,H), or NULL.
 * One kiln_scan, so T is the scan's trip count, not a loop in C: a compiled
 * caller can serve every T with one variant. */
static inline kiln_tensor *lstm_layer(const lstm_cell_w *w, kiln_tensor *x) {
  int64_t hc[2] = {kiln_size(x, 1), w->hidden};
  kiln_tensor *init[2] = {kiln_zeros(KILN_F32, 2, hc), kiln_zeros(KILN_F32, 2, hc)}, *last[2], *hs;
  return kiln_scan(lstm_cell, (void *)w, 2, init, 1, &x, last, 1, &hs) ? NULL : hs;
}

#endif
