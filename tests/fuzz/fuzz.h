/* Shared by the libFuzzer targets in tests/fuzz: a reader that turns the
 * fuzzer's bytes into choices (zeros once they run out, so every input is a
 * complete run), and a check that prints why and aborts, which libFuzzer
 * reports as a crash with the input saved. */
#ifndef KILN_FUZZ_H
#define KILN_FUZZ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

typedef struct fuzz_in {
  const uint8_t *p;
  size_t n, at;
} fuzz_in;

static inline unsigned fuzz_byte(fuzz_in *f) { return f->at < f->n ? f->p[f->at++] : 0; }
static inline bool fuzz_left(const fuzz_in *f) { return f->at < f->n; }
/* A choice in [0, n), n <= 256: one byte, so a mutation of it changes only this choice. */
static inline int fuzz_pick(fuzz_in *f, int n) { return n <= 1 ? 0 : (int)(fuzz_byte(f) % (unsigned)n); }
static inline bool fuzz_chance(fuzz_in *f, int one_in) { return fuzz_pick(f, one_in) == 0; }

#define FUZZ_CHECK(cond, ...)                                                          \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      fprintf(stderr, "\nfuzz check failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                                    \
      fputc('\n', stderr);                                                             \
      abort();                                                                         \
    }                                                                                  \
  } while (0)

#endif
