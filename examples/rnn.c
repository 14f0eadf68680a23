/* rnn: a character-level LSTM trained with kiln_scan over sequences of
 * varying length, then a greedy decode that stops on an end token with
 * kiln_while_loop.
 *
 * The text is examples/data/genesis.txt (run from the checkout, or pass its
 * path). Each step trains on a batch of chunks of a random length from 8 to
 * 24: the LSTM cell is the scan's body, its carry (h, c), its ys the hidden
 * states, so one call covers any length. The whole step (forward, backward,
 * SGD) is one kiln_compile'd function called at every length; a twin model
 * trained by the same step run eagerly must see the same losses. The
 * decode, a kiln_while_loop whose carry gathers the characters, runs
 * compiled and eagerly and must give the same text. The program exits
 * nonzero when the two sides differ or when the loss does not fall well
 * below its start, so it doubles as a smoke test.
 *
 *   build/examples/rnn [path] [--steps N]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"
#include "lstm.h"

/* DECODE_MAX stays under 63: a compiled decode breaks the graph at each test
 * of the loop until while_loop compiles to a native loop, and a call allows
 * 63 breaks. */
enum { E = 16, H = 64, B = 16, TMIN = 8, TMAX = 24, MAXV = 96, DECODE_MAX = 48 };
enum { EMB, WX, WH, BIAS, WO, BO, NPARAM };
static const double LR = 0.5;

typedef struct model {
  kiln_tensor *p[NPARAM]; /* emb (V,E), wx (E,4H), wh (H,4H), bias (4H), wo (H,V), bo (V) */
} model;

/* The cell of lstm.h reads the model's weights. */
static lstm_cell_w cell_of(const model *m) { return (lstm_cell_w){m->p[WX], m->p[WH], m->p[BIAS], H}; }

/* Mean cross entropy of predicting ids[t+1] from ids[..t], ids (T+1,B) i64.
 * The LSTM is one kiln_scan over x's dim 0, not a C loop over T, so one
 * compiled step can serve every length. */
static kiln_tensor *loss_of(model *m, kiln_tensor *ids) {
  int64_t T = kiln_size(ids, 0) - 1;
  lstm_cell_w w = cell_of(m);
  kiln_tensor *x = kiln_embedding(m->p[EMB], kiln_slice(ids, 0, 0, T, 1)); /* (T,B,E) */
  kiln_tensor *hs = lstm_layer(&w, x);                                     /* (T,B,H) */
  kiln_tensor *logits = kiln_add(kiln_matmul(kiln_reshape(hs, 2, (int64_t[]){-1, H}), m->p[WO]), m->p[BO]);
  kiln_tensor *target = kiln_reshape(kiln_contiguous(kiln_slice(ids, 0, 1, T + 1, 1)), 1, (int64_t[]){-1});
  return kiln_cross_entropy(logits, target);
}

/* One training step, the body of the compiled function: in = ids (T+1,B),
 * out = the loss before the SGD update, which happens in place. */
static int train_step(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  model *m = ctx;
  out[0] = loss_of(m, in[0]);
  if (!out[0] || kiln_backward(out[0])) return -1;
  kiln_no_grad_begin();
  for (int k = 0; k < NPARAM; k++) {
    kiln_sub_(m->p[k], kiln_mul(kiln_scalar(KILN_F32, LR), kiln_grad(m->p[k])));
    kiln_zero_grad(m->p[k]);
  }
  kiln_no_grad_end();
  return 0;
}

/* ---- greedy decode with kiln_while_loop ---- */

typedef struct decoder {
  model *m;
  int64_t end; /* the end token's id */
} decoder;

/* carry: h (1,H), c (1,H), tok i64 (1), n i64 0-d, made i64 (DECODE_MAX).
 * Go on while tok != end and n < DECODE_MAX. */
static int more(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  decoder *d = ctx;
  kiln_tensor *not_end = kiln_ne(kiln_sum_all(in[2]), kiln_scalar(KILN_I64, d->end));
  kiln_tensor *room = kiln_lt(in[3], kiln_scalar(KILN_I64, DECODE_MAX));
  out[0] = kiln_gt(kiln_mul(kiln_cast(not_end, KILN_I64), kiln_cast(room, KILN_I64)), kiln_scalar(KILN_I64, 0));
  return out[0] ? 0 : -1;
}

/* One step: the next character is the argmax of the logits; it goes to
 * made[n] with ops, not with a read into C, so the body stays a pure graph
 * (a read would be a graph break in a compiled decode). */
static int next_char(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  decoder *d = ctx;
  kiln_tensor *cs[3];
  kiln_tensor *step_in[3] = {in[0], in[1], kiln_embedding(d->m->p[EMB], in[2])};
  lstm_cell_w w = cell_of(d->m);
  if (lstm_cell(&w, step_in, cs)) return -1;
  kiln_tensor *logits = kiln_add(kiln_matmul(cs[0], d->m->p[WO]), d->m->p[BO]); /* (1,V) */
  kiln_tensor *at_n = kiln_eq(kiln_arange(KILN_I64, 0, DECODE_MAX, 1), in[3]);
  out[0] = cs[0];
  out[1] = cs[1];
  out[2] = kiln_reshape(kiln_argmax(logits, -1, false), 1, (int64_t[]){1});
  out[3] = kiln_add(in[3], kiln_scalar(KILN_I64, 1));
  out[4] = kiln_where(at_n, out[2], in[4]);
  return out[2] && out[3] && out[4] ? 0 : -1;
}

/* The decode's body (compiled below): in = the start token (1) i64;
 * out = made (DECODE_MAX) i64 and how many were made (0-d). */
static int decode_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  kiln_tensor *init[5] = {kiln_zeros(KILN_F32, 2, (int64_t[]){1, H}), kiln_zeros(KILN_F32, 2, (int64_t[]){1, H}),
                          in[0], kiln_scalar(KILN_I64, 0), kiln_zeros(KILN_I64, 1, (int64_t[]){DECODE_MAX})};
  kiln_tensor *fin[5];
  if (kiln_while_loop(more, next_char, ctx, 5, init, fin)) return -1;
  out[0] = fin[4];
  out[1] = fin[3];
  return 0;
}

/* Decodes from start, eagerly (fn NULL) or through fn, into text. 0 or -1. */
static int decode(decoder *d, kiln_fn *fn, int64_t start, const unsigned char *chars, char *text) {
  int64_t made[DECODE_MAX], n = 0;
  kiln_scope_begin();
  kiln_no_grad_begin();
  kiln_tensor *in = kiln_tensor_from(KILN_I64, 1, (int64_t[]){1}, &start), *out[2];
  int rc = fn ? kiln_call(fn, &in, out) : decode_body(d, &in, out);
  if (!rc) rc = kiln_read(out[0], made, sizeof made) || kiln_read(out[1], &n, sizeof n) ? -1 : 0;
  kiln_no_grad_end();
  kiln_scope_end();
  text[0] = (char)chars[start];
  for (int64_t i = 0; i < n; i++) text[i + 1] = (char)chars[made[i]];
  text[rc ? 1 : n + 1] = 0;
  return rc;
}

/* ---- data and training ---- */

static unsigned char *read_text(const char *path, long *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  *n = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *buf = malloc((size_t)*n);
  if (buf && fread(buf, 1, (size_t)*n, f) != (size_t)*n) free(buf), buf = NULL;
  fclose(f);
  return buf;
}

static uint64_t rng = 88172645463325252ull;
static uint64_t next_rand(void) {
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return rng;
}

/* The same random weights for every model made. */
static void model_init(model *m, int vocab) {
  int64_t shapes[NPARAM][2] = {{vocab, E}, {E, 4 * H}, {H, 4 * H}, {4 * H, 0}, {H, vocab}, {vocab, 0}};
  double scale[NPARAM] = {1.0, 1 / sqrt(E), 1 / sqrt(H), 0, 1 / sqrt(H), 0};
  kiln_scope_begin();
  for (int k = 0; k < NPARAM; k++) {
    int nd = shapes[k][1] ? 2 : 1;
    m->p[k] = kiln_keep(kiln_mul(kiln_randn(KILN_F32, nd, shapes[k], 100 + (uint64_t)k), kiln_scalar(KILN_F32, scale[k])));
    kiln_requires_grad(m->p[k], true);
  }
  kiln_scope_end();
}

static int fail(const char *what) {
  fprintf(stderr, "rnn: %s: %s\n", what, kiln_last_error());
  return 1;
}

int main(int argc, char **argv) {
  const char *path = "examples/data/genesis.txt";
  int steps = 300;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
    else path = argv[i];
  }
  long n;
  unsigned char *text = read_text(path, &n);
  if (!text) return fprintf(stderr, "rnn: cannot read %s (run from the checkout or pass the path)\n", path), 1;
  /* the vocabulary: the bytes that occur, in byte order */
  int id_of[256], vocab = 0;
  unsigned char chars[MAXV];
  for (int c = 0; c < 256; c++) id_of[c] = -1;
  for (long i = 0; i < n; i++) id_of[text[i]] = 0;
  for (int c = 0; c < 256; c++)
    if (id_of[c] == 0 && vocab < MAXV) chars[vocab] = (unsigned char)c, id_of[c] = vocab++;
  int64_t *ids = malloc(sizeof *ids * (size_t)n);
  for (long i = 0; i < n; i++) ids[i] = id_of[text[i]] < 0 ? 0 : id_of[text[i]];

  /* twins: one trained by the compiled step, one by the same step run eagerly */
  model m, twin;
  model_init(&m, vocab);
  model_init(&twin, vocab);
  kiln_fn *step_fn = kiln_compile(train_step, &m, &(kiln_options){.name = "lstm_step", .n_in = 1, .n_out = 1});
  if (!step_fn) return fail("kiln_compile");

  printf("rnn: %ld bytes, vocabulary %d, LSTM E=%d H=%d, batch %d, lengths %d..%d\n", n, vocab, E, H, B, TMIN, TMAX);
  double first = 0, last = 0, worst = 0;
  int64_t batch[(TMAX + 1) * B];
  for (int step = 0; step < steps; step++) {
    int T = TMIN + (int)(next_rand() % (TMAX - TMIN + 1));
    for (int b = 0; b < B; b++) {
      long at = (long)(next_rand() % (uint64_t)(n - T - 1));
      for (int t = 0; t <= T; t++) batch[t * B + b] = ids[at + t];
    }
    kiln_scope_begin();
    kiln_tensor *x = kiln_tensor_from(KILN_I64, 2, (int64_t[]){T + 1, B}, batch), *loss, *eager_loss;
    if (kiln_call(step_fn, &x, &loss)) return fail("compiled step");
    if (train_step(&twin, &x, &eager_loss)) return fail("eager step");
    double l = kiln_item(loss), le = kiln_item(eager_loss);
    kiln_scope_end();
    double diff = fabs(l - le) / (1 + fabs(le));
    if (diff > worst) worst = diff;
    /* a running mean over 20 steps, the first and the last */
    if (step < 20) first += l / 20;
    if (step >= steps - 20) last += l / (steps < 20 ? steps : 20);
    if (step % 50 == 0 || step == steps - 1) printf("step %4d  T %2d  loss %.3f (eager %.3f)\n", step, T, l, le);
  }
  kiln_fn_stats st;
  kiln_fn_get_stats(step_fn, &st);
  printf("compiled step: %lld calls, %lld variants, %lld traces, %lld fallbacks to eager\n", (long long)st.calls,
         (long long)st.variants, (long long)st.traces, (long long)st.fallbacks);
  printf("loss: first 20 steps %.3f, last 20 %.3f; compiled against eager: %.2g at most (relative)\n", first, last,
         worst);

  decoder d = {.m = &m, .end = id_of['\n'] >= 0 ? id_of['\n'] : 0};
  kiln_fn *dec_fn = kiln_compile(decode_body, &d, &(kiln_options){.name = "decode", .n_in = 1, .n_out = 2});
  char out[DECODE_MAX + 2], out_eager[DECODE_MAX + 2];
  int64_t start = id_of['A'] >= 0 ? id_of['A'] : 0;
  if (!dec_fn || decode(&d, dec_fn, start, chars, out)) return fail("compiled decode");
  if (decode(&d, NULL, start, chars, out_eager)) return fail("eager decode");
  printf("greedy decode from 'A' to the end of a line: %s\n", out);

  kiln_fn_free(dec_fn);
  kiln_fn_free(step_fn);
  for (int k = 0; k < NPARAM; k++) kiln_release(m.p[k]), kiln_release(twin.p[k]);
  free(ids);
  free(text);
  if (worst > 1e-3) return fprintf(stderr, "rnn: compiled and eager losses differ by %.3g\n", worst), 1;
  if (strcmp(out, out_eager)) return fprintf(stderr, "rnn: the eager decode differs: %s\n", out_eager), 1;
  /* ln(vocab) is where an untrained model starts */
  if (!(last < 0.8 * first)) return fprintf(stderr, "rnn: the loss did not fall enough\n"), 1;
  return 0;
}
