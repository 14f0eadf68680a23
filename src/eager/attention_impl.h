/* The fused attention kernel's loops for one float type and one vector
 * width (attention.c includes this once per pair): AT is the type, AT_SFX
 * its suffix, AT_EXP its exp, AT_VB the bytes of a vector (GCC/clang
 * vector extensions), AT_ISA the name of the instruction set and AT_TARGET
 * the attribute that compiles the outer functions for it. The width is
 * the instruction set's register (64 bytes on AVX-512, 32 on AVX2, 16
 * otherwise): wider vectors than the registers make GCC split them, spill
 * the register blocks and compare lane by lane (AVX2 ran W7 12x slower
 * than eager that way). A tile is BR query rows by BC key columns; the
 * loops over it are register blocked, four rows by CV vectors (below), so that
 * the inner loop is FMAs fed by CV loads and four broadcasts. */

#define AT_CAT2(a, b) a##_##b
#define AT_CAT(a, b) AT_CAT2(a, b)
#define FN(name) AT_CAT(AT_CAT(name, AT_SFX), AT_ISA)
#define LN ((int64_t)(AT_VB / sizeof(AT))) /* lanes */
#define BC (ATTN_TILE_VECS * LN)           /* key columns of a tile */
/* vectors of columns in a register block: 4 rows by 4 takes 16 of AVX-512's
 * 32 registers; 16-register sets take 4 by 2, which leaves room for the loads */
#define CV (AT_VB >= 64 ? 4 : 2)
#define AI static inline __attribute__((always_inline))

/* aligned(sizeof(AT)): loads and stores from any element address */
typedef AT FN(vec) __attribute__((vector_size(AT_VB), aligned(sizeof(AT))));
typedef int64_t FN(ivec) __attribute__((vector_size(AT_VB), aligned(sizeof(AT))));

/* s[r][0..CV LN) = q[r] . kt[.][0..CV LN) for the 4 rows of q (row length D; kt and s rows BC apart). */
AI void FN(scores4)(const AT *q, int64_t D, const AT *kt, AT *s) {
  FN(vec) acc[4][CV];
  memset(acc, 0, sizeof acc);
  for (int64_t d = 0; d < D; d++) {
    const FN(vec) *kv = (const FN(vec) *)(kt + d * BC);
    FN(vec) k[CV];
    for (int c = 0; c < CV; c++) k[c] = kv[c];
    for (int r = 0; r < 4; r++) {
      AT a = q[r * D + d];
      for (int c = 0; c < CV; c++) acc[r][c] += a * k[c];
    }
  }
  for (int r = 0; r < 4; r++)
    for (int c = 0; c < CV; c++) ((FN(vec) *)(s + r * BC))[c] = acc[r][c];
}

/* Four rows at once: o[k*ol ..][0..NV vectors) += sum over i < n of
 * a[k*ak + i*as] * b[i*ld ...] for k < 4, NV <= CV (a constant once
 * inlined): each load of b feeds four multiply-adds. The forward's p @ v
 * (a and o rows BC and ld apart) and the backward's sums. */
AI void FN(axpy4_nv)(AT *o, int64_t ol, const AT *a, int64_t ak, int64_t as, int64_t n, const AT *b, int64_t ld,
                     const int NV) {
  FN(vec) acc[4][CV];
  for (int k = 0; k < 4; k++)
    for (int x = 0; x < NV; x++) acc[k][x] = ((const FN(vec) *)(o + k * ol))[x];
  for (int64_t i = 0; i < n; i++) {
    const FN(vec) *bv = (const FN(vec) *)(b + i * ld);
    FN(vec) w[CV];
    for (int x = 0; x < NV; x++) w[x] = bv[x];
    for (int k = 0; k < 4; k++) {
      AT c = a[k * ak + i * as];
      for (int x = 0; x < NV; x++) acc[k][x] += c * w[x];
    }
  }
  for (int k = 0; k < 4; k++)
    for (int x = 0; x < NV; x++) ((FN(vec) *)(o + k * ol))[x] = acc[k][x];
}

/* The largest of s[0..nv*LN); -inf when all are. */
AI AT FN(row_max)(const AT *s, int64_t nv) {
  FN(vec) m = ((const FN(vec) *)s)[0];
  for (int64_t c = 1; c < nv; c++) {
    FN(vec) x = ((const FN(vec) *)s)[c];
    FN(ivec) gt = (FN(ivec))(x > m);
    m = (FN(vec))(((FN(ivec))x & gt) | ((FN(ivec))m & ~gt));
  }
  AT r = m[0];
  for (int i = 1; i < LN; i++) r = m[i] > r ? m[i] : r;
  return r;
}

/* s[c] = exp(s[c] - mx) over s[0..nv*LN); their sum. */
AI AT FN(row_exp)(AT *s, int64_t nv, AT mx) {
  for (int64_t c = 0; c < nv * LN; c++) s[c] = AT_EXP(s[c] - mx);
  FN(vec) t = ((FN(vec) *)s)[0];
  for (int64_t c = 1; c < nv; c++) t += ((FN(vec) *)s)[c];
  AT r = 0;
  for (int i = 0; i < LN; i++) r += t[i];
  return r;
}

/* Packs batch entries [b, e) of j's k and v: per entry, k's tiles (D,BC)
 * transposed and v's rows (S rounded up to tiles, Ep), zero-padded. */
AT_TARGET static void FN(attn_pack)(const attn_job *j, int64_t b, int64_t e) {
  const int64_t D = j->D, E = j->E, Ep = j->Ep, S = j->S, Sp = j->ntiles * BC;
  for (int64_t bh = b; bh < e; bh++) {
    int64_t off[J_N];
    attn_offsets(j, bh, off);
    const AT *k = (const AT *)j->k + off[1], *v = (const AT *)j->v + off[2];
    AT *kp = (AT *)j->kp + bh * Sp * D, *vp = (AT *)j->vp + bh * Sp * Ep;
    for (int64_t c = 0; c < Sp; c++) {
      AT *kt = kp + (c / BC) * D * BC + c % BC;
      for (int64_t d = 0; d < D; d++) kt[d * BC] = c < S ? k[c * j->krs + d] : 0;
      for (int64_t x = 0; x < Ep; x++) vp[c * Ep + x] = c < S && x < E ? v[c * j->vrs + x] : 0;
    }
  }
}

/* Tasks [b, e) of j (a row block of one batch entry each), with ws the
 * chunk's working memory (attn_ws_elems elements). */
AT_TARGET static void FN(attn_tasks)(const attn_job *j, int64_t b, int64_t e, AT *ws) {
  const int64_t D = j->D, E = j->E, Ep = j->Ep, T = j->T, S = j->S, Sp = j->ntiles * BC;
  AT *qb = ws, *sb = qb + ATTN_BR * D, *ob = sb + ATTN_BR * BC, *m = ob + ATTN_BR * Ep, *l = m + ATTN_BR;
  const AT scale = (AT)j->scale;
  for (int64_t t = b; t < e; t++) {
    int64_t bh = t / j->nrb, i = t % j->nrb;
    /* zigzag: a chunk of consecutive tasks gets early and late (costly, when causal) blocks alike */
    int64_t rb = i % 2 == 0 ? i / 2 : j->nrb - 1 - i / 2;
    int64_t off[J_N];
    attn_offsets(j, bh, off);
    const AT *q = (const AT *)j->q + off[0];
    const AT *kp = (const AT *)j->kp + bh * Sp * D, *vp = (const AT *)j->vp + bh * Sp * Ep;
    AT *out = (AT *)j->out + off[4];
    int64_t r0 = rb * ATTN_BR, nr = T - r0 < ATTN_BR ? T - r0 : ATTN_BR, nr4 = (nr + 3) / 4 * 4;
    for (int64_t r = 0; r < nr; r++) {
      const AT *restrict qr = q + (r0 + r) * j->qrs;
      AT *restrict to = qb + r * D;
      for (int64_t d = 0; d < D; d++) to[d] = qr[d] * scale;
    }
    memset(qb + nr * D, 0, sizeof(AT) * (size_t)((nr4 - nr) * D));
    for (int64_t r = 0; r < ATTN_BR; r++) m[r] = -INFINITY, l[r] = 0;
    memset(ob, 0, sizeof(AT) * (size_t)(nr4 * Ep));
    for (int64_t c0 = 0; c0 < S; c0 += BC) {
      int64_t nc = S - c0 < BC ? S - c0 : BC, nv = (nc + LN - 1) / LN; /* the vectors with a column */
      int mode = attn_tile_mode(j, off[3], r0, nr, c0, nc);
      if (mode == TILE_SKIP) continue;
      const AT *kt = kp + (c0 / BC) * D * BC, *vb = vp + c0 * Ep;
      /* each half of the tile that has a key; the columns past nc are set to -inf below */
      for (int64_t rg = 0; rg < nr4; rg += 4)
        for (int64_t h = 0; h < nc; h += CV * LN) FN(scores4)(qb + rg * D, D, kt + h, sb + rg * BC + h);
      for (int64_t r = 0; r < nr; r++) {
        AT *s = sb + r * BC;
        if (mode == TILE_MASK) {
          const bool *mk = (const bool *)j->mask + off[3] + (r0 + r) * j->mrs + c0 * j->mcs;
          for (int64_t c = 0; c < nc; c++)
            if (mk[c * j->mcs] == j->drop) s[c] = -INFINITY;
        } else if (mode == TILE_ADD) {
          const AT *mk = (const AT *)j->mask + off[3] + (r0 + r) * j->mrs + c0 * j->mcs;
          for (int64_t c = 0; c < nc; c++) s[c] += mk[c * j->mcs];
        }
        for (int64_t c = nc; c < nv * LN; c++) s[c] = -INFINITY;
        AT mx = FN(row_max)(s, nv), mn = mx > m[r] ? mx : m[r];
        if (mn == -INFINITY) { /* nothing kept in this row yet */
          memset(s, 0, sizeof(AT) * (size_t)nc);
          continue;
        }
        AT alpha = AT_EXP(m[r] - mn), sum = FN(row_exp)(s, nv, mn);
        l[r] = l[r] * alpha + sum;
        m[r] = mn;
        if (alpha != 1)
          for (int64_t x = 0; x < Ep; x++) ob[r * Ep + x] *= alpha;
      }
      for (int64_t rg = 0; rg < nr4; rg += 4)
        for (int64_t x0 = 0; x0 < Ep; x0 += CV * LN) {
          const AT *p = sb + rg * BC, *vx = vb + x0;
          AT *o = ob + rg * Ep + x0;
          int64_t left = (Ep - x0) / LN;
          if (CV == 4 && left >= 4) FN(axpy4_nv)(o, Ep, p, BC, 1, nc, vx, Ep, 4);
          else if (CV == 4 && left == 3) FN(axpy4_nv)(o, Ep, p, BC, 1, nc, vx, Ep, 3);
          else if (left >= 2) FN(axpy4_nv)(o, Ep, p, BC, 1, nc, vx, Ep, 2);
          else FN(axpy4_nv)(o, Ep, p, BC, 1, nc, vx, Ep, 1);
        }
    }
    /* a row that kept nothing is 0/0: NaN, as the unfused softmax gives */
    for (int64_t r = 0; r < nr; r++) {
      AT *o = out + (r0 + r) * j->ors, inv = 1 / l[r];
      if (j->ocs == 1)
        for (int64_t x = 0; x < E; x++) o[x] = ob[r * Ep + x] * inv;
      else
        for (int64_t x = 0; x < E; x++) o[x * j->ocs] = ob[r * Ep + x] * inv;
    }
  }
}

/* ---- the backward (k_attention_grad) ---- */

/* o[0..NV vectors) += sum over i < n of a[i*as] * b[i*ld ...]: NV <= 4, a constant once inlined. */
AI void FN(axpy_nv)(AT *o, const AT *a, int64_t as, int64_t n, const AT *b, int64_t ld, const int NV) {
  FN(vec) acc[4];
  for (int x = 0; x < NV; x++) acc[x] = ((const FN(vec) *)o)[x];
  for (int64_t i = 0; i < n; i++) {
    const FN(vec) *bv = (const FN(vec) *)(b + i * ld);
    AT c = a[i * as];
    for (int x = 0; x < NV; x++) acc[x] += c * bv[x];
  }
  for (int x = 0; x < NV; x++) ((FN(vec) *)o)[x] = acc[x];
}

/* The same over nv vectors, four at a time: every product of the backward
 * is rows of b weighted by a's entries, summed into a row of o. */
AI void FN(axpy)(AT *o, const AT *a, int64_t as, int64_t n, const AT *b, int64_t ld, int64_t nv) {
  int64_t x = 0;
  for (; x + 4 <= nv; x += 4) FN(axpy_nv)(o + x * LN, a, as, n, b + x * LN, ld, 4);
  if (nv - x == 3) FN(axpy_nv)(o + x * LN, a, as, n, b + x * LN, ld, 3);
  else if (nv - x == 2) FN(axpy_nv)(o + x * LN, a, as, n, b + x * LN, ld, 2);
  else if (nv - x == 1) FN(axpy_nv)(o + x * LN, a, as, n, b + x * LN, ld, 1);
}

/* The same over nv vectors, CV at a time. */
AI void FN(axpy4)(AT *o, int64_t ol, const AT *a, int64_t ak, int64_t as, int64_t n, const AT *b, int64_t ld,
                  int64_t nv) {
  int64_t x = 0;
  for (; x + CV <= nv; x += CV) FN(axpy4_nv)(o + x * LN, ol, a, ak, as, n, b + x * LN, ld, CV);
  if (CV == 4 && nv - x == 3) FN(axpy4_nv)(o + x * LN, ol, a, ak, as, n, b + x * LN, ld, 3);
  else if (nv - x >= 2) FN(axpy4_nv)(o + x * LN, ol, a, ak, as, n, b + x * LN, ld, 2), x += 2;
  if (nv - x == 1) FN(axpy4_nv)(o + x * LN, ol, a, ak, as, n, b + x * LN, ld, 1);
}

/* The vectors of row rr of the tile at c0 (nc columns, nv vectors) up to
 * its last kept column: a causal row needs no more (0: it keeps none). */
AI int64_t FN(row_vectors)(const attn_job *j, int64_t mo, int mode, int64_t rr, int64_t c0, int64_t nc, int64_t nv) {
  if (mode != TILE_MASK) return nv;
  const bool *mk = (const bool *)j->mask + mo + rr * j->mrs + c0 * j->mcs;
  int64_t c = nc - 1;
  while (c >= 0 && mk[c * j->mcs] == j->drop) c--;
  return (c + LN) / LN;
}

/* s[0..nv LN) = the scaled scores of row rr against the tile at c0 (kt its
 * pack), masked as the forward masks them, -inf past its nc columns. */
AI void FN(bwd_scores)(const attn_job *j, int64_t mo, int mode, const AT *qr, const AT *kt, int64_t rr, int64_t c0,
                       int64_t nc, int64_t nv, AT *s) {
  memset(s, 0, sizeof(AT) * (size_t)(nv * LN));
  FN(axpy)(s, qr, 1, j->D, kt, BC, nv);
  if (mode == TILE_MASK) {
    const bool *mk = (const bool *)j->mask + mo + rr * j->mrs + c0 * j->mcs;
    for (int64_t c = 0; c < nc && c < nv * LN; c++)
      if (mk[c * j->mcs] == j->drop) s[c] = -INFINITY;
  } else if (mode == TILE_ADD) {
    const AT *mk = (const AT *)j->mask + mo + rr * j->mrs + c0 * j->mcs;
    for (int64_t c = 0; c < nc; c++) s[c] += mk[c * j->mcs];
  }
  for (int64_t c = nc; c < nv * LN; c++) s[c] = -INFINITY;
}

/* Batch entries [b, e) of j's backward, ws the chunk's working memory
 * (attn_bwd_ws_elems). Per entry: k and v packed as the forward packs k,
 * then per block of query rows two walks over the key tiles (masked-out
 * tiles skipped, and in a masked tile each row cut after its last kept
 * column): the first recomputes each row's max and sum of exps (its
 * logsumexp), the second the probabilities p, dp = do v^T, ds = p (dp -
 * rowsum(do o)), and sums dv += p^T do, dk += ds^T q, dq += ds k. Only a
 * tile of p and ds is ever held. */
AT_TARGET static void FN(attn_bwd_tasks)(const attn_job *j, int64_t b, int64_t e, AT *ws) {
  const int64_t D = j->D, E = j->E, Dp = j->Dp, Ep = j->Ep, T = j->T, S = j->S, Sp = j->ntiles * BC;
  const int64_t nvd = Dp / LN, nve = Ep / LN;
  AT *kT = ws, *vT = kT + Sp * D, *kr = vT + Sp * E, *dk = kr + Sp * Dp, *dv = dk + Sp * Dp, *qs = dv + Sp * Ep;
  AT *dO = qs + ATTN_BR * Dp, *dq = dO + ATTN_BR * Ep, *pb = dq + ATTN_BR * Dp, *sb = pb + ATTN_BR * BC;
  AT *m = sb + ATTN_BR * BC, *l = m + ATTN_BR, *dl = l + ATTN_BR;
  int64_t nvr[ATTN_BR], first[ATTN_TILE_VECS]; /* a row's vectors in the tile; a vector's first row that has it */
  const AT scale = (AT)j->scale;
  for (int64_t bh = b; bh < e; bh++) {
    int64_t off[J_N];
    attn_offsets(j, bh, off);
    const AT *q = (const AT *)j->q + off[J_Q], *k = (const AT *)j->k + off[J_K], *v = (const AT *)j->v + off[J_V];
    const AT *o = (const AT *)j->o + off[J_O], *g = (const AT *)j->dout + off[J_DO];
    AT *gq = (AT *)j->out + bh * T * D, *gk = (AT *)j->out + j->nb * T * D + bh * S * D;
    AT *gv = (AT *)j->out + j->nb * (T * D + S * D) + bh * S * E;
    for (int64_t c = 0; c < Sp; c++) {
      AT *kt = kT + (c / BC) * D * BC + c % BC, *vt = vT + (c / BC) * E * BC + c % BC;
      for (int64_t d = 0; d < D; d++) kt[d * BC] = c < S ? k[c * j->krs + d] : 0;
      for (int64_t x = 0; x < E; x++) vt[x * BC] = c < S ? v[c * j->vrs + x] : 0;
      for (int64_t d = 0; d < Dp; d++) kr[c * Dp + d] = c < S && d < D ? k[c * j->krs + d] : 0;
    }
    memset(dk, 0, sizeof(AT) * (size_t)(Sp * Dp));
    memset(dv, 0, sizeof(AT) * (size_t)(Sp * Ep));
    for (int64_t r0 = 0; r0 < T; r0 += ATTN_BR) {
      int64_t nr = T - r0 < ATTN_BR ? T - r0 : ATTN_BR;
      for (int64_t r = 0; r < nr; r++) {
        const AT *qr = q + (r0 + r) * j->qrs, *gr = g + (r0 + r) * j->do_rs, *orow = o + (r0 + r) * j->o_rs;
        AT delta = 0;
        for (int64_t d = 0; d < Dp; d++) qs[r * Dp + d] = d < D ? qr[d] * scale : 0;
        for (int64_t x = 0; x < Ep; x++) dO[r * Ep + x] = x < E ? gr[x] : 0;
        for (int64_t x = 0; x < E; x++) delta += gr[x] * orow[x];
        dl[r] = delta, m[r] = -INFINITY, l[r] = 0;
      }
      memset(dq, 0, sizeof(AT) * (size_t)(nr * Dp));
      for (int64_t c0 = 0; c0 < S; c0 += BC) { /* each row's logsumexp, as the forward's online softmax */
        int64_t nc = S - c0 < BC ? S - c0 : BC, nv = (nc + LN - 1) / LN;
        int mode = attn_tile_mode(j, off[J_MASK], r0, nr, c0, nc);
        if (mode == TILE_SKIP) continue;
        for (int64_t r = 0; r < nr; r++) {
          int64_t n = FN(row_vectors)(j, off[J_MASK], mode, r0 + r, c0, nc, nv);
          if (!n) continue;
          FN(bwd_scores)(j, off[J_MASK], mode, qs + r * Dp, kT + (c0 / BC) * D * BC, r0 + r, c0, nc, n, sb);
          AT mx = FN(row_max)(sb, n), mn = mx > m[r] ? mx : m[r];
          if (mn == -INFINITY) continue;
          l[r] = l[r] * AT_EXP(m[r] - mn) + FN(row_exp)(sb, n, mn);
          m[r] = mn;
        }
      }
      for (int64_t r = 0; r < nr; r++) m[r] += AT_LOG(l[r]);
      for (int64_t c0 = 0; c0 < S; c0 += BC) {
        int64_t nc = S - c0 < BC ? S - c0 : BC, nv = (nc + LN - 1) / LN;
        int mode = attn_tile_mode(j, off[J_MASK], r0, nr, c0, nc);
        if (mode == TILE_SKIP) continue;
        for (int64_t x = 0; x < nv; x++) first[x] = nr;
        for (int64_t r = nr - 1; r >= 0; r--) {
          AT *p = pb + r * BC, *ds = sb + r * BC;
          int64_t n = nvr[r] = FN(row_vectors)(j, off[J_MASK], mode, r0 + r, c0, nc, nv);
          for (int64_t x = 0; x < n; x++) first[x] = r;
          memset(p + n * LN, 0, sizeof(AT) * (size_t)((nv - n) * LN));
          memset(ds, 0, sizeof(AT) * (size_t)(nv * LN));
          if (!n) continue;
          FN(bwd_scores)(j, off[J_MASK], mode, qs + r * Dp, kT + (c0 / BC) * D * BC, r0 + r, c0, nc, n, p);
          AT lse = m[r];
          for (int64_t c = 0; c < n * LN; c++) p[c] = AT_EXP(p[c] - lse); /* -inf past nc: 0 */
          FN(axpy)(ds, dO + r * Ep, 1, E, vT + (c0 / BC) * E * BC, BC, n);
          AT dlr = dl[r];
          for (int64_t c = 0; c < n * LN; c++) ds[c] = p[c] * (ds[c] - dlr);
        }
        /* the rows before a column's first are 0 there: left out; four
         * columns (rows of dq) at a time, in the same order of terms */
        int64_t c = 0;
        for (; c + 4 <= nc; c += 4) { /* LN is a multiple of 4: one vector's first */
          int64_t f = first[c / LN];
          FN(axpy4)(dv + (c0 + c) * Ep, Ep, pb + f * BC + c, 1, BC, nr - f, dO + f * Ep, Ep, nve);
          FN(axpy4)(dk + (c0 + c) * Dp, Dp, sb + f * BC + c, 1, BC, nr - f, qs + f * Dp, Dp, nvd);
        }
        for (; c < nc; c++) {
          int64_t f = first[c / LN];
          FN(axpy)(dv + (c0 + c) * Ep, pb + f * BC + c, BC, nr - f, dO + f * Ep, Ep, nve);
          FN(axpy)(dk + (c0 + c) * Dp, sb + f * BC + c, BC, nr - f, qs + f * Dp, Dp, nvd);
        }
        int64_t r = 0;
        for (; r + 4 <= nr; r += 4) { /* ds is 0 past a row's vectors: the longest of the four */
          int64_t n = 0;
          for (int64_t y = r; y < r + 4; y++) n = nvr[y] * LN > n ? nvr[y] * LN : n;
          FN(axpy4)(dq + r * Dp, Dp, sb + r * BC, BC, 1, n < nc ? n : nc, kr + c0 * Dp, Dp, nvd);
        }
        for (; r < nr; r++) {
          int64_t n = nvr[r] * LN < nc ? nvr[r] * LN : nc;
          FN(axpy)(dq + r * Dp, sb + r * BC, 1, n, kr + c0 * Dp, Dp, nvd);
        }
      }
      for (int64_t r = 0; r < nr; r++)
        for (int64_t d = 0; d < D; d++) gq[(r0 + r) * D + d] = dq[r * Dp + d] * scale;
    }
    for (int64_t c = 0; c < S; c++) {
      for (int64_t d = 0; d < D; d++) gk[c * D + d] = dk[c * Dp + d];
      for (int64_t x = 0; x < E; x++) gv[c * E + x] = dv[c * Ep + x];
    }
  }
}

/* ---- the decode form: a few query rows, k and v read in place ---- */

/* The sum of v's lanes, halves added to halves down to 16 bytes: summing
 * lane by lane is a chain LN adds deep, through the stack. */
AI AT FN(hsum)(FN(vec) v) {
  typedef AT v16 __attribute__((vector_size(16)));
  v16 x, y;
#if AT_VB == 64
  typedef AT v32 __attribute__((vector_size(32)));
  v32 a, b;
  memcpy(&a, &v, 32);
  memcpy(&b, (const char *)&v + 32, 32);
  a += b;
  memcpy(&x, &a, 16);
  memcpy(&y, (const char *)&a + 16, 16);
  x += y;
#elif AT_VB == 32
  memcpy(&x, &v, 16);
  memcpy(&y, (const char *)&v + 16, 16);
  x += y;
#else
  memcpy(&x, &v, 16);
#endif
  (void)y;
  AT r = x[0];
  for (int i = 1; i < (int)(16 / sizeof(AT)); i++) r += x[i];
  return r;
}

/* s[0..n) = q . k[c] over rows c < n of k (krs apart), D long: four rows at
 * a time, each with its own accumulators. */
AI void FN(dots)(const AT *q, int64_t D, const AT *k, int64_t krs, int64_t n, AT *s) {
  int64_t dv = D / LN * LN, c = 0;
  for (; c < n; c += 4) {
    int nk = n - c < 4 ? (int)(n - c) : 4;
    const AT *kr[4];
    for (int i = 0; i < 4; i++) kr[i] = k + (c + (i < nk ? i : 0)) * krs;
    FN(vec) acc[4] = {0};
    for (int64_t d = 0; d < dv; d += LN) {
      FN(vec) qv = *(const FN(vec) *)(q + d);
      for (int i = 0; i < 4; i++) acc[i] += qv * *(const FN(vec) *)(kr[i] + d);
    }
    for (int i = 0; i < nk; i++) {
      AT t = FN(hsum)(acc[i]);
      for (int64_t d = dv; d < D; d++) t += q[d] * kr[i][d];
      s[c + i] = t;
    }
  }
}

/* o[0..E) += sum over c < n of p[c] * v[c*vrs ..]: whole vectors four at a
 * time (axpy_nv), the tail past them by elements. */
AI void FN(pv_rows)(AT *o, const AT *p, int64_t n, const AT *v, int64_t vrs, int64_t E) {
  int64_t x = 0;
  for (; x + 4 * LN <= E; x += 4 * LN) FN(axpy_nv)(o + x, p, 1, n, v + x, vrs, 4);
  int64_t left = (E - x) / LN;
  if (left == 3) FN(axpy_nv)(o + x, p, 1, n, v + x, vrs, 3);
  else if (left == 2) FN(axpy_nv)(o + x, p, 1, n, v + x, vrs, 2);
  else if (left == 1) FN(axpy_nv)(o + x, p, 1, n, v + x, vrs, 1);
  for (x += left * LN; x < E; x++) {
    AT t = o[x];
    for (int64_t c = 0; c < n; c++) t += p[c] * v[c * vrs + x];
    o[x] = t;
  }
}

/* Asks for rows [0, n) of x (ld apart, len elements each) to be brought
 * into cache: a KV cache the weights streamed past has left memory, and a
 * walk down one head's rows (a stride of all heads' width) is a pattern the
 * hardware prefetchers follow too slowly. */
AI void FN(prefetch_rows)(const AT *x, int64_t ld, int64_t n, int64_t len) {
  for (int64_t c = 0; c < n; c++)
    for (int64_t d = 0; d < len; d += 64 / (int64_t)sizeof(AT)) __builtin_prefetch(x + c * ld + d);
}

/* One decode task's row in its group (attn_dec_rows). */
typedef struct FN(dec_row) {
  const AT *k, *v;    /* the entry's k and v */
  AT *out;            /* its output row */
  int64_t mo, r;      /* the mask's offset for the entry, the query row */
  AT *qs, *s, *acc;   /* working memory: q scaled (D), scores (S), output (E) */
  uint8_t *mode;      /* per key block: attn_tile_mode's answer */
  AT mx, l;           /* the max of the scores, the sum of their exps */
} FN(dec_row);

/* Tasks [b, e) of j's decode form, one query row of one batch entry each,
 * ws the chunk's working memory (attn_dec_ws_elems), ATTN_DEC_GROUP rows at
 * a time. Three passes over the key blocks of ATTN_DEC_BLK columns, each
 * skipping a row's blocks whose mask drops every entry (past the position
 * of a KV cache): the scores and their max, their exps and sum, then p @ v.
 * k and v are read in place (packing them would cost as much as the row's
 * work), and the group's rows walk the blocks together: the heads of a
 * (S, H*hs) cache are one stretch of memory a block, where one head at a
 * time would stride through it H times. */
AT_TARGET static void FN(attn_dec_rows)(const attn_job *j, int64_t b, int64_t e, AT *ws) {
  const int64_t D = j->D, E = j->E, T = j->T, S = j->S, nblk = (S + ATTN_DEC_BLK - 1) / ATTN_DEC_BLK;
  const AT scale = (AT)j->scale;
  FN(dec_row) rows[ATTN_DEC_GROUP];
  for (int64_t g0 = b; g0 < e; g0 += ATTN_DEC_GROUP) {
    int n = e - g0 < ATTN_DEC_GROUP ? (int)(e - g0) : ATTN_DEC_GROUP;
    for (int i = 0; i < n; i++) {
      FN(dec_row) *w = &rows[i];
      int64_t bh = (g0 + i) / T, off[J_N];
      w->r = (g0 + i) % T;
      attn_offsets(j, bh, off);
      w->k = (const AT *)j->k + off[J_K], w->v = (const AT *)j->v + off[J_V];
      w->out = (AT *)j->out + off[J_OUT] + w->r * j->ors;
      w->mo = off[J_MASK];
      w->qs = ws + i * attn_dec_row_elems(j);
      w->s = w->qs + D, w->acc = w->s + S, w->mode = (uint8_t *)(w->acc + E);
      const AT *q = (const AT *)j->q + off[J_Q] + w->r * j->qrs;
      for (int64_t d = 0; d < D; d++) w->qs[d] = q[d] * scale;
      memset(w->acc, 0, sizeof(AT) * (size_t)E);
      w->mx = -INFINITY, w->l = 0;
    }
    for (int64_t x = 0; x < nblk; x++) {
      int64_t c0 = x * ATTN_DEC_BLK, nc = S - c0 < ATTN_DEC_BLK ? S - c0 : ATTN_DEC_BLK;
      for (int i = 0; i < n; i++) {
        FN(dec_row) *w = &rows[i];
        int mode = w->mode[x] = (uint8_t)attn_tile_mode(j, w->mo, w->r, 1, c0, nc);
        if (mode == TILE_SKIP) continue;
        /* the next block's keys (kept, or a few lines for nothing) and this block's values */
        int64_t nn = S - c0 - nc < ATTN_DEC_BLK ? S - c0 - nc : ATTN_DEC_BLK;
        FN(prefetch_rows)(w->k + (c0 + nc) * j->krs, j->krs, nn, D);
        FN(prefetch_rows)(w->v + c0 * j->vrs, j->vrs, nc, E);
        AT *sc = w->s + c0;
        FN(dots)(w->qs, D, w->k + c0 * j->krs, j->krs, nc, sc);
        if (mode == TILE_MASK) {
          const bool *mk = (const bool *)j->mask + w->mo + w->r * j->mrs + c0 * j->mcs;
          for (int64_t c = 0; c < nc; c++)
            if (mk[c * j->mcs] == j->drop) sc[c] = -INFINITY;
        } else if (mode == TILE_ADD) {
          const AT *mk = (const AT *)j->mask + w->mo + w->r * j->mrs + c0 * j->mcs;
          for (int64_t c = 0; c < nc; c++) sc[c] += mk[c * j->mcs];
        }
        for (int64_t c = 0; c < nc; c++) w->mx = sc[c] > w->mx ? sc[c] : w->mx;
      }
    }
    /* a row whose max is -inf keeps nothing: its sum stays 0, and 0/0 below is NaN, as the unfused softmax gives */
    for (int i = 0; i < n; i++) {
      FN(dec_row) *w = &rows[i];
      for (int64_t x = 0; x < nblk && w->mx != -INFINITY; x++) {
        if (w->mode[x] == TILE_SKIP) continue;
        int64_t c0 = x * ATTN_DEC_BLK, nc = S - c0 < ATTN_DEC_BLK ? S - c0 : ATTN_DEC_BLK;
        AT *sc = w->s + c0, l = 0;
        for (int64_t c = 0; c < nc; c++) sc[c] = AT_EXP(sc[c] - w->mx);
        for (int64_t c = 0; c < nc; c++) l += sc[c];
        w->l += l;
      }
    }
    for (int64_t x = 0; x < nblk; x++) {
      int64_t c0 = x * ATTN_DEC_BLK, nc = S - c0 < ATTN_DEC_BLK ? S - c0 : ATTN_DEC_BLK;
      for (int i = 0; i < n; i++) {
        FN(dec_row) *w = &rows[i];
        if (w->mode[x] != TILE_SKIP && w->mx != -INFINITY)
          FN(pv_rows)(w->acc, w->s + c0, nc, w->v + c0 * j->vrs, j->vrs, E);
      }
    }
    for (int i = 0; i < n; i++) {
      AT inv = 1 / rows[i].l;
      for (int64_t x = 0; x < E; x++) rows[i].out[x * j->ocs] = rows[i].acc[x] * inv;
    }
  }
}

#undef AT_CAT2
#undef AT_CAT
#undef FN
#undef LN
#undef BC
#undef CV
#undef AI
