/* The plan an exported model carries (codegen/export.c writes it, rt.c runs
 * it): one array of int64 words, so that it is the same data on every
 * 64-bit little-endian target and needs no relocations. Sizes are programs
 * over the symbols (s0, s1 ...) in a small postfix code (sym_code writes
 * them), evaluated per call: one export serves every size its guards allow.
 *
 *   header   PLAN_* words below
 *   symbols  per symbol: lo, hi, input, dim (the input dim it is bound from)
 *   inputs   per input: dtype, ndim, name (string offset), dims[RT_MAXD] (code offsets)
 *   outputs  per output: dtype, then a view
 *   buffers  per buffer: RT_BUF_* kind, dtype, numel (code), src, alias_of, first, last
 *   kernels  per kernel: the offset of its record (RT_K_LOOP or RT_K_MATMUL)
 *   guards   per guard: sym_cmp op, lhs (code), rhs (code), text (string offset)
 *
 * A graph with control flow is several *units*: the top graph (unit 0, its
 * header at word 0) and each region of its cond, while and scan nodes,
 * nested ones included, each a header and sections of its own laid out as
 * above, every offset counted from word 0. The top header's PLAN_UNITS
 * points at the table of the units' header offsets. A region's symbols are
 * the top's (its symbol rows bind from nothing: input -1), its inputs are
 * the region's arguments and its outputs what it gives back.
 *
 * A view: buf, offset (code), ndim, shape[RT_MAXD] (codes), stride[RT_MAXD] (codes).
 * The model (what the object's <name>_run passes to kiln_rt_run) points at
 * the plan, its strings, the kernels' addresses, the weights and a small
 * mutable state (the arena kept between calls). */
#ifndef KILN_RT_PLAN_H
#define KILN_RT_PLAN_H

#include <stddef.h>
#include <stdint.h>

#define RT_MAGIC 0x31706e6c6e6c696bll /* "kilnlnp1" */
/* Bumped when the plan's layout changes: a runtime reads only its own.
 * (test_export builds a runtime with another, to see the refusal.) */
#ifndef RT_PLAN_VERSION
#define RT_PLAN_VERSION 2
#endif
#define RT_MAXD 8 /* dims of a tensor (kiln's MAXD) */
#define RT_MAX_SYMS 64

enum {
  PLAN_MAGIC, PLAN_VERSION, PLAN_NSYMS, PLAN_NIN, PLAN_NOUT, PLAN_NBUF, PLAN_NK, PLAN_NGUARD,
  PLAN_SYMS, PLAN_INS, PLAN_OUTS, PLAN_BUFS, PLAN_KERNELS, PLAN_GUARDS, PLAN_NAME, PLAN_WORDS,
  PLAN_NUNIT, PLAN_UNITS, PLAN_NCF, /* the top's: units, their table, control-flow kernels */
  PLAN_HEADER
};
enum { SYM_WORDS = 4, IN_WORDS = 3 + RT_MAXD, VIEW_WORDS = 3 + 2 * RT_MAXD, OUT_WORDS = 1 + VIEW_WORDS,
       BUF_WORDS = 7, GUARD_WORDS = 4 };

/* The size code: postfix over a stack of int64, ended by RT_C_END. */
enum { RT_C_END, RT_C_CONST /* v */, RT_C_SYM /* id */, RT_C_ADD, RT_C_MUL, RT_C_FLOOR, RT_C_MOD };

enum { RT_BUF_INPUT, RT_BUF_WEIGHT, RT_BUF_TEMP, RT_BUF_OUTPUT };

/* Kernel records.
 *   RT_K_LOOP:   kind, fn (index in the kernel table), split, staged (0 or 1; the JIT also 2, 3), n_outer, ndim, dims[ndim] (codes),
 *                n_param, params[n_param] (codes), n_acc, then per access: buf, shift (elements)
 *   RT_K_MATMUL: kind, dtype, alpha and beta (a double's bits), then three views: a, b, out
 *   RT_K_GATHER: kind, dtype, dim, where (string offset: "index_select (file:line)"), then three
 *                views: the source, the i64 indices (1-D), out; out = source's slices at the indices along dim
 *   RT_K_CUMSUM: kind, dtype, dim, then two views: the source, out; out = the running sums along dim
 *                (f32's accumulated in f64, as eager's kernel)
 *   RT_K_CF:     kind, op (RT_CF_*), id (0 .. PLAN_NCF-1: its state in a call), n_in, n_carry, n_xs,
 *                unit0, unit1 (-1 for a scan), where (string offset), then per operand: dtype, a view.
 *                Runs the construct over its operands (a cond's first is the predicate) into
 *                result slots the call keeps; its node's value is nothing
 *   RT_K_GET:    kind, id (the RT_K_CF's), k, dtype, then a view: result k of that construct into it */
enum { RT_K_LOOP, RT_K_MATMUL, RT_K_GATHER, RT_K_CF, RT_K_GET, RT_K_CUMSUM };
enum { RT_CF_COND, RT_CF_WHILE, RT_CF_SCAN };
enum { CF_WORDS = 9 }; /* an RT_K_CF record's words before its operands */

/* A loop kernel's code: p its sizes, bufs its accesses' pointers (then a
 * scratch), [begin, end) the outer elements it runs (split: codegen.h). */
typedef void (*rt_kernel_fn)(const int64_t *p, char *const *bufs, int64_t begin, int64_t end);

/* What the object holds; its layout is the exporter's too (export.c builds
 * it as an LLVM constant), so fields are only pointers and int64s. */
typedef struct kiln_rt_model {
  const int64_t *plan;
  const char *strings;        /* NUL-ended texts the plan points into */
  const rt_kernel_fn *kernels;
  const unsigned char *weights; /* the embedded params and constants, 64-byte aligned each */
  int64_t *state;             /* RT_STATE_WORDS zeroed words: the kept arena */
} kiln_rt_model;
enum { RT_STATE_WORDS = 4 };

/* Outer elements a dot-product kernel runs per pass of its inner loop, and
 * the blocks of a split full reduction (codegen.h: CG_JAM, CG_BLOCKS). */
enum { RT_JAM = 4, RT_BLOCKS = 64 };
/* Elements of work per block of a loop kernel split over threads: one of
 * fewer than two blocks runs on the calling thread (loop.c). A dot-product
 * kernel (a matvec) runs as `staged` RT_STAGED_DOT or RT_STAGED_DOT_COARSE:
 * both split a small one in fixed shares of rows (each core's cache keeps
 * its part of the weight from call to call); RT_STAGED_DOT also takes a
 * finer grain, since a batch-1 layer of 256x256 pays for a second thread
 * that is already awake. The JIT's runtime passes it only then (a worker
 * awake, or runs back to back), else the coarse one; exported plans hold
 * 0 or 1, and rt.c runs 2 and 3 as given. */
enum { RT_GRAIN = 65536, RT_DOT_GRAIN = 16384, RT_STAGED_DOT = 2, RT_STAGED_DOT_COARSE = 3 };
/* Products up to which a dot-product kernel's rows are split in one share a
 * thread (a weight of 2 MiB in f32 at most: what the cores' caches keep). */
enum { RT_DOT_STATIC = 1 << 19 };

/* Runs loop kernel fn over its outer range on the thread pool: range outer
 * elements (each over inner elements when staged: a reduction or a row),
 * acc[n_acc] its scratch; a split reduction runs its RT_BLOCKS blocks, then
 * the combine. (codegen's runtime.c and the runtime.) */
void rt_run_loop(rt_kernel_fn fn, const int64_t *p, char **acc, int n_acc, int64_t range, int64_t inner, int staged,
                 int split);

/* First fit by liveness: offsets in one arena for the n buffers with
 * temp[i] set, of bytes[i] bytes, alive over kernels [first[i], last[i]];
 * largest first. Returns the arena's bytes. (codegen's plan.c and the runtime.) */
size_t rt_plan_arena(int n, const unsigned char *temp, const int *first, const int *last, const size_t *bytes,
                     size_t *offset);

#endif
