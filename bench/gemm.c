/* kiln_bench --gemm [--threads N]: kiln's own f32 GEMM (src/eager/gemm.c)
 * against OpenBLAS's cblas_sgemm on the shapes kiln's workloads run, the two
 * timed in alternation, sample by sample, so that load falls on both alike.
 * Prints the kernels each side runs (OpenBLAS picks its own by CPU model or
 * OPENBLAS_CORETYPE), median ms per product, GFLOP/s and the ratio.
 *
 * Where OpenBLAS runs AVX-512 kernels, kiln leaves it the bigger products:
 * KILN_GEMM=kiln makes kiln's GEMM take them, for this comparison.
 *
 * Without --threads it runs at 1 thread, timing CPU seconds: they measure
 * the work even on a loaded machine. At more threads it times wall seconds. */
#define _POSIX_C_SOURCE 200809L
#include <cblas.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "eager/gemm.h"
#include "kiln.h"
#include "stats.h"

char *openblas_get_corename(void);

enum { SAMPLES = 15 };

static const struct {
  const char *what;
  int m, n, k;
  bool tb;
} SHAPES[] = {
    {"llama q/k/v/o, T=64 (W12)", 64, 288, 288, false},
    {"llama w1/w3, T=64 (W12)", 64, 768, 288, false},
    {"llama w2, T=64 (W12)", 64, 288, 768, false},
    {"llama head x @ wte^T (W12)", 64, 32000, 288, true},
    {"gpt2-small qkv, B*T=256 (W8)", 256, 2304, 768, false},
    {"gpt2-small mlp, B*T=256 (W8)", 256, 3072, 768, false},
    {"resnet18 3x3 conv 64ch 32x32 (W13)", 64, 1024, 576, false},
    {"resnet18 3x3 conv 512ch 4x4 (W13 b1)", 512, 16, 4608, false},
    {"mlp 1024^3 (W4-like)", 1024, 1024, 1024, false},
};

static double cpu_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int bench_gemm(int threads) {
  kiln_set_num_threads(threads);
  printf("kiln GEMM: %s kernel; OpenBLAS: %s kernels (OPENBLAS_CORETYPE=%s); %d thread%s\n", gemm_kernel_name(),
         openblas_get_corename(), getenv("OPENBLAS_CORETYPE") ? getenv("OPENBLAS_CORETYPE") : "unset", threads,
         threads == 1 ? "" : "s");
  if (!strcmp(gemm_kernel_name(), "blas")) {
    printf("kiln's GEMM does not run on this CPU (or KILN_GEMM=blas): nothing to compare\n");
    return 0;
  }
  printf("%-38s %16s %10s %10s %9s %9s %7s\n", "shape (m x n x k)", "", "BLAS ms", "kiln ms", "BLAS GF/s",
         "kiln GF/s", "ratio");
  const char *clock_name = threads == 1 ? "cpu" : "wall";
  for (size_t s = 0; s < sizeof SHAPES / sizeof *SHAPES; s++) {
    int m = SHAPES[s].m, n = SHAPES[s].n, k = SHAPES[s].k;
    bool tb = SHAPES[s].tb;
    float *a = malloc(sizeof(float) * (size_t)m * (size_t)k), *b = malloc(sizeof(float) * (size_t)k * (size_t)n);
    float *c = malloc(sizeof(float) * (size_t)m * (size_t)n);
    if (!a || !b || !c) return 1;
    for (size_t i = 0; i < (size_t)m * (size_t)k; i++) a[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f;
    for (size_t i = 0; i < (size_t)k * (size_t)n; i++) b[i] = (float)((i * 104729) % 1000) / 1000.0f - 0.5f;
    double flop = 2.0 * m * n * k, tblas[SAMPLES], tkiln[SAMPLES];
    /* repeats per sample: about 20 ms of work */
    int reps = (int)(2e9 / flop) + 1;
    for (int r = -2; r < SAMPLES; r++) { /* two warm-up rounds */
      for (int side = 0; side < 2; side++) {
        double t0 = threads == 1 ? cpu_s() : bench_now_s();
        for (int q = 0; q < reps; q++) {
          if (side == 0)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, 1.0f, a, k, b,
                        tb ? k : n, 0.0f, c, n);
          else if (!kgemm_f32(false, tb, m, n, k, 1.0f, a, k, b, tb ? k : n, 0.0f, c, n))
            return fprintf(stderr, "kiln's GEMM leaves %dx%dx%d to OpenBLAS here: run with KILN_GEMM=kiln\n", m, n,
                           k),
                   1;
        }
        double t = ((threads == 1 ? cpu_s() : bench_now_s()) - t0) / reps;
        if (r >= 0) (side ? tkiln : tblas)[r] = t;
      }
    }
    double mb = bench_median(tblas, SAMPLES), mk = bench_median(tkiln, SAMPLES);
    char shape[40];
    snprintf(shape, sizeof shape, "%dx%dx%d%s", m, n, k, tb ? " B^T" : "");
    printf("%-38s %16s %10.3f %10.3f %9.1f %9.1f %6.2fx\n", SHAPES[s].what, shape, mb * 1e3, mk * 1e3, flop / mb * 1e-9,
           flop / mk * 1e-9, mb / mk);
    free(a), free(b), free(c);
  }
  printf("(%s time; ratio above 1: kiln's GEMM is faster)\n", clock_name);
  return 0;
}
