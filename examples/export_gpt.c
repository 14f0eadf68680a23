/* export_gpt: the GPT forward of gpt.h (GPT_BENCH_CONFIG, the next-byte
 * logits, the context length symbolic) compiled three ways and exported:
 *
 *   export_gpt DIR [--native]
 *
 * prints the first call's time (trace, compile, run) with the kernel cache
 * cold, with its kernels in memory (a second compiled function of the same
 * body), and with them only on disk (KILN_CACHE_DIR set to DIR/cache, the
 * memory cleared, as a later run of a program finds them), and the time per
 * call; then writes DIR/gpt_fwd.o and DIR/gpt_fwd.h (kiln_export; --native:
 * for this machine's CPU, else a generic one), which a program links with
 * libkiln_rt alone (examples/deploy/gpt_app.c; docs/deploy.md, "Sizes and
 * times", has the numbers). */
#define _POSIX_C_SOURCE 200809L /* setenv, clock_gettime */
#include <sys/stat.h>
#include <time.h>

#include "gpt.h"

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* A new compiled forward and its first call on idx: the ms it took, or -1. */
static double first_call(gpt *g, kiln_tensor *idx, kiln_fn **fn) {
  *fn = kiln_compile(gpt_next_body, g, &(kiln_options){.name = "gpt", .n_in = 1, .n_out = 1});
  kiln_tensor *out = NULL;
  if (!*fn || kiln_mark_dynamic(*fn, 0, 1)) return -1;
  kiln_scope_begin(); /* owns the output */
  double t0 = now_ms();
  int rc = kiln_call(*fn, &idx, &out);
  double t1 = now_ms();
  kiln_scope_end();
  return rc ? -1 : t1 - t0;
}

int main(int argc, char **argv) {
  if (argc < 2 || argc > 3 || (argc == 3 && strcmp(argv[2], "--native"))) {
    fprintf(stderr, "usage: %s DIR [--native]\n", argv[0]);
    return 2;
  }
  const char *dir = argv[1];
  char cache[4096], prefix[4096];
  snprintf(cache, sizeof cache, "%s/cache", dir);
  snprintf(prefix, sizeof prefix, "%s/gpt_fwd", dir);
  mkdir(dir, 0777);
  mkdir(cache, 0700);
  setenv("KILN_CACHE_DIR", cache, 1); /* before the first compile */
  gpt_config cfg = GPT_BENCH_CONFIG;
  gpt g;
  if (gpt_init(&g, &cfg, 1)) return 1;
  int64_t ctx[64];
  for (int t = 0; t < 64; t++) ctx[t] = (t * 37 + 11) % 256;
  kiln_scope_begin();
  kiln_tensor *idx = kiln_tensor_from(KILN_I64, 2, ((int64_t[]){1, cfg.block_size}), ctx);
  kiln_fn *fn[3] = {0};
  kiln_cache_clear();
  double cold = first_call(&g, idx, &fn[0]);     /* the disk cache is new and empty */
  double memory = first_call(&g, idx, &fn[1]);   /* the kernels of fn[0], in memory */
  kiln_cache_clear();
  double disk = first_call(&g, idx, &fn[2]);     /* the kernels fn[0] wrote to DIR/cache */
  int rc = cold < 0 || memory < 0 || disk < 0 ? -1 : 0;
  double per = 0;
  float logits[256]; /* V */
  for (int i = 0; i < 20 && !rc; i++) {
    kiln_tensor *out = NULL;
    kiln_scope_begin();
    double t0 = now_ms();
    rc = kiln_call(fn[0], &idx, &out);
    double t = now_ms() - t0;
    if (!rc && i == 0) rc = kiln_read(out, logits, sizeof logits);
    kiln_scope_end();
    per = i == 0 || t < per ? t : per;
  }
  if (!rc) {
    printf("first call, kernel cache cold:      %8.2f ms\n", cold);
    printf("first call, kernels in memory:      %8.2f ms\n", memory);
    printf("first call, kernels on disk only:   %8.2f ms\n", disk);
    printf("per call (best of 20):              %8.2f ms\n", per);
    printf("logits[0..3]: %.6f %.6f %.6f %.6f\n", logits[0], logits[1], logits[2], logits[3]);
    const char *cpu = argc == 3 ? "native" : NULL;
    rc = kiln_export(fn[0], prefix, &(kiln_export_options){.name = "gpt_fwd", .cpu = cpu});
  }
  if (!rc) printf("wrote %s.o and %s.h (cpu %s)\n", prefix, prefix, argc == 3 ? "native" : "generic");
  else fprintf(stderr, "export_gpt: %s\n", kiln_last_error());
  for (int i = 0; i < 3; i++) kiln_fn_free(fn[i]);
  kiln_scope_end();
  gpt_free(&g);
  return rc ? 1 : 0;
}
