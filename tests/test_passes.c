/* Graph passes and the verifier. Graphs are built by hand (shapes from the
 * shape rules, or set explicitly where a test wants a broken node); tests
 * assert on the IR after each pass (which nodes remain, where outputs and
 * writes point, that leaves survive), on the numbers the interpreter gives
 * before and after the pipeline, on the verifier's message for each kind of
 * broken graph, and (test build) that every allocation failure in the
 * pipeline returns NULL without a leak. */
#include <check.h>
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tracer/tracer.h"

static ir_graph *g;
static char err[512];

static void setup(void) {
  g = ir_new("t");
  ck_assert_ptr_nonnull(g);
}

static void teardown(void) {
  ir_free(g);
  g = NULL;
}

/* ---- building graphs ---- */

static sym_dim C(int64_t c) { return sym_const(c); }

static sym_dim SYM(int64_t lo, int64_t hi) {
  sym_dim d;
  ck_assert_int_eq(0, ir_add_sym(g, lo, hi, &d));
  return d;
}

/* A shape argument: DIMS(s0, C(4)) is the pointer and the count. */
#define DIMS(...) (sym_dim[]){__VA_ARGS__}, (int)(sizeof((sym_dim[]){__VA_ARGS__}) / sizeof(sym_dim))

static int leaf(int op, kiln_dtype dt, const sym_dim *shape, int nd) {
  ir_node n = {.op = op, .dtype = dt, .ndim = nd, .file = "t.c", .line = 1};
  n.index = op == IR_INPUT ? g->n_inputs : g->n_params;
  if (nd) memcpy(n.shape, shape, sizeof(sym_dim) * (size_t)nd);
  int id = ir_append(g, &n);
  ck_assert_int_ge(id, 0);
  return id;
}
static int input(kiln_dtype dt, const sym_dim *shape, int nd) { return leaf(IR_INPUT, dt, shape, nd); }
static int param(kiln_dtype dt, const sym_dim *shape, int nd) { return leaf(IR_PARAM, dt, shape, nd); }
static int input0(kiln_dtype dt) { return leaf(IR_INPUT, dt, NULL, 0); }

static int grad_of(int p) {
  const ir_node *l = &g->nodes[p];
  ir_node n = {.op = IR_GRAD, .dtype = l->dtype, .ndim = l->ndim, .n_in = 1, .in = &p, .file = "t.c", .line = 1};
  memcpy(n.shape, l->shape, sizeof n.shape);
  int id = ir_append(g, &n);
  ck_assert_int_ge(id, 0);
  return id;
}

static int konst(kiln_dtype dt, int nd, const int64_t *shape, const void *data) {
  ir_node n = {.op = IR_CONST, .dtype = dt, .ndim = nd, .data = (void *)data, .file = "t.c", .line = 2};
  for (int i = 0; i < nd; i++) n.shape[i] = C(shape[i]);
  int id = ir_add(g, &n);
  ck_assert_int_ge(id, 0);
  return id;
}
static int scalar_f32(float v) { return konst(KILN_F32, 0, NULL, &v); }
static int scalar_f64(double v) { return konst(KILN_F64, 0, NULL, &v); }
static int vec_f32(int n, const float *v) { return konst(KILN_F32, 1, (int64_t[]){n}, v); }

/* An op node, its dtype and shape from the shape rule; interned unless raw. */
static int make(int op, int n_in, const int *in, const op_attrs *a, int line, bool raw) {
  ir_node n = {.op = op, .n_in = n_in, .in = (int *)in, .file = "t.c", .line = line};
  if (a) n.attrs = *a;
  shape_env env = {.g = g, .vals = NULL, .nvals = 0, .record = false};
  ck_assert_msg(symshape_infer(&env, &n, err, sizeof err) == 0, "line %d: %s", line, err);
  int id = raw ? ir_append(g, &n) : ir_add(g, &n);
  ck_assert_int_ge(id, 0);
  return id;
}
#define OP1(op, x) make(op, 1, (int[]){x}, NULL, __LINE__, false)
#define OP2(op, x, y) make(op, 2, (int[]){x, y}, NULL, __LINE__, false)
#define OPA(op, x, ...) make(op, 1, (int[]){x}, &(op_attrs){__VA_ARGS__}, __LINE__, false)

static int cast(int x, kiln_dtype dt) { return OPA(OP_CAST, x, .dtype = dt); }
static int permute(int x, int a, int b, int c) { return OPA(OP_PERMUTE, x, .perm = {a, b, c}); }

/* A node with everything given: for graphs the verifier must reject. */
static int raw(int op, kiln_dtype dt, const sym_dim *shape, int nd, int n_in, const int *in) {
  ir_node n = {.op = op, .dtype = dt, .ndim = nd, .n_in = n_in, .in = (int *)in, .file = "t.c", .line = 3};
  if (nd) memcpy(n.shape, shape, sizeof(sym_dim) * (size_t)nd);
  int id = ir_append(g, &n);
  ck_assert_int_ge(id, 0);
  return id;
}

static void output(int id) { ck_assert_int_eq(0, ir_add_output(g, id)); }
static void write_data(int target, int value) {
  ck_assert_int_eq(0, ir_add_write(g, (ir_write){.kind = IR_WRITE_DATA, .target = target, .value = value, .file = "t.c", .line = 9}));
}
static void write_grad(int target, int value) {
  ck_assert_int_eq(0, ir_add_write(g, (ir_write){.kind = IR_WRITE_GRAD, .target = target, .value = value, .file = "t.c", .line = 9}));
}

/* ---- running passes and looking at the result ---- */

static void verify_ok(void) { ck_assert_msg(ir_verify(g, err, sizeof err) == 0, "%s", err); }

static void pass(ir_graph *(*p)(ir_graph *)) {
  verify_ok();
  g = p(g);
  ck_assert_ptr_nonnull(g);
  verify_ok();
}

static void pipeline(void) {
  g = pass_pipeline(g, err, sizeof err);
  ck_assert_msg(g != NULL, "%s", err);
  verify_ok();
}

static int count(int op) {
  int k = 0;
  for (int i = 0; i < g->n_nodes; i++) k += g->nodes[i].op == op;
  return k;
}

static const ir_node *out_node(int i) { return &g->nodes[g->outputs[i]]; }

/* ---- simplify ---- */

START_TEST(test_mul_one_add_zero)
{
  sym_dim s0 = SYM(1, 1024);
  int x = input(KILN_F32, DIMS(s0, C(4)));
  int one = scalar_f32(1), zero = scalar_f32(0);
  output(OP2(OP_MUL, x, one));
  output(OP2(OP_MUL, one, x));
  output(OP2(OP_ADD, x, zero));
  output(OP2(OP_ADD, zero, x));
  output(OP2(OP_SUB, x, zero));
  output(OP2(OP_DIV, x, one));
  output(OP2(OP_MUL, x, vec_f32(4, (float[]){1, 1, 1, 1}))); /* broadcasts into x's own shape */
  output(OP2(OP_ADD, x, vec_f32(4, (float[]){0, -0.0f, 0, 0})));
  pass(pass_simplify);
  for (int i = 0; i < 8; i++) ck_assert_int_eq(x, g->outputs[i]);
  pass(pass_dce);
  ck_assert_int_eq(1, g->n_nodes); /* the constants went with their users */
  ck_assert_int_eq(IR_INPUT, g->nodes[0].op);
}
END_TEST

START_TEST(test_identities_that_stay)
{
  int x = input(KILN_F32, DIMS(C(4)));
  int one = scalar_f32(1), zero = scalar_f32(0), two = scalar_f32(2);
  output(OP2(OP_SUB, zero, x)); /* 0 - x is -x, not x */
  output(OP2(OP_DIV, one, x));
  output(OP2(OP_MUL, x, two));
  /* the constant broadcasts x to a bigger shape: the op is a broadcast */
  output(OP2(OP_MUL, x, konst(KILN_F32, 2, (int64_t[]){3, 4}, (float[12]){1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1})));
  /* not all ones */
  output(OP2(OP_MUL, x, vec_f32(4, (float[]){1, 1, 2, 1})));
  pass(pass_simplify);
  static const int want[] = {OP_SUB, OP_DIV, OP_MUL, OP_MUL, OP_MUL};
  for (int i = 0; i < 5; i++) ck_assert_int_eq(want[i], out_node(i)->op);
  ck_assert_int_eq(2, out_node(3)->ndim);
}
END_TEST

START_TEST(test_integer_identities)
{
  int x = input(KILN_I64, DIMS(C(3)));
  int64_t one = 1, zero = 0;
  output(OP2(OP_MUL, x, konst(KILN_I64, 0, NULL, &one)));
  output(OP2(OP_ADD, konst(KILN_I64, 0, NULL, &zero), x));
  pass(pass_simplify);
  ck_assert_int_eq(x, g->outputs[0]);
  ck_assert_int_eq(x, g->outputs[1]);
}
END_TEST

START_TEST(test_neg_neg)
{
  int x = input(KILN_F32, DIMS(C(5)));
  int n1 = OP1(OP_NEG, x), n2 = OP1(OP_NEG, n1), n3 = OP1(OP_NEG, n2);
  output(n2);
  output(n3);
  output(OP1(OP_NEG, n3));
  pass(pass_simplify);
  ck_assert_int_eq(x, g->outputs[0]);
  ck_assert_int_eq(OP_NEG, out_node(1)->op); /* three negs are one */
  ck_assert_int_eq(x, out_node(1)->in[0]);
  ck_assert_int_eq(x, g->outputs[2]);
  pass(pass_dce);
  ck_assert_int_eq(1, count(OP_NEG));
}
END_TEST

START_TEST(test_cast_to_own_type)
{
  int x = input(KILN_F32, DIMS(C(2), C(3)));
  output(cast(x, KILN_F32));
  output(cast(x, KILN_F64));
  pass(pass_simplify);
  ck_assert_int_eq(x, g->outputs[0]);
  ck_assert_int_eq(OP_CAST, out_node(1)->op);
  ck_assert_int_eq(KILN_F64, out_node(1)->dtype);
}
END_TEST

START_TEST(test_permute_of_permute)
{
  int x = input(KILN_F32, DIMS(C(2), C(3), C(4)));
  /* (1,2,0) then (2,0,1): the identity */
  output(permute(permute(x, 1, 2, 0), 2, 0, 1));
  /* (1,0,2) then (0,2,1): one permute (1,2,0) */
  output(permute(permute(x, 1, 0, 2), 0, 2, 1));
  output(permute(x, 0, 1, 2));
  pass(pass_simplify);
  ck_assert_int_eq(x, g->outputs[0]);
  const ir_node *p = out_node(1);
  ck_assert_int_eq(OP_PERMUTE, p->op);
  ck_assert_int_eq(x, p->in[0]);
  ck_assert_int_eq(1, p->attrs.perm[0]);
  ck_assert_int_eq(2, p->attrs.perm[1]);
  ck_assert_int_eq(0, p->attrs.perm[2]);
  ck_assert_int_eq(3, p->shape[0].c);
  ck_assert_int_eq(4, p->shape[1].c);
  ck_assert_int_eq(2, p->shape[2].c);
  ck_assert_int_eq(x, g->outputs[2]);
  pass(pass_dce);
  ck_assert_int_eq(1, count(OP_PERMUTE));
}
END_TEST

START_TEST(test_reshape_chains)
{
  sym_dim s0 = SYM(1, 1024);
  int x = input(KILN_F32, DIMS(s0, C(6)));
  sym_dim flat = sym_mul(g->sym, s0, C(6));
  int r1 = OPA(OP_RESHAPE, x, .ndim = 3, .shape = {s0, C(2), C(3)});
  int r2 = OPA(OP_RESHAPE, r1, .ndim = 1, .shape = {flat});
  output(r2);
  output(OPA(OP_RESHAPE, r2, .ndim = 2, .shape = {s0, C(6)})); /* back to x's shape */
  pass(pass_simplify);
  const ir_node *r = out_node(0);
  ck_assert_int_eq(OP_RESHAPE, r->op);
  ck_assert_int_eq(x, r->in[0]);
  ck_assert(sym_same(flat, r->shape[0]));
  ck_assert_int_eq(x, g->outputs[1]);
  pass(pass_dce);
  ck_assert_int_eq(1, count(OP_RESHAPE));
}
END_TEST

START_TEST(test_identity_views)
{
  sym_dim s0 = SYM(2, 64);
  int x = input(KILN_F32, DIMS(s0, C(4)));
  output(OPA(OP_EXPAND, x, .ndim = 2, .shape = {s0, C(4)}));
  output(OPA(OP_SLICE, x, .dim = 0, .start = C(0), .end = s0, .step = 1));
  output(OPA(OP_SLICE, x, .dim = 1, .start = C(0), .end = C(4), .step = 1));
  output(OPA(OP_SLICE, x, .dim = 1, .start = C(1), .end = C(4), .step = 1));
  output(OPA(OP_SLICE, x, .dim = 1, .start = C(0), .end = C(4), .step = 2));
  output(OPA(OP_EXPAND, x, .ndim = 3, .shape = {C(3), s0, C(4)}));
  output(OP1(OP_COPY, x)); /* contiguous stays: it is about layout */
  pass(pass_simplify);
  ck_assert_int_eq(x, g->outputs[0]);
  ck_assert_int_eq(x, g->outputs[1]);
  ck_assert_int_eq(x, g->outputs[2]);
  ck_assert_int_eq(OP_SLICE, out_node(3)->op);
  ck_assert_int_eq(OP_SLICE, out_node(4)->op);
  ck_assert_int_eq(OP_EXPAND, out_node(5)->op);
  ck_assert_int_eq(OP_COPY, out_node(6)->op);
}
END_TEST

START_TEST(test_chain_through_rewrites)
{
  /* x*1 exposes neg(neg), which exposes cast to own type ... */
  int x = input(KILN_F64, DIMS(C(3)));
  int a = OP1(OP_NEG, x);
  int b = OP2(OP_MUL, a, scalar_f64(1));
  int c = OP1(OP_NEG, b);
  int d = cast(c, KILN_F64);
  output(OP2(OP_ADD, d, scalar_f64(0)));
  pass(pass_simplify);
  ck_assert_int_eq(x, g->outputs[0]);
}
END_TEST

START_TEST(test_writes_follow_rewrites)
{
  int a = input(KILN_F32, DIMS(C(4)));
  int b = input(KILN_F32, DIMS(C(4)));
  int w = param(KILN_F32, DIMS(C(4)));
  write_data(a, OP2(OP_ADD, b, scalar_f32(0)));
  write_grad(w, OP2(OP_MUL, b, scalar_f32(1)));
  write_grad(a, -1);
  output(OP1(OP_NEG, OP1(OP_NEG, a)));
  pipeline();
  ck_assert_int_eq(3, g->n_nodes); /* only the leaves */
  ck_assert_int_eq(a, g->outputs[0]);
  ck_assert_int_eq(a, g->writes[0].target);
  ck_assert_int_eq(b, g->writes[0].value);
  ck_assert_int_eq(w, g->writes[1].target);
  ck_assert_int_eq(b, g->writes[1].value);
  ck_assert_int_eq(-1, g->writes[2].value);
}
END_TEST

/* ---- fold ---- */

START_TEST(test_fold_constants)
{
  int x = input(KILN_F32, DIMS(C(3)));
  int c1 = vec_f32(3, (float[]){1, 2, 3}), c2 = vec_f32(3, (float[]){10, 20, 30});
  int sum = OP2(OP_ADD, c1, c2);
  output(OP2(OP_MUL, x, OP1(OP_NEG, sum)));
  pass(pass_fold);
  pass(pass_dce);
  ck_assert_int_eq(OP_MUL, out_node(0)->op);
  const ir_node *k = &g->nodes[out_node(0)->in[1]];
  ck_assert_int_eq(IR_CONST, k->op);
  ck_assert_int_eq(KILN_F32, k->dtype);
  ck_assert_int_eq(1, k->ndim);
  ck_assert_int_eq(3, k->shape[0].c);
  const float *v = k->data;
  ck_assert_float_eq(-11, v[0]);
  ck_assert_float_eq(-22, v[1]);
  ck_assert_float_eq(-33, v[2]);
  ck_assert_int_eq(2, count(IR_CONST) + count(IR_INPUT)); /* x and the folded constant */
}
END_TEST

START_TEST(test_fold_keeps_file_line)
{
  int c1 = vec_f32(2, (float[]){1, 2});
  int line = __LINE__ + 1;
  int e = OP1(OP_EXP, c1);
  output(e);
  pass(pass_fold);
  ck_assert_int_eq(IR_CONST, out_node(0)->op);
  ck_assert_int_eq(line, out_node(0)->line);
  ck_assert_str_eq("t.c", out_node(0)->file);
}
END_TEST

START_TEST(test_fold_views_row_major)
{
  int c = konst(KILN_F64, 2, (int64_t[]){2, 3}, (double[]){1, 2, 3, 4, 5, 6});
  int t = OPA(OP_PERMUTE, c, .perm = {1, 0});
  output(t);
  output(OPA(OP_SLICE, t, .dim = 0, .start = C(1), .end = C(3), .step = 1));
  output(OPA(OP_SUM, c, .naxes = 1, .axes = {1}));
  pass(pass_fold);
  static const double want_t[] = {1, 4, 2, 5, 3, 6}, want_s[] = {2, 5, 3, 6}, want_r[] = {6, 15};
  ck_assert_int_eq(IR_CONST, out_node(0)->op);
  ck_assert_int_eq(IR_CONST, out_node(1)->op);
  ck_assert_int_eq(IR_CONST, out_node(2)->op);
  ck_assert_mem_eq(want_t, out_node(0)->data, sizeof want_t);
  ck_assert_mem_eq(want_s, out_node(1)->data, sizeof want_s);
  ck_assert_mem_eq(want_r, out_node(2)->data, sizeof want_r);
}
END_TEST

START_TEST(test_fold_limits)
{
  static float big[4097];
  for (int i = 0; i < 4097; i++) big[i] = (float)i;
  int x = input0(KILN_F32);
  output(OP1(OP_NEG, vec_f32(4096, big)));
  output(OP1(OP_NEG, vec_f32(4097, big))); /* too big to fold */
  output(OP2(OP_ADD, x, scalar_f32(2))); /* not all constant */
  /* fails when run (index out of range): stays, the runtime reports it */
  int64_t idx = 7;
  output(make(OP_INDEX_SELECT, 2, (int[]){vec_f32(3, big), konst(KILN_I64, 1, (int64_t[]){1}, &idx)},
              &(op_attrs){.dim = 0}, __LINE__, false));
  pass(pass_fold);
  ck_assert_int_eq(IR_CONST, out_node(0)->op);
  ck_assert_int_eq(OP_NEG, out_node(1)->op);
  ck_assert_int_eq(OP_ADD, out_node(2)->op);
  ck_assert_int_eq(OP_INDEX_SELECT, out_node(3)->op);
}
END_TEST

START_TEST(test_fold_symbolic_stays)
{
  sym_dim s0 = SYM(1, 8);
  int x = input(KILN_F32, DIMS(s0));
  int c = vec_f32(1, (float[]){3});
  /* constant input, but a symbolic target: not foldable */
  output(OPA(OP_EXPAND, c, .ndim = 1, .shape = {s0}));
  output(x);
  pass(pass_fold);
  ck_assert_int_eq(OP_EXPAND, out_node(0)->op);
}
END_TEST

/* Casts of scalars fold, and then the identities show: x * cast(1.0) is x. */
START_TEST(test_pipeline_fold_then_simplify)
{
  int x = input(KILN_F32, DIMS(C(4)));
  output(OP2(OP_MUL, x, cast(scalar_f64(1), KILN_F32)));
  output(OP2(OP_ADD, x, cast(OP2(OP_SUB, scalar_f64(2), scalar_f64(2)), KILN_F32)));
  pipeline();
  ck_assert_int_eq(x, g->outputs[0]);
  ck_assert_int_eq(x, g->outputs[1]);
  ck_assert_int_eq(1, g->n_nodes);
}
END_TEST

/* ---- cse and dce ---- */

/* ---- accumulate ---- */

/* x + index_add(zeros, 0, idx, src) becomes index_add_to(x, 0, idx, src);
 * not over -0 zeros (x + -0 keeps a -0 that x + 0 would not), nor where
 * the index_add has another reader; over a transposed GEMM-like x the
 * rows go into M's columns (dim 1), read back through a permute. */
static int rows_into(int zero, int idx, int src) {
  int z = OPA(OP_EXPAND, zero, .ndim = 2, .shape = {C(5), C(3)});
  return make(OP_INDEX_ADD, 3, (int[]){z, idx, src}, &(op_attrs){.dim = 0}, __LINE__, false);
}

START_TEST(test_accumulate_rules)
{
  int x = input(KILN_F32, DIMS(C(5), C(3))), idx = input(KILN_I64, DIMS(C(4))), m = input(KILN_F32, DIMS(C(3), C(5)));
  int src[4];
  for (int i = 0; i < 4; i++) src[i] = input(KILN_F32, DIMS(C(4), C(3)));
  int plus = scalar_f32(0), minus = scalar_f32(-0.0f);
  output(OP2(OP_ADD, x, rows_into(plus, idx, src[0])));  /* 0: taken */
  output(OP2(OP_ADD, rows_into(minus, idx, src[1]), x)); /* 1: -0 zeros: kept */
  int shared = rows_into(plus, idx, src[2]);
  output(OP2(OP_ADD, x, shared)); /* 2: the rows read again: kept */
  output(shared);
  int xt = OP1(OP_COPY, OPA(OP_PERMUTE, m, .perm = {1, 0}));
  output(OP1(OP_NEG, OP2(OP_ADD, xt, rows_into(plus, idx, src[3])))); /* 4: transposed */
  pass(pass_accumulate);
  ck_assert_int_eq(OP_INDEX_ADD_TO, out_node(0)->op);
  ck_assert_int_eq(x, out_node(0)->in[0]);
  ck_assert_int_eq(OP_ADD, out_node(1)->op);
  ck_assert_int_eq(OP_ADD, out_node(2)->op);
  const ir_node *back = &g->nodes[out_node(4)->in[0]];
  ck_assert_int_eq(OP_PERMUTE, back->op);
  const ir_node *into = &g->nodes[back->in[0]];
  ck_assert_int_eq(OP_INDEX_ADD_TO, into->op);
  ck_assert_int_eq(1, into->attrs.dim);
  ck_assert_int_eq(m, into->in[0]);
  ck_assert_int_eq(OP_PERMUTE, g->nodes[into->in[2]].op);
}
END_TEST

START_TEST(test_cse_merges)
{
  int x = input(KILN_F32, DIMS(C(4)));
  int y = input(KILN_F32, DIMS(C(4)));
  int a1 = make(OP_ADD, 2, (int[]){x, y}, NULL, 1, true);
  int a2 = make(OP_ADD, 2, (int[]){x, y}, NULL, 2, true);
  int e1 = make(OP_EXP, 1, (int[]){a1}, NULL, 3, true);
  int e2 = make(OP_EXP, 1, (int[]){a2}, NULL, 4, true);
  output(e1);
  output(e2);
  ck_assert_int_ne(e1, e2);
  pass(pass_cse);
  ck_assert_int_eq(4, g->n_nodes);
  ck_assert_int_eq(g->outputs[0], g->outputs[1]);
  ck_assert_int_eq(OP_EXP, out_node(0)->op);
  ck_assert_int_eq(3, out_node(0)->line); /* the first one's location */
}
END_TEST

START_TEST(test_dce_keeps_leaves)
{
  int x = input(KILN_F32, DIMS(C(4)));
  int unused = input(KILN_F32, DIMS(C(4)));
  int p = param(KILN_F32, DIMS(C(4)));
  int gp = grad_of(p);
  int dead = OP1(OP_EXP, x);
  OP1(OP_LOG, dead);
  vec_f32(2, (float[]){1, 2});
  int live = OP2(OP_ADD, x, p);
  int w = OP2(OP_MUL, x, x);
  output(live);
  write_data(p, w);
  (void)unused, (void)gp;
  ck_assert_int_eq(9, g->n_nodes);
  pass(pass_dce);
  ck_assert_int_eq(6, g->n_nodes);
  ck_assert_int_eq(2, count(IR_INPUT));
  ck_assert_int_eq(1, count(IR_PARAM));
  ck_assert_int_eq(1, count(IR_GRAD));
  ck_assert_int_eq(0, count(IR_CONST));
  ck_assert_int_eq(0, count(OP_EXP));
  ck_assert_int_eq(OP_ADD, out_node(0)->op);
  ck_assert_int_eq(OP_MUL, g->nodes[g->writes[0].value].op);
  ck_assert_int_eq(2, g->writes[0].target);
  /* nothing to drop: the same graph back */
  ir_graph *before = g;
  pass(pass_dce);
  ck_assert_ptr_eq(before, g);
}
END_TEST

/* ---- the pipeline against the interpreter ---- */

/* x:(s0,3) f32, w:(3) f32 param; identities, foldable constants, a dead
 * branch, duplicates and a write to w. */
static void build_mixed(void) {
  sym_dim s0 = SYM(1, 1024);
  int x = input(KILN_F32, DIMS(s0, C(3)));
  int w = param(KILN_F32, DIMS(C(3)));
  int one = cast(scalar_f64(1), KILN_F32);
  int k = OP2(OP_MUL, vec_f32(3, (float[]){1, 2, 3}), vec_f32(3, (float[]){0.5f, 0.25f, 2}));
  int y = OP2(OP_ADD, OP2(OP_MUL, x, one), k);
  int t = OPA(OP_PERMUTE, OPA(OP_PERMUTE, y, .perm = {1, 0}), .perm = {1, 0});
  sym_dim flat = sym_mul(g->sym, s0, C(3));
  int r = OPA(OP_RESHAPE, OPA(OP_RESHAPE, t, .ndim = 1, .shape = {flat}), .ndim = 2, .shape = {s0, C(3)});
  int z = OP2(OP_SUB, r, OP1(OP_NEG, OP1(OP_NEG, w)));
  int z2 = make(OP_SUB, 2, (int[]){r, OP1(OP_NEG, OP1(OP_NEG, w))}, NULL, 77, true); /* a duplicate */
  OP1(OP_EXP, z); /* dead */
  output(OP1(OP_TANH, z));
  output(OPA(OP_SUM, z2, .naxes = 1, .axes = {0}));
  write_data(w, OP2(OP_MUL, w, cast(OP2(OP_ADD, scalar_f64(1), scalar_f64(1)), KILN_F32)));
}

static void run_interp(const float *xv, int64_t rows, float out0[], float out1[], float w_after[]) {
  kiln_tensor *x = kiln_tensor_from(KILN_F32, 2, ((int64_t[]){rows, 3}), xv);
  kiln_tensor *w = kiln_tensor_from(KILN_F32, 1, ((int64_t[]){3}), ((float[]){0.5f, -1, 4}));
  kiln_tensor *out[2] = {0};
  ck_assert_msg(interp_run(g, &x, &w, out) == 0, "%s", kiln_last_error());
  ck_assert_int_eq(0, kiln_read(out[0], out0, sizeof(float) * (size_t)rows * 3));
  ck_assert_int_eq(0, kiln_read(out[1], out1, sizeof(float) * 3));
  ck_assert_int_eq(0, kiln_read(w, w_after, sizeof(float) * 3));
  kiln_release(out[0]);
  kiln_release(out[1]);
  kiln_release(x);
  kiln_release(w);
}

START_TEST(test_pipeline_same_numbers)
{
  build_mixed();
  int before = g->n_nodes;
  const int64_t rows = 5;
  float xv[15];
  for (int i = 0; i < 15; i++) xv[i] = (float)(i % 7) * 0.3f - 1;
  float a0[15], a1[3], aw[3], b0[15], b1[3], bw[3];
  run_interp(xv, rows, a0, a1, aw);
  pipeline();
  run_interp(xv, rows, b0, b1, bw);
  for (int i = 0; i < 15; i++) ck_assert_msg(a0[i] == b0[i], "out0[%d]: %g != %g", i, (double)a0[i], (double)b0[i]);
  for (int i = 0; i < 3; i++) {
    ck_assert_msg(a1[i] == b1[i], "out1[%d]: %g != %g", i, (double)a1[i], (double)b1[i]);
    ck_assert_msg(aw[i] == bw[i], "w[%d]: %g != %g", i, (double)aw[i], (double)bw[i]);
  }
  /* what is left: x, w, the folded vector, add, sub, tanh, sum, the write's mul and its folded 2 */
  ck_assert_int_lt(g->n_nodes, before);
  ck_assert_int_eq(0, count(OP_PERMUTE));
  ck_assert_int_eq(0, count(OP_RESHAPE));
  ck_assert_int_eq(0, count(OP_NEG));
  ck_assert_int_eq(0, count(OP_CAST));
  ck_assert_int_eq(0, count(OP_EXP));
  ck_assert_int_eq(1, count(OP_SUB));
  ck_assert_int_eq(2, count(IR_CONST));
  ck_assert_int_eq(9, g->n_nodes);
}
END_TEST

/* ---- the verifier ---- */

static void v_use_before_def(void) {
  input(KILN_F32, DIMS(C(4)));
  raw(OP_NEG, KILN_F32, DIMS(C(4)), 1, (int[]){1});
}
static void v_leaf_after_op(void) {
  int x = input(KILN_F32, DIMS(C(4)));
  OP1(OP_NEG, x);
  input(KILN_F32, DIMS(C(4)));
}
static void v_input_index(void) {
  ir_node n = {.op = IR_INPUT, .dtype = KILN_F32, .index = 1};
  ir_append(g, &n);
}
static void v_input_count(void) {
  input(KILN_F32, DIMS(C(4)));
  g->n_inputs = 2;
}
static void v_grad_of_grad(void) {
  int p = param(KILN_F32, DIMS(C(4)));
  int gp = grad_of(p);
  grad_of(gp);
}
static void v_grad_shape(void) {
  int p = param(KILN_F32, DIMS(C(4)));
  raw(IR_GRAD, KILN_F32, DIMS(C(5)), 1, &p);
}
static void v_arity(void) {
  int x = input(KILN_F32, DIMS(C(4)));
  raw(OP_ADD, KILN_F32, DIMS(C(4)), 1, &x);
}
static void v_cat_empty(void) { raw(OP_CAT, KILN_F32, DIMS(C(4)), 0, NULL); }
static void v_const_symbolic(void) {
  sym_dim s0 = SYM(1, 4);
  int id = konst(KILN_F32, 0, NULL, (float[]){1});
  g->nodes[id].ndim = 1;
  g->nodes[id].shape[0] = s0;
}
static void v_const_no_data(void) {
  int id = scalar_f32(1);
  g->nodes[id].data = NULL;
}
static void v_undeclared_symbol(void) {
  sym_dim s2 = sym_var(g->sym, 2, 1, 10);
  input(KILN_F32, DIMS(s2));
}
static void v_negative_dim(void) { input(KILN_F32, DIMS(C(-1))); }
static void v_unknown_op(void) { raw(999, KILN_F32, DIMS(C(1)), 0, NULL); }
static void v_dtype(void) {
  int x = input(KILN_F32, DIMS(C(4))), y = input(KILN_F32, DIMS(C(4)));
  raw(OP_ADD, KILN_F64, DIMS(C(4)), 2, (int[]){x, y});
}
static void v_rank(void) {
  int x = input(KILN_F32, DIMS(C(4))), y = input(KILN_F32, DIMS(C(4)));
  raw(OP_ADD, KILN_F32, DIMS(C(1), C(4)), 2, (int[]){x, y});
}
static void v_dim(void) {
  int x = input(KILN_F32, DIMS(C(4))), y = input(KILN_F32, DIMS(C(1)));
  raw(OP_ADD, KILN_F32, DIMS(C(5)), 2, (int[]){x, y});
}
static void v_symbolic_dim(void) {
  sym_dim s0 = SYM(1, 100);
  int x = input(KILN_F32, DIMS(s0));
  raw(OP_NEG, KILN_F32, DIMS(sym_add(g->sym, s0, C(1))), 1, &x);
}
static void v_rule_fails(void) {
  int x = input(KILN_F32, DIMS(C(3))), y = input(KILN_F32, DIMS(C(4)));
  raw(OP_ADD, KILN_F32, DIMS(C(4)), 2, (int[]){x, y});
}
static void v_reshape_numel(void) {
  int x = input(KILN_F32, DIMS(C(6)));
  ir_node n = {.op = OP_RESHAPE, .dtype = KILN_F32, .ndim = 1, .shape = {C(4)}, .n_in = 1, .in = &x,
               .attrs = {.ndim = 1, .shape = {C(4)}}};
  ir_append(g, &n);
}
static void v_output_range(void) {
  input(KILN_F32, DIMS(C(4)));
  output(5);
}
static void v_write_target(void) {
  int x = input(KILN_F32, DIMS(C(4)));
  write_data(OP1(OP_NEG, x), x);
}
static void v_write_value(void) {
  int x = input(KILN_F32, DIMS(C(4))), y = input(KILN_F32, DIMS(C(5)));
  write_data(x, y);
}
static void v_grad_write_value(void) {
  int p = param(KILN_F32, DIMS(C(4)));
  write_grad(p, cast(p, KILN_F64));
}
static void v_guard(void) {
  sym_dim s0 = SYM(1, 100);
  sym_dim s3 = sym_var(g->sym, 3, 1, 10);
  ck_assert_int_eq(0, ir_add_guard(g, (sym_guard){SYM_EQ, s0, s3}));
}

START_TEST(test_verify_rejects)
{
  static const struct {
    void (*build)(void);
    const char *want; /* a prefix of the message */
  } cases[] = {
      {v_use_before_def, "%1: neg: input 0 is %1, which is not defined before it"},
      {v_leaf_after_op, "%2: input: leaf after %1, which is not a leaf"},
      {v_input_index, "%0: input: index 1, expected 0"},
      {v_input_count, "graph: 1 inputs and 0 params, but the counts say 2 and 0"},
      {v_grad_of_grad, "%2: grad: %1 is a grad, not a param or input"},
      {v_grad_shape, "%1: grad: dtype or shape differs from its leaf %0"},
      {v_arity, "%1: add: takes 2 inputs, has 1"},
      {v_cat_empty, "%0: cat: needs at least one input"},
      {v_const_symbolic, "%0: const: shape is not concrete"},
      {v_const_no_data, "%0: const: no data"},
      {v_undeclared_symbol, "%0: input: dim 0 uses s2, which is not declared (0 symbols)"},
      {v_negative_dim, "%0: input: dim 0 is negative (-1)"},
      {v_unknown_op, "%0: unknown op 999"},
      {v_dtype, "%2: add: dtype f64, but the rule gives f32"},
      {v_rank, "%2: add: rank 2, but the rule gives 1"},
      {v_dim, "%2: add: dim 0 is 5, but the rule gives 4"},
      {v_symbolic_dim, "%1: neg: dim 0 is s0 + 1, but the rule gives s0"},
      {v_rule_fails, "%2: add: shapes [3] and [4] do not broadcast"},
      {v_reshape_numel, "%1: reshape: cannot reshape"},
      {v_output_range, "output 0: %5 is not a node"},
      {v_write_target, "write 0: target %1 is a neg, not an input or param"},
      {v_write_value, "write 0: value %1 differs from target %0 in dtype or shape"},
      {v_grad_write_value, "write 0: value %1 differs from target %0 in dtype or shape"},
      {v_guard, "guard 0: uses s3, which is not declared (1 symbols)"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ir_free(g);
    g = ir_new("bad");
    cases[i].build();
    err[0] = '\0';
    ck_assert_msg(ir_verify(g, err, sizeof err) == -1, "case %zu (%s) was accepted", i, cases[i].want);
    ck_assert_msg(strncmp(err, cases[i].want, strlen(cases[i].want)) == 0, "case %zu: want '%s', got '%s'", i,
                  cases[i].want, err);
  }
}
END_TEST

START_TEST(test_verify_accepts)
{
  verify_ok(); /* empty */
  build_mixed();
  verify_ok();
  /* grads of inputs and params, grad writes to NULL, a guard-decided broadcast */
  ir_free(g);
  g = ir_new("ok");
  sym_dim s0 = SYM(2, 100), s1 = SYM(2, 100);
  int x = input(KILN_F32, DIMS(s0));
  int y = input(KILN_F32, DIMS(s1));
  int p = param(KILN_F64, DIMS(C(2), s0));
  int gx = grad_of(x);
  grad_of(p);
  ck_assert_int_eq(0, ir_add_guard(g, (sym_guard){SYM_EQ, s0, s1}));
  int a = OP2(OP_ADD, x, y); /* decided by the guard */
  ck_assert(sym_same(s0, g->nodes[a].shape[0]));
  output(a);
  output(OP2(OP_MUL, a, gx));
  write_grad(p, -1);
  write_grad(x, a);
  write_data(x, OP1(OP_NEG, a));
  verify_ok();
  /* without the guard the bounds cannot decide s0 == s1: accepted (the runtime checks it) */
  g->n_guards = 0;
  verify_ok();
}
END_TEST

/* Text the parser accepts is not always a sound graph (kiln_load verifies
 * what it reads): mutated golden inputs never crash the verifier, and every
 * graph it accepts goes through the pipeline and still verifies. */
static uint64_t rng = 88172645463325252ull;
static uint64_t rnd(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}

static char *golden_inputs(size_t *len) {
  char dir[4096];
  snprintf(dir, sizeof dir, "%s", __FILE__);
  char *slash = strrchr(dir, '/');
  ck_assert_ptr_nonnull(slash);
  snprintf(slash, sizeof dir - (size_t)(slash - dir), "/ir");
  DIR *d = opendir(dir);
  ck_assert_msg(d != NULL, "cannot open %s", dir);
  char *all = calloc(1, 1);
  *len = 0;
  for (struct dirent *e; (e = readdir(d));) {
    size_t n = strlen(e->d_name);
    if (n < 4 || strcmp(e->d_name + n - 3, ".ir")) continue;
    char path[8192];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    FILE *f = fopen(path, "rb");
    ck_assert_ptr_nonnull(f);
    char buf[1 << 16];
    size_t k = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[k] = '\0';
    char *mark = strstr(buf, ";---- pipeline");
    if (mark) *mark = '\0';
    /* the graph lines only: a flip inside a comment tests nothing */
    all = realloc(all, *len + strlen(buf) + 2);
    for (char *line = strtok(buf, "\n"); line; line = strtok(NULL, "\n")) {
      if (line[0] == ';') continue;
      k = strlen(line);
      memcpy(all + *len, line, k);
      all[*len + k] = '\n';
      *len += k + 1;
    }
    all[(*len)++] = '\0'; /* texts separated by NULs */
  }
  closedir(d);
  return all;
}

START_TEST(test_verify_hostile)
{
  size_t len;
  char *all = golden_inputs(&len);
  static const char alphabet[] = "0123456789%,[]()s+-*fi:=\n ";
  int parsed = 0, accepted = 0;
  for (const char *text = all; text < all + len; text += strlen(text) + 1) {
    size_t n = strlen(text);
    char *m = malloc(n + 1);
    for (int it = 0; it < 4000 && n; it++) {
      memcpy(m, text, n + 1);
      for (int k = 1 + (int)(rnd() % 3); k > 0; k--) m[rnd() % n] = alphabet[rnd() % (sizeof alphabet - 1)];
      ir_graph *x = ir_parse(m, err, sizeof err);
      if (!x) continue;
      parsed++;
      if (ir_verify(x, err, sizeof err) == 0) {
        accepted++;
        x = pass_pipeline(x, err, sizeof err);
        ck_assert_msg(x != NULL, "pipeline failed on a verified graph: %s\n%s", err, m);
        ck_assert_msg(ir_verify(x, err, sizeof err) == 0, "%s\n%s", err, m);
      }
      ir_free(x);
    }
    free(m);
  }
  free(all);
  ck_assert_int_gt(parsed, 100);
  ck_assert_int_gt(accepted, 10);
}
END_TEST

/* ---- out of memory ---- */

#ifdef KILN_TEST_BUILD
START_TEST(test_pipeline_out_of_memory)
{
  build_mixed();
  pipeline();
  int want_nodes = g->n_nodes;
  int failed = 0, n;
  for (n = 1; n < 100000; n++) {
    ir_free(g);
    g = ir_new("oom");
    build_mixed();
    alloc_fail_after(n);
    ir_graph *r = pass_pipeline(g, err, sizeof err);
    alloc_fail_after(0);
    g = r;
    if (r) break;
    ck_assert_msg(err[0], "n=%d: NULL without a message", n);
    failed++;
  }
  ck_assert_ptr_nonnull(g);
  verify_ok();
  ck_assert_int_eq(want_nodes, g->n_nodes);
  ck_assert_int_gt(failed, 20);
}
END_TEST
#endif

static Suite *passes_suite(void) {
  Suite *s = suite_create("passes");
  TCase *tc = tcase_create("passes");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_mul_one_add_zero);
  tcase_add_test(tc, test_identities_that_stay);
  tcase_add_test(tc, test_integer_identities);
  tcase_add_test(tc, test_neg_neg);
  tcase_add_test(tc, test_cast_to_own_type);
  tcase_add_test(tc, test_permute_of_permute);
  tcase_add_test(tc, test_reshape_chains);
  tcase_add_test(tc, test_identity_views);
  tcase_add_test(tc, test_chain_through_rewrites);
  tcase_add_test(tc, test_writes_follow_rewrites);
  tcase_add_test(tc, test_fold_constants);
  tcase_add_test(tc, test_fold_keeps_file_line);
  tcase_add_test(tc, test_fold_views_row_major);
  tcase_add_test(tc, test_fold_limits);
  tcase_add_test(tc, test_fold_symbolic_stays);
  tcase_add_test(tc, test_pipeline_fold_then_simplify);
  tcase_add_test(tc, test_accumulate_rules);
  tcase_add_test(tc, test_cse_merges);
  tcase_add_test(tc, test_dce_keeps_leaves);
  tcase_add_test(tc, test_pipeline_same_numbers);
  tcase_add_test(tc, test_verify_rejects);
  tcase_add_test(tc, test_verify_accepts);
  tcase_add_test(tc, test_verify_hostile);
#ifdef KILN_TEST_BUILD
  tcase_add_test(tc, test_pipeline_out_of_memory);
#endif
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(passes_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
