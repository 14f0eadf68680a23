/* Reverse mode through a construct recorded as one region (on_cf in
 * record.c). The construct's results get one autograd node (a multi-output
 * node, autograd.c) that keeps what the recording logged of each body: its
 * events, copied into a small program over the region's arguments and its
 * captures (the outer tensors it read). The user's C body is never run
 * again, so a backward after the body's ctx went out of scope is sound, and
 * so are bodies with side effects.
 *
 * Backward replays a body's program with gradients on over fresh leaves,
 * then takes the gradients of sum_k sum(out_k * cot_k) (the cotangents of
 * its results) with kiln's autograd: under a recording, that records the
 * step's VJP, forward recomputed included, as one region again.
 *  - scan: the forward also stacks each step's incoming carry as extra ys
 *    (the saved carries: T times the carry's size). The backward is a
 *    kiln_scan over the steps in reverse (flipped xs: the saved carries, xs,
 *    the ys' cotangents), whose carry is the carry's cotangent and the
 *    captures' gradients summed over the steps, and whose ys are the xs'
 *    gradients. By default (kiln_options.scan_save, KILN_SCAN_SAVE_DOTS)
 *    the forward also yields each step's matmul results (the body's own
 *    level) and the replay takes them for the matmul's value, recording
 *    only its autograd node: the reverse step computes no forward matmul.
 *    The rest of a step is recomputed; with KILN_SCAN_SAVE_CARRIES all of it.
 *    A carry the loss cannot reach (no read result depends on it, step
 *    after step: scan_deps, plan_live) gets no cotangent, so that what only
 *    it reaches stays without a gradient, as eagerly.
 *  - cond: the backward is a kiln_cond on the same predicate of the two
 *    branches' VJPs.
 *  - while_loop: forward only, as in JAX: its results get a node whose
 *    backward is an error naming the loop's line (ag_forward_only).
 * A body whose events a program cannot hold (a nested construct, a
 * draw, an in-place write) is not a region: record.c runs it step by step. */
#include <string.h>

#include "tracer/tracer.h"

/* A body's events as a program. Every value a construct's bodies make
 * (nested bodies included) has a slot of its own; a reference is a slot
 * (>= 0) or a capture (-1 - index). A nested construct is an EV_CF
 * instruction whose regions are ranges of the instructions after it, and
 * an EV_GET per result it hands to the body. */
typedef struct cfg_region {
  int n_args, args[64]; /* the slots its arguments take */
  int begin, end;       /* its instructions */
  int n_out, *out;      /* the references of its results */
} cfg_region;

typedef struct cfg_cf {
  cf_kind kind;
  int n_carry, n_xs, n_regions, n_results;
  cfg_region reg[2];
  int next;          /* the first instruction after its regions */
  kiln_tensor **res; /* its results, while a replay runs (the caller's scope) */
} cfg_cf;

typedef struct cfg_ins {
  rec_ekind kind; /* EV_OP, EV_FULL, EV_DATA, EV_NUMEL, EV_CF or EV_GET */
  int op;
  op_attrs a;
  int n_in, *in;
  int out;     /* its slot (EV_CF: none) */
  void *data;  /* EV_DATA's bytes (owned) */
  cfg_cf *cf;  /* EV_CF: the construct; EV_GET: the construct whose result a.k it is */
  const char *file;
  int line;
  int vid;  /* EV_OP: the recording's value id of its result */
  int keep; /* its per-step values the forward yields (saved): their index, else -1 */
} cfg_ins;

typedef struct cfg_prog {
  cfg_ins *ins;
  int n_ins, cap_ins, n_slots;
  cfg_region top[2]; /* the construct's own regions */
} cfg_prog;

/* What a value of one step depends on, as far as a gradient can flow: the
 * region's arguments (a scan's carries, then its xs) and the captures, a
 * bit each. An over-approximation (a nested construct's results depend on
 * all it reads), except that a value of an integer or bool dtype depends on
 * nothing: no gradient flows through it. */
typedef struct cfg_dep {
  uint64_t arg, cap;
} cfg_dep;

struct cfg_grad {
  cf_kind kind;
  int n_carry, n_xs, n_res; /* n_res: the construct's results the user sees */
  int n_in;                 /* the construct's inputs, then the captures: the node's inputs */
  kiln_tensor **in;
  int n_caps, cap_caps;
  kiln_tensor **caps;
  cfg_prog prog;
  kiln_tensor **saved; /* scan: the stacked carries (n_carry), then the kept values (n_kept) */
  int n_kept, kept_ids[64]; /* scan_save: the instructions whose per-step values are saved, as value ids */
  cfg_dep dep[128];         /* scan: what each result of a step (carries, then ys) depends on */
  const char *file;
  int line;
};

/* ---- the program, from the recording ---- */

enum { NO_SLOT = -1, POISON = -2, BAD_REF = INT32_MIN };

typedef struct builder {
  recording *r;
  cfg_grad *g;
  int *slot_of; /* value id -> slot, NO_SLOT, or POISON (a value no body may read) */
  int k;        /* the next event */
} builder;

static int ref_of(builder *b, int id) {
  cfg_grad *g = b->g;
  if (b->slot_of[id] >= 0) return b->slot_of[id];
  if (b->slot_of[id] == POISON) return BAD_REF;
  kiln_tensor *t = rec_tensor_of(b->r, id);
  if (!t) return BAD_REF;
  for (int c = 0; c < g->n_caps; c++)
    if (g->caps[c] == t) return -1 - c;
  if (alloc_grow((void **)&g->caps, &g->cap_caps, g->n_caps + 1, sizeof *g->caps)) return BAD_REF;
  g->caps[g->n_caps] = kiln_retain(t);
  return -1 - g->n_caps++;
}

static cfg_ins *ins_new(builder *b, const rec_event *e) {
  cfg_prog *p = &b->g->prog;
  if (alloc_grow((void **)&p->ins, &p->cap_ins, p->n_ins + 1, sizeof *p->ins)) return NULL;
  cfg_ins *in = &p->ins[p->n_ins++];
  *in = (cfg_ins){.kind = e->kind, .op = e->op, .a = *e->a, .n_in = e->n_in, .out = -1, .file = e->file, .line = e->line,
                  .vid = e->out, .keep = -1};
  if (!(in->in = alloc_malloc(sizeof(int) * (size_t)(e->n_in + 1)))) return NULL;
  for (int j = 0; j < e->n_in; j++)
    if ((in->in[j] = ref_of(b, b->r->ids[e->in + j])) == BAD_REF) return NULL;
  return in;
}

static int parse_cf(builder *b);

/* Region i of the construct whose events are being read: its arguments,
 * its body (nested constructs included), its yield. 0, or -1 when a
 * program cannot hold it (or out of memory). n_keep: results kept (-1 all). */
static int parse_region(builder *b, int i, cfg_region *reg, int n_keep) {
  recording *r = b->r;
  cfg_prog *p = &b->g->prog;
  reg->begin = p->n_ins;
  for (; b->k < r->n_ev; b->k++) {
    const rec_event *e = &r->ev[b->k];
    if (e->kind == EV_DEAD) continue; /* a nested construct run step by step: its steps follow */
    if (e->kind == EV_ARG) {
      if (e->a->dim != i || e->a->k < 0 || e->a->k >= 64) return -1;
      reg->args[e->a->k] = b->slot_of[e->out] = p->n_slots++;
      if (e->a->k + 1 > reg->n_args) reg->n_args = (int)e->a->k + 1;
      continue;
    }
    if (e->kind == EV_YIELD) {
      if (e->a->k != i) return -1;
      reg->end = p->n_ins;
      reg->n_out = n_keep >= 0 && n_keep < e->n_in ? n_keep : e->n_in;
      if (!(reg->out = alloc_malloc(sizeof(int) * (size_t)(e->n_in + 1)))) return -1;
      for (int j = 0; j < reg->n_out; j++)
        if ((reg->out[j] = ref_of(b, r->ids[e->in + j])) == BAD_REF) return -1;
      b->k++;
      return 0;
    }
    if (e->kind == EV_CF) {
      if (parse_cf(b)) return -1;
      b->k--; /* the loop steps past the construct's last event */
      continue;
    }
    bool ok = e->kind == EV_FULL || e->kind == EV_DATA || e->kind == EV_NUMEL ||
              (e->kind == EV_OP && !(op_table[e->op].attrs & AF_RNG));
    if (!ok) return -1; /* a draw, a write in place, a break: not replayable */
    cfg_ins *in = ins_new(b, e);
    if (!in) return -1;
    if (e->kind == EV_DATA) {
      size_t bytes = rec_ev_bytes(e);
      if (!(in->data = alloc_malloc(bytes + 1))) return -1;
      if (bytes) memcpy(in->data, e->data, bytes);
    }
    in->out = b->slot_of[e->out] = p->n_slots++;
  }
  return -1;
}

/* A nested construct at event b->k (its EV_CF): an instruction, its
 * regions, and one EV_GET instruction per result the body reads. */
static int parse_cf(builder *b) {
  recording *r = b->r;
  const rec_event *e = &r->ev[b->k];
  cfg_cf *cf = alloc_calloc(1, sizeof *cf);
  if (!cf) return -1;
  cfg_ins *in = ins_new(b, e);
  if (!in) return alloc_free(cf), -1;
  in->cf = cf;
  cf->kind = e->op == IR_COND ? CF_COND : e->op == IR_WHILE ? CF_WHILE : CF_SCAN;
  cf->n_carry = (int)e->a->k;
  cf->n_xs = e->a->dim;
  cf->n_regions = ir_n_sub(e->op);
  /* a scan recorded for autograd stacked its carries as extra ys (a.flag): not the body's */
  int n_keep = cf->kind == CF_SCAN && e->a->flag ? -2 : -1;
  b->k++;
  for (int i = 0; i < cf->n_regions; i++) {
    if (n_keep == -2) {
      /* the yield's count less the carries it saved: its yield is the first at this depth */
      int y = b->k, open[64], n_open = 0;
      for (; y < r->n_ev; y++) {
        const rec_event *ye = &r->ev[y];
        if (ye->kind == EV_CF && n_open < 64) open[n_open++] = ir_n_sub(ye->op);
        if (ye->kind != EV_YIELD) continue;
        if (!n_open) break;
        if (--open[n_open - 1] == 0) n_open--;
      }
      if (y == r->n_ev) return -1;
      n_keep = r->ev[y].n_in - cf->n_carry;
    }
    if (parse_region(b, i, &cf->reg[i], n_keep)) return -1;
  }
  cf->n_results = cf->kind == CF_WHILE ? cf->n_carry : cf->reg[0].n_out;
  if (!(cf->res = alloc_calloc((size_t)cf->n_results + 1, sizeof *cf->res))) return -1;
  cfg_cf *mine = cf;
  cf->next = b->g->prog.n_ins;
  for (; b->k < r->n_ev && r->ev[b->k].kind == EV_GET; b->k++) {
    const rec_event *ge = &r->ev[b->k];
    if (ge->a->k >= mine->n_results) {
      b->slot_of[ge->out] = POISON; /* a saved carry: autograd's, not the body's */
      continue;
    }
    cfg_ins *gi = ins_new(b, ge);
    if (!gi) return -1;
    gi->cf = mine;
    gi->out = b->slot_of[ge->out] = b->g->prog.n_slots++;
  }
  return 0;
}

/* The construct's regions from its events (EV_CF at first). 0, or -1 when
 * a program cannot hold them or out of memory. */
static int prog_build(recording *r, int first, cfg_grad *g, int n_regions) {
  builder b = {.r = r, .g = g, .k = first + 1};
  if (!(b.slot_of = alloc_malloc(sizeof(int) * (size_t)(r->n_val + 1)))) return -1;
  for (int v = 0; v < r->n_val; v++) b.slot_of[v] = NO_SLOT;
  int rc = 0;
  for (int i = 0; i < n_regions && !rc; i++) rc = parse_region(&b, i, &g->prog.top[i], -1);
  alloc_free(b.slot_of);
  return rc;
}

static void prog_free(cfg_prog *p) {
  for (int i = 0; i < p->n_ins; i++) {
    cfg_ins *in = &p->ins[i];
    alloc_free(in->in);
    alloc_free(in->data);
    if (in->kind == EV_CF && in->cf) {
      for (int k = 0; k < 2; k++) alloc_free(in->cf->reg[k].out);
      alloc_free(in->cf->res);
      alloc_free(in->cf);
    }
  }
  alloc_free(p->ins);
  for (int k = 0; k < 2; k++) alloc_free(p->top[k].out);
}

/* How region reg reads capture c: READ_NONE, READ_NESTED (only inside a
 * nested construct, or as a scan's xs: eagerly its gradient exists only
 * where that construct ran the part that reads it) or READ_OWN (at its own
 * level: its gradient exists whenever the region runs). */
enum { READ_NONE, READ_NESTED, READ_OWN };
static int cap_read(const cfg_prog *p, const cfg_region *reg, int c) {
  int ref = -1 - c, how = READ_NONE;
  bool plain = false, nested = false;
  for (int k = 0; k < reg->n_out; k++)
    if (reg->out[k] == ref) return READ_OWN;
  for (int i = reg->begin; i < reg->end; i++) {
    const cfg_ins *in = &p->ins[i];
    if (in->kind != EV_CF) {
      for (int j = 0; j < in->n_in; j++) plain |= in->in[j] == ref;
      continue;
    }
    nested = true;
    const cfg_cf *cf = in->cf;
    for (int j = 0; j < in->n_in; j++) {
      /* a cond's operands and a scan's initial carry get gradients whatever runs */
      bool own = cf->kind == CF_COND || (cf->kind == CF_SCAN && j < cf->n_carry);
      if (in->in[j] == ref) {
        if (own) return READ_OWN;
        how = READ_NESTED;
      }
    }
    for (int k = 0; k < cf->n_regions; k++)
      if (cap_read(p, &cf->reg[k], c) != READ_NONE) how = READ_NESTED;
    i = cf->next - 1;
  }
  /* read at its own level: its gradient exists whenever the region runs,
   * unless what it made reaches the loss only through a nested construct
   * (h = x @ W the xs of an inner scan of length 0), which this does not
   * follow: with a nested construct in the region it gets a flag too, which
   * says "reached" for a gradient that has no condition of its own */
  if (plain) return nested ? READ_NESTED : READ_OWN;
  return how;
}

/* Whether the gradient d exists, as a 0-d bool: false where none was
 * reached, its grad_if where it has one (a nested construct's), else true. */
static kiln_tensor *exists_flag(const kiln_tensor *d, bool reached, const char *file, int line) {
  if (reached && d->grad_if) return ag_grad_if_bool(d, file, line);
  return kiln_scalar_at(KILN_BOOL, reached, file, line);
}

/* ---- which values of a step depend on which arguments ---- */

static cfg_dep dep_or(cfg_dep a, cfg_dep b) { return (cfg_dep){a.arg | b.arg, a.cap | b.cap}; }
static cfg_dep dep_of(const cfg_dep *sd, int ref) {
  return ref >= 0 ? sd[ref] : (cfg_dep){0, (uint64_t)1 << (-1 - ref)};
}

static void deps_range(const cfg_prog *p, const recording *r, int begin, int end, cfg_dep *sd, cfg_dep *acc);

/* The dependencies of a nested construct's results (res, n_results): a
 * cond's result on what either branch's yields there depends on; a scan's
 * carry on its init and what the step's carry out depends on, round after
 * round to a fixpoint, a y on what the step's y depends on then; a
 * while_loop's (forward only) on all it reads. */
static void deps_cf(const cfg_prog *p, const recording *r, const cfg_ins *in, cfg_dep *sd, cfg_dep *res) {
  const cfg_cf *cf = in->cf;
  cfg_dep all = {0, 0}, x[128];
  for (int j = 0; j < in->n_in && j < 128; j++) x[j] = dep_of(sd, in->in[j]), all = dep_or(all, x[j]);
  for (int o = 0; o < cf->n_results; o++) res[o] = (cfg_dep){0, 0};
  if (cf->kind == CF_COND) {
    for (int k = 0; k < 2; k++) {
      const cfg_region *reg = &cf->reg[k];
      cfg_dep acc = {0, 0};
      for (int a = 0; a < reg->n_args && 1 + a < in->n_in; a++) sd[reg->args[a]] = x[1 + a];
      deps_range(p, r, reg->begin, reg->end, sd, &acc);
      for (int o = 0; o < reg->n_out && o < cf->n_results; o++) res[o] = dep_or(res[o], dep_of(sd, reg->out[o]));
    }
    return;
  }
  const cfg_region *reg = &cf->reg[0];
  if (cf->kind == CF_SCAN) {
    cfg_dep carry[128];
    int nc = cf->n_carry;
    for (int k = 0; k < nc; k++) carry[k] = x[k];
    for (bool more = true; more;) {
      cfg_dep acc = {0, 0};
      for (int a = 0; a < reg->n_args && a < in->n_in; a++) sd[reg->args[a]] = a < nc ? carry[a] : x[a];
      deps_range(p, r, reg->begin, reg->end, sd, &acc);
      more = false;
      for (int k = 0; k < nc && k < reg->n_out; k++) {
        cfg_dep d = dep_or(carry[k], dep_of(sd, reg->out[k]));
        more |= d.arg != carry[k].arg || d.cap != carry[k].cap;
        carry[k] = d;
      }
    }
    for (int o = 0; o < cf->n_results && o < reg->n_out; o++) res[o] = o < nc ? carry[o] : dep_of(sd, reg->out[o]);
    return;
  }
  for (cfg_dep was = {~(uint64_t)0, 0}; was.arg != all.arg || was.cap != all.cap;) {
    was = all;
    for (int k = 0; k < cf->n_regions; k++) {
      const cfg_region *rg = &cf->reg[k];
      for (int a = 0; a < rg->n_args; a++) sd[rg->args[a]] = was;
      deps_range(p, r, rg->begin, rg->end, sd, &all);
      for (int o = 0; o < rg->n_out; o++) all = dep_or(all, dep_of(sd, rg->out[o]));
    }
  }
  for (int o = 0; o < cf->n_results; o++) res[o] = all;
}

/* The dependencies (sd, by slot) of the values instructions [begin, end)
 * make, their union added to *acc. */
static void deps_range(const cfg_prog *p, const recording *r, int begin, int end, cfg_dep *sd, cfg_dep *acc) {
  for (int i = begin; i < end; i++) {
    const cfg_ins *in = &p->ins[i];
    cfg_dep d = {0, 0};
    if (in->kind == EV_CF) {
      const cfg_cf *cf = in->cf;
      cfg_dep res[128];
      deps_cf(p, r, in, sd, res);
      int j = cf->next;
      for (; j < p->n_ins && p->ins[j].kind == EV_GET && p->ins[j].cf == cf; j++) {
        const cfg_ins *gi = &p->ins[j];
        sd[gi->out] = dtype_is_float(r->val[gi->vid].dtype) && gi->a.k < cf->n_results ? res[gi->a.k] : (cfg_dep){0, 0};
        *acc = dep_or(*acc, sd[gi->out]);
      }
      i = j - 1;
      continue;
    }
    if (in->kind == EV_OP && dtype_is_float(r->val[in->vid].dtype))
      for (int j = 0; j < in->n_in; j++) d = dep_or(d, dep_of(sd, in->in[j]));
    if (in->out >= 0) sd[in->out] = d;
    *acc = dep_or(*acc, d);
  }
}

/* g->dep: what each result of a scan's step depends on. 0 or -1 (out of memory). */
static int scan_deps(cfg_grad *g, const recording *r) {
  const cfg_region *top = &g->prog.top[0];
  cfg_dep *sd = alloc_calloc((size_t)g->prog.n_slots + 1, sizeof *sd), acc = {0, 0};
  if (!sd) return -1;
  for (int a = 0; a < top->n_args && a < 64; a++) sd[top->args[a]] = (cfg_dep){(uint64_t)1 << a, 0};
  deps_range(&g->prog, r, top->begin, top->end, sd, &acc);
  for (int o = 0; o < g->n_res && o < 128; o++)
    g->dep[o] = o < top->n_out ? dep_of(sd, top->out[o]) : (cfg_dep){~(uint64_t)0, ~(uint64_t)0};
  alloc_free(sd);
  return 0;
}

/* ---- replay ---- */

typedef struct replay {
  const cfg_grad *g;
  kiln_tensor **v;            /* the slots */
  kiln_tensor *const *kept;   /* this step's kept values (NULL: recompute every op) */
} replay;

typedef struct body_ctx {
  replay *rp;
  const cfg_cf *cf;
} body_ctx;

static kiln_tensor *ref_get(const replay *rp, int ref) { return ref >= 0 ? rp->v[ref] : rp->g->caps[-1 - ref]; }

static int run_range(replay *rp, int begin, int end);

/* Region i of a construct replayed as its body: in[] into its argument slots. */
static int run_region(replay *rp, const cfg_region *reg, kiln_tensor *const *in, kiln_tensor **out) {
  for (int j = 0; j < reg->n_args; j++) rp->v[reg->args[j]] = in[j];
  if (run_range(rp, reg->begin, reg->end)) return -1;
  for (int k = 0; k < reg->n_out; k++) out[k] = ref_get(rp, reg->out[k]);
  return 0;
}
static int replay_body0(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  body_ctx *bc = ctx;
  return run_region(bc->rp, &bc->cf->reg[0], in, out);
}
static int replay_body1(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  body_ctx *bc = ctx;
  return run_region(bc->rp, &bc->cf->reg[1], in, out);
}

static int run_cf(replay *rp, const cfg_ins *in, kiln_tensor *const *x) {
  const cfg_cf *cf = in->cf;
  body_ctx bc = {rp, cf};
  const char *file = in->file;
  int line = in->line;
  switch (cf->kind) {
  case CF_COND:
    return kiln_cond_at(x[0], replay_body0, replay_body1, &bc, in->n_in - 1, x + 1, cf->n_results, cf->res, file, line);
  case CF_WHILE:
    return kiln_while_loop_at(replay_body0, replay_body1, &bc, cf->n_carry, x, cf->res, file, line);
  case CF_SCAN:
    return kiln_scan_at(replay_body0, &bc, cf->n_carry, x, cf->n_xs, x + cf->n_carry, cf->res,
                        cf->n_results - cf->n_carry, cf->res + cf->n_carry, file, line);
  }
  return -1;
}

/* The op of in over x whose value the forward saved (kept): an identity
 * view of it (a permute that passes no size, which the passes drop), with
 * the op's autograd node over x, so that the gradients flow as through the
 * op while the op itself does not run again. */
static kiln_tensor *kept_value(kiln_tensor *kept, const cfg_ins *in, kiln_tensor *const *x) {
  int perm[MAXD];
  for (int d = 0; d < kept->ndim; d++) perm[d] = d;
  kiln_tensor *t = kiln_permute_at(kept, perm, in->file, in->line);
  if (!t || ag_record((op_id)in->op, x, in->n_in, &in->a, t, in->file, in->line)) return NULL;
  return t;
}

static int run_range(replay *rp, int begin, int end) {
  const cfg_prog *p = &rp->g->prog;
  for (int i = begin; i < end; i++) {
    const cfg_ins *in = &p->ins[i];
    kiln_tensor *x[128];
    if (in->n_in > 128) return err_set(in->file, in->line, "autograd", "more than 128 inputs to replay"), -1;
    for (int j = 0; j < in->n_in; j++) x[j] = ref_get(rp, in->in[j]);
    int64_t shape[MAXD];
    for (int d = 0; d < in->a.ndim && d < MAXD; d++) shape[d] = in->a.shape[d].c;
    kiln_tensor *t = NULL;
    switch (in->kind) {
    case EV_OP:
      t = in->keep >= 0 && rp->kept ? kept_value(rp->kept[in->keep], in, x)
                                     : op_dispatch((op_id)in->op, x, in->n_in, &in->a, in->file, in->line);
      break;
    case EV_FULL: t = kiln_full_at(in->a.dtype, in->a.ndim, shape, in->a.value, in->file, in->line); break;
    case EV_DATA: t = kiln_tensor_from_at(in->a.dtype, in->a.ndim, shape, in->data, in->file, in->line); break;
    case EV_NUMEL: t = numel_scalar(x[0], in->a.axes, in->a.naxes, in->a.start.c, in->a.dtype, in->file, in->line); break;
    case EV_GET: t = in->cf->res[in->a.k]; break;
    case EV_CF:
      if (run_cf(rp, in, x)) return -1;
      i = in->cf->next - 1;
      continue;
    default: break;
    }
    if (!t) return -1;
    rp->v[in->out] = t;
  }
  return 0;
}

/* Runs the construct's region i over args: out[] scope-owned, or -1 with the error set. */
static int prog_run(const cfg_grad *g, int region, kiln_tensor *const *args, kiln_tensor *const *kept,
                    kiln_tensor **out) {
  replay rp = {g, alloc_calloc((size_t)g->prog.n_slots + 1, sizeof(kiln_tensor *)), kept};
  if (!rp.v) return err_set(g->file, g->line, "autograd", "out of memory"), -1;
  int rc = run_region(&rp, &g->prog.top[region], args, out);
  alloc_free(rp.v);
  return rc;
}

/* ---- a body's VJP ---- */

/* Zeros of t's dtype and shape, the shape taken from t itself: sizes passed
 * as numbers could be taken for another symbol of the same value. */
static kiln_tensor *zeros_like(kiln_tensor *t, const char *file, int line) {
  kiln_tensor *z = kiln_scalar_at(t->dtype, 0, file, line);
  return kiln_where_at(kiln_eq_at(t, t, file, line), z, z, file, line);
}

/* d with x's dims as the graph writes them: a gradient's dims may be other
 * symbols of the same value (or constants), and a carry's or a branch's
 * type must agree in the graph, not only in value. NULL: zeros like x. */
static kiln_tensor *shaped_like(kiln_tensor *x, kiln_tensor *d, const char *file, int line) {
  if (!d) return zeros_like(x, file, line);
  if (d->ndim == 0) return d;
  kiln_tensor *all = kiln_eq_at(x, x, file, line);
  return kiln_where_at(all, d, d, file, line); /* broadcast keeps the first operand's dims where they are symbols */
}

/* Region i replayed over args (gradients on, the args that need[] theirs
 * as new leaves); then the gradients of sum_k sum(out_k * cot_k) (cot_k
 * NULL: none) into d: d[j] of args[j] (NULL unless need[j]), d[n_args + c]
 * of each capture that requires grad (zeros where none flows, and
 * reached[] false). 0 or -1. */
static int vjp(const cfg_grad *g, int region, kiln_tensor *const *args, kiln_tensor *const *kept, const bool *need,
               kiln_tensor *const *cot, kiln_tensor **d, bool *reached) {
  const cfg_region *p = &g->prog.top[region];
  int n_args = p->n_args, n = 0, rc = 0;
  kiln_tensor *out[128], *wrt[192], *res[192], *own[128];
  int where[192];
  bool had[128];
  /* An argument passed twice, or also read as a capture (eagerly, after an
   * escape: a recording's arguments are new tensors), gets an alias of its
   * own, so that each slot's gradient is its own share. */
  for (int j = 0; j < n_args; j++) {
    bool dup = false;
    for (int i = 0; i < j; i++) dup |= args[i] == args[j];
    for (int c = 0; c < g->n_caps; c++) dup |= g->caps[c] == args[j];
    own[j] = dup ? tensor_view(args[j], args[j]->ndim, args[j]->shape, args[j]->stride, args[j]->offset) : NULL;
    if (dup && !own[j]) rc = -1, err_set(g->file, g->line, "autograd", "out of memory");
    if (own[j]) scope_adopt(own[j]);
    own[j] = own[j] ? own[j] : args[j];
  }
  if (rc) return -1;
  args = own;
  int depth = grad_mode_force_on();
  for (int j = 0; j < n_args; j++) {
    d[j] = NULL;
    had[j] = args[j]->requires_grad;
    if (!need[j]) continue;
    /* a new leaf (an eager operand keeps its history: the walk stops at it) */
    if (!args[j]->grad_fn) args[j]->requires_grad = true;
    where[n] = j;
    wrt[n++] = args[j];
  }
  for (int c = 0; c < g->n_caps; c++)
    if (g->caps[c]->requires_grad && dtype_is_float(g->caps[c]->dtype)) where[n] = n_args + c, wrt[n++] = g->caps[c];
  rc = prog_run(g, region, args, kept, out);
  kiln_tensor *L = NULL;
  for (int k = 0; !rc && k < p->n_out; k++) {
    if (!cot[k] || !out[k]->requires_grad) continue;
    kiln_tensor *term = kiln_sum_axes_at(kiln_mul_at(out[k], cot[k], g->file, g->line), NULL, 0, false, g->file, g->line);
    L = L ? kiln_add_at(L, term, g->file, g->line) : term;
    if (!L) rc = -1;
  }
  for (int j = 0; j < n; j++) res[j] = NULL;
  if (!rc && L) rc = ag_grad_of_stop(L, wrt, n, res, g->file, g->line);
  grad_mode_restore(depth);
  for (int j = 0; j < n && !rc; j++) {
    kiln_tensor *x = where[j] < n_args ? args[where[j]] : g->caps[where[j] - n_args];
    d[where[j]] = res[j] ? res[j] : zeros_like(x, g->file, g->line);
    reached[where[j]] = res[j] != NULL;
    if (!d[where[j]]) rc = -1;
  }
  for (int j = 0; j < n_args; j++) args[j]->requires_grad = had[j];
  return rc;
}

/* ---- scan ---- */

/* The index that reverses dim 0 of x (T-1, ..., 0, i64), made from x's
 * own elements and shape so that a trace keeps it symbolic in T: no size
 * passes as a number (a number equal to two symbols, or below 2, would be
 * taken for a constant). Every flip of one backward uses it, so the reverse
 * scan's xs agree on dim 0 in the graph, not only in value. */
static kiln_tensor *rev_index(kiln_tensor *x, const char *file, int line) {
  kiln_tensor *one = kiln_scalar_at(KILN_F32, 1, file, line), *ones = NULL;
  bool empty = false;
  for (int d = 1; d < x->ndim; d++) empty |= x->shape[d] == 0;
  if (empty) {
    int64_t T = x->shape[0]; /* no element to take the shape from: the number, then */
    ones = kiln_expand_at(one, 1, &T, file, line);
  } else {
    kiln_tensor *v = x;
    for (int d = 1; d < x->ndim; d++) v = kiln_slice_at(v, d, 0, 1, 1, file, line);
    for (int d = x->ndim - 1; d >= 1; d--) v = kiln_squeeze_at(v, d, file, line);
    ones = kiln_where_at(kiln_eq_at(v, v, file, line), one, one, file, line); /* 1 whatever v holds, NaN too */
  }
  kiln_tensor *steps = kiln_cumsum_at(ones, 0, file, line);
  kiln_tensor *n = numel_scalar(x, (int[]){0}, 1, 0, KILN_F32, file, line);
  return kiln_cast_at(kiln_sub_at(n, steps, file, line), KILN_I64, file, line);
}

typedef struct rev_ctx {
  const cfg_grad *g;
  int n_dy, dy_of[64]; /* the ys whose cotangents the reverse scan steps over */
  int n_capg, capg[64];
  int n_flag, flag_of[64]; /* the captures' gradients (indices into capg) whose step may reach none: a bool
                              carry each, whether some step did (READ_NESTED) */
  bool x_need[64];
  int n_dx;
  /* whether some step's VJP reached each capture's gradient (capg) and each
   * xs' (a read through an argmax or a compare reaches none): one no step
   * reaches gets no gradient, as eagerly, not zeros; and each incoming
   * carry's: one no step reaches has a gradient only where no step ran */
  bool cap_hit[64], x_hit[64], carry_hit[64];
  /* which carries' cotangents may be non-zero at some step (the others are
   * passed as none, so that what only they depend on is not reached); and
   * those whose liveness varies from step to step, a bool carry each
   * (live'[k]: some live result of the step depends on carry k) */
  uint64_t live;
  int n_var, var_of[64];
  uint64_t var, always; /* the carries with a flag; the live ones at every step */
  const cfg_dep *y_dep; /* what the ys whose cotangent flowed depend on */
} rev_ctx;

/* The step's live' flags from its live ones (in rc->var_of's order): carry
 * k is live before the step where a y whose cotangent flowed, or a carry
 * live after it, depends on k. */
static int live_step(const rev_ctx *rc, kiln_tensor *const *live, kiln_tensor **out) {
  const cfg_grad *g = rc->g;
  for (int v = 0; v < rc->n_var; v++) {
    int k = rc->var_of[v];
    bool always = rc->y_dep->arg >> k & 1;
    kiln_tensor *any = NULL;
    for (int m = 0; m < g->n_carry && !always; m++) {
      if (!(g->dep[m].arg >> k & 1)) continue;
      if (rc->always >> m & 1) always = true;
      for (int u = 0; u < rc->n_var; u++) {
        if (rc->var_of[u] != m) continue;
        if (!any) {
          any = live[u];
          continue;
        }
        /* or; a failure is the call's error, never a false flag */
        if (!(any = kiln_where_at(any, any, live[u], g->file, g->line))) return -1;
      }
    }
    out[v] = always || !any ? kiln_scalar_at(KILN_BOOL, always, g->file, g->line) : any;
    if (!out[v]) return -1;
  }
  return 0;
}

/* The reverse scan's step: in = dcarry, dcaps, flags, live, carry_t, xs_t, dy_t, kept_t;
 * out = dcarry', dcaps', flags', live', dx_t (of the xs that need theirs). */
static int rev_step(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  rev_ctx *rc = ctx;
  const cfg_grad *g = rc->g;
  int nc = g->n_carry, nx = g->n_xs, n_args = nc + nx, nf = rc->n_flag, nv = rc->n_var;
  kiln_tensor *const *dcarry = in, *const *dcaps = in + nc, *const *flags = in + nc + rc->n_capg,
                     *const *live = flags + nf, *const *cx = live + nv;
  kiln_tensor *cot[128] = {0}, *d[192];
  bool need[128], reached[192] = {0};
  for (int k = 0; k < nc; k++) cot[k] = rc->live >> k & 1 ? dcarry[k] : NULL, need[k] = dtype_is_float(cx[k]->dtype);
  for (int j = 0; j < nx; j++) need[nc + j] = rc->x_need[j];
  for (int k = 0; k < rc->n_dy; k++) cot[nc + rc->dy_of[k]] = cx[n_args + k];
  if (vjp(g, 0, cx, g->n_kept ? cx + n_args + rc->n_dy : NULL, need, cot, d, reached)) return -1;
  for (int k = 0; k < nc; k++)
    if (!(out[k] = shaped_like(cx[k], d[k], g->file, g->line))) return -1;
  for (int c = 0; c < rc->n_capg; c++) rc->cap_hit[c] |= reached[n_args + rc->capg[c]];
  for (int j = 0; j < nx; j++) rc->x_hit[j] |= reached[nc + j];
  for (int k = 0; k < nc; k++) rc->carry_hit[k] |= reached[k];
  for (int c = 0; c < rc->n_capg; c++)
    if (!(out[nc + c] = kiln_add_at(dcaps[c], d[n_args + rc->capg[c]], g->file, g->line))) return -1;
  for (int f = 0; f < nf; f++) {
    int i = n_args + rc->capg[rc->flag_of[f]];
    kiln_tensor *now = exists_flag(d[i], reached[i], g->file, g->line);
    if (!(out[nc + rc->n_capg + f] = kiln_where_at(flags[f], flags[f], now, g->file, g->line))) return -1; /* or */
  }
  if (live_step(rc, live, out + nc + rc->n_capg + nf)) return -1;
  for (int j = 0, m = 0; j < nx; j++)
    if (rc->x_need[j]) out[nc + rc->n_capg + nf + nv + m++] = d[nc + j];
  return 0;
}

/* Which carries' cotangents are live at each step, from the results the
 * loss reaches (gout). Counting steps from the last, the live set at step
 * 0 is the carries whose gout flowed (L0); at step i + 1, those a y whose
 * cotangent flowed or a carry live at step i depends on: S(i+1) = f(S(i)).
 * Every step is the same body, so the union of them all is a fixpoint
 * within n_carry + 1 rounds of U = L0 | f(U) (rc->live), and the sequence
 * itself repeats: a carry whose liveness for i >= 1 does not change is
 * decided here; the others are carried as flags (rc->var_of). A capture's
 * and an xs' first step (cap_first, x_first: -1 none) says from which T on
 * eagerly a gradient reaches them. */
typedef struct live_plan {
  uint64_t l0, all1; /* live at step 0; live at every step i >= 1 */
  int cap_first[64], x_first[64];
} live_plan;

static cfg_dep live_reach(const cfg_grad *g, const cfg_dep *y_dep, uint64_t s) {
  cfg_dep r = *y_dep;
  for (int k = 0; k < g->n_carry; k++)
    if (s >> k & 1) r = dep_or(r, g->dep[k]);
  return r;
}

static void plan_live(const cfg_grad *g, kiln_tensor *const *gout, rev_ctx *rc, cfg_dep *y_dep, live_plan *pl) {
  enum { MAX_SEQ = 256 };
  int nc = g->n_carry, n = 0, back = -1;
  uint64_t cmask = nc >= 64 ? ~(uint64_t)0 : ((uint64_t)1 << nc) - 1, seq[MAX_SEQ], l0 = 0;
  *y_dep = (cfg_dep){0, 0};
  for (int k = 0; k < nc; k++) l0 |= (uint64_t)(gout[k] != NULL) << k;
  for (int k = nc; k < g->n_res; k++)
    if (gout[k]) *y_dep = dep_or(*y_dep, g->dep[k]);
  rc->y_dep = y_dep;
  uint64_t u = l0;
  for (int i = 0; i <= nc; i++) u = l0 | (live_reach(g, y_dep, u).arg & cmask);
  rc->live = u;
  for (int i = 0; i < 64; i++) pl->cap_first[i] = pl->x_first[i] = -1;
  for (seq[n++] = l0; n < MAX_SEQ && back < 0; n++) {
    cfg_dep r = live_reach(g, y_dep, seq[n - 1]);
    for (int c = 0; c < g->n_caps; c++)
      if (pl->cap_first[c] < 0 && r.cap >> c & 1) pl->cap_first[c] = n - 1;
    for (int j = 0; j < g->n_xs; j++)
      if (pl->x_first[j] < 0 && r.arg >> (nc + j) & 1) pl->x_first[j] = n - 1;
    seq[n] = r.arg & cmask;
    for (int j = 0; j < n && back < 0; j++)
      if (seq[j] == seq[n]) back = j;
  }
  n--; /* seq[0..n) distinct; step n is step back again */
  uint64_t all1 = ~(uint64_t)0, none1 = ~(uint64_t)0;
  for (int i = 1; back >= 0 && i <= n; i++) {
    uint64_t s = i < n ? seq[i] : seq[back];
    all1 &= s, none1 &= ~s;
  }
  if (back < 0) all1 = 0, none1 = 0; /* no repeat found: every carry gets a flag */
  pl->l0 = l0, pl->all1 = all1 & cmask;
  rc->always = l0 & all1;
  rc->var = 0;
  if (u & ~(all1 | none1)) rc->var = u & ~rc->always;
  rc->n_var = 0;
  for (int k = 0; k < nc; k++)
    if (rc->var >> k & 1) rc->var_of[rc->n_var++] = k;
  if (nc + rc->n_capg + rc->n_flag + rc->n_var > 64) rc->n_var = 0, rc->var = 0; /* kiln_scan's list: no flags */
}

/* g exists only where m (a 0-d bool) holds, and where it existed before (a
 * mark of its own), as GRAD_IF_TRUE. -1: out of memory. */
static int mark_and(kiln_tensor *gr, kiln_tensor *m, const char *file, int line) {
  if (gr->grad_if && (gr->grad_if_kind & GRAD_IF_TRUE)) {
    kiln_tensor *was = ag_grad_if_bool(gr, file, line);
    m = kiln_where_at(was, m, kiln_scalar_at(KILN_BOOL, 0, file, line), file, line);
  }
  if (!m) return -1;
  ag_set_grad_if(gr, m, GRAD_IF_TRUE);
  return 0;
}

static int scan_backward(void *data, kiln_tensor *const *gout, kiln_tensor **gin, const char *file, int line) {
  (void)file, (void)line;
  const cfg_grad *g = data;
  int nc = g->n_carry, nx = g->n_xs, ny = g->n_res - nc;
  rev_ctx rc = {.g = g};
  live_plan pl;
  cfg_dep y_dep;
  kiln_tensor *init[128], *xs[192], *cout[128], *dx[64];
  for (int k = 0; k < nc; k++)
    if (!(init[k] = shaped_like(g->in[k], gout[k], g->file, g->line))) return -1; /* typed as the carry the step gives */
  for (int c = 0; c < g->n_caps; c++)
    if (g->caps[c]->requires_grad && dtype_is_float(g->caps[c]->dtype)) {
      if (cap_read(&g->prog, &g->prog.top[0], c) != READ_OWN) rc.flag_of[rc.n_flag++] = rc.n_capg;
      rc.capg[rc.n_capg] = c;
      if (!(init[nc + rc.n_capg++] = zeros_like(g->caps[c], g->file, g->line))) return -1;
    }
  for (int f = 0; f < rc.n_flag; f++) /* no step has reached it yet */
    if (!(init[nc + rc.n_capg + f] = kiln_scalar_at(KILN_BOOL, 0, g->file, g->line))) return -1;
  plan_live(g, gout, &rc, &y_dep, &pl);
  kiln_tensor **live = init + nc + rc.n_capg + rc.n_flag; /* live after the last step: those whose gout flowed */
  for (int v = 0; v < rc.n_var; v++)
    if (!(live[v] = kiln_scalar_at(KILN_BOOL, (double)(pl.l0 >> rc.var_of[v] & 1), g->file, g->line))) return -1;
  int n_xs = 0, n_carry = nc + rc.n_capg + rc.n_flag + rc.n_var;
  kiln_tensor *rev = rev_index(g->in[nc], g->file, g->line);
  if (!rev) return -1;
#define FLIP(x) kiln_index_select_at((x), 0, rev, g->file, g->line)
  for (int k = 0; k < nc; k++)
    if (!(xs[n_xs++] = FLIP(g->saved[k]))) return -1;
  for (int j = 0; j < nx; j++) {
    if (!(xs[n_xs++] = FLIP(g->in[nc + j]))) return -1;
    rc.x_need[j] = g->in[nc + j]->requires_grad && dtype_is_float(g->in[nc + j]->dtype);
    rc.n_dx += rc.x_need[j];
  }
  for (int k = 0; k < ny; k++)
    if (gout[nc + k]) {
      rc.dy_of[rc.n_dy++] = k;
      if (!(xs[n_xs++] = FLIP(gout[nc + k]))) return -1;
    }
  for (int j = 0; j < g->n_kept; j++)
    if (!(xs[n_xs++] = FLIP(g->saved[nc + j]))) return -1;
  if (kiln_scan_at(rev_step, &rc, n_carry, init, n_xs, xs, cout, rc.n_dx, dx, g->file, g->line)) return -1;
  kiln_tensor *T = numel_scalar(g->in[nc], (int[]){0}, 1, 0, KILN_I64, g->file, g->line);
  if (!T) return -1;
#define T_CMP(fn, n) fn(T, kiln_scalar_at(KILN_I64, (n), g->file, g->line), g->file, g->line)
  for (int k = 0; k < nc; k++) gin[k] = cout[k];
  /* an init's gradient exists where eagerly the loss reaches it: where the
   * carry is live before the first step (after the last, where T == 0). An
   * init no step's VJP reached (read through an argmax, say) gets one only
   * from a scan of no step, where the last carry is init; one live at every
   * step i >= 1, where T != 0 (and where T == 0, if its gout flowed); the
   * others where their flag says */
  for (int k = 0; k < nc; k++) {
    if (!dtype_is_float(g->in[k]->dtype)) continue;
    kiln_tensor *m = NULL;
    if (!rc.carry_hit[k]) {
      if (!gout[k]) {
        gin[k] = NULL;
        continue;
      }
      m = T_CMP(kiln_eq_at, 0);
    } else if (pl.all1 >> k & 1) {
      if (pl.l0 >> k & 1) continue;
      m = T_CMP(kiln_ne_at, 0);
    } else if (rc.var >> k & 1) {
      for (int v = 0; v < rc.n_var; v++)
        if (rc.var_of[v] == k) m = cout[nc + rc.n_capg + rc.n_flag + v];
    } else {
      continue; /* no flag to carry it (kiln_scan's list is full): as if live */
    }
    if (!m) return -1;
    ag_set_grad_if(gin[k], m, GRAD_IF_TRUE);
  }
  for (int j = 0, m = 0; j < nx; j++) {
    if (!rc.x_need[j]) continue;
    kiln_tensor *dxj = dx[m++];
    if (rc.x_hit[j] && !(gin[nc + j] = FLIP(dxj))) return -1;
  }
#undef FLIP
  for (int c = 0; c < rc.n_capg; c++)
    if (rc.cap_hit[c]) gin[g->n_in + rc.capg[c]] = cout[nc + c];
  /* the captures' and xs' gradients exist only where a step ran: eagerly a
   * scan over no step reaches neither, and kiln_grad stays NULL (grad_if);
   * one a step reaches only through a nested construct, where some step did */
  for (int i = nc; i < g->n_in + g->n_caps; i++)
    if (gin[i] && !gin[i]->grad_if) ag_set_grad_if(gin[i], g->in[nc], GRAD_IF_DIM);
  for (int f = 0; f < rc.n_flag; f++)
    if (rc.cap_hit[rc.flag_of[f]])
      ag_set_grad_if(gin[g->n_in + rc.capg[rc.flag_of[f]]], cout[nc + rc.n_capg + f], GRAD_IF_TRUE);
  /* one that only a carry dead at the last steps reaches: where T > its first step */
  for (int i = nc; i < g->n_in + g->n_caps; i++) {
    int first = i < g->n_in ? pl.x_first[i - nc] : pl.cap_first[i - g->n_in];
    if (gin[i] && first > 0 && mark_and(gin[i], T_CMP(kiln_gt_at, first), g->file, g->line)) return -1;
  }
#undef T_CMP
  return 0;
}

/* ---- cond ---- */

typedef struct cond_ctx {
  const cfg_grad *g;
  bool has[64];        /* the results whose cotangent flowed (the others are not passed) */
  int n_flag, flag_of[64]; /* the captures whose gradient's existence is a result too */
  bool ran[2];             /* the branches whose VJP ran (both under a recording, one eagerly) */
  bool reached[2][192];    /* whether it reached each operand, then each capture */
} cond_ctx;

/* A branch's VJP: in = operands, the cotangents that flowed; out = the
 * operands' gradients (zeros for those that need none), the captures',
 * then for each flag_of capture whether its gradient exists. */
static int cond_branch_vjp(cond_ctx *cc, int region, kiln_tensor *const *in, kiln_tensor **out) {
  const cfg_grad *g = cc->g;
  int n_ops = g->n_in - 1;
  kiln_tensor *d[192], *cot[128];
  bool need[128] = {0}, reached[192] = {0};
  for (int j = 0; j < n_ops; j++) need[j] = dtype_is_float(in[j]->dtype);
  for (int k = 0, m = n_ops; k < g->n_res; k++) cot[k] = cc->has[k] ? in[m++] : NULL;
  if (vjp(g, region, in, NULL, need, cot, d, reached)) return -1;
  cc->ran[region] = true;
  memcpy(cc->reached[region], reached, sizeof(bool) * (size_t)(n_ops + g->n_caps));
  int m = 0;
  for (int j = 0; j < n_ops; j++)
    if (!(out[m++] = shaped_like(in[j], d[j], g->file, g->line))) return -1;
  for (int c = 0; c < g->n_caps; c++)
    if (g->caps[c]->requires_grad && dtype_is_float(g->caps[c]->dtype) &&
        !(out[m++] = shaped_like(g->caps[c], d[n_ops + c], g->file, g->line)))
      return -1;
  for (int f = 0; f < cc->n_flag; f++) {
    int c = cc->flag_of[f];
    if (!(out[m++] = exists_flag(d[n_ops + c], reached[n_ops + c], g->file, g->line))) return -1;
  }
  return 0;
}
static int then_vjp(void *ctx, kiln_tensor *const *in, kiln_tensor **out) { return cond_branch_vjp(ctx, 0, in, out); }
static int else_vjp(void *ctx, kiln_tensor *const *in, kiln_tensor **out) { return cond_branch_vjp(ctx, 1, in, out); }

/* The gradient *gr of the cond's input i (an operand, then the captures)
 * where the branch that ran reaches it: under a recording both branches
 * ran, so reached by the then branch alone, where pred holds; by the else
 * branch alone, where it does not (*not_pred, made once); by both, always;
 * by neither, never: *gr NULL (reached only through a result the loss never
 * reads, say). Eagerly one ran: its answer is the one. 0 or -1. */
static int reach_mark(const cond_ctx *cc, int i, kiln_tensor *pred, kiln_tensor **not_pred, kiln_tensor **gr) {
  const cfg_grad *g = cc->g;
  bool both = cc->ran[0] && cc->ran[1];
  bool r0 = cc->ran[0] && cc->reached[0][i], r1 = cc->ran[1] && cc->reached[1][i];
  if ((r0 && r1) || (!both && (r0 || r1))) return 0;
  if (!r0 && !r1) {
    *gr = NULL;
    return 0;
  }
  if (!r0 && !*not_pred) {
    kiln_tensor *f0 = kiln_scalar_at(KILN_BOOL, 0, g->file, g->line), *t1 = kiln_scalar_at(KILN_BOOL, 1, g->file, g->line);
    if (!(*not_pred = kiln_where_at(pred, f0, t1, g->file, g->line))) return -1;
  }
  ag_set_grad_if(*gr, r0 ? pred : *not_pred, GRAD_IF_TRUE);
  return 0;
}

static int cond_backward(void *data, kiln_tensor *const *gout, kiln_tensor **gin, const char *file, int line) {
  (void)file, (void)line;
  const cfg_grad *g = data;
  int n_ops = g->n_in - 1, n = 0, n_out = 0;
  kiln_tensor *in[128], *out[128];
  cond_ctx cc = {.g = g};
  for (int j = 0; j < n_ops; j++) in[n++] = g->in[1 + j];
  for (int k = 0; k < g->n_res; k++)
    if ((cc.has[k] = gout[k] != NULL)) in[n++] = gout[k];
  n_out = n_ops;
  /* A capture read inside a construct nested in a branch: whether its
   * gradient exists is an extra result of the cond (the branch's own
   * knowledge: the nested construct's condition) */
  for (int c = 0; c < g->n_caps; c++) {
    if (!g->caps[c]->requires_grad || !dtype_is_float(g->caps[c]->dtype)) continue;
    n_out++;
    if (cap_read(&g->prog, &g->prog.top[0], c) == READ_NESTED || cap_read(&g->prog, &g->prog.top[1], c) == READ_NESTED)
      cc.flag_of[cc.n_flag++] = c;
  }
  kiln_tensor *pred = g->in[0];
  if (kiln_cond_at(pred, then_vjp, else_vjp, &cc, n, in, n_out + cc.n_flag, out, g->file, g->line)) return -1;
  /* An operand's and a capture's gradient exists where the branch that ran
   * reaches it (eagerly the other never ran); a capture read inside a
   * construct nested in a branch, where its flag says */
  kiln_tensor *not_pred = NULL;
  for (int j = 0; j < n_ops; j++) {
    gin[1 + j] = out[j];
    if (dtype_is_float(g->in[1 + j]->dtype) && reach_mark(&cc, j, pred, &not_pred, &gin[1 + j])) return -1;
  }
  for (int c = 0, m = n_ops, f = 0; c < g->n_caps; c++) {
    if (!g->caps[c]->requires_grad || !dtype_is_float(g->caps[c]->dtype)) continue;
    gin[g->n_in + c] = out[m++];
    if (f < cc.n_flag && cc.flag_of[f] == c)
      ag_set_grad_if(gin[g->n_in + c], out[n_out + f++], GRAD_IF_TRUE);
    else if (reach_mark(&cc, n_ops + c, pred, &not_pred, &gin[g->n_in + c]))
      return -1;
  }
  return 0;
}

/* ---- the node ---- */

static void cfg_free(void *data) {
  cfg_grad *g = data;
  if (!g) return;
  for (int i = 0; i < g->n_in; i++) kiln_release(g->in[i]);
  for (int c = 0; c < g->n_caps; c++) kiln_release(g->caps[c]);
  for (int k = 0; g->saved && k < g->n_carry + g->n_kept; k++) kiln_release(g->saved[k]);
  alloc_free(g->in);
  alloc_free(g->caps);
  alloc_free(g->saved);
  prog_free(&g->prog);
  alloc_free(g);
}

static const ag_multi_ops scan_ops = {scan_backward, cfg_free};
static const ag_multi_ops cond_ops = {cond_backward, cfg_free};

cfg_grad *cfg_new(recording *r, const cf_call *c, int first) {
  cfg_grad *g = alloc_calloc(1, sizeof *g);
  if (!g) return NULL;
  *g = (cfg_grad){.kind = c->kind, .n_carry = c->n_carry, .n_xs = c->n_xs, .n_res = c->n_results, .n_in = c->n_in,
                  .file = c->file, .line = c->line};
  g->in = alloc_calloc((size_t)c->n_in + 1, sizeof *g->in);
  if (!g->in) return cfg_free(g), NULL;
  for (int i = 0; i < c->n_in; i++) g->in[i] = kiln_retain(c->in[i]);
  if (prog_build(r, first, g, c->n_regions)) return cfg_free(g), NULL;
  /* the backward's construct must fit kiln_scan's and kiln_cond's lists (64 each); else step by step */
  int n_capg = 0, n_flag = 0; /* n_flag: the captures' gradients whose existence the backward carries or yields */
  for (int k = 0; k < g->n_caps; k++)
    if (g->caps[k]->requires_grad && dtype_is_float(g->caps[k]->dtype)) {
      n_capg++;
      n_flag += cap_read(&g->prog, &g->prog.top[0], k) != READ_OWN ||
                (g->kind == CF_COND && cap_read(&g->prog, &g->prog.top[1], k) != READ_OWN);
    }
  int n_rev_xs = 2 * g->n_carry + g->n_xs + (g->n_res - g->n_carry);
  /* scan_save: the matmuls of the body's own level (a nested construct's stay
   * recomputed: its replay runs a program of its own) */
  const cfg_region *top = &g->prog.top[0];
  for (int i = top->begin; g->kind == CF_SCAN && r->scan_save == KILN_SCAN_SAVE_DOTS && r->cf_depth == 0 && i < top->end; i++) {
    cfg_ins *in = &g->prog.ins[i];
    if (in->kind == EV_CF) {
      i = in->cf->next - 1;
      continue;
    }
    if (in->kind != EV_OP || in->op != OP_MATMUL || !dtype_is_float(r->val[in->vid].dtype)) continue;
    if (n_rev_xs + g->n_kept + 1 > 64 || g->n_carry + g->n_kept + 1 > 64) break; /* the rest recomputed */
    in->keep = g->n_kept;
    g->kept_ids[g->n_kept++] = in->vid;
  }
  bool fits = g->kind == CF_SCAN ? g->n_carry + n_capg + n_flag <= 64 && n_rev_xs + g->n_kept <= 64
                                 : g->n_in - 1 + g->n_res <= 64 && g->n_in - 1 + n_capg + n_flag <= 64;
  if (!fits || g->n_caps > 64) return cfg_free(g), NULL;
  if (g->kind == CF_SCAN && scan_deps(g, r)) return cfg_free(g), NULL;
  return g;
}

void cfg_discard(cfg_grad *g) { cfg_free(g); }

int cfg_kept(const cfg_grad *g, const int **ids) {
  *ids = g->kept_ids;
  return g->n_kept;
}

int cfg_attach(cfg_grad *g, kiln_tensor *const *results, kiln_tensor *const *saved) {
  const char *file = g->file;
  int line = g->line;
  g->saved = alloc_calloc((size_t)(g->n_carry + g->n_kept) + 1, sizeof *g->saved);
  kiln_tensor **in = alloc_malloc(sizeof *in * (size_t)(g->n_in + g->n_caps + 1));
  if (!g->saved || !in) {
    alloc_free(in);
    cfg_free(g);
    return err_set(file, line, "autograd", "out of memory"), -1;
  }
  /* scan: the stacked carries (never a result: that would keep its own node alive) */
  for (int k = 0; g->kind == CF_SCAN && k < g->n_carry + g->n_kept; k++) g->saved[k] = kiln_retain(saved[k]);
  memcpy(in, g->in, sizeof *in * (size_t)g->n_in);
  if (g->n_caps) memcpy(in + g->n_in, g->caps, sizeof *in * (size_t)g->n_caps);
  int rc = ag_record_multi(g->kind == CF_SCAN ? &scan_ops : &cond_ops, g, in, g->n_in + g->n_caps, results, g->n_res,
                           g->file, g->line);
  alloc_free(in);
  return rc;
}
