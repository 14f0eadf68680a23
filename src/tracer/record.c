/* Recording: a compiled function's body run with the dispatch hooks set so
 * that nothing is computed. Each op makes a meta tensor (its shape and dtype,
 * no data) and appends an event to the call's log; factories, in-place
 * writes and element counts do the same. The body's C code runs as it would
 * eagerly, so whatever it decides from sizes, numbers or data shows in the
 * log, and the call matches a cached variant only when its log does.
 *
 * Values are numbered as they appear: the call's inputs first, then params
 * (tensors made before the call), .grads, and the results of events. A read
 * of data a value does not have yet is a break: the events since the last
 * break run as a segment (compile.c), the live values get their data, and
 * recording goes on with them as carried values. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "tracer/tracer.h"

/* serial -> value id, open addressing */
typedef struct smap {
  uint64_t *key;
  int *val;
  size_t cap, n;
} smap;

typedef struct leaf_state {
  kiln_tensor *t;        /* the input or param (params retained by r->params; carried values by held) */
  int value;             /* its value id when the segment started */
  kiln_tensor *grad0;    /* its .grad when the segment started (retained) */
  uint64_t grad0_serial;
  int grad_value;        /* the RV_GRAD value, -1 until read */
  bool held;             /* t retained (a value carried from an earlier segment) */
  uint32_t grad0_refs;   /* grad0's references just after the recording took its own */
} leaf_state;

struct rec_state {
  smap leaves;           /* leaf tensor serial -> current value id */
  smap layouts;          /* (storage, layout) of a value -> its id: views made outside dispatch */
  smap carried;          /* value of an earlier segment -> its RV_CARRY value in this one (key: id + 1) */
  smap written;          /* storage serial of a leaf written in place in this segment -> 1 */
  leaf_state *leaf;
  int n_leaf, cap_leaf;
  kiln_tensor **made;    /* every tensor the recording made in this segment (retained) */
  int n_made, cap_made;
  int n_laid;            /* made[0..n_laid) are in layouts (filled when a lookup needs them) */
  uint64_t serial0;      /* tensors with a serial below this were made before the call */
  op_attrs **chunk;      /* the events' own attributes, ATTR_CHUNK to a chunk (kept between calls) */
  int n_chunk, cap_chunk;
  int chunk_at, chunk_used; /* the chunk being filled, and how much of it is */
  char *bytes;           /* EV_DATA payloads, one block each */
  char **blocks;
  int n_blocks, cap_blocks;
  trace_hooks hooks;
  const trace_hooks *saved;
  /* the recording's own lists, parked here between calls (rec_keep) */
  struct {
    rec_event *ev;
    int *ids;
    rec_value *val;
    kiln_tensor **params;
    struct rec_param_seen *seen;
    void *reads;
    int cap_ev, cap_ids, cap_val, cap_params, cap_seen, cap_reads;
  } park;
};

static atomic_ullong next_id = 1;

op_attrs rec_no_attrs;
/* an in-place write through a view, of no number (add_, copy_ into a slice):
 * shared like rec_no_attrs, never written (a variant copies it as any) */
static op_attrs view_write_attrs = {.flag = true};
enum { ATTR_CHUNK = 256 };

static void fail(recording *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(recording *r, const char *fmt, ...) {
  if (r->failed) return;
  r->failed = true;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->why, sizeof r->why, fmt, ap);
  va_end(ap);
}

static int new_event(recording *r, rec_ekind kind, int op, const int *ids, int n, const char *file, int line);

/* Something the graph cannot hold: the events so far run as a segment, the
 * live values get their data, and the rest of the body runs eagerly. */
static void escape(recording *r, const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void escape(recording *r, const char *file, int line, const char *fmt, ...) {
  if (r->failed || r->escaped) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->why, sizeof r->why, fmt, ap);
  va_end(ap);
  if (r->cf_depth) {
    /* a region records its body once: the construct runs step by step instead */
    r->cf_unfit = true;
    return;
  }
  if (new_event(r, EV_ESCAPE, 0, NULL, 0, file, line) < 0) return;
  r->escaped = true;
  r->st->hooks.record = false;
  if (r->run(r, r->run_ctx, false)) {
    r->failed = true;
    snprintf(r->why, sizeof r->why, "%s", kiln_last_error());
    r->why_is_error = true;
  }
}

/* ---- maps ---- */

static int map_get(const smap *m, uint64_t k) {
  if (!m->cap) return -1;
  for (size_t i = hash64(k) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
    if (!m->key[i]) return -1;
    if (m->key[i] == k) return m->val[i];
  }
}

static int map_put(smap *m, uint64_t k, int v) {
  if ((m->n + 1) * 2 > m->cap) {
    size_t cap = m->cap ? m->cap * 2 : 32;
    uint64_t *key = alloc_calloc(cap, sizeof *key);
    int *val = alloc_calloc(cap, sizeof *val);
    if (!key || !val) {
      alloc_free(key);
      alloc_free(val);
      return -1;
    }
    for (size_t i = 0; i < m->cap; i++) {
      if (!m->key[i]) continue;
      size_t j = hash64(m->key[i]) & (cap - 1);
      while (key[j]) j = (j + 1) & (cap - 1);
      key[j] = m->key[i];
      val[j] = m->val[i];
    }
    alloc_free(m->key);
    alloc_free(m->val);
    m->key = key;
    m->val = val;
    m->cap = cap;
  }
  size_t i = hash64(k) & (m->cap - 1);
  while (m->key[i] && m->key[i] != k) i = (i + 1) & (m->cap - 1);
  if (!m->key[i]) m->n++;
  m->key[i] = k;
  m->val[i] = v;
  return 0;
}

static void map_clear(smap *m) {
  if (m->cap) memset(m->key, 0, sizeof *m->key * m->cap);
  m->n = 0;
}

static void map_free(smap *m) {
  alloc_free(m->key);
  alloc_free(m->val);
  memset(m, 0, sizeof *m);
}

static uint64_t layout_key(const kiln_tensor *t) {
  uint64_t h = hash64(t->st->serial ^ 0x5bd1e995u);
  h = hash64(h ^ ((uint64_t)t->dtype << 8 | (uint64_t)t->ndim));
  for (int i = 0; i < t->ndim; i++) h = hash64(h ^ (uint64_t)t->shape[i]) + (uint64_t)t->stride[i] * 0x9e3779b97f4a7c15ull;
  h = hash64(h ^ (uint64_t)t->offset);
  return h ? h : 1;
}

/* ---- the log ---- */

static int new_value(recording *r, rec_vkind kind, const kiln_tensor *t, int index, int event) {
  if (alloc_grow((void **)&r->val, &r->cap_val, r->n_val + 1, sizeof *r->val)) return fail(r, "out of memory while recording"), -1;
  rec_value *v = &r->val[r->n_val];
  *v = (rec_value){.kind = kind, .dtype = t->dtype, .ndim = t->ndim, .index = index, .event = event, .seg = r->seg,
                   .version = atomic_load(&t->st->version)};
  memcpy(v->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
  return r->n_val++;
}

/* Room for one event's attributes, or NULL (out of memory). Chunks stay
 * where they are, so events can point into them. */
static op_attrs *attrs_new(recording *r) {
  struct rec_state *s = r->st;
  if (s->chunk_used == ATTR_CHUNK) s->chunk_at++, s->chunk_used = 0;
  if (s->chunk_at == s->n_chunk) {
    if (alloc_grow((void **)&s->chunk, &s->cap_chunk, s->n_chunk + 1, sizeof *s->chunk)) return NULL;
    if (!(s->chunk[s->n_chunk] = alloc_malloc(sizeof(op_attrs) * ATTR_CHUNK))) return NULL;
    s->n_chunk++;
  }
  return &s->chunk[s->chunk_at][s->chunk_used++];
}

/* A new event with inputs ids[0..n); its index, or -1. */
static int new_event(recording *r, rec_ekind kind, int op, const int *ids, int n, const char *file, int line) {
  if (alloc_grow((void **)&r->ev, &r->cap_ev, r->n_ev + 1, sizeof *r->ev) ||
      alloc_grow((void **)&r->ids, &r->cap_ids, r->n_ids + n, sizeof *r->ids))
    return fail(r, "out of memory while recording"), -1;
  rec_event *e = &r->ev[r->n_ev];
  /* an op's attributes are copied by on_op, right after, when it has any */
  e->a = &rec_no_attrs;
  if (kind != EV_OP && kind != EV_INPLACE && kind != EV_BREAK && kind != EV_ESCAPE) {
    if (!(e->a = attrs_new(r))) return fail(r, "out of memory while recording"), -1;
    memset(e->a, 0, sizeof *e->a);
  }
  e->data = NULL;
  e->kind = kind;
  e->op = op;
  e->n_in = n;
  e->in = r->n_ids;
  e->out = -1;
  e->file = file ? file : "";
  e->line = line;
  e->user = !in_internal();
  e->src = -1;
  if (n) memcpy(r->ids + r->n_ids, ids, sizeof(int) * (size_t)n);
  r->n_ids += n;
  return r->n_ev++;
}

/* Keeps t (made by the recording) and tags it with its value. */
static int adopt(recording *r, kiln_tensor *t, int value) {
  struct rec_state *s = r->st;
  t->rec_call = r->id;
  t->rec_id = value;
  if (alloc_grow((void **)&s->made, &s->cap_made, s->n_made + 1, sizeof *s->made)) {
    fail(r, "out of memory while recording");
    return -1;
  }
  s->made[s->n_made++] = kiln_retain(t);
  return 0;
}

/* The made tensors' layouts into the map: only a lookup of a view made
 * outside dispatch needs them, so it is done then, not for every op. The
 * newest value of a layout wins, whenever it was put. */
static void layouts_fill(recording *r) {
  struct rec_state *s = r->st;
  for (; s->n_laid < s->n_made; s->n_laid++) {
    kiln_tensor *t = s->made[s->n_laid];
    uint64_t k = layout_key(t);
    /* value ids grow with time: an entry an in-place write put since is newer, and stays */
    if (map_get(&s->layouts, k) > t->rec_id) continue;
    if (map_put(&s->layouts, k, t->rec_id)) return fail(r, "out of memory while recording");
  }
}

/* ---- values of tensors ---- */

static int add_leaf(recording *r, kiln_tensor *t, int value) {
  struct rec_state *s = r->st;
  if (alloc_grow((void **)&s->leaf, &s->cap_leaf, s->n_leaf + 1, sizeof *s->leaf) || map_put(&s->leaves, t->serial, value))
    return fail(r, "out of memory while recording"), -1;
  bool held = r->val[value].kind == RV_CARRY; /* the body may drop it while the call still runs segments */
  s->leaf[s->n_leaf++] = (leaf_state){t, value, kiln_retain(t->grad), t->grad ? t->grad->serial : 0, -1, held,
                                      t->grad ? tensor_refs(t->grad) : 0};
  if (held) kiln_retain(t);
  return 0;
}

void rec_set_grad0_refs(recording *r, const kiln_tensor *t, uint32_t refs) {
  for (int i = 0; i < r->st->n_leaf; i++)
    if (r->st->leaf[i].t == t && r->st->leaf[i].grad0) r->st->leaf[i].grad0_refs = refs;
}

static leaf_state *leaf_of(recording *r, int value) {
  for (int i = 0; i < r->st->n_leaf; i++)
    if (r->st->leaf[i].value == value) return &r->st->leaf[i];
  return NULL;
}

int rec_value_of(recording *r, kiln_tensor *t) {
  struct rec_state *s = r->st;
  if (t->rec_call == r->id && r->val[t->rec_id].seg == r->seg) {
    if (r->val[t->rec_id].version != atomic_load(&t->st->version)) {
      escape(r, "", 0, "a view made before an in-place write into the tensor it views is used after it: a compiled "
                       "write gives the tensor a new value, not its old views, so the rest of the body ran eagerly (make the "
                       "view again after the write)");
      return -1;
    }
    return t->rec_id;
  }
  int id = map_get(&s->leaves, t->serial);
  if (id >= 0) {
    if (r->val[id].version != atomic_load(&t->st->version)) {
      escape(r, "", 0, "a tensor viewing a param or input was written through another view of it: the rest of the body ran "
                       "eagerly");
      return -1;
    }
    return id;
  }
  if (t->rec_call == r->id) {
    /* computed at a break: a leaf of this segment, carried in */
    if (r->val[t->rec_id].version != atomic_load(&t->st->version)) {
      escape(r, "", 0, "a value carried across a break was written through another tensor after it: the rest of the body ran eagerly");
      return -1;
    }
    id = new_value(r, RV_CARRY, t, t->rec_id, -1);
    if (id < 0 || add_leaf(r, t, id)) return -1;
    return id;
  }
  /* a view of a value made outside dispatch (autograd keeps its outputs so) */
  id = -1;
  if (t->serial >= s->serial0) {
    layouts_fill(r);
    id = map_get(&s->layouts, layout_key(t));
  }
  if (id >= 0 && r->val[id].seg == r->seg) return id;
  if (id >= 0 && !t->st->meta && r->val[id].version == atomic_load(&t->st->version)) {
    /* such a view made in an earlier segment, its data computed at the break: carried in */
    int v = new_value(r, RV_CARRY, t, id, -1);
    if (v < 0 || add_leaf(r, t, v)) return -1;
    return v;
  }
  if (t->st->meta) {
    fail(r, "a tensor without data that this call did not make (made by another compiled call's recording that failed)");
    return -1;
  }
  /* the .grad of a leaf, read before it changed */
  for (int i = 0; i < s->n_leaf; i++) {
    leaf_state *l = &s->leaf[i];
    if (l->grad0 != t || l->grad0_serial != t->serial) continue;
    if (l->grad_value < 0) {
      l->grad_value = new_value(r, RV_GRAD, t, l->value, -1);
      if (l->grad_value < 0 || map_put(&s->leaves, t->serial, l->grad_value)) return fail(r, "out of memory while recording"), -1;
    }
    return l->grad_value;
  }
  if (t->serial >= s->serial0) {
    escape(r, "", 0, "a tensor made in the body other than by a kiln op or factory: the rest of the body ran eagerly");
    return -1;
  }
  if (map_get(&s->written, t->st->serial) >= 0) {
    /* its leaf would hold the data before the write, which takes effect at the segment's end */
    escape(r, "", 0, "a tensor sharing memory with one the body wrote in place is first used after the write: the rest "
                     "of the body ran eagerly");
    return -1;
  }
  /* a tensor made before the call: a param, read by reference on every call */
  if (alloc_grow((void **)&r->params, &r->cap_params, r->n_params + 1, sizeof *r->params)) return fail(r, "out of memory while recording"), -1;
  id = new_value(r, RV_PARAM, t, r->n_params, -1);
  if (id < 0) return -1;
  if (alloc_grow((void **)&r->param_seen, &r->cap_seen, r->n_params + 1, sizeof *r->param_seen))
    return fail(r, "out of memory while recording"), -1;
  r->params[r->n_params] = kiln_retain(t);
  r->param_seen[r->n_params++] = (struct rec_param_seen){t->grad != NULL};
  if (add_leaf(r, t, id)) return -1;
  return id;
}

int rec_made_tensors(const recording *r, kiln_tensor **by_value) {
  const struct rec_state *s = r->st;
  for (int i = 0; i < r->n_val; i++) by_value[i] = NULL;
  for (int i = 0; i < s->n_made; i++) {
    kiln_tensor *t = s->made[i];
    if (t->rec_call != r->id || t->rec_id < 0 || t->rec_id >= r->n_val) continue;
    if (by_value[t->rec_id] && by_value[t->rec_id] != t) return -1;
    by_value[t->rec_id] = t;
  }
  return 0;
}

bool rec_views_kept(const recording *r, kiln_tensor *const *out, int n_out) {
  const struct rec_state *s = r->st;
  for (int i = 0; i < s->n_made; i++) {
    const kiln_tensor *t = s->made[i];
    if (t->st->meta || t->rec_call != r->id) continue; /* meta: rec_live_values' */
    bool is_out = false;
    for (int k = 0; k < n_out && !is_out; k++) is_out = out[k] == t;
    if (!is_out && tensor_refs(t) > (uint32_t)rec_holds(r, t) + tensor_scope_refs(t)) return true;
  }
  return false;
}

int rec_holds(const recording *r, const kiln_tensor *t) {
  const struct rec_state *s = r->st;
  int n = 0;
  for (int i = 0; i < s->n_made; i++) n += s->made[i] == t;
  for (int i = 0; i < s->n_leaf; i++) n += s->leaf[i].held && s->leaf[i].t == t;
  return n;
}

kiln_tensor *rec_tensor_of(recording *r, int value) {
  struct rec_state *s = r->st;
  for (int i = s->n_made - 1; i >= 0; i--)
    if (s->made[i]->rec_call == r->id && s->made[i]->rec_id == value && r->val[value].seg == r->seg) return s->made[i];
  for (int i = 0; i < s->n_leaf; i++) {
    leaf_state *l = &s->leaf[i];
    if (l->value == value || map_get(&s->leaves, l->t->serial) == value) return l->t;
    if (l->grad_value == value) return l->grad0;
  }
  return NULL;
}

/* Every input's value id, or -1. */
static int values_of(recording *r, kiln_tensor *const *in, int n, int *ids) {
  for (int i = 0; i < n; i++)
    if ((ids[i] = rec_value_of(r, in[i])) < 0) return -1;
  return 0;
}

/* ---- the hooks ---- */

static bool has_user_numbers(const recording *r, const rec_event *e) {
  rec_slot tmp[2 * MAXD + 8];
  (void)r;
  if (!e->user || !rec_has_slots(e)) return false;
  return rec_slots(e, tmp, (int)(sizeof tmp / sizeof tmp[0])) > 0;
}

/* After an escape: out, a meta tensor of an op recorded no longer, computed from its (now real) inputs. */
static void compute_now(recording *r, op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  if (!out->st->meta) return; /* a view of data that exists */
  for (int i = 0; i < n; i++)
    if (in[i]->st->meta) return fail(r, "an input of an op after the escape has no data");
  void *data = alloc_aligned((out->st->bytes + 63) & ~(size_t)63);
  if (!data) return fail(r, "out of memory");
  storage_materialize(out->st, data);
  if (op_table[op].kind == KIND_VIEW) {
    /* a reshape that could not view: in[0]'s elements in order */
    kiln_tensor tmp = {.dtype = in[0]->dtype, .ndim = in[0]->ndim, .st = out->st};
    memcpy(tmp.shape, in[0]->shape, sizeof tmp.shape);
    contiguous_strides(tmp.ndim, tmp.shape, tmp.stride);
    pw_copy(&tmp, in[0]);
  } else if (op_kernel(op, in, n, a, out)) {
    fail(r, "out of memory");
  }
}

static void on_op(void *ctx, op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out,
                  const char *file, int line) {
  rec_op(ctx, op, in, n, a, out, file, line, user_numbers() || !in_internal());
}

static void layout_read(recording *r, const kiln_tensor *t);

/* Whether reshaping x to a's shape views x whatever its layout: the sizes
 * other than 1 stay as they are (an unsqueeze, a squeeze), or there are no
 * elements. */
static bool reshape_views_any(const kiln_tensor *x, const op_attrs *a) {
  int i = 0, j = 0;
  for (int d = 0; d < x->ndim; d++)
    if (x->shape[d] == 0) return true;
  for (;; i++, j++) {
    while (i < x->ndim && x->shape[i] == 1) i++;
    while (j < a->ndim && a->shape[j].c == 1) j++;
    if (i == x->ndim || j == a->ndim) return i == x->ndim && j == a->ndim;
    if (x->shape[i] != a->shape[j].c) return false;
  }
}

void rec_op(recording *r, op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out, const char *file,
            int line, bool user) {
  if (r->failed) return;
  if (op == OP_RESHAPE && a && !reshape_views_any(in[0], a)) layout_read(r, in[0]);
  int small[16], *ids = n <= 16 ? small : alloc_malloc(sizeof(int) * (size_t)n);
  if (!ids) return fail(r, "out of memory while recording");
  if (values_of(r, in, n, ids) == 0) {
    int e = new_event(r, EV_OP, (int)op, ids, n, file, line);
    if (e >= 0) {
      if (a && op_table[op].attrs) {
        /* an op without attributes keeps rec_no_attrs: none of a's fields is part of it */
        op_attrs *c = attrs_new(r);
        if (!c) {
          fail(r, "out of memory while recording");
          goto done;
        }
        *c = *a;
        r->ev[e].a = c;
      }
      r->ev[e].user = user;
      if (op_table[op].attrs & AF_SHAPE) r->ev[e].src = r->shape_src;
      if (has_user_numbers(r, &r->ev[e])) r->c_numbers = true;
      int v = new_value(r, RV_MADE, out, -1, e);
      if (v >= 0) {
        r->ev[e].out = v;
        adopt(r, out, v);
      }
    }
  }
done:
  if (r->escaped) compute_now(r, op, in, n, a, out);
  if (ids != small) alloc_free(ids);
}

/* The whole tensor of this call that view t (value v) was made from by view
 * ops that keep every element distinct (slice, reshape, permute), or NULL. */
static kiln_tensor *view_base(recording *r, const kiln_tensor *t, int v) {
  struct rec_state *s = r->st;
  kiln_tensor *base = NULL;
  for (int i = 0; i < s->n_leaf && !base; i++)
    if (s->leaf[i].t->st == t->st && tensor_covers_storage(s->leaf[i].t)) base = s->leaf[i].t;
  for (int i = 0; i < s->n_made && !base; i++)
    if (s->made[i]->st == t->st && tensor_covers_storage(s->made[i]) && r->val[s->made[i]->rec_id].seg == r->seg &&
        r->val[s->made[i]->rec_id].version == atomic_load(&t->st->version))
      base = s->made[i];
  if (!base) return NULL;
  int bv = rec_value_of(r, base);
  if (bv < 0) return NULL;
  while (v != bv) {
    const rec_value *rv = &r->val[v];
    if (rv->kind != RV_MADE || rv->event < 0) return NULL;
    const rec_event *e = &r->ev[rv->event];
    if (e->kind != EV_OP || (e->op != OP_SLICE && e->op != OP_RESHAPE && e->op != OP_PERMUTE)) return NULL;
    v = r->ids[e->in];
  }
  return base;
}

static void on_inplace(void *ctx, op_id op, kiln_tensor *dst, kiln_tensor *src, double value, const char *file,
                       int line) {
  rec_inplace(ctx, op, dst, src, value, file, line, !in_internal());
}

void rec_inplace(recording *r, op_id op, kiln_tensor *dst, kiln_tensor *src, double value, const char *file, int line,
                 bool user) {
  if (r->failed) return;
  /* a region's body is functional: the construct runs step by step instead
   * (the write is recorded as any, among the events that then go dead) */
  if (r->cf_depth) r->cf_unfit = true;
  int ids[3] = {rec_value_of(r, dst), src ? rec_value_of(r, src) : 0, 0};
  if (ids[0] < 0 || ids[1] < 0) return;
  int n = src ? 2 : 1;
  /* the root of dst's views (view ops' results back to the first value
   * that is not one: a .grad, say, is found by no base search) */
  int root = ids[0];
  for (const rec_value *rv = &r->val[root]; rv->kind == RV_MADE && rv->event >= 0; rv = &r->val[root]) {
    const rec_event *ve = &r->ev[rv->event];
    if (ve->kind != EV_OP || op_table[ve->op].kind != KIND_VIEW) break;
    root = r->ids[ve->in];
  }
  /* a write into a view is a write of the whole base: its value after is
   * the view's new elements scattered into it (build.c). A view that
   * covers all of its storage (a reshape of a param, its full slice) is a
   * view all the same (as itself, the write reached no leaf and was lost);
   * a whole write of a leaf or of an op's own result is a write of itself,
   * found without a search. */
  kiln_tensor *base = dst;
  if (!tensor_covers_storage(dst) || root != ids[0]) {
    kiln_tensor *vb = view_base(r, dst, ids[0]);
    if (!vb)
      return escape(r, file, line, "%s:%d: an in-place write into a view that is not a chain of slices, reshapes and "
                    "permutes of a whole tensor of this call: the rest of the body ran eagerly", file, line);
    if (vb != dst) {
      base = vb;
      if ((ids[n++] = rec_value_of(r, base)) < 0) return;
    }
  }
  if (r->val[root].kind == RV_GRAD || r->val[base == dst ? ids[0] : ids[n - 1]].kind == RV_GRAD)
    /* a .grad the call began with is read as a leaf, and only a leaf's data
     * or its .grad as a whole is written back, not a write into its .grad */
    return escape(r, file, line, "%s:%d: an in-place write into a .grad the call began with: the rest of the body ran "
                  "eagerly", file, line);
  int e = new_event(r, EV_INPLACE, (int)op, ids, n, file, line);
  if (e < 0) return;
  r->ev[e].user = user;
  /* a fill's value is a number of the event; any other write's is 0 and
   * shares its attributes (a step's optimizer makes hundreds of writes) */
  if (memcmp(&value, &(double){0}, sizeof value)) {
    op_attrs *c = attrs_new(r);
    if (!c) return fail(r, "out of memory while recording");
    memset(c, 0, sizeof *c);
    c->value = value;
    c->flag = base != dst;
    r->ev[e].a = c;
  } else if (base != dst) {
    r->ev[e].a = &view_write_attrs;
  }
  if (!src && r->ev[e].user) r->c_numbers = true;
  int v = new_value(r, RV_MADE, base, -1, e);
  if (v < 0) return;
  r->val[v].version++; /* inplace() bumps the version after this hook */
  r->ev[e].out = v;
  struct rec_state *s = r->st;
  if (base->rec_call == r->id && r->val[base->rec_id].seg == r->seg) {
    base->rec_id = v;
    if (map_put(&s->layouts, layout_key(base), v)) fail(r, "out of memory while recording");
  } else if (map_put(&s->leaves, base->serial, v) || map_put(&s->layouts, layout_key(base), v) ||
             map_put(&s->written, base->st->serial, 1)) {
    fail(r, "out of memory while recording");
  }
}

static bool pending(recording *r, const kiln_tensor *t);

static void on_read(void *ctx, const char *what, const kiln_tensor *t, const char *file, int line) {
  recording *r = ctx;
  r->read_data = true;
  r->reader = what;
  if (r->failed || !pending(r, t)) return;
  if (r->cf_depth) {
    /* a region is recorded without data: the construct runs step by step
     * instead, where this read is a graph break as anywhere else */
    r->cf_unfit = true;
    return;
  }
  if (r->n_breaks == REC_MAX_BREAKS)
    return escape(r, file, line, "%s:%d: %s reads data after %d graph breaks in one call: the rest of the body ran eagerly",
                  file, line, what, REC_MAX_BREAKS);
  r->n_breaks++;
  int e = new_event(r, EV_BREAK, 0, NULL, 0, file, line);
  if (e < 0) return;
  if (r->run(r, r->run_ctx, false)) {
    fail(r, "%s", kiln_last_error());
    r->why_is_error = true;
  }
}

/* The value of the tensor (serial, call, id) whose shape the next shape given
 * is; -1 when it is none of this segment's (a value an earlier segment
 * made, or none). Looks only: a shape's source makes no value. */
static void on_shape_src(void *ctx, uint64_t serial, uint64_t call, int id) {
  recording *r = ctx;
  r->shape_src = -1;
  if (!serial || r->failed) return;
  bool ours = id >= 0 && id < r->n_val && r->val[id].seg == r->seg;
  /* (a replay's tag that handed over to us, where it names the tensor it was given for) */
  const kiln_tensor *t = ours && call != r->id && r->alias_id && call == r->alias_id ? rec_tensor_of(r, id) : NULL;
  if (ours && (call == r->id || (t && t->serial == serial))) r->shape_src = id;
  else r->shape_src = map_get(&r->st->leaves, serial);
}

static void on_zero_grad(void *ctx, kiln_tensor *t) {
  recording *r = ctx;
  if (!r->failed) rec_value_of(r, t); /* a leaf now, so its .grad at the start is known */
}

static void on_numel(void *ctx, kiln_tensor *out, const kiln_tensor *x, const int *axes, int naxes, int64_t offset,
                     const char *file, int line) {
  rec_numel(ctx, out, x, axes, naxes, offset, file, line, !in_internal());
}

void rec_numel(recording *r, kiln_tensor *out, const kiln_tensor *x, const int *axes, int naxes, int64_t offset,
               const char *file, int line, bool user) {
  if (r->failed) return;
  int id = rec_value_of(r, (kiln_tensor *)x);
  if (id < 0) return;
  int e = new_event(r, EV_NUMEL, 0, &id, 1, file, line);
  if (e < 0) return;
  r->ev[e].user = user;
  r->ev[e].a->naxes = naxes;
  for (int i = 0; i < naxes && i < MAXD; i++) r->ev[e].a->axes[i] = axes[i];
  r->ev[e].a->start = sym_const(offset);
  r->ev[e].a->dtype = out->dtype;
  int v = new_value(r, RV_MADE, out, -1, e);
  if (v >= 0) {
    r->ev[e].out = v;
    adopt(r, out, v);
  }
}

static void on_size_read(void *ctx, const kiln_tensor *t, int dim) { rec_size_read(ctx, t, dim); }

/* A view or a copy of t, chosen by its layout: when t is an input, or a view
 * of one, that input's layout is part of the variant (the guard-only path
 * checks it), since the write into the result, or the result handed out,
 * reaches the input only where it is a view. Looks only: a tensor that is
 * no value yet is none of the inputs. */
static void layout_read(recording *r, const kiln_tensor *t) {
  int v = t->rec_call == r->id && t->rec_id >= 0 && t->rec_id < r->n_val ? t->rec_id : map_get(&r->st->leaves, t->serial);
  while (v >= 0 && r->val[v].kind == RV_MADE && r->val[v].event >= 0) {
    const rec_event *e = &r->ev[r->val[v].event];
    if (e->kind == EV_INPLACE) v = e->a->flag ? r->ids[e->in + e->n_in - 1] : r->ids[e->in]; /* the tensor written */
    else if (e->kind == EV_OP && op_table[e->op].kind == KIND_VIEW) v = r->ids[e->in];
    else return;
  }
  if (v >= 0 && r->val[v].kind == RV_INPUT && r->val[v].index < 64) r->layout_in |= 1ull << r->val[v].index;
}

void rec_size_read(recording *r, const kiln_tensor *t, int dim) {
  r->read_meta = true;
  if (dim == META_LAYOUT && !r->failed) layout_read(r, t);
  if (r->failed || r->escaped || dim < 0 || r->n_reads == 64) return;
  int v = rec_value_of(r, (kiln_tensor *)t);
  if (v < 0) return;
  for (int i = 0; i < r->n_reads; i++)
    if (r->reads[i].value == v && r->reads[i].dim == dim) return;
  if (alloc_grow((void **)&r->reads, &r->cap_reads, r->n_reads + 1, sizeof *r->reads)) return;
  r->reads[r->n_reads].value = v;
  r->reads[r->n_reads++].dim = dim;
}

static kiln_tensor *on_factory(void *ctx, int kind, kiln_dtype dt, int ndim, const int64_t *shape, double value,
                               uint64_t seed, bool flag, const void *data, const char *file, int line) {
  kiln_tensor *t = tensor_new_meta(dt, ndim, shape);
  if (!t) return err_set(file, line, "record", "out of memory");
  rec_factory(ctx, t, kind, value, seed, flag, data, file, line, !in_internal());
  return t;
}

void rec_factory(recording *r, kiln_tensor *t, int kind, double value, uint64_t seed, bool flag, const void *data,
                 const char *file, int line, bool user) {
  if (r->failed) return;
  kiln_dtype dt = t->dtype;
  int ndim = t->ndim;
  const int64_t *shape = t->shape;
  rec_ekind k = kind == FAC_DATA ? EV_DATA : kind == FAC_RAND ? EV_RAND : EV_FULL;
  int e = new_event(r, k, 0, NULL, 0, file, line);
  if (e < 0) return;
  rec_event *ev = &r->ev[e];
  ev->user = user;
  if (k == EV_FULL) ev->src = r->shape_src;
  ev->a->dtype = dt;
  ev->a->ndim = ndim;
  for (int i = 0; i < ndim; i++) ev->a->shape[i] = sym_const(shape[i]);
  ev->a->value = value;
  ev->a->k = (int64_t)seed;
  ev->a->flag = flag;
  if (ev->user) r->c_numbers = true;
  if (k == EV_DATA) {
    size_t bytes = rec_ev_bytes(ev);
    struct rec_state *s = r->st;
    char *b = alloc_malloc(bytes ? bytes : 1);
    if (!b || alloc_grow((void **)&s->blocks, &s->cap_blocks, s->n_blocks + 1, sizeof *s->blocks)) {
      alloc_free(b);
      fail(r, "out of memory while recording");
      return;
    }
    if (bytes) memcpy(b, data, bytes);
    s->blocks[s->n_blocks++] = b;
    r->ev[e].data = b;
  }
  int v = new_value(r, RV_MADE, t, -1, e);
  if (v >= 0) {
    r->ev[e].out = v;
    adopt(r, t, v);
  }
}

/* ---- control flow: each body recorded once, as a region ---- */

static const char *const cf_name[] = {"cond", "while_loop", "scan"};

/* " (f.c:12)": where the recording made t, or where it came from. */
static const char *made_at(recording *r, const kiln_tensor *t, char *buf, size_t n) {
  if (t->rec_call == r->id && t->rec_id >= 0 && t->rec_id < r->n_val) {
    const rec_value *v = &r->val[t->rec_id];
    if (v->kind == RV_MADE && v->event >= 0) {
      const rec_event *e = &r->ev[v->event];
      snprintf(buf, n, "%s:%d", e->file, e->line);
      return buf;
    }
  }
  snprintf(buf, n, "%s", t->rec_call == r->id ? "a value of the call" : "a tensor made before the call");
  return buf;
}

/* got agrees with want in dtype and shape, or the error names both and the lines that made them. */
static int cf_same(recording *r, const cf_call *c, const char *what, int k, const kiln_tensor *got, const char *against,
                   const kiln_tensor *want) {
  if (got->dtype == want->dtype && got->ndim == want->ndim &&
      !memcmp(got->shape, want->shape, sizeof(int64_t) * (size_t)got->ndim))
    return 0;
  char b0[SHAPE_BUF], b1[SHAPE_BUF], w0[300], w1[300];
  err_set(c->file, c->line, cf_name[c->kind], "%s %d is %s%s (made at %s) but %s is %s%s (made at %s)", what, k,
          kiln_dtype_name(got->dtype), err_shape(b0, got->ndim, got->shape), made_at(r, got, w0, sizeof w0), against,
          kiln_dtype_name(want->dtype), err_shape(b1, want->ndim, want->shape), made_at(r, want, w1, sizeof w1));
  return -1;
}

/* A new meta tensor of dtype dt and shape, made by event ev of the recording (its value). */
static kiln_tensor *cf_value(recording *r, int ev, kiln_dtype dt, int ndim, const int64_t *shape) {
  kiln_tensor *t = tensor_new_meta(dt, ndim, shape);
  if (!t) return fail(r, "out of memory while recording"), NULL;
  int v = new_value(r, RV_MADE, t, -1, ev);
  if (v < 0 || adopt(r, t, v)) {
    kiln_release(t);
    return NULL;
  }
  r->ev[ev].out = v;
  return t;
}

static void release_all(kiln_tensor **ts, int n) {
  for (int i = 0; i < n; i++) {
    kiln_release(ts[i]);
    ts[i] = NULL;
  }
}

/* Region i's results out[0..n) against what the construct needs of them:
 * while's cond a one-element bool; a new carry the carry's type; else's
 * results then's (prev). 0, or -1 with the error set. */
static int cf_check_outs(recording *r, const cf_call *c, int i, kiln_tensor *const *out, kiln_tensor *const *prev) {
  if (c->kind == CF_WHILE && i == 0) {
    const kiln_tensor *p = out[0];
    if (p->dtype == KILN_BOOL && shape_numel(p->ndim, p->shape) == 1) return 0;
    char b[SHAPE_BUF], w[300];
    err_set(c->file, c->line, cf_name[c->kind], "cond_fn's out[0] must be a one-element bool tensor, got %s%s (made at %s)",
            kiln_dtype_name(p->dtype), err_shape(b, p->ndim, p->shape), made_at(r, p, w, sizeof w));
    return -1;
  }
  if (c->kind == CF_COND)
    for (int k = 0; i == 1 && k < c->n_out[1]; k++)
      if (cf_same(r, c, "else_fn's out", k, out[k], "then_fn's", prev[k])) return -1;
  for (int k = 0; c->kind != CF_COND && k < c->n_carry; k++)
    if (cf_same(r, c, "body_fn's out", k, out[k], "the carry", c->in[k])) return -1;
  return 0;
}

/* Records the construct: an EV_CF, each region's arguments (meta tensors),
 * its body's events and an EV_YIELD of its results, then one EV_GET per
 * result. A construct that autograd must see through, or whose body draws
 * from the generator, is marked dead and run as eager code instead (0): its
 * steps then record one by one, as before. */
static int on_cf(void *ctx, const cf_call *c, kiln_tensor **results) {
  recording *r = ctx;
  if (r->failed || r->escaped) return 0;
  static const int ir_op[] = {IR_COND, IR_WHILE, IR_SCAN};
  int ids[2 * 64], first = r->n_ev, made0 = r->st->n_made, rc = 0;
  uint64_t seed0, off0; /* the generator, as the eager run that may follow must find it */
  gen_state_get(&seed0, &off0);
  if (c->n_in > (int)(sizeof ids / sizeof ids[0]) || values_of(r, c->in, c->n_in, ids)) return r->failed ? -1 : 0;
  int e = new_event(r, EV_CF, ir_op[c->kind], ids, c->n_in, c->file, c->line);
  if (e < 0) return err_set(c->file, c->line, cf_name[c->kind], "%s", r->why), -1;
  r->ev[e].a->k = c->n_carry;
  r->ev[e].a->dim = c->n_xs;
  /* stepwise: the construct runs step by step (a body draws, reads data or
   * writes in place, or autograd cannot replay it), not as a region.
   * want_grad: gradients flow through it (cfgrad.c) */
  bool stepwise = false, want_grad = false, unfit0 = r->cf_unfit;
  r->cf_unfit = false;
  for (int j = 0; j < c->n_in; j++) want_grad |= c->in[j]->requires_grad && kiln_grad_enabled();
  kiln_tensor *args[2 * 64] = {0}, *out[2][2 * 64] = {{0}};
  for (int i = 0; i < c->n_regions && !rc; i++) {
    for (int j = 0; j < c->n_args && !rc; j++) {
      const kiln_tensor *src = c->in[c->kind == CF_COND ? j + 1 : j];
      bool x = c->kind == CF_SCAN && j >= c->n_carry; /* xs[t]: dim 0 dropped */
      int a = new_event(r, EV_ARG, 0, NULL, 0, c->file, c->line);
      if (a >= 0) {
        r->ev[a].a->k = j;
        r->ev[a].a->dim = i;
      }
      args[j] = a < 0 ? NULL : cf_value(r, a, src->dtype, src->ndim - x, src->shape + x);
      if (!args[j]) rc = -1;
    }
    if (rc) {
      release_all(args, c->n_args);
      err_set(c->file, c->line, cf_name[c->kind], "%s", r->why);
      break;
    }
    r->cf_depth++;
    rc = c->run(c, i, args, out[i]);
    r->cf_depth--;
    release_all(args, c->n_args);
    if (!rc && r->failed) rc = -1, err_set(c->file, c->line, cf_name[c->kind], "%s", r->why);
    if (!rc) rc = cf_check_outs(r, c, i, out[i], out[0]);
    int oid[2 * 64];
    if (!rc && values_of(r, out[i], c->n_out[i], oid)) rc = -1, err_set(c->file, c->line, cf_name[c->kind], "%s", r->why);
    int y = rc ? -1 : new_event(r, EV_YIELD, 0, oid, c->n_out[i], c->file, c->line);
    if (!rc && y < 0) rc = -1, err_set(c->file, c->line, cf_name[c->kind], "%s", r->why);
    if (!rc) r->ev[y].a->k = i;
    for (int k = 0; !rc && k < c->n_out[i]; k++) want_grad |= out[i][k]->requires_grad;
  }
  /* a body read data or wrote in place: whatever it did after (its error
   * included: the read had no data) is the recording's, not the user's */
  if (r->cf_unfit) rc = 0, stepwise = true;
  r->cf_unfit = unfit0;
  /* a draw from the generator in a body: eager draws anew each step, a
   * region recorded once would not */
  for (int k = first; k < r->n_ev && !rc; k++) stepwise |= r->ev[k].kind == EV_OP && (op_table[r->ev[k].op].attrs & AF_RNG);
  /* gradients through a scan or cond: its bodies kept as programs autograd
   * replays; a scan stacks each step's incoming carry as extra ys (what its
   * backward steps over). A while_loop stays forward only. */
  cfg_grad *grad = NULL;
  int n_saved = 0, n_kept = 0; /* n_kept: of the saved, the per-step values after the carries */
  kiln_tensor *saved[64] = {0};
  const int *kept_ids = NULL;
  if (!rc && !stepwise && want_grad && c->kind != CF_WHILE) {
    grad = cfg_new(r, c, first);
    if (!grad) stepwise = true;
    if (grad && c->kind == CF_SCAN) {
      int y = r->n_ev - 1, cid[64];
      const int *kept;
      n_kept = cfg_kept(grad, &kept);
      kept_ids = kept;
      /* the body's arguments open its events (a nested construct's come later) */
      for (int j = 0; j < c->n_carry; j++) {
        KILN_ASSERT(r->ev[first + 1 + j].kind == EV_ARG && r->ev[first + 1 + j].a->k == j);
        cid[j] = r->ev[first + 1 + j].out;
      }
      memcpy(cid + c->n_carry, kept, sizeof(int) * (size_t)n_kept); /* cfg_new keeps n_carry + n_kept <= 64 */
      KILN_ASSERT(r->ev[y].kind == EV_YIELD && r->ev[y].in + r->ev[y].n_in == r->n_ids);
      if (alloc_grow((void **)&r->ids, &r->cap_ids, r->n_ids + c->n_carry + n_kept, sizeof *r->ids)) {
        rc = -1;
        fail(r, "out of memory while recording");
        err_set(c->file, c->line, cf_name[c->kind], "%s", r->why);
      } else {
        memcpy(r->ids + r->n_ids, cid, sizeof(int) * (size_t)(c->n_carry + n_kept));
        r->n_ids += c->n_carry + n_kept;
        r->ev[y].n_in += c->n_carry + n_kept;
        n_saved = c->n_carry + n_kept;
        r->ev[first].a->flag = true; /* its yield holds the saved carries too (cfgrad.c) */
      }
    }
  }
  if (!rc && stepwise) {
    for (int i = 0; i < 2; i++) release_all(out[i], c->n_regions > i ? c->n_out[i] : 0);
    /* gradients flow through it, or it draws: its steps run as eager code, recorded one
     * by one. What its bodies made goes: no graph computes it, and no
     * segment may take it for a live value (autograd's saved tensors would) */
    for (int k = first; k < r->n_ev; k++) r->ev[k].kind = EV_DEAD;
    gen_state_set(seed0, off0);
    struct rec_state *s = r->st;
    for (int i = made0; i < s->n_made; i++) {
      kiln_tensor *t = s->made[i];
      if (t->grad_fn) ag_node_release(t->grad_fn);
      t->grad_fn = NULL;
    }
    for (int i = made0; i < s->n_made; i++) kiln_release(s->made[i]);
    s->n_made = made0;
    if (s->n_laid > made0) s->n_laid = made0;
  } else if (!rc) {
    /* the bodies' tensors stay inside their regions: no autograd history
     * (a replay's, or one through a capture) may reach them from outside,
     * nor a gradient's condition (grad_if) keep a body's value alive */
    struct rec_state *s = r->st;
    for (int i = made0; i < s->n_made; i++) {
      kiln_tensor *t = s->made[i];
      if (t->grad_fn) ag_node_release(t->grad_fn);
      t->grad_fn = NULL;
      t->requires_grad = false;
      ag_set_grad_if(t, NULL, 0);
    }
    for (int k = 0; k < c->n_results + n_saved && !rc; k++) {
      int g = new_event(r, EV_GET, 0, NULL, 0, c->file, c->line);
      if (g < 0) {
        rc = -1;
        break;
      }
      r->ev[g].a->k = k;
      const kiln_tensor *like = c->kind == CF_COND                ? out[0][k]
                                : k >= c->n_results + c->n_carry ? c->in[0] /* kept: typed below */
                                : k >= c->n_results              ? c->in[k - c->n_results]
                                : k < c->n_carry                 ? c->in[k]
                                                                 : out[0][k];
      int64_t shape[MAXD];
      int nd = like->ndim;
      kiln_dtype dt = like->dtype;
      memcpy(shape, like->shape, sizeof(int64_t) * (size_t)nd);
      if (k >= c->n_results + c->n_carry) {
        /* a kept per-step value (scan_save): its type as the body made it */
        const rec_value *kv = &r->val[kept_ids[k - c->n_results - c->n_carry]];
        dt = kv->dtype, nd = kv->ndim;
        memcpy(shape, kv->shape, sizeof(int64_t) * (size_t)nd);
      }
      if (c->kind == CF_SCAN && k >= c->n_carry) {
        /* y: stacked along a new dim 0 of the steps' count */
        if (nd + 1 > MAXD) {
          release_all(results, k);
          rc = -1;
          err_set(c->file, c->line, "scan", "y %d of rank %d would stack to rank %d, more than %d", k - c->n_carry, nd, nd + 1, MAXD);
          break;
        }
        memmove(shape + 1, shape, sizeof(int64_t) * (size_t)nd);
        shape[0] = c->in[c->n_carry]->shape[0];
        nd++;
      }
      kiln_tensor **dst = k < c->n_results ? &results[k] : &saved[k - c->n_results];
      if (!(*dst = cf_value(r, g, dt, nd, shape))) {
        release_all(results, k < c->n_results ? k : c->n_results);
        release_all(saved, n_saved);
        rc = -1;
      }
    }
    if (rc && !r->failed) fail(r, "out of memory while recording");
    if (rc) err_set(c->file, c->line, cf_name[c->kind], "%s", r->why);
    int ag = 0;
    if (!rc && grad) {
      ag = cfg_attach(grad, results, saved);
      grad = NULL;
    } else if (!rc && want_grad && c->kind == CF_WHILE) {
      ag = ag_forward_only(results, c->n_results, c->file, c->line);
    }
    if (!rc) release_all(saved, n_saved);
    if (ag) release_all(results, c->n_results), rc = -1;
    /* a scan over an input's dim 0: that dim is a symbol from the first trace, 0 and 1 included */
    for (int j = 0; !rc && c->kind == CF_SCAN && j < c->n_xs; j++) {
      const rec_value *xv = &r->val[ids[c->n_carry + j]];
      bool known = false;
      for (int q = 0; q < r->n_scan_dims; q++) known |= r->scan_dims[q].input == xv->index;
      if (xv->kind != RV_INPUT || known || r->n_scan_dims == (int)(sizeof r->scan_dims / sizeof r->scan_dims[0])) continue;
      r->scan_dims[r->n_scan_dims].input = xv->index;
      r->scan_dims[r->n_scan_dims++].dim = 0;
    }
  }
  for (int i = 0; i < 2; i++) release_all(out[i], c->n_regions > i ? c->n_out[i] : 0);
  cfg_discard(grad);
  if (rc) return -1;
  return stepwise ? 0 : 1;
}

/* ---- data a read needs ---- */

/* Whether reading t needs the segment to run: its data is a recording's, or
 * a leaf's storage it views was written in this segment. */
static bool pending(recording *r, const kiln_tensor *t) {
  if (t->st->meta) return true;
  struct rec_state *s = r->st;
  for (int i = 0; i < s->n_leaf; i++) {
    leaf_state *l = &s->leaf[i];
    if (l->t->st == t->st && map_get(&s->leaves, l->t->serial) != l->value) return true;
  }
  return false;
}

int rec_live_values(recording *r, kiln_tensor *const *skip, int n_skip, rec_live **out, int *n) {
  struct rec_state *s = r->st;
  *out = NULL;
  *n = 0;
  rec_live *lv = alloc_malloc(sizeof *lv * (size_t)(s->n_made + 1));
  if (!lv) return -1;
  /* per meta storage: the tensors made over it, and the first whole tensor
   * whose value (this segment's, current version) covers it */
  for (int i = 0; i < s->n_made; i++) {
    storage *st = s->made[i]->st;
    if (st->meta) st->rec_count = 0, st->rec_value = -1, st->rec_listed = false;
  }
  for (int i = 0; i < s->n_made; i++) {
    kiln_tensor *w = s->made[i];
    storage *st = w->st;
    if (!st->meta) continue;
    st->rec_count++;
    if (st->rec_value < 0 && tensor_covers_storage(w) && r->val[w->rec_id].seg == r->seg &&
        r->val[w->rec_id].version == atomic_load(&st->version))
      st->rec_value = w->rec_id;
  }
  int k = 0;
  for (int i = 0; i < s->n_made; i++) {
    kiln_tensor *t = s->made[i];
    /* alive beyond our reference, and holding data the call computes; or
     * its storage is (a view made outside dispatch, autograd's, holds it) */
    if (!t->st->meta || t->st->rec_listed) continue;
    if (tensor_refs(t) <= 1 && atomic_load(&t->st->refcount) <= t->st->rec_count) continue;
    bool skipped = false;
    for (int j = 0; j < n_skip && !skipped; j++) skipped = skip[j] == t;
    if (skipped) continue;
    /* the storage's data: the value of the tensor that covers it */
    int value = t->st->rec_value;
    if (value < 0) {
      alloc_free(lv);
      fail(r, "a live view whose whole storage the call no longer has");
      return -1;
    }
    t->st->rec_listed = true;
    lv[k++] = (rec_live){value, t->st, -1};
  }
  *out = lv;
  *n = k;
  return 0;
}

void rec_strip_history(recording *r) {
  struct rec_state *s = r->st;
  for (int i = 0; i < s->n_made; i++) {
    kiln_tensor *t = s->made[i];
    if (t->grad_fn) {
      ag_node_release(t->grad_fn);
      t->grad_fn = NULL;
    }
    t->requires_grad = false;
    /* the writes have their conditions: none is a live value to hand out */
    if (t->grad_if) ag_set_grad_if(t, NULL, 0);
  }
}

void rec_restore_grads(recording *r) {
  struct rec_state *s = r->st;
  for (int i = 0; i < s->n_leaf; i++) {
    leaf_state *l = &s->leaf[i];
    if (l->t->grad == l->grad0) continue;
    kiln_release(l->t->grad);
    l->t->grad = kiln_retain(l->grad0);
  }
}

bool rec_grads_kept(const recording *r) {
  const struct rec_state *s = r->st;
  for (int i = 0; i < s->n_leaf; i++) {
    const leaf_state *l = &s->leaf[i];
    /* the leaf's own reference is gone when its .grad was replaced since */
    if (l->grad0 && tensor_refs(l->grad0) > l->grad0_refs - (l->t->grad != l->grad0)) return true;
  }
  return false;
}

kiln_tensor *rec_grad0(recording *r, int leaf_value) {
  leaf_state *l = leaf_of(r, leaf_value);
  return l ? l->grad0 : NULL;
}

/* Leaf values of the segment: each leaf as its own data again. */
void rec_next_segment(recording *r) {
  struct rec_state *s = r->st;
  layouts_fill(r);
  for (int i = 0; i < s->n_made; i++) kiln_release(s->made[i]);
  s->n_made = 0;
  s->n_laid = 0;
  /* layouts stay: a view autograd made in this segment may be read in a later one */
  map_clear(&s->carried);
  map_clear(&s->written); /* this segment's writes are in the data now */
  r->seg++;
  r->seg_start = r->n_ev;
  r->n_reads = 0;
  for (int i = 0; i < s->n_leaf; i++) {
    leaf_state *l = &s->leaf[i];
    rec_vkind kind = r->val[l->value].kind;
    int index = r->val[l->value].index;
    int v = new_value(r, kind, l->t, index, -1);
    if (v < 0) return;
    l->value = v;
    kiln_release(l->grad0);
    l->grad0 = kiln_retain(l->t->grad);
    l->grad0_serial = l->t->grad ? l->t->grad->serial : 0;
    l->grad_value = -1;
    if (map_put(&s->leaves, l->t->serial, v)) fail(r, "out of memory while recording");
  }
}

int rec_leaves(recording *r, rec_leaf **out, int *n) {
  struct rec_state *s = r->st;
  *n = 0;
  *out = alloc_malloc(sizeof **out * (size_t)(s->n_leaf + 1));
  if (!*out) return -1;
  for (int i = 0; i < s->n_leaf; i++) {
    leaf_state *l = &s->leaf[i];
    (*out)[(*n)++] = (rec_leaf){l->t, l->value, map_get(&s->leaves, l->t->serial), l->grad0, l->t->grad, l->grad_value};
  }
  return 0;
}

void rec_pause(recording *r) { rec_end(r); }
void rec_resume(recording *r) {
  r->st->saved = dispatch_hooks();
  dispatch_set_hooks(&r->st->hooks);
}

/* ---- slots: the numbers user code could change between calls ---- */

static int put_i(rec_slot *out, int k, int max, int64_t v) {
  if (k < max) out[k] = (rec_slot){false, v, 0};
  return k + 1;
}
static int put_f(rec_slot *out, int k, int max, double v) {
  if (k < max) out[k] = (rec_slot){true, 0, v};
  return k + 1;
}

bool rec_same_attrs(int op, const op_attrs *a, const op_attrs *b) {
  unsigned all = op_table[op].attrs;
  unsigned f = all & ~(unsigned)(AF_SHAPE | AF_START | AF_END | AF_VALUE | AF_VALUE2 | AF_K | AF_INTS | AF_RNG);
  return (a == b || attrs_equal(f, a, b)) && a->infer == b->infer && a->raw == b->raw &&
         (!(all & AF_SHAPE) || a->ndim == b->ndim) && (!(all & AF_INTS) || a->nints == b->nints);
}

int rec_slots(const rec_event *e, rec_slot *out, int max) {
  const op_attrs *a = e->a;
  int k = 0;
  switch (e->kind) {
  case EV_OP: {
    unsigned f = op_table[e->op].attrs;
    if (f & AF_SHAPE)
      for (int i = 0; i < a->ndim; i++) k = put_i(out, k, max, i == a->infer - 1 ? -1 : a->shape[i].c);
    if (f & AF_START) k = put_i(out, k, max, a->raw ? a->raw_start : a->start.c);
    if (f & AF_END) k = put_i(out, k, max, a->raw ? a->raw_end : a->end.c);
    if (f & AF_VALUE) k = put_f(out, k, max, a->value);
    if (f & AF_VALUE2) k = put_f(out, k, max, a->value2);
    if (f & AF_K) k = put_i(out, k, max, a->k);
    if (f & AF_INTS)
      for (int i = 0; i < a->nints; i++) k = put_i(out, k, max, a->ints[i]);
    if (f & AF_RNG) k = put_i(out, put_i(out, k, max, a->seed.c), max, a->offset.c);
    break;
  }
  case EV_INPLACE:
    if (e->op == OP_COUNT) k = put_f(out, k, max, a->value);
    break;
  case EV_FULL:
  case EV_RAND:
    for (int i = 0; i < a->ndim; i++) k = put_i(out, k, max, a->shape[i].c);
    k = e->kind == EV_FULL ? put_f(out, k, max, a->value) : put_i(out, k, max, a->k);
    break;
  case EV_DATA:
    /* the sizes, then its bytes, as a slot whose rule says whether they are a
     * constant (compared whole by matching) or passed at run time */
    for (int i = 0; i < a->ndim; i++) k = put_i(out, k, max, a->shape[i].c);
    k = put_i(out, k, max, 0);
    break;
  case EV_NUMEL:
  case EV_BREAK:
  case EV_ESCAPE:
  case EV_CF:
  case EV_ARG:
  case EV_YIELD:
  case EV_GET:
  case EV_DEAD:
    break;
  }
  return k;
}

/* ---- start and end ---- */

/* How long this thread's last recording grew its lists: the next starts at
 * that size instead of growing again from nothing. */
static _Thread_local struct { int ev, ids, val, made; } last_size;

int rec_begin(recording *r, kiln_tensor *const *in, int n_in, rec_run_fn run, void *run_ctx, struct rec_state *spare) {
  memset(r, 0, sizeof *r);
  r->id = atomic_fetch_add(&next_id, 1);
  r->shape_src = -1;
  r->in = in;
  r->n_in = n_in;
  r->run = run;
  r->run_ctx = run_ctx;
  r->st = spare ? spare : alloc_calloc(1, sizeof *r->st);
  if (!r->st) return -1;
  struct rec_state *s = r->st;
  if (spare) {
    r->ev = s->park.ev, r->cap_ev = s->park.cap_ev;
    r->ids = s->park.ids, r->cap_ids = s->park.cap_ids;
    r->val = s->park.val, r->cap_val = s->park.cap_val;
    r->params = s->park.params, r->cap_params = s->park.cap_params;
    r->param_seen = s->park.seen, r->cap_seen = s->park.cap_seen;
    r->reads = s->park.reads, r->cap_reads = s->park.cap_reads;
    memset(&s->park, 0, sizeof s->park);
  }
  if (alloc_grow((void **)&r->ev, &r->cap_ev, last_size.ev, sizeof *r->ev) ||
      alloc_grow((void **)&r->ids, &r->cap_ids, last_size.ids, sizeof *r->ids) ||
      alloc_grow((void **)&r->val, &r->cap_val, last_size.val, sizeof *r->val) ||
      alloc_grow((void **)&s->made, &s->cap_made, last_size.made, sizeof *s->made))
    return -1;
  s->serial0 = tensor_serial_now();
  for (int i = 0; i < n_in; i++) {
    if (i < 64 && in[i]->grad) r->in_had_grad |= 1ull << i;
    if (i < 64) r->in_refs[i] = tensor_refs(in[i]);
    int v = new_value(r, RV_INPUT, in[i], i, -1);
    if (v < 0) return -1;
    /* the same tensor passed twice: the first input stands for both */
    if (map_get(&s->leaves, in[i]->serial) < 0 && add_leaf(r, in[i], v)) return -1;
  }
  s->hooks = (trace_hooks){.ctx = r,
                           .op = on_op,
                           .inplace = on_inplace,
                           .read = on_read,
                           .zero_grad = on_zero_grad,
                           .numel = on_numel,
                           .size_read = on_size_read,
                           .shape_src = on_shape_src,
                           .record = true,
                           .factory = on_factory,
                           .cf = on_cf};
  s->saved = dispatch_hooks();
  dispatch_set_hooks(&s->hooks);
  return r->failed ? -1 : 0;
}

void rec_end(recording *r) {
  if (r->st && dispatch_hooks() == &r->st->hooks) dispatch_set_hooks(r->st->saved);
}

struct rec_state *rec_keep(recording *r) {
  struct rec_state *s = r->st;
  if (r->n_ev) {
    last_size.ev = r->n_ev, last_size.ids = r->n_ids, last_size.val = r->n_val;
    last_size.made = s && s->n_made > last_size.made ? s->n_made : last_size.made;
  }
  for (int i = 0; i < r->n_params; i++) kiln_release(r->params[i]);
  if (!s) {
    alloc_free(r->params);
    alloc_free(r->param_seen);
    alloc_free(r->reads);
    alloc_free(r->ev);
    alloc_free(r->ids);
    alloc_free(r->val);
    memset(r, 0, sizeof *r);
    return NULL;
  }
  rec_end(r);
  for (int i = 0; i < s->n_made; i++) kiln_release(s->made[i]);
  for (int i = 0; i < s->n_leaf; i++) {
    kiln_release(s->leaf[i].grad0);
    if (s->leaf[i].held) kiln_release(s->leaf[i].t);
  }
  for (int i = 0; i < s->n_blocks; i++) alloc_free(s->blocks[i]);
  s->n_made = s->n_laid = s->n_leaf = s->n_blocks = 0;
  s->chunk_at = s->chunk_used = 0;
  map_clear(&s->leaves);
  /* an entry of a param written in place would give a view of it made outside
   * dispatch, next call, this call's value id (test_outside_view_on_reused_recording) */
  map_clear(&s->layouts);
  map_clear(&s->carried);
  map_clear(&s->written);
  s->saved = NULL;
  memset(&s->hooks, 0, sizeof s->hooks);
  s->park.ev = r->ev, s->park.cap_ev = r->cap_ev;
  s->park.ids = r->ids, s->park.cap_ids = r->cap_ids;
  s->park.val = r->val, s->park.cap_val = r->cap_val;
  s->park.params = r->params, s->park.cap_params = r->cap_params;
  s->park.seen = r->param_seen, s->park.cap_seen = r->cap_seen;
  s->park.reads = r->reads, s->park.cap_reads = r->cap_reads;
  memset(r, 0, sizeof *r);
  return s;
}

void rec_spare_free(struct rec_state *s) {
  if (!s) return;
  alloc_free(s->park.params);
  alloc_free(s->park.seen);
  alloc_free(s->park.reads);
  alloc_free(s->park.ev);
  alloc_free(s->park.ids);
  alloc_free(s->park.val);
  alloc_free(s->blocks);
  for (int i = 0; i < s->n_chunk; i++) alloc_free(s->chunk[i]);
  alloc_free(s->chunk);
  alloc_free(s->made);
  alloc_free(s->leaf);
  map_free(&s->leaves);
  map_free(&s->layouts);
  map_free(&s->carried);
  map_free(&s->written);
  alloc_free(s);
}

void rec_free(recording *r) { rec_spare_free(rec_keep(r)); }
