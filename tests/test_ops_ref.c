/* The eager ops against numpy: cases written by tests/gen_refs.py (random
 * seeded shapes of rank 0..4 with broadcasting, size-0 and size-1 dims,
 * transposed, sliced and expanded operands, every dtype an op takes), one
 * Check case per op family, and a block of hand-derived values that catch
 * mistakes a numpy reference could share.
 *
 * Run: /usr/bin/python3 tests/gen_refs.py DIR && KILN_REFS_DIR=DIR test_ops_ref
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eager/eager.h"
#include "kiln.h"
#include "refcase.h"

static ref_file refs;

/* ---- dispatch: one case's op through the kiln call it names ------------ */

typedef kiln_tensor *(*binary_fn)(kiln_tensor *, kiln_tensor *, const char *, int);
typedef kiln_tensor *(*unary_fn)(kiln_tensor *, const char *, int);
typedef kiln_tensor *(*reduce_fn)(kiln_tensor *, int, bool, const char *, int);
typedef kiln_tensor *(*reduce_axes_fn)(kiln_tensor *, const int *, int, bool, const char *, int);
typedef kiln_tensor *(*inplace_fn)(kiln_tensor *, kiln_tensor *, const char *, int);

#define BINARY_ROW(name) {#name, kiln_##name##_at},
#define UNARY_ROW(name) {#name, kiln_##name##_at},
static const struct {
  const char *name;
  binary_fn fn;
} binary_ops[] = {KILN_BINARY_OPS(BINARY_ROW)};
static const struct {
  const char *name;
  unary_fn fn;
} unary_ops[] = {KILN_UNARY_OPS(UNARY_ROW)};

static const struct {
  const char *name;
  reduce_fn fn;
} reduce_ops[] = {{"sum", kiln_sum_at}, {"mean", kiln_mean_at}, {"max", kiln_max_at},
                  {"min", kiln_min_at}, {"argmax", kiln_argmax_at}, {"argmin", kiln_argmin_at},
                  {"logsumexp", kiln_logsumexp_at}};
static const struct {
  const char *name;
  reduce_axes_fn fn;
} reduce_axes_ops[] = {{"sum_axes", kiln_sum_axes_at},
                       {"mean_axes", kiln_mean_axes_at},
                       {"max_axes", kiln_max_axes_at},
                       {"min_axes", kiln_min_axes_at}};
static const struct {
  const char *name;
  inplace_fn fn;
} inplace_ops[] = {{"add_", kiln_add__at}, {"sub_", kiln_sub__at}, {"mul_", kiln_mul__at}, {"copy_", kiln_copy__at}};

/* Every op the file must hold cases for, beyond the X-macro lists. */
static const char *const other_ops[] = {
    "where", "sum", "mean", "max", "min", "var", "argmax", "sum_axes", "mean_axes", "max_axes",
    "min_axes", "var_axes", "sum_all", "mean_all", "matmul", "softmax", "log_softmax", "layer_norm",
    "embedding", "index_select", "cross_entropy", "mse_loss", "reshape", "transpose", "permute",
    "expand", "squeeze", "unsqueeze", "slice", "contiguous", "cat", "stack", "cast", "zeros",
    "ones", "full", "scalar", "arange", "add_", "sub_", "mul_", "copy_", "fill_", "zero_",
    "conv2d", "conv1d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "batch_norm",
    "clamp", "leaky_relu", "add_scalar", "sub_scalar", "mul_scalar", "div_scalar", "argmin", "logsumexp",
    "max_all", "min_all", "masked_fill", "rms_norm", "group_norm", "gather", "scatter_add", "index_copy", "tril",
    "triu", "pad", "cumsum", "topk", "split", "one_hot", "repeat",
};

#define NELEM(a) (sizeof(a) / sizeof((a)[0]))

static double attr1(const refcase *c, const char *name, bool *ok)
{
  const ref_attr *a = ref_find_attr(c, name);
  if (!a || a->n < 1) {
    *ok = false;
    return 0;
  }
  return a->v[0];
}

static int attr_list(const refcase *c, const char *name, int64_t *v, bool *ok)
{
  const ref_attr *a = ref_find_attr(c, name);
  if (!a) {
    *ok = false;
    return 0;
  }
  for (int k = 0; k < a->n; k++)
    v[k] = (int64_t)a->v[k];
  return a->n;
}

/* An in-place op returns dst itself; its outputs are dst and dst's base. */
static void inplace_results(const refcase *c, kiln_tensor *r, kiln_tensor *dst, kiln_tensor *base,
                            kiln_tensor **out)
{
  if (r && r != dst) {
    fprintf(stderr, "case %d [%s %s]: returned a tensor other than dst\n", c->index, c->family, c->op);
    r = NULL;
  }
  out[0] = r;
  out[1] = r ? base : NULL;
}

/* A pair of ints attribute into p (true), or false when the case has none (NULL: the default). */
static bool attr_pair(const refcase *c, const char *name, int p[2])
{
  const ref_attr *a = ref_find_attr(c, name);
  if (!a || a->n != 2)
    return false;
  p[0] = (int)a->v[0];
  p[1] = (int)a->v[1];
  return true;
}

/* The convolution, pooling and batch norm cases; false for other ops. The
 * gradient primitives have no public call: they go to op_dispatch. */
static bool conv_dispatch(const refcase *c, kiln_tensor **in, kiln_tensor **out, bool *ok)
{
  const char *op = c->op;
  int s[2] = {0}, p[2] = {0}, d[2] = {0}, k[2] = {0};
  bool hs = attr_pair(c, "stride", s), hp = attr_pair(c, "padding", p), hd = attr_pair(c, "dilation", d);
  if (strcmp(op, "conv2d") == 0) {
    out[0] = kiln_conv2d(in[0], in[1], c->nin == 3 ? in[2] : NULL, hs ? s : NULL, hp ? p : NULL, hd ? d : NULL,
                         (int)attr1(c, "groups", ok));
  } else if (strcmp(op, "conv1d") == 0) {
    out[0] = kiln_conv1d(in[0], in[1], c->nin == 3 ? in[2] : NULL, (int)attr1(c, "stride", ok), (int)attr1(c, "padding", ok),
                         (int)attr1(c, "dilation", ok), (int)attr1(c, "groups", ok));
  } else if (strcmp(op, "conv2d_grad_input") == 0 || strcmp(op, "conv2d_grad_weight") == 0) {
    op_attrs a = {.nints = 7, .ints = {s[0], s[1], p[0], p[1], d[0], d[1], (int64_t)attr1(c, "groups", ok)}};
    *ok = *ok && hs && hp && hd;
    out[0] = op_dispatch(strcmp(op, "conv2d_grad_input") == 0 ? OP_CONV2D_GRAD_INPUT : OP_CONV2D_GRAD_WEIGHT, in, 3, &a, __FILE__, __LINE__);
  } else if (strcmp(op, "max_pool2d") == 0 || strcmp(op, "avg_pool2d") == 0) {
    *ok = *ok && attr_pair(c, "kernel", k);
    out[0] = (op[0] == 'm' ? kiln_max_pool2d_at : kiln_avg_pool2d_at)(in[0], k, hs ? s : NULL, hp ? p : NULL, __FILE__, __LINE__);
  } else if (strcmp(op, "max_pool2d_grad") == 0 || strcmp(op, "avg_pool2d_grad") == 0) {
    *ok = *ok && attr_pair(c, "kernel", k) && hs && hp;
    op_attrs a = {.nints = 6, .ints = {k[0], k[1], s[0], s[1], p[0], p[1]}};
    out[0] = op_dispatch(op[0] == 'm' ? OP_MAX_POOL2D_GRAD : OP_AVG_POOL2D_GRAD, in, 2, &a, __FILE__, __LINE__);
  } else if (strcmp(op, "adaptive_avg_pool2d") == 0) {
    *ok = *ok && attr_pair(c, "out", k);
    out[0] = kiln_adaptive_avg_pool2d(in[0], k);
  } else if (strcmp(op, "adaptive_avg_pool2d_grad") == 0) {
    *ok = *ok && attr_pair(c, "out", k);
    op_attrs a = {.nints = 2, .ints = {k[0], k[1]}};
    out[0] = op_dispatch(OP_ADAPTIVE_AVG_POOL2D_GRAD, in, 2, &a, __FILE__, __LINE__);
  } else if (strcmp(op, "batch_norm") == 0) {
    bool affine = c->nin == 5;
    out[0] = kiln_batch_norm(in[0], in[1], in[2], affine ? in[3] : NULL, affine ? in[4] : NULL, attr1(c, "training", ok) != 0,
                             attr1(c, "momentum", ok), attr1(c, "eps", ok));
    out[1] = in[1];
    out[2] = in[2];
  } else {
    return false;
  }
  return true;
}

/* Runs c's op on ins; the results go to out[0..nout). false when the case
 * names an op or attribute this runner does not know. base0 is the base
 * tensor of input 0 (the in-place ops check it). */
static bool dispatch(const refcase *c, kiln_tensor **in, kiln_tensor *base0, kiln_tensor **out)
{
  const char *op = c->op;
  bool ok = true;
  int64_t list[KILN_MAX_DIMS];
  int ilist[KILN_MAX_DIMS];

  for (size_t k = 0; k < NELEM(binary_ops); k++)
    if (strcmp(op, binary_ops[k].name) == 0 && c->nin == 2) {
      out[0] = binary_ops[k].fn(in[0], in[1], __FILE__, __LINE__);
      return true;
    }
  for (size_t k = 0; k < NELEM(unary_ops); k++)
    if (strcmp(op, unary_ops[k].name) == 0 && c->nin == 1) {
      out[0] = unary_ops[k].fn(in[0], __FILE__, __LINE__);
      return true;
    }
  for (size_t k = 0; k < NELEM(reduce_ops); k++)
    if (strcmp(op, reduce_ops[k].name) == 0) {
      int axis = (int)attr1(c, "axis", &ok);
      bool keepdim = attr1(c, "keepdim", &ok) != 0;
      out[0] = reduce_ops[k].fn(in[0], axis, keepdim, __FILE__, __LINE__);
      return ok;
    }
  for (size_t k = 0; k < NELEM(reduce_axes_ops); k++)
    if (strcmp(op, reduce_axes_ops[k].name) == 0) {
      int n = attr_list(c, "axes", list, &ok);
      for (int j = 0; j < n; j++)
        ilist[j] = (int)list[j];
      bool keepdim = attr1(c, "keepdim", &ok) != 0;
      out[0] = reduce_axes_ops[k].fn(in[0], n ? ilist : NULL, n, keepdim, __FILE__, __LINE__);
      return ok;
    }
  for (size_t k = 0; k < NELEM(inplace_ops); k++)
    if (strcmp(op, inplace_ops[k].name) == 0) {
      kiln_tensor *r = inplace_ops[k].fn(in[0], in[1], __FILE__, __LINE__);
      inplace_results(c, r, in[0], base0, out);
      return true;
    }

  static const struct {
    const char *name;
    kiln_tensor *(*fn)(kiln_tensor *, double, const char *, int);
  } scalar_ops[] = {{"add_scalar", kiln_add_scalar_at}, {"sub_scalar", kiln_sub_scalar_at},
                    {"mul_scalar", kiln_mul_scalar_at}, {"div_scalar", kiln_div_scalar_at},
                    {"leaky_relu", kiln_leaky_relu_at}};
  for (size_t k = 0; k < NELEM(scalar_ops); k++)
    if (strcmp(op, scalar_ops[k].name) == 0) {
      double v = attr1(c, k == 4 ? "slope" : "value", &ok);
      out[0] = scalar_ops[k].fn(in[0], v, __FILE__, __LINE__);
      return ok;
    }
  if (strcmp(op, "max_all") == 0 || strcmp(op, "min_all") == 0) {
    out[0] = (op[1] == 'a' ? kiln_max_all_at : kiln_min_all_at)(in[0], __FILE__, __LINE__);
    return true;
  }
  if (strcmp(op, "masked_fill") == 0) {
    out[0] = kiln_masked_fill(in[0], in[1], attr1(c, "value", &ok));
    return ok;
  }
  if (strcmp(op, "rms_norm") == 0) {
    out[0] = kiln_rms_norm(in[0], c->nin > 1 ? in[1] : NULL, attr1(c, "eps", &ok));
    return ok;
  }
  if (strcmp(op, "group_norm") == 0) {
    int groups = (int)attr1(c, "groups", &ok);
    out[0] = kiln_group_norm(in[0], groups, c->nin > 1 ? in[1] : NULL, c->nin > 2 ? in[2] : NULL, attr1(c, "eps", &ok));
    return ok;
  }
  if (strcmp(op, "gather") == 0) {
    out[0] = kiln_gather(in[0], (int)attr1(c, "dim", &ok), in[1]);
    return ok;
  }
  if (strcmp(op, "scatter_add") == 0 || strcmp(op, "index_copy") == 0) {
    out[0] = (op[0] == 's' ? kiln_scatter_add_at : kiln_index_copy_at)(in[0], (int)attr1(c, "dim", &ok), in[1], in[2],
                                                                         __FILE__, __LINE__);
    return ok;
  }
  if (strcmp(op, "tril") == 0 || strcmp(op, "triu") == 0) {
    int64_t k = (int64_t)attr1(c, "k", &ok);
    out[0] = op[3] == 'l' ? kiln_tril(in[0], k) : kiln_triu(in[0], k);
    return ok;
  }
  if (strcmp(op, "pad") == 0) {
    int n = attr_list(c, "pads", list, &ok);
    out[0] = kiln_pad(in[0], n, list, attr1(c, "value", &ok));
    return ok;
  }
  if (strcmp(op, "cumsum") == 0) {
    out[0] = kiln_cumsum(in[0], (int)attr1(c, "dim", &ok));
    return ok;
  }
  if (strcmp(op, "topk") == 0) {
    int64_t k = (int64_t)attr1(c, "k", &ok);
    int dim = (int)attr1(c, "dim", &ok);
    bool largest = attr1(c, "largest", &ok) != 0;
    if (kiln_topk(in[0], k, dim, largest, &out[0], &out[1]))
      out[0] = out[1] = NULL;
    return ok;
  }
  if (strcmp(op, "split") == 0) {
    kiln_tensor *pieces[16];
    int n = kiln_split_n(in[0], (int64_t)attr1(c, "size", &ok), (int)attr1(c, "dim", &ok), pieces, 16);
    if (n != c->nout) {
      fprintf(stderr, "case %d: split made %d pieces, expected %d\n", c->index, n, c->nout);
      return false;
    }
    for (int k = 0; k < n; k++)
      out[k] = pieces[k];
    return ok;
  }
  if (strcmp(op, "one_hot") == 0) {
    out[0] = kiln_one_hot(in[0], (int64_t)attr1(c, "n", &ok));
    return ok;
  }
  if (strcmp(op, "repeat") == 0) {
    int n = attr_list(c, "reps", list, &ok);
    out[0] = kiln_repeat(in[0], n, list);
    return ok;
  }
  if (strcmp(op, "clamp") == 0) {
    double lo = attr1(c, "lo", &ok), hi = attr1(c, "hi", &ok);
    out[0] = kiln_clamp(in[0], lo, hi);
    return ok;
  }
  if (strcmp(op, "where") == 0) {
    out[0] = kiln_where(in[0], in[1], in[2]);
  } else if (strcmp(op, "var") == 0) {
    int axis = (int)attr1(c, "axis", &ok);
    int corr = (int)attr1(c, "correction", &ok);
    out[0] = kiln_var(in[0], axis, corr, attr1(c, "keepdim", &ok) != 0);
  } else if (strcmp(op, "var_axes") == 0) {
    int n = attr_list(c, "axes", list, &ok);
    for (int j = 0; j < n; j++)
      ilist[j] = (int)list[j];
    int corr = (int)attr1(c, "correction", &ok);
    out[0] = kiln_var_axes(in[0], n ? ilist : NULL, n, corr, attr1(c, "keepdim", &ok) != 0);
  } else if (strcmp(op, "sum_all") == 0) {
    out[0] = kiln_sum_all(in[0]);
  } else if (strcmp(op, "mean_all") == 0) {
    out[0] = kiln_mean_all(in[0]);
  } else if (strcmp(op, "matmul") == 0) {
    out[0] = kiln_matmul(in[0], in[1]);
  } else if (strcmp(op, "softmax") == 0) {
    out[0] = kiln_softmax(in[0], (int)attr1(c, "axis", &ok));
  } else if (strcmp(op, "log_softmax") == 0) {
    out[0] = kiln_log_softmax(in[0], (int)attr1(c, "axis", &ok));
  } else if (strcmp(op, "layer_norm") == 0) {
    double eps = attr1(c, "eps", &ok);
    out[0] = kiln_layer_norm(in[0], c->nin == 3 ? in[1] : NULL, c->nin == 3 ? in[2] : NULL, eps);
  } else if (strcmp(op, "embedding") == 0) {
    out[0] = kiln_embedding(in[0], in[1]);
  } else if (strcmp(op, "index_select") == 0) {
    out[0] = kiln_index_select(in[0], (int)attr1(c, "dim", &ok), in[1]);
  } else if (strcmp(op, "cross_entropy") == 0) {
    out[0] = kiln_cross_entropy(in[0], in[1]);
  } else if (strcmp(op, "mse_loss") == 0) {
    out[0] = kiln_mse_loss(in[0], in[1]);
  } else if (strcmp(op, "reshape") == 0) {
    int n = attr_list(c, "shape", list, &ok);
    out[0] = kiln_reshape(in[0], n, list);
  } else if (strcmp(op, "transpose") == 0) {
    out[0] = kiln_transpose(in[0], (int)attr1(c, "d0", &ok), (int)attr1(c, "d1", &ok));
  } else if (strcmp(op, "permute") == 0) {
    int n = attr_list(c, "perm", list, &ok);
    for (int j = 0; j < n; j++)
      ilist[j] = (int)list[j];
    out[0] = kiln_permute(in[0], ilist);
  } else if (strcmp(op, "expand") == 0) {
    int n = attr_list(c, "shape", list, &ok);
    out[0] = kiln_expand(in[0], n, list);
  } else if (strcmp(op, "squeeze") == 0) {
    out[0] = kiln_squeeze(in[0], (int)attr1(c, "dim", &ok));
  } else if (strcmp(op, "unsqueeze") == 0) {
    out[0] = kiln_unsqueeze(in[0], (int)attr1(c, "dim", &ok));
  } else if (strcmp(op, "slice") == 0) {
    int dim = (int)attr1(c, "dim", &ok);
    int64_t start = (int64_t)attr1(c, "start", &ok), end = (int64_t)attr1(c, "end", &ok);
    out[0] = kiln_slice(in[0], dim, start, end, (int64_t)attr1(c, "step", &ok));
  } else if (strcmp(op, "contiguous") == 0) {
    out[0] = kiln_contiguous(in[0]);
    if (out[0] && !kiln_is_contiguous(out[0])) {
      fprintf(stderr, "case %d [views contiguous]: result is not contiguous\n", c->index);
      out[0] = NULL;
    }
  } else if (strcmp(op, "cat") == 0) {
    out[0] = kiln_cat(in, c->nin, (int)attr1(c, "dim", &ok));
  } else if (strcmp(op, "stack") == 0) {
    out[0] = kiln_stack(in, c->nin, (int)attr1(c, "dim", &ok));
  } else if (strcmp(op, "cast") == 0) {
    out[0] = kiln_cast(in[0], (kiln_dtype)attr1(c, "dtype", &ok));
  } else if (strcmp(op, "zeros") == 0 || strcmp(op, "ones") == 0 || strcmp(op, "full") == 0) {
    kiln_dtype dt = (kiln_dtype)attr1(c, "dtype", &ok);
    int n = attr_list(c, "shape", list, &ok);
    if (op[0] == 'z')
      out[0] = kiln_zeros(dt, n, list);
    else if (op[0] == 'o')
      out[0] = kiln_ones(dt, n, list);
    else
      out[0] = kiln_full(dt, n, list, attr1(c, "value", &ok));
  } else if (strcmp(op, "scalar") == 0) {
    out[0] = kiln_scalar((kiln_dtype)attr1(c, "dtype", &ok), attr1(c, "value", &ok));
  } else if (strcmp(op, "arange") == 0) {
    kiln_dtype dt = (kiln_dtype)attr1(c, "dtype", &ok);
    double start = attr1(c, "start", &ok), stop = attr1(c, "stop", &ok);
    out[0] = kiln_arange(dt, start, stop, attr1(c, "step", &ok));
  } else if (conv_dispatch(c, in, out, &ok)) {
  } else if (strcmp(op, "attention") == 0) {
    /* made by the compiler's attention pass, never called: straight to dispatch */
    op_attrs a = {.value = attr1(c, "scale", &ok), .flag = attr1(c, "drop", &ok) != 0};
    out[0] = op_dispatch(OP_ATTENTION, in, c->nin, &a, __FILE__, __LINE__);
  } else if (strcmp(op, "attention_grad") == 0) {
    op_attrs a = {.value = attr1(c, "scale", &ok), .flag = attr1(c, "drop", &ok) != 0};
    out[0] = op_dispatch(OP_ATTENTION_GRAD, in, c->nin, &a, __FILE__, __LINE__);
  } else if (strcmp(op, "fill_") == 0 || strcmp(op, "zero_") == 0) {
    kiln_tensor *r = op[0] == 'f' ? kiln_fill_(in[0], attr1(c, "value", &ok)) : kiln_zero_(in[0]);
    inplace_results(c, r, in[0], base0, out);
  } else {
    return false;
  }
  return ok;
}

/* Expected strides (in elements) where the case gives them. */
static int check_strides(const refcase *c, const kiln_tensor *t)
{
  const ref_attr *a = ref_find_attr(c, "strides");
  if (!a || !t)
    return 0;
  for (int d = 0; d < a->n; d++)
    if (kiln_stride(t, d) != (int64_t)a->v[d]) {
      ref_describe(c, stderr);
      fprintf(stderr, "  stride of dim %d: expected %lld, got %lld\n", d, (long long)a->v[d],
              (long long)kiln_stride(t, d));
      return 1;
    }
  return 0;
}

/* Runs one case inside a scope; 0 when every output matches and the scope
 * gave back all the storage it took. */
static int run_case(const refcase *c)
{
  int bad = 0;
  size_t mem0 = kiln_mem_in_use();
  kiln_clear_error();
  kiln_scope_begin();
  kiln_tensor *in[REF_MAX_IN] = {0}, *out[REF_MAX_OUT] = {0}, *base0 = NULL;
  for (int k = 0; k < c->nin; k++) {
    in[k] = ref_make(&c->in[k], k == 0 ? &base0 : NULL);
    if (!in[k]) {
      ref_describe(c, stderr);
      fprintf(stderr, "  making input %d failed: %s\n", k, kiln_last_error());
      bad = 1;
    }
  }
  if (!bad) {
    if (!dispatch(c, in, base0, out)) {
      ref_describe(c, stderr);
      fprintf(stderr, "  the runner does not know this op or misses an attribute\n");
      bad = 1;
    } else {
      for (int k = 0; k < c->nout; k++)
        bad |= ref_check(c, k, out[k], stderr);
      if (!bad)
        bad |= check_strides(c, out[0]);
    }
  }
  kiln_scope_end();
  size_t mem1 = kiln_mem_in_use();
  if (mem1 != mem0) {
    ref_describe(c, stderr);
    fprintf(stderr, "  storage in use went from %zu to %zu bytes across the scope\n", mem0, mem1);
    bad = 1;
  }
  return bad;
}

static void run_family(const char *family)
{
  int n = 0, nbad = 0;
  for (int k = 0; k < refs.n; k++)
    if (strcmp(refs.cases[k].family, family) == 0) {
      n++;
      nbad += run_case(&refs.cases[k]);
    }
  ck_assert_msg(n > 0, "no '%s' cases in the reference file", family);
  ck_assert_msg(nbad == 0, "%d of %d '%s' cases failed (details on stderr)", nbad, n, family);
}

START_TEST(test_binary) { run_family("binary"); }
END_TEST
START_TEST(test_compare) { run_family("compare"); }
END_TEST
START_TEST(test_where) { run_family("where"); }
END_TEST
START_TEST(test_unary) { run_family("unary"); }
END_TEST
START_TEST(test_reduce) { run_family("reduce"); }
END_TEST
START_TEST(test_matmul) { run_family("matmul"); }
END_TEST
START_TEST(test_nn) { run_family("nn"); }
END_TEST
START_TEST(test_views) { run_family("views"); }
END_TEST
START_TEST(test_creation) { run_family("creation"); }
END_TEST
START_TEST(test_inplace) { run_family("inplace"); }
END_TEST
/* f16, bf16 and i32: computed wide, rounded once; promotion between dtypes */
START_TEST(test_narrow) { run_family("narrow"); }
END_TEST
START_TEST(test_conv) { run_family("conv"); }
END_TEST
START_TEST(test_pool) { run_family("pool"); }
END_TEST
START_TEST(test_norm) { run_family("norm"); }
END_TEST
START_TEST(test_data) { run_family("data"); }
END_TEST
START_TEST(test_attention) { run_family("attention"); }
END_TEST
/* Large tensors, with 3 threads so that chunk edges fall mid-row. */
START_TEST(test_big)
{
  int nt = kiln_get_num_threads();
  kiln_set_num_threads(3);
  run_family("big");
  kiln_set_num_threads(nt);
}
END_TEST

static int count_op(const char *op)
{
  int n = 0;
  for (int k = 0; k < refs.n; k++)
    n += strcmp(refs.cases[k].op, op) == 0;
  return n;
}

/* Primitives no public call reaches directly, or that numpy cannot stand for: what tests them instead. */
static const struct {
  const char *op, *covered_by;
} indirect[] = {
    {"index_add", "the gradient of index_select and embedding (test_autograd, finite differences)"},
    {"slice_scatter", "the gradient of slice (test_autograd, finite differences)"},
    {"index_add_to", "a tied embedding's gradient, eager's index_add and add to the bit (test_codegen, "
                     "test_tied_rows_added_in_place)"},
    {"index_check", "cross entropy's targets and one_hot's indices (test_compile: test_bad_targets_compiled, test_index_checks_every_call)"},
    {"rand", "the default generator's numbers against kiln_rand's stream, eager and compiled (test_capture)"},
    {"allreduce", "a collective: hand-derived sums over 1, 2 and 3 processes under mpirun, eager, gradient, "
                  "interpreter and compiled (test_dist)"},
};

/* The file covers every primitive of the op table, every composite op and
 * every op of kiln.h's op sections. */
START_TEST(test_coverage)
{
  for (int op = 0; op < OP_COUNT; op++) {
    const char *name = op_table[op].name;
    bool elsewhere = false;
    for (size_t k = 0; k < NELEM(indirect); k++)
      elsewhere |= strcmp(indirect[k].op, name) == 0;
    ck_assert_msg(elsewhere || count_op(name) > 0, "no numpy cases for the primitive %s (tests/gen_refs.py)", name);
  }
#define C(name, made_of) ck_assert_msg(count_op(#name) > 0, "no numpy cases for the composite %s", #name);
#include "eager/composites.def"
#undef C
  for (size_t k = 0; k < NELEM(binary_ops); k++)
    ck_assert_msg(count_op(binary_ops[k].name) > 0, "no cases for %s", binary_ops[k].name);
  for (size_t k = 0; k < NELEM(unary_ops); k++)
    ck_assert_msg(count_op(unary_ops[k].name) > 0, "no cases for %s", unary_ops[k].name);
  for (size_t k = 0; k < NELEM(other_ops); k++)
    ck_assert_msg(count_op(other_ops[k]) > 0, "no cases for %s", other_ops[k]);
  ck_assert_uint_eq(1, kiln_dtype_size(KILN_BOOL)); /* the runner writes bools as bytes */
}
END_TEST

/* ---- hand-derived values ---------------------------------------------- */

static kiln_tensor *vec64(int n, const double *v)
{
  int64_t s[1] = {n};
  return kiln_tensor_from(KILN_F64, 1, s, v);
}

/* t is f64 (or f32) with the given values, to within tol. */
static void expect_f(const kiln_tensor *t, int n, const double *want, double tol, int line)
{
  ck_assert_msg(t != NULL, "line %d: NULL: %s", line, kiln_last_error());
  ck_assert_msg(kiln_numel(t) == n, "line %d: numel %lld, expected %d", line, (long long)kiln_numel(t), n);
  double got[16];
  float gf[16];
  ck_assert(n <= 16);
  if (kiln_type(t) == KILN_F32) {
    ck_assert_int_eq(0, kiln_read(t, gf, (size_t)n * sizeof(float)));
    for (int k = 0; k < n; k++)
      got[k] = gf[k];
  } else {
    ck_assert_int_eq(KILN_F64, kiln_type(t));
    ck_assert_int_eq(0, kiln_read(t, got, (size_t)n * sizeof(double)));
  }
  for (int k = 0; k < n; k++)
    ck_assert_msg(fabs(got[k] - want[k]) <= tol, "line %d: element %d: expected %.17g, got %.17g (diff %.3g)",
                  line, k, want[k], got[k], fabs(got[k] - want[k]));
}
#define EXPECT_F(t, n, want, tol) expect_f((t), (n), (want), (tol), __LINE__)

static void expect_i(const kiln_tensor *t, int n, const int64_t *want, int line)
{
  ck_assert_msg(t != NULL, "line %d: NULL: %s", line, kiln_last_error());
  ck_assert_int_eq(KILN_I64, kiln_type(t));
  ck_assert_int_eq(n, kiln_numel(t));
  int64_t got[16];
  ck_assert(n <= 16);
  ck_assert_int_eq(0, kiln_read(t, got, (size_t)n * sizeof(int64_t)));
  for (int k = 0; k < n; k++)
    ck_assert_msg(got[k] == want[k], "line %d: element %d: expected %lld, got %lld", line, k,
                  (long long)want[k], (long long)got[k]);
}
#define EXPECT_I(t, n, ...) expect_i((t), (n), (const int64_t[]){__VA_ARGS__}, __LINE__)

START_TEST(test_hand_nn)
{
  size_t mem0 = kiln_mem_in_use();
  kiln_scope_begin();
  const double L3 = log(3.0);
  /* softmax([0, ln 3]): exp gives 1 and 3, sum 4 */
  EXPECT_F(kiln_softmax(vec64(2, (double[]){0, L3}), 0), 2, ((double[]){0.25, 0.75}), 1e-15);
  EXPECT_F(kiln_softmax(kiln_cast(vec64(2, (double[]){0, L3}), KILN_F32), -1), 2, ((double[]){0.25, 0.75}), 1e-6);
  /* softmax is shift invariant: [1000, 1000 + ln 3] gives the same */
  EXPECT_F(kiln_softmax(vec64(2, (double[]){1000, 1000 + L3}), 0), 2, ((double[]){0.25, 0.75}), 1e-12);
  /* log_softmax([0, 0]) = -ln 2 twice */
  EXPECT_F(kiln_log_softmax(vec64(2, (double[]){0, 0}), 0), 2, ((double[]){-log(2.0), -log(2.0)}), 1e-15);
  /* sigmoid(ln 3) = 1/(1 + 1/3) = 0.75; sigmoid(-ln 3) = 0.25 */
  EXPECT_F(kiln_sigmoid(vec64(3, (double[]){0, L3, -L3})), 3, ((double[]){0.5, 0.75, 0.25}), 1e-15);
  /* gelu_erf(1) = Phi(1) = 0.5*(1 + erf(1/sqrt 2)), the normal CDF at 1 */
  EXPECT_F(kiln_gelu_erf(vec64(3, (double[]){1, -1, 0})), 3,
           ((double[]){0.8413447460685429, -0.15865525393145707, 0}), 1e-12);
  /* gelu (tanh form) saturates: x for large x, 0 for very negative x */
  EXPECT_F(kiln_gelu(vec64(3, (double[]){0, 10, -10})), 3, ((double[]){0, 10, 0}), 1e-12);
  EXPECT_F(kiln_relu(vec64(3, (double[]){-2, 0, 3})), 3, ((double[]){0, 0, 3}), 0);
  /* var([1,2,3,4]): squared deviations sum to 5; mean 2.5 */
  kiln_tensor *x4 = vec64(4, (double[]){1, 2, 3, 4});
  EXPECT_F(kiln_var(x4, 0, 1, false), 1, ((double[]){5.0 / 3.0}), 1e-15);
  EXPECT_F(kiln_var(x4, 0, 0, false), 1, ((double[]){1.25}), 1e-15);
  EXPECT_F(kiln_mean(x4, 0, false), 1, ((double[]){2.5}), 0);
  /* layer_norm([1,2,3]): mean 2, biased var 2/3; eps 1/3 makes the denominator 1 */
  int64_t s13[2] = {1, 3};
  kiln_tensor *x3 = kiln_reshape(vec64(3, (double[]){1, 2, 3}), 2, s13);
  EXPECT_F(kiln_layer_norm(x3, NULL, NULL, 1.0 / 3.0), 3, ((double[]){-1, 0, 1}), 1e-15);
  EXPECT_F(kiln_layer_norm(x3, vec64(3, (double[]){2, 2, 2}), vec64(3, (double[]){1, 1, 1}), 1.0 / 3.0), 3,
           ((double[]){-1, 1, 3}), 1e-15);
  /* cross_entropy rows [0, ln 3] with targets 1, 0: (-ln 0.75 - ln 0.25)/2 = ln(16/3)/2 */
  int64_t s22[2] = {2, 2};
  kiln_tensor *lg = kiln_tensor_from(KILN_F64, 2, s22, ((double[]){0, L3, 0, L3}));
  int64_t s2[1] = {2};
  kiln_tensor *tg = kiln_tensor_from(KILN_I64, 1, s2, ((int64_t[]){1, 0}));
  kiln_tensor *ce = kiln_cross_entropy(lg, tg);
  ck_assert_int_eq(0, kiln_ndim(ce));
  EXPECT_F(ce, 1, ((double[]){log(16.0 / 3.0) / 2}), 1e-15);
  /* mse_loss([1,2],[3,5]) = (4 + 9)/2; broadcast [[1],[2]] vs [0,1]: (1+0+4+1)/4 */
  EXPECT_F(kiln_mse_loss(vec64(2, (double[]){1, 2}), vec64(2, (double[]){3, 5})), 1, ((double[]){6.5}), 0);
  int64_t s21[2] = {2, 1};
  kiln_tensor *col = kiln_tensor_from(KILN_F64, 2, s21, ((double[]){1, 2}));
  EXPECT_F(kiln_mse_loss(col, vec64(2, (double[]){0, 1})), 1, ((double[]){1.5}), 0);
  /* embedding picks rows: table [[1,2],[3,4],[5,6]], idx [2,0,2] */
  int64_t s32[2] = {3, 2}, s3[1] = {3};
  kiln_tensor *tab = kiln_tensor_from(KILN_F64, 2, s32, ((double[]){1, 2, 3, 4, 5, 6}));
  kiln_tensor *emb = kiln_embedding(tab, kiln_tensor_from(KILN_I64, 1, s3, ((int64_t[]){2, 0, 2})));
  EXPECT_F(emb, 6, ((double[]){5, 6, 1, 2, 5, 6}), 0);
  ck_assert_int_eq(2, kiln_ndim(emb));
  kiln_scope_end();
  ck_assert_uint_eq(mem0, kiln_mem_in_use());
}
END_TEST

/* max/min along rows long enough for the vector loop: a NaN anywhere (in
 * the vector part or the tail) is the result, and so is the first of two;
 * otherwise the extreme value, wherever it sits. */
START_TEST(test_hand_extremes)
{
  kiln_scope_begin();
  for (int dt = 0; dt < 2; dt++) {
    enum { N = 37 };
    double v[4][N];
    for (int r = 0; r < 4; r++)
      for (int i = 0; i < N; i++) v[r][i] = (double)((i * 7 + r) % N) - 18.5; /* a permutation of -18.5..17.5 */
    v[1][20] = NAN;   /* in the vector part */
    v[2][35] = -NAN;  /* in the tail */
    v[3][3] = NAN, v[3][30] = -NAN;
    int64_t sh[2] = {4, N};
    kiln_tensor *x = kiln_tensor_from(KILN_F64, 2, sh, &v[0][0]);
    if (dt == 0) x = kiln_cast(x, KILN_F32);
    double mx[4], mn[4];
    kiln_tensor *m = kiln_cast(kiln_max(x, 1, false), KILN_F64), *n = kiln_cast(kiln_min(x, 1, false), KILN_F64);
    ck_assert_int_eq(0, kiln_read(m, mx, sizeof mx));
    ck_assert_int_eq(0, kiln_read(n, mn, sizeof mn));
    ck_assert_double_eq(mx[0], 17.5);
    ck_assert_double_eq(mn[0], -18.5);
    for (int r = 1; r < 4; r++) ck_assert_msg(isnan(mx[r]) && isnan(mn[r]), "dtype %d row %d: %g %g", dt, r, mx[r], mn[r]);
    ck_assert(!signbit(mx[1]) && signbit(mx[2]) && !signbit(mx[3]));
  }
  kiln_scope_end();
}
END_TEST

START_TEST(test_hand_math)
{
  size_t mem0 = kiln_mem_in_use();
  kiln_scope_begin();
  /* [[1,2],[3,4]] @ [[5,6],[7,8]] = [[1*5+2*7, 1*6+2*8], [3*5+4*7, 3*6+4*8]] */
  int64_t s22[2] = {2, 2};
  kiln_tensor *a = kiln_tensor_from(KILN_F64, 2, s22, ((double[]){1, 2, 3, 4}));
  kiln_tensor *b = kiln_tensor_from(KILN_F64, 2, s22, ((double[]){5, 6, 7, 8}));
  EXPECT_F(kiln_matmul(a, b), 4, ((double[]){19, 22, 43, 50}), 0);
  /* a^T @ b = [[1*5+3*7, 1*6+3*8], [2*5+4*7, 2*6+4*8]] */
  EXPECT_F(kiln_matmul(kiln_transpose(a, 0, 1), b), 4, ((double[]){26, 30, 38, 44}), 0);
  /* 1-D . 1-D is a 0-d dot product: 4 + 10 + 18 */
  kiln_tensor *dot = kiln_matmul(vec64(3, (double[]){1, 2, 3}), vec64(3, (double[]){4, 5, 6}));
  ck_assert_int_eq(0, kiln_ndim(dot));
  EXPECT_F(dot, 1, ((double[]){32}), 0);
  /* pow: negative base with integral exponents, a root, and 0^0 = 1 */
  EXPECT_F(kiln_pow(vec64(4, (double[]){-2, -2, 4, 0}), vec64(4, (double[]){3, -2, 0.5, 0})), 4,
           ((double[]){-8, 0.25, 2, 1}), 1e-15);
  EXPECT_F(kiln_rsqrt(vec64(2, (double[]){4, 0.25})), 2, ((double[]){0.5, 2}), 1e-15);
  EXPECT_F(kiln_div(vec64(2, (double[]){1, -3}), vec64(2, (double[]){4, 2})), 2, ((double[]){0.25, -1.5}), 0);
  /* a 0-d operand broadcasts against anything */
  EXPECT_F(kiln_sub(kiln_scalar(KILN_F64, 10), vec64(3, (double[]){1, 2, 3})), 3, ((double[]){9, 8, 7}), 0);
  /* argmax: the first of tied maxima */
  EXPECT_I(kiln_argmax(vec64(4, (double[]){1, 3, 3, 2}), 0, false), 1, 1);
  kiln_tensor *m = kiln_tensor_from(KILN_I64, 2, s22, ((int64_t[]){5, 5, 1, 7}));
  EXPECT_I(kiln_argmax(m, 0, false), 2, 0, 1);
  EXPECT_I(kiln_argmax(m, 1, true), 2, 0, 1);
  ck_assert_int_eq(2, kiln_ndim(kiln_argmax(m, 1, true)));
  /* i64 stays exact past 2^53, where a trip through double would round */
  const int64_t big = (int64_t)1 << 60;
  int64_t s3[1] = {3}, s2[1] = {2};
  EXPECT_I(kiln_sum_all(kiln_tensor_from(KILN_I64, 1, s3, ((int64_t[]){big, 1, -big}))), 1, 1);
  /* i64 sums wrap (two's complement), as its add does: no overflow, in any of
   * the sum's paths (one row, strided, columns, blocks combined) */
  EXPECT_I(kiln_sum_all(kiln_tensor_from(KILN_I64, 1, s3, ((int64_t[]){INT64_MAX, 1, 1}))), 1, INT64_MIN + 1);
  int64_t s1[1] = {1};
  kiln_tensor *imax = kiln_tensor_from(KILN_I64, 1, s1, ((int64_t[]){INT64_MAX}));
  EXPECT_I(kiln_add(imax, kiln_tensor_from(KILN_I64, 1, s1, ((int64_t[]){1}))), 1, INT64_MIN);
  int64_t s22w[2] = {2, 2};
  kiln_tensor *mw = kiln_tensor_from(KILN_I64, 2, s22w, ((int64_t[]){INT64_MAX, INT64_MIN, 2, -1}));
  EXPECT_I(kiln_sum(mw, 0, false), 2, INT64_MIN + 1, INT64_MAX);
  EXPECT_I(kiln_sum(mw, 1, false), 2, -1, 1);
  EXPECT_I(kiln_sum(kiln_transpose(mw, 0, 1), 0, false), 2, -1, 1);
  EXPECT_I(kiln_sum(kiln_expand(imax, 1, ((int64_t[]){100000})), 0, false), 1, (int64_t)((uint64_t)INT64_MAX * 100000u));
  EXPECT_I(kiln_sum(kiln_contiguous(kiln_expand(imax, 1, ((int64_t[]){100000}))), 0, false), 1,
           (int64_t)((uint64_t)INT64_MAX * 100000u));
  kiln_tensor *bb = kiln_tensor_from(KILN_I64, 1, s2, ((int64_t[]){big, big + 1}));
  EXPECT_I(kiln_argmax(bb, 0, false), 1, 1);
  EXPECT_I(kiln_max(bb, 0, false), 1, big + 1);
  EXPECT_I(kiln_add(bb, kiln_scalar(KILN_I64, 1)), 2, big + 1, big + 2);
  /* cast: toward zero to i64, != 0 to bool */
  kiln_tensor *f = kiln_cast(vec64(4, (double[]){-2.7, 2.7, -0.5, 0}), KILN_F32);
  EXPECT_I(kiln_cast(f, KILN_I64), 4, -2, 2, 0, 0);
  kiln_tensor *bl = kiln_cast(f, KILN_BOOL);
  EXPECT_F(kiln_cast(bl, KILN_F64), 4, ((double[]){1, 1, 1, 0}), 0);
  /* comparisons give bool; where takes it */
  kiln_tensor *lt = kiln_lt(vec64(3, (double[]){1, 2, 3}), kiln_scalar(KILN_F64, 2));
  ck_assert_int_eq(KILN_BOOL, kiln_type(lt));
  EXPECT_F(kiln_where(lt, kiln_scalar(KILN_F64, -1), vec64(3, (double[]){7, 8, 9})), 3,
           ((double[]){-1, 8, 9}), 0);
  /* arange: [0, 1) by 1/4, and integers [0, 5) by 2 */
  EXPECT_F(kiln_arange(KILN_F64, 0, 1, 0.25), 4, ((double[]){0, 0.25, 0.5, 0.75}), 0);
  EXPECT_I(kiln_arange(KILN_I64, 0, 5, 2), 3, 0, 2, 4);
  kiln_scope_end();
  ck_assert_uint_eq(mem0, kiln_mem_in_use());
}
END_TEST

/* Views share storage: strides follow the layout, writes go through. */
START_TEST(test_hand_views)
{
  size_t mem0 = kiln_mem_in_use();
  kiln_scope_begin();
  int64_t s23[2] = {2, 3};
  kiln_tensor *x = kiln_zeros(KILN_F64, 2, s23);
  ck_assert(kiln_is_contiguous(x));
  ck_assert_int_eq(3, kiln_stride(x, 0));
  ck_assert_int_eq(1, kiln_stride(x, 1));
  kiln_tensor *xt = kiln_transpose(x, 0, 1);
  ck_assert_int_eq(1, kiln_stride(xt, 0));
  ck_assert_int_eq(3, kiln_stride(xt, 1));
  ck_assert(!kiln_is_contiguous(xt));
  int64_t s31[2] = {3, 1}, s34[2] = {3, 4};
  kiln_tensor *e = kiln_expand(kiln_zeros(KILN_F32, 2, s31), 2, s34);
  ck_assert_int_eq(0, kiln_stride(e, 1));
  /* a step-2 slice of columns 1 and 3, filled, shows in the base */
  int64_t s24[2] = {2, 4};
  kiln_tensor *base = kiln_zeros(KILN_F64, 2, s24);
  kiln_tensor *cols = kiln_slice(base, 1, 1, 4, 2);
  ck_assert_int_eq(2, kiln_stride(cols, 1));
  ck_assert_ptr_eq(cols, kiln_fill_(cols, 7));
  EXPECT_F(base, 8, ((double[]){0, 7, 0, 7, 0, 7, 0, 7}), 0);
  /* through a transposed view: row 0 of base^T is column 0 of base */
  kiln_tensor *row = kiln_slice(kiln_transpose(base, 0, 1), 0, 0, 1, 1);
  ck_assert_ptr_eq(row, kiln_add_(row, kiln_scalar(KILN_F64, 1)));
  EXPECT_F(base, 8, ((double[]){1, 7, 0, 7, 1, 7, 0, 7}), 0);
  /* dst and src the same tensor is the one overlap allowed */
  ck_assert_ptr_nonnull(kiln_add_(base, base));
  EXPECT_F(base, 8, ((double[]){2, 14, 0, 14, 2, 14, 0, 14}), 0);
  ck_assert_ptr_nonnull(kiln_zero_(cols));
  EXPECT_F(base, 8, ((double[]){2, 0, 0, 0, 2, 0, 0, 0}), 0);
  /* reshape with -1 infers 8 / 2 */
  int64_t sm1[2] = {-1, 2};
  kiln_tensor *r = kiln_reshape(base, 2, sm1);
  ck_assert_int_eq(4, kiln_size(r, 0));
  ck_assert_int_eq(2, kiln_size(r, -1));
  kiln_scope_end();
  ck_assert_uint_eq(mem0, kiln_mem_in_use());
}
END_TEST

/* rand and randn: deterministic per seed, in range, roughly the moments. */
START_TEST(test_hand_random)
{
  size_t mem0 = kiln_mem_in_use();
  kiln_scope_begin();
  enum { N = 20000 };
  int64_t s[1] = {N};
  static double u[N], v[N];
  ck_assert_int_eq(0, kiln_read(kiln_rand(KILN_F64, 1, s, 7), u, sizeof u));
  ck_assert_int_eq(0, kiln_read(kiln_rand(KILN_F64, 1, s, 7), v, sizeof v));
  ck_assert(memcmp(u, v, sizeof u) == 0);
  ck_assert_int_eq(0, kiln_read(kiln_rand(KILN_F64, 1, s, 8), v, sizeof v));
  ck_assert(memcmp(u, v, sizeof u) != 0);
  double mean = 0;
  for (int k = 0; k < N; k++) {
    ck_assert_msg(u[k] >= 0 && u[k] < 1, "rand[%d] = %g", k, u[k]);
    mean += u[k] / N;
  }
  ck_assert_msg(fabs(mean - 0.5) < 0.01, "rand mean %g", mean); /* sd of the mean is 0.002 */
  ck_assert_int_eq(0, kiln_read(kiln_randn(KILN_F64, 1, s, 7), u, sizeof u));
  double m1 = 0, m2 = 0;
  for (int k = 0; k < N; k++) {
    m1 += u[k] / N;
    m2 += u[k] * u[k] / N;
  }
  ck_assert_msg(fabs(m1) < 0.04 && fabs(m2 - 1) < 0.06, "randn mean %g, mean square %g", m1, m2);
  kiln_scope_end();
  ck_assert_uint_eq(mem0, kiln_mem_in_use());
}
END_TEST

/* Bad input gives NULL and a message naming the op and this file. */
static void expect_error(kiln_tensor *t, const char *op, int line)
{
  ck_assert_msg(t == NULL, "line %d: %s accepted bad input", line, op);
  const char *msg = kiln_last_error();
  ck_assert_msg(strstr(msg, op) != NULL && strstr(msg, "test_ops_ref.c:") != NULL,
                "line %d: error '%s' should name %s and test_ops_ref.c", line, msg, op);
  kiln_clear_error();
}
#define EXPECT_ERROR(t, op) expect_error((t), (op), __LINE__)

START_TEST(test_hand_errors)
{
  size_t mem0 = kiln_mem_in_use();
  kiln_scope_begin();
  int64_t s3[1] = {3}, s4[1] = {4}, s23[2] = {2, 3}, s45[2] = {4, 5}, s20[2] = {2, 0};
  kiln_tensor *a = kiln_zeros(KILN_F32, 1, s3), *b = kiln_zeros(KILN_F32, 1, s4);
  EXPECT_ERROR(kiln_add(a, b), "kiln_add");
  EXPECT_ERROR(kiln_div(kiln_ones(KILN_I64, 1, s3), kiln_ones(KILN_I64, 1, s3)), "kiln_div");
  EXPECT_ERROR(kiln_matmul(kiln_zeros(KILN_F32, 2, s23), kiln_zeros(KILN_F32, 2, s45)), "kiln_matmul");
  EXPECT_ERROR(kiln_max(kiln_zeros(KILN_F32, 2, s20), 1, false), "kiln_max");
  EXPECT_ERROR(kiln_sum(a, 1, false), "kiln_sum");
  ck_assert_ptr_null(kiln_exp(kiln_add(a, b))); /* NULL in, NULL out */
  ck_assert_ptr_null(kiln_mul(NULL, a));
  kiln_clear_error();
  ck_assert_str_eq("", kiln_last_error());
  kiln_scope_end();
  ck_assert_uint_eq(mem0, kiln_mem_in_use());
}
END_TEST

/* A row shorter than a block is summed pairwise like the rest: n equal
 * values, n a power of two, sum to exactly n*v, and their mean is v. In
 * order, 3v rounds and 8v does not come out (1.8734567f: 1.8734568f). */
START_TEST(test_hand_short_sums)
{
  kiln_scope_begin();
  const float vals[] = {1.87345672f, 2.70000005f, 1.89999998f, 0.1f, 3.14159274f};
  for (size_t k = 0; k < NELEM(vals); k++)
    for (int64_t n = 2; n <= 16; n *= 2) {
      int64_t sh[2] = {3, n};
      kiln_tensor *x = kiln_full(KILN_F32, 2, sh, vals[k]);
      float mean[3], sum[3];
      ck_assert_int_eq(0, kiln_read(kiln_mean(x, 1, false), mean, sizeof mean));
      ck_assert_int_eq(0, kiln_read(kiln_sum(x, 1, false), sum, sizeof sum));
      for (int r = 0; r < 3; r++) {
        ck_assert_msg(mean[r] == vals[k], "mean of %lld x %.9g: %.9g", (long long)n, vals[k], mean[r]);
        ck_assert_msg(sum[r] == vals[k] * (float)n, "sum of %lld x %.9g: %.9g", (long long)n, vals[k], sum[r]);
      }
    }
  kiln_scope_end();
}
END_TEST

static Suite *ops_ref_suite(void)
{
  Suite *s = suite_create("ops_ref");
  struct {
    const char *name;
    const TTest *test;
  } cases[] = {
      {"coverage", test_coverage}, {"binary", test_binary},     {"compare", test_compare},
      {"where", test_where},       {"unary", test_unary},       {"reduce", test_reduce},
      {"matmul", test_matmul},     {"nn", test_nn},             {"views", test_views},
      {"creation", test_creation}, {"inplace", test_inplace},   {"big", test_big},
      {"hand_nn", test_hand_nn},       {"hand_extremes", test_hand_extremes},
      {"hand_math", test_hand_math}, {"hand_views", test_hand_views}, {"hand_random", test_hand_random},
      {"hand_errors", test_hand_errors}, {"hand_short_sums", test_hand_short_sums},
      {"conv", test_conv}, {"pool", test_pool}, {"norm", test_norm}, {"data", test_data},
      {"narrow", test_narrow}, {"attention", test_attention},
  };
  for (size_t k = 0; k < NELEM(cases); k++) {
    TCase *tc = tcase_create(cases[k].name);
    tcase_set_timeout(tc, 120); /* sanitizer builds are slow */
    tcase_add_test(tc, cases[k].test);
    suite_add_tcase(s, tc);
  }
  return s;
}

int main(void)
{
  const char *dir = getenv("KILN_REFS_DIR");
  if (!dir || !*dir) {
    fprintf(stderr, "test_ops_ref: set KILN_REFS_DIR to a folder written by "
                    "'/usr/bin/python3 tests/gen_refs.py DIR'\n");
    return EXIT_FAILURE;
  }
  char err[16384];
  if (ref_file_load(dir, &refs, err, sizeof err) != 0) {
    fprintf(stderr, "test_ops_ref: %s\n", err);
    return EXIT_FAILURE;
  }
  SRunner *sr = srunner_create(ops_ref_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  ref_file_free(&refs);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
