/* Llama-2 generation with a KV cache through one compiled variant.
 *
 *   llama [model.bin [tokenizer.bin]] [-n tokens] [--eager] [--train] [--15m]
 *
 * model.bin is a llama2.c checkpoint (stories15M.bin, say) and tokenizer.bin
 * its tokenizer; without them a model of random weights in a small config is
 * written to a temporary file and loaded back (--15m: stories15M's shape),
 * and tokens print as numbers.
 * Generation is greedy from BOS. --eager runs every step eagerly instead;
 * --train first takes one SGD step on the first tokens and prints the loss
 * before and after. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "llama.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
  const char *model = NULL, *tok_path = NULL;
  int n = 64;
  bool eager = false, train = false, big = false;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "-n") && i + 1 < argc) n = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--eager")) eager = true;
    else if (!strcmp(argv[i], "--train")) train = true;
    else if (!strcmp(argv[i], "--15m")) big = true;
    else if (!model) model = argv[i];
    else if (!tok_path) tok_path = argv[i];
    else {
      fprintf(stderr, "usage: %s [model.bin [tokenizer.bin]] [-n tokens] [--eager] [--train] [--15m]\n", argv[0]);
      return 2;
    }
  }
  llama m;
  char tmp[64] = "";
  if (!model) {
    llama_config c = {.dim = 64, .hidden_dim = 172, .n_layers = 2, .n_heads = 4, .n_kv_heads = 2, .vocab_size = 256,
                      .seq_len = 128, .untied = true};
    if (big) c = LLAMA_STORIES15M;
    snprintf(tmp, sizeof tmp, "/tmp/kiln_llama_demo_%d.bin", (int)getpid());
    if (llama_init(&m, &c, 1) || llama_save(&m, tmp)) return fprintf(stderr, "llama: %s\n", kiln_last_error()), 1;
    llama_free(&m);
    model = tmp;
    printf("random weights (dim %d, %d layers, %d heads over %d kv heads), written to %s\n", c.dim, c.n_layers, c.n_heads,
           c.n_kv_heads, tmp);
  }
  if (llama_load(&m, model, KILN_F32)) return 1;
  if (tmp[0]) remove(tmp);
  llama_tokenizer tk = {0};
  if (tok_path && llama_tokenizer_load(&tk, tok_path, m.cfg.vocab_size)) return 1;
  if (n < 1 || n >= m.cfg.seq_len) n = m.cfg.seq_len - 1;

  if (train) {
    int64_t t[33];
    for (int i = 0; i < 33; i++) t[i] = (i * 7919 + 13) % m.cfg.vocab_size;
    llama_requires_grad(&m, true);
    kiln_scope_begin();
    kiln_tensor *tokens = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){33}), t);
    kiln_tensor *before = llama_train_step(&m, tokens, 1e-3);
    kiln_tensor *after = before ? llama_loss(&m, tokens) : NULL;
    if (!after) return fprintf(stderr, "llama: %s\n", kiln_last_error()), 1;
    printf("one SGD step on 32 tokens: loss %.4f -> %.4f\n", kiln_item(before), kiln_item(after));
    kiln_scope_end();
    llama_requires_grad(&m, false);
  }

  /* the position is an input: one graph for every step, and calls skip running the body */
  kiln_options o = {.name = "llama_step", .n_in = 2, .n_out = 1, .capture = KILN_CAPTURE_GUARDS};
  kiln_fn *fn = eager ? NULL : kiln_compile(llama_step_body, &m, &o);
  int64_t *out = malloc(sizeof *out * (size_t)(n + 1)), bos = LLAMA_BOS;
  double t0 = now_s();
  if (!out || llama_generate(&m, fn, &bos, 1, n, out)) return fprintf(stderr, "llama: %s\n", kiln_last_error()), 1;
  double dt = now_s() - t0;
  char buf[2];
  for (int i = 1; i <= n; i++) {
    if (tk.n) fputs(llama_decode_piece(&tk, (int)out[i - 1], (int)out[i], buf), stdout);
    else printf("%lld ", (long long)out[i]);
  }
  printf("\n%d tokens in %.3f s (%.1f tok/s, %s, the first call traces and compiles)\n", n, dt, n / dt,
         eager ? "eager" : "compiled");
  if (fn) {
    kiln_fn_stats st;
    kiln_fn_get_stats(fn, &st);
    printf("compiled: %lld calls, %lld variant(s), %lld hits\n", (long long)st.calls, (long long)st.variants,
           (long long)st.hits);
    kiln_fn_free(fn);
  }
  free(out);
  llama_tokenizer_free(&tk);
  llama_free(&m);
  return 0;
}
