/* The IR text form: graphs built by hand print, parse back to the same
 * fields and print again to the same bytes; hostile text (broken lines,
 * every truncation, random byte flips, allocation failures) gives an error
 * with its line and column, never a crash or a leak; and the golden files in
 * tests/ir/ round-trip (and, where they say so, match the pass pipeline). */
#include <check.h>
#include <dirent.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tracer/tracer.h"

static ir_graph *g;
static char err[256];

static void setup(void) { g = ir_new("test"); }
static void teardown(void) { ir_free(g); }

/* For hot loops: Check's passing asserts each write to a pipe. */
#define CHECK(cond, ...)                    \
  do {                                      \
    if (!(cond)) ck_abort_msg(__VA_ARGS__); \
  } while (0)

static uint64_t rng_state;
static uint64_t rnd(void)
{
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return rng_state >> 33;
}
static uint64_t rnd64(void) { return rnd() << 62 ^ rnd() << 31 ^ rnd(); }

/* ---- building graphs by hand ---- */

static sym_dim SYM(int64_t lo, int64_t hi)
{
  sym_dim d;
  ck_assert_int_eq(0, ir_add_sym(g, lo, hi, &d));
  return d;
}

/* "s0,4" -> dims, read with the graph's symbols. */
static int dims_of(const char *text, sym_dim *d)
{
  int n = 0;
  const char *p = text;
  while (*p) {
    ck_assert_int_lt(n, MAXD);
    const char *end;
    ck_assert_msg(0 == sym_parse(g->sym, p, &d[n++], &end, err, sizeof err), "'%s': %s", text, err);
    p = *end == ',' ? end + 1 : end;
  }
  return n;
}

static int add_node(ir_node *n, kiln_dtype dt, const char *shape, const char *file, int line)
{
  n->dtype = dt;
  n->ndim = dims_of(shape, n->shape);
  n->file = file;
  n->line = line;
  int id = ir_append(g, n);
  ck_assert_int_ge(id, 0);
  return id;
}

static int input(kiln_dtype dt, const char *shape)
{
  return add_node(&(ir_node){.op = IR_INPUT, .index = g->n_inputs}, dt, shape, "", 0);
}
static int param(kiln_dtype dt, const char *shape)
{
  return add_node(&(ir_node){.op = IR_PARAM, .index = g->n_params}, dt, shape, "", 0);
}
static int grad(int p)
{
  ir_node n = {.op = IR_GRAD, .n_in = 1, .in = &p};
  n.ndim = g->nodes[p].ndim;
  memcpy(n.shape, g->nodes[p].shape, sizeof n.shape);
  n.dtype = g->nodes[p].dtype;
  int id = ir_append(g, &n);
  ck_assert_int_ge(id, 0);
  return id;
}

/* op(in...) at t.c:line */
static int op_at(int op, kiln_dtype dt, const char *shape, const op_attrs *a, int line, int n_in, const int *in)
{
  ir_node n = {.op = op, .n_in = n_in, .in = (int *)in};
  if (a) n.attrs = *a;
  return add_node(&n, dt, shape, line ? "t.c" : "", line);
}
#define OP(op, dt, shape, a, line, ...) \
  op_at(op, dt, shape, a, line, (int)(sizeof((int[]){__VA_ARGS__}) / sizeof(int)), (int[]){__VA_ARGS__})

static int konst(kiln_dtype dt, const char *shape, const void *data)
{
  ir_node n = {.op = IR_CONST, .data = (void *)data};
  return add_node(&n, dt, shape, "c.c", 7);
}

static void output(int id) { ck_assert_int_eq(0, ir_add_output(g, id)); }
static void write_(ir_write_kind k, int target, int value, const char *file, int line)
{
  ck_assert_int_eq(0, ir_add_write(g, (ir_write){.kind = k, .target = target, .value = value, .file = file, .line = line}));
}
static void guard(const char *text)
{
  sym_guard gd;
  ck_assert_msg(0 == sym_guard_parse(g->sym, text, &gd, NULL, err, sizeof err), "%s: %s", text, err);
  ck_assert_int_eq(0, ir_add_guard(g, gd));
}

/* ---- comparing ---- */

static char *text_of(const ir_graph *x)
{
  char *t = ir_to_string(x);
  ck_assert_ptr_nonnull(t);
  return t;
}

static const char *dim_text(sym_dim d, char *buf)
{
  ck_assert_int_lt(sym_print(d, buf, 256), 256);
  return buf;
}

static void same_dims(int n, const sym_dim *a, const sym_dim *b, int id)
{
  char x[256], y[256];
  for (int i = 0; i < n; i++)
    ck_assert_msg(!strcmp(dim_text(a[i], x), dim_text(b[i], y)), "%%%d dim %d: %s vs %s", id, i, x, y);
}

/* Equal as the text form carries them: leaves' source locations are not in it. */
static bool same_value(const ir_node *n, const void *a, const void *b, int64_t i)
{
  size_t sz = kiln_dtype_size(n->dtype);
  const char *pa = (const char *)a + (size_t)i * sz, *pb = (const char *)b + (size_t)i * sz;
  if (n->dtype == KILN_F32 && isnan(*(const float *)pa))
    return isnan(*(const float *)pb) && signbit(*(const float *)pa) == signbit(*(const float *)pb);
  if (n->dtype == KILN_F64 && isnan(*(const double *)pa))
    return isnan(*(const double *)pb) && signbit(*(const double *)pa) == signbit(*(const double *)pb);
  return !memcmp(pa, pb, sz);
}

static void same_graph(const ir_graph *a, const ir_graph *b)
{
  ck_assert_str_eq(a->name, b->name);
  ck_assert_int_eq(a->n_syms, b->n_syms);
  for (int i = 0; i < a->n_syms; i++) {
    ck_assert_int_eq(a->sym_lo[i], b->sym_lo[i]);
    ck_assert_int_eq(a->sym_hi[i], b->sym_hi[i]);
  }
  ck_assert_int_eq(a->n_nodes, b->n_nodes);
  ck_assert_int_eq(a->n_inputs, b->n_inputs);
  ck_assert_int_eq(a->n_params, b->n_params);
  for (int id = 0; id < a->n_nodes; id++) {
    const ir_node *x = &a->nodes[id], *y = &b->nodes[id];
    ck_assert_int_eq(x->op, y->op);
    ck_assert_int_eq(x->dtype, y->dtype);
    ck_assert_int_eq(x->ndim, y->ndim);
    same_dims(x->ndim, x->shape, y->shape, id);
    ck_assert_int_eq(x->n_in, y->n_in);
    for (int j = 0; j < x->n_in; j++) ck_assert_int_eq(x->in[j], y->in[j]);
    ck_assert_int_eq(x->index, y->index);
    const op_attrs *p = &x->attrs, *q = &y->attrs;
    switch (x->op) {
    case OP_SUM:
    case OP_MEAN:
    case OP_MAX:
    case OP_MIN:
    case OP_ARGMAX:
      ck_assert_int_eq(p->naxes, q->naxes);
      ck_assert_int_eq(0, memcmp(p->axes, q->axes, sizeof(int) * (size_t)p->naxes));
      ck_assert_int_eq(p->keepdim, q->keepdim);
      break;
    case OP_RESHAPE:
    case OP_EXPAND:
      ck_assert_int_eq(p->ndim, q->ndim);
      same_dims(p->ndim, p->shape, q->shape, id);
      break;
    case OP_PERMUTE: ck_assert_int_eq(0, memcmp(p->perm, q->perm, sizeof p->perm)); break;
    case OP_SLICE:
    case OP_SLICE_SCATTER:
      same_dims(1, &p->start, &q->start, id);
      same_dims(1, &p->end, &q->end, id);
      ck_assert_int_eq(p->step, q->step);
      /* fallthrough */
    case OP_CAT:
    case OP_INDEX_SELECT:
    case OP_INDEX_ADD: ck_assert_int_eq(p->dim, q->dim); break;
    case OP_CAST: ck_assert_int_eq(p->dtype, q->dtype); break;
    case IR_NUMEL:
      ck_assert_int_eq(p->naxes, q->naxes);
      ck_assert_int_eq(0, memcmp(p->axes, q->axes, sizeof(int) * (size_t)p->naxes));
      same_dims(1, &p->start, &q->start, id);
      break;
    default: break;
    }
    if (x->op == IR_CONST) {
      int64_t k = ir_node_numel_const(x);
      for (int64_t i = 0; i < k; i++)
        ck_assert_msg(same_value(x, x->data, y->data, i), "%%%d value %lld", id, (long long)i);
    }
    if (x->op < IR_INPUT || x->op > IR_GRAD) {
      ck_assert_str_eq(x->file, y->file);
      ck_assert_int_eq(x->line, y->line);
    }
  }
  ck_assert_int_eq(a->n_outputs, b->n_outputs);
  for (int i = 0; i < a->n_outputs; i++) ck_assert_int_eq(a->outputs[i], b->outputs[i]);
  ck_assert_int_eq(a->n_writes, b->n_writes);
  for (int i = 0; i < a->n_writes; i++) {
    const ir_write *x = &a->writes[i], *y = &b->writes[i];
    ck_assert_int_eq(x->kind, y->kind);
    ck_assert_int_eq(x->target, y->target);
    ck_assert_int_eq(x->value, y->value);
    ck_assert_str_eq(x->file, y->file);
    ck_assert_int_eq(x->line, y->line);
  }
  ck_assert_int_eq(a->n_guards, b->n_guards);
  for (int i = 0; i < a->n_guards; i++) {
    char x[256], y[256];
    sym_guard_print(&a->guards[i], x, sizeof x);
    sym_guard_print(&b->guards[i], y, sizeof y);
    ck_assert_str_eq(x, y);
  }
}

/* print, parse, same fields, print again: the same bytes. Returns the text (free it). */
static char *round_trip(const ir_graph *x)
{
  char *t1 = text_of(x);
  ir_graph *y = ir_parse(t1, err, sizeof err);
  ck_assert_msg(y != NULL, "%s\n--- in ---\n%s", err, t1);
  same_graph(x, y);
  char *t2 = text_of(y);
  ck_assert_str_eq(t1, t2);
  alloc_free(t2);
  ir_free(y);
  return t1;
}

/* parse(text) prints as text exactly. */
static void assert_canonical(const char *text)
{
  ir_graph *y = ir_parse(text, err, sizeof err);
  ck_assert_msg(y != NULL, "%s\n--- in ---\n%s", err, text);
  char *t = text_of(y);
  ck_assert_str_eq(text, t);
  alloc_free(t);
  ir_free(y);
}

/* ---- cases ---- */

static const char mlp_text[] = "graph mlp(%0: f32[s0,1024], %1: f32[1024,4096] @param, %2: f32[4096] @param, %3: "
                               "f32[1024,4096] @grad(%1)) -> (%6, %2)\n"
                               "  sym s0 in [1, 9223372036854775807]\n"
                               "  guards: s0 % 4 == 0, s0 >= 2\n"
                               "  %4: f32[s0,4096] = matmul(%0, %1)  # examples/mlp.c:41\n"
                               "  %5: f32[] = const(0x1p-1)  # examples/mlp.c:40\n"
                               "  %6: f32[s0,4096] = add(%4, %2)  # examples/mlp.c:41\n"
                               "  %7: f32[s0,4,1024] = reshape(%6) {shape=[s0,4,1024]}  # examples/mlp.c:43\n"
                               "  write %2 = %6  # examples/mlp.c:50\n"
                               "  grad %1 = %4\n"
                               "  grad %2 = none\n";

START_TEST(test_example)
{
  assert_canonical(mlp_text);
  ir_graph *x = ir_parse(mlp_text, err, sizeof err);
  ck_assert_ptr_nonnull(x);
  ck_assert_str_eq("mlp", x->name);
  ck_assert_int_eq(8, x->n_nodes);
  ck_assert_int_eq(1, x->n_inputs);
  ck_assert_int_eq(2, x->n_params);
  ck_assert_int_eq(IR_INPUT, x->nodes[0].op);
  ck_assert_int_eq(0, x->nodes[0].index);
  ck_assert_int_eq(IR_PARAM, x->nodes[2].op);
  ck_assert_int_eq(1, x->nodes[2].index);
  ck_assert_int_eq(IR_GRAD, x->nodes[3].op);
  ck_assert_int_eq(1, x->nodes[3].in[0]);
  ck_assert_int_eq(OP_MATMUL, x->nodes[4].op);
  ck_assert_str_eq("examples/mlp.c", x->nodes[4].file);
  ck_assert_int_eq(41, x->nodes[4].line);
  ck_assert_float_eq(0.5f, *(float *)x->nodes[5].data);
  ck_assert_int_eq(3, x->nodes[7].attrs.ndim);
  ck_assert_int_eq(2, x->n_outputs);
  ck_assert_int_eq(2, x->outputs[1]);
  ck_assert_int_eq(3, x->n_writes);
  ck_assert_int_eq(IR_WRITE_GRAD, x->writes[2].kind);
  ck_assert_int_eq(-1, x->writes[2].value);
  ck_assert_int_eq(2, x->n_guards);
  ck_assert_int_eq(SYM_DIVIDES, x->guards[0].op);
  ck_assert_int_eq(INT64_MAX, x->sym_hi[0]);
  ir_free(x);

  /* any spaces, comments, blank lines and CRLF read the same */
  const char *loose = "; a comment\n\n"
                      "graph   mlp ( %0 : f32 [ s0 , 1024 ] , %1: f32[1024,4096]   @param,%2: f32[4096] @param, %3: "
                      "f32[1024,4096] @grad( %1 ) ) -> ( %6 , %2 )\r\n"
                      "\t sym s0 in [ 1 , 9223372036854775807 ]\n"
                      "   ; another\n"
                      "guards:s0 % 4 == 0,s0>=2\n"
                      "%4: f32[s0,4096] = matmul( %0,%1 )   # examples/mlp.c:41   \n"
                      "%5: f32[] = const( 0x1p-1 )  # examples/mlp.c:40\n"
                      "      %6: f32[s0, 4096]=add(%4, %2)  # examples/mlp.c:41\n"
                      "%7: f32[s0,4,1024] = reshape(%6){ shape = [s0, 4, 1024] }  # examples/mlp.c:43\n"
                      "write %2 = %6  # examples/mlp.c:50\n"
                      "grad %1=%4\n"
                      "grad %2 = none";
  x = ir_parse(loose, err, sizeof err);
  ck_assert_msg(x != NULL, "%s", err);
  char *t = text_of(x);
  ck_assert_str_eq(mlp_text, t);
  alloc_free(t);
  ir_free(x);
}
END_TEST

START_TEST(test_leaves_and_outputs)
{
  int x = input(KILN_F32, "2,3"), w = param(KILN_F32, "3"), y = input(KILN_I64, ""), b = param(KILN_BOOL, "1");
  int gw = grad(w), gb = grad(b), gx = grad(x); /* an input's .grad too */
  int s = OP(OP_ADD, KILN_F32, "2,3", NULL, 5, x, w);
  output(s);
  output(x);
  output(s);
  output(gw);
  output(y);
  write_(IR_WRITE_GRAD, x, s, "", 0);
  write_(IR_WRITE_GRAD, b, gb, "", 0);
  char *t = round_trip(g);
  ck_assert_str_eq("graph test(%0: f32[2,3], %1: f32[3] @param, %2: i64[], %3: bool[1] @param, %4: f32[3] @grad(%1), "
                   "%5: bool[1] @grad(%3), %6: f32[2,3] @grad(%0)) -> (%7, %0, %7, %4, %2)\n"
                   "  %7: f32[2,3] = add(%0, %1)  # t.c:5\n"
                   "  grad %0 = %7\n"
                   "  grad %3 = %5\n",
                   t);
  alloc_free(t);
  (void)gx;

  /* no leaves, no outputs */
  ir_graph *e = ir_new("empty");
  t = round_trip(e);
  ck_assert_str_eq("graph empty() -> ()\n", t);
  alloc_free(t);
  ir_free(e);
}
END_TEST

START_TEST(test_names)
{
  snprintf(g->name, sizeof g->name, "my graph!x.1");
  char *t = text_of(g);
  ck_assert_str_eq("graph my_graph_x.1() -> ()\n", t);
  assert_canonical(t);
  alloc_free(t);
  ir_graph *y = ir_parse("graph 9lives() -> ()", err, sizeof err);
  ck_assert_ptr_null(y);
  snprintf(g->name, sizeof g->name, "9lives");
  t = text_of(g);
  ck_assert_str_eq("graph _lives() -> ()\n", t);
  alloc_free(t);
  /* 63 chars fit, 64 do not */
  char text[200];
  snprintf(text, sizeof text, "graph %.63s() -> ()\n",
           "abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyz");
  assert_canonical(text);
  snprintf(text, sizeof text, "graph %.64s() -> ()\n",
           "abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyz");
  ck_assert_ptr_null(ir_parse(text, err, sizeof err));
  ck_assert_str_eq("line 1, col 7: graph name longer than 63 chars", err);
}
END_TEST

START_TEST(test_consts)
{
  float f[] = {0.5f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 0x1p-149f, FLT_MAX, 3.14159f, 1e-40f};
  double d[] = {0x1p-1074, DBL_MAX, -1.0 / 3, NAN, DBL_MIN, -0.0};
  int64_t i[] = {INT64_MIN, -1, 0, INT64_MAX};
  unsigned char b[] = {1, 0, 1};
  float same[6] = {2.5f, 2.5f, 2.5f, 2.5f, 2.5f, 2.5f};
  float zeros[2] = {0.0f, -0.0f};
  double one = 1;
  int64_t seven[4] = {7, 7, 7, 7};
  unsigned char trues[3] = {1, 1, 1};
  konst(KILN_F32, "10", f);
  konst(KILN_F64, "2,3", d);
  konst(KILN_I64, "4", i);
  konst(KILN_BOOL, "3", b);
  konst(KILN_F32, "2,3", same);
  konst(KILN_F32, "2", zeros);
  konst(KILN_F64, "", &one);
  konst(KILN_I64, "2,2", seven);
  konst(KILN_BOOL, "1,3", trues);
  konst(KILN_F32, "0,3", NULL);
  konst(KILN_I64, "1,1,1", seven);
  /* NaNs with other payloads print alike, so read back as one value */
  uint32_t nan_bits[2] = {0x7fc00001u, 0x7fc00002u};
  konst(KILN_F32, "2", nan_bits);
  char *t = round_trip(g);
  ck_assert_str_eq(
      "graph test() -> ()\n"
      "  %0: f32[10] = const(0x1p-1, -0x0p+0, inf, -inf, nan, -nan, 0x1p-149, 0x1.fffffep+127, "
      "0x1.921fap+1, 0x1.16c2p-133)  # c.c:7\n"
      "  %1: f64[2,3] = const(0x0.0000000000001p-1022, 0x1.fffffffffffffp+1023, -0x1.5555555555555p-2, nan, "
      "0x1p-1022, -0x0p+0)  # c.c:7\n"
      "  %2: i64[4] = const(-9223372036854775808, -1, 0, 9223372036854775807)  # c.c:7\n"
      "  %3: bool[3] = const(1, 0, 1)  # c.c:7\n"
      "  %4: f32[2,3] = const(0x1.4p+1)  # c.c:7\n"
      "  %5: f32[2] = const(0x0p+0, -0x0p+0)  # c.c:7\n"
      "  %6: f64[] = const(0x1p+0)  # c.c:7\n"
      "  %7: i64[2,2] = const(7)  # c.c:7\n"
      "  %8: bool[1,3] = const(1)  # c.c:7\n"
      "  %9: f32[0,3] = const()  # c.c:7\n"
      "  %10: i64[1,1,1] = const(7)  # c.c:7\n"
      "  %11: f32[2] = const(nan)  # c.c:7\n",
      t);
  alloc_free(t);
}
END_TEST

/* The printer writes what glibc's "%a" writes, and every value reads back bit for bit. */
START_TEST(test_float_exact)
{
  enum { N = 4000 };
  double *d = malloc(sizeof *d * N);
  float *f = malloc(sizeof *f * N);
  rng_state = 12345;
  for (int i = 0; i < N; i++) {
    uint64_t u = rnd64();
    uint32_t v = (uint32_t)rnd64();
    if (i % 4 == 1) u &= 0x800fffffffffffffull; /* subnormals */
    if (i % 4 == 2) v &= 0x807fffffu;
    memcpy(&d[i], &u, 8);
    memcpy(&f[i], &v, 4);
  }
  konst(KILN_F64, "4000", d);
  konst(KILN_F32, "4000", f);
  char *t = text_of(g);
  /* token by token against snprintf */
  const char *p = strstr(t, "const(");
  for (int k = 0; k < 2; k++) {
    p += 6;
    for (int i = 0; i < N; i++) {
      char want[64], got[64];
      snprintf(want, sizeof want, "%a", k == 0 ? d[i] : (double)f[i]);
      size_t n = strcspn(p, ",)");
      snprintf(got, sizeof got, "%.*s", (int)n, p);
      CHECK(!strcmp(want, got), "value %d: want %s got %s", i, want, got);
      p += n + (p[n] == ',' ? 2 : 0);
    }
    p = strstr(p, "const(");
  }
  ir_graph *y = ir_parse(t, err, sizeof err);
  ck_assert_msg(y != NULL, "%s", err);
  for (int i = 0; i < N; i++) {
    CHECK(same_value(&g->nodes[0], d, y->nodes[0].data, i), "f64 %d: %a", i, d[i]);
    CHECK(same_value(&g->nodes[1], f, y->nodes[1].data, i), "f32 %d: %a", i, (double)f[i]);
  }
  alloc_free(t);
  ir_free(y);
  free(d);
  free(f);
}
END_TEST

/* Hand-written values: decimals, hex floats with more digits than fit (rounded
 * to nearest even), signs, exponents far out of range. */
START_TEST(test_float_reading)
{
  static const struct {
    const char *text;
    double want;
  } cases[] = {
      {"1.5", 1.5},
      {"-2", -2.0},
      {"1e-3", 1e-3},
      {".25", 0.25},
      {"+7", 7.0},
      {"-0", -0.0},
      {"0x1.8p1", 3.0},
      {"0X1P-2", 0.25},
      {"0x.8", 0.5},
      {"0x10", 16.0},
      {"0x1.00000000000008p0", 1.0},                     /* tie: to even */
      {"0x1.00000000000018p0", 0x1.0000000000002p0},     /* tie: up to even */
      {"0x1.000000000000080001p0", 0x1.0000000000001p0}, /* past the tie */
      {"0x1.fffffffffffff8p1023", INFINITY},
      {"0x1p-1075", 0.0},
      {"0x1.0000001p-1075", 0x1p-1074},
      {"0x1p-99999999", 0.0},
      {"0x1p+99999999", INFINITY},
      {"0x0.0000000000001p-1022", 0x1p-1074},
      {"0x000000000000000000001p0", 1.0},
      {"0x1234567890abcdef1234p0", 0x1234567890abcdef1234p0},
      {"1e400", INFINITY},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char text[200];
    snprintf(text, sizeof text, "graph t() -> ()\n  %%0: f64[] = const(%s)\n", cases[i].text);
    ir_graph *y = ir_parse(text, err, sizeof err);
    ck_assert_msg(y != NULL, "%s: %s", cases[i].text, err);
    double got = *(double *)y->nodes[0].data;
    ck_assert_msg(!memcmp(&got, &cases[i].want, 8), "%s: want %a got %a", cases[i].text, cases[i].want, got);
    ir_free(y);
  }
  /* f32 reads the double and rounds it */
  ir_graph *y = ir_parse("graph t() -> ()\n  %0: f32[3] = const(0.1, 0x1.fffffffp+127, 1e-46)\n", err, sizeof err);
  ck_assert_msg(y != NULL, "%s", err);
  float *v = y->nodes[0].data;
  ck_assert(v[0] == 0.1f);
  ck_assert(isinf(v[1]));
  ck_assert(v[2] == 0.0f);
  ir_free(y);
}
END_TEST

START_TEST(test_attrs)
{
  SYM(1, 100);
  int x = input(KILN_F32, "2,3,4"), ix = input(KILN_I64, "5"), s = input(KILN_F32, "2,s0,4");
  int n = 3, line = 10;
  OP(OP_SUM, KILN_F32, "2,1,1", (&(op_attrs){.naxes = 2, .axes = {1, 2}, .keepdim = true}), line++, x);
  OP(OP_MEAN, KILN_F32, "3,4", (&(op_attrs){.naxes = 1, .axes = {0}}), line++, x);
  OP(OP_MAX, KILN_F32, "", (&(op_attrs){.naxes = 3, .axes = {0, 1, 2}}), line++, x);
  OP(OP_MIN, KILN_F32, "2,3,4", (&(op_attrs){.naxes = 0}), line++, x);
  OP(OP_ARGMAX, KILN_I64, "2,3", (&(op_attrs){.naxes = 1, .axes = {2}}), line++, x);
  OP(OP_RESHAPE, KILN_F32, "6,4", (&(op_attrs){.ndim = 2, .shape = {{6, NULL}, {4, NULL}}}), line++, x);
  OP(OP_RESHAPE, KILN_F32, "", (&(op_attrs){.ndim = 0}), line++,
     OP(OP_SUM, KILN_F32, "", (&(op_attrs){.naxes = 3, .axes = {0, 1, 2}}), 0, x));
  op_attrs ex = {.ndim = 4};
  dims_of("7,2,s0,4", ex.shape);
  OP(OP_EXPAND, KILN_F32, "7,2,s0,4", &ex, line++, s);
  OP(OP_PERMUTE, KILN_F32, "4,2,3", (&(op_attrs){.perm = {2, 0, 1}}), line++, x);
  op_attrs sl = {.dim = 1, .start = sym_const(1), .step = 2};
  dims_of("s0 - 1", &sl.end);
  int sls = OP(OP_SLICE, KILN_F32, "2,s0//2,4", &sl, line++, s);
  OP(OP_SLICE_SCATTER, KILN_F32, "2,s0,4", &sl, line++, s, sls);
  OP(OP_CAT, KILN_F32, "6,3,4", (&(op_attrs){.dim = 0}), line++, x, x, x);
  OP(OP_CAT, KILN_F32, "2,3,4", (&(op_attrs){.dim = 2}), line++, x);
  OP(OP_INDEX_SELECT, KILN_F32, "2,5,4", (&(op_attrs){.dim = 1}), line++, x, ix);
  OP(OP_INDEX_ADD, KILN_F32, "2,3,4", (&(op_attrs){.dim = 0}), line++, x, ix, x);
  OP(OP_CAST, KILN_F64, "2,3,4", (&(op_attrs){.dtype = KILN_F64}), line++, x);
  OP(OP_CAST, KILN_BOOL, "2,3,4", (&(op_attrs){.dtype = KILN_BOOL}), line++, x);
  OP(OP_WHERE, KILN_F32, "2,3,4", NULL, line++, n + 16, x, x);
  OP(OP_COPY, KILN_F32, "2,3,4", NULL, 0, x);
  OP(IR_NUMEL, KILN_I64, "", (&(op_attrs){.naxes = 2, .axes = {0, 2}, .start = sym_const(-1)}), line++, x);
  op_attrs nu = {.naxes = 0};
  dims_of("s0 + 1", &nu.start);
  OP(IR_NUMEL, KILN_F32, "", &nu, line++, s);
  char *t = round_trip(g);
  const char *want[] = {
      "= sum(%0) {axes=[1,2], keepdim=true}  # t.c:10",
      "= mean(%0) {axes=[0], keepdim=false}  # t.c:11",
      "= max(%0) {axes=[0,1,2], keepdim=false}",
      "= min(%0) {axes=[], keepdim=false}",
      "i64[2,3] = argmax(%0) {axes=[2], keepdim=false}",
      "= reshape(%0) {shape=[6,4]}",
      "f32[] = reshape(%9) {shape=[]}",
      "= expand(%2) {shape=[7,2,s0,4]}",
      "= permute(%0) {perm=[2,0,1]}",
      "f32[2,s0//2,4] = slice(%2) {dim=1, start=1, end=s0 - 1, step=2}",
      "= slice_scatter(%2, %13) {dim=1, start=1, end=s0 - 1, step=2}",
      "= cat(%0, %0, %0) {dim=0}",
      "= cat(%0) {dim=2}",
      "= index_select(%0, %1) {dim=1}",
      "= index_add(%0, %1, %0) {dim=0}",
      "f64[2,3,4] = cast(%0) {dtype=f64}",
      "bool[2,3,4] = cast(%0) {dtype=bool}",
      "= where(%19, %0, %0)  # t.c:27\n",
      "  %22: f32[2,3,4] = contiguous(%0)\n",
      "  %23: i64[] = numel(%0) {axes=[0,2], start=-1}  # t.c:28\n",
      "  %24: f32[] = numel(%2) {axes=[], start=s0 + 1}  # t.c:29\n",
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
    ck_assert_msg(strstr(t, want[i]), "missing '%s' in\n%s", want[i], t);
  alloc_free(t);
}
END_TEST

/* The attributes of the newer ops: numbers (clamp's bounds, inf among them),
 * integers (a diagonal, pad widths, topk's k) and a flag, written and read. */
START_TEST(test_attrs_of_newer_ops)
{
  SYM(1, 100);
  int x = input(KILN_F32, "3,4"), ix = input(KILN_I64, "3,2"), i1 = input(KILN_I64, "2");
  int line = 10;
  OP(OP_CLAMP, KILN_F32, "3,4", (&(op_attrs){.value = -0.5, .value2 = INFINITY}), line++, x);
  OP(OP_LEAKY_RELU, KILN_F32, "3,4", (&(op_attrs){.value = 0.25}), line++, x);
  OP(OP_TRIL, KILN_F32, "3,4", (&(op_attrs){.k = -1}), line++, x);
  OP(OP_PAD, KILN_F32, "5,3", (&(op_attrs){.value = 2, .nints = 4, .ints = {-1, 0, 1, 1}}), line++, x);
  OP(OP_TOPK, KILN_I64, "3,2", (&(op_attrs){.dim = 1, .k = 2, .flag = true}), line++, x);
  OP(OP_GATHER, KILN_F32, "3,2", (&(op_attrs){.dim = 1}), line++, x, ix);
  OP(OP_SCATTER_ADD, KILN_F32, "3,4", (&(op_attrs){.dim = 1}), line++, x, ix, OP(OP_GATHER, KILN_F32, "3,2", (&(op_attrs){.dim = 1}), 0, x, ix));
  OP(OP_INDEX_COPY, KILN_F32, "3,4", (&(op_attrs){.dim = 1}), line++, x, i1, OP(OP_GATHER, KILN_F32, "3,2", (&(op_attrs){.dim = 1}), 0, x, ix));
  OP(OP_CUMSUM, KILN_F32, "3,4", (&(op_attrs){.dim = 0}), line++, x);
  OP(OP_ARGMIN, KILN_I64, "3", (&(op_attrs){.naxes = 1, .axes = {1}}), line++, x);
  char *t = round_trip(g);
  const char *want[] = {
      "= clamp(%0) {value=-0x1p-1, value2=inf}  # t.c:10",
      "= leaky_relu(%0) {value=0x1p-2}",
      "= tril(%0) {k=-1}",
      "f32[5,3] = pad(%0) {value=0x1p+1, ints=[-1,0,1,1]}",
      "i64[3,2] = topk(%0) {dim=1, k=2, flag=true}",
      "= gather(%0, %1) {dim=1}",
      "= scatter_add(%0, %1, %",
      "= index_copy(%0, %2, %",
      "= cumsum(%0) {dim=0}",
      "i64[3] = argmin(%0) {axes=[1], keepdim=false}",
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
    ck_assert_msg(strstr(t, want[i]), "missing '%s' in\n%s", want[i], t);
  alloc_free(t);
}
END_TEST

START_TEST(test_symbolic)
{
  sym_dim s0 = SYM(1, INT64_MAX), s1 = SYM(2, 64), s2 = SYM(-5, 5);
  (void)s0, (void)s1, (void)s2;
  int x = input(KILN_F32, "s0,s1");
  int y = input(KILN_F32, "s0*s1,4*s0 + 3");
  op_attrs ra = {.ndim = 1};
  dims_of("s1*s0", ra.shape);
  int r = OP(OP_RESHAPE, KILN_F32, "s0*s1", &ra, 3, x);
  OP(OP_ADD, KILN_F32, "(s0 + 1)//2,s0 % 4,s2 + 5,2*(s0//4),s0*s0*s1 - s1 + 7", NULL, 4, x, y);
  output(r);
  guard("s0 % 4 == 0");
  guard("s0 >= 2");
  guard("s0*s1 <= 4096");
  guard("s1 != 3");
  guard("(s0 + 1) % s1 == 0");
  guard("(s0 % 4) == 0");
  guard("s2 < 0");
  guard("s0 >= 2"); /* a duplicate: dropped */
  char *t = round_trip(g);
  ck_assert_str_eq("graph test(%0: f32[s0,s1], %1: f32[s0*s1,4*s0 + 3]) -> (%2)\n"
                   "  sym s0 in [1, 9223372036854775807]\n"
                   "  sym s1 in [2, 64]\n"
                   "  sym s2 in [-5, 5]\n"
                   "  guards: s0 % 4 == 0, s0 >= 2, s0*s1 <= 4096, s1 != 3, (s0 + 1) % s1 == 0, (s0 % 4) == 0, s2 < 0\n"
                   "  %2: f32[s0*s1] = reshape(%0) {shape=[s0*s1]}  # t.c:3\n"
                   "  %3: f32[(s0 + 1)//2,s0 % 4,s2 + 5,2*(s0//4),s0*s0*s1 - s1 + 7] = add(%0, %1)  # t.c:4\n",
                   t);
  alloc_free(t);
}
END_TEST

START_TEST(test_writes_and_where)
{
  int x = input(KILN_F32, "4"), w = param(KILN_F32, "4"), gw = grad(w);
  int a = OP(OP_ADD, KILN_F32, "4", NULL, 0, x, w);
  int b = op_at(OP_NEG, KILN_F32, "4", NULL, 0, 1, &a);
  g->nodes[b].file = "dir with space/odd:name#1.c";
  g->nodes[b].line = 12;
  int c = op_at(OP_EXP, KILN_F32, "4", NULL, 0, 1, &b);
  g->nodes[c].file = "tab\there\nnewline.c";
  g->nodes[c].line = 3;
  int e = op_at(OP_LOG, KILN_F32, "4", NULL, 0, 1, &c);
  g->nodes[e].line = 9; /* no file, a line */
  write_(IR_WRITE_DATA, x, a, "w.c", 1);
  write_(IR_WRITE_DATA, w, b, "", 0);
  write_(IR_WRITE_GRAD, w, c, "w.c", 2);
  write_(IR_WRITE_GRAD, w, -1, "w.c", 3);
  write_(IR_WRITE_GRAD, w, gw, NULL, 0);
  output(e);
  char *t = text_of(g);
  ck_assert_str_eq("graph test(%0: f32[4], %1: f32[4] @param, %2: f32[4] @grad(%1)) -> (%6)\n"
                   "  %3: f32[4] = add(%0, %1)\n"
                   "  %4: f32[4] = neg(%3)  # dir with space/odd:name#1.c:12\n"
                   "  %5: f32[4] = exp(%4)  # tab?here?newline.c:3\n"
                   "  %6: f32[4] = log(%5)  # :9\n"
                   "  write %0 = %3  # w.c:1\n"
                   "  write %1 = %4\n"
                   "  grad %1 = %5  # w.c:2\n"
                   "  grad %1 = none  # w.c:3\n"
                   "  grad %1 = %2\n",
                   t);
  /* the file name reads back up to the last ':' (the control chars are gone) */
  ir_graph *y = ir_parse(t, err, sizeof err);
  ck_assert_msg(y != NULL, "%s", err);
  ck_assert_str_eq("dir with space/odd:name#1.c", y->nodes[4].file);
  ck_assert_str_eq("tab?here?newline.c", y->nodes[5].file);
  ck_assert_str_eq("", y->nodes[6].file);
  ck_assert_int_eq(9, y->nodes[6].line);
  char *t2 = text_of(y);
  ck_assert_str_eq(t, t2);
  alloc_free(t);
  alloc_free(t2);
  ir_free(y);
}
END_TEST

/* text parsed, and printed back the same */
static ir_graph *parsed_same(const char *text) {
  ir_graph *y = ir_parse(text, err, sizeof err);
  ck_assert_msg(y != NULL, "%s", err);
  char *t = text_of(y);
  ck_assert_str_eq(text, t);
  alloc_free(t);
  return y;
}

/* `grad %T = %V when D` reads and writes back, and is skipped where D is 0
 * (a scan's length: a weight only its body reads keeps its .grad) */
START_TEST(test_grad_when)
{
  const char *text = "graph f(%0: f32[s0,4], %1: f32[4] @param) -> (%2)\n"
                     "  sym s0 in [0, 100]\n"
                     "  %2: f32[4] = neg(%1)\n"
                     "  grad %1 = %2 when s0 - 1  # w.c:2\n";
  ir_graph *y = parsed_same(text);
  int64_t at[3] = {1, 0, 5};
  for (int i = 0; i < 3; i++) ck_assert_int_eq(at[i] == 1, ir_write_skipped(y, &y->writes[0], &at[i], NULL));
  ir_free(y);
  /* a condition follows a value only */
  ck_assert_ptr_null(ir_parse("graph f(%0: f32[s0,4], %1: f32[4] @param) -> ()\n  sym s0 in [0, 100]\n"
                              "  grad %1 = none when s0\n",
                              err, sizeof err));
  ck_assert_msg(strstr(err, "line 3") != NULL, "%s", err);
}
END_TEST

/* `grad %T = %V when %C [else none]`: a one-element bool node as the
 * condition (a cond's predicate) reads and writes back; the interpreter
 * skips the write where it is false, leaving .grad as it was, or NULL with
 * `else none` */
START_TEST(test_grad_when_cond)
{
  const char *text = "graph f(%0: bool[1], %1: f32[4] @param, %2: f32[4] @param) -> (%3)\n"
                     "  %3: f32[4] = neg(%1)\n"
                     "  grad %1 = %3 when %0  # w.c:2\n"
                     "  grad %2 = %3 when %0 else none  # w.c:3\n";
  ir_graph *y = parsed_same(text);
  char verr[256];
  ck_assert_msg(0 == ir_verify(y, verr, sizeof verr), "%s", verr);
  const float w[4] = {1, 2, 3, 4}, old[4] = {7, 7, 7, 7};
  for (int pv = 0; pv < 2; pv++) {
    kiln_scope_begin();
    bool pb = pv;
    kiln_tensor *pred = kiln_tensor_from(KILN_BOOL, 1, (int64_t[]){1}, &pb), *out[1];
    kiln_tensor *p[2] = {kiln_tensor_from(KILN_F32, 1, (int64_t[]){4}, w), kiln_tensor_from(KILN_F32, 1, (int64_t[]){4}, w)};
    kiln_tensor *g0[2];
    for (int k = 0; k < 2; k++) p[k]->grad = g0[k] = kiln_retain(kiln_tensor_from(KILN_F32, 1, (int64_t[]){4}, old));
    ck_assert_msg(0 == interp_run(y, &pred, p, out), "%s", kiln_last_error());
    kiln_release(out[0]);
    if (!pv) {
      ck_assert_ptr_eq(g0[0], p[0]->grad); /* as it was */
      ck_assert_ptr_null(p[1]->grad);      /* else none */
    }
    for (int k = 0; pv && k < 2; k++) {
      float got[4];
      ck_assert_ptr_nonnull(p[k]->grad);
      ck_assert_int_eq(0, kiln_read(p[k]->grad, got, sizeof got));
      for (int i = 0; i < 4; i++) ck_assert_float_eq(-w[i], got[i]);
    }
    for (int k = 0; k < 2; k++) kiln_release(p[k]->grad), p[k]->grad = NULL;
    kiln_scope_end();
  }
  /* the verifier refuses a condition that is not a one-element bool */
  y->writes[0].cond = 3;
  ck_assert_int_eq(-1, ir_verify(y, verr, sizeof verr));
  ck_assert_msg(strstr(verr, "not a one-element bool") != NULL, "%s", verr);
  ir_free(y);
  /* nor does the parser take one, or an `else` other than none */
  ck_assert_ptr_null(ir_parse("graph f(%0: f32[1], %1: f32[4] @param) -> ()\n  %2: f32[4] = neg(%1)\n"
                              "  grad %1 = %2 when %0\n", err, sizeof err));
  ck_assert_msg(strstr(err, "one-element bool") != NULL, "%s", err);
  ck_assert_ptr_null(ir_parse("graph f(%0: bool[1], %1: f32[4] @param) -> ()\n  %2: f32[4] = neg(%1)\n"
                              "  grad %1 = %2 when %0 else %2\n", err, sizeof err));
  ck_assert_msg(strstr(err, "none") != NULL, "%s", err);
}
END_TEST

/* ir_print writes what ir_to_string returns. */
START_TEST(test_print_file)
{
  ir_graph *x = ir_parse(mlp_text, err, sizeof err);
  ck_assert_ptr_nonnull(x);
  FILE *f = tmpfile();
  ck_assert_ptr_nonnull(f);
  ck_assert_int_eq(0, ir_print(x, f));
  long n = ftell(f);
  rewind(f);
  char *buf = calloc(1, (size_t)n + 1);
  ck_assert_int_eq(n, (long)fread(buf, 1, (size_t)n, f));
  ck_assert_str_eq(mlp_text, buf);
  free(buf);
  fclose(f);
  ir_free(x);
}
END_TEST

/* A leaf after a node cannot be a header entry: it prints as a node line the parser refuses. */
START_TEST(test_leaf_out_of_place)
{
  int x = input(KILN_F32, "4");
  OP(OP_NEG, KILN_F32, "4", NULL, 0, x);
  param(KILN_F32, "4");
  char *t = text_of(g);
  ck_assert_str_eq("graph test(%0: f32[4]) -> ()\n"
                   "  %1: f32[4] = neg(%0)\n"
                   "  %2: f32[4] = param()\n",
                   t);
  ck_assert_ptr_null(ir_parse(t, err, sizeof err));
  ck_assert_str_eq("line 3, col 16: 'param' is a leaf: leaves are listed in the graph header", err);
  alloc_free(t);
}
END_TEST

#define H "graph f(%0: f32[s0,4], %1: f32[4] @param) -> (%2)\n  sym s0 in [1, 100]\n"

static const struct {
  const char *text, *want;
} bad[] = {
    {"", "line 1, col 1: expected 'graph'"},
    {"\n; only a comment\n", "line 3, col 1: expected 'graph'"},
    {"grph f() -> ()", "line 1, col 1: expected 'graph'"},
    {"graph () -> ()", "line 1, col 7: expected the graph's name"},
    {"graph f(%1: f32[4]) -> ()", "line 1, col 9: expected %0 (ids count up from %0)"},
    {"graph f(%0: f33[4]) -> ()", "line 1, col 13: unknown dtype 'f33'"},
    {"graph f(%0: f32[s1]) -> ()\n  sym s0 in [1, 10]", "line 1, col 17: s1 is not declared"},
    {"graph f(%0: f32[4] @parm) -> ()", "line 1, col 21: expected '@param', '@grad(%N)' or '@sym(s<k>)'"},
    {"graph f(%0: f32[4], %1: f32[4] @grad(%2)) -> ()", "line 1, col 38: %2 is not defined yet"},
    {"graph f(%0: f32[4], %1: f32[4] @grad(%0), %2: f32[4] @grad(%1)) -> ()", "line 1, col 60: %1 is not an input or a param"},
    {"graph f(%0: f32[4] @param, %1: f32[4] @grad(%2)) -> ()", "line 1, col 45: %2 is not defined yet"},
    {"graph f(%0: f32[4]) -> (%3)", "line 1, col 25: output %3 is not defined"},
    {"graph f(%0: f32[4]) - (%0)", "line 1, col 21: expected '->'"},
    {"graph f(%0: f32[4]) -> (%0) x", "line 1, col 29: expected end of line, not 'x'"},
    {"graph f(%0: f32[4", "line 1, col 18: expected ',' or ']' at end of line"},
    {"graph f(%0: f32[4]", "line 1, col 19: expected ',' or ')' at end of line"},
    {"graph f(%0: f32[1,1,1,1,1,1,1,1,1]) -> ()", "line 1, col 33: more than 8 dims"},
    {"graph f(%0: f32[99999999999999999999]) -> ()", "line 1, col 17: number out of range"},
    {"graph f(%99999999999) -> ()", "line 1, col 9: node id out of range"},
    {"graph f() -> ()\n  sym s1 in [0, 4]", "line 2, col 7: expected s0 (symbols are declared in order)"},
    {"graph f() -> ()\n  sym s0 in [5, 4]", "line 2, col 14: empty bounds: 5 > 4"},
    {"graph f() -> ()\n  sym s0 in [0, 99999999999999999999]", "line 2, col 17: number out of range"},
    {H "  %3: f32[4] = neg(%0)", "line 3, col 3: expected %2 (ids count up by one)"},
    {H "  %2: f32[s0,4] = mtmul(%0, %1)", "line 3, col 19: unknown op 'mtmul'"},
    {H "  %2: f32[s0,4] = neg(%7)", "line 3, col 23: %7 is not defined yet"},
    {H "  %2: f32[s0,4] = add(%0)", "line 3, col 19: 'add' takes 2 inputs, not 1"},
    {H "  %2: f32[s0,4] = neg(%0, %1)", "line 3, col 19: 'neg' takes 1 input, not 2"},
    {H "  %2: f32[s0,4] = cat() {dim=0}", "line 3, col 19: 'cat' takes at least 1 input"},
    {H "  %2: f32[s0,4] = input()", "line 3, col 19: 'input' is a leaf: leaves are listed in the graph header"},
    {H "  %2: i64[] = numel(%0) {axes=[1]}", "line 3, col 34: expected ','"},
    {H "  %2: i64[] = numel(%0, %1) {axes=[1], start=0}", "line 3, col 15: 'numel' takes 1 input, not 2"},
    {H "  %2: f32[s0] = const(1)", "line 3, col 7: a const's shape must be concrete and non-negative"},
    {H "  %2: f32[3] = const(1, 2)", "line 3, col 26: a const of 3 elements needs 3 values or one, not 2"},
    {H "  %2: f32[3] = const(1, 2, 3, 4)", "line 3, col 31: more values than the 3 of the shape"},
    {H "  %2: f32[65536,65536] = const(0)", "line 3, col 7: a const holds at most 268435456 elements"},
    {H "  %2: bool[2] = const(0, 2)", "line 3, col 26: a bool is 0 or 1"},
    {H "  %2: i64[1] = const(1.5)", "line 3, col 23: expected ',' or ')', not '.'"},
    {H "  %2: f32[1] = const(1.5x)", "line 3, col 22: malformed number"},
    {H "  %2: f32[1] = const(0xp1)", "line 3, col 22: malformed hex float"},
    {H "  %2: f32[1] = const(%0)", "line 3, col 22: expected a number"},
    {H "  %2: f32[1] = const(1", "line 3, col 23: expected ',' or ')' at end of line"},
    {H "  %2: f32[1] = sum(%0)", "line 3, col 23: expected '{'"},
    {H "  %2: f32[s0,4] = add(%0, %1) {dim=0}", "line 3, col 31: 'add' takes no attributes"},
    {H "  %2: f32[1] = sum(%0) {axis=[0], keepdim=true}", "line 3, col 25: expected 'axes'"},
    {H "  %2: f32[1] = sum(%0) {axes=[0], keepdim=yes}", "line 3, col 43: expected 'true' or 'false'"},
    {H "  %2: f32[1] = sum(%0) {axes=[9], keepdim=true}", "line 3, col 31: number out of range [0, 7]"},
    {H "  %2: f32[4,s0] = permute(%0) {perm=[1,0,2]}", "line 3, col 37: perm has 3 entries but %0 has 2 dims"},
    {H "  %2: f32[4] = slice(%1) {dim=0, start=0, stop=4, step=1}", "line 3, col 43: expected 'end'"},
    {H "  %2: f32[4] = cast(%1) {dtype=f8}", "line 3, col 32: unknown dtype 'f8'"},
    {H "  %2: f32[4] = neg(%1)  #f.c:3", "line 3, col 26: expected ' ' after '#', not 'f'"},
    {H "  %2: f32[4] = neg(%1)  # f.c", "line 3, col 27: expected 'file:line' after '# '"},
    {H "  %2: f32[4] = neg(%1)  # f.c:x", "line 3, col 31: expected a number"},
    {H "  %2: f32[4] = neg(%1) foo", "line 3, col 24: expected end of line, not 'f'"},
    {H "  guards: s0 >> 2", "line 3, col 15: unexpected '>'"},
    {H "  guards: s0 >= 2 s0", "line 3, col 19: expected ',' or end of line, not 's'"},
    {H "  guards: s3 >= 2", "line 3, col 11: s3 is not declared"},
    {H "  %2: f32[4] = neg(%1)\n  guards: s0 >= 2", "line 4, col 3: a guards line after the node lines"},
    {H "  %2: f32[4] = neg(%1)\n  sym s1 in [0, 1]",
     "line 4, col 3: a sym line must follow the header or another sym line"},
    {H "  %2: f32[4] = neg(%1)\n  grad %1 = none\n  %3: f32[4] = neg(%1)",
     "line 5, col 3: a node line after the write and grad lines"},
    {H "  %2: f32[4] = neg(%1)\n  write %2 = %1", "line 4, col 9: %2 is not an input or a param"},
    {H "  %2: f32[4] = neg(%1)\n  grad %2 = none", "line 4, col 8: %2 is not an input or a param"},
    {H "  %2: f32[4] = neg(%1)\n  write %1 = none", "line 4, col 14: expected a node id '%N'"},
    {H "  %2: f32[4] = neg(%1)\n  grad %1 = %5", "line 4, col 13: %5 is not defined yet"},
    {H "  %2: f32[4] = neg(%1)\n  graph g() -> ()", "line 4, col 3: a second graph (one per text)"},
    {H "  hello", "line 3, col 3: expected a node line, 'write' or 'grad'"},
    {H "  %2: f32[4] = neg(%1)\n  %3: f32[s0 // 0] = neg(%1)", "line 4, col 14: divisor not provably positive"},
    {"graph f() -> ()\n  sym s0 in [1, 2]\n  sym s0 in [1, 2]",
     "line 3, col 7: expected s1 (symbols are declared in order)"},
    {"graph f(%0: f32[4] @param()) -> ()", "line 1, col 27: expected a param name"},
    {"graph f(%0: f32[4] @param(a b)) -> ()", "line 1, col 28: expected a param name"},
    /* the format's version line: a newer one needs a newer kiln */
    {"version 2\ngraph f() -> ()", "line 1, col 9: graph format version 2 is newer than this kiln reads (1 .. 1)"},
    {"version 0\ngraph f() -> ()", "line 1, col 9: graph format version 0 is not one (1 .. 1)"},
    {"version\ngraph f() -> ()", "line 1, col 8: expected a number"},
    {"version 1 x\ngraph f() -> ()", "line 1, col 11: expected end of line"},
    {"version 1\n", "line 2, col 1: expected 'graph'"},
    {"graph f() -> ()\nversion 1", "line 2, col 1: expected a node line"},
};

/* A saved file starts with its format's version; one without (the format
 * before versions) reads the same. */
START_TEST(test_version_line)
{
  const char *body = "graph f(%0: f32[4]) -> (%1)\n  %1: f32[4] = neg(%0)\n";
  char with[256];
  snprintf(with, sizeof with, "; saved\nversion %d\n%s", IR_TEXT_VERSION, body);
  ir_graph *a = ir_parse(with, err, sizeof err), *b = ir_parse(body, err, sizeof err);
  ck_assert_msg(a && b, "%s", err);
  char *ta = ir_to_string(a), *tb = ir_to_string(b);
  ck_assert_str_eq(tb, ta);
  ck_assert_str_eq(body, ta);
  alloc_free(ta), alloc_free(tb);
  ir_free(a), ir_free(b);
}
END_TEST

START_TEST(test_errors)
{
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    err[0] = '\0';
    ir_graph *y = ir_parse(bad[i].text, err, sizeof err);
    ck_assert_msg(y == NULL, "case %zu parsed:\n%s", i, bad[i].text);
    ck_assert_msg(!strncmp(err, bad[i].want, strlen(bad[i].want)), "case %zu:\n%s\nwant: %s\ngot:  %s", i, bad[i].text,
                  bad[i].want, err);
  }
  /* guards are few: a text with thousands is refused before it gets slow */
  char *many = malloc(1 << 16);
  int n = snprintf(many, 1 << 16, "graph f() -> ()\n  sym s0 in [0, 100000]\n  guards: s0 >= 0");
  for (int i = 1; i <= 4096; i++) n += snprintf(many + n, (size_t)(1 << 16) - (size_t)n, ", s0 >= %d", i);
  ck_assert_ptr_null(ir_parse(many, err, sizeof err));
  ck_assert_str_eq("line 3, col 48053: more than 4096 guards", err);
  free(many);
  /* a short err buffer is cut, never overrun; none at all is fine */
  char small[8];
  ck_assert_ptr_null(ir_parse("x", small, sizeof small));
  ck_assert_str_eq("line 1,", small);
  ck_assert_ptr_null(ir_parse("x", NULL, 0));
  ck_assert_ptr_null(ir_parse(NULL, err, sizeof err));
  ck_assert_str_eq("line 1, col 1: no text", err);
}
END_TEST

/* A text with every kind of line, to cut and damage. */
static char *rich_text(void)
{
  sym_dim s0 = SYM(1, 64);
  (void)s0;
  int x = input(KILN_F32, "s0,4"), w = param(KILN_F32, "4,4"), gw = grad(w);
  float c[4] = {1, -2, 0.5f, NAN};
  int k = konst(KILN_F32, "4", c);
  int m = OP(OP_MATMUL, KILN_F32, "s0,4", NULL, 1, x, w);
  int a = OP(OP_ADD, KILN_F32, "s0,4", NULL, 2, m, k);
  int s = OP(OP_SUM, KILN_F32, "4", (&(op_attrs){.naxes = 1, .axes = {0}}), 3, a);
  int p = OP(OP_PERMUTE, KILN_F32, "4,s0", (&(op_attrs){.perm = {1, 0}}), 4, a);
  op_attrs sl = {.dim = 1, .start = sym_const(0), .step = 1};
  dims_of("s0//2", &sl.end);
  OP(OP_SLICE, KILN_F32, "4,s0//2", &sl, 5, p);
  OP(OP_CAT, KILN_F32, "8", (&(op_attrs){.dim = 0}), 6, s, s);
  guard("s0 % 2 == 0");
  output(a);
  output(s);
  write_(IR_WRITE_DATA, w, gw, "t.c", 9);
  write_(IR_WRITE_GRAD, w, -1, "t.c", 10);
  return text_of(g);
}

/* Every prefix of a valid text is an error or a graph, never a crash. */
START_TEST(test_truncations)
{
  char *t = rich_text();
  size_t n = strlen(t);
  int parsed = 0;
  for (size_t i = 0; i <= n; i++) {
    char *cut = strndup(t, i);
    err[0] = '\0';
    ir_graph *y = ir_parse(cut, err, sizeof err);
    if (y) {
      parsed++;
      ir_free(y);
    } else {
      CHECK(!strncmp(err, "line ", 5), "prefix %zu: '%s'", i, err);
    }
    free(cut);
  }
  /* the whole text and the ones missing only writes or line ends */
  ck_assert_int_gt(parsed, 3);
  alloc_free(t);
}
END_TEST

/* Random byte flips: an error, or a graph that round-trips itself. */
START_TEST(test_byte_flips)
{
  char *t = rich_text();
  size_t n = strlen(t);
  char *m = malloc(n + 1);
  rng_state = 4242;
  int parsed = 0;
  for (int it = 0; it < 4000; it++) {
    memcpy(m, t, n + 1);
    int flips = 1 + (int)(rnd() % 3);
    static const char interesting[] = "%,()[]{}:=#;s0123456789-+ \n\t@x.";
    for (int k = 0; k < flips; k++) {
      size_t at = rnd() % n;
      m[at] = rnd() % 2 ? interesting[rnd() % (sizeof interesting - 1)] : (char)(1 + rnd() % 255);
    }
    err[0] = '\0';
    ir_graph *y = ir_parse(m, err, sizeof err);
    if (!y) {
      CHECK(!strncmp(err, "line ", 5), "flip %d: '%s'", it, err);
      continue;
    }
    parsed++;
    char *t1 = ir_to_string(y);
    CHECK(t1 != NULL, "flip %d: no text", it);
    ir_graph *z = ir_parse(t1, err, sizeof err);
    CHECK(z != NULL, "flip %d: printed text does not parse: %s\n%s", it, err, t1);
    char *t2 = ir_to_string(z);
    CHECK(t2 && !strcmp(t1, t2), "flip %d: not a fixed point:\n%s\n---\n%s", it, t1, t2);
    alloc_free(t1);
    alloc_free(t2);
    ir_free(y);
    ir_free(z);
  }
  ck_assert_int_gt(parsed, 100);
  free(m);
  alloc_free(t);
}
END_TEST

#ifdef KILN_TEST_BUILD
/* Every allocation failure gives "out of memory", never a crash or a leak. */
START_TEST(test_out_of_memory)
{
  char *t = rich_text();
  int failed = 0;
  for (int n = 1;; n++) {
    alloc_fail_after(n);
    ir_graph *y = ir_parse(t, err, sizeof err);
    alloc_fail_after(0);
    if (y) {
      char *t2 = text_of(y);
      ck_assert_str_eq(t, t2);
      alloc_free(t2);
      ir_free(y);
      break;
    }
    ck_assert_msg(!strcmp(err, "out of memory"), "n=%d: %s", n, err);
    failed++;
  }
  ck_assert_int_gt(failed, 5);
  /* and the printer */
  for (int n = 1;; n++) {
    alloc_fail_after(n);
    char *t2 = ir_to_string(g);
    alloc_fail_after(0);
    if (t2) {
      ck_assert_str_eq(t, t2);
      alloc_free(t2);
      break;
    }
  }
  alloc_free(t);
}
END_TEST
#endif

/* ---- golden files: tests/ir/NAME.ir ---- */

/* The lines of text that are not blank or comments, each ending in '\n'. */
static char *strip_comments(const char *text, size_t n)
{
  char *out = calloc(1, n + 2), *o = out;
  const char *p = text, *end = text + n;
  while (p < end) {
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    size_t len = nl ? (size_t)(nl - p) : (size_t)(end - p);
    size_t k = strspn(p, " \t");
    if (k < len && p[k] != ';') {
      memcpy(o, p, len);
      o += len;
      *o++ = '\n';
    }
    p += len + 1;
  }
  return out;
}

static char *read_file(const char *path)
{
  FILE *f = fopen(path, "rb");
  ck_assert_msg(f != NULL, "cannot open %s", path);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  rewind(f);
  char *buf = calloc(1, (size_t)n + 1);
  ck_assert_int_eq(n, (long)fread(buf, 1, (size_t)n, f));
  fclose(f);
  return buf;
}

/* Each file's input section (before a line `;---- pipeline`) prints as
 * itself, comments and blank lines aside; its pipeline section, if any, is
 * what pass_pipeline makes of it. */
static void run_golden(const char *path)
{
  char *text = read_file(path);
  const char *mark = ";---- pipeline";
  char *sep = strstr(text, mark);
  while (sep && sep != text && sep[-1] != '\n') sep = strstr(sep + 1, mark);
  size_t in_len = sep ? (size_t)(sep - text) : strlen(text);
  char *input_text = strndup(text, in_len);
  char *want = strip_comments(text, in_len);
  ir_graph *x = ir_parse(input_text, err, sizeof err);
  ck_assert_msg(x != NULL, "%s: %s", path, err);
  char *got = text_of(x);
  ck_assert_msg(!strcmp(want, got), "%s: input does not round-trip:\n%s\n--- printed ---\n%s", path, want, got);
  char verr[256];
  ck_assert_msg(0 == ir_verify(x, verr, sizeof verr), "%s: %s", path, verr);
  alloc_free(got);
  free(want);
  if (sep) {
    const char *body = strchr(sep, '\n');
    body = body ? body + 1 : sep + strlen(sep);
    want = strip_comments(body, strlen(body));
    x = pass_pipeline(x, err, sizeof err);
    ck_assert_msg(x != NULL, "%s: pass_pipeline: %s", path, err);
    got = text_of(x);
    ck_assert_msg(!strcmp(want, got), "%s: after pass_pipeline:\n%s\n--- want ---\n%s", path, got, want);
    alloc_free(got);
    free(want);
  }
  ir_free(x);
  free(input_text);
  free(text);
}

START_TEST(test_golden)
{
  /* this file's directory: CMake compiles it by its absolute path */
  char dir[4096];
  snprintf(dir, sizeof dir, "%s", __FILE__);
  char *slash = strrchr(dir, '/');
  ck_assert_msg(slash != NULL, "no directory in %s", __FILE__);
  snprintf(slash, sizeof dir - (size_t)(slash - dir), "/ir");
  DIR *d = opendir(dir);
  ck_assert_msg(d != NULL, "cannot open %s", dir);
  int files = 0;
  for (struct dirent *e; (e = readdir(d));) {
    size_t n = strlen(e->d_name);
    if (n < 4 || strcmp(e->d_name + n - 3, ".ir")) continue;
    char path[8192];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    run_golden(path);
    files++;
  }
  closedir(d);
  ck_assert_int_ge(files, 4);
}
END_TEST

/* Found by fuzzing (tests/fuzz/fuzz_irtext.c): a graph without outputs is
 * refused by kiln_load_string, whose message used to read the freed graph. */
START_TEST(test_load_no_outputs)
{
  ck_assert_ptr_null(kiln_load_string("graph e() -> ()"));
  ck_assert_msg(strstr(kiln_last_error(), "kiln_load: the graph has 0 inputs and 0 outputs") != NULL, "%s",
                kiln_last_error());
  ck_assert_ptr_null(kiln_load_string("graph e(%0: f32[2]) -> ()\n"));
  ck_assert_msg(strstr(kiln_last_error(), "1 inputs and 0 outputs") != NULL, "%s", kiln_last_error());
}
END_TEST

/* Found by fuzzing (tests/fuzz/fuzz_irtext.c, LLVM against the interpreter):
 * the verifier accepts a dim it cannot decide from the bounds ([s0,1] for a
 * sum that gives [1,s1]); the backends used to trust it at any size. Now a
 * call checks a loaded graph at its sizes, on either backend, broadcasts
 * included. */
START_TEST(test_load_checks_dims)
{
  static const char text[] = "graph bad(%0: f32[s0,s1]) -> (%1)\n"
                             "  sym s0 in [1, 4096]\n"
                             "  sym s1 in [1, 4096]\n"
                             "  %1: f32[s0,1] = sum(%0) {axes=[0], keepdim=true}\n";
  kiln_fn *fn = kiln_load_string(text);
  ck_assert_msg(fn != NULL, "%s", kiln_last_error());
  kiln_scope_begin();
  kiln_tensor *y = NULL, *x = kiln_ones(KILN_F32, 2, ((int64_t[]){2, 5}));
  ck_assert_int_eq(-1, kiln_call(fn, &x, &y));
  ck_assert_msg(strstr(kiln_last_error(), "kiln_call: bad: the call does not fit the loaded graph") &&
                    strstr(kiln_last_error(), "%1: sum: the graph says f32[2,1], the rule gives f32[1,5]"),
                "%s", kiln_last_error());
  /* a reshape whose count holds only at some sizes: the interpreter used to view a prefix */
  kiln_fn *fn2 = kiln_load_string("graph r(%0: f32[s0,8]) -> (%1)\n"
                                  "  sym s0 in [4, 4096]\n"
                                  "  %1: f32[s0//4,4,8] = reshape(%0) {shape=[s0//4,4,8]}\n");
  ck_assert_msg(fn2 != NULL, "%s", kiln_last_error());
  x = kiln_ones(KILN_F32, 2, ((int64_t[]){5, 8}));
  ck_assert_int_eq(-1, kiln_call(fn2, &x, &y));
  ck_assert_msg(strstr(kiln_last_error(), "%1: reshape: cannot reshape"), "%s", kiln_last_error());
  x = kiln_ones(KILN_F32, 2, ((int64_t[]){8, 8}));
  ck_assert_msg(kiln_call(fn2, &x, &y) == 0, "%s", kiln_last_error());
  kiln_fn_free(fn2);
  /* a symbolic dim that is 1 at the call broadcasts; compiled code broadcast
   * only constant 1s and read past the input */
  fn2 = kiln_load_string("graph b(%0: f32[s0,8], %1: f32[s1,8]) -> (%2)\n"
                         "  sym s0 in [1, 64]\n"
                         "  sym s1 in [1, 64]\n"
                         "  %2: f32[s0,8] = add(%1, %0)\n");
  ck_assert_msg(fn2 != NULL, "%s", kiln_last_error());
  kiln_tensor *in2[2] = {kiln_ones(KILN_F32, 2, ((int64_t[]){4, 8})), kiln_ones(KILN_F32, 2, ((int64_t[]){1, 8}))};
  ck_assert_int_eq(-1, kiln_call(fn2, in2, &y));
  ck_assert_msg(strstr(kiln_last_error(), "%2: add: input 0's dim s1 is 1 here and broadcasts"), "%s", kiln_last_error());
  in2[1] = kiln_ones(KILN_F32, 2, ((int64_t[]){4, 8}));
  ck_assert_msg(kiln_call(fn2, in2, &y) == 0, "%s", kiln_last_error());
  ck_assert_double_eq(64, kiln_item(kiln_sum_all(y)));
  kiln_fn_free(fn2);
  x = kiln_ones(KILN_F32, 2, ((int64_t[]){1, 1})); /* the sizes where it holds */
  ck_assert_msg(kiln_call(fn, &x, &y) == 0, "%s", kiln_last_error());
  ck_assert_double_eq(1, kiln_item(y));
  kiln_scope_end();
  kiln_fn_free(fn);
}
END_TEST

static Suite *irtext_suite(void)
{
  Suite *s = suite_create("irtext");
  TCase *tc = tcase_create("irtext");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_example);
  tcase_add_test(tc, test_leaves_and_outputs);
  tcase_add_test(tc, test_names);
  tcase_add_test(tc, test_version_line);
  tcase_add_test(tc, test_consts);
  tcase_add_test(tc, test_float_exact);
  tcase_add_test(tc, test_float_reading);
  tcase_add_test(tc, test_attrs);
  tcase_add_test(tc, test_attrs_of_newer_ops);
  tcase_add_test(tc, test_symbolic);
  tcase_add_test(tc, test_writes_and_where);
  tcase_add_test(tc, test_grad_when);
  tcase_add_test(tc, test_grad_when_cond);
  tcase_add_test(tc, test_print_file);
  tcase_add_test(tc, test_leaf_out_of_place);
  tcase_add_test(tc, test_errors);
  tcase_add_test(tc, test_truncations);
  tcase_add_test(tc, test_byte_flips);
#ifdef KILN_TEST_BUILD
  tcase_add_test(tc, test_out_of_memory);
#endif
  tcase_add_test(tc, test_golden);
  tcase_add_test(tc, test_load_no_outputs);
  tcase_add_test(tc, test_load_checks_dims);
  suite_add_tcase(s, tc);
  return s;
}

int main(void)
{
  SRunner *sr = srunner_create(irtext_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
