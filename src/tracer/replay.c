/* Replay: a call on the recording path that follows an earlier call's log
 * instead of recording anew.
 *
 * A call that recorded a log of ops, values over shapes (kiln_scalar),
 * counts of shapes (numel_scalar) and whole in-place writes alone (no C
 * data, draws, data reads, breaks, constructs or writes into views), and
 * ran one segment of a cached variant that sets params' .grads only
 * unconditionally, leaves a script beside that variant: its events, the
 * meta tensors it made, and which of its numbers the variant passes at run
 * time. Ops may give autograd history, and a backward runs over the
 * script's tensors as its ops are checked; the history goes at the call's
 * end, and a .grad the backward left set to a tensor of the script's is
 * the one the variant sets. A later call whose inputs have the same dtypes and shapes runs the
 * body with the replay hooks: each op is checked against the script's next
 * event (the op, the very tensors it takes, its line, its attributes, each
 * number equal, or a factory's value the variant takes as an argument)
 * before its rules run, and gets the script's tensor for it, so no shape
 * rule runs, no tensor is made and nothing is logged. An op's result the call hands out (an output, a view
 * of an input) is made anew each call. When the body has done every event,
 * returned the script's outputs and kept none of the script's tensors, the
 * call runs the variant's segment with this call's inputs and numbers: the
 * log it would have recorded is the script's, which matched the variant.
 *
 * Anything else is a step the script does not have: the replay hands over
 * to the recording, which gets the hook calls the body made so far (the
 * events matched, the sizes read), with the same tensors, as if it had
 * recorded from the start, and the call goes on as a recorded one. */
#include <string.h>

#include "tracer/tracer.h"

typedef struct rp_event {
  rec_ekind kind;        /* EV_OP, EV_FULL (a factory's value over a shape), EV_NUMEL (a count of a shape) or
                            EV_INPLACE (a whole write: its value is the written tensor's, in[0]) */
  int op, n_in, in, out; /* in: its first input value in ids[]; out: its value */
  const op_attrs *a;     /* the script's copy, or rec_no_attrs */
  const char *file;
  int line;
  bool user;             /* its numbers came from user code */
  bool fresh;            /* its result is made anew each call */
  int src;               /* a shape given by an autograd formula: the value it is of (the recording's e->src), or -1 */
  int slot_at, n_slots;  /* its numbers in slot[] */
} rp_event;

/* A number of an event: the script's, which the call must pass again, or
 * (arg >= 0) a float the variant takes at run time as argument arg. */
typedef struct rp_slot {
  rec_slot v;
  int arg;
} rp_slot;

typedef struct rp_val {
  kiln_tensor *t;        /* a made value's tensor (retained), NULL when fresh */
  uint64_t serial;       /* a param's serial: its pointer is checked with it, not held */
  kiln_dtype dt;
  int ndim;
  int64_t shape[MAXD];
} rp_val;

struct rp_script {
  int n_in, n_ev, n_val, n_params, n_out, n_slot;
  rp_event *ev;
  int *ids;
  op_attrs *attrs;
  rp_slot *slot;
  rp_val *val;
  int *kind, *index;     /* per value: its rec_vkind and index (input i, param i, or its event) */
  kiln_tensor **params;  /* not retained: checked by pointer and serial when an op takes one */
  bool *param_held;      /* in a call: an op took it, and the replay holds a reference, as a
                            recording does (the body may let go of it before the call ends) */
  uint64_t origin;       /* the recording that made the script's tensors (their rec_call) */
  int *out;              /* the body's outputs' values */
  int *in_first;         /* the first input that is the same tensor as input i */
  int *in_st;            /* the first input that shares input i's storage */
  int *param_st;         /* the first input that shares param i's storage, or -1 */
  kiln_dtype *in_dt;
  int *in_ndim;
  int64_t (*in_shape)[MAXD];
  int64_t argi[IR_MAX_SYMS];
  double argf[IR_MAX_SYMS];
  int n_args;
  bool broken;           /* a replay handed over: the recording holds its tensors now */
  /* a replay's scratch, kept between calls */
  kiln_tensor **cur;     /* per value: the tensor that is it in the call */
  kiln_tensor **fresh;   /* made in the call, a reference each of ours */
  int n_fresh;
  /* the hook calls that are no events, in order, for a hand-over: size
   * reads, shape sources (an autograd formula's input) and .grad
   * registrations (kiln_zero_grad, kiln_grad) before event `at` */
  struct rp_note {
    enum { NOTE_SIZE, NOTE_SHAPE_SRC, NOTE_GRAD } kind;
    int at;
    const kiln_tensor *t;
    int dim;
    uint64_t serial, call; /* NOTE_SHAPE_SRC as the formula gave it (dim: its id) */
  } *notes;
  int n_notes, cap_notes;
  int *leafish;          /* the values that are inputs, params or writes, where a shape source's serial is looked up */
  int n_leafish;
  uint64_t *param_serial;/* per param: its serial in the script's call */
  int *grad_end;         /* per param: the value its .grad is at the end (the variant sets it: a
                            tensor of the script's, or -1 NULL), or -2 (the variant leaves it) */
  int *grad_refs;        /* per value: how many of those .grads are it (such a value is made anew each call) */
  kiln_tensor **grad0;   /* per param taken: its .grad then (retained), which a hand-over shows the recording */
  uint32_t *grad0_refs;  /* and that .grad's references then, with the one a recording would take */
  kiln_tensor **stash;   /* a hand-over's scratch: the .grads meanwhile; for rp_grad_seen, the .grads the body left */
};

void rp_free(rp_script *s) {
  if (!s) return;
  for (int i = 0; s->val && i < s->n_val; i++) kiln_release(s->val[i].t);
  alloc_free(s->ev);
  alloc_free(s->ids);
  alloc_free(s->attrs);
  alloc_free(s->slot);
  alloc_free(s->val);
  alloc_free(s->kind);
  alloc_free(s->index);
  alloc_free(s->params);
  alloc_free(s->param_serial);
  alloc_free(s->grad_end);
  alloc_free(s->grad_refs);
  alloc_free(s->param_held);
  alloc_free(s->out);
  alloc_free(s->in_first);
  alloc_free(s->in_st);
  alloc_free(s->param_st);
  alloc_free(s->in_dt);
  alloc_free(s->in_ndim);
  alloc_free(s->in_shape);
  alloc_free(s->cur);
  alloc_free(s->fresh);
  alloc_free(s->notes);
  alloc_free(s->leafish);
  alloc_free(s->grad0);
  alloc_free(s->grad0_refs);
  alloc_free(s->stash);
  alloc_free(s);
}

bool rp_broken(const rp_script *s) { return s->broken; }

/* Whether the call's log is one a replay can check: ops, values over
 * shapes (kiln_scalar, kiln_zeros) and counts of shapes (a variance's
 * divisor) alone, over the call's inputs, params
 * and values of its own, none with autograd history, in one segment,
 * outputs made by ops that are not views (an output is made anew each
 * call: a view would have to be one of another output's). */
static bool replayable(const recording *r, kiln_tensor *const *made, kiln_tensor *const *out, int n_out) {
  if (r->escaped || r->seg || r->n_breaks || r->failed || r->n_in > 64) return false;
  for (int i = 0; i < r->n_ev; i++) {
    const rec_event *e = &r->ev[i];
    if ((e->kind != EV_OP && e->kind != EV_FULL && e->kind != EV_NUMEL && e->kind != EV_INPLACE) || e->out < 0)
      return false;
    if (e->kind == EV_OP && (op_table[e->op].attrs & AF_RNG)) return false;
    /* a write into a view is a write of its base, found by a search the replay does not make */
    if (e->kind == EV_INPLACE && (e->a->flag || e->n_in != (e->op == OP_COUNT ? 1 : 2))) return false;
  }
  for (int v = 0; v < r->n_val; v++) {
    const rec_value *rv = &r->val[v];
    if (rv->kind != RV_INPUT && rv->kind != RV_PARAM && rv->kind != RV_MADE) return false;
    if (rv->kind == RV_MADE && r->ev[rv->event].kind == EV_INPLACE) continue; /* the written tensor's */
    if (rv->kind == RV_MADE && (!made[v] || made[v]->requires_grad || made[v]->grad_fn)) return false;
  }
  for (int k = 0; k < n_out; k++) {
    if (!out[k] || out[k]->rec_call != r->id) return false;
    int v = out[k]->rec_id;
    if (v < 0 || v >= r->n_val || r->val[v].kind != RV_MADE || made[v] != out[k]) return false;
    const rec_event *e = &r->ev[r->val[v].event];
    if ((e->kind == EV_OP && op_table[e->op].kind == KIND_VIEW) || e->kind == EV_INPLACE) return false;
    for (int j = 0; j < k; j++)
      if (out[j] == out[k]) return false;
  }
  return true;
}

/* The first of in[0..n) that shares t's storage, or -1. A recording reads a
 * tensor sharing storage with one written before as an escape: inputs and
 * params share as the script's call's did, or the replay hands over before
 * any event touches them. */
static int first_sharing(kiln_tensor *const *in, int n, const kiln_tensor *t) {
  for (int i = 0; i < n; i++)
    if (in[i]->st == t->st) return i;
  return -1;
}

rp_script *rp_make(const recording *r, kiln_tensor *const *out, int n_out, const slot_rule *rules, const int *rule_at,
                   const int64_t *argi, const double *argf, int n_args, const build_write *writes, int n_writes) {
  if (r->n_ev == 0 || n_args > IR_MAX_SYMS) return NULL;
  /* the .grads the variant sets: a param's, whatever the call (one that
   * hangs on a construct's path, or an input's, is not replayed), to a
   * tensor an op or a factory made (its own: made anew each call, below) */
  for (int i = 0; i < n_writes; i++) {
    const build_write *w = &writes[i];
    if (!w->grad_set) continue;
    if (w->when >= 0 || r->val[w->base].kind != RV_PARAM) return NULL;
    const rec_value *gv = w->grad >= 0 ? &r->val[w->grad] : NULL;
    const rec_event *ge = gv && gv->kind == RV_MADE ? &r->ev[gv->event] : NULL;
    if (gv && (!ge || !(ge->kind == EV_FULL || (ge->kind == EV_OP && op_table[ge->op].kind != KIND_VIEW)))) return NULL;
  }
  kiln_tensor **made = alloc_malloc(sizeof *made * (size_t)(r->n_val + 1));
  bool *used = alloc_calloc((size_t)r->n_params + 1, sizeof *used); /* param i is an op's input */
  rp_script *s = alloc_calloc(1, sizeof *s);
  if (!made || !used || !s || rec_made_tensors(r, made)) goto fail;
  /* a tensor written in place is known by its last value: it is its first value's, and
   * the values of writes have none of their own (the call's tensor is the written one) */
  for (int i = r->n_ev - 1; i >= 0; i--) {
    const rec_event *e = &r->ev[i];
    if (e->kind != EV_INPLACE || e->out < 0) continue;
    int dst = r->ids[e->in];
    if (r->val[dst].kind == RV_MADE && !made[dst]) made[dst] = made[e->out];
    made[e->out] = NULL;
  }
  if (!replayable(r, made, out, n_out)) goto fail;
  s->n_in = r->n_in, s->n_ev = r->n_ev, s->n_val = r->n_val, s->n_params = r->n_params, s->n_out = n_out;
  int n_attrs = 0;
  for (int i = 0; i < r->n_ev; i++) {
    const rec_event *e = &r->ev[i];
    n_attrs += e->a != &rec_no_attrs;
    if (rec_has_slots(e)) s->n_slot += rule_at[i + 1] - rule_at[i];
  }
  s->ev = alloc_malloc(sizeof *s->ev * (size_t)s->n_ev);
  s->ids = alloc_malloc(sizeof *s->ids * (size_t)(r->n_ids + 1));
  s->attrs = alloc_malloc(sizeof *s->attrs * (size_t)(n_attrs + 1));
  s->slot = alloc_malloc(sizeof *s->slot * (size_t)(s->n_slot + 1));
  s->val = alloc_calloc((size_t)s->n_val, sizeof *s->val);
  s->kind = alloc_malloc(sizeof *s->kind * (size_t)s->n_val);
  s->index = alloc_malloc(sizeof *s->index * (size_t)s->n_val);
  s->params = alloc_malloc(sizeof *s->params * (size_t)(s->n_params + 1));
  s->param_serial = alloc_malloc(sizeof *s->param_serial * (size_t)(s->n_params + 1));
  s->grad_end = alloc_malloc(sizeof *s->grad_end * (size_t)(s->n_params + 1));
  s->grad_refs = alloc_calloc((size_t)s->n_val + 1, sizeof *s->grad_refs);
  s->param_held = alloc_calloc((size_t)s->n_params + 1, sizeof *s->param_held);
  s->out = alloc_malloc(sizeof *s->out * (size_t)(n_out + 1));
  s->in_first = alloc_malloc(sizeof *s->in_first * (size_t)(s->n_in + 1));
  s->in_st = alloc_malloc(sizeof *s->in_st * (size_t)(s->n_in + 1));
  s->param_st = alloc_malloc(sizeof *s->param_st * (size_t)(s->n_params + 1));
  s->in_dt = alloc_malloc(sizeof *s->in_dt * (size_t)(s->n_in + 1));
  s->in_ndim = alloc_malloc(sizeof *s->in_ndim * (size_t)(s->n_in + 1));
  s->in_shape = alloc_malloc(sizeof *s->in_shape * (size_t)(s->n_in + 1));
  s->cur = alloc_malloc(sizeof *s->cur * (size_t)s->n_val);
  s->leafish = alloc_malloc(sizeof *s->leafish * (size_t)(s->n_val + 1));
  s->grad0 = alloc_calloc((size_t)s->n_params + 1, sizeof *s->grad0);
  s->grad0_refs = alloc_malloc(sizeof *s->grad0_refs * (size_t)(s->n_params + 1));
  s->stash = alloc_malloc(sizeof *s->stash * (size_t)(s->n_params + 1));
  s->fresh = alloc_malloc(sizeof *s->fresh * (size_t)s->n_val);
  if (!s->ev || !s->ids || !s->attrs || !s->slot || !s->val || !s->kind || !s->index || !s->params || !s->out ||
      !s->in_dt || !s->in_ndim || !s->in_shape || !s->cur || !s->fresh || !s->param_held || !s->in_first || !s->in_st ||
      !s->param_st || !s->leafish || !s->grad0 || !s->stash || !s->grad0_refs || !s->param_serial || !s->grad_end || !s->grad_refs)
    goto fail;
  s->origin = r->id;
  memcpy(s->ids, r->ids, sizeof *s->ids * (size_t)r->n_ids);
  for (int i = 0; i < s->n_params; i++) {
    s->params[i] = r->params[i], s->param_st[i] = first_sharing(r->in, s->n_in, r->params[i]);
    s->param_serial[i] = r->params[i]->serial, s->grad_end[i] = -2;
  }
  /* the .grads the variant sets (checked above). Their tensors are made
   * anew each call: the recording's became the .grads, with this call's
   * data (grads_keep_handles), which a later recording must not take for a
   * value it is to compute */
  for (int i = 0; i < n_writes; i++) {
    const build_write *w = &writes[i];
    if (!w->grad_set) continue;
    s->grad_end[r->val[w->base].index] = w->grad;
    if (w->grad >= 0) s->grad_refs[w->grad]++;
  }
  for (int i = 0; i < s->n_in; i++) {
    s->in_first[i] = i;
    s->in_st[i] = first_sharing(r->in, i + 1, r->in[i]);
    for (int j = 0; j < i && s->in_first[i] == i; j++)
      if (r->in[j] == r->in[i]) s->in_first[i] = j;
    s->in_dt[i] = r->in[i]->dtype;
    s->in_ndim[i] = r->in[i]->ndim;
    memcpy(s->in_shape[i], r->in[i]->shape, sizeof s->in_shape[i]);
  }
  for (int k = 0; k < n_out; k++) s->out[k] = out[k]->rec_id;
  for (int v = 0; v < s->n_val; v++) {
    const rec_value *rv = &r->val[v];
    s->kind[v] = rv->kind;
    s->index[v] = rv->kind == RV_MADE ? rv->event : rv->index;
    rp_val *pv = &s->val[v];
    if (rv->kind != RV_MADE || r->ev[rv->event].kind == EV_INPLACE) s->leafish[s->n_leafish++] = v;
    pv->dt = rv->dtype;
    pv->ndim = rv->ndim;
    memcpy(pv->shape, rv->shape, sizeof(int64_t) * (size_t)rv->ndim);
    if (rv->kind == RV_PARAM) pv->serial = r->params[rv->index]->serial;
  }
  for (int i = 0, at = 0, na = 0; i < s->n_ev; i++) {
    const rec_event *e = &r->ev[i];
    rp_event *pe = &s->ev[i];
    *pe = (rp_event){.kind = e->kind, .op = e->op, .n_in = e->n_in, .in = e->in, .out = e->out, .a = &rec_no_attrs, .file = e->file,
                     .line = e->line, .user = e->user, .slot_at = at, .src = e->src};
    if (e->a != &rec_no_attrs) {
      s->attrs[na] = *e->a;
      pe->a = &s->attrs[na++];
    }
    /* made anew: an output, or a view of a tensor of the call (an input, or one made anew) */
    bool out_of_call = false;
    for (int k = 0; k < n_out; k++) out_of_call |= s->out[k] == e->out;
    if (e->kind == EV_OP && op_table[e->op].kind == KIND_VIEW) {
      int x = r->ids[e->in];
      /* a written tensor is the one its first value is (an input written in place is the input) */
      while (s->kind[x] == RV_MADE && r->ev[s->index[x]].kind == EV_INPLACE) x = r->ids[r->ev[s->index[x]].in];
      out_of_call = s->kind[x] == RV_INPUT || (s->kind[x] == RV_MADE && s->ev[s->index[x]].fresh);
    }
    /* (numel_scalar makes its tensor each call) */
    pe->fresh = out_of_call || e->kind == EV_NUMEL || (e->kind != EV_INPLACE && s->grad_refs[e->out]);
    /* a write into a tensor made anew each call (an output): that tensor is made at its own event */
    if (e->kind == EV_INPLACE && s->kind[r->ids[e->in]] == RV_MADE && s->ev[s->index[r->ids[e->in]]].fresh) goto fail;
    for (int k = 0; k < e->n_in; k++)
      if (s->kind[r->ids[e->in + k]] == RV_PARAM) used[s->index[r->ids[e->in + k]]] = true;
    if (!pe->fresh && e->kind != EV_INPLACE) s->val[e->out].t = kiln_retain(made[e->out]);
    if (!rec_has_slots(e)) continue;
    rec_slot sl[2 * MAXD + 8];
    int n = rec_slots(e, sl, (int)(sizeof sl / sizeof sl[0]));
    if (n != rule_at[i + 1] - rule_at[i] || n > (int)(sizeof sl / sizeof sl[0])) goto fail;
    for (int k = 0; k < n; k++) {
      const slot_rule *rule = &rules[rule_at[i] + k];
      /* a factory's or a fill's value the variant takes as an argument may change;
       * every other number is the script's: a size the variant binds (the
       * same inputs' shapes give the same), or a number that decides a
       * shape the script's tensors have, or a constant of the variant */
      bool arg = (e->kind == EV_FULL || e->kind == EV_INPLACE) && rule->kind == SLOT_ARG && sl[k].is_float;
      s->slot[at + k] = (rp_slot){sl[k], arg ? rule->arg : -1};
    }
    pe->n_slots = n;
    at += n;
  }
  /* a param the body only read a size of is checked by no op */
  for (int i = 0; i < s->n_params; i++)
    if (!used[i]) goto fail;
  s->n_args = n_args;
  if (n_args) {
    memcpy(s->argi, argi, sizeof *argi * (size_t)n_args);
    memcpy(s->argf, argf, sizeof *argf * (size_t)n_args);
  }
  alloc_free(made);
  alloc_free(used);
  return s;
fail:
  alloc_free(made);
  alloc_free(used);
  rp_free(s);
  return NULL;
}

bool rp_fits(const rp_script *s, kiln_tensor *const *in, int n_in) {
  if (s->broken || n_in != s->n_in) return false;
  for (int i = 0; i < n_in; i++) {
    if (in[i]->dtype != s->in_dt[i] || in[i]->ndim != s->in_ndim[i] ||
        memcmp(in[i]->shape, s->in_shape[i], sizeof(int64_t) * (size_t)in[i]->ndim))
      return false;
    /* one tensor passed twice is one value of the log, two tensors two */
    int first = i;
    for (int j = 0; j < i && first == i; j++)
      if (in[j] == in[i]) first = j;
    if (first != s->in_first[i]) return false;
  }
  return true;
}

/* ---- a replayed call ---- */

static void let_go_of_params(rp_script *s) {
  for (int i = 0; i < s->n_params; i++) {
    if (s->param_held[i]) kiln_release(s->params[i]), s->param_held[i] = false;
    kiln_release(s->grad0[i]), s->grad0[i] = NULL;
  }
}

/* The tensor of value id in the script, when that is what a tag (call, id)
 * and serial name; else NULL. */
static kiln_tensor *tagged(const rp_script *s, uint64_t serial, uint64_t call, int id) {
  if (call != s->origin || id < 0 || id >= s->n_val || !s->cur[id] || s->cur[id]->serial != serial) return NULL;
  return s->cur[id];
}

/* The recording takes over: it gets the hook calls of the body so far, with
 * the tensors the body got, and the script lets go of them. */
static void hand_over(rp_call *p) {
  if (!p->on) return;
  p->on = false;
  rp_script *s = p->s;
  recording *r = p->r;
  dispatch_set_hooks(p->saved);
  /* the nodes autograd made in the replay name the script's tensors by its tags */
  r->alias_id = s->origin;
  /* the recording sees each write as it came, before its version bump: the
   * versions go back to the call's start and are bumped again write by write */
  for (int i = 0; i < p->at; i++)
    if (s->ev[i].kind == EV_INPLACE) atomic_fetch_sub(&s->cur[s->ids[s->ev[i].in]]->st->version, 1);
  /* and each param's .grad is the one it had when an event first took it
   * (a backward or a zero_grad since changed it), the leaf's .grad at the
   * call's start as the recording takes it; the .grads go back after */
  for (int j = 0; j < s->n_params; j++) {
    s->stash[j] = NULL;
    if (!s->param_held[j]) continue;
    if (s->params[j]->grad == s->grad0[j]) {
      /* unchanged: the param's own reference is the one the recording counts */
      kiln_release(s->grad0[j]), s->grad0[j] = NULL;
      continue;
    }
    s->stash[j] = s->params[j]->grad;
    s->params[j]->grad = s->grad0[j]; /* our reference, as the param's was */
    s->grad0[j] = NULL;
    if (!s->stash[j]) s->stash[j] = s->params[j]; /* (a dropped .grad: marked by the param itself) */
  }
  kiln_tensor *small[16];
  for (int i = 0, k = 0; i <= p->at; i++) {
    if (r->escaped) {
      /* never expected (the checks above hand over before a step a recording
       * would escape at), but the steps after it would be logged, not done */
      r->failed = true;
      snprintf(r->why, sizeof r->why, "a replayed call escaped while it handed over to the recording");
      break;
    }
    for (; k < s->n_notes && s->notes[k].at == i; k++) {
      const struct rp_note *nt = &s->notes[k];
      if (nt->kind == NOTE_SIZE) {
        rec_size_read(r, nt->t, nt->dim);
      } else if (nt->kind == NOTE_GRAD) {
        p->saved->zero_grad(p->saved->ctx, (kiln_tensor *)nt->t);
      } else {
        p->saved->shape_src(p->saved->ctx, nt->serial, nt->call, nt->dim); /* the script's tags are the recording's (alias_id) */
      }
    }
    if (i == p->at) break;
    const rp_event *e = &s->ev[i];
    if (e->kind == EV_NUMEL) {
      rec_numel(r, s->cur[e->out], s->cur[s->ids[e->in]], e->a->axes, e->a->naxes, e->a->start.c, e->file, e->line, e->user);
      continue;
    }
    if (e->kind == EV_INPLACE) {
      kiln_tensor *dst = s->cur[s->ids[e->in]], *src = e->n_in > 1 ? s->cur[s->ids[e->in + 1]] : NULL;
      const rp_slot *vs = &s->slot[e->slot_at];
      rec_inplace(r, (op_id)e->op, dst, src, e->n_slots ? (vs->arg >= 0 ? p->argf[vs->arg] : vs->v.f) : 0, e->file, e->line,
                  e->user);
      atomic_fetch_add(&dst->st->version, 1);
      continue;
    }
    if (e->kind == EV_FULL) {
      /* with this call's value */
      const rp_slot *vs = &s->slot[e->slot_at + e->a->ndim];
      rec_factory(r, s->cur[e->out], FAC_FULL, vs->arg >= 0 ? p->argf[vs->arg] : vs->v.f, 0, false, NULL, e->file, e->line,
                  e->user);
      continue;
    }
    kiln_tensor **in = e->n_in <= 16 ? small : alloc_malloc(sizeof *in * (size_t)e->n_in);
    if (!in) {
      r->failed = true;
      snprintf(r->why, sizeof r->why, "out of memory while recording");
      break;
    }
    for (int j = 0; j < e->n_in; j++) in[j] = s->cur[s->ids[e->in + j]];
    rec_op(r, (op_id)e->op, in, e->n_in, e->a, s->cur[e->out], e->file, e->line, e->user);
    if (in != small) alloc_free(in);
  }
  for (int j = 0; j < s->n_params; j++)
    if (s->param_held[j]) rec_set_grad0_refs(r, s->params[j], s->grad0_refs[j]);
  for (int j = 0; j < s->n_params; j++) {
    if (!s->stash[j]) continue;
    kiln_release(s->params[j]->grad);
    s->params[j]->grad = s->stash[j] == s->params[j] ? NULL : s->stash[j];
  }
  /* what the body holds and the recording adopted stays; the rest goes */
  for (int v = 0; v < s->n_val; v++) kiln_release(s->val[v].t), s->val[v].t = NULL;
  for (int i = 0; i < s->n_fresh; i++) kiln_release(s->fresh[i]);
  s->n_fresh = 0;
  let_go_of_params(s);
  s->broken = true;
}

/* The same line of the user's code: a hand-over logs the script's, which
 * the dumps and errors name (two branches may do the same op). */
static bool same_site(const rp_event *e, const char *file, int line) {
  if (!file) file = "";
  return e->line == line && (e->file == file || !strcmp(e->file, file));
}

static bool same_number(const rec_slot *a, const rec_slot *b) {
  return a->is_float == b->is_float && (a->is_float ? !memcmp(&a->f, &b->f, sizeof a->f) : a->i == b->i);
}

/* The tensor event e gives: the script's, or one made anew (made: its dtype and shape). */
static kiln_tensor *result(rp_call *p, const rp_event *e, kiln_tensor *made) {
  rp_script *s = p->s;
  if (!e->fresh) return kiln_retain(s->cur[e->out]);
  if (!made) return NULL;
  made->rec_call = s->origin;
  made->rec_id = e->out;
  s->cur[e->out] = made;
  s->fresh[s->n_fresh++] = kiln_retain(made);
  return made;
}

/* Whether event e took the very tensors in[0..n) at this line, or (alias)
 * a tensor autograd made of one to save it: a tensor of its own over the
 * same storage and layout, made in this call, which the recording finds
 * by its layout. (A result may get autograd history: the dispatcher
 * records it on the script's tensor, and the call drops it at its end,
 * rp_nothing_kept.) */
static bool took_same(const rp_call *p, const rp_event *e, kiln_tensor *const *in, int n, const char *file, int line,
                      bool alias) {
  const rp_script *s = p->s;
  if (e->n_in != n || !same_site(e, file, line)) return false;
  for (int k = 0; k < n; k++) {
    int w = s->ids[e->in + k];
    const kiln_tensor *c = s->cur[w];
    if (in[k] == c) {
      if (s->val[w].serial && in[k]->serial != s->val[w].serial) return false;
      continue;
    }
    /* (a param an event took is alive to look at; one none took yet may be gone) */
    bool alive = c && (s->kind[w] != RV_PARAM || s->param_held[s->index[w]]);
    /* (autograd's aliases carry no tag; a view an event made here carries the script's) */
    if (!alias || !alive || in[k]->serial < p->serial0 || in[k]->rec_call == s->origin || !tensor_same_view(in[k], c))
      return false;
  }
  return true;
}

/* Param j, tensor t, is held for the call from here, as a recording holds
 * it, with its .grad now; false when it shares storage with the inputs
 * unlike in the script's call (held, it is alive to look at). */
static bool take_param(rp_call *p, int j, kiln_tensor *t) {
  rp_script *s = p->s;
  s->param_held[j] = true, kiln_retain(t);
  s->grad0_refs[j] = t->grad ? tensor_refs(t->grad) + 1 : 0;
  s->grad0[j] = kiln_retain(t->grad);
  return first_sharing(p->in, s->n_in, t) == s->param_st[j];
}

/* The params event e took (checked by took_same) are held for the call. */
static bool take_params(rp_call *p, const rp_event *e, kiln_tensor *const *in, int n) {
  rp_script *s = p->s;
  for (int k = 0; k < n; k++) {
    int w = s->ids[e->in + k];
    if (s->val[w].serial && !s->param_held[s->index[w]] && !take_param(p, s->index[w], in[k])) return false;
  }
  return true;
}

static kiln_tensor *rp_op(void *ctx, op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file,
                          int line) {
  rp_call *p = ctx;
  rp_script *s = p->s;
  if (p->at == s->n_ev) goto part;
  const rp_event *e = &s->ev[p->at];
  if (e->kind != EV_OP || e->op != (int)op || !took_same(p, e, in, n, file, line, true)) goto part;
  /* a shape an autograd formula gave is of the same value (the recording's e->src) */
  if ((op_table[op].attrs & AF_SHAPE) && e->src != p->src) goto part;
  if ((user_numbers() || !in_internal()) != e->user) goto part;
  if (op_table[op].attrs) {
    static const op_attrs none;
    if (!a) a = &none;
    if (!rec_same_attrs(op, a, e->a)) goto part;
    if (e->n_slots) {
      rec_event tmp = {.kind = EV_OP, .op = (int)op, .a = (op_attrs *)a};
      rec_slot sl[2 * MAXD + 8];
      if (rec_slots(&tmp, sl, (int)(sizeof sl / sizeof sl[0])) != e->n_slots) goto part;
      for (int k = 0; k < e->n_slots; k++)
        if (!same_number(&sl[k], &s->slot[e->slot_at + k].v)) goto part;
    }
  }
  if (!take_params(p, e, in, n)) goto part;
  kiln_tensor *made = NULL;
  if (e->fresh) {
    const rp_val *pv = &s->val[e->out];
    if (op_table[op].kind == KIND_VIEW) {
      /* laid out over this call's input, as the op would (no layout: made is NULL, and the recording says why) */
      static const op_attrs none;
      bool no_layout;
      made = view_result(op, in[0], a ? a : &none, true, &no_layout);
    } else {
      made = tensor_new_meta(pv->dt, pv->ndim, pv->shape);
    }
  }
  kiln_tensor *t = result(p, e, made);
  if (!t) goto part; /* the recording says out of memory */
  p->at++;
  return t;
part:
  hand_over(p);
  return NULL;
}

/* Whether t is a param an event took (the replay holds it). */
static bool taken(const rp_script *s, const kiln_tensor *t) {
  for (int j = 0; j < s->n_params; j++)
    if (s->param_held[j] && s->params[j] == t) return true;
  return false;
}

/* Whether the recording can be handed t later: the script or the call
 * holds it (a param an event took). A size read of a param no event took
 * hands over at once: the body may let go of a tensor it replaces (a
 * state) before the replay would hand it over. */
static bool held(const rp_call *p, const kiln_tensor *t) {
  const rp_script *s = p->s;
  if (t->rec_call == s->origin && t->rec_id >= 0 && t->rec_id < s->n_val && s->cur[t->rec_id] == t) return true;
  for (int i = 0; i < s->n_in; i++)
    if (s->cur[i] == t) return true;
  return taken(s, t);
}

static void rp_size_read(void *ctx, const kiln_tensor *t, int dim) {
  rp_call *p = ctx;
  rp_script *s = p->s;
  if (!held(p, t) || alloc_grow((void **)&s->notes, &s->cap_notes, s->n_notes + 1, sizeof *s->notes)) {
    hand_over(p);
    rec_size_read(p->r, t, dim);
    return;
  }
  s->notes[s->n_notes++] = (struct rp_note){.kind = NOTE_SIZE, .at = p->at, .t = t, .dim = dim};
}

/* A whole in-place write: the same op into the same tensor from the same
 * one, a fill with the same value (or one the variant takes as an
 * argument). The written tensor is the write's value from here on; as the
 * recording, it writes nothing (inplace() bumps dst's version after). */
static void rp_inplace(void *ctx, op_id op, kiln_tensor *dst, kiln_tensor *src, double value, const char *file, int line) {
  rp_call *p = ctx;
  rp_script *s = p->s;
  kiln_tensor *in[2] = {dst, src};
  int n = src ? 2 : 1;
  if (p->at == s->n_ev) goto part;
  const rp_event *e = &s->ev[p->at];
  /* (a dst that does not cover its storage, an input that is a slice, is a write into a view) */
  if (e->kind != EV_INPLACE || e->op != (int)op || !in_internal() != e->user || !took_same(p, e, in, n, file, line, false) ||
      !tensor_covers_storage(dst))
    goto part;
  if (e->n_slots) {
    const rp_slot *vs = &s->slot[e->slot_at];
    if (vs->arg >= 0) p->argf[vs->arg] = value;
    else if (memcmp(&value, &vs->v.f, sizeof value)) goto part;
  }
  if (!take_params(p, e, in, n)) goto part;
  s->cur[e->out] = dst;
  p->at++;
  return;
part:
  hand_over(p);
  p->saved->inplace(p->saved->ctx, op, dst, src, value, file, line);
}

/* Every other hook is a step the script does not have. */
static void rp_read(void *ctx, const char *what, const kiln_tensor *t, const char *file, int line) {
  rp_call *p = ctx;
  hand_over(p);
  p->saved->read(p->saved->ctx, what, t, file, line);
}
/* A .grad's registration (kiln_zero_grad, kiln_grad): noted, for a param
 * of the script's, which is held from here if no event took it yet (a
 * step that zeroes its .grads first, torch's order); the .grad itself
 * changes as eagerly, and the end of the call checks what is left in it. */
static void rp_zero_grad(void *ctx, kiln_tensor *t) {
  rp_call *p = ctx;
  rp_script *s = p->s;
  bool ok = false;
  for (int j = 0; j < s->n_params; j++)
    if (s->params[j] == t) {
      /* (compared by pointer before anything is read: one not held may be gone, t has the serial) */
      ok = s->param_held[j] || (t->serial == s->param_serial[j] && take_param(p, j, t));
      break;
    }
  if (!ok || alloc_grow((void **)&s->notes, &s->cap_notes, s->n_notes + 1, sizeof *s->notes)) {
    hand_over(p);
    p->saved->zero_grad(p->saved->ctx, t);
    return;
  }
  s->notes[s->n_notes++] = (struct rp_note){.kind = NOTE_GRAD, .at = p->at, .t = t};
}
/* A value over a shape (kiln_scalar, kiln_zeros): its dtype, shape and value
 * the script's, or the value one the variant takes as an argument. */
static kiln_tensor *rp_factory(void *ctx, int kind, kiln_dtype dt, int ndim, const int64_t *shape, double value,
                               uint64_t seed, bool flag, const void *data, const char *file, int line) {
  rp_call *p = ctx;
  rp_script *s = p->s;
  if (kind != FAC_FULL || flag || p->at == s->n_ev) goto part;
  const rp_event *e = &s->ev[p->at];
  if (e->kind != EV_FULL || e->a->dtype != dt || e->a->ndim != ndim || e->n_slots != ndim + 1 || !in_internal() != e->user ||
      !same_site(e, file, line) || e->src != p->src)
    goto part;
  for (int i = 0; i < ndim; i++)
    if (shape[i] != s->slot[e->slot_at + i].v.i) goto part;
  const rp_slot *vs = &s->slot[e->slot_at + ndim];
  if (vs->arg >= 0) p->argf[vs->arg] = value;
  else if (memcmp(&value, &vs->v.f, sizeof value)) goto part;
  kiln_tensor *t = result(p, e, e->fresh ? tensor_new_meta(dt, ndim, shape) : NULL);
  if (!t) goto part;
  p->at++;
  return t;
part:
  hand_over(p);
  return p->saved->factory(p->saved->ctx, kind, dt, ndim, shape, value, seed, flag, data, file, line);
}
/* A count of x's elements (numel_scalar made out, as it does every call). */
static void rp_numel(void *ctx, kiln_tensor *out, const kiln_tensor *x, const int *axes, int naxes, int64_t offset,
                     const char *file, int line) {
  rp_call *p = ctx;
  rp_script *s = p->s;
  if (p->at == s->n_ev) goto part;
  const rp_event *e = &s->ev[p->at];
  kiln_tensor *xs = (kiln_tensor *)x; /* (a param is held as an op's) */
  if (e->kind != EV_NUMEL || !took_same(p, e, &xs, 1, file, line, false) || e->a->naxes != naxes ||
      e->a->start.c != offset || e->a->dtype != out->dtype || !in_internal() != e->user ||
      (naxes && memcmp(e->a->axes, axes, sizeof *axes * (size_t)naxes)) || !take_params(p, e, &xs, 1))
    goto part;
  result(p, e, out); /* the reference handed back is numel_scalar's own */
  p->at++;
  return;
part:
  hand_over(p);
  p->saved->numel(p->saved->ctx, out, x, axes, naxes, offset, file, line);
}
/* The tensor whose shape the next shape given is (an autograd formula's
 * input): the value the recording would take it for (on_shape_src), a
 * tensor of the script by its tag, a leaf by its serial at its latest
 * value; -2 for a tag that names no tensor of this call (no event matches). */
static void rp_shape_src(void *ctx, uint64_t serial, uint64_t rec_call, int rec_id) {
  rp_call *p = ctx;
  rp_script *s = p->s;
  if (alloc_grow((void **)&s->notes, &s->cap_notes, s->n_notes + 1, sizeof *s->notes)) {
    hand_over(p);
    p->saved->shape_src(p->saved->ctx, serial, rec_call, rec_id);
    return;
  }
  s->notes[s->n_notes++] =
      (struct rp_note){.kind = NOTE_SHAPE_SRC, .at = p->at, .dim = rec_id, .serial = serial, .call = rec_call};
  p->src = -1;
  if (!serial) return;
  if (rec_call == s->origin) {
    p->src = tagged(s, serial, rec_call, rec_id) ? rec_id : -2;
    return;
  }
  for (int i = s->n_leafish - 1; i >= 0 && p->src == -1; i--) {
    int v = s->leafish[i];
    const kiln_tensor *t = s->cur[v];
    if (t && (s->kind[v] != RV_PARAM || s->param_held[s->index[v]]) && t->serial == serial) p->src = v;
  }
}
static int rp_cf(void *ctx, const struct cf_call *c, kiln_tensor **results) {
  rp_call *p = ctx;
  hand_over(p);
  return p->saved->cf(p->saved->ctx, c, results);
}
/* An op the replay handed over in rp_op: the recording's hook sees it (dispatch reads the hooks anew). */
static void rp_after_op(void *ctx, op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out,
                        const char *file, int line) {
  rp_call *p = ctx;
  hand_over(p);
  p->saved->op(p->saved->ctx, op, in, n, a, out, file, line);
}

void rp_begin(rp_call *p, rp_script *s, recording *r, kiln_tensor *const *in) {
  /* field by field: argf alone is 512 bytes, set below as far as used */
  p->s = s;
  p->r = r;
  p->in = in;
  p->at = 0;
  p->src = -1;
  p->serial0 = tensor_serial_now();
  p->on = true;
  s->n_fresh = 0;
  s->n_notes = 0;
  memset(s->param_held, 0, sizeof *s->param_held * (size_t)s->n_params);
  for (int v = 0; v < s->n_val; v++)
    s->cur[v] = s->kind[v] == RV_INPUT ? in[s->index[v]] : s->kind[v] == RV_PARAM ? s->params[s->index[v]] : s->val[v].t;
  if (s->n_args) memcpy(p->argf, s->argf, sizeof *p->argf * (size_t)s->n_args);
  p->hooks = (trace_hooks){.ctx = p,
                           .op = rp_after_op,
                           .inplace = rp_inplace,
                           .read = rp_read,
                           .zero_grad = rp_zero_grad,
                           .numel = rp_numel,
                           .size_read = rp_size_read,
                           .shape_src = rp_shape_src,
                           .record = true,
                           .factory = rp_factory,
                           .cf = rp_cf,
                           .replay = rp_op};
  p->saved = dispatch_hooks();
  dispatch_set_hooks(&p->hooks);
  for (int i = 0; i < s->n_in; i++)
    if (first_sharing(in, i + 1, in[i]) != s->in_st[i]) {
      hand_over(p);
      break;
    }
}

bool rp_finished(rp_call *p, int rc, kiln_tensor *const *out, int n_out) {
  if (!p->on) return false;
  rp_script *s = p->s;
  bool ok = rc == 0 && p->at == s->n_ev && n_out == s->n_out;
  for (int k = 0; ok && k < n_out; k++) ok = out[k] && out[k] == s->cur[s->out[k]];
  if (!ok) hand_over(p);
  return ok;
}

/* The history ops gave a tensor of the call goes (as a recording's end
 * strips its own): none is handed out or kept with it. */
static void strip(kiln_tensor *t) {
  if (!t || !t->grad_fn) return;
  ag_node_release(t->grad_fn);
  t->grad_fn = NULL;
  t->requires_grad = false;
}

bool rp_nothing_kept(rp_call *p) {
  if (!p->on) return false;
  rp_script *s = p->s;
  for (int v = 0; v < s->n_val; v++) strip(s->val[v].t);
  for (int i = 0; i < s->n_fresh; i++) strip(s->fresh[i]);
  bool ok = true;
  /* each .grad the variant sets is where the script's call left it: the
   * tensor of its value (whose reference the run replaces), or NULL */
  for (int j = 0; j < s->n_params && ok; j++)
    if (s->grad_end[j] != -2)
      ok = s->param_held[j] && s->params[j]->grad == (s->grad_end[j] >= 0 ? s->cur[s->grad_end[j]] : NULL);
  /* the script's own tensors: held by it alone, as it made them (a body
   * that stored one, or marked it requires_grad, did what the script did not) */
  for (int v = 0; v < s->n_val && ok; v++) {
    const kiln_tensor *t = s->val[v].t;
    ok = !t || (tensor_refs(t) == 1 && !t->requires_grad);
  }
  /* made anew: ours, each .grad's that is it (a .grad value is made anew), and the caller's for each output */
  for (int i = 0; i < s->n_fresh && ok; i++) {
    const kiln_tensor *t = s->fresh[i];
    uint32_t want = 1 + (uint32_t)s->grad_refs[t->rec_id];
    for (int k = 0; k < s->n_out; k++) want += s->cur[s->out[k]] == t;
    ok = tensor_refs(t) == want && !t->requires_grad;
  }
  if (!ok) hand_over(p);
  return ok;
}

void rp_end(rp_call *p) {
  if (!p->s) return;
  if (dispatch_hooks() == &p->hooks) dispatch_set_hooks(p->saved);
  rp_script *s = p->s;
  for (int i = 0; i < s->n_fresh; i++) kiln_release(s->fresh[i]);
  s->n_fresh = 0;
  s->n_notes = 0;
  let_go_of_params(s);
  p->on = false;
}

void rp_restore_grads(rp_call *p) {
  rp_script *s = p->s;
  for (int j = 0; j < s->n_params; j++) {
    s->stash[j] = NULL;
    if (s->grad_end[j] == -2 || !s->param_held[j] || s->params[j]->grad == s->grad0[j]) continue;
    s->stash[j] = s->params[j]->grad; /* the param's reference, ours now */
    s->params[j]->grad = kiln_retain(s->grad0[j]);
  }
}

kiln_tensor *rp_grad_seen(rp_call *p, int j) {
  kiln_tensor *t = p->s->stash[j];
  p->s->stash[j] = NULL;
  return t;
}

const int64_t *rp_argi(const rp_call *p) { return p->s->argi; }
int rp_n_params(const rp_call *p) { return p->s->n_params; }

kiln_tensor *rp_take_param(rp_call *p, int i) {
  rp_script *s = p->s;
  if (!s->param_held[i]) return kiln_retain(s->params[i]);
  s->param_held[i] = false;
  return s->params[i];
}
