/* gpt_ddp: the GPT of examples/gpt.h trained data-parallel over MPI.
 *
 * Every process holds the whole model, from the same init. Each step draws
 * the same batch of B windows everywhere (the same seed), and process r of P
 * trains on rows [B*r/P, B*(r+1)/P) of it: its mean loss, scaled by its share
 * of the rows, then backward, then kiln_allreduce_ sums each gradient over
 * the processes, so every process holds the gradient of the whole batch's
 * mean loss and makes the same AdamW update. The parameters stay equal
 * everywhere, and equal to training on the whole batch in one process, to
 * the rounding of f32 sums taken in another order.
 *
 *   mpirun -np 2 build/examples/gpt_ddp [--steps N] [--compiled] [--check] [--data FILE]
 *
 * --compiled runs the step (forward, backward, allreduces, AdamW) through
 * kiln_compile: the allreduces are nodes of the one compiled graph.
 * --check also trains one model on the whole batch in this process, eagerly,
 * and compares: the parameters after N steps, and the losses. --f64 trains in
 * float64, where the comparison is tight.
 * --collectives N: fails unless every step after the first made N collectives
 * (the buckets of a compiled step: KILN_DIST_BUCKET_KB).
 * --die-at K: process 1 kills itself at step K (the fault test: the other
 * processes must end with an error, not hang).
 * Prints "final loss X" (process 0) and exits nonzero when anything is off. */
#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpt.h"
#include "kiln.h"

/* Max |ddp - one process| allowed for a parameter after the steps, and for
 * the losses (relative). The gradients are summed in another order (each
 * process's part, then the allreduce), which changes their last bits, and
 * AdamW amplifies that: it divides by sqrt(v), so in f32 a last-bit change
 * in a near-zero gradient moves a weight by up to lr (3e-3) a step. So f32
 * is held to a third of one step's lr (measured: 2e-4 after 20 steps), and f64 (--f64), whose last bits are
 * 2^29 times smaller, to 1e-9. */
static const double PARAM_ATOL_F32 = 1e-3, PARAM_ATOL_F64 = 1e-9;
static const double LOSS_RTOL_F32 = 1e-5, LOSS_RTOL_F64 = 1e-12;

typedef struct ddp {
  gpt *g;
  int64_t rows, batch; /* this process's rows of the batch */
} ddp;

static double now_ms(void) {
  struct timespec ts;
  timespec_get(&ts, TIME_UTC);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

/* One data-parallel step on this process's rows: the whole batch's mean loss
 * (before the update), or NULL. In an open scope. */
static kiln_tensor *ddp_step(ddp *d, kiln_tensor *idx, kiln_tensor *tgt) {
  gpt *g = d->g;
  kiln_dtype dt = g->cfg.dtype;
  kiln_scope_begin();
  /* mean over my rows x my share = my part of the mean over the batch */
  kiln_tensor *part = kiln_mul(gpt_loss(g, idx, tgt), kiln_scalar(dt, (double)d->rows / (double)d->batch));
  int bad = !part || kiln_backward(part) != 0;
  kiln_no_grad_begin();
  kiln_tensor *loss = bad ? NULL : kiln_allreduce(part, KILN_REDUCE_SUM);
  for (int i = 0; i < g->n_params && !bad; i++) bad = !kiln_allreduce_(kiln_grad(g->p[i]), KILN_REDUCE_SUM);
  kiln_no_grad_end();
  if (!bad && loss) kiln_keep(loss);
  kiln_scope_end();
  return !bad && loss && gpt_adamw_step(g) == 0 ? loss : NULL;
}

static int ddp_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  out[0] = ddp_step(ctx, in[0], in[1]);
  return out[0] ? 0 : -1;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  int steps = 20, die_at = -1, want_colls = -1;
  bool compiled = false, check = false, f64 = false;
  const char *path = "examples/data/genesis.txt";
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--data") && i + 1 < argc) path = argv[++i];
    else if (!strcmp(argv[i], "--die-at") && i + 1 < argc) die_at = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--collectives") && i + 1 < argc) want_colls = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--compiled")) compiled = true;
    else if (!strcmp(argv[i], "--check")) check = true;
    else if (!strcmp(argv[i], "--f64")) f64 = true;
    else {
      fprintf(stderr, "usage: %s [--steps N] [--compiled] [--check] [--f64] [--data FILE] [--die-at K] [--collectives N]\n",
              argv[0]);
      return 2;
    }
  }
  if (steps < 1) steps = 1;
  int rank = kiln_dist_rank(), size = kiln_dist_size();
  if (rank < 0 || size < 1) {
    fprintf(stderr, "gpt_ddp: %s\n", kiln_last_error());
    return 1;
  }

  gpt_config cfg = GPT_DEMO_CONFIG;
  if (f64) cfg.dtype = KILN_F64;
  const int64_t B = GPT_DEMO_BATCH, T = cfg.block_size;
  const int64_t lo = B * rank / size, hi = B * (rank + 1) / size;
  gpt_data data = {0};
  gpt model = {0}, ref = {0};
  kiln_fn *fn = NULL;
  int status = 1;
  int64_t colls0 = 0;
  double step_ms = 0, flight0 = 0, blocked0 = 0, ref_loss_last = NAN, loss_last = NAN, worst_loss = 0;
  if (gpt_data_load(&data, path) != 0) return 1;
  if (hi <= lo) {
    fprintf(stderr, "gpt_ddp: %d processes for a batch of %lld: process %d has no rows\n", size, (long long)B, rank);
    goto fail;
  }
  if (gpt_init(&model, &cfg, 1) != 0 || (check && gpt_init(&ref, &cfg, 1) != 0)) goto fail;
  ddp d = {.g = &model, .rows = hi - lo, .batch = B};
  int64_t n_weights = 0;
  for (int i = 0; i < model.n_params; i++) n_weights += kiln_numel(model.p[i]);
  if (rank == 0)
    printf("gpt_ddp: %lld parameters: each step sums %.2f MiB of gradients over the processes\n", (long long)n_weights,
           (double)n_weights * (f64 ? 8 : 4) / 1048576.0);
  if (rank == 0)
    printf("gpt_ddp: %d processes, batch %lld x %lld split %s, %d steps, %s, %s\n", size, (long long)B, (long long)T,
           B % size ? "unevenly" : "evenly", steps, compiled ? "compiled" : "eager", f64 ? "f64" : "f32");
  if (compiled) {
    kiln_options o = {.name = "ddp_step", .n_in = 2, .n_out = 1};
    if (!(fn = kiln_compile(ddp_body, &d, &o))) goto fail;
  }

  uint64_t rng = 1234;
  for (int s = 0; s < steps; s++) {
    if (s == die_at && rank == 1) raise(SIGKILL);
    kiln_scope_begin();
    kiln_tensor *idx, *tgt, *loss = NULL;
    int rc = gpt_batch(&data, B, T, &rng, &idx, &tgt);
    if (rc == 0 && check) {
      kiln_tensor *r = gpt_train_step(&ref, idx, tgt);
      rc = r ? 0 : -1;
      ref_loss_last = r ? kiln_item(r) : NAN;
    }
    if (rc == 0) {
      /* my rows, contiguous: a compiled step's inputs */
      kiln_tensor *in[2] = {kiln_contiguous(kiln_slice(idx, 0, lo, hi, 1)),
                            kiln_contiguous(kiln_slice(tgt, 0, lo, hi, 1))};
      double t0 = now_ms();
      if (s == 1) kiln_dist_times(&flight0, &blocked0), colls0 = kiln_dist_collectives(); /* step 0 traces and compiles */
      if (compiled) rc = in[0] && in[1] ? kiln_call(fn, in, &loss) : -1;
      else rc = (loss = ddp_step(&d, in[0], in[1])) ? 0 : -1;
      loss_last = rc == 0 ? kiln_item(loss) : NAN;
      if (s > 0) step_ms += now_ms() - t0; /* step 0 traces and compiles */
    }
    kiln_scope_end();
    if (rc != 0) goto fail;
    if (check) worst_loss = fmax(worst_loss, fabs(loss_last - ref_loss_last) / fabs(ref_loss_last));
    if (rank == 0 && (s % 10 == 0 || s == steps - 1)) printf("step %3d  loss %.6f\n", s, loss_last);
  }
  status = 0;
  if (rank == 0 && steps > 1)
    printf("ms/step %.2f\n", step_ms / (steps - 1));
  if (rank == 0 && steps > 1) {
    double flight, blocked;
    kiln_dist_times(&flight, &blocked);
    flight = (flight - flight0) / (steps - 1), blocked = (blocked - blocked0) / (steps - 1);
    if (flight >= 0.01)
      printf("ms/step in allreduces %.2f, blocked waiting %.2f: %.0f%% overlapped\n", flight, blocked,
             100 * (1 - blocked / flight));
    /* compiled: the allreduces packed into buckets (KILN_DIST_BUCKET_KB) */
    printf("collectives/step %.1f\n", (double)(kiln_dist_collectives() - colls0) / (steps - 1));
  }
  if (want_colls >= 0 && steps > 1 && kiln_dist_collectives() - colls0 != (int64_t)want_colls * (steps - 1)) {
    printf("process %d: %lld collectives in %d steps, expected %d a step: FAILED\n", rank,
           (long long)(kiln_dist_collectives() - colls0), steps - 1, want_colls);
    status = 1;
  }
  if (compiled) {
    /* every call after the first ran the graph, with one allreduce per gradient and one for the loss */
    kiln_fn_stats st;
    char *graph = kiln_fn_get_stats(fn, &st) == 0 ? kiln_fn_graph(fn, 0) : NULL;
    int n_ar = 0;
    for (const char *p = graph; p && (p = strstr(p, "= allreduce(")); p++) n_ar++;
    free(graph);
    bool ok = graph && st.hits == steps - 1 && n_ar == model.n_params + 1;
    if (rank == 0 || !ok)
      printf("process %d: %lld of %d calls ran the compiled graph, which has %d allreduce nodes: %s\n", rank,
             (long long)st.hits, steps, n_ar, ok ? "ok" : "FAILED");
    if (!ok) status = 1;
  }
  if (check) {
    double pd = gpt_params_max_diff(&model, &ref);
    double patol = f64 ? PARAM_ATOL_F64 : PARAM_ATOL_F32, lrtol = f64 ? LOSS_RTOL_F64 : LOSS_RTOL_F32;
    bool ok = pd >= 0 && pd <= patol && worst_loss <= lrtol;
    printf("process %d: params max |ddp - one process| %.3g (allowed %.0e), losses max rel diff %.3g (allowed %.0e): %s\n",
           rank, pd, patol, worst_loss, lrtol, ok ? "ok" : "FAILED");
    if (!ok) status = 1;
  }
  if (rank == 0) printf("final loss %.6f\n", loss_last);
  goto done;
fail:
  fprintf(stderr, "gpt_ddp: process %d: %s\n", rank, kiln_last_error());
done:
  kiln_fn_free(fn);
  gpt_free(&model);
  gpt_free(&ref);
  gpt_data_free(&data);
  return status;
}
