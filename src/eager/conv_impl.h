/* The loops of conv.c for one float type, included once per type with
 *   T      the element type (float, double)
 *   F(x)   x's name for that type (x_f32, x_f64)
 *   GEMM   cblas_sgemm or cblas_dgemm
 * conv.c documents the layouts; everything here is contiguous NCHW. */

/* Rows [r0, r1) of the columns of images [n0, n0 + nb) of group g into col
 * (q->k rows of nb * q->p): row r = (c, i, j) holds, at column b*p + oh*wo + ow,
 * x[n0+b, g*cg + c, oh*sh - ph + i*dh, ow*sw - pw + j*dw], 0 in the padding. */
static void F(im2col)(const conv_geom *q, const T *x, int64_t n0, int64_t nb, int64_t g, T *col, int64_t r0,
                      int64_t r1) {
  int64_t ld = nb * q->p;
  for (int64_t r = r0; r < r1; r++) {
    int64_t c = r / (q->kh * q->kw), i = r / q->kw % q->kh, j = r % q->kw, lo, hi;
    out_range(q->wo, q->w, q->sw, q->pw, j * q->dw, &lo, &hi);
    for (int64_t b = 0; b < nb; b++) {
      const T *plane = x + ((n0 + b) * q->c + g * q->cg + c) * q->h * q->w;
      T *dst = col + r * ld + b * q->p;
      for (int64_t oh = 0; oh < q->ho; oh++, dst += q->wo) {
        int64_t ih = oh * q->sh - q->ph + i * q->dh;
        if (ih < 0 || ih >= q->h) {
          memset(dst, 0, sizeof(T) * (size_t)q->wo);
          continue;
        }
        int64_t base = ih * q->w - q->pw + j * q->dw; /* input element of output column 0 */
        for (int64_t ow = 0; ow < lo; ow++) dst[ow] = 0;
        if (q->sw == 1) {
          if (hi > lo) memcpy(dst + lo, plane + base + lo, sizeof(T) * (size_t)(hi - lo));
        } else {
          for (int64_t ow = lo; ow < hi; ow++) dst[ow] = plane[base + ow * q->sw];
        }
        for (int64_t ow = hi; ow < q->wo; ow++) dst[ow] = 0;
      }
    }
  }
}

/* The reverse of im2col, adding: for items [t0, t1) of images [n0, n0 + nb)
 * (item b*cg + c is channel g*cg + c of image n0 + b), gx gets every column
 * entry of that channel's rows added at the input element it was read from. */
static void F(col2im)(const conv_geom *q, const T *col, int64_t n0, int64_t nb, int64_t g, T *gx, int64_t t0,
                      int64_t t1) {
  int64_t ld = nb * q->p;
  for (int64_t t = t0; t < t1; t++) {
    int64_t b = t / q->cg, c = t % q->cg;
    T *plane = gx + ((n0 + b) * q->c + g * q->cg + c) * q->h * q->w;
    for (int64_t i = 0; i < q->kh; i++)
      for (int64_t j = 0; j < q->kw; j++) {
        int64_t lo, hi;
        out_range(q->wo, q->w, q->sw, q->pw, j * q->dw, &lo, &hi);
        const T *src = col + ((c * q->kh + i) * q->kw + j) * ld + b * q->p;
        for (int64_t oh = 0; oh < q->ho; oh++, src += q->wo) {
          int64_t ih = oh * q->sh - q->ph + i * q->dh;
          if (ih < 0 || ih >= q->h) continue;
          int64_t base = ih * q->w - q->pw + j * q->dw;
          for (int64_t ow = lo; ow < hi; ow++) plane[base + ow * q->sw] += src[ow];
        }
      }
  }
}

/* Direct convolution for output planes [t0, t1) (plane n*o + oc), for groups
 * too thin for a GEMM (depthwise): y[n, oc] = sum over c, i, j of
 * w[oc, c, i, j] times the shifted input plane. */
static void F(direct_fwd)(const conv_geom *q, const T *x, const T *w, T *y, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; t++) {
    int64_t ni = t / q->o, oc = t % q->o, g = oc / q->og;
    T *yp = y + t * q->p;
    for (int64_t e = 0; e < q->p; e++) yp[e] = 0;
    for (int64_t c = 0; c < q->cg; c++) {
      const T *xp = x + (ni * q->c + g * q->cg + c) * q->h * q->w;
      for (int64_t i = 0; i < q->kh; i++)
        for (int64_t j = 0; j < q->kw; j++) {
          T wv = w[((oc * q->cg + c) * q->kh + i) * q->kw + j];
          int64_t lo, hi;
          out_range(q->wo, q->w, q->sw, q->pw, j * q->dw, &lo, &hi);
          for (int64_t oh = 0; oh < q->ho; oh++) {
            int64_t ih = oh * q->sh - q->ph + i * q->dh;
            if (ih < 0 || ih >= q->h) continue;
            int64_t base = ih * q->w - q->pw + j * q->dw;
            T *yr = yp + oh * q->wo;
            for (int64_t ow = lo; ow < hi; ow++) yr[ow] += wv * xp[base + ow * q->sw];
          }
        }
    }
  }
}

/* The input gradient of direct_fwd for input planes [t0, t1) (plane n*c + ci). */
static void F(direct_grad_input)(const conv_geom *q, const T *gy, const T *w, T *gx, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; t++) {
    int64_t ni = t / q->c, ci = t % q->c, g = ci / q->cg, cl = ci % q->cg;
    T *gp = gx + t * q->h * q->w;
    for (int64_t e = 0; e < q->h * q->w; e++) gp[e] = 0;
    for (int64_t oc = g * q->og; oc < (g + 1) * q->og; oc++) {
      const T *yp = gy + (ni * q->o + oc) * q->p;
      for (int64_t i = 0; i < q->kh; i++)
        for (int64_t j = 0; j < q->kw; j++) {
          T wv = w[((oc * q->cg + cl) * q->kh + i) * q->kw + j];
          int64_t lo, hi;
          out_range(q->wo, q->w, q->sw, q->pw, j * q->dw, &lo, &hi);
          for (int64_t oh = 0; oh < q->ho; oh++) {
            int64_t ih = oh * q->sh - q->ph + i * q->dh;
            if (ih < 0 || ih >= q->h) continue;
            int64_t base = ih * q->w - q->pw + j * q->dw;
            const T *yr = yp + oh * q->wo;
            for (int64_t ow = lo; ow < hi; ow++) gp[base + ow * q->sw] += wv * yr[ow];
          }
        }
    }
  }
}

/* The weight gradient of direct_fwd for output channels [t0, t1), each a sum
 * over the batch and the output positions (in double). */
static void F(direct_grad_weight)(const conv_geom *q, const T *gy, const T *x, T *gw, int64_t t0, int64_t t1) {
  for (int64_t oc = t0; oc < t1; oc++) {
    int64_t g = oc / q->og;
    for (int64_t c = 0; c < q->cg; c++)
      for (int64_t i = 0; i < q->kh; i++)
        for (int64_t j = 0; j < q->kw; j++) {
          int64_t lo, hi;
          out_range(q->wo, q->w, q->sw, q->pw, j * q->dw, &lo, &hi);
          double acc = 0;
          for (int64_t ni = 0; ni < q->n; ni++) {
            const T *xp = x + (ni * q->c + g * q->cg + c) * q->h * q->w, *yp = gy + (ni * q->o + oc) * q->p;
            for (int64_t oh = 0; oh < q->ho; oh++) {
              int64_t ih = oh * q->sh - q->ph + i * q->dh;
              if (ih < 0 || ih >= q->h) continue;
              int64_t base = ih * q->w - q->pw + j * q->dw;
              const T *yr = yp + oh * q->wo;
              for (int64_t ow = lo; ow < hi; ow++) acc += (double)yr[ow] * (double)xp[base + ow * q->sw];
            }
          }
          gw[((oc * q->cg + c) * q->kh + i) * q->kw + j] = (T)acc;
        }
  }
}

/* c (m, n; ldc) = a @ b + beta c, a (m, k) or its transpose, b (k, n) or its transpose. */
static void F(gemm)(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const T *a, int64_t lda, const T *b,
                    int64_t ldb, T beta, T *c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (int64_t r = 0; r < m; r++)
      for (int64_t e = 0; e < n; e++) c[r * ldc + e] = beta == 0 ? 0 : beta * c[r * ldc + e];
    return;
  }
  GEMM(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)m, (int)n, (int)k, 1, a,
       (int)lda, b, (int)ldb, beta, c, (int)ldc);
}

/* ---- thread-pool chunks ---- */

static void F(im2col_chunk)(void *ctx, int64_t r0, int64_t r1) {
  const conv_job *j = ctx;
  F(im2col)(j->q, j->x, j->n0, j->nb, j->g, j->col, r0, r1);
}
static void F(col2im_chunk)(void *ctx, int64_t t0, int64_t t1) {
  const conv_job *j = ctx;
  F(col2im)(j->q, j->col, j->n0, j->nb, j->g, j->out, t0, t1);
}
static void F(direct_fwd_chunk)(void *ctx, int64_t t0, int64_t t1) {
  const conv_job *j = ctx;
  F(direct_fwd)(j->q, j->x, j->w, j->out, t0, t1);
}
static void F(direct_grad_input_chunk)(void *ctx, int64_t t0, int64_t t1) {
  const conv_job *j = ctx;
  F(direct_grad_input)(j->q, j->x, j->w, j->out, t0, t1);
}
static void F(direct_grad_weight_chunk)(void *ctx, int64_t t0, int64_t t1) {
  const conv_job *j = ctx;
  F(direct_grad_weight)(j->q, j->x, j->w, j->out, t0, t1);
}

/* The columns of images [n0, n0 + nb) of group g into col, over the pool. */
static void F(columns)(const conv_geom *q, const T *x, int64_t n0, int64_t nb, int64_t g, T *col) {
  conv_job j = {.q = q, .x = x, .n0 = n0, .nb = nb, .g = g, .col = col};
  pool_parallel_for(q->k, grain_for(nb * q->p), F(im2col_chunk), &j);
}

/* ---- the three ops ---- */

/* y (N, O, P) = conv2d(x, w). */
static int F(conv_forward)(const conv_geom *q, const T *x, const T *w, T *y, void *scratch) {
  if (use_direct(q)) {
    conv_job j = {.q = q, .x = x, .w = w, .out = y};
    pool_parallel_for(q->n * q->o, grain_for(q->p * q->cg * q->kh * q->kw), F(direct_fwd_chunk), &j);
    return 0;
  }
  int64_t nb = chunk_images(q);
  T *col, *tmp;
  void *own = working_memory(q, scratch, sizeof(T), (void **)&col, (void **)&tmp);
  if (!own && !scratch && scratch_bytes(q, sizeof(T))) return -1;
  for (int64_t n0 = 0; n0 < q->n; n0 += nb) {
    int64_t nc = q->n - n0 < nb ? q->n - n0 : nb, ld = nc * q->p;
    for (int64_t g = 0; g < q->groups; g++) {
      const T *b = col ? col : x + (n0 * q->c + g * q->cg) * q->h * q->w;
      if (col) F(columns)(q, x, n0, nc, g, col);
      T *c = tmp ? tmp : y + (n0 * q->o + g * q->og) * q->p;
      F(gemm)(false, false, q->og, ld, q->k, w + g * q->og * q->k, q->k, b, ld, 0, c, ld);
      if (tmp) rows_out(q, tmp, y, n0, nc, g, sizeof(T));
    }
  }
  alloc_free(own);
  return 0;
}

/* gx (N, C, H, W) from gy (N, O, P) and w. */
static int F(conv_grad_input)(const conv_geom *q, const T *gy, const T *w, T *gx, void *scratch) {
  if (use_direct(q)) {
    conv_job j = {.q = q, .x = gy, .w = w, .out = gx};
    pool_parallel_for(q->n * q->c, grain_for(q->p * q->og * q->kh * q->kw), F(direct_grad_input_chunk), &j);
    return 0;
  }
  int64_t nb = chunk_images(q);
  bool plain = is_plain(q) && nb == 1;
  T *col, *tmp;
  void *own = working_memory(q, scratch, sizeof(T), (void **)&col, (void **)&tmp);
  if (!own && !scratch && scratch_bytes(q, sizeof(T))) return -1;
  if (!plain) memset(gx, 0, sizeof(T) * (size_t)(q->n * q->c * q->h * q->w));
  for (int64_t n0 = 0; n0 < q->n; n0 += nb) {
    int64_t nc = q->n - n0 < nb ? q->n - n0 : nb, ld = nc * q->p;
    for (int64_t g = 0; g < q->groups; g++) {
      const T *a = gy + (n0 * q->o + g * q->og) * q->p;
      if (tmp) {
        rows_in(q, gy, tmp, n0, nc, g, sizeof(T));
        a = tmp;
      }
      const T *wg = w + g * q->og * q->k;
      if (plain) {
        F(gemm)(true, false, q->k, ld, q->og, wg, q->k, a, ld, 0, gx + (n0 * q->c + g * q->cg) * q->h * q->w, ld);
        continue;
      }
      F(gemm)(true, false, q->k, ld, q->og, wg, q->k, a, ld, 0, col, ld);
      conv_job j = {.q = q, .col = col, .n0 = n0, .nb = nc, .g = g, .out = gx};
      pool_parallel_for(nc * q->cg, grain_for(q->k / (q->cg ? q->cg : 1) * q->p), F(col2im_chunk), &j);
    }
  }
  alloc_free(own);
  return 0;
}

/* gw (O, C/groups, kh, kw) from gy (N, O, P) and x. */
static int F(conv_grad_weight)(const conv_geom *q, const T *gy, const T *x, T *gw, void *scratch) {
  if (use_direct(q)) {
    conv_job j = {.q = q, .x = gy, .w = x, .out = gw};
    pool_parallel_for(q->o, grain_for(q->n * q->p * q->k), F(direct_grad_weight_chunk), &j);
    return 0;
  }
  int64_t nb = chunk_images(q);
  T *col, *tmp;
  void *own = working_memory(q, scratch, sizeof(T), (void **)&col, (void **)&tmp);
  if (!own && !scratch && scratch_bytes(q, sizeof(T))) return -1;
  if (q->n == 0) memset(gw, 0, sizeof(T) * (size_t)(q->o * q->k));
  for (int64_t n0 = 0; n0 < q->n; n0 += nb) {
    int64_t nc = q->n - n0 < nb ? q->n - n0 : nb, ld = nc * q->p;
    for (int64_t g = 0; g < q->groups; g++) {
      const T *a = gy + (n0 * q->o + g * q->og) * q->p, *b = col ? col : x + (n0 * q->c + g * q->cg) * q->h * q->w;
      if (tmp) {
        rows_in(q, gy, tmp, n0, nc, g, sizeof(T));
        a = tmp;
      }
      if (col) F(columns)(q, x, n0, nc, g, col);
      F(gemm)(false, true, q->og, q->k, ld, a, ld, b, ld, n0 == 0 ? 0 : 1, gw + g * q->og * q->k, q->k);
    }
  }
  alloc_free(own);
  return 0;
}
