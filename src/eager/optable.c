/* The op table expanded from ops.def, and what is done with attributes by
 * walking an op's schema (the AF_* fields of its row): hashing, equality and
 * evaluation at symbol values. The IR printer and parser walk the same
 * schema (print.c, parse.c), so a new attribute field is written once here
 * and once in each of them, not once per op. */
#include <string.h>

#include "eager/eager.h"

#define NONE NULL
#define DT(in, out, pr) {DT_IN_##in, DT_OUT_##out, DT_PROMOTE_##pr, DT_FIRST_##pr}
enum { DT_PROMOTE_NP = 0, DT_PROMOTE_P = 1, DT_PROMOTE_P1 = 1, DT_FIRST_NP = 0, DT_FIRST_P = 0, DT_FIRST_P1 = 1 };

const op_info op_table[OP_COUNT] = {
#define X(id, nm, ar, kd, at, dty, sh, kn, ck, bw, sv, cgc, cs, em)                                                    \
  [OP_##id] = {.name = #nm, .arity = ar, .kind = KIND_##kd, .attrs = (at), .dt = dty, .shape = sh, .kernel = kn,        \
               .check = ck, .backward = #bw, .saves = (sv), .cg = CGC_##cgc, .cost = cs, .emitter = #em},
#include "ops.def"
#undef X
};
#undef NONE
#undef DT

bool op_differentiable(op_id op) { return strcmp(op_table[op].backward, "NONE") != 0; }
bool op_has_emitter(op_id op) { return strcmp(op_table[op].emitter, "NONE") != 0; }

/* ---- attributes ---- */

const char *attr_field_name(unsigned field) {
  static const char *const names[AF_FIELDS] = {"axes", "keepdim", "shape", "perm", "dim", "start", "end",
                                               "step", "dtype", "value", "value2", "k", "flag", "ints", "rng"};
  for (int i = 0; i < AF_FIELDS; i++)
    if (field == 1u << i) return names[i];
  return "?";
}

static int clamp(int n, int hi) { return n < 0 ? 0 : n > hi ? hi : n; }

static uint64_t mix(uint64_t h, uint64_t v) { return h ^ (v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2)); }
static uint64_t dim_hash(sym_dim d) { return d.e ? (uint64_t)(uintptr_t)d.e : (uint64_t)d.c * 31 + 7; }
static bool dim_eq(sym_dim a, sym_dim b) { return a.e == b.e && (a.e || a.c == b.c); }
static uint64_t bits_of(double v) {
  uint64_t b;
  memcpy(&b, &v, sizeof b);
  return b;
}

uint64_t attrs_hash(unsigned f, const op_attrs *a) {
  uint64_t h = 0;
  if (f & AF_AXES) {
    h = mix(h, (uint64_t)a->naxes);
    for (int i = 0; i < clamp(a->naxes, MAXD); i++) h = mix(h, (uint64_t)a->axes[i]);
  }
  if (f & AF_KEEPDIM) h = mix(h, a->keepdim);
  if (f & AF_SHAPE) {
    h = mix(h, (uint64_t)a->ndim);
    for (int i = 0; i < clamp(a->ndim, MAXD); i++) h = mix(h, dim_hash(a->shape[i]));
  }
  if (f & AF_PERM)
    for (int i = 0; i < MAXD; i++) h = mix(h, (uint64_t)a->perm[i]);
  if (f & AF_DIM) h = mix(h, (uint64_t)a->dim);
  if (f & AF_START) h = mix(h, dim_hash(a->start));
  if (f & AF_END) h = mix(h, dim_hash(a->end));
  if (f & AF_STEP) h = mix(h, (uint64_t)a->step);
  if (f & AF_DTYPE) h = mix(h, (uint64_t)a->dtype);
  if (f & AF_VALUE) h = mix(h, bits_of(a->value));
  if (f & AF_VALUE2) h = mix(h, bits_of(a->value2));
  if (f & AF_K) h = mix(h, (uint64_t)a->k);
  if (f & AF_FLAG) h = mix(h, a->flag);
  if (f & AF_INTS) {
    h = mix(h, (uint64_t)a->nints);
    for (int i = 0; i < clamp(a->nints, 2 * MAXD); i++) h = mix(h, (uint64_t)a->ints[i]);
  }
  if (f & AF_RNG) h = mix(mix(h, dim_hash(a->seed)), dim_hash(a->offset));
  return h;
}

bool attrs_equal(unsigned f, const op_attrs *a, const op_attrs *b) {
  if ((f & AF_AXES) &&
      (a->naxes != b->naxes || memcmp(a->axes, b->axes, sizeof(int) * (size_t)clamp(a->naxes, MAXD))))
    return false;
  if ((f & AF_KEEPDIM) && a->keepdim != b->keepdim) return false;
  if (f & AF_SHAPE) {
    if (a->ndim != b->ndim) return false;
    for (int i = 0; i < clamp(a->ndim, MAXD); i++)
      if (!dim_eq(a->shape[i], b->shape[i])) return false;
  }
  if ((f & AF_PERM) && memcmp(a->perm, b->perm, sizeof a->perm)) return false;
  if ((f & AF_DIM) && a->dim != b->dim) return false;
  if ((f & AF_START) && !dim_eq(a->start, b->start)) return false;
  if ((f & AF_END) && !dim_eq(a->end, b->end)) return false;
  if ((f & AF_STEP) && a->step != b->step) return false;
  if ((f & AF_DTYPE) && a->dtype != b->dtype) return false;
  /* numbers by their bits: -0.0 and 0.0 are different attributes, a NaN equals itself */
  if ((f & AF_VALUE) && bits_of(a->value) != bits_of(b->value)) return false;
  if ((f & AF_VALUE2) && bits_of(a->value2) != bits_of(b->value2)) return false;
  if ((f & AF_K) && a->k != b->k) return false;
  if ((f & AF_FLAG) && a->flag != b->flag) return false;
  if ((f & AF_INTS) &&
      (a->nints != b->nints || memcmp(a->ints, b->ints, sizeof(int64_t) * (size_t)clamp(a->nints, 2 * MAXD))))
    return false;
  if ((f & AF_RNG) && (!dim_eq(a->seed, b->seed) || !dim_eq(a->offset, b->offset))) return false;
  return true;
}

static int eval_dim(sym_dim *d, const int64_t *vals, int nvals) {
  int64_t v;
  if (sym_eval(*d, vals, nvals, &v)) return -1;
  *d = sym_const(v);
  return 0;
}

int attrs_eval(unsigned f, const op_attrs *a, const int64_t *vals, int nvals, op_attrs *out) {
  *out = *a;
  if (f & AF_SHAPE)
    for (int i = 0; i < clamp(a->ndim, MAXD); i++)
      if (eval_dim(&out->shape[i], vals, nvals)) return -1;
  if ((f & AF_START) && eval_dim(&out->start, vals, nvals)) return -1;
  if ((f & AF_END) && eval_dim(&out->end, vals, nvals)) return -1;
  if ((f & AF_RNG) && (eval_dim(&out->seed, vals, nvals) || eval_dim(&out->offset, vals, nvals))) return -1;
  return 0;
}
