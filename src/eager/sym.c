/* Symbolic dims: hash-consed canonical expressions over bounded symbols,
 * their bounds, evaluation, text form and guards (see sym.h).
 *
 * Canonical form. A non-constant dim is one of
 *   an atom:    s<id>, FLOOR(n, d) = n // d, MOD(n, d) = n % d
 *               (n an expression or a constant, d a constant >= 2 or an
 *               expression with bounds >= 1);
 *   a product:  two or more atoms, sorted (repeats allowed), coefficient 1;
 *   a sum:      constant + sum of coef*mono (mono an atom or a product),
 *               coefs nonzero, monos distinct and sorted, and not a lone
 *               mono with coefficient 1 and constant 0.
 * The order of atoms and monos is structural (never by address), so the
 * text of a dim does not depend on the order things were made in.
 *
 * Text grammar (sym_print writes it, sym_parse reads it):
 *   guard  := expr ('==' | '!=' | '<' | '<=' | '>=' | '>') expr
 *   expr   := term (('+' | '-') term)*
 *   term   := factor (('*' | '//' | '%') factor)*     left to right, as in Python
 *   factor := INT | 's' DIGITS | '(' expr ')' | '-' factor
 * INT is a decimal that fits int64; '-' before digits reads a negative
 * literal, so INT64_MIN reads back. Blanks between tokens are ignored.
 * Printed: monos in canonical order, the constant last; FLOOR/MOD inside a
 * product or after a coefficient in parentheses; a numerator or divisor
 * other than a symbol or constant in parentheses:
 *   2*s0*s1 - s0 + 3   (s0*s1)//4   s0 % 4   2*(s0//4)   (s0 + 1) % 4 == 0
 * A guard `E % F == 0` (one term, last operator %) reads as SYM_DIVIDES(E, F).
 *
 * Bounds hold for every value where evaluation succeeds: sym_eval checks
 * each product and sum step, so every step's value is an int64 and clamping
 * each step's interval to int64 stays sound. Intervals are computed in
 * 128-bit integers so no step overflows. */
#include "eager/sym.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "eager/eager.h"
#include "rt/plan.h"

typedef __int128 i128;

typedef enum kind { K_VAR, K_FLOOR, K_MOD, K_PROD, K_SUM } kind;

typedef struct term {
  int64_t coef;
  const sym_expr *mono; /* an atom or a product */
} term;

struct sym_expr {
  kind k;
  int n;                        /* SUM: terms; PROD: atoms */
  int depth;                    /* 1 for a symbol */
  int id;                       /* VAR */
  int64_t c;                    /* SUM: constant; FLOOR/MOD: divisor when b is NULL */
  int64_t ac;                   /* FLOOR/MOD: numerator when a is NULL */
  const sym_expr *a, *b;        /* FLOOR/MOD: numerator, divisor */
  int64_t lo, hi;               /* bounds (inclusive) */
  const term *terms;            /* SUM, sorted by mono */
  const sym_expr *const *atoms; /* PROD, sorted */
  uint64_t hash;
  sym_expr *next; /* hash chain */
};

struct sym_ctx {
  sym_expr **bucket; /* power-of-two count */
  size_t nbucket, count;
  const char *err;
};

static const sym_expr err_node = {.k = K_VAR};

static const char *const E_OOM = "out of memory";
static const char *const E_OVF = "integer overflow";
static const char *const E_BIG = "expression too large";
static const char *const E_DEEP = "expression nested too deeply";
static const char *const E_DIV = "divisor not provably positive";

sym_dim sym_error(void) { return (sym_dim){0, &err_node}; }
bool sym_is_err(sym_dim d) { return d.e == &err_node; }

bool sym_same(sym_dim a, sym_dim b)
{
  if (sym_is_err(a) || sym_is_err(b)) return false;
  return a.e == b.e && (a.e != NULL || a.c == b.c);
}

static sym_dim fail(sym_ctx *ctx, const char *why)
{
  if (ctx) ctx->err = why;
  return sym_error();
}

static sym_dim expr_dim(const sym_expr *e) { return (sym_dim){0, e}; }

/* ---- integers -------------------------------------------------------- */

/* Floor division and modulo by k >= 1 (never overflow). */
static int64_t fdiv(int64_t a, int64_t k)
{
  int64_t q = a / k;
  if (a % k != 0 && a < 0) q--;
  return q;
}

static int64_t fmod64(int64_t a, int64_t k)
{
  int64_t r = a % k;
  return r < 0 ? r + k : r;
}

static int64_t clamp64(i128 v)
{
  if (v > INT64_MAX) return INT64_MAX;
  if (v < INT64_MIN) return INT64_MIN;
  return (int64_t)v;
}

static uint64_t uabs(int64_t v) { return v < 0 ? 0 - (uint64_t)v : (uint64_t)v; }

static uint64_t gcd_u(uint64_t a, uint64_t b)
{
  while (b) {
    uint64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

static i128 min4(i128 a, i128 b, i128 c, i128 d)
{
  i128 m = a < b ? a : b;
  if (c < m) m = c;
  return d < m ? d : m;
}

static i128 max4(i128 a, i128 b, i128 c, i128 d)
{
  i128 m = a > b ? a : b;
  if (c > m) m = c;
  return d > m ? d : m;
}

/* ---- order ----------------------------------------------------------- */

static int cmp_expr(const sym_expr *x, const sym_expr *y);

static int atom_count(const sym_expr *m) { return m->k == K_PROD ? m->n : 1; }
static const sym_expr *atom_at(const sym_expr *m, int i) { return m->k == K_PROD ? m->atoms[i] : m; }

static int cmp_i64(int64_t a, int64_t b) { return (a > b) - (a < b); }

/* A constant part (e == NULL) sorts before any expression. */
static int cmp_part(const sym_expr *x, int64_t xc, const sym_expr *y, int64_t yc)
{
  if (!x || !y) return x ? 1 : y ? -1 : cmp_i64(xc, yc);
  return cmp_expr(x, y);
}

static int cmp_atom(const sym_expr *x, const sym_expr *y)
{
  if (x == y) return 0;
  if (x->k != y->k) return x->k < y->k ? -1 : 1;
  if (x->k == K_VAR) return x->id < y->id ? -1 : 1;
  int r = cmp_part(x->a, x->ac, y->a, y->ac);
  return r ? r : cmp_part(x->b, x->c, y->b, y->c);
}

/* Monos compare by degree, higher first (s0*s1 + s0), then as sorted atom lists. */
static int cmp_mono(const sym_expr *x, const sym_expr *y)
{
  if (x == y) return 0;
  int nx = atom_count(x), ny = atom_count(y);
  if (nx != ny) return nx > ny ? -1 : 1;
  for (int i = 0; i < nx; i++) {
    int r = cmp_atom(atom_at(x, i), atom_at(y, i));
    if (r) return r;
  }
  return 0;
}

static int cmp_expr(const sym_expr *x, const sym_expr *y)
{
  if (x == y) return 0;
  int sx = x->k == K_SUM, sy = y->k == K_SUM;
  if (sx != sy) return sx - sy;
  if (!sx) return cmp_mono(x, y);
  int r = cmp_i64(x->c, y->c);
  for (int i = 0; !r && i < x->n && i < y->n; i++) {
    r = cmp_mono(x->terms[i].mono, y->terms[i].mono);
    if (!r) r = cmp_i64(x->terms[i].coef, y->terms[i].coef);
  }
  return r ? r : (x->n > y->n) - (x->n < y->n);
}

/* ---- the context and interning --------------------------------------- */

sym_ctx *sym_ctx_new(void)
{
  sym_ctx *ctx = alloc_calloc(1, sizeof *ctx);
  if (!ctx) return NULL;
  ctx->nbucket = 256;
  ctx->bucket = alloc_calloc(ctx->nbucket, sizeof *ctx->bucket);
  if (!ctx->bucket) {
    alloc_free(ctx);
    return NULL;
  }
  ctx->err = "";
  return ctx;
}

void sym_ctx_free(sym_ctx *ctx)
{
  if (!ctx) return;
  for (size_t i = 0; i < ctx->nbucket; i++)
    for (sym_expr *x = ctx->bucket[i], *nx; x; x = nx) {
      nx = x->next;
      alloc_free(x);
    }
  alloc_free(ctx->bucket);
  alloc_free(ctx);
}

const char *sym_ctx_error(const sym_ctx *ctx) { return ctx ? ctx->err : "no context"; }

static uint64_t mix(uint64_t h, uint64_t v)
{
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdull;
}

/* Children are interned, so their addresses identify them. */
static uint64_t node_hash(const sym_expr *x)
{
  uint64_t h = mix((uint64_t)x->k, (uint64_t)x->n);
  h = mix(h, (uint64_t)x->id);
  h = mix(h, (uint64_t)x->c);
  h = mix(h, (uint64_t)x->ac);
  h = mix(h, (uint64_t)(uintptr_t)x->a);
  h = mix(h, (uint64_t)(uintptr_t)x->b);
  if (x->k == K_SUM)
    for (int i = 0; i < x->n; i++) h = mix(mix(h, (uint64_t)x->terms[i].coef), (uint64_t)(uintptr_t)x->terms[i].mono);
  if (x->k == K_PROD)
    for (int i = 0; i < x->n; i++) h = mix(h, (uint64_t)(uintptr_t)x->atoms[i]);
  return h;
}

/* Same node; a symbol is known by its id alone. */
static bool node_same(const sym_expr *x, const sym_expr *y)
{
  if (x->k != y->k || x->n != y->n || x->id != y->id || x->c != y->c || x->ac != y->ac || x->a != y->a ||
      x->b != y->b)
    return false;
  if (x->k == K_SUM)
    for (int i = 0; i < x->n; i++)
      if (x->terms[i].coef != y->terms[i].coef || x->terms[i].mono != y->terms[i].mono) return false;
  if (x->k == K_PROD)
    for (int i = 0; i < x->n; i++)
      if (x->atoms[i] != y->atoms[i]) return false;
  return true;
}

static sym_expr *find(const sym_ctx *ctx, sym_expr *key)
{
  key->hash = node_hash(key);
  for (sym_expr *x = ctx->bucket[key->hash & (ctx->nbucket - 1)]; x; x = x->next)
    if (x->hash == key->hash && node_same(x, key)) return x;
  return NULL;
}

static void grow(sym_ctx *ctx)
{
  size_t n = ctx->nbucket * 2;
  sym_expr **b = alloc_calloc(n, sizeof *b);
  if (!b) return; /* longer chains, still correct */
  for (size_t i = 0; i < ctx->nbucket; i++)
    for (sym_expr *x = ctx->bucket[i], *nx; x; x = nx) {
      nx = x->next;
      x->next = b[x->hash & (n - 1)];
      b[x->hash & (n - 1)] = x;
    }
  alloc_free(ctx->bucket);
  ctx->bucket = b;
  ctx->nbucket = n;
}

/* Interval of a part (an expression or the constant c). */
static void part_bounds(const sym_expr *e, int64_t c, int64_t *lo, int64_t *hi)
{
  *lo = e ? e->lo : c;
  *hi = e ? e->hi : c;
}

static int part_depth(const sym_expr *e) { return e ? e->depth : 0; }

/* Depth and bounds of a new node from its children. */
static void node_info(sym_expr *x)
{
  int d = 0;
  i128 lo = 0, hi = 0;
  switch (x->k) {
  case K_VAR:
    return;
  case K_PROD:
    lo = hi = 1;
    for (int i = 0; i < x->n; i++) {
      const sym_expr *f = x->atoms[i];
      if (f->depth > d) d = f->depth;
      i128 a = lo * f->lo, b = lo * f->hi, c = hi * f->lo, e = hi * f->hi;
      lo = clamp64(min4(a, b, c, e));
      hi = clamp64(max4(a, b, c, e));
    }
    break;
  case K_SUM:
    lo = hi = x->c;
    for (int i = 0; i < x->n; i++) {
      const term *t = &x->terms[i];
      if (t->mono->depth > d) d = t->mono->depth;
      i128 a = (i128)t->coef * t->mono->lo, b = (i128)t->coef * t->mono->hi;
      lo += clamp64(a < b ? a : b);
      hi += clamp64(a < b ? b : a);
    }
    break;
  case K_FLOOR:
  case K_MOD: {
    int64_t alo, ahi, blo, bhi;
    part_bounds(x->a, x->ac, &alo, &ahi);
    part_bounds(x->b, x->c, &blo, &bhi);
    d = part_depth(x->a) > part_depth(x->b) ? part_depth(x->a) : part_depth(x->b);
    if (x->k == K_FLOOR) {
      /* floor(a/b) is monotone in a and in b (b >= 1): the corners bound it */
      int64_t q[4] = {fdiv(alo, blo), fdiv(alo, bhi), fdiv(ahi, blo), fdiv(ahi, bhi)};
      lo = min4(q[0], q[1], q[2], q[3]);
      hi = max4(q[0], q[1], q[2], q[3]);
    } else {
      lo = 0;
      hi = bhi - 1;
      if (alo >= 0 && ahi < hi) hi = ahi;
    }
    break;
  }
  }
  x->depth = d + 1;
  x->lo = clamp64(lo);
  x->hi = clamp64(hi);
}

/* The interned node equal to key (which may point at temporary arrays);
 * NULL with ctx->err set on failure. */
static const sym_expr *intern(sym_ctx *ctx, sym_expr key)
{
  sym_expr *x = find(ctx, &key);
  if (x) return x;
  node_info(&key);
  if (key.depth > SYM_MAX_DEPTH) {
    ctx->err = E_DEEP;
    return NULL;
  }
  size_t extra = key.k == K_SUM ? (size_t)key.n * sizeof(term)
               : key.k == K_PROD ? (size_t)key.n * sizeof(sym_expr *)
                                 : 0;
  x = alloc_malloc(sizeof *x + extra);
  if (!x) {
    ctx->err = E_OOM;
    return NULL;
  }
  *x = key;
  if (key.k == K_SUM) {
    memcpy(x + 1, key.terms, extra);
    x->terms = (const term *)(x + 1);
  } else if (key.k == K_PROD) {
    memcpy(x + 1, key.atoms, extra);
    x->atoms = (const sym_expr *const *)(x + 1);
  }
  size_t i = x->hash & (ctx->nbucket - 1);
  x->next = ctx->bucket[i];
  ctx->bucket[i] = x;
  if (++ctx->count > ctx->nbucket) grow(ctx);
  return x;
}

sym_dim sym_var(sym_ctx *ctx, int id, int64_t lo, int64_t hi)
{
  if (!ctx) return sym_error();
  if (id < 0 || id >= SYM_MAX_ID) return fail(ctx, "symbol id out of range");
  if (lo > hi) return fail(ctx, "symbol bounds are empty");
  sym_expr key = {.k = K_VAR, .id = id, .lo = lo, .hi = hi, .depth = 1};
  const sym_expr *x = find(ctx, &key);
  if (x) return x->lo == lo && x->hi == hi ? expr_dim(x) : fail(ctx, "symbol declared again with other bounds");
  x = intern(ctx, key);
  return x ? expr_dim(x) : sym_error();
}

/* The symbol s<id>, declared with the default bounds if it is new. */
static sym_dim var_or_default(sym_ctx *ctx, int id)
{
  sym_expr key = {.k = K_VAR, .id = id};
  const sym_expr *x = find(ctx, &key);
  return x ? expr_dim(x) : sym_var(ctx, id, SYM_DEFAULT_LO, SYM_DEFAULT_HI);
}

/* ---- polynomials: the working form of sums ----------------------------- */

typedef struct poly {
  int64_t c;
  int n;
  term t[SYM_MAX_TERMS];
} poly;

/* A read-only view of d's terms; one is storage for a lone mono. */
static const term *dim_terms(sym_dim d, int64_t *c, int *n, term *one)
{
  if (!d.e) {
    *c = d.c;
    *n = 0;
    return one;
  }
  if (d.e->k == K_SUM) {
    *c = d.e->c;
    *n = d.e->n;
    return d.e->terms;
  }
  *c = 0;
  *n = 1;
  *one = (term){1, d.e};
  return one;
}

static int poly_add_const(sym_ctx *ctx, poly *p, int64_t c)
{
  if (__builtin_add_overflow(p->c, c, &p->c)) {
    ctx->err = E_OVF;
    return -1;
  }
  return 0;
}

/* p += coef*mono, keeping the terms sorted and nonzero. 0 or -1. */
static int poly_add_term(sym_ctx *ctx, poly *p, int64_t coef, const sym_expr *mono)
{
  if (coef == 0) return 0;
  int lo = 0, hi = p->n;
  while (lo < hi) {
    int mid = (lo + hi) / 2, r = cmp_mono(p->t[mid].mono, mono);
    if (r == 0) {
      if (__builtin_add_overflow(p->t[mid].coef, coef, &p->t[mid].coef)) {
        ctx->err = E_OVF;
        return -1;
      }
      if (p->t[mid].coef == 0) {
        memmove(&p->t[mid], &p->t[mid + 1], (size_t)(p->n - mid - 1) * sizeof(term));
        p->n--;
      }
      return 0;
    }
    if (r < 0) lo = mid + 1;
    else hi = mid;
  }
  if (p->n == SYM_MAX_TERMS) {
    ctx->err = E_BIG;
    return -1;
  }
  memmove(&p->t[lo + 1], &p->t[lo], (size_t)(p->n - lo) * sizeof(term));
  p->t[lo] = (term){coef, mono};
  p->n++;
  return 0;
}

/* p += s*d. 0 or -1. */
static int poly_add_scaled(sym_ctx *ctx, poly *p, sym_dim d, int64_t s)
{
  int64_t c, v;
  int n;
  term one;
  const term *t = dim_terms(d, &c, &n, &one);
  if (__builtin_mul_overflow(c, s, &v) || poly_add_const(ctx, p, v)) {
    ctx->err = E_OVF;
    return -1;
  }
  for (int i = 0; i < n; i++)
    if (__builtin_mul_overflow(t[i].coef, s, &v) || poly_add_term(ctx, p, v, t[i].mono)) {
      if (ctx->err != E_BIG) ctx->err = E_OVF;
      return -1;
    }
  return 0;
}

static sym_dim poly_build(sym_ctx *ctx, const poly *p)
{
  if (p->n == 0) return sym_const(p->c);
  if (p->n == 1 && p->t[0].coef == 1 && p->c == 0) return expr_dim(p->t[0].mono);
  const sym_expr *x = intern(ctx, (sym_expr){.k = K_SUM, .n = p->n, .c = p->c, .terms = p->t});
  return x ? expr_dim(x) : sym_error();
}

/* The mono x*y (merged sorted atom lists); NULL on failure. */
static const sym_expr *mono_mul(sym_ctx *ctx, const sym_expr *x, const sym_expr *y)
{
  int nx = atom_count(x), ny = atom_count(y), i = 0, j = 0, n = 0;
  if (nx + ny > SYM_MAX_ATOMS) {
    ctx->err = E_BIG;
    return NULL;
  }
  const sym_expr *buf[SYM_MAX_ATOMS];
  while (i < nx || j < ny) {
    if (j == ny || (i < nx && cmp_atom(atom_at(x, i), atom_at(y, j)) <= 0)) buf[n++] = atom_at(x, i++);
    else buf[n++] = atom_at(y, j++);
  }
  return intern(ctx, (sym_expr){.k = K_PROD, .n = n, .atoms = buf});
}

/* Whether every atom of d (with repeats) occurs in m. */
static bool mono_contains(const sym_expr *m, const sym_expr *d)
{
  int nm = atom_count(m), nd = atom_count(d), j = 0;
  for (int i = 0; i < nm && j < nd; i++) {
    int r = cmp_atom(atom_at(m, i), atom_at(d, j));
    if (r == 0) j++;
    else if (r > 0) return false; /* d's atom j is not in m */
  }
  return j == nd;
}

/* m / d where mono_contains(m, d): *q is the rest, NULL when nothing is
 * left. 0 or -1. */
static int mono_quot(sym_ctx *ctx, const sym_expr *m, const sym_expr *d, const sym_expr **q)
{
  const sym_expr *buf[SYM_MAX_ATOMS];
  int nm = atom_count(m), nd = atom_count(d), j = 0, n = 0;
  for (int i = 0; i < nm; i++) {
    if (j < nd && atom_at(m, i) == atom_at(d, j)) j++;
    else buf[n++] = atom_at(m, i);
  }
  *q = n == 0 ? NULL : n == 1 ? buf[0] : intern(ctx, (sym_expr){.k = K_PROD, .n = n, .atoms = buf});
  return n > 1 && !*q ? -1 : 0;
}

/* ---- arithmetic -------------------------------------------------------- */

sym_dim sym_add(sym_ctx *ctx, sym_dim a, sym_dim b)
{
  if (sym_is_err(a) || sym_is_err(b)) return sym_error();
  if (!a.e && !b.e) {
    int64_t v;
    return __builtin_add_overflow(a.c, b.c, &v) ? fail(ctx, E_OVF) : sym_const(v);
  }
  if (!ctx) return sym_error();
  poly p; /* only t[0, n) is read: zeroing all of t cost most of a call */
  p.c = 0, p.n = 0;
  if (poly_add_scaled(ctx, &p, a, 1) || poly_add_scaled(ctx, &p, b, 1)) return sym_error();
  return poly_build(ctx, &p);
}

sym_dim sym_sub(sym_ctx *ctx, sym_dim a, sym_dim b)
{
  if (sym_is_err(a) || sym_is_err(b)) return sym_error();
  if (!a.e && !b.e) {
    int64_t v;
    return __builtin_sub_overflow(a.c, b.c, &v) ? fail(ctx, E_OVF) : sym_const(v);
  }
  if (!ctx) return sym_error();
  poly p;
  p.c = 0, p.n = 0;
  if (poly_add_scaled(ctx, &p, a, 1) || poly_add_scaled(ctx, &p, b, -1)) return sym_error();
  return poly_build(ctx, &p);
}

sym_dim sym_mul(sym_ctx *ctx, sym_dim a, sym_dim b)
{
  if (sym_is_err(a) || sym_is_err(b)) return sym_error();
  if (!a.e && !b.e) {
    int64_t v;
    return __builtin_mul_overflow(a.c, b.c, &v) ? fail(ctx, E_OVF) : sym_const(v);
  }
  if (!ctx) return sym_error();
  poly p;
  p.c = 0, p.n = 0;
  if (!a.e || !b.e) {
    if (poly_add_scaled(ctx, &p, a.e ? a : b, a.e ? b.c : a.c)) return sym_error();
    return poly_build(ctx, &p);
  }
  int64_t ca, cb;
  int na, nb;
  term oa, ob;
  const term *ta = dim_terms(a, &ca, &na, &oa), *tb = dim_terms(b, &cb, &nb, &ob);
  /* index n stands for the constant term (mono NULL) */
  for (int i = 0; i <= na; i++)
    for (int j = 0; j <= nb; j++) {
      int64_t x = i < na ? ta[i].coef : ca, y = j < nb ? tb[j].coef : cb, v;
      const sym_expr *mx = i < na ? ta[i].mono : NULL, *my = j < nb ? tb[j].mono : NULL;
      if (__builtin_mul_overflow(x, y, &v)) return fail(ctx, E_OVF);
      if (v == 0) continue;
      if (!mx && !my) {
        if (poly_add_const(ctx, &p, v)) return sym_error();
        continue;
      }
      const sym_expr *m = !mx ? my : !my ? mx : mono_mul(ctx, mx, my);
      if (!m || poly_add_term(ctx, &p, v, m)) return sym_error();
    }
  return poly_build(ctx, &p);
}

/* The atom n // d or n % d for already reduced parts. */
static sym_dim make_divmod(sym_ctx *ctx, kind k, sym_dim n, sym_dim d)
{
  const sym_expr *x = intern(ctx, (sym_expr){.k = k, .a = n.e, .ac = n.e ? 0 : n.c, .b = d.e, .c = d.e ? 0 : d.c});
  return x ? expr_dim(x) : sym_error();
}

/* The numerator of a FLOOR/MOD atom as a dim. */
static sym_dim numer(const sym_expr *x) { return x->a ? expr_dim(x->a) : sym_const(x->ac); }

/* Splits a by a constant k >= 2 into a = k*q + r with q, r polys: terms
 * whose coefficient k divides go to q, the constant splits by floor
 * division. With mod, r's coefficients are reduced into 1..k-1 and q is
 * not kept. Then divides r and k by the gcd of r's coefficients and k;
 * returns that gcd. */
static int64_t split_const(sym_dim a, int64_t *k, poly *q, poly *r, bool mod)
{
  int64_t c;
  int n;
  term one;
  const term *t = dim_terms(a, &c, &n, &one);
  q->n = r->n = 0;
  q->c = fdiv(c, *k);
  r->c = fmod64(c, *k);
  for (int i = 0; i < n; i++) {
    int64_t rem = fmod64(t[i].coef, *k);
    if (rem == 0) {
      if (!mod) q->t[q->n++] = (term){t[i].coef / *k, t[i].mono};
    } else {
      r->t[r->n++] = (term){mod ? rem : t[i].coef, t[i].mono};
    }
  }
  uint64_t g = gcd_u((uint64_t)*k, uabs(r->c));
  for (int i = 0; i < r->n; i++) g = gcd_u(g, uabs(r->t[i].coef));
  if (g > 1) {
    *k /= (int64_t)g;
    r->c /= (int64_t)g;
    for (int i = 0; i < r->n; i++) r->t[i].coef /= (int64_t)g;
  }
  return (int64_t)g;
}

/* Splits a by the mono divisor coef kb * mb: terms it divides exactly go
 * to q (divided), the rest and the constant to r. 0 or -1. */
static int split_mono(sym_ctx *ctx, sym_dim a, int64_t kb, const sym_expr *mb, poly *q, poly *r)
{
  int64_t c;
  int n;
  term one;
  const term *t = dim_terms(a, &c, &n, &one);
  q->c = q->n = 0;
  r->n = 0;
  r->c = c;
  for (int i = 0; i < n; i++) {
    bool div = kb == -1 ? t[i].coef != INT64_MIN : t[i].coef % kb == 0;
    if (div && mono_contains(t[i].mono, mb)) {
      const sym_expr *rest;
      if (mono_quot(ctx, t[i].mono, mb, &rest)) return -1;
      int64_t v = t[i].coef / kb;
      if (rest ? poly_add_term(ctx, q, v, rest) : poly_add_const(ctx, q, v)) return -1;
    } else {
      r->t[r->n++] = t[i];
    }
  }
  return 0;
}

/* Whether d is coef*mono with no constant; sets them. */
static bool as_mono(sym_dim d, int64_t *coef, const sym_expr **mono)
{
  int64_t c;
  int n;
  term one;
  const term *t = dim_terms(d, &c, &n, &one);
  if (n != 1 || c != 0) return false;
  *coef = t[0].coef;
  *mono = t[0].mono;
  return true;
}

static sym_dim divmod_const(sym_ctx *ctx, sym_dim a, int64_t k, bool mod)
{
  if (k == 1) return mod ? sym_const(0) : a;
  if (!a.e) return sym_const(mod ? fmod64(a.c, k) : fdiv(a.c, k));
  poly q, r;
  int64_t g = split_const(a, &k, &q, &r, mod);
  /* floor division: (k*q + r)//k = q + r//k; modulo: (k*q + r)%k = r%k, and (g*r)%(g*k) = g*(r%k) */
  if (r.n == 0) return mod ? sym_mul(ctx, sym_const(g), sym_const(r.c)) : poly_build(ctx, &q);
  sym_dim rd = poly_build(ctx, &r), part;
  if (sym_is_err(rd)) return rd;
  int64_t lo = rd.e->lo, hi = rd.e->hi, blk = fdiv(lo, k), base, jk;
  if (blk == fdiv(hi, k) && !__builtin_mul_overflow(blk, k, &base)) {
    /* r stays within one block of k: r//k is that block, r%k = r - k*block */
    part = mod ? sym_sub(ctx, rd, sym_const(base)) : sym_const(blk);
  } else if (!mod && rd.e->k == K_FLOOR && !rd.e->b && !__builtin_mul_overflow(rd.e->c, k, &jk)) {
    part = divmod_const(ctx, numer(rd.e), jk, false); /* (x//j)//k = x//(j*k) */
  } else if (mod && rd.e->k == K_MOD && !rd.e->b && rd.e->c % k == 0) {
    part = divmod_const(ctx, numer(rd.e), k, true); /* (x%j)%k = x%k when k divides j */
  } else {
    part = make_divmod(ctx, mod ? K_MOD : K_FLOOR, rd, sym_const(k));
  }
  if (mod) return sym_mul(ctx, sym_const(g), part);
  sym_dim qd = poly_build(ctx, &q);
  return sym_add(ctx, qd, part);
}

static sym_dim divmod_sym(sym_ctx *ctx, sym_dim a, sym_dim b, bool mod)
{
  if (b.e->lo < 1) return fail(ctx, E_DIV);
  if (sym_same(a, b)) return sym_const(mod ? 0 : 1);
  poly q, r;
  q.c = r.c = 0, q.n = r.n = 0;
  int64_t kb;
  const sym_expr *mb;
  if (as_mono(b, &kb, &mb)) {
    /* (b*q + r)//b = q + r//b and (b*q + r)%b = r%b */
    if (split_mono(ctx, a, kb, mb, &q, &r)) return sym_error();
  } else if (poly_add_scaled(ctx, &r, a, 1)) {
    return sym_error();
  }
  sym_dim qd = poly_build(ctx, &q), rd = poly_build(ctx, &r), part;
  if (sym_is_err(qd) || sym_is_err(rd)) return sym_error();
  int64_t lo, hi;
  sym_bounds(rd, &lo, &hi);
  if (lo >= 0 && hi < b.e->lo) part = mod ? rd : sym_const(0); /* 0 <= r < b */
  else part = make_divmod(ctx, mod ? K_MOD : K_FLOOR, rd, b);
  return mod ? part : sym_add(ctx, qd, part);
}

sym_dim sym_floordiv(sym_ctx *ctx, sym_dim a, sym_dim b)
{
  if (sym_is_err(a) || sym_is_err(b)) return sym_error();
  if (!a.e && !b.e) {
    if (b.c < 1) return fail(ctx, E_DIV);
    int64_t q = a.c / b.c, r = a.c % b.c;
    if (r < 0) q--, r += b.c; /* floor, as Python */
    return sym_const(q);
  }
  if (!ctx) return sym_error();
  if (!b.e) return b.c < 1 ? fail(ctx, E_DIV) : divmod_const(ctx, a, b.c, false);
  return divmod_sym(ctx, a, b, false);
}

sym_dim sym_mod(sym_ctx *ctx, sym_dim a, sym_dim b)
{
  if (sym_is_err(a) || sym_is_err(b)) return sym_error();
  if (!a.e && !b.e) {
    if (b.c < 1) return fail(ctx, E_DIV);
    int64_t q = a.c / b.c, r = a.c % b.c;
    if (r < 0) q--, r += b.c; /* floor, as Python */
    return sym_const(r);
  }
  if (!ctx) return sym_error();
  if (!b.e) return b.c < 1 ? fail(ctx, E_DIV) : divmod_const(ctx, a, b.c, true);
  return divmod_sym(ctx, a, b, true);
}

/* ---- bounds and evaluation --------------------------------------------- */

void sym_bounds(sym_dim d, int64_t *lo, int64_t *hi)
{
  if (sym_is_err(d)) {
    *lo = INT64_MIN;
    *hi = INT64_MAX;
    return;
  }
  part_bounds(d.e, d.c, lo, hi);
}

static int eval_expr(const sym_expr *e, const int64_t *vals, int nvals, int64_t *out);

static int eval_part(const sym_expr *e, int64_t c, const int64_t *vals, int nvals, int64_t *out)
{
  if (!e) {
    *out = c;
    return 0;
  }
  return eval_expr(e, vals, nvals, out);
}

static int eval_expr(const sym_expr *e, const int64_t *vals, int nvals, int64_t *out)
{
  int64_t v, x, y;
  switch (e->k) {
  case K_VAR:
    if (e->id >= nvals || !vals) return -1;
    v = vals[e->id];
    if (v < e->lo || v > e->hi) return -1; /* simplifications relied on the bounds */
    *out = v;
    return 0;
  case K_PROD:
    v = 1;
    for (int i = 0; i < e->n; i++)
      if (eval_expr(e->atoms[i], vals, nvals, &x) || __builtin_mul_overflow(v, x, &v)) return -1;
    *out = v;
    return 0;
  case K_SUM:
    v = e->c;
    for (int i = 0; i < e->n; i++)
      if (eval_expr(e->terms[i].mono, vals, nvals, &x) || __builtin_mul_overflow(x, e->terms[i].coef, &x) ||
          __builtin_add_overflow(v, x, &v))
        return -1;
    *out = v;
    return 0;
  case K_FLOOR:
  case K_MOD:
    if (eval_part(e->a, e->ac, vals, nvals, &x) || eval_part(e->b, e->c, vals, nvals, &y) || y < 1) return -1;
    *out = e->k == K_FLOOR ? fdiv(x, y) : fmod64(x, y);
    return 0;
  }
  return -1;
}

int sym_eval(sym_dim d, const int64_t *vals, int nvals, int64_t *out)
{
  if (sym_is_err(d)) return -1;
  return eval_part(d.e, d.c, vals, nvals, out);
}

/* ---- the runtime's code ---------------------------------------------------- */

typedef struct cbuf {
  int64_t *out;
  int n, cap;
} cbuf;

static void put(cbuf *c, int64_t w) {
  if (c->n < c->cap) c->out[c->n] = w;
  c->n++;
}

static void code_expr(cbuf *c, const sym_expr *e);

static void code_part(cbuf *c, const sym_expr *e, int64_t v) {
  if (e) code_expr(c, e);
  else put(c, RT_C_CONST), put(c, v);
}

static void code_expr(cbuf *c, const sym_expr *e) {
  switch (e->k) {
  case K_VAR:
    put(c, RT_C_SYM), put(c, e->id);
    break;
  case K_PROD:
    for (int i = 0; i < e->n; i++) {
      code_expr(c, e->atoms[i]);
      if (i) put(c, RT_C_MUL);
    }
    break;
  case K_SUM:
    put(c, RT_C_CONST), put(c, e->c);
    for (int i = 0; i < e->n; i++) {
      code_expr(c, e->terms[i].mono);
      put(c, RT_C_CONST), put(c, e->terms[i].coef), put(c, RT_C_MUL), put(c, RT_C_ADD);
    }
    break;
  case K_FLOOR:
  case K_MOD:
    code_part(c, e->a, e->ac);
    code_part(c, e->b, e->c);
    put(c, e->k == K_FLOOR ? RT_C_FLOOR : RT_C_MOD);
    break;
  }
}

int sym_code(sym_dim d, int64_t *out, int cap) {
  if (sym_is_err(d)) return -1;
  cbuf c = {out, 0, cap};
  code_part(&c, d.e, d.c);
  put(&c, RT_C_END);
  return c.n <= cap ? c.n : -1;
}

/* ---- printing ------------------------------------------------------------ */

#define PRINT_MAX ((size_t)1 << 26) /* shared subexpressions can print exponentially long */

typedef struct sbuf {
  char *buf;
  size_t n, len;
  bool over;
} sbuf;

static void sb_put(sbuf *s, const char *str)
{
  if (s->over) return;
  size_t m = strlen(str);
  if (s->len + m > PRINT_MAX) {
    s->over = true;
    return;
  }
  if (s->len < s->n) {
    size_t room = s->n - s->len - 1, k = m < room ? m : room;
    memcpy(s->buf + s->len, str, k);
    s->buf[s->len + k] = '\0';
  }
  s->len += m;
}

static void sb_int(sbuf *s, int64_t v)
{
  char t[32];
  snprintf(t, sizeof t, "%lld", (long long)v);
  sb_put(s, t);
}

static void print_expr(sbuf *s, const sym_expr *e);

/* A FLOOR/MOD operand: bare when a symbol or a nonnegative constant. */
static void print_operand(sbuf *s, const sym_expr *e, int64_t c)
{
  if (!e ? c >= 0 : e->k == K_VAR) {
    if (e) print_expr(s, e);
    else sb_int(s, c);
    return;
  }
  sb_put(s, "(");
  if (e) print_expr(s, e);
  else sb_int(s, c);
  sb_put(s, ")");
}

/* An atom; FLOOR/MOD bare only when nothing binds to it from the left. */
static void print_atom(sbuf *s, const sym_expr *x, bool bare)
{
  if (s->over) return;
  if (x->k == K_VAR) {
    char t[24];
    snprintf(t, sizeof t, "s%d", x->id);
    sb_put(s, t);
    return;
  }
  if (!bare) sb_put(s, "(");
  print_operand(s, x->a, x->ac);
  sb_put(s, x->k == K_FLOOR ? "//" : " % ");
  print_operand(s, x->b, x->c);
  if (!bare) sb_put(s, ")");
}

static void print_mono(sbuf *s, const sym_expr *m, bool bare)
{
  if (m->k != K_PROD) {
    print_atom(s, m, bare);
    return;
  }
  for (int i = 0; i < m->n; i++) {
    if (i) sb_put(s, "*");
    print_atom(s, m->atoms[i], false);
  }
}

static void print_expr(sbuf *s, const sym_expr *e)
{
  if (s->over) return;
  if (e->k != K_SUM) {
    print_mono(s, e, true);
    return;
  }
  for (int i = 0; i < e->n; i++) {
    int64_t coef = e->terms[i].coef;
    const sym_expr *m = e->terms[i].mono;
    if (i > 0 && coef != INT64_MIN) {
      sb_put(s, coef > 0 ? " + " : " - ");
      coef = coef > 0 ? coef : -coef;
    } else if (i > 0) {
      sb_put(s, " + "); /* -INT64_MIN does not exist: write the negative literal */
    }
    if (coef == 1) {
      print_mono(s, m, true);
    } else if (coef == -1) {
      sb_put(s, "-");
      print_mono(s, m, false);
    } else {
      sb_int(s, coef);
      sb_put(s, "*");
      print_mono(s, m, false);
    }
  }
  if (e->c > 0) {
    sb_put(s, " + ");
    sb_int(s, e->c);
  } else if (e->c < 0 && e->c != INT64_MIN) {
    sb_put(s, " - ");
    sb_int(s, -e->c);
  } else if (e->c == INT64_MIN) {
    sb_put(s, " + ");
    sb_int(s, e->c);
  }
}

static void print_dim(sbuf *s, sym_dim d)
{
  if (d.e) print_expr(s, d.e);
  else sb_int(s, d.c);
}

static int sb_done(sbuf *s)
{
  if (s->n) s->buf[s->len < s->n ? s->len : s->n - 1] = '\0';
  return s->over ? -1 : (int)s->len;
}

int sym_print(sym_dim d, char *buf, size_t n)
{
  if (n) buf[0] = '\0';
  if (sym_is_err(d)) return -1;
  sbuf s = {buf, n, 0, false};
  print_dim(&s, d);
  return sb_done(&s);
}

/* ---- parsing ------------------------------------------------------------- */

enum { PARSE_MAX_NEST = 200 };

typedef struct parser {
  sym_ctx *ctx;
  const char *text, *p;
  char *err;
  size_t errn;
  bool failed;
  int nest;
  /* the top-level expression, for reading `E % F == 0` as a guard */
  int top_terms;
  bool top_mod;
  sym_dim mod_l, mod_r;
} parser;

static sym_dim perr(parser *ps, const char *at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static sym_dim perr(parser *ps, const char *at, const char *fmt, ...)
{
  if (!ps->failed && ps->errn) {
    char msg[128];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(ps->err, ps->errn, "col %lld: %s", (long long)(at - ps->text) + 1, msg);
  }
  ps->failed = true;
  return sym_error();
}

static void skip_ws(parser *ps)
{
  while (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r') ps->p++;
}

static bool is_digit(char c) { return c >= '0' && c <= '9'; }

static sym_dim unexpected(parser *ps)
{
  unsigned char c = (unsigned char)*ps->p;
  if (c == '\0') return perr(ps, ps->p, "unexpected end of input");
  if (c >= 0x20 && c < 0x7f) return perr(ps, ps->p, "unexpected '%c'", c);
  return perr(ps, ps->p, "unexpected byte 0x%02x", c);
}

/* Digits at ps->p as an integer of magnitude <= limit. */
static int read_uint(parser *ps, uint64_t limit, uint64_t *out)
{
  const char *start = ps->p;
  uint64_t v = 0;
  bool big = false;
  for (; is_digit(*ps->p); ps->p++) {
    uint64_t d = (uint64_t)(*ps->p - '0');
    if (v > (limit - d) / 10) big = true;
    else v = v * 10 + d;
  }
  if (big) {
    perr(ps, start, "number out of range");
    return -1;
  }
  *out = v;
  return 0;
}

static sym_dim parse_expr(parser *ps, bool top);

static sym_dim parse_factor(parser *ps)
{
  skip_ws(ps);
  const char *at = ps->p;
  uint64_t u;
  if (*at == '(') {
    if (++ps->nest > PARSE_MAX_NEST) return perr(ps, at, "nested too deeply");
    ps->p++;
    sym_dim e = parse_expr(ps, false);
    ps->nest--;
    if (ps->failed) return e;
    skip_ws(ps);
    if (*ps->p != ')') return perr(ps, ps->p, "expected ')'");
    ps->p++;
    return e;
  }
  if (*at == '-') {
    ps->p++;
    skip_ws(ps);
    if (is_digit(*ps->p)) {
      if (read_uint(ps, (uint64_t)INT64_MAX + 1, &u)) return sym_error();
      return sym_const(u == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)u);
    }
    if (++ps->nest > PARSE_MAX_NEST) return perr(ps, at, "nested too deeply");
    sym_dim f = parse_factor(ps);
    ps->nest--;
    if (ps->failed) return f;
    sym_dim r = sym_mul(ps->ctx, sym_const(-1), f);
    return sym_is_err(r) ? perr(ps, at, "%s", ps->ctx->err) : r;
  }
  if (is_digit(*at)) {
    if (read_uint(ps, INT64_MAX, &u)) return sym_error();
    return sym_const((int64_t)u);
  }
  if (*at == 's') {
    ps->p++;
    if (!is_digit(*ps->p)) return perr(ps, ps->p, "expected a symbol number after 's'");
    if (read_uint(ps, INT64_MAX, &u)) return sym_error();
    if (u >= SYM_MAX_ID) return perr(ps, at, "symbol id out of range");
    sym_dim v = var_or_default(ps->ctx, (int)u);
    return sym_is_err(v) ? perr(ps, at, "%s", ps->ctx->err) : v;
  }
  return unexpected(ps);
}

static sym_dim parse_term(parser *ps, bool top)
{
  sym_dim acc = parse_factor(ps);
  if (top) ps->top_mod = false;
  while (!ps->failed) {
    skip_ws(ps);
    const char *at = ps->p;
    char op = *at;
    if (op == '/') {
      if (at[1] != '/') return perr(ps, at, "expected '//'");
      ps->p += 2;
    } else if (op == '*' || op == '%') {
      ps->p++;
    } else {
      break;
    }
    sym_dim f = parse_factor(ps);
    if (ps->failed) return f;
    sym_dim r = op == '*' ? sym_mul(ps->ctx, acc, f) : op == '/' ? sym_floordiv(ps->ctx, acc, f) : sym_mod(ps->ctx, acc, f);
    if (sym_is_err(r)) return perr(ps, at, "%s", ps->ctx->err);
    if (top) {
      ps->top_mod = op == '%';
      ps->mod_l = acc;
      ps->mod_r = f;
    }
    acc = r;
  }
  return ps->failed ? sym_error() : acc;
}

static sym_dim parse_expr(parser *ps, bool top)
{
  sym_dim acc = parse_term(ps, top);
  int nterms = 1;
  while (!ps->failed) {
    skip_ws(ps);
    const char *at = ps->p;
    char op = *at;
    if (op != '+' && op != '-') break;
    ps->p++;
    sym_dim t = parse_term(ps, false);
    if (ps->failed) return t;
    sym_dim r = op == '+' ? sym_add(ps->ctx, acc, t) : sym_sub(ps->ctx, acc, t);
    if (sym_is_err(r)) return perr(ps, at, "%s", ps->ctx->err);
    acc = r;
    nterms++;
  }
  if (top) ps->top_terms = nterms;
  return ps->failed ? sym_error() : acc;
}

/* Ends a parse: trailing blanks, then the end of text unless end is given. */
static int parse_finish(parser *ps, const char **end)
{
  if (ps->failed) return -1;
  skip_ws(ps);
  if (end) *end = ps->p;
  else if (*ps->p) {
    unexpected(ps);
    return -1;
  }
  return 0;
}

static void parser_init(parser *ps, sym_ctx *ctx, const char *text, char *err, size_t errn)
{
  *ps = (parser){.ctx = ctx, .text = text, .p = text, .err = err, .errn = errn};
  if (errn) err[0] = '\0';
}

int sym_parse(sym_ctx *ctx, const char *text, sym_dim *out, const char **end, char *err, size_t errn)
{
  *out = sym_error();
  if (!ctx || !text) {
    if (errn) snprintf(err, errn, "col 1: no context or text");
    return -1;
  }
  parser ps;
  parser_init(&ps, ctx, text, err, errn);
  sym_dim d = parse_expr(&ps, false);
  if (parse_finish(&ps, end)) return -1;
  *out = d;
  return 0;
}

/* ---- guards ---------------------------------------------------------------- */

static const char *const cmp_text[] = {"==", "!=", "<", "<=", ">=", ">"};

int sym_guard_check(const sym_guard *g, const int64_t *vals, int nvals)
{
  int64_t a, b;
  if (!g || sym_eval(g->lhs, vals, nvals, &a) || sym_eval(g->rhs, vals, nvals, &b)) return -1;
  switch (g->op) {
  case SYM_EQ: return a == b;
  case SYM_NE: return a != b;
  case SYM_LT: return a < b;
  case SYM_LE: return a <= b;
  case SYM_GE: return a >= b;
  case SYM_GT: return a > b;
  case SYM_DIVIDES: return b < 1 ? -1 : fmod64(a, b) == 0;
  }
  return -1;
}

static bool is_bare_mod(sym_dim d) { return d.e && d.e->k == K_MOD; }

int sym_guard_print(const sym_guard *g, char *buf, size_t n)
{
  if (n) buf[0] = '\0';
  if (!g || sym_is_err(g->lhs) || sym_is_err(g->rhs) || (unsigned)g->op > SYM_DIVIDES) return -1;
  sbuf s = {buf, n, 0, false};
  if (g->op == SYM_DIVIDES) {
    /* the left side must read back as the whole left operand of the last % */
    bool paren = g->lhs.e && g->lhs.e->k == K_SUM && (g->lhs.e->n > 1 || g->lhs.e->c != 0);
    if (paren) sb_put(&s, "(");
    print_dim(&s, g->lhs);
    if (paren) sb_put(&s, ")");
    sb_put(&s, " % ");
    print_operand(&s, g->rhs.e, g->rhs.c);
    sb_put(&s, " == 0");
    return sb_done(&s);
  }
  /* `s0 % 4 == 0` would read back as SYM_DIVIDES */
  bool paren = g->op == SYM_EQ && is_bare_mod(g->lhs) && sym_same(g->rhs, sym_const(0));
  if (paren) sb_put(&s, "(");
  print_dim(&s, g->lhs);
  if (paren) sb_put(&s, ")");
  sb_put(&s, " ");
  sb_put(&s, cmp_text[g->op]);
  sb_put(&s, " ");
  print_dim(&s, g->rhs);
  return sb_done(&s);
}

int sym_guard_parse(sym_ctx *ctx, const char *text, sym_guard *out, const char **end, char *err, size_t errn)
{
  *out = (sym_guard){SYM_EQ, sym_error(), sym_error()};
  if (!ctx || !text) {
    if (errn) snprintf(err, errn, "col 1: no context or text");
    return -1;
  }
  parser ps;
  parser_init(&ps, ctx, text, err, errn);
  sym_dim lhs = parse_expr(&ps, true);
  if (ps.failed) return -1;
  bool divides = ps.top_terms == 1 && ps.top_mod;
  sym_dim mod_l = ps.mod_l, mod_r = ps.mod_r;
  skip_ws(&ps);
  const char *at = ps.p;
  int op = -1;
  for (int i = 0; i < 6 && op < 0; i++) {
    size_t m = strlen(cmp_text[i]);
    /* "<" followed by "=" is "<=", found later in the table */
    if (strncmp(at, cmp_text[i], m) == 0 && !(m == 1 && at[1] == '=')) op = i;
  }
  if (op < 0) {
    perr(&ps, at, "expected a comparison (==, !=, <, <=, >=, >)");
    return -1;
  }
  ps.p += strlen(cmp_text[op]);
  sym_dim rhs = parse_expr(&ps, false);
  if (parse_finish(&ps, end)) return -1;
  if (op == SYM_EQ && divides && sym_same(rhs, sym_const(0))) *out = (sym_guard){SYM_DIVIDES, mod_l, mod_r};
  else *out = (sym_guard){(sym_cmp)op, lhs, rhs};
  return 0;
}

/* ---- static decisions ------------------------------------------------------- */

/* Bounds of a - b, combining like terms so that s0 + 1 > s0 is provable.
 * Each combined term (ca - cb)*m is ca*m - cb*m, two int64 values where
 * evaluation succeeds, so it lies within +-2^64. */
static void diff_bounds(sym_dim a, sym_dim b, i128 *lo, i128 *hi)
{
  int64_t ca, cb;
  int na, nb, i = 0, j = 0;
  term oa, ob;
  const term *ta = dim_terms(a, &ca, &na, &oa), *tb = dim_terms(b, &cb, &nb, &ob);
  const i128 lim = (i128)1 << 64;
  *lo = *hi = (i128)ca - cb;
  while (i < na || j < nb) {
    int r = i == na ? 1 : j == nb ? -1 : cmp_mono(ta[i].mono, tb[j].mono);
    const sym_expr *m = r <= 0 ? ta[i].mono : tb[j].mono;
    i128 coef = (r <= 0 ? (i128)ta[i].coef : 0) - (r >= 0 ? (i128)tb[j].coef : 0);
    if (r <= 0) i++;
    if (r >= 0) j++;
    i128 x = coef * m->lo, y = coef * m->hi, tl = x < y ? x : y, th = x < y ? y : x;
    *lo += tl < -lim ? -lim : tl;
    *hi += th > lim ? lim : th;
  }
}

/* Whether every term of a and its constant are multiples of b. */
static bool provably_divisible(sym_dim a, sym_dim b)
{
  if (sym_same(a, b)) return true;
  int64_t c, kb;
  int n;
  term one;
  const sym_expr *mb = NULL;
  const term *t = dim_terms(a, &c, &n, &one);
  if (!b.e) {
    kb = b.c;
  } else if (!as_mono(b, &kb, &mb) || c != 0) {
    return false;
  }
  if (kb == 0) return false;
  if (kb != -1 && c % kb != 0) return false;
  for (int i = 0; i < n; i++) {
    if (kb != -1 && t[i].coef % kb != 0) return false;
    if (mb && !mono_contains(t[i].mono, mb)) return false;
  }
  return true;
}

/* 1 proven true, 0 proven false, -1 not provable. */
static int prove(sym_dim a, sym_cmp op, sym_dim b)
{
  if (!a.e && !b.e) {
    sym_guard g = {op, a, b};
    return sym_guard_check(&g, NULL, 0);
  }
  if (op == SYM_DIVIDES) {
    int64_t alo, ahi, blo, bhi;
    sym_bounds(a, &alo, &ahi);
    sym_bounds(b, &blo, &bhi);
    if (blo < 1) return -1;
    if (provably_divisible(a, b)) return 1;
    if (alo >= 1 && ahi < blo) return 0; /* 0 < a < b */
    return -1;
  }
  if (sym_same(a, b)) return op == SYM_EQ || op == SYM_LE || op == SYM_GE;
  i128 lo, hi;
  diff_bounds(a, b, &lo, &hi);
  switch (op) {
  case SYM_EQ: return lo > 0 || hi < 0 ? 0 : lo == 0 && hi == 0 ? 1 : -1;
  case SYM_NE: return lo > 0 || hi < 0 ? 1 : lo == 0 && hi == 0 ? 0 : -1;
  case SYM_LT: return hi < 0 ? 1 : lo >= 0 ? 0 : -1;
  case SYM_LE: return hi <= 0 ? 1 : lo > 0 ? 0 : -1;
  case SYM_GE: return lo >= 0 ? 1 : hi < 0 ? 0 : -1;
  case SYM_GT: return lo > 0 ? 1 : hi <= 0 ? 0 : -1;
  default: return -1;
  }
}

int sym_decide(sym_dim a, sym_cmp op, sym_dim b, const int64_t *vals, int nvals, bool *result, bool *needs_guard)
{
  if (sym_is_err(a) || sym_is_err(b) || (unsigned)op > SYM_DIVIDES) return -1;
  int p = prove(a, op, b);
  if (p >= 0) {
    *result = p == 1;
    *needs_guard = false;
    return 0;
  }
  sym_guard g = {op, a, b};
  int r = sym_guard_check(&g, vals, nvals);
  if (r < 0) return -1;
  *result = r == 1;
  *needs_guard = true;
  return 0;
}
