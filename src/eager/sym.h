/* Symbolic dimensions: a dim is a value, either a constant or an expression
 * over symbols s0, s1 ... with known inclusive bounds (tinygrad's Variable).
 * Expressions live in a sym_ctx (one per graph) and are hash-consed there, so
 * two structurally equal canonical expressions are the same pointer and dim
 * equality is pointer equality. Shape rules compute with these dims; where
 * they must decide a comparison the bounds cannot settle, sym_decide answers
 * from the traced values and says a guard is needed (torch's ShapeEnv).
 *
 * Errors (overflow, out of memory, an expression over the size limits, a
 * divisor not provably positive) give the error dim: every op returns it for
 * an error operand, so a chain needs one check at its end; sym_ctx_error()
 * says why the last one failed. */
#ifndef KILN_SYM_H
#define KILN_SYM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct sym_ctx sym_ctx;
typedef struct sym_expr sym_expr;

/* e == NULL: the constant c; else the expression e (and c is 0). */
typedef struct sym_dim {
  int64_t c;
  const sym_expr *e;
} sym_dim;

/* Limits that keep hostile input (the parser is fuzzed) cheap. */
enum {
  SYM_MAX_TERMS = 128, /* terms in one sum */
  SYM_MAX_ATOMS = 32,  /* factors in one product */
  SYM_MAX_DEPTH = 48,  /* nesting of expression nodes */
  SYM_MAX_ID = 1 << 20 /* symbol ids are 0 .. SYM_MAX_ID-1 */
};

/* Bounds a symbol gets when the parser meets one that was never declared. */
#define SYM_DEFAULT_LO ((int64_t)0)
#define SYM_DEFAULT_HI INT64_MAX

static inline sym_dim sym_const(int64_t c) { return (sym_dim){c, NULL}; }
static inline bool sym_is_const(sym_dim d) { return d.e == NULL; }

sym_ctx *sym_ctx_new(void);                  /* NULL when out of memory */
void sym_ctx_free(sym_ctx *ctx);             /* frees every expression of ctx */
const char *sym_ctx_error(const sym_ctx *ctx); /* why the last error dim was made */

sym_dim sym_error(void);                    /* the error dim */
bool sym_is_err(sym_dim d);                 /* d is the error dim */
bool sym_same(sym_dim a, sym_dim b);        /* equal as canonical forms (never for errors) */

/* Symbol s<id> with lo <= value <= hi. Declaring an id again with other
 * bounds, lo > hi or an id out of range gives the error dim. */
sym_dim sym_var(sym_ctx *ctx, int id, int64_t lo, int64_t hi);

/* Canonical forms of a+b, a-b, a*b; the error dim on int64 overflow of a
 * coefficient or constant. */
sym_dim sym_add(sym_ctx *ctx, sym_dim a, sym_dim b);
sym_dim sym_sub(sym_ctx *ctx, sym_dim a, sym_dim b);
sym_dim sym_mul(sym_ctx *ctx, sym_dim a, sym_dim b);
/* Floor division and floor modulo (Python's // and %); the divisor must be
 * provably >= 1 from its bounds, else the error dim. */
sym_dim sym_floordiv(sym_ctx *ctx, sym_dim a, sym_dim b);
sym_dim sym_mod(sym_ctx *ctx, sym_dim a, sym_dim b);

/* Inclusive bounds of every value d takes where sym_eval succeeds
 * (saturated at the int64 limits); the full range for the error dim. */
void sym_bounds(sym_dim d, int64_t *lo, int64_t *hi);

/* d with s<id> = vals[id]. 0, or -1 on overflow, a symbol id >= nvals, a
 * value outside its symbol's bounds, a divisor <= 0 or the error dim. */
int sym_eval(sym_dim d, const int64_t *vals, int nvals, int64_t *out);

/* d as the exported runtime's postfix code (rt/plan.h, RT_C_*), ended by
 * RT_C_END, into out[0..cap): the words written, or -1 when it does not fit
 * or d is the error dim. Evaluating it is sym_eval without the bounds checks
 * (the runtime checks each symbol's bounds when it binds it). */
int sym_code(sym_dim d, int64_t *out, int cap);

/* Canonical text (grammar at the top of sym.c), snprintf-style: returns the
 * length it needed (writes at most n-1 chars and a NUL), or -1 for the error
 * dim or a text over 64 MiB (shared subexpressions print once per use). */
int sym_print(sym_dim d, char *buf, size_t n);

/* Parses one expression. With end == NULL the whole text must be the
 * expression; else parsing stops before the first char that cannot continue
 * it and *end points there. 0, or -1 with "col N: why" in err (N 1-based). */
int sym_parse(sym_ctx *ctx, const char *text, sym_dim *out, const char **end, char *err, size_t errn);

/* ---- guards: relations a compiled variant requires of its symbols ---- */

typedef enum sym_cmp {
  SYM_EQ, SYM_NE, SYM_LT, SYM_LE, SYM_GE, SYM_GT,
  SYM_DIVIDES /* rhs divides lhs: lhs % rhs == 0; printed so, and reads back when rhs >= 1 by bounds */
} sym_cmp;

typedef struct sym_guard {
  sym_cmp op;
  sym_dim lhs, rhs;
} sym_guard;

/* 1 when the guard holds for vals, 0 when not, -1 when it cannot be evaluated. */
int sym_guard_check(const sym_guard *g, const int64_t *vals, int nvals);
/* `lhs OP rhs`, snprintf-style like sym_print; -1 for an error dim or op. */
int sym_guard_print(const sym_guard *g, char *buf, size_t n);
/* Reads what sym_guard_print writes; `E % F == 0` reads as SYM_DIVIDES.
 * Contract as sym_parse. */
int sym_guard_parse(sym_ctx *ctx, const char *text, sym_guard *out, const char **end, char *err, size_t errn);

/* Decides `a op b`. When the bounds prove it, *needs_guard = false; else
 * the answer comes from evaluating with vals and *needs_guard = true (the
 * caller records the guard {op, a, b} or its negation). 0, or -1 when it
 * is unprovable and cannot be evaluated. */
int sym_decide(sym_dim a, sym_cmp op, sym_dim b, const int64_t *vals, int nvals, bool *result, bool *needs_guard);

#endif
