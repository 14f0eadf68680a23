/* Tensors: reference-counted views over reference-counted storage, creation,
 * inspection, scopes, and the counter-based random generator. */
#include <ctype.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "eager/eager.h"
#include "eager/half.h"
#include "eager/pool.h"

/* ---- sizes and layout ---- */

size_t kiln_dtype_size(kiln_dtype dt) {
  switch (dt) {
  case KILN_F32: return 4;
  case KILN_F64: return 8;
  case KILN_I64: return 8;
  case KILN_BOOL: return 1;
  case KILN_I32: return 4;
  case KILN_F16:
  case KILN_BF16: return 2;
  }
  return 0;
}

const char *kiln_dtype_name(kiln_dtype dt) {
  switch (dt) {
  case KILN_F32: return "f32";
  case KILN_F64: return "f64";
  case KILN_I64: return "i64";
  case KILN_BOOL: return "bool";
  case KILN_I32: return "i32";
  case KILN_F16: return "f16";
  case KILN_BF16: return "bf16";
  }
  return "?";
}

int64_t shape_numel(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  return n;
}

void contiguous_strides(int ndim, const int64_t *shape, int64_t *stride) {
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    stride[i] = s;
    s *= shape[i] > 1 ? shape[i] : 1;
  }
}

bool tensor_covers_storage(const kiln_tensor *t) {
  return t->offset == 0 && tensor_contiguous(t) &&
         (size_t)shape_numel(t->ndim, t->shape) * kiln_dtype_size(t->dtype) == t->st->bytes;
}

bool tensor_same_view(const kiln_tensor *a, const kiln_tensor *b) {
  return a->st == b->st && a->dtype == b->dtype && a->offset == b->offset && a->ndim == b->ndim &&
         !memcmp(a->shape, b->shape, sizeof(int64_t) * (size_t)a->ndim) &&
         !memcmp(a->stride, b->stride, sizeof(int64_t) * (size_t)a->ndim);
}

bool tensor_contiguous(const kiln_tensor *t) {
  int64_t s = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    if (t->shape[i] == 0) return true;
    if (t->shape[i] != 1 && t->stride[i] != s) return false;
    s *= t->shape[i];
  }
  return true;
}

/* Checks a user-given shape: rank in range, sizes >= 0, element count and byte
 * count that fit in int64. */
static int check_shape(const char *op, int ndim, const int64_t *shape, kiln_dtype dt, const char *file,
                       int line) {
  if (ndim < 0 || ndim > MAXD) return err_set(file, line, op, "rank %d is outside 0..%d", ndim, MAXD), -1;
  if (ndim > 0 && !shape) return err_set(file, line, op, "shape is NULL for rank %d", ndim), -1;
  if (!dtype_valid(dt)) return err_set(file, line, op, "unknown dtype %d", (int)dt), -1;
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0) return err_set(file, line, op, "size %" PRId64 " of dim %d is negative", shape[i], i), -1;
    if (shape[i] && n > INT64_MAX / 8 / shape[i]) {
      char b[SHAPE_BUF];
      return err_set(file, line, op, "shape %s has too many elements", err_shape(b, ndim, shape)), -1;
    }
    n *= shape[i];
  }
  return 0;
}

/* ---- storage and tensors ---- */

/* Serial numbers never repeat (addresses do): the tracer tells tensors and storages apart by them. */
static atomic_ullong next_serial = 1;

uint64_t tensor_serial_now(void) { return atomic_load(&next_serial); }

static atomic_ullong storages_made;
uint64_t storage_count(void) { return atomic_load(&storages_made); }

_Static_assert(sizeof(storage) <= ALLOC_SMALL, "a storage header fits a small block");

static storage *storage_new(size_t bytes) {
  storage *s = alloc_small();
  if (!s) return NULL;
  atomic_fetch_add_explicit(&storages_made, 1, memory_order_relaxed);
  /* 64-byte aligned data so vector loads never split cache lines at the start */
  size_t rounded = (bytes + 63) & ~(size_t)63;
  s->data = alloc_aligned(rounded ? rounded : 64);
  if (!s->data) {
    alloc_small_free(s);
    return NULL;
  }
  atomic_init(&s->refcount, 1);
  atomic_init(&s->version, 0);
  s->serial = atomic_fetch_add(&next_serial, 1);
  s->bytes = bytes;
  s->meta = false;
  atomic_init(&s->name, NULL);
  alloc_track((int64_t)bytes);
  return s;
}

void storage_release_ref(storage *s);
static void storage_release(storage *s) { storage_release_ref(s); }
void storage_release_ref(storage *s) {
  if (atomic_fetch_sub(&s->refcount, 1) != 1) return;
  alloc_free(atomic_load(&s->name));
  if (s->data) {
    alloc_track(-(int64_t)s->bytes);
    alloc_aligned_free(s->data, (s->bytes + 63) & ~(size_t)63);
  }
  alloc_small_free(s);
}

/* A storage of bytes whose data a recording has yet to compute: no memory until materialized. */
static storage *storage_new_meta(size_t bytes) {
  storage *s = alloc_small();
  if (!s) return NULL;
  atomic_init(&s->refcount, 1);
  atomic_init(&s->version, 0);
  s->serial = atomic_fetch_add(&next_serial, 1);
  s->bytes = bytes;
  s->data = NULL;
  s->meta = true;
  atomic_init(&s->name, NULL);
  return s;
}

void storage_steal(storage *st, storage *src) {
  st->data = src->data; /* the bytes stay counted: they move, they are not new */
  st->meta = false;
  src->data = NULL;
  src->bytes = 0;
}

void storage_materialize(storage *st, void *data) {
  st->data = data;
  st->meta = false;
  alloc_track((int64_t)st->bytes);
}

/* Tensor headers: parked, never freed, when released (alloc_handle), so that
 * a tensor released twice, or used after its release, is reported in every
 * build. The last 4096 released headers are not reused: that is how long a
 * released tensor stays known as released. */
static handle_pool tensor_pool = HANDLE_POOL(kiln_tensor, sizeof(atomic_ullong), 4096);

static kiln_tensor *tensor_alloc(kiln_dtype dt, int ndim, const int64_t *shape) {
  kiln_tensor *t = alloc_handle(&tensor_pool);
  if (!t) return NULL;
  atomic_store(&t->refs, REF_ONE);
  t->serial = atomic_fetch_add(&next_serial, 1);
  t->dtype = dt;
  t->ndim = ndim;
  for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
  return t;
}

/* A contiguous tensor over a new storage (meta: no data until a recording materializes it). */
static kiln_tensor *tensor_make(kiln_dtype dt, int ndim, const int64_t *shape, bool meta) {
  kiln_tensor *t = tensor_alloc(dt, ndim, shape);
  if (!t) return NULL;
  size_t bytes = (size_t)shape_numel(ndim, shape) * kiln_dtype_size(dt);
  t->st = meta ? storage_new_meta(bytes) : storage_new(bytes);
  if (!t->st) {
    atomic_store(&t->refs, 0);
    alloc_handle_park(&tensor_pool, t);
    return NULL;
  }
  contiguous_strides(ndim, shape, t->stride);
  return t;
}

kiln_tensor *tensor_new(kiln_dtype dt, int ndim, const int64_t *shape) { return tensor_make(dt, ndim, shape, false); }
kiln_tensor *tensor_new_meta(kiln_dtype dt, int ndim, const int64_t *shape) { return tensor_make(dt, ndim, shape, true); }

kiln_tensor *tensor_view(kiln_tensor *base, int ndim, const int64_t *shape, const int64_t *stride,
                         int64_t offset) {
  kiln_tensor *t = tensor_alloc(base->dtype, ndim, shape);
  if (!t) return NULL;
  for (int i = 0; i < ndim; i++) t->stride[i] = stride[i];
  t->offset = offset;
  t->st = base->st;
  atomic_fetch_add(&t->st->refcount, 1);
  return t;
}

int tensor_check_live(const kiln_tensor *t, const char *what, const char *op, const char *file, int line) {
  /* only the reference word is read: the rest of a released header is stale */
  if (!t || tensor_refs(t) != 0) return 0;
  err_set(file, line, op, "%s was already released", what);
  return -1;
}

bool tensor_bad_arg(const kiln_tensor *t, const char *file, int line, const char *op, const char *what) {
  if (!t) return err_null(file, line, op, "%s", what), true;
  return tensor_check_live(t, what, op, file, line) != 0;
}

kiln_tensor *kiln_retain_at(kiln_tensor *t, const char *file, int line) {
  if (!t) return NULL;
  /* never from 0: a released tensor stays released */
  unsigned long long r = atomic_load(&t->refs);
  do {
    if ((uint32_t)r == 0) return tensor_check_live(t, "tensor", "retain", file, line), NULL;
  } while (!atomic_compare_exchange_weak(&t->refs, &r, r + REF_ONE));
  return t;
}

/* The last reference is gone: what t owns goes, and its header is parked. */
static void tensor_free(kiln_tensor *t) {
  if (t->grad) kiln_release(t->grad);
  if (t->grad_fn) ag_node_release(t->grad_fn);
  if (t->grad_if) kiln_release(t->grad_if);
  storage_release(t->st);
  t->st = NULL;
  t->grad = NULL;
  t->grad_fn = NULL;
  t->grad_if = NULL;
  t->grad_if_kind = 0;
  alloc_handle_park(&tensor_pool, t);
}

/* kiln_release returns nothing a caller could check: the error goes to stderr too. */
static void release_error(const char *file, int line, const char *why) {
  err_set(file, line, "release", "%s", why);
  fprintf(stderr, "kiln: error: %s\n", kiln_last_error());
}

void kiln_release_at(kiln_tensor *t, const char *file, int line) {
  if (!t) return;
  unsigned long long r = atomic_load(&t->refs);
  do {
    uint32_t all = (uint32_t)r, scoped = (uint32_t)(r >> 32);
    if (all == 0) {
      release_error(file, line, "tensor was already released");
      return;
    }
    if (all <= scoped) {
      release_error(file, line, "tensor belongs to a scope, which releases it at kiln_scope_end (kiln_keep it "
                                "to own it, or kiln_retain a reference of your own)");
      return;
    }
  } while (!atomic_compare_exchange_weak(&t->refs, &r, r - REF_ONE));
  if ((uint32_t)r == 1) tensor_free(t);
}

kiln_tensor *(kiln_retain)(kiln_tensor *t) { return kiln_retain_at(t, "", 0); }
void (kiln_release)(kiln_tensor *t) { kiln_release_at(t, "", 0); }
kiln_tensor *(kiln_keep)(kiln_tensor *t) { return kiln_keep_at(t, "", 0); }

/* ---- scopes ---- */

typedef struct scope {
  kiln_tensor **items;
  int n, cap;
} scope;
/* The first levels need no allocation, so the outermost scope always opens
 * (one that could not would leave its tensors to nobody); deeper ones grow
 * on the heap. */
#define SCOPES_INLINE 16
static _Thread_local scope scopes_inline[SCOPES_INLINE];
static KILN_TLS_HOT scope *scopes;
static KILN_TLS_HOT int nscopes, capscopes;
/* Scopes that could not be opened (out of memory), by the depth they stood
 * at: their scope_end must close nothing, so begin/end stay paired; their
 * tensors go to the scope below. */
static _Thread_local int phantom_at[64];
static KILN_TLS_HOT int nphantom;

static int scope_push(scope *s, kiln_tensor *t) {
  if (s->n == s->cap) {
    int cap = s->cap ? s->cap * 2 : 64;
    kiln_tensor **items = alloc_realloc(s->items, (size_t)cap * sizeof *items);
    if (!items) return -1;
    s->items = items;
    s->cap = cap;
  }
  s->items[s->n++] = t;
  return 0;
}

kiln_tensor *scope_adopt(kiln_tensor *t) {
  if (!t || nscopes == 0) return t;
  if (scope_push(&scopes[nscopes - 1], t) != 0) {
    kiln_release(t);
    return err_set("", 0, "scope", "out of memory (no room in the scope for a new tensor)");
  }
  atomic_fetch_add(&t->refs, REF_SCOPED - REF_ONE); /* the reference handed in is now the scope's */
  return t;
}

/* Drops the reference a scope held. */
static void scope_release(kiln_tensor *t) {
  uint64_t r = atomic_fetch_sub(&t->refs, REF_SCOPED);
  KILN_ASSERT((uint32_t)(r >> 32) >= 1 && (uint32_t)r >= 1);
  if ((uint32_t)r == 1) tensor_free(t);
}

void kiln_scope_begin(void) {
  if (!scopes) scopes = scopes_inline, capscopes = SCOPES_INLINE;
  if (nscopes == capscopes) {
    int cap = capscopes * 2;
    scope *s = scopes == scopes_inline ? alloc_malloc((size_t)cap * sizeof *s)
                                       : alloc_realloc(scopes, (size_t)cap * sizeof *s);
    if (!s) {
      if (nphantom < 64) phantom_at[nphantom++] = nscopes;
      err_set("", 0, "scope_begin", "out of memory");
      return;
    }
    if (scopes == scopes_inline) memcpy(s, scopes_inline, sizeof scopes_inline);
    scopes = s;
    capscopes = cap;
  }
  scopes[nscopes++] = (scope){0};
}

void kiln_scope_end(void) {
  if (nphantom && phantom_at[nphantom - 1] == nscopes) {
    nphantom--; /* the matching begin opened nothing */
    return;
  }
  if (nscopes == 0) return;
  scope *s = &scopes[--nscopes];
  for (int i = s->n - 1; i >= 0; i--) scope_release(s->items[i]);
  alloc_free(s->items);
  if (nscopes == 0 && scopes != scopes_inline) {
    alloc_free(scopes);
    scopes = NULL;
  }
}

kiln_tensor *kiln_keep_at(kiln_tensor *t, const char *file, int line) {
  if (tensor_check_live(t, "tensor", "keep", file, line)) return NULL;
  if (!t || nscopes == 0) return t;
  scope *s = &scopes[nscopes - 1];
  for (int i = s->n - 1; i >= 0; i--) {
    if (s->items[i] != t) continue;
    memmove(s->items + i, s->items + i + 1, (size_t)(s->n - i - 1) * sizeof *s->items);
    s->n--;
    if (nscopes >= 2 && scope_push(&scopes[nscopes - 2], t) != 0) {
      /* cannot move it out: leave it where it was rather than leak it */
      s->items[s->n++] = t;
      return err_set(file, line, "keep", "out of memory");
    }
    if (nscopes == 1) atomic_fetch_sub(&t->refs, REF_SCOPED - REF_ONE); /* now the caller's */
    return t;
  }
  return t;
}

/* ---- creation ---- */

/* While a recording runs, factories make its values instead of tensors with data. */
static const trace_hooks *recording(void) {
  const trace_hooks *h = dispatch_hooks();
  return h && h->record && h->factory ? h : NULL;
}

kiln_tensor *kiln_tensor_from_at(kiln_dtype dt, int ndim, const int64_t *shape, const void *data,
                                 const char *file, int line) {
  if (check_shape("tensor_from", ndim, shape, dt, file, line)) return NULL;
  int64_t n = shape_numel(ndim, shape);
  if (!data && n > 0) return err_set(file, line, "tensor_from", "data is NULL");
  const trace_hooks *h = recording();
  if (h) return scope_adopt(h->factory(h->ctx, FAC_DATA, dt, ndim, shape, 0, 0, false, data, file, line));
  kiln_tensor *t = tensor_new(dt, ndim, shape);
  if (!t) return err_set(file, line, "tensor_from", "out of memory");
  if (n) memcpy(t->st->data, data, (size_t)n * kiln_dtype_size(dt));
  return scope_adopt(t);
}

static kiln_tensor *full(const char *op, kiln_dtype dt, int ndim, const int64_t *shape, double v, const char *file,
                         int line) {
  if (check_shape(op, ndim, shape, dt, file, line)) return NULL;
  const trace_hooks *h = recording();
  if (h) {
    ag_shape_begin(shape);
    kiln_tensor *t = h->factory(h->ctx, FAC_FULL, dt, ndim, shape, v, 0, false, NULL, file, line);
    ag_shape_end();
    return scope_adopt(t);
  }
  kiln_tensor *t = tensor_new(dt, ndim, shape);
  if (!t) return err_set(file, line, op, "out of memory");
  pw_fill(t, v);
  return scope_adopt(t);
}

kiln_tensor *kiln_full_at(kiln_dtype dt, int ndim, const int64_t *shape, double v, const char *file, int line) {
  return full("full", dt, ndim, shape, v, file, line);
}

kiln_tensor *kiln_zeros_at(kiln_dtype dt, int ndim, const int64_t *shape, const char *file, int line) {
  return full("zeros", dt, ndim, shape, 0.0, file, line);
}

kiln_tensor *kiln_ones_at(kiln_dtype dt, int ndim, const int64_t *shape, const char *file, int line) {
  return full("ones", dt, ndim, shape, 1.0, file, line);
}

kiln_tensor *kiln_scalar_at(kiln_dtype dt, double v, const char *file, int line) {
  return full("scalar", dt, 0, NULL, v, file, line);
}

kiln_tensor *kiln_arange_at(kiln_dtype dt, double start, double stop, double step, const char *file, int line) {
  if (step == 0 || !isfinite(step) || !isfinite(start) || !isfinite(stop))
    return err_set(file, line, "arange", "bad range (%g, %g, step %g)", start, stop, step);
  if (dt == KILN_BOOL) return err_set(file, line, "arange", "dtype bool is not allowed");
  double count = ceil((stop - start) / step);
  if (count < 0) count = 0;
  if (count > 1e15) return err_set(file, line, "arange", "range (%g, %g, step %g) is too long", start, stop, step);
  int64_t n = (int64_t)count;
  if (recording()) {
    /* start + i * step from ops over n ones: the count is a number of the
     * graph, so positions up to a length that grows every call (a decode
     * loop) are one variant, not a constant that differs at every call.
     * In f64, as below, then cast: the same values */
    kiln_scope_begin();
    kiln_tensor *i = kiln_sub_at(kiln_cumsum_at(kiln_full_at(KILN_F64, 1, &n, 1, file, line), 0, file, line),
                                 kiln_scalar_at(KILN_F64, 1, file, line), file, line);
    kiln_tensor *v = kiln_add_at(kiln_mul_at(i, kiln_scalar_at(KILN_F64, step, file, line), file, line),
                                 kiln_scalar_at(KILN_F64, start, file, line), file, line);
    kiln_tensor *r = kiln_keep(kiln_cast_at(v, dt, file, line));
    kiln_scope_end();
    return r; /* kept: owned as an op result would be */
  }
  kiln_tensor *t = tensor_new(dt, 1, &n);
  if (!t) return err_set(file, line, "arange", "out of memory");
  for (int64_t i = 0; i < n; i++) {
    double v = start + (double)i * step;
    elem_store(dt, t->st->data, i, dtype_is_float(dt) ? v : (double)(int64_t)v);
  }
  return scope_adopt(t);
}

/* Counter-based generator: value i is a hash of (seed, i), so the numbers do
 * not depend on the tensor size, the machine or the thread count. */
static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static inline double unit_open(uint64_t key, uint64_t i) { /* in (0, 1] */
  return (double)((mix64(key + (i + 1) * 0x9E3779B97F4A7C15ull) >> 11) + 1) * 0x1p-53;
}

typedef struct rng_job {
  kiln_tensor *t;
  uint64_t key;
  uint64_t offset; /* element i is number offset + i of the stream */
  bool normal;
} rng_job;

static void rng_chunk(void *ctx, int64_t b, int64_t e) {
  rng_job *j = ctx;
  for (int64_t i = b; i < e; i++) {
    double v;
    uint64_t n = j->offset + (uint64_t)i;
    if (j->normal) {
      double u1 = unit_open(j->key, 2 * n), u2 = unit_open(j->key, 2 * n + 1);
      v = sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
    } else {
      v = 1.0 - unit_open(j->key, n); /* [0, 1) */
    }
    if (j->t->dtype == KILN_F64) {
      ((double *)j->t->st->data)[i] = v;
    } else {
      elem_store(j->t->dtype, j->t->st->data, i, v);
      /* rounding must not reach 1: the largest value below it instead */
      if (!j->normal && elem_load(j->t->dtype, j->t->st->data, i) >= 1.0)
        elem_store(j->t->dtype, j->t->st->data, i, 1.0 - (j->t->dtype == KILN_F32 ? 0x1p-24 : j->t->dtype == KILN_F16 ? 0x1p-11 : 0x1p-8));
    }
  }
}

static kiln_tensor *random_tensor(const char *op, bool normal, kiln_dtype dt, int ndim, const int64_t *shape,
                                  uint64_t seed, const char *file, int line) {
  if (check_shape(op, ndim, shape, dt, file, line)) return NULL;
  if (!dtype_is_float(dt)) return err_set(file, line, op, "dtype %s is not a float type", kiln_dtype_name(dt));
  const trace_hooks *h = recording();
  if (h) return scope_adopt(h->factory(h->ctx, FAC_RAND, dt, ndim, shape, 0, seed, normal, NULL, file, line));
  kiln_tensor *t = tensor_new(dt, ndim, shape);
  if (!t) return err_set(file, line, op, "out of memory");
  rng_job j = {t, mix64(seed ^ 0x6A09E667F3BCC909ull), 0, normal};
  pool_parallel_for(shape_numel(t->ndim, t->shape), 1 << 14, rng_chunk, &j);
  return scope_adopt(t);
}

/* ---- the default generator: a seed and how many numbers were drawn ---- */

static atomic_ullong gen_seed = 0x5eed5eed5eedull, gen_offset;

/* Calls on this thread that set kiln's own state (the generator's seed, the
 * thread count): a compiled call asks whether its body made one. */
static _Thread_local unsigned long settings;
unsigned long settings_count(void) { return settings; }
void settings_note(void) { settings++; }

void kiln_manual_seed(uint64_t seed) {
  settings_note();
  atomic_store(&gen_seed, seed);
  atomic_store(&gen_offset, 0);
}

void gen_state_get(uint64_t *seed, uint64_t *offset) {
  *seed = atomic_load(&gen_seed);
  *offset = atomic_load(&gen_offset);
}
void gen_state_set(uint64_t seed, uint64_t offset) {
  atomic_store(&gen_seed, seed);
  atomic_store(&gen_offset, offset);
}

/* Takes n numbers from the stream: *offset is the first one's index. A
 * normal number takes two uniforms, 2k and 2k+1 (rng_chunk): such a draw
 * starts at an even uniform, and its offset counts pairs. */
static void gen_draw(int64_t n, bool normal, uint64_t *seed, uint64_t *offset) {
  *seed = atomic_load(&gen_seed);
  if (!normal) {
    *offset = atomic_fetch_add(&gen_offset, (uint64_t)n);
    return;
  }
  uint64_t at = atomic_load(&gen_offset), start;
  do start = (at + 1) & ~1ull;
  while (!atomic_compare_exchange_weak(&gen_offset, &at, start + 2 * (uint64_t)n));
  *offset = start / 2;
}

int k_rand(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op, (void)in, (void)n;
  rng_job j = {out, mix64((uint64_t)a->seed.c ^ 0x6A09E667F3BCC909ull), (uint64_t)a->offset.c, a->flag};
  pool_parallel_for(shape_numel(out->ndim, out->shape), 1 << 14, rng_chunk, &j);
  return 0;
}

static kiln_tensor *draw_like(const char *op, kiln_tensor *x, bool normal, const char *file, int line) {
  if (tensor_bad_arg(x, file, line, op, "input 0")) return NULL;
  if (!dtype_is_float(x->dtype)) return err_set(file, line, op, "dtype %s is not a float type", kiln_dtype_name(x->dtype));
  uint64_t seed, offset;
  gen_draw(shape_numel(x->ndim, x->shape), normal, &seed, &offset);
  op_attrs a = {.flag = normal, .seed = sym_const((int64_t)seed), .offset = sym_const((int64_t)offset)};
  /* from the generator, not from x: no gradient flows to x */
  kiln_no_grad_begin();
  kiln_tensor *r = op_dispatch(OP_RAND, &x, 1, &a, file, line);
  kiln_no_grad_end();
  return r;
}

kiln_tensor *kiln_rand_like_at(kiln_tensor *x, const char *file, int line) { return draw_like("rand_like", x, false, file, line); }
kiln_tensor *kiln_randn_like_at(kiln_tensor *x, const char *file, int line) { return draw_like("randn_like", x, true, file, line); }

kiln_tensor *kiln_randn_at(kiln_dtype dt, int ndim, const int64_t *shape, uint64_t seed, const char *file,
                           int line) {
  return random_tensor("randn", true, dt, ndim, shape, seed, file, line);
}

kiln_tensor *kiln_rand_at(kiln_dtype dt, int ndim, const int64_t *shape, uint64_t seed, const char *file,
                          int line) {
  return random_tensor("rand", false, dt, ndim, shape, seed, file, line);
}

/* ---- inspection ---- */

/* These take no caller's line: a released tensor gives the NULL answer and an error without one. */
static bool gone(const kiln_tensor *t, const char *op) { return !t || tensor_check_live(t, "tensor", op, "", 0); }

/* The caller looked at metadata it can branch on: a recording must run the body again on every call. */
void meta_read(const kiln_tensor *t, int dim) {
  const trace_hooks *h = dispatch_hooks();
  if (h && h->size_read) h->size_read(h->ctx, t, dim);
}

int kiln_ndim(const kiln_tensor *t) {
  if (gone(t, "ndim")) return -1;
  meta_read(t, -1);
  return t->ndim;
}
int64_t kiln_numel(const kiln_tensor *t) {
  if (gone(t, "numel")) return -1;
  meta_read(t, -1);
  return shape_numel(t->ndim, t->shape);
}
kiln_dtype kiln_type(const kiln_tensor *t) {
  if (gone(t, "type")) return KILN_F32;
  meta_read(t, -1);
  return t->dtype;
}
bool kiln_is_contiguous(const kiln_tensor *t) {
  if (gone(t, "is_contiguous")) return false;
  meta_read(t, -1);
  return tensor_contiguous(t);
}

int64_t kiln_size(const kiln_tensor *t, int dim) {
  if (gone(t, "size")) return -1;
  int d = axis_norm(dim, t->ndim);
  if (d < 0) return -1;
  meta_read(t, d);
  return t->shape[d];
}

int64_t kiln_stride(const kiln_tensor *t, int dim) {
  if (gone(t, "stride")) return -1;
  int d = axis_norm(dim, t->ndim);
  if (d >= 0) meta_read(t, d);
  return d < 0 ? -1 : t->stride[d];
}

double tensor_get(const kiln_tensor *t, int64_t linear) {
  int64_t off = t->offset;
  for (int i = t->ndim - 1; i >= 0; i--) {
    off += (linear % t->shape[i]) * t->stride[i];
    linear /= t->shape[i];
  }
  return elem_load(t->dtype, t->st->data, off);
}

double elem_load(kiln_dtype dt, const void *base, int64_t i) {
  switch (dt) {
  case KILN_F32: return ((const float *)base)[i];
  case KILN_F64: return ((const double *)base)[i];
  case KILN_I64: return (double)((const int64_t *)base)[i];
  case KILN_BOOL: return ((const bool *)base)[i];
  case KILN_I32: return ((const int32_t *)base)[i];
  case KILN_F16: return half_to_float(((const uint16_t *)base)[i]);
  case KILN_BF16: return bf16_to_float(((const uint16_t *)base)[i]);
  }
  return 0;
}

void elem_store(kiln_dtype dt, void *base, int64_t i, double v) {
  switch (dt) {
  case KILN_F32: ((float *)base)[i] = (float)v; break;
  case KILN_F64: ((double *)base)[i] = v; break;
  case KILN_I64: ((int64_t *)base)[i] = v != v ? 0 : v >= 0x1p63 ? INT64_MAX : v <= -0x1p63 ? INT64_MIN : (int64_t)v; break;
  case KILN_BOOL: ((bool *)base)[i] = v != 0; break;
  case KILN_I32: ((int32_t *)base)[i] = v != v ? 0 : v >= 0x1p31 ? INT32_MAX : v <= -0x1p31 ? INT32_MIN : (int32_t)v; break;
  case KILN_F16: ((uint16_t *)base)[i] = half_from_float(half_f64_odd(v)); break;
  case KILN_BF16: ((uint16_t *)base)[i] = bf16_from_float(half_f64_odd(v)); break;
  }
}

int kiln_read_at(const kiln_tensor *t, void *dst, size_t bytes, const char *file, int line) {
  if (!t) return err_set(file, line, "read", "tensor is NULL"), -1;
  if (tensor_check_live(t, "tensor", "read", file, line)) return -1;
  hook_read("kiln_read", t, file, line);
  if (t->st->meta) return err_set(file, line, "read", "the tensor has no data: it is a value of a recording that could not compute it"), -1;
  size_t need = (size_t)shape_numel(t->ndim, t->shape) * kiln_dtype_size(t->dtype);
  char b[SHAPE_BUF];
  if (bytes != need)
    return err_set(file, line, "read", "%s%s needs %zu bytes, got %zu", kiln_dtype_name(t->dtype),
                   err_shape(b, t->ndim, t->shape), need, bytes),
           -1;
  if (need == 0) return 0;
  if (!dst) return err_set(file, line, "read", "dst is NULL"), -1;
  if (tensor_contiguous(t)) {
    memcpy(dst, tensor_data(t), need);
    return 0;
  }
  /* a temporary contiguous tensor over the caller's buffer */
  storage st = {.data = dst, .bytes = need};
  kiln_tensor out = {.dtype = t->dtype, .ndim = t->ndim, .st = &st};
  memcpy(out.shape, t->shape, sizeof out.shape);
  contiguous_strides(t->ndim, t->shape, out.stride);
  pw_copy(&out, t);
  return 0;
}

double kiln_item_at(const kiln_tensor *t, const char *file, int line) {
  if (!t) return err_set(file, line, "item", "tensor is NULL"), NAN;
  if (tensor_check_live(t, "tensor", "item", file, line)) return NAN;
  hook_read("kiln_item", t, file, line);
  if (t->st->meta) return err_set(file, line, "item", "the tensor has no data: it is a value of a recording that could not compute it"), NAN;
  if (shape_numel(t->ndim, t->shape) != 1) {
    char b[SHAPE_BUF];
    return err_set(file, line, "item", "tensor %s has %" PRId64 " elements, not 1", err_shape(b, t->ndim, t->shape),
                   shape_numel(t->ndim, t->shape)),
           NAN;
  }
  return tensor_get(t, 0);
}

char *kiln_describe(const kiln_tensor *t, char *buf, size_t n) {
  if (!buf || !n) return buf;
  if (!t || tensor_refs(t) == 0) {
    snprintf(buf, n, t ? "(released)" : "(null)");
    return buf;
  }
  meta_read(t, -1); /* the text has the shape, strides and dtype: C can branch on it */
  char s[SHAPE_BUF], st[SHAPE_BUF];
  snprintf(buf, n, "%s%s strides %s%s", kiln_dtype_name(t->dtype), err_shape(s, t->ndim, t->shape),
           err_shape(st, t->ndim, t->stride), t->requires_grad ? " requires_grad" : "");
  return buf;
}

static void print_rec(const kiln_tensor *t, int d, int64_t *linear, int64_t block) {
  if (d == t->ndim) {
    double v = tensor_get(t, *linear);
    if (!dtype_is_float(t->dtype)) printf("%lld", (long long)v);
    else printf("%.6g", v);
    (*linear)++;
    return;
  }
  block /= t->shape[d] ? t->shape[d] : 1;
  printf("[");
  for (int64_t i = 0; i < t->shape[d]; i++) {
    if (t->shape[d] > 8 && i == 3) {
      printf(", ...");
      i = t->shape[d] - 3;
      *linear += block * (t->shape[d] - 6);
    }
    if (i) printf(", ");
    print_rec(t, d + 1, linear, block);
  }
  printf("]");
}

void kiln_print_at(const kiln_tensor *t, const char *file, int line) {
  char b[2 * SHAPE_BUF + 32];
  if (tensor_check_live(t, "tensor", "print", file, line)) {
    printf("(released)\n");
    return;
  }
  if (t) hook_read("kiln_print", t, file, line);
  /* still no data while recording: a construct's body recorded once as a
   * region, which then runs step by step, printing each step's values (or
   * a call that fails): a line here would be one print more than eager's */
  if (t && t->st->meta && recording()) return;
  printf("%s\n", kiln_describe(t, b, sizeof b));
  if (!t) return;
  if (t->st->meta) {
    printf("(no data: a value of a recording that could not compute it)\n");
    return;
  }
  int64_t linear = 0;
  print_rec(t, 0, &linear, shape_numel(t->ndim, t->shape));
  printf("\n");
}

/* ---- param names ---- */

/* A name a saved graph can carry: 1 .. 128 of [A-Za-z0-9_.:/-]. */
static bool param_name_ok(const char *s) {
  size_t n = 0;
  for (; s[n]; n++)
    if (n == 128 || !(isalnum((unsigned char)s[n]) || strchr("_.:/-", s[n]))) return false;
  return n > 0;
}

int kiln_param_name_at(kiln_tensor *t, const char *name, const char *file, int line) {
  if (!t) return err_set(file, line, "param_name", "the tensor is NULL"), -1;
  if (!name || !param_name_ok(name))
    return err_set(file, line, "param_name", "\"%s\" is not a name: 1 to 128 of A-Z a-z 0-9 _ . : / -", name ? name : "(null)"), -1;
  size_t n = strlen(name);
  char *c = alloc_malloc(n + 1);
  if (!c) return err_set(file, line, "param_name", "out of memory"), -1;
  memcpy(c, name, n + 1);
  alloc_free(atomic_exchange(&t->st->name, c));
  return 0;
}

int (kiln_param_name)(kiln_tensor *t, const char *name) { return kiln_param_name_at(t, name, "", 0); }

const char *storage_name_default(storage *st, const char *name) {
  char *had = atomic_load(&st->name);
  if (had) return had;
  size_t n = strlen(name);
  char *c = alloc_malloc(n + 1);
  if (!c) return NULL;
  memcpy(c, name, n + 1);
  if (atomic_compare_exchange_strong(&st->name, &had, c)) return c;
  alloc_free(c); /* named meanwhile: that name wins */
  return had;
}
