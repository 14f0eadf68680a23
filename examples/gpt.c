/* gpt: a small GPT-2-style model (examples/gpt.h) trained on the bytes of
 * Genesis (examples/data/), eagerly and through kiln_compile, side by side.
 *
 * Two copies of the model start from the same init. Each step draws one
 * batch; model A runs the training step (forward, backward, AdamW, all kiln
 * ops) as a plain C function, model B runs the same function wrapped by
 * kiln_compile: its first call traces the whole step into one graph, every
 * later call runs that graph as fused native code. The two loss curves must
 * agree (the first steps to float32 rounding, the rest within what training
 * compounds of it), and fall.
 *
 * Then it samples text from model B with the compiled forward pass, the
 * sequence growing by one byte a call: the sequence length is marked dynamic,
 * so one variant, with T a symbol (s0), serves every length.
 *
 *   build/examples/gpt [--steps N] [--data FILE] [--kernels]
 *
 * --kernels also prints the generation graph's kernels (KILN_DUMP_KERNELS) on
 * stderr. Exits nonzero when anything is off, so it doubles as a smoke test.
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpt.h"
#include "kiln.h"

enum { DEFAULT_STEPS = 200, PRINT_EVERY = 20, MEASURE_STEP = 5, SAMPLE_BYTES = 200 };
/* |eager - compiled| / |eager| allowed for a loss. Compiled sums add in another
 * order, so the two differ in the last bits of f32, and training compounds
 * that: AdamW divides by sqrt(v), so a last-bit difference in a tiny gradient
 * moves a weight by up to lr. The early steps must agree to f32 rounding; the
 * whole curve, to RTOL_CURVE. */
enum { EARLY_STEPS = 20 };
static const double RTOL_EARLY = 1e-5;
static const double RTOL_CURVE = 1e-2;
static const double TEMPERATURE = 0.7;  /* sampling */
static const char PROMPT[] = "And God said"; /* 12 bytes: a length no literal of the model equals */

static double now_ms(void) {
  struct timespec ts;
  timespec_get(&ts, TIME_UTC);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static double rel_diff(double a, double b) { return fabs(a - b) / fmax(fabs(a), 1e-12); }

/* Prints one verdict line; clears *ok when it failed. */
static void check(bool pass, bool *ok, const char *what) {
  printf("  %-6s %s\n", pass ? "ok" : "FAILED", what);
  if (!pass) *ok = false;
}

/* Loss of a model on a fixed batch, eagerly and without autograd; NAN on error. */
static double eval_loss(const gpt *g, const gpt_data *d, int64_t B, int64_t T) {
  uint64_t rng = 99;
  kiln_scope_begin();
  kiln_no_grad_begin();
  kiln_tensor *idx, *tgt, *loss = NULL;
  if (gpt_batch(d, B, T, &rng, &idx, &tgt) == 0) loss = gpt_loss(g, idx, tgt);
  double v = loss ? kiln_item(loss) : NAN;
  kiln_no_grad_end();
  kiln_scope_end();
  return v;
}

/* One step of the same batch on both models: A eagerly, then B through fn.
 * Losses in le/lc, times in te/tc; peaks (bytes above what was in use before)
 * when asked. 0 or -1. */
static int step_both(gpt *a, kiln_fn *fn, kiln_tensor *idx, kiln_tensor *tgt, double *le, double *lc, double *te,
                     double *tc, size_t *eager_peak, size_t *compiled_peak) {
  kiln_tensor *in[2] = {idx, tgt}, *loss = NULL;
  size_t base = kiln_mem_in_use();
  kiln_mem_reset_peak();
  double t0 = now_ms();
  kiln_scope_begin(); /* the step's intermediates die here, as in a training loop */
  loss = gpt_train_step(a, idx, tgt);
  *le = loss ? kiln_item(loss) : NAN;
  kiln_scope_end();
  double t1 = now_ms();
  if (eager_peak) *eager_peak = kiln_mem_peak() - base;
  if (!loss) return -1;

  base = kiln_mem_in_use();
  kiln_mem_reset_peak();
  double t2 = now_ms();
  kiln_scope_begin();
  int rc = kiln_call(fn, in, &loss);
  *lc = rc == 0 ? kiln_item(loss) : NAN;
  kiln_scope_end();
  double t3 = now_ms();
  if (compiled_peak) *compiled_peak = kiln_mem_peak() - base;
  *te = t1 - t0;
  *tc = t3 - t2;
  return rc == 0 && isfinite(*le) && isfinite(*lc) ? 0 : -1;
}

/* The first line of text, then for each needle the first line after it
 * that contains it, in the order of the text; indented, cut at 150 columns. */
static void print_lines_with(const char *text, const char *const *needles, int n_needles) {
  bool used[16] = {0};
  const char *p = text;
  for (int line = 0; *p; line++) {
    int len = (int)strcspn(p, "\n");
    bool want = line == 0;
    for (int i = 0; i < n_needles && i < 16 && line > 0; i++) {
      const char *hit = strstr(p, needles[i]);
      if (!used[i] && hit && hit < p + len) want = used[i] = true;
    }
    if (want) printf("    %.*s%s\n", len > 150 ? 150 : len, p, len > 150 ? " ..." : "");
    p += len + (p[len] == '\n');
  }
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0); /* the dumps go to stderr: keep the two in order */
  int steps = DEFAULT_STEPS;
  const char *path = "examples/data/genesis.txt";
  bool kernels = false;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--data") && i + 1 < argc) path = argv[++i];
    else if (!strcmp(argv[i], "--kernels")) kernels = true;
    else {
      fprintf(stderr, "usage: %s [--steps N] [--data FILE] [--kernels]\n", argv[0]);
      return 2;
    }
  }
  if (steps < 20) steps = 20;

  const gpt_config cfg = GPT_DEMO_CONFIG;
  const int64_t B = GPT_DEMO_BATCH, T = cfg.block_size;
  gpt_data data = {0};
  gpt a = {0}, b = {0};
  kiln_fn *train = NULL, *gen = NULL;
  double *le = NULL, *lc = NULL, *te = NULL, *tc = NULL;
  uint8_t *text = NULL;
  int status = 1;
  kiln_clear_error();

  if (gpt_data_load(&data, path) != 0) return 1;
  if (gpt_init(&a, &cfg, 1) != 0 || gpt_init(&b, &cfg, 1) != 0) goto fail;
  int64_t n_weights = 0;
  for (int i = 0; i < a.n_params; i++) n_weights += kiln_numel(a.p[i]);
  printf("gpt: %d layers, %d heads, %d channels, context %d, vocab %d (bytes): %lld parameters\n", cfg.n_layer,
         cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size, (long long)n_weights);
  printf("data: %s, %lld bytes; batch %lld x %lld, AdamW lr %g, %d steps, %d threads\n", path, (long long)data.n,
         (long long)B, (long long)T, cfg.opt.lr, steps, kiln_get_num_threads());
  printf("A: the training step as a plain C function (eager)   B: the same function under kiln_compile\n\n");

  kiln_options topts = {.name = "train_step", .n_in = 2, .n_out = 1};
  train = kiln_compile(gpt_train_body, &b, &topts);
  le = malloc(sizeof(double) * (size_t)steps), lc = malloc(sizeof(double) * (size_t)steps);
  te = malloc(sizeof(double) * (size_t)steps), tc = malloc(sizeof(double) * (size_t)steps);
  if (!train || !le || !lc || !te || !tc) goto fail;

  /* the compiled side keeps an arena between calls: count what stays */
  size_t before_first = kiln_mem_in_use(), eager_peak = 0, compiled_peak = 0, kept = 0;
  double worst = 0, worst_early = 0;
  uint64_t rng = 1234;
  printf("step   eager loss  compiled loss  rel diff\n");
  for (int s = 0; s < steps; s++) {
    bool measure = s == MEASURE_STEP;
    size_t in_use = kiln_mem_in_use();
    kiln_scope_begin();
    kiln_tensor *idx, *tgt;
    int rc = gpt_batch(&data, B, T, &rng, &idx, &tgt);
    if (rc == 0)
      rc = step_both(&a, train, idx, tgt, &le[s], &lc[s], &te[s], &tc[s], measure ? &eager_peak : NULL,
                     measure ? &compiled_peak : NULL);
    kiln_scope_end();
    if (rc != 0) goto fail;
    if (measure) kept = in_use > before_first ? in_use - before_first : 0;
    double d = rel_diff(le[s], lc[s]);
    if (d > worst) worst = d;
    if (s < EARLY_STEPS && d > worst_early) worst_early = d;
    if (s % PRINT_EVERY == 0 || s == steps - 1)
      printf("%4d   %10.5f  %13.5f  %8.1e%s\n", s, le[s], lc[s], d,
             s == 0 ? "   (B's first call records the body and compiles it)" : "");
  }
  compiled_peak += kept;
  kiln_fn_stats st;
  if (kiln_fn_get_stats(train, &st) != 0) goto fail;
  double pdiff = gpt_params_max_diff(&a, &b), eval_a = eval_loss(&a, &data, 4 * B, T), eval_b = eval_loss(&b, &data, 4 * B, T);
  if (pdiff < 0 || !isfinite(eval_a) || !isfinite(eval_b)) goto fail;

  double first = (le[0] + le[1] + le[2]) / 3, last = 0;
  for (int s = steps - 10; s < steps; s++) last += le[s] / 10;
  double me = median(te + 1, steps - 1), mc = median(tc + 1, steps - 1); /* step 0 traced */
  printf("\n                      eager   compiled\n");
  printf("ms/step (median)   %8.2f   %8.2f   speedup %.2fx\n", me, mc, me / mc);
  printf("compile ms                    %8.1f   (trace %.0f, passes %.0f, fusion %.0f; LLVM in parallel jobs, CPU ms: "
         "optimize %.0f, machine code %.0f)\n",
         st.trace_ms + st.compile_ms, st.trace_ms, st.passes_ms, st.fuse_ms, st.llvm_opt_ms, st.llvm_codegen_ms);
  printf("peak MiB per step  %8.2f   %8.2f   (compiled: %.2f MiB kept between calls)\n\n", eager_peak / 1048576.0,
         compiled_peak / 1048576.0, kept / 1048576.0);

  char *graph = kiln_fn_graph(train, 0);
  if (!graph) goto fail;
  int n_nodes = 0;
  for (const char *p = graph; (p = strchr(p, '\n')); p++) n_nodes++;
  printf("the compiled step is one graph of about %d lines; some of them (dtype, shape, source line per node):\n",
         n_nodes);
  const char *train_needles[] = {"= index_select(", "= gelu(", "= index_add(", "= pow(", "write %"};
  print_lines_with(graph, train_needles, 5);
  free(graph);

  /* generation: T marked dynamic, so the first call traces with T = s0 */
  printf("\nsampling %d bytes (temperature %.1f) from model B, prompt \"%s\", one compiled call per byte:\n",
         SAMPLE_BYTES, TEMPERATURE, PROMPT);
  kiln_options gopts = {.name = "next_byte", .n_in = 1, .n_out = 1, .dump = kernels ? KILN_DUMP_KERNELS : 0};
  gen = kiln_compile(gpt_next_body, &b, &gopts);
  if (!gen || kiln_mark_dynamic(gen, 0, 1) != 0) goto fail;
  int64_t plen = (int64_t)strlen(PROMPT), len = plen, elen = plen;
  text = malloc((size_t)(2 * (plen + SAMPLE_BYTES)));
  if (!text) goto fail;
  uint8_t *etext = text + plen + SAMPLE_BYTES;
  memcpy(text, PROMPT, (size_t)plen);
  memcpy(etext, PROMPT, (size_t)plen);
  uint64_t grng = 42, erng = 42;
  fflush(stdout);
  double g0 = now_ms();
  if (gpt_generate(&b, gen, text, &len, 1, TEMPERATURE, &grng) != 0) goto fail; /* traces */
  double g1 = now_ms();
  if (gpt_generate(&b, gen, text, &len, SAMPLE_BYTES - 1, TEMPERATURE, &grng) != 0) goto fail;
  double g2 = now_ms();
  if (gpt_generate(&b, NULL, etext, &elen, SAMPLE_BYTES, TEMPERATURE, &erng) != 0) goto fail;
  double g3 = now_ms();
  fflush(stderr);
  printf("----\n%.*s\n----\n", (int)len, (const char *)text);
  kiln_fn_stats gs;
  if (kiln_fn_get_stats(gen, &gs) != 0) goto fail;
  double tok_c = (SAMPLE_BYTES - 1) / ((g2 - g1) / 1e3), tok_e = SAMPLE_BYTES / ((g3 - g2) / 1e3);
  printf("bytes/s: eager %.0f, compiled %.0f (speedup %.2fx; the first call traced and compiled in %.1f ms)\n", tok_e,
         tok_c, tok_c / tok_e, g1 - g0);
  printf("next_byte: %lld calls, %lld traces, %lld variants, %lld hits, %lld fallbacks; its graph:\n",
         (long long)gs.calls, (long long)gs.traces, (long long)gs.variants, (long long)gs.hits, (long long)gs.fallbacks);
  graph = kiln_fn_graph(gen, 0);
  if (!graph) goto fail;
  const char *gen_needles[] = {"= slice(%1)", "= index_select(", "bool[s0,s0]", "= where(", "f32[1,4,s0,s0] = matmul"};
  print_lines_with(graph, gen_needles, 5);
  bool symbolic = strstr(graph, "i64[1,s0]") != NULL;
  free(graph);

  /* the verdicts */
  bool ok = true;
  char line[240];
  printf("\nchecks:\n");
  snprintf(line, sizeof line, "the first %d losses agree to f32 rounding (worst rel diff %.1e, limit %g)", EARLY_STEPS,
           worst_early, RTOL_EARLY);
  check(worst_early <= RTOL_EARLY, &ok, line);
  snprintf(line, sizeof line, "all %d agree as training compounds rounding (worst rel diff %.1e, limit %g)", steps, worst,
           RTOL_CURVE);
  check(worst <= RTOL_CURVE, &ok, line);
  /* weights that moved by up to lr apart are compared through the loss they give */
  snprintf(line, sizeof line, "the trained models agree: loss on %lld held-out rows A %.5f, B %.5f (max weight diff %.1e)",
           (long long)(4 * B), eval_a, eval_b, pdiff);
  check(rel_diff(eval_a, eval_b) <= RTOL_CURVE, &ok, line);
  snprintf(line, sizeof line, "the loss falls: %.3f (first 3 steps) -> %.3f (last 10)", first, last);
  check(last < first - 1.0, &ok, line);
  snprintf(line, sizeof line, "training: one trace, then %d hits (got %lld traces, %lld hits, %lld fallbacks)",
           steps - 1, (long long)st.traces, (long long)st.hits, (long long)st.fallbacks);
  check(st.traces == 1 && st.hits == steps - 1 && st.fallbacks == 0, &ok, line);
  snprintf(line, sizeof line, "generation: one variant with T symbolic serves lengths %lld..%d (%lld traces)",
           (long long)plen, cfg.block_size, (long long)gs.traces);
  check(gs.traces == 1 && gs.variants == 1 && gs.fallbacks == 0 && symbolic, &ok, line);
  snprintf(line, sizeof line, "eager sampling from the same model and seed gives the same text");
  check(elen == len && !memcmp(text, etext, (size_t)len), &ok, line);
  status = ok ? 0 : 2;
  printf("%s\n", ok ? "gpt: ok" : "gpt: FAILED");
  goto done;
fail:
  fprintf(stderr, "gpt: %s\n", *kiln_last_error() ? kiln_last_error() : "a loss is not finite");
  status = 1;
done:
  free(text);
  free(le), free(lc), free(te), free(tc);
  kiln_fn_free(gen);
  kiln_fn_free(train);
  gpt_free(&a);
  gpt_free(&b);
  gpt_data_free(&data);
  return status;
}
