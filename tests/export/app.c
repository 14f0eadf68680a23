/* A program that links an exported model and libkiln_rt only (no libkiln,
 * no LLVM): test_export builds it against each model it exports, with
 * -DMODEL_H="name.h" -DRUN=name_run -DERROR=name_error, natively or with a
 * cross compiler (run under qemu). It runs the calls a request file lists
 * and writes what each returned:
 *
 *   request (int64 words, then raw data):  n_calls; per call: n_in, n_out,
 *     per input: elem_size, ndim, shape[ndim], then its bytes; per output: elem_size
 *   reply: per call: rc; rc 0: per output ndim, shape[ndim], then its bytes;
 *     rc -1: the error's length and text
 *
 * Outputs are allocated by the runtime (data NULL), except with
 * KILN_APP_OUT_BUFFERS=1, when the app passes buffers of the shape the first
 * call returned (a later call of another shape must then be an error). */
#include <stdint.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include MODEL_H

static int64_t word(FILE *f) {
  int64_t v = 0;
  if (fread(&v, sizeof v, 1, f) != 1) {
    fprintf(stderr, "app: short request\n");
    exit(2);
  }
  return v;
}

static void put(FILE *f, const void *p, size_t n) {
  if (n && fwrite(p, 1, n, f) != n) {
    fprintf(stderr, "app: cannot write the reply\n");
    exit(2);
  }
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: app REQUEST REPLY\n");
    return 2;
  }
  FILE *f = fopen(argv[1], "rb"), *o = fopen(argv[2], "wb");
  if (!f || !o) return 2;
  int64_t calls = word(f);
  kiln_rt_buffer kept[16];
  size_t kept_es[16];
  int have_kept = 0;
  const char *ob = getenv("KILN_APP_OUT_BUFFERS");
  for (int64_t c = 0; c < calls; c++) {
    int64_t n_in = word(f), n_out = word(f);
    if (n_in > 16 || n_out > 16) return 2;
    kiln_rt_buffer in[16], out[16];
    size_t es[16];
    memset(in, 0, sizeof in), memset(out, 0, sizeof out);
    for (int i = 0; i < n_in; i++) {
      size_t e = (size_t)word(f), n = 1;
      in[i].ndim = (int)word(f);
      for (int d = 0; d < in[i].ndim; d++) in[i].shape[d] = word(f), n *= (size_t)in[i].shape[d];
      in[i].data = malloc(n * e + 1);
      if (!in[i].data || fread(in[i].data, e, n, f) != n) return 2;
    }
    for (int i = 0; i < n_out; i++) es[i] = (size_t)word(f);
    if (ob && !strcmp(ob, "1") && have_kept)
      for (int i = 0; i < n_out; i++) {
        size_t n = 1;
        for (int d = 0; d < kept[i].ndim; d++) n *= (size_t)kept[i].shape[d];
        out[i] = kept[i];
        out[i].data = malloc(n * kept_es[i] + 1);
      }
    int64_t rc = RUN(in, out);
    put(o, &rc, sizeof rc);
    if (rc == 0) {
      for (int i = 0; i < n_out; i++) {
        int64_t nd = out[i].ndim;
        size_t n = 1;
        put(o, &nd, sizeof nd);
        for (int d = 0; d < out[i].ndim; d++) put(o, &out[i].shape[d], 8), n *= (size_t)out[i].shape[d];
        put(o, out[i].data, n * es[i]);
        if (!have_kept) kept[i] = out[i], kept_es[i] = es[i];
      }
      have_kept = 1;
    } else {
      const char *msg = ERROR();
      int64_t len = (int64_t)strlen(msg);
      put(o, &len, sizeof len);
      put(o, msg, (size_t)len);
    }
    for (int i = 0; i < n_in; i++) free(in[i].data);
    for (int i = 0; i < n_out; i++) free(out[i].data);
  }
  fclose(f);
#ifdef KILN_RT_TEST_COUNTS
  extern atomic_long kiln_rt_test_copies;
  FILE *c = fopen("copies", "w");
  if (!c || fprintf(c, "%ld\n", atomic_load(&kiln_rt_test_copies)) < 0 || fclose(c)) return 2;
#endif
  return fclose(o) ? 2 : 0;
}
