/* Structured control flow run eagerly: kiln_cond, kiln_while_loop and
 * kiln_scan call the user's bodies as plain C, so every op inside them is an
 * ordinary op (autograd records it, a recording sees it). What these
 * functions add is the contract: the predicate is a one-element bool, the
 * carry keeps its dtypes and shapes from one step to the next, scan's xs
 * agree on dim 0 and its ys are stacked along a new dim 0 (T may be 0).
 *
 * Each branch or step runs inside a scope of its own, so a long loop does
 * not pile its intermediates into the caller's scope: the step's outputs are
 * retained, the scope closes, and what autograd needs lives on in its nodes.
 * Results are new references owned like any op result.
 *
 * Inside a compiled function's recording, each construct is first offered
 * to the tracer (the cf hook): it records each body once, over meta
 * tensors, as a region of the graph, and hands back the results' meta
 * tensors; the predicate is never read and a scan's length never unrolled.
 * When the tracer declines (autograd must see through it, or the recording
 * went eager), the construct runs here as plain C, as outside. */
#include <limits.h>
#include <string.h>

#include "eager/eager.h"

#define CF_MAX 64 /* tensors a body may take or set, as kiln_options allows */

/* out[i] of a body: non-NULL and live, with the error set otherwise. */
static int check_outs(const char *op, const char *who, kiln_tensor *const *out, int n, const char *file, int line) {
  for (int i = 0; i < n; i++) {
    if (!out[i]) return err_set(file, line, op, "%s returned 0 but left out[%d] NULL", who, i), -1;
    if (tensor_check_live(out[i], "an output", op, file, line)) return -1;
  }
  return 0;
}

/* Runs fn(ctx, in, out) with out[0..n_out) cleared first; a nonzero return
 * keeps the body's own message when it set one. */
static int run_body(const char *op, const char *who, kiln_body fn, void *ctx, kiln_tensor *const *in,
                    kiln_tensor **out, int n_out, const char *file, int line) {
  for (int i = 0; i < n_out; i++) out[i] = NULL;
  unsigned long errors = err_count();
  int rc = fn(ctx, in, out);
  if (rc) {
    if (err_count() == errors) err_set(file, line, op, "%s returned %d", who, rc);
    return -1;
  }
  return check_outs(op, who, out, n_out, file, line);
}

/* t agrees with want in dtype and shape, or the error names both. */
static int same_type(const char *op, const char *what, int i, const kiln_tensor *t, kiln_dtype dt, int ndim,
                     const int64_t *shape, const char *against, const char *file, int line) {
  if (t->dtype == dt && t->ndim == ndim && !memcmp(t->shape, shape, sizeof(int64_t) * (size_t)ndim)) return 0;
  char b0[SHAPE_BUF], b1[SHAPE_BUF];
  err_set(file, line, op, "%s %d is %s%s but %s is %s%s", what, i, kiln_dtype_name(t->dtype),
          err_shape(b0, t->ndim, t->shape), against, kiln_dtype_name(dt), err_shape(b1, ndim, shape));
  return -1;
}

/* p must be a one-element bool tensor: 0, or -1 with the error set. */
static int check_pred(const char *op, const char *what, const kiln_tensor *p, const char *file, int line) {
  if (p->dtype == KILN_BOOL && kiln_numel(p) == 1) return 0;
  char b[SHAPE_BUF];
  err_set(file, line, op, "%s must be a one-element bool tensor, got %s%s", what, kiln_dtype_name(p->dtype),
          err_shape(b, p->ndim, p->shape));
  return -1;
}

/* p as a C bool: 0/1, or -1 with the error set. */
static int read_pred(const char *op, const char *what, const kiln_tensor *p, const char *file, int line) {
  if (check_pred(op, what, p, file, line)) return -1;
  /* a read at the caller's line: inside a compiled function it is where the graph breaks */
  unsigned char v = 0;
  /* named as the construct's read (a break's dump and fullgraph's error say so), not as kiln_read */
  hook_read(op[0] == 'c' ? "kiln_cond (its predicate)" : "kiln_while_loop (its condition)", p, file, line);
  if (kiln_read_at(p, &v, sizeof v, file, line)) return -1;
  return v != 0;
}

static int check_list(const char *op, const char *what, kiln_tensor *const *ts, int n, int lo, const char *file,
                      int line) {
  if (n < lo || n > CF_MAX) return err_set(file, line, op, "%s: %d tensors, must be %d to %d", what, n, lo, CF_MAX), -1;
  if (n && !ts) return err_set(file, line, op, "%s is NULL", what), -1;
  for (int i = 0; i < n; i++) {
    char w[64];
    snprintf(w, sizeof w, "%s[%d]", what, i);
    if (tensor_bad_arg(ts[i], file, line, op, w)) return -1;
  }
  return 0;
}

/* Hands the references in ts[0..n) to the caller's scope, as op results. */
static void hand_out(kiln_tensor **ts, int n) {
  for (int i = 0; i < n; i++) ts[i] = scope_adopt(ts[i]);
}

static void release_all(kiln_tensor **ts, int n) {
  for (int i = 0; i < n; i++) {
    kiln_release(ts[i]);
    ts[i] = NULL;
  }
}

/* ---- inside a recording: the bodies recorded once, as regions ---- */

static const char *const cf_op[] = {"cond", "while_loop", "scan"};

static int cf_run(const cf_call *c, int i, kiln_tensor *const *args, kiln_tensor **out) {
  static const char *const who[3][2] = {{"then_fn", "else_fn"}, {"cond_fn", "body_fn"}, {"body_fn", "body_fn"}};
  kiln_tensor *res[2 * CF_MAX];
  kiln_scope_begin();
  int rc = run_body(cf_op[c->kind], who[c->kind][i], c->fn[i], c->ctx, args, res, c->n_out[i], c->file, c->line);
  for (int k = 0; k < c->n_out[i]; k++) out[k] = rc ? NULL : kiln_retain(res[k]);
  kiln_scope_end();
  return rc;
}

/* Offers the construct to a recording (the tracer's cf hook): 1 recorded,
 * its results handed out to the caller's scope; 0 run it eagerly; -1 error. */
static int cf_offer(cf_call *c, kiln_tensor **results) {
  const trace_hooks *h = dispatch_hooks();
  if (!h || !h->record || !h->cf) return 0;
  c->run = cf_run;
  int rc = h->cf(h->ctx, c, results);
  if (rc == 1) hand_out(results, c->n_results);
  return rc;
}

int kiln_cond_at(kiln_tensor *pred, kiln_body then_fn, kiln_body else_fn, void *ctx, int n_in, kiln_tensor *const *in,
                 int n_out, kiln_tensor **out, const char *file, int line) {
  const char *op = "cond";
  if (tensor_bad_arg(pred, file, line, op, "pred")) return -1;
  if (!then_fn || !else_fn) return err_set(file, line, op, "%s is NULL", then_fn ? "else_fn" : "then_fn"), -1;
  if (check_list(op, "in", in, n_in, 0, file, line)) return -1;
  if (n_out < 1 || n_out > CF_MAX || !out) return err_set(file, line, op, "n_out %d: must be 1 to %d with out set", n_out, CF_MAX), -1;
  for (int i = 0; i < n_out; i++) out[i] = NULL;
  if (check_pred(op, "pred", pred, file, line)) return -1;
  kiln_tensor *ops[CF_MAX + 1] = {pred};
  if (n_in) memcpy(ops + 1, in, sizeof *ops * (size_t)n_in);
  cf_call c = {.kind = CF_COND, .in = ops, .n_in = n_in + 1, .n_args = n_in, .n_regions = 2, .n_out = {n_out, n_out},
               .n_results = n_out, .fn = {then_fn, else_fn}, .ctx = ctx, .file = file, .line = line};
  int recorded = cf_offer(&c, out);
  if (recorded) return recorded < 0 ? -1 : 0;
  int p = read_pred(op, "pred", pred, file, line);
  if (p < 0) return -1;
  kiln_tensor *res[CF_MAX];
  kiln_scope_begin();
  int rc = run_body(op, p ? "then_fn" : "else_fn", p ? then_fn : else_fn, ctx, in, res, n_out, file, line);
  for (int i = 0; i < n_out; i++) res[i] = rc ? NULL : kiln_retain(res[i]);
  kiln_scope_end();
  if (rc) return -1;
  memcpy(out, res, sizeof *out * (size_t)n_out);
  hand_out(out, n_out);
  return 0;
}

int kiln_while_loop_at(kiln_body cond_fn, kiln_body body_fn, void *ctx, int n_carry, kiln_tensor *const *init,
                       kiln_tensor **final, const char *file, int line) {
  const char *op = "while_loop";
  if (!cond_fn || !body_fn) return err_set(file, line, op, "%s is NULL", cond_fn ? "body_fn" : "cond_fn"), -1;
  if (check_list(op, "init", init, n_carry, 1, file, line)) return -1;
  if (!final) return err_set(file, line, op, "final is NULL"), -1;
  cf_call c = {.kind = CF_WHILE, .in = init, .n_in = n_carry, .n_carry = n_carry, .n_args = n_carry, .n_regions = 2,
               .n_out = {1, n_carry}, .n_results = n_carry, .fn = {cond_fn, body_fn}, .ctx = ctx, .file = file, .line = line};
  int recorded = cf_offer(&c, final);
  if (recorded) return recorded < 0 ? -1 : 0;
  kiln_tensor *carry[CF_MAX], *next[CF_MAX];
  for (int i = 0; i < n_carry; i++) carry[i] = kiln_retain(init[i]);
  int rc = 0;
  for (;;) {
    kiln_scope_begin();
    kiln_tensor *p;
    rc = run_body(op, "cond_fn", cond_fn, ctx, carry, &p, 1, file, line);
    int go = rc ? -1 : read_pred(op, "cond_fn's out[0]", p, file, line);
    if (go == 1) rc = run_body(op, "body_fn", body_fn, ctx, carry, next, n_carry, file, line);
    for (int i = 0; go == 1 && !rc && i < n_carry; i++)
      rc = same_type(op, "body_fn's out", i, next[i], init[i]->dtype, init[i]->ndim, init[i]->shape, "the carry",
                     file, line);
    for (int i = 0; go == 1 && !rc && i < n_carry; i++) next[i] = kiln_retain(next[i]);
    kiln_scope_end();
    if (go != 1 || rc) {
      rc = rc || go < 0;
      break;
    }
    release_all(carry, n_carry);
    memcpy(carry, next, sizeof *carry * (size_t)n_carry);
  }
  /* forward only, as in JAX: a gradient reaching the results is an error
   * at this line, not a gradient through however many steps this call took.
   * Under no_grad a carry still requiring grad is an init passed through:
   * a result without history, as a compiled loop gives */
  bool grad = false;
  for (int i = 0; !rc && i < n_carry; i++) grad |= grad_mode() && carry[i]->requires_grad;
  for (int i = 0; !rc && i < n_carry; i++) {
    kiln_tensor *t = carry[i];
    if (!grad && !t->requires_grad) continue;
    carry[i] = tensor_view(t, t->ndim, t->shape, t->stride, t->offset);
    kiln_release(t);
    if (!carry[i]) rc = -1, err_set(file, line, op, "out of memory");
  }
  if (grad && !rc) rc = ag_forward_only(carry, n_carry, file, line);
  if (rc) {
    release_all(carry, n_carry);
    return -1;
  }
  memcpy(final, carry, sizeof *final * (size_t)n_carry);
  hand_out(final, n_carry);
  return 0;
}

/* One step of scan: slices xs at t (or zeros of a step's shape when t < 0,
 * which only learns the shapes of ys), runs the body and checks the new
 * carry against init and each y against ys_like (when set). The outputs,
 * retained, go to out. */
static int scan_step(kiln_body body_fn, void *ctx, int n_carry, kiln_tensor *const *init, kiln_tensor *const *carry,
                     int n_xs, kiln_tensor *const *xs, int64_t t, int n_ys, kiln_tensor *const *ys_like,
                     kiln_tensor **out, const char *file, int line) {
  const char *op = "scan";
  kiln_tensor *in[2 * CF_MAX];
  int n_out = n_carry + n_ys, rc = 0;
  kiln_scope_begin();
  memcpy(in, carry, sizeof *in * (size_t)n_carry);
  for (int j = 0; j < n_xs && !rc; j++) {
    const kiln_tensor *x = xs[j];
    in[n_carry + j] = t >= 0 ? kiln_squeeze_at(kiln_slice_at(xs[j], 0, t, t + 1, 1, file, line), 0, file, line)
                             : kiln_zeros_at(x->dtype, x->ndim - 1, x->shape + 1, file, line);
    rc = in[n_carry + j] ? 0 : -1;
  }
  if (!rc) rc = run_body(op, "body_fn", body_fn, ctx, in, out, n_out, file, line);
  for (int i = 0; !rc && i < n_carry; i++)
    rc = same_type(op, "body_fn's out", i, out[i], init[i]->dtype, init[i]->ndim, init[i]->shape, "the carry", file,
                   line);
  for (int k = 0; !rc && ys_like && k < n_ys; k++) {
    const kiln_tensor *y = ys_like[k];
    char what[64];
    snprintf(what, sizeof what, "step %lld's out", (long long)t);
    rc = same_type(op, what, n_carry + k, out[n_carry + k], y->dtype, y->ndim, y->shape, "the first step's", file, line);
  }
  for (int i = 0; i < n_out; i++) out[i] = rc ? NULL : kiln_retain(out[i]);
  kiln_scope_end();
  return rc;
}

int kiln_scan_at(kiln_body body_fn, void *ctx, int n_carry, kiln_tensor *const *init, int n_xs,
                 kiln_tensor *const *xs, kiln_tensor **carry_out, int n_ys, kiln_tensor **ys, const char *file,
                 int line) {
  const char *op = "scan";
  if (!body_fn) return err_set(file, line, op, "body_fn is NULL"), -1;
  if (check_list(op, "init", init, n_carry, 0, file, line) || check_list(op, "xs", xs, n_xs, 1, file, line)) return -1;
  if (n_ys < 0 || n_ys > CF_MAX || (n_ys && !ys)) return err_set(file, line, op, "n_ys %d: must be 0 to %d with ys set", n_ys, CF_MAX), -1;
  if (n_carry && !carry_out) return err_set(file, line, op, "carry_out is NULL"), -1;
  if (n_carry + n_ys < 1) return err_set(file, line, op, "the body has no outputs (n_carry and n_ys are 0)"), -1;
  for (int j = 0; j < n_xs; j++) {
    char b0[SHAPE_BUF], b1[SHAPE_BUF];
    if (xs[j]->ndim < 1) return err_set(file, line, op, "xs[%d] is 0-d; it needs a dim 0 to scan over", j), -1;
    if (xs[j]->shape[0] != xs[0]->shape[0])
      return err_set(file, line, op, "xs[%d] %s and xs[0] %s differ in dim 0 (%lld != %lld)", j,
                     err_shape(b0, xs[j]->ndim, xs[j]->shape), err_shape(b1, xs[0]->ndim, xs[0]->shape),
                     (long long)xs[j]->shape[0], (long long)xs[0]->shape[0]),
             -1;
  }
  int64_t T = xs[0]->shape[0];
  if (T > INT_MAX) return err_set(file, line, op, "%lld steps, more than %d", (long long)T, INT_MAX), -1;
  {
    kiln_tensor *ops[2 * CF_MAX], *res[2 * CF_MAX];
    if (n_carry) memcpy(ops, init, sizeof *ops * (size_t)n_carry);
    memcpy(ops + n_carry, xs, sizeof *ops * (size_t)n_xs);
    cf_call c = {.kind = CF_SCAN, .in = ops, .n_in = n_carry + n_xs, .n_carry = n_carry, .n_xs = n_xs,
                 .n_args = n_carry + n_xs, .n_regions = 1, .n_out = {n_carry + n_ys}, .n_results = n_carry + n_ys,
                 .fn = {body_fn}, .ctx = ctx, .file = file, .line = line};
    int recorded = cf_offer(&c, res);
    if (recorded < 0) return -1;
    if (recorded) {
      if (n_carry) memcpy(carry_out, res, sizeof *carry_out * (size_t)n_carry);
      if (n_ys) memcpy(ys, res + n_carry, sizeof *ys * (size_t)n_ys);
      return 0;
    }
  }
  kiln_tensor *carry[CF_MAX], *step[2 * CF_MAX], *res[CF_MAX] = {0};
  kiln_tensor **yt = NULL; /* (T, n_ys): every step's ys, retained */
  for (int i = 0; i < n_carry; i++) carry[i] = kiln_retain(init[i]);
  int rc = 0;
  if (T == 0) {
    /* No step runs; one run over zeros, without autograd, gives the shapes of ys. */
    kiln_no_grad_begin();
    rc = scan_step(body_fn, ctx, n_carry, init, carry, n_xs, xs, -1, n_ys, NULL, step, file, line);
    kiln_no_grad_end();
    kiln_scope_begin();
    for (int k = 0; !rc && k < n_ys; k++) {
      const kiln_tensor *y = step[n_carry + k];
      int64_t shape[MAXD] = {0};
      if (y->ndim + 1 > MAXD) {
        rc = -1;
        err_set(file, line, op, "y %d of rank %d would stack to rank %d, more than %d", k, y->ndim, y->ndim + 1, MAXD);
        break;
      }
      memcpy(shape + 1, y->shape, sizeof(int64_t) * (size_t)y->ndim);
      res[k] = kiln_retain(kiln_zeros_at(y->dtype, y->ndim + 1, shape, file, line));
      if (!res[k]) rc = -1;
    }
    kiln_scope_end();
    release_all(step, n_carry + n_ys); /* NULLs when the run failed */
  } else if (n_ys && !(yt = alloc_calloc((size_t)T * (size_t)n_ys, sizeof *yt))) {
    rc = -1;
    err_set(file, line, op, "out of memory");
  }
  for (int64_t t = 0; T > 0 && !rc && t < T; t++) {
    rc = scan_step(body_fn, ctx, n_carry, init, carry, n_xs, xs, t, n_ys, t ? yt : NULL, step, file, line);
    if (rc) break;
    release_all(carry, n_carry);
    memcpy(carry, step, sizeof *carry * (size_t)n_carry);
    if (n_ys) memcpy(yt + t * n_ys, step + n_carry, sizeof *yt * (size_t)n_ys);
  }
  if (T > 0 && !rc && n_ys) {
    kiln_tensor **col = alloc_malloc(sizeof *col * (size_t)T);
    if (!col) rc = -1, err_set(file, line, op, "out of memory");
    kiln_scope_begin();
    for (int k = 0; !rc && k < n_ys; k++) {
      for (int64_t t = 0; t < T; t++) col[t] = yt[t * n_ys + k];
      res[k] = kiln_retain(kiln_stack_at(col, (int)T, 0, file, line));
      if (!res[k]) rc = -1;
    }
    kiln_scope_end();
    alloc_free(col);
  }
  if (yt)
    for (int64_t t = 0; t < T; t++) release_all(yt + t * n_ys, n_ys);
  alloc_free(yt);
  if (rc) {
    release_all(carry, n_carry);
    release_all(res, n_ys);
    for (int k = 0; k < n_ys; k++) ys[k] = NULL;
    for (int i = 0; carry_out && i < n_carry; i++) carry_out[i] = NULL;
    return -1;
  }
  if (n_ys) memcpy(ys, res, sizeof *ys * (size_t)n_ys);
  if (n_carry) memcpy(carry_out, carry, sizeof *carry_out * (size_t)n_carry);
  hand_out(carry_out, n_carry);
  hand_out(ys, n_ys);
  return 0;
}
