/* The loops of pooling.c for one float type, included once per type with
 *   T      the element type (float, double)
 *   F(x)   x's name for that type (x_f32, x_f64) */

/* Planes [t0, t1) of the pool's output (plane n*C + c). */
static void F(pool_fwd)(const pool_job *j, int64_t t0, int64_t t1) {
  const pool_geom *q = j->q;
  for (int64_t t = t0; t < t1; t++) {
    const T *xp = (const T *)j->x + t * q->h * q->w;
    T *yp = (T *)j->out + t * q->ho * q->wo;
    for (int64_t oh = 0; oh < q->ho; oh++)
      for (int64_t ow = 0; ow < q->wo; ow++) {
        window win = window_at(q, oh, ow);
        T v;
        if (q->op == OP_MAX_POOL2D) {
          v = -(T)INFINITY;
          for (int64_t ih = win.h0; ih < win.h1; ih++)
            for (int64_t iw = win.w0; iw < win.w1; iw++) {
              T e = xp[ih * q->w + iw];
              if (e > v || e != e) v = e;
            }
        } else {
          T s = 0;
          for (int64_t ih = win.h0; ih < win.h1; ih++)
            for (int64_t iw = win.w0; iw < win.w1; iw++) s += xp[ih * q->w + iw];
          v = s / (T)win.count;
        }
        yp[oh * q->wo + ow] = v;
      }
  }
}

/* Planes [t0, t1) of the input's gradient: each output's gradient goes to
 * the first maximum of its window (max), or spread evenly over it. */
static void F(pool_bwd)(const pool_job *j, int64_t t0, int64_t t1) {
  const pool_geom *q = j->q;
  for (int64_t t = t0; t < t1; t++) {
    const T *xp = (const T *)j->x + t * q->h * q->w, *gp = (const T *)j->g + t * q->ho * q->wo;
    T *dp = (T *)j->out + t * q->h * q->w;
    for (int64_t e = 0; e < q->h * q->w; e++) dp[e] = 0;
    for (int64_t oh = 0; oh < q->ho; oh++)
      for (int64_t ow = 0; ow < q->wo; ow++) {
        window win = window_at(q, oh, ow);
        T g = gp[oh * q->wo + ow];
        if (q->op == OP_MAX_POOL2D) {
          T v = -(T)INFINITY;
          int64_t at = win.h0 * q->w + win.w0;
          for (int64_t ih = win.h0; ih < win.h1; ih++)
            for (int64_t iw = win.w0; iw < win.w1; iw++) {
              T e = xp[ih * q->w + iw];
              if (e > v || e != e) v = e, at = ih * q->w + iw;
            }
          dp[at] += g;
        } else {
          T share = g / (T)win.count;
          for (int64_t ih = win.h0; ih < win.h1; ih++)
            for (int64_t iw = win.w0; iw < win.w1; iw++) dp[ih * q->w + iw] += share;
        }
      }
  }
}

static void F(pool_fwd_chunk)(void *ctx, int64_t t0, int64_t t1) { F(pool_fwd)(ctx, t0, t1); }
static void F(pool_bwd_chunk)(void *ctx, int64_t t0, int64_t t1) { F(pool_bwd)(ctx, t0, t1); }
