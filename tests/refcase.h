/* Reference cases written by tests/gen_refs.py: the parser, and the helpers
 * that turn a case's inputs into kiln tensors and compare outputs with the
 * expected values. Included by tests/test_ops_ref.c only.
 *
 * The file is a stream of whitespace separated tokens (gen_refs.py documents
 * the grammar). Float values are hex floats, so they round-trip exactly. */
#ifndef KILN_TESTS_REFCASE_H
#define KILN_TESTS_REFCASE_H

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eager/half.h" /* f16 and bf16 bits (the file's values are exact in them) */
#include "kiln.h"

#define REF_MAX_IN 6
#define REF_MAX_OUT 3
#define REF_MAX_ATTR 12
#define REF_MAX_VIEWS 4

typedef struct ref_view {
  char kind;                     /* 't'ranspose 'p'ermute 's'lice 'e'xpand */
  int n;                         /* number of args in a[] */
  int64_t a[KILN_MAX_DIMS + 1];
} ref_view;

typedef struct ref_tensor {
  kiln_dtype dt;
  int ndim;
  int64_t shape[KILN_MAX_DIMS];
  int64_t numel;
  int nviews;                    /* replayed in order on the base */
  ref_view views[REF_MAX_VIEWS];
  double *f;                     /* values of f32/f64 tensors */
  int64_t *i;                    /* values of i64/bool tensors */
} ref_tensor;

typedef struct ref_attr {
  char name[16];
  int n;
  double v[KILN_MAX_DIMS];
} ref_attr;

typedef struct refcase {
  int index;                     /* position in the file, from 0 */
  char family[16];
  char op[32];
  int nattr;
  ref_attr attr[REF_MAX_ATTR];
  int nin;
  ref_tensor in[REF_MAX_IN];
  int nout;
  ref_tensor out[REF_MAX_OUT];
  double rtol, atol;
} refcase;

typedef struct ref_file {
  refcase *cases;
  int n;
} ref_file;

/* ---- parsing --------------------------------------------------------- */

typedef struct ref_lexer {
  char *p;
  const char *path;
  const unsigned char *bin; /* big.bin, for 'bin OFFSET' values */
  size_t binlen;
  char err[256];
} ref_lexer;

static char *ref_tok(ref_lexer *lx)
{
  while (*lx->p == ' ' || *lx->p == '\n' || *lx->p == '\t' || *lx->p == '\r')
    lx->p++;
  if (!*lx->p)
    return NULL;
  char *t = lx->p;
  while (*lx->p && *lx->p != ' ' && *lx->p != '\n' && *lx->p != '\t' && *lx->p != '\r')
    lx->p++;
  if (*lx->p)
    *lx->p++ = '\0';
  return t;
}

static int ref_fail(ref_lexer *lx, const char *what, const char *tok)
{
  if (!lx->err[0])
    snprintf(lx->err, sizeof lx->err, "%s: bad reference file: expected %s, got '%s'", lx->path, what,
             tok ? tok : "end of file");
  return -1;
}

static int ref_dtype_of(const char *s, kiln_dtype *dt)
{
  static const char *names[] = {"f32", "f64", "i64", "bool", "i32", "f16", "bf16"};
  static const kiln_dtype dts[] = {KILN_F32, KILN_F64, KILN_I64, KILN_BOOL, KILN_I32, KILN_F16, KILN_BF16};
  for (int k = 0; k < (int)(sizeof names / sizeof names[0]); k++)
    if (s && strcmp(s, names[k]) == 0) {
      *dt = dts[k];
      return 0;
    }
  return -1;
}

static int ref_int_of(ref_lexer *lx, const char *t, int64_t *v)
{
  char *end;
  if (!t)
    return ref_fail(lx, "an integer", t);
  errno = 0;
  *v = strtoll(t, &end, 10);
  if (*end || errno)
    return ref_fail(lx, "an integer", t);
  return 0;
}

static int ref_int(ref_lexer *lx, int64_t *v) { return ref_int_of(lx, ref_tok(lx), v); }

static int ref_double_of(ref_lexer *lx, const char *t, double *v)
{
  char *end;
  if (!t)
    return ref_fail(lx, "a number", t);
  kiln_dtype dt;
  if (ref_dtype_of(t, &dt) == 0) { /* dtype attributes are stored as the enum value */
    *v = (double)dt;
    return 0;
  }
  *v = strtod(t, &end);
  if (*end)
    return ref_fail(lx, "a number", t);
  return 0;
}

static int ref_double(ref_lexer *lx, double *v) { return ref_double_of(lx, ref_tok(lx), v); }

/* The numel values of t: listed, 'gen A B M C S' or 'bin OFFSET'. */
static int ref_values(ref_lexer *lx, ref_tensor *t)
{
  bool fl = t->dt == KILN_F32 || t->dt == KILN_F64 || t->dt == KILN_F16 || t->dt == KILN_BF16;
  size_t n = (size_t)(t->numel > 0 ? t->numel : 1);
  if (fl)
    t->f = calloc(n, sizeof *t->f);
  else
    t->i = calloc(n, sizeof *t->i);
  if (t->numel == 0)
    return 0;
  char *first = ref_tok(lx);
  if (first && strcmp(first, "gen") == 0) {
    /* element k is ((k*A + B) % M - C) * S, as in gen_refs.py formula() */
    int64_t A, B, M, C;
    double S;
    if (ref_int(lx, &A) || ref_int(lx, &B) || ref_int(lx, &M) || ref_int(lx, &C) || ref_double(lx, &S))
      return -1;
    if (M <= 0)
      return ref_fail(lx, "a positive modulus", NULL);
    for (int64_t k = 0; k < t->numel; k++) {
      int64_t v = (k * A + B) % M - C;
      if (fl)
        t->f[k] = t->dt == KILN_F32 ? (double)(float)((double)v * S) : (double)v * S;
      else
        t->i[k] = t->dt == KILN_BOOL ? v > 0 : v * (int64_t)S;
    }
    return 0;
  }
  if (first && strcmp(first, "bin") == 0) {
    int64_t off;
    size_t es = kiln_dtype_size(t->dt);
    if (ref_int(lx, &off))
      return -1;
    if (off < 0 || (size_t)off + n * es > lx->binlen)
      return ref_fail(lx, "an offset inside big.bin", NULL);
    const unsigned char *p = lx->bin + off;
    for (size_t k = 0; k < n; k++, p += es) {
      float f32;
      double f64;
      int64_t i64;
      switch (t->dt) {
      case KILN_F32: memcpy(&f32, p, 4); t->f[k] = f32; break;
      case KILN_F64: memcpy(&f64, p, 8); t->f[k] = f64; break;
      case KILN_I64: memcpy(&i64, p, 8); t->i[k] = i64; break;
      case KILN_BOOL: t->i[k] = *p; break;
      default: return ref_fail(lx, "bin data of f32, f64, i64 or bool", NULL);
      }
    }
    return 0;
  }
  for (int64_t k = 0; k < t->numel; k++) {
    const char *tok = k ? ref_tok(lx) : first;
    if (fl ? ref_double_of(lx, tok, &t->f[k]) : ref_int_of(lx, tok, &t->i[k]))
      return -1;
  }
  return 0;
}

static int ref_dims(ref_lexer *lx, int *ndim, int64_t *shape, int max)
{
  int64_t n;
  if (ref_int(lx, &n) || n < 0 || n > max)
    return ref_fail(lx, "a rank", NULL);
  *ndim = (int)n;
  for (int k = 0; k < *ndim; k++)
    if (ref_int(lx, &shape[k]))
      return -1;
  return 0;
}

/* "DTYPE NDIM DIMS... [NVIEWS VIEWS...] VALUES" after the in/out keyword. */
static int ref_tensor_parse(ref_lexer *lx, ref_tensor *t, bool with_views)
{
  memset(t, 0, sizeof *t);
  if (ref_dtype_of(ref_tok(lx), &t->dt))
    return ref_fail(lx, "a dtype", NULL);
  if (ref_dims(lx, &t->ndim, t->shape, KILN_MAX_DIMS))
    return -1;
  t->numel = 1;
  for (int k = 0; k < t->ndim; k++)
    t->numel *= t->shape[k];
  if (with_views) {
    int64_t nv;
    if (ref_int(lx, &nv) || nv < 0 || nv > REF_MAX_VIEWS)
      return ref_fail(lx, "a view count", NULL);
    t->nviews = (int)nv;
    for (int k = 0; k < t->nviews; k++) {
      ref_view *v = &t->views[k];
      char *kind = ref_tok(lx);
      int ndim;
      if (kind && strcmp(kind, "transpose") == 0) {
        v->kind = 't';
        v->n = 2;
      } else if (kind && strcmp(kind, "slice") == 0) {
        v->kind = 's';
        v->n = 4;
      } else if (kind && (strcmp(kind, "permute") == 0 || strcmp(kind, "expand") == 0)) {
        v->kind = kind[0];
        if (ref_dims(lx, &ndim, v->a, KILN_MAX_DIMS))
          return -1;
        v->n = ndim;
        continue;
      } else {
        return ref_fail(lx, "a view kind", kind);
      }
      for (int j = 0; j < v->n; j++)
        if (ref_int(lx, &v->a[j]))
          return -1;
    }
  }
  return ref_values(lx, t);
}

static int ref_case_parse(ref_lexer *lx, refcase *c)
{
  char *t = ref_tok(lx);
  if (!t || strlen(t) >= sizeof c->family)
    return ref_fail(lx, "a family", t);
  strcpy(c->family, t);
  t = ref_tok(lx);
  if (!t || strlen(t) >= sizeof c->op)
    return ref_fail(lx, "an op", t);
  strcpy(c->op, t);
  for (;;) {
    t = ref_tok(lx);
    if (!t)
      return ref_fail(lx, "end", t);
    if (strcmp(t, "end") == 0)
      return 0;
    if (strcmp(t, "attr") == 0) {
      if (c->nattr == REF_MAX_ATTR)
        return ref_fail(lx, "fewer attributes", t);
      ref_attr *a = &c->attr[c->nattr++];
      t = ref_tok(lx);
      if (!t || strlen(t) >= sizeof a->name)
        return ref_fail(lx, "an attribute name", t);
      strcpy(a->name, t);
      int64_t n;
      if (ref_int(lx, &n) || n < 0 || n > KILN_MAX_DIMS)
        return ref_fail(lx, "an attribute count", NULL);
      a->n = (int)n;
      for (int k = 0; k < a->n; k++)
        if (ref_double(lx, &a->v[k]))
          return -1;
    } else if (strcmp(t, "in") == 0) {
      if (c->nin == REF_MAX_IN)
        return ref_fail(lx, "fewer inputs", t);
      if (ref_tensor_parse(lx, &c->in[c->nin++], true))
        return -1;
    } else if (strcmp(t, "out") == 0) {
      if (c->nout == REF_MAX_OUT)
        return ref_fail(lx, "fewer outputs", t);
      if (ref_tensor_parse(lx, &c->out[c->nout++], false))
        return -1;
    } else if (strcmp(t, "tol") == 0) {
      if (ref_double(lx, &c->rtol) || ref_double(lx, &c->atol))
        return -1;
    } else {
      return ref_fail(lx, "attr, in, out, tol or end", t);
    }
  }
}

static void ref_file_free(ref_file *rf)
{
  for (int k = 0; k < rf->n; k++) {
    refcase *c = &rf->cases[k];
    for (int j = 0; j < c->nin; j++) {
      free(c->in[j].f);
      free(c->in[j].i);
    }
    for (int j = 0; j < c->nout; j++) {
      free(c->out[j].f);
      free(c->out[j].i);
    }
  }
  free(rf->cases);
  rf->cases = NULL;
  rf->n = 0;
}

/* The whole file, NUL-terminated; NULL with a message in err. */
static char *ref_slurp(const char *path, size_t *len, char *err, size_t errn)
{
  FILE *fp = fopen(path, "rb");
  if (!fp) {
    snprintf(err, errn, "%s: %s", path, strerror(errno));
    return NULL;
  }
  fseek(fp, 0, SEEK_END);
  long n = ftell(fp);
  fseek(fp, 0, SEEK_SET);
  char *text = n >= 0 ? malloc((size_t)n + 1) : NULL;
  if (!text || fread(text, 1, (size_t)n, fp) != (size_t)n) {
    fclose(fp);
    free(text);
    snprintf(err, errn, "%s: read failed", path);
    return NULL;
  }
  fclose(fp);
  text[n] = '\0';
  *len = (size_t)n;
  return text;
}

/* Loads every case of DIR/ops.txt (with DIR/big.bin); 0, or -1 with a
 * message in err. */
static int ref_file_load(const char *dir, ref_file *rf, char *err, size_t errn)
{
  memset(rf, 0, sizeof *rf);
  char path[4096], binpath[4096];
  snprintf(path, sizeof path, "%s/ops.txt", dir);
  snprintf(binpath, sizeof binpath, "%s/big.bin", dir);
  size_t len, binlen;
  char *text = ref_slurp(path, &len, err, errn);
  if (!text)
    return -1;
  char *bin = ref_slurp(binpath, &binlen, err, errn);
  if (!bin) {
    free(text);
    return -1;
  }

  ref_lexer lx = {.p = text, .path = path, .bin = (const unsigned char *)bin, .binlen = binlen};
  int rc = 0, cap = 0;
  char *t = ref_tok(&lx);
  if (!t || strcmp(t, "kiln-refs") != 0 || !(t = ref_tok(&lx)) || strcmp(t, "1") != 0)
    rc = ref_fail(&lx, "the header 'kiln-refs 1'", t);
  while (rc == 0 && (t = ref_tok(&lx)) != NULL) {
    if (strcmp(t, "case") != 0) {
      rc = ref_fail(&lx, "case", t);
      break;
    }
    if (rf->n == cap) {
      cap = cap ? 2 * cap : 256;
      rf->cases = realloc(rf->cases, (size_t)cap * sizeof *rf->cases);
    }
    refcase *c = &rf->cases[rf->n];
    memset(c, 0, sizeof *c);
    c->index = rf->n++;
    rc = ref_case_parse(&lx, c);
  }
  free(text);
  free(bin);
  if (rc) {
    snprintf(err, errn, "%s (in case %d)", lx.err, rf->n - 1);
    ref_file_free(rf);
  }
  return rc;
}

/* ---- attributes ------------------------------------------------------ */

static const ref_attr *ref_find_attr(const refcase *c, const char *name)
{
  for (int k = 0; k < c->nattr; k++)
    if (strcmp(c->attr[k].name, name) == 0)
      return &c->attr[k];
  return NULL;
}

/* ---- inputs as kiln tensors ------------------------------------------ */

/* The base tensor of t (out: *base), then its views; NULL when kiln refuses. */
static kiln_tensor *ref_make(const ref_tensor *t, kiln_tensor **base)
{
  size_t es = kiln_dtype_size(t->dt);
  size_t n = (size_t)t->numel;
  unsigned char *buf = calloc(n ? n : 1, es ? es : 1);
  for (size_t k = 0; k < n; k++) {
    switch (t->dt) {
    case KILN_F32: ((float *)buf)[k] = (float)t->f[k]; break;
    case KILN_F64: ((double *)buf)[k] = t->f[k]; break;
    case KILN_I64: ((int64_t *)buf)[k] = t->i[k]; break;
    case KILN_BOOL: buf[k] = t->i[k] != 0; break;
    /* the file's values are exact in these */
    case KILN_I32: ((int32_t *)buf)[k] = (int32_t)t->i[k]; break;
    case KILN_F16: ((uint16_t *)buf)[k] = half_from_float((float)t->f[k]); break;
    case KILN_BF16: ((uint16_t *)buf)[k] = bf16_from_float((float)t->f[k]); break;
    }
  }
  kiln_tensor *x = kiln_tensor_from(t->dt, t->ndim, t->shape, buf);
  free(buf);
  if (base)
    *base = x;
  for (int k = 0; k < t->nviews; k++) {
    const ref_view *v = &t->views[k];
    int perm[KILN_MAX_DIMS];
    switch (v->kind) {
    case 't': x = kiln_transpose(x, (int)v->a[0], (int)v->a[1]); break;
    case 's': x = kiln_slice(x, (int)v->a[0], v->a[1], v->a[2], v->a[3]); break;
    case 'e': x = kiln_expand(x, v->n, v->a); break;
    case 'p':
      for (int j = 0; j < v->n; j++)
        perm[j] = (int)v->a[j];
      x = kiln_permute(x, perm);
      break;
    }
  }
  return x;
}

/* ---- description ----------------------------------------------------- */

static void ref_shape_str(kiln_dtype dt, int ndim, const int64_t *shape, char *buf, size_t n)
{
  int w = snprintf(buf, n, "%s[", kiln_dtype_name(dt));
  for (int k = 0; k < ndim && w > 0 && (size_t)w < n; k++)
    w += snprintf(buf + w, n - (size_t)w, "%s%lld", k ? "," : "", (long long)shape[k]);
  if (w > 0 && (size_t)w < n)
    snprintf(buf + w, n - (size_t)w, "]");
}

/* The shape a ref_tensor has after its views (what the op receives). */
static void ref_view_shape(const ref_tensor *t, int *ndim, int64_t *shape)
{
  *ndim = t->ndim;
  memcpy(shape, t->shape, sizeof t->shape);
  for (int k = 0; k < t->nviews; k++) {
    const ref_view *v = &t->views[k];
    int64_t tmp[KILN_MAX_DIMS];
    switch (v->kind) {
    case 't': {
      int64_t s = shape[v->a[0]];
      shape[v->a[0]] = shape[v->a[1]];
      shape[v->a[1]] = s;
      break;
    }
    case 'p':
      for (int j = 0; j < v->n; j++)
        tmp[j] = shape[v->a[j]];
      memcpy(shape, tmp, (size_t)v->n * sizeof *tmp);
      break;
    case 'e':
      *ndim = v->n;
      memcpy(shape, v->a, (size_t)v->n * sizeof *shape);
      break;
    case 's': { /* the generator only emits in-range steps of the Python rules */
      int64_t len = shape[v->a[0]], st = v->a[1], en = v->a[2], step = v->a[3];
      if (st < 0) st += len;
      if (en < 0) en += len;
      st = st < 0 ? 0 : st > len ? len : st;
      en = en < 0 ? 0 : en > len ? len : en;
      shape[v->a[0]] = en > st ? (en - st + step - 1) / step : 0;
      break;
    }
    }
  }
}

/* "case 12 [binary add]: in f32[3,4] (transpose 0 1), f32[4] -> f32[3,4]" */
static void ref_describe(const refcase *c, FILE *fp)
{
  char b[128];
  fprintf(fp, "case %d [%s %s]:", c->index, c->family, c->op);
  for (int k = 0; k < c->nattr; k++) {
    fprintf(fp, " %s=", c->attr[k].name);
    for (int j = 0; j < c->attr[k].n; j++)
      fprintf(fp, "%s%.17g", j ? "," : "", c->attr[k].v[j]);
  }
  fprintf(fp, " in");
  for (int k = 0; k < c->nin; k++) {
    const ref_tensor *t = &c->in[k];
    int nd;
    int64_t sh[KILN_MAX_DIMS];
    ref_view_shape(t, &nd, sh);
    ref_shape_str(t->dt, nd, sh, b, sizeof b);
    fprintf(fp, "%s %s", k ? "," : "", b);
    if (t->nviews) {
      ref_shape_str(t->dt, t->ndim, t->shape, b, sizeof b);
      fprintf(fp, " (from %s by", b);
      for (int v = 0; v < t->nviews; v++) {
        const ref_view *w = &t->views[v];
        fprintf(fp, " %s", w->kind == 't' ? "transpose" : w->kind == 's' ? "slice" : w->kind == 'p' ? "permute" : "expand");
        for (int j = 0; j < w->n; j++)
          fprintf(fp, "%s%lld", j ? "," : " ", (long long)w->a[j]);
      }
      fprintf(fp, ")");
    }
  }
  fprintf(fp, " -> expected");
  for (int k = 0; k < c->nout; k++) {
    ref_shape_str(c->out[k].dt, c->out[k].ndim, c->out[k].shape, b, sizeof b);
    fprintf(fp, " %s", b);
  }
  fprintf(fp, "\n");
}

/* ---- comparison ------------------------------------------------------ */

static void ref_unravel(int64_t flat, int ndim, const int64_t *shape, char *buf, size_t n)
{
  int64_t idx[KILN_MAX_DIMS];
  for (int k = ndim - 1; k >= 0; k--) {
    idx[k] = shape[k] ? flat % shape[k] : 0;
    flat = shape[k] ? flat / shape[k] : 0;
  }
  int w = snprintf(buf, n, "[");
  for (int k = 0; k < ndim && w > 0 && (size_t)w < n; k++)
    w += snprintf(buf + w, n - (size_t)w, "%s%lld", k ? "," : "", (long long)idx[k]);
  if (w > 0 && (size_t)w < n)
    snprintf(buf + w, n - (size_t)w, "]");
}

/* Compares got with expected output oi of c; 0 when it matches. On a mismatch
 * prints the case, the max abs/rel difference and the first bad index. */
static int ref_check(const refcase *c, int oi, const kiln_tensor *got, FILE *fp)
{
  const ref_tensor *e = &c->out[oi];
  char want[128], have[128];
  if (!got) {
    ref_describe(c, fp);
    fprintf(fp, "  output %d: NULL: %s\n", oi, kiln_last_error());
    return 1;
  }
  int nd = kiln_ndim(got);
  int64_t sh[KILN_MAX_DIMS] = {0};
  for (int k = 0; k < nd && k < KILN_MAX_DIMS; k++)
    sh[k] = kiln_size(got, k);
  bool same = kiln_type(got) == e->dt && nd == e->ndim;
  for (int k = 0; same && k < nd; k++)
    same = sh[k] == e->shape[k];
  if (!same) {
    ref_shape_str(e->dt, e->ndim, e->shape, want, sizeof want);
    ref_shape_str(kiln_type(got), nd, sh, have, sizeof have);
    ref_describe(c, fp);
    fprintf(fp, "  output %d: expected %s, got %s\n", oi, want, have);
    return 1;
  }
  size_t es = kiln_dtype_size(e->dt), n = (size_t)e->numel;
  unsigned char *buf = calloc(n ? n : 1, es);
  if (kiln_read(got, buf, n * es) != 0) {
    ref_describe(c, fp);
    fprintf(fp, "  output %d: kiln_read failed: %s\n", oi, kiln_last_error());
    free(buf);
    return 1;
  }
  int64_t nbad = 0, first = -1;
  double max_abs = 0, max_rel = 0, first_want = 0, first_got = 0;
  for (size_t k = 0; k < n; k++) {
    double g, x;
    bool ok;
    if (e->dt == KILN_F32 || e->dt == KILN_F64 || e->dt == KILN_F16 || e->dt == KILN_BF16) {
      uint16_t h = e->dt == KILN_F16 || e->dt == KILN_BF16 ? ((uint16_t *)buf)[k] : 0;
      g = e->dt == KILN_F32    ? (double)((float *)buf)[k]
          : e->dt == KILN_F64  ? ((double *)buf)[k]
          : e->dt == KILN_F16  ? (double)half_to_float(h)
                               : (double)bf16_to_float(h);
      x = e->f[k];
      double d = fabs(g - x);
      ok = (isnan(x) && isnan(g)) || g == x || d <= c->atol + c->rtol * fabs(x);
      if (!isnan(d)) {
        if (d > max_abs) max_abs = d;
        if (x != 0 && d / fabs(x) > max_rel) max_rel = d / fabs(x);
      } else if (!ok) {
        max_abs = max_rel = NAN;
      }
    } else if (e->dt == KILN_I64 || e->dt == KILN_I32) {
      int64_t gi = e->dt == KILN_I64 ? ((int64_t *)buf)[k] : ((int32_t *)buf)[k];
      ok = gi == e->i[k];
      g = (double)gi;
      x = (double)e->i[k];
      if (!ok && fabs(g - x) > max_abs) max_abs = fabs(g - x);
    } else {
      /* a bool must read back as exactly 0 or 1 */
      ok = buf[k] == (unsigned char)e->i[k];
      g = buf[k];
      x = (double)e->i[k];
      if (!ok) max_abs = 1;
    }
    if (!ok) {
      if (first < 0) {
        first = (int64_t)k;
        first_want = x;
        first_got = g;
      }
      nbad++;
    }
  }
  free(buf);
  if (!nbad)
    return 0;
  char at[128];
  ref_unravel(first, e->ndim, e->shape, at, sizeof at);
  ref_describe(c, fp);
  fprintf(fp, "  output %d: %lld of %zu elements differ; max abs diff %.3g, max rel diff %.3g "
              "(rtol %.3g, atol %.3g); first bad index %lld %s: expected %.17g, got %.17g\n",
          oi, (long long)nbad, n, max_abs, max_rel, c->rtol, c->atol, (long long)first, at, first_want,
          first_got);
  return 1;
}

#endif
