/* Differential fuzzing of the compiler: the bytes choose a random program
 * (the generator of tests/fuzz/randprog.h, which test_codegen runs from
 * seeds), its dynamic mode, C mode (C branches, numbers, value reads and
 * dropout around the ops), its op set (mode 1 adds the newer ops, mode 2 control flow too) and the sizes of two to four calls; each call runs
 * compiled (LLVM) and eagerly, and the outputs must agree within the
 * tolerance test_codegen uses. A mismatch or a compiled call that fails where
 * eager succeeds aborts with the program's IR. Layout of an input: 8 bytes of
 * settings, then the generator's choices. */
#include <math.h>

#include "fuzz/fuzz.h"
#include "fuzz/randprog.h"

static bool verbose;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  verbose = getenv("KILN_FUZZ_VERBOSE") != NULL;
  kiln_set_num_threads(1);
  return 0;
}

static void fail(kiln_fn *fn, const prog *pg, const char *why) {
  char *text = kiln_fn_graph(fn, 0);
  for (int v = 1;; v++) { /* the newest variant */
    char *t = kiln_fn_graph(fn, v);
    if (!t) break;
    free(text);
    text = t;
  }
  fprintf(stderr, "\nfuzz_compile: %s\nprogram: C=%d, x %s, %s%s%s, %d outputs\nits graph:\n%s\n", why, pg->C,
          pg->nd_x == 3 ? "(B,T,C)" : "(B,C)", pg->f64 ? "f64" : "f32", pg->grad ? ", with grads" : "",
          pg->cmode ? ", C mode" : "", pg->n_out,
          text ? text : "(none)");
  free(text);
  abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size > 512) return -1; /* longer inputs make no longer programs */
  fuzz_in f = {data, size, 0};
  prog pg;
  prog_init(&pg, fuzz_byte(&f));
  static const int cs[] = {3, 4, 6, 8, 12};
  pg.C = cs[fuzz_pick(&f, 5)];
  pg.nd_x = 2 + fuzz_pick(&f, 2);
  pg.f64 = fuzz_chance(&f, 6);
  pg.grad = fuzz_chance(&f, 4);
  pg.n_val = 1 + fuzz_pick(&f, 3);
  pg.n_out = pg.n_val + (pg.grad ? N_IN : 0);
  int dynamic = fuzz_pick(&f, 3); /* auto, static, all */
  int n_calls = 2 + fuzz_pick(&f, 3);
  int64_t sizes[4][2];
  for (int k = 0; k < 4; k++) {
    unsigned b = fuzz_byte(&f);
    if (k == 0) pg.cmode = b >> 6 & 1; /* C around the ops (randprog.h) */
    if (k == 1) pg.mode = b >> 6 & 1;  /* the newer ops too */
    if (k == 2 && (b >> 6 & 1)) pg.mode = 2; /* and control flow */
    sizes[k][0] = 1 + (b & 7);
    sizes[k][1] = 1 + (b >> 3 & 3) + (b >> 5 & 1) * (pg.C - 1); /* T sometimes equal to C */
  }
  pg.bytes = data + f.at;
  pg.n_bytes = size - f.at;

  kiln_options o = {.name = "fuzz", .n_in = N_IN, .n_out = pg.n_out, .dynamic = dynamic, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(random_body, &pg, &o);
  FUZZ_CHECK(fn != NULL, "kiln_compile: %s", kiln_last_error());
  int C = pg.C;
  kiln_dtype ft = pg.f64 ? KILN_F64 : KILN_F32;
  for (int k = 0; k < n_calls; k++) {
    int64_t b = sizes[k][0], t = sizes[k][1];
    uint64_t sd = (uint64_t)k * 16 + 1;
    kiln_scope_begin();
    kiln_tensor *in[N_IN];
    if (pg.nd_x == 2) {
      in[0] = kiln_randn(ft, 2, ((int64_t[]){b, C}), sd);
      in[2] = kiln_randn(ft, 2, ((int64_t[]){1, C}), 101);
      in[3] = kiln_randn(ft, 2, ((int64_t[]){b, 1}), sd + 7);
    } else {
      in[0] = kiln_randn(ft, 3, ((int64_t[]){b, t, C}), sd);
      in[2] = kiln_randn(ft, 2, ((int64_t[]){t, C}), sd + 5);
      in[3] = kiln_randn(ft, 3, ((int64_t[]){b, 1, C}), sd + 7);
    }
    in[1] = kiln_randn(ft, 1, ((int64_t[]){C}), 100);
    in[4] = kiln_randn(ft, 2, ((int64_t[]){8, C}), 102);
    if (pg.grad)
      for (int j = 0; j < N_IN; j++) kiln_requires_grad(in[j], true);
    kiln_tensor *y[16] = {0}, *ref[16] = {0};
    pg.call_no = k;
    kiln_manual_seed((uint64_t)k); /* the same draws for both runs */
    if (random_body(&pg, in, ref)) {
      /* the generator keeps its programs valid at every size: a failure is its bug or kiln's */
      char why[512];
      snprintf(why, sizeof why, "B=%lld T=%lld: the program fails eagerly: %s", (long long)b, (long long)t, body_err);
      fail(fn, &pg, why);
    }
    kiln_manual_seed((uint64_t)k);
    if (kiln_call(fn, in, y)) {
      char why[512];
      snprintf(why, sizeof why, "B=%lld T=%lld: the compiled call failed: %s", (long long)b, (long long)t,
               kiln_last_error());
      fail(fn, &pg, why);
    }
    for (int j = 0; j < pg.n_out; j++) {
      bool grad_out = j >= pg.n_val;
      double tol = pg.f64 ? (grad_out ? 1e-8 : 1e-9) : (grad_out ? 1e-4 : 2e-5);
      char why[512], s1[128], s2[128];
      if (!same_shape(y[j], ref[j])) {
        snprintf(why, sizeof why, "B=%lld T=%lld: output %d has shape %s, eager %s", (long long)b, (long long)t, j,
                 kiln_describe(y[j], s1, sizeof s1), kiln_describe(ref[j], s2, sizeof s2));
        fail(fn, &pg, why);
      }
      int64_t bad;
      double d = maxdiff_rel(y[j], ref[j], &bad);
      if (!(d <= tol)) {
        snprintf(why, sizeof why, "B=%lld T=%lld: output %d%s: max rel diff %g (tolerance %g) at element %lld",
                 (long long)b, (long long)t, j, grad_out ? " (a gradient)" : "", d, tol, (long long)bad);
        fail(fn, &pg, why);
      }
    }
    kiln_scope_end();
  }
  if (verbose) {
    kiln_fn_stats st;
    kiln_fn_get_stats(fn, &st);
    fprintf(stderr, "C=%d nd=%d %s dyn=%d: %d calls, %lld traces, %lld hits\n", C, pg.nd_x, pg.f64 ? "f64" : "f32",
            dynamic, n_calls, (long long)st.traces, (long long)st.hits);
  }
  kiln_fn_free(fn);
  return 0;
}
