/* Fuzzes the eager API: the bytes are a program of eager calls on a small
 * pool of tensors of random shapes (0 to 4 dims, sizes 0 to 5), dtypes (f32,
 * f64, i64, bool) and layouts (transposed, sliced, expanded, reshaped views),
 * with valid and invalid arguments. Every call either returns a tensor or
 * NULL with kiln_last_error() naming the op and this file's line. A result
 * of the ops with a simple reference here (pointwise, reductions, matmul,
 * views, cat, softmax, where) must match naive loops in double; so must a
 * refusal: an op the reference knows to be valid must not fail, nor one it
 * knows to be invalid succeed. All tensors live in one scope, closed at the
 * end, and the bytes in use must come back to where they started. */
#include <math.h>
#include <string.h>

#include "fuzz/fuzz.h"
#include "kiln.h"

enum { POOL = 12, MAX_STEPS = 64, MAX_NUMEL = 4096, ND = KILN_MAX_DIMS };

/* A tensor's logical (row-major) values in double, with a magnitude per
 * element that scales the tolerance (sum of |terms| for sums and products). */
typedef struct ref {
  int nd;
  int64_t sh[ND];
  int64_t n;
  kiln_dtype dt;
  double *v, *m;
} ref;

static kiln_tensor *pool[POOL];
static int n_pool, next_slot; /* both reset per input: a finding must replay from its bytes alone */
static bool verbose;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  verbose = getenv("KILN_FUZZ_VERBOSE") != NULL;
  kiln_set_num_threads(1);
  return 0;
}

static void ref_init(ref *r, kiln_dtype dt, int nd, const int64_t *sh) {
  r->dt = dt, r->nd = nd, r->n = 1;
  for (int i = 0; i < nd; i++) r->sh[i] = sh[i], r->n *= sh[i];
  r->v = calloc((size_t)r->n + 1, sizeof(double));
  r->m = calloc((size_t)r->n + 1, sizeof(double));
}
static void ref_free(ref *r) {
  free(r->v), free(r->m);
  r->v = r->m = NULL;
}

/* The values of t, read back through kiln_read in its own dtype. */
static void ref_read(kiln_tensor *t, ref *r) {
  int64_t sh[ND];
  for (int i = 0; i < kiln_ndim(t); i++) sh[i] = kiln_size(t, i);
  ref_init(r, kiln_type(t), kiln_ndim(t), sh);
  size_t es = kiln_dtype_size(r->dt);
  unsigned char *raw = malloc((size_t)r->n * es + 1);
  FUZZ_CHECK(kiln_read(t, raw, (size_t)r->n * es) == 0, "kiln_read failed: %s", kiln_last_error());
  for (int64_t i = 0; i < r->n; i++) {
    switch (r->dt) {
    case KILN_F32: { float f; memcpy(&f, raw + i * 4, 4); r->v[i] = f; break; }
    case KILN_F64: memcpy(&r->v[i], raw + i * 8, 8); break;
    case KILN_I64: { int64_t k; memcpy(&k, raw + i * 8, 8); r->v[i] = (double)k; break; }
    default: r->v[i] = raw[i] != 0; break;
    }
    r->m[i] = fabs(r->v[i]);
  }
  free(raw);
}

/* Row-major strides of a shape. */
static void strides_of(int nd, const int64_t *sh, int64_t *st) {
  int64_t s = 1;
  for (int i = nd - 1; i >= 0; i--) st[i] = s, s *= sh[i];
}
/* Multi-index of flat i in shape sh. */
static void unflat(int64_t i, int nd, const int64_t *sh, int64_t *ix) {
  for (int d = nd - 1; d >= 0; d--) {
    ix[d] = sh[d] ? i % sh[d] : 0;
    i = sh[d] ? i / sh[d] : 0;
  }
}
/* Flat index into a (nd, sh) tensor of the broadcast index ix of rank ond. */
static int64_t bflat(const int64_t *ix, int ond, int nd, const int64_t *sh) {
  int64_t f = 0;
  for (int d = 0; d < nd; d++) {
    int64_t k = sh[d] == 1 ? 0 : ix[ond - nd + d];
    f = f * sh[d] + k;
  }
  return f;
}

static bool is_float(kiln_dtype dt) { return dt == KILN_F32 || dt == KILN_F64; }

/* Broadcast shape of a and b (NumPy), or false. */
static bool bshape(int na, const int64_t *a, int nb, const int64_t *b, int *nd, int64_t *sh) {
  int n = na > nb ? na : nb;
  for (int i = 0; i < n; i++) {
    int64_t x = i - (n - na) >= 0 ? a[i - (n - na)] : 1, y = i - (n - nb) >= 0 ? b[i - (n - nb)] : 1;
    if (x != y && x != 1 && y != 1) return false;
    sh[i] = x == 1 ? y : x;
  }
  *nd = n;
  return true;
}

/* ---- checking one call ---- */

typedef enum { REF_INVALID, REF_VALID, REF_UNSURE } verdict;

static const char *cur_op;
static int cur_line;

/* got: kiln's result; want: REF_VALID with r filled, REF_INVALID or REF_UNSURE. */
static kiln_tensor *check(kiln_tensor *got, verdict want, ref *r, double eps) {
  const char *e = kiln_last_error();
  if (!got) {
    char place[160], alt[160];
    snprintf(place, sizeof place, "fuzz_eager.c:%d: kiln_%s: ", cur_line, cur_op);
    /* the _axes forms report the op they share with the one-axis form (kiln_max_axes: kiln_max) */
    size_t n = strlen(cur_op);
    int base = n > 5 && !strcmp(cur_op + n - 5, "_axes") ? (int)n - 5 : (int)n;
    snprintf(alt, sizeof alt, "fuzz_eager.c:%d: kiln_%.*s: ", cur_line, base, cur_op);
    FUZZ_CHECK(strstr(e, place) || strstr(e, alt), "a failed kiln_%s says '%s' (want it to contain '%s')", cur_op, e, place);
    FUZZ_CHECK(want != REF_VALID, "kiln_%s refused a valid call: %s", cur_op, e);
    if (verbose) fprintf(stderr, "  refused: %s\n", e);
    if (r) ref_free(r);
    return NULL;
  }
  FUZZ_CHECK(want != REF_INVALID, "kiln_%s (line %d) accepted an invalid call", cur_op, cur_line);
  if (kiln_numel(got) > MAX_NUMEL) {
    if (r) ref_free(r);
    return NULL; /* valid, but too large to keep working with */
  }
  if (want == REF_VALID) {
    char d[128];
    FUZZ_CHECK(kiln_type(got) == r->dt, "kiln_%s: dtype %s, want %s", cur_op, kiln_dtype_name(kiln_type(got)),
               kiln_dtype_name(r->dt));
    FUZZ_CHECK(kiln_ndim(got) == r->nd, "kiln_%s: %s, want rank %d", cur_op, kiln_describe(got, d, sizeof d), r->nd);
    for (int i = 0; i < r->nd; i++)
      FUZZ_CHECK(kiln_size(got, i) == r->sh[i], "kiln_%s: %s, want dim %d = %lld", cur_op, kiln_describe(got, d, sizeof d),
                 i, (long long)r->sh[i]);
    ref k;
    ref_read(got, &k);
    for (int64_t i = 0; i < r->n; i++) {
      double want_v = r->dt == KILN_F32 ? (double)(float)r->v[i] : r->v[i], x = k.v[i];
      if (isnan(want_v) || x == want_v) continue;
      if (isinf(x) && fabs(want_v) > 1e38 && (x > 0) == (want_v > 0)) continue; /* overflow at the edge */
      double tol = eps * (1 + fabs(want_v) + r->m[i]);
      FUZZ_CHECK(fabs(x - want_v) <= tol, "kiln_%s (line %d): element %lld is %.17g, the reference %.17g (tolerance %g)",
                 cur_op, cur_line, (long long)i, x, want_v, tol);
    }
    ref_free(&k);
    ref_free(r);
  }
  /* a full pool replaces its entries in turn (the scope still owns them) */
  if (n_pool < POOL) pool[n_pool++] = got;
  else pool[next_slot++ % POOL] = got;
  return got;
}

#define CALL(name, expr) (kiln_clear_error(), cur_op = (name), cur_line = __LINE__, (expr))

static double eps_of(kiln_dtype dt) { return dt == KILN_F32 ? 2e-5 : 1e-12; }

/* ---- building blocks of the program ---- */

static kiln_dtype pick_dtype(fuzz_in *f) { return (kiln_dtype)fuzz_pick(f, 4); }
static int pick_shape(fuzz_in *f, int64_t *sh) {
  int nd = fuzz_pick(f, 5);
  for (int i = 0; i < nd; i++) sh[i] = fuzz_pick(f, 6);
  return nd;
}
static kiln_tensor *pick_t(fuzz_in *f) { return n_pool ? pool[fuzz_pick(f, n_pool)] : NULL; }
/* An axis, sometimes out of range. */
static int pick_axis(fuzz_in *f, int nd) { return fuzz_pick(f, 2 * nd + 3) - nd - 1; }
static bool axis_ok(int ax, int nd) { return ax >= -nd && ax < nd; }
static int norm_axis(int ax, int nd) { return ax < 0 ? ax + nd : ax; }

static void make_tensor(fuzz_in *f) {
  int64_t sh[ND];
  int nd = pick_shape(f, sh);
  kiln_dtype dt = pick_dtype(f);
  uint64_t seed = fuzz_byte(f);
  switch (fuzz_pick(f, 5)) {
  case 0:
    if (is_float(dt)) CALL("randn", check(kiln_randn(dt, nd, sh, seed), REF_UNSURE, NULL, 0));
    else CALL("full", check(kiln_full(dt, nd, sh, (double)fuzz_pick(f, 7) - 3), REF_UNSURE, NULL, 0));
    break;
  case 1: { /* values the bytes choose, small integers or halves */
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= sh[i];
    double *v = malloc(sizeof(double) * (size_t)(n + 1));
    for (int64_t i = 0; i < n; i++) v[i] = ((double)fuzz_pick(f, 17) - 8) / (is_float(dt) ? 2 : 1);
    kiln_tensor *t64 = CALL("tensor_from", check(kiln_tensor_from(KILN_F64, nd, sh, v), REF_UNSURE, NULL, 0));
    free(v);
    if (t64 && dt != KILN_F64) CALL("cast", check(kiln_cast(t64, dt), REF_UNSURE, NULL, 0));
    break;
  }
  case 2: /* a bad shape: a negative size, or too many dims */
    if (fuzz_chance(f, 2) && nd > 0) sh[fuzz_pick(f, nd)] = -1 - fuzz_pick(f, 3);
    else nd = KILN_MAX_DIMS + 1;
    CALL("zeros", check(kiln_zeros(dt, nd, sh), REF_INVALID, NULL, 0));
    break;
  case 3: {
    double a = (double)fuzz_pick(f, 5) - 2, b = (double)fuzz_pick(f, 9) - 2, step = fuzz_pick(f, 4) * 0.5;
    CALL("arange", check(kiln_arange(dt, a, b, step), REF_UNSURE, NULL, 0));
    break;
  }
  default: CALL("rand", check(kiln_rand(is_float(dt) ? dt : KILN_F32, nd, sh, seed), REF_UNSURE, NULL, 0)); break;
  }
}

/* ---- ops with a reference ---- */

static double bin_ref(int op, double a, double b) {
  switch (op) {
  case 0: return a + b;
  case 1: return a - b;
  case 2: return a * b;
  case 3: return a / b;
  case 4: return isnan(a) || isnan(b) ? NAN : a > b ? a : b;
  case 5: return isnan(a) || isnan(b) ? NAN : a < b ? a : b;
  case 6: return a < b;
  default: return a == b;
  }
}
static const char *const bin_names[] = {"add", "sub", "mul", "div", "maximum", "minimum", "lt", "eq"};

static void binary(fuzz_in *f) {
  kiln_tensor *a = pick_t(f), *b = fuzz_chance(f, 16) ? NULL : pick_t(f);
  int op = fuzz_pick(f, 8);
  if (!a) return;
  kiln_tensor *(*fns[])(kiln_tensor *, kiln_tensor *, const char *, int) = {
      kiln_add_at, kiln_sub_at, kiln_mul_at, kiln_div_at, kiln_maximum_at, kiln_minimum_at, kiln_lt_at, kiln_eq_at};
  if (!b) {
    CALL(bin_names[op], check(fns[op](a, b, __FILE__, __LINE__), REF_INVALID, NULL, 0));
    return;
  }
  ref x, y, r;
  ref_read(a, &x), ref_read(b, &y);
  int nd;
  int64_t sh[ND];
  verdict want = REF_UNSURE;
  bool fits = bshape(x.nd, x.sh, y.nd, y.sh, &nd, sh);
  /* same float dtype: the reference knows; mixed dtypes and integer division it leaves alone */
  if (!fits) want = REF_INVALID;
  else if (x.dt == y.dt && is_float(x.dt)) want = REF_VALID;
  if (want == REF_VALID) {
    ref_init(&r, op >= 6 ? KILN_BOOL : x.dt, nd, sh);
    int64_t ix[ND];
    for (int64_t i = 0; i < r.n; i++) {
      unflat(i, nd, sh, ix);
      int64_t ia = bflat(ix, nd, x.nd, x.sh), ib = bflat(ix, nd, y.nd, y.sh);
      r.v[i] = bin_ref(op, x.v[ia], y.v[ib]);
      r.m[i] = op == 3 ? fabs(r.v[i]) : fabs(x.v[ia]) + fabs(y.v[ib]);
      if (op >= 6 && (isnan(x.v[ia]) || isnan(y.v[ib]))) r.v[i] = NAN; /* compares of NaN: not judged */
    }
  }
  ref_free(&x), ref_free(&y);
  /* the macro's line is this one: the call names it */
  CALL(bin_names[op], check(fns[op](a, b, __FILE__, __LINE__), want, want == REF_VALID ? &r : NULL, eps_of(kiln_type(a)) * 4));
}

static double un_ref(int op, double a) {
  if (isnan(a)) return NAN; /* NaN in, NaN out: not judged */
  switch (op) {
  case 0: return -a;
  case 1: return fabs(a);
  case 2: return exp(a);
  case 3: return tanh(a);
  case 4: return a > 0 ? a : 0;
  case 5: return sqrt(a);
  case 6: return log(a);
  default: return 1 / (1 + exp(-a));
  }
}
static const char *const un_names[] = {"neg", "abs", "exp", "tanh", "relu", "sqrt", "log", "sigmoid"};

static void unary(fuzz_in *f) {
  kiln_tensor *a = pick_t(f);
  int op = fuzz_pick(f, 8);
  if (!a) return;
  kiln_tensor *(*fns[])(kiln_tensor *, const char *, int) = {kiln_neg_at,  kiln_abs_at,  kiln_exp_at, kiln_tanh_at,
                                                             kiln_relu_at, kiln_sqrt_at, kiln_log_at, kiln_sigmoid_at};
  ref x, r;
  ref_read(a, &x);
  verdict want = is_float(x.dt) ? REF_VALID : REF_UNSURE;
  if (want == REF_VALID) {
    ref_init(&r, x.dt, x.nd, x.sh);
    for (int64_t i = 0; i < r.n; i++) r.v[i] = un_ref(op, x.v[i]), r.m[i] = fabs(r.v[i]);
  }
  ref_free(&x);
  /* vector math: a few ulps */
  CALL(un_names[op], check(fns[op](a, __FILE__, __LINE__), want, want == REF_VALID ? &r : NULL, eps_of(kiln_type(a)) * 8));
}

/* sum, mean, max, min over one axis */
static void reduce(fuzz_in *f) {
  kiln_tensor *a = pick_t(f);
  int op = fuzz_pick(f, 4);
  bool keep = fuzz_chance(f, 2);
  if (!a) return;
  int nd = kiln_ndim(a), ax = pick_axis(f, nd);
  static const char *const names[] = {"sum", "mean", "max", "min"};
  kiln_tensor *(*fns[])(kiln_tensor *, int, bool, const char *, int) = {kiln_sum_at, kiln_mean_at, kiln_max_at, kiln_min_at};
  ref x, r;
  ref_read(a, &x);
  verdict want = REF_UNSURE;
  if (nd > 0 && !axis_ok(ax, nd)) want = REF_INVALID;
  else if (nd > 0 && is_float(x.dt) && x.sh[norm_axis(ax, nd)] > 0) want = REF_VALID;
  if (want == REF_VALID) {
    int k = norm_axis(ax, nd), ond = 0;
    int64_t sh[ND], len = x.sh[k];
    for (int i = 0; i < nd; i++)
      if (i != k) sh[ond++] = x.sh[i];
      else if (keep) sh[ond++] = 1;
    ref_init(&r, x.dt, ond, sh);
    int64_t st[ND];
    strides_of(nd, x.sh, st);
    for (int64_t o = 0; o < r.n; o++) {
      /* the input index of output o with the reduced axis at 0 */
      int64_t ix[ND], oix[ND], base = 0;
      unflat(o, ond, sh, oix);
      for (int i = 0, j = 0; i < nd; i++) {
        if (i == k) ix[i] = 0, j += keep;
        else ix[i] = oix[j++];
        base += ix[i] * st[i];
      }
      double acc = op >= 2 ? x.v[base] : 0, mag = 0;
      bool nan_seen = false;
      for (int64_t t = 0; t < len; t++) {
        double v = x.v[base + t * st[k]];
        nan_seen |= isnan(v);
        mag += fabs(v);
        if (op < 2) acc += v;
        else if (op == 2 ? v > acc : v < acc) acc = v;
      }
      r.v[o] = nan_seen && op >= 2 ? NAN : op == 1 ? acc / (double)len : acc;
      r.m[o] = op == 1 ? mag / (double)len : mag;
    }
  }
  ref_free(&x);
  CALL(names[op], check(fns[op](a, ax, keep, __FILE__, __LINE__), want, want == REF_VALID ? &r : NULL, eps_of(kiln_type(a)) * 4));
}

static void matmul(fuzz_in *f) {
  kiln_tensor *a = pick_t(f), *b = pick_t(f);
  if (!a || !b) return;
  ref x, y, r;
  ref_read(a, &x), ref_read(b, &y);
  verdict want = REF_UNSURE;
  if (x.nd == 0 || y.nd == 0) want = REF_INVALID;
  else if (x.nd == 2 && y.nd == 2) want = x.sh[1] != y.sh[0] ? REF_INVALID : x.dt == y.dt && is_float(x.dt) ? REF_VALID : REF_UNSURE;
  if (want == REF_VALID) {
    int64_t M = x.sh[0], K = x.sh[1], N = y.sh[1];
    ref_init(&r, x.dt, 2, ((int64_t[]){M, N}));
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < N; j++)
        for (int64_t k = 0; k < K; k++) {
          r.v[i * N + j] += x.v[i * K + k] * y.v[k * N + j];
          r.m[i * N + j] += fabs(x.v[i * K + k] * y.v[k * N + j]);
        }
  }
  ref_free(&x), ref_free(&y);
  if (verbose) {
    char da[128], db[128];
    fprintf(stderr, "  matmul %s @ %s\n", kiln_describe(a, da, sizeof da), kiln_describe(b, db, sizeof db));
  }
  CALL("matmul", check(kiln_matmul(a, b), want, want == REF_VALID ? &r : NULL, eps_of(kiln_type(a)) * 4));
}

/* The view ops, valid and not: the reference moves the values by index. */
static void view(fuzz_in *f) {
  kiln_tensor *a = pick_t(f);
  if (!a) return;
  ref x, r;
  ref_read(a, &x);
  int nd = x.nd;
  int64_t ix[ND], jx[ND];
  switch (fuzz_pick(f, 6)) {
  case 0: { /* transpose */
    int d0 = pick_axis(f, nd), d1 = pick_axis(f, nd);
    verdict want = nd == 0 ? REF_UNSURE : axis_ok(d0, nd) && axis_ok(d1, nd) ? REF_VALID : REF_INVALID;
    if (want == REF_VALID) {
      int p = norm_axis(d0, nd), q = norm_axis(d1, nd);
      int64_t sh[ND];
      memcpy(sh, x.sh, sizeof sh);
      sh[p] = x.sh[q], sh[q] = x.sh[p];
      ref_init(&r, x.dt, nd, sh);
      for (int64_t i = 0; i < r.n; i++) {
        unflat(i, nd, sh, ix);
        memcpy(jx, ix, sizeof jx);
        jx[p] = ix[q], jx[q] = ix[p];
        r.v[i] = x.v[bflat(jx, nd, nd, x.sh)];
      }
    }
    CALL("transpose", check(kiln_transpose(a, d0, d1), want, want == REF_VALID ? &r : NULL, 0));
    break;
  }
  case 1: { /* slice, Python rules for the bounds */
    int dim = pick_axis(f, nd);
    int64_t start = fuzz_pick(f, 15) - 7, end = fuzz_pick(f, 15) - 7, step = fuzz_pick(f, 4);
    if (fuzz_chance(f, 4)) end = INT64_MAX;
    verdict want = nd > 0 && axis_ok(dim, nd) && step >= 1 ? REF_VALID : nd > 0 ? REF_INVALID : REF_UNSURE;
    if (want == REF_VALID) {
      int k = norm_axis(dim, nd);
      int64_t L = x.sh[k], s = start < 0 ? start + L : start, e = end < 0 ? end + L : end;
      s = s < 0 ? 0 : s > L ? L : s;
      e = e < 0 ? 0 : e > L ? L : e;
      int64_t cnt = e > s ? (e - s + step - 1) / step : 0, sh[ND];
      memcpy(sh, x.sh, sizeof sh);
      sh[k] = cnt;
      ref_init(&r, x.dt, nd, sh);
      for (int64_t i = 0; i < r.n; i++) {
        unflat(i, nd, sh, ix);
        ix[k] = s + ix[k] * step;
        r.v[i] = x.v[bflat(ix, nd, nd, x.sh)];
      }
    }
    CALL("slice", check(kiln_slice(a, dim, start, end, step), want, want == REF_VALID ? &r : NULL, 0));
    break;
  }
  case 2: { /* expand: size-1 dims (and new leading dims) to the bytes' sizes */
    int ond = nd + fuzz_pick(f, 3);
    if (ond > ND) ond = ND;
    int64_t sh[ND];
    bool ok = true;
    for (int i = 0; i < ond; i++) {
      int j = i - (ond - nd);
      int64_t want_sz = fuzz_pick(f, 5);
      if (j >= 0 && x.sh[j] != 1 && !fuzz_chance(f, 8)) want_sz = x.sh[j];
      sh[i] = want_sz;
      if (j >= 0 && x.sh[j] != 1 && x.sh[j] != want_sz) ok = false;
    }
    verdict want = ok ? REF_VALID : REF_INVALID;
    if (ok) {
      ref_init(&r, x.dt, ond, sh);
      for (int64_t i = 0; i < r.n; i++) {
        unflat(i, ond, sh, ix);
        r.v[i] = x.v[bflat(ix, ond, nd, x.sh)];
      }
    }
    CALL("expand", check(kiln_expand(a, ond, sh), want, ok ? &r : NULL, 0));
    break;
  }
  case 3: { /* reshape to a shape with the same count, or not */
    int64_t sh[ND];
    int ond = pick_shape(f, sh), neg = -1;
    if (fuzz_chance(f, 2)) { /* a shape from the count, maybe with -1 */
      ond = 0;
      int64_t left = x.n;
      while (left > 1 && ond < 3) {
        int64_t d = 1 + fuzz_pick(f, 3);
        if (left % d) d = 1;
        if (d == 1) d = left;
        sh[ond++] = d, left /= d;
      }
      if (x.n == 0) sh[ond++] = 0;
      if (ond > 0 && fuzz_chance(f, 2)) neg = fuzz_pick(f, ond), sh[neg] = -1;
    }
    int64_t cnt = 1;
    for (int i = 0; i < ond; i++)
      if (i != neg) cnt *= sh[i];
    verdict want = REF_UNSURE;
    bool bad_dim = false;
    for (int i = 0; i < ond; i++) bad_dim |= i != neg && sh[i] < 0;
    if (!bad_dim && neg < 0) want = cnt == x.n ? REF_VALID : REF_INVALID;
    if (!bad_dim && neg >= 0 && cnt > 0) {
      want = x.n % cnt ? REF_INVALID : REF_VALID;
      if (want == REF_VALID) sh[neg] = x.n / cnt;
    }
    if (want == REF_VALID) {
      ref_init(&r, x.dt, ond, sh);
      memcpy(r.v, x.v, sizeof(double) * (size_t)x.n);
      if (neg >= 0) sh[neg] = -1;
    }
    CALL("reshape", check(kiln_reshape(a, ond, sh), want, want == REF_VALID ? &r : NULL, 0));
    break;
  }
  case 4: { /* permute, a permutation or not */
    int perm[ND];
    for (int i = 0; i < nd; i++) perm[i] = i;
    for (int i = nd - 1; i > 0; i--) {
      int j = fuzz_pick(f, i + 1), t = perm[i];
      perm[i] = perm[j], perm[j] = t;
    }
    bool ok = true;
    if (nd > 0 && fuzz_chance(f, 6)) perm[fuzz_pick(f, nd)] = fuzz_pick(f, nd + 2) - 1, ok = false;
    int np[ND]; /* negative entries count from the end */
    for (int i = 0; i < nd; i++) np[i] = perm[i] < 0 ? perm[i] + nd : perm[i];
    if (!ok) { /* still a permutation by chance? */
      bool seen[ND + 2] = {0};
      ok = true;
      for (int i = 0; i < nd; i++) {
        if (np[i] < 0 || np[i] >= nd || seen[np[i]]) ok = false;
        else seen[np[i]] = true;
      }
    }
    if (ok) {
      int64_t sh[ND];
      for (int i = 0; i < nd; i++) sh[i] = x.sh[np[i]];
      ref_init(&r, x.dt, nd, sh);
      for (int64_t i = 0; i < r.n; i++) {
        unflat(i, nd, sh, ix);
        for (int d = 0; d < nd; d++) jx[np[d]] = ix[d];
        r.v[i] = x.v[bflat(jx, nd, nd, x.sh)];
      }
    }
    CALL("permute", check(kiln_permute(a, perm), ok ? REF_VALID : REF_INVALID, ok ? &r : NULL, 0));
    break;
  }
  default: { /* contiguous copy, or a dtype cast between floats */
    if (fuzz_chance(f, 2) || !is_float(x.dt)) {
      ref_init(&r, x.dt, nd, x.sh);
      memcpy(r.v, x.v, sizeof(double) * (size_t)x.n);
      CALL("contiguous", check(kiln_contiguous(a), REF_VALID, &r, 0));
    } else {
      kiln_dtype to = x.dt == KILN_F32 ? KILN_F64 : KILN_F32;
      ref_init(&r, to, nd, x.sh);
      memcpy(r.v, x.v, sizeof(double) * (size_t)x.n);
      CALL("cast", check(kiln_cast(a, to), REF_VALID, &r, 0));
    }
  }
  }
  ref_free(&x);
}

static void cat2(fuzz_in *f) {
  kiln_tensor *a = pick_t(f), *b = pick_t(f);
  if (!a || !b) return;
  ref x, y, r;
  ref_read(a, &x), ref_read(b, &y);
  int dim = pick_axis(f, x.nd);
  verdict want = REF_UNSURE;
  if (x.nd > 0 && x.nd == y.nd && x.dt == y.dt && axis_ok(dim, x.nd)) {
    int k = norm_axis(dim, x.nd);
    want = REF_VALID;
    for (int i = 0; i < x.nd; i++)
      if (i != k && x.sh[i] != y.sh[i]) want = REF_INVALID;
    if (want == REF_VALID) {
      int64_t sh[ND], ix[ND];
      memcpy(sh, x.sh, sizeof sh);
      sh[k] += y.sh[k];
      ref_init(&r, x.dt, x.nd, sh);
      for (int64_t i = 0; i < r.n; i++) {
        unflat(i, x.nd, sh, ix);
        if (ix[k] < x.sh[k]) r.v[i] = x.v[bflat(ix, x.nd, x.nd, x.sh)];
        else ix[k] -= x.sh[k], r.v[i] = y.v[bflat(ix, y.nd, y.nd, y.sh)];
      }
    }
  } else if (x.nd > 0 && x.nd == y.nd && !axis_ok(dim, x.nd)) {
    want = REF_INVALID;
  }
  ref_free(&x), ref_free(&y);
  CALL("cat", check(kiln_cat(((kiln_tensor *[]){a, b}), 2, dim), want, want == REF_VALID ? &r : NULL, 0));
}

static void softmax(fuzz_in *f) {
  kiln_tensor *a = pick_t(f);
  if (!a) return;
  ref x, r;
  ref_read(a, &x);
  int nd = x.nd, ax = pick_axis(f, nd);
  verdict want = REF_UNSURE;
  if (nd > 0 && !axis_ok(ax, nd)) want = REF_INVALID;
  else if (nd > 0 && is_float(x.dt) && x.sh[norm_axis(ax, nd)] > 0) want = REF_VALID;
  if (want == REF_VALID) {
    int k = norm_axis(ax, nd);
    int64_t st[ND], ix[ND];
    strides_of(nd, x.sh, st);
    ref_init(&r, x.dt, nd, x.sh);
    for (int64_t i = 0; i < r.n; i++) {
      unflat(i, nd, x.sh, ix);
      int64_t base = i - ix[k] * st[k];
      double mx = -INFINITY, s = 0;
      for (int64_t t = 0; t < x.sh[k]; t++) mx = fmax(mx, x.v[base + t * st[k]]);
      for (int64_t t = 0; t < x.sh[k]; t++) s += exp(x.v[base + t * st[k]] - mx);
      r.v[i] = isinf(mx) ? NAN : exp(x.v[i] - mx) / s; /* rows with an infinity: not judged */
      r.m[i] = 1;
    }
  }
  ref_free(&x);
  CALL("softmax", check(kiln_softmax(a, ax), want, want == REF_VALID ? &r : NULL, eps_of(kiln_type(a)) * 8));
}

static void where3(fuzz_in *f) {
  kiln_tensor *c = pick_t(f), *a = pick_t(f), *b = pick_t(f);
  if (!c || !a || !b) return;
  ref z, x, y, r;
  ref_read(c, &z), ref_read(a, &x), ref_read(b, &y);
  int nd, nd2;
  int64_t sh[ND], sh2[ND];
  verdict want = REF_UNSURE;
  bool fits = bshape(z.nd, z.sh, x.nd, x.sh, &nd, sh) && bshape(nd, sh, y.nd, y.sh, &nd2, sh2);
  if (!fits) want = REF_INVALID;
  else if (z.dt == KILN_BOOL && x.dt == y.dt) want = REF_VALID;
  if (want == REF_VALID) {
    int64_t ix[ND];
    ref_init(&r, x.dt, nd2, sh2);
    for (int64_t i = 0; i < r.n; i++) {
      unflat(i, nd2, sh2, ix);
      r.v[i] = z.v[bflat(ix, nd2, z.nd, z.sh)] ? x.v[bflat(ix, nd2, x.nd, x.sh)] : y.v[bflat(ix, nd2, y.nd, y.sh)];
    }
  }
  ref_free(&z), ref_free(&x), ref_free(&y);
  CALL("where", check(kiln_where(c, a, b), want, want == REF_VALID ? &r : NULL, 0));
}

/* Ops judged only on "a result or an error naming the op". */
static void other(fuzz_in *f) {
  kiln_tensor *a = pick_t(f), *b = pick_t(f);
  if (!a || !b) return;
  int ax = pick_axis(f, kiln_ndim(a));
  int axes[3] = {pick_axis(f, kiln_ndim(a)), pick_axis(f, kiln_ndim(a)), pick_axis(f, kiln_ndim(a))};
  switch (fuzz_pick(f, 14)) {
  case 0: CALL("var", check(kiln_var(a, ax, fuzz_pick(f, 3), fuzz_chance(f, 2)), REF_UNSURE, NULL, 0)); break;
  case 1: CALL("argmax", check(kiln_argmax(a, ax, fuzz_chance(f, 2)), REF_UNSURE, NULL, 0)); break;
  case 2: CALL("sum_axes", check(kiln_sum_axes(a, axes, fuzz_pick(f, 4), fuzz_chance(f, 2)), REF_UNSURE, NULL, 0)); break;
  case 3: CALL("max_axes", check(kiln_max_axes(a, axes, fuzz_pick(f, 4), fuzz_chance(f, 2)), REF_UNSURE, NULL, 0)); break;
  case 4: CALL("squeeze", check(kiln_squeeze(a, ax), REF_UNSURE, NULL, 0)); break;
  case 5: CALL("unsqueeze", check(kiln_unsqueeze(a, pick_axis(f, kiln_ndim(a) + 1)), REF_UNSURE, NULL, 0)); break;
  case 6: CALL("stack", check(kiln_stack(((kiln_tensor *[]){a, b}), 2, ax), REF_UNSURE, NULL, 0)); break;
  case 7: CALL("log_softmax", check(kiln_log_softmax(a, ax), REF_UNSURE, NULL, 0)); break;
  case 8: CALL("index_select", check(kiln_index_select(a, ax, b), REF_UNSURE, NULL, 0)); break;
  case 9: CALL("layer_norm", check(kiln_layer_norm(a, fuzz_chance(f, 2) ? b : NULL, NULL, 1e-5), REF_UNSURE, NULL, 0)); break;
  case 10: CALL("add_", check(kiln_add_(a, b), REF_UNSURE, NULL, 0)); break;
  case 11: CALL("copy_", check(kiln_copy_(a, b), REF_UNSURE, NULL, 0)); break;
  case 12: CALL("pow", check(kiln_pow(a, b), REF_UNSURE, NULL, 0)); break;
  default: CALL("cross_entropy", check(kiln_cross_entropy(a, b), REF_UNSURE, NULL, 0)); break;
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_in f = {data, size, 0};
  size_t mem0 = kiln_mem_in_use();
  kiln_scope_begin();
  n_pool = next_slot = 0;
  for (int s = 0; s < MAX_STEPS && fuzz_left(&f); s++) {
    int k = fuzz_pick(&f, 16);
    if (verbose) fprintf(stderr, "step %d: kind %d (pool %d)\n", s, k, n_pool);
    if (n_pool < 2 || k < 2) make_tensor(&f);
    else if (k < 5) binary(&f);
    else if (k < 7) unary(&f);
    else if (k < 9) reduce(&f);
    else if (k < 10) matmul(&f);
    else if (k < 13) view(&f);
    else if (k < 14) cat2(&f);
    else if (k < 15) fuzz_chance(&f, 2) ? softmax(&f) : where3(&f);
    else other(&f);
  }
  kiln_scope_end();
  n_pool = 0;
  FUZZ_CHECK(kiln_mem_in_use() == mem0, "tensor bytes in use: %zu before, %zu after the scope closed", mem0,
             kiln_mem_in_use());
  return 0;
}
