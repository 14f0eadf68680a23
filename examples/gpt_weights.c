/* gpt_weights: the GPT of gpt.h with its weights in a safetensors file
 * under PyTorch's names, the state_dict keys of bench/torch_gpt.py's model,
 * so that weights move between kiln and PyTorch (bench/torch_roundtrip.py
 * runs both directions and compares the logits).
 *
 *   gpt_weights load WEIGHTS IDX OUT
 *       loads WEIGHTS (as safetensors.torch.save_file(model.state_dict())
 *       writes it) into a GPT_BENCH_CONFIG model, the tokens "idx" (B,T)
 *       i64 from IDX, and writes OUT with "logits" (B,T,V) f32, eager, and
 *       "logits_compiled", the same through kiln_compile.
 *   gpt_weights save SEED WEIGHTS IDX OUT
 *       a model initialized by gpt_init(SEED): writes its weights to WEIGHTS
 *       under the same names, and OUT as above from that model.
 *
 * The names: gpt.h's "h1.attn_w" is the state_dict's "blocks.1.attn_w";
 * "wte", "wpe", "lnf_w" and "lnf_b" are the same. Both models hold their
 * matrices (in,out) and apply them as x @ W (neither has an nn.Linear,
 * whose weight is (out,in)), so no weight is transposed, and both tie the
 * output projection to wte (logits = h @ wte^T), so there is no separate
 * head in either file. The state_dict's "mask" buffer is not a weight:
 * load skips it, gpt_init makes its own. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpt.h"

/* The state_dict key of gpt.h's param i. */
static const char *torch_key(const gpt_config *c, int i, char *buf, size_t n) {
  char own[64];
  gpt_param_name(c, i, own, sizeof own);
  int layer;
  const char *dot = strchr(own, '.');
  if (own[0] == 'h' && dot && sscanf(own, "h%d.", &layer) == 1) snprintf(buf, n, "blocks.%d.%s", layer, dot + 1);
  else snprintf(buf, n, "%s", own);
  return buf;
}

/* logits (B,T,V) = gpt_head(gpt_hidden(idx)), no autograd */
static int logits_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  const gpt *g = ctx;
  kiln_no_grad_begin();
  out[0] = gpt_head(g, gpt_hidden(g, in[0]));
  kiln_no_grad_end();
  return out[0] ? 0 : -1;
}

/* OUT <- the logits of idx (from IDX's "idx"), eager and compiled. 0 or -1. */
static int write_logits(gpt *g, const char *idx_path, const char *out_path) {
  kiln_tensor *idx = NULL, *out[2] = {0};
  const char *idx_name = "idx";
  if (kiln_load_tensors(idx_path, 1, &idx_name, &idx)) return -1;
  kiln_fn *fn = kiln_compile(logits_body, g, &(kiln_options){.name = "gpt_logits", .n_in = 1, .n_out = 1});
  int rc = -1;
  if (fn && kiln_ndim(idx) == 2 && kiln_type(idx) == KILN_I64 && !logits_body(g, &idx, &out[0]) &&
      !kiln_call(fn, &idx, &out[1])) {
    const char *names[2] = {"logits", "logits_compiled"};
    rc = kiln_save_tensors(out_path, 2, names, out);
  } else if (idx && (kiln_ndim(idx) != 2 || kiln_type(idx) != KILN_I64)) {
    fprintf(stderr, "%s: \"idx\" must be (B,T) i64\n", idx_path);
  }
  kiln_fn_free(fn); /* the tensors belong to the caller's scope */
  return rc;
}

int main(int argc, char **argv) {
  bool load = argc == 5 && !strcmp(argv[1], "load"), save = argc == 6 && !strcmp(argv[1], "save");
  if (!load && !save) {
    fprintf(stderr, "usage: %s load WEIGHTS IDX OUT\n       %s save SEED WEIGHTS IDX OUT\n", argv[0], argv[0]);
    return 2;
  }
  gpt_config cfg = GPT_BENCH_CONFIG;
  gpt g;
  if (gpt_init(&g, &cfg, save ? strtoull(argv[2], NULL, 10) : 0)) {
    fprintf(stderr, "gpt_init: %s\n", kiln_last_error());
    return 1;
  }
  int n = g.n_params;
  char(*keys)[64] = calloc((size_t)n, sizeof *keys);
  const char **names = calloc((size_t)n, sizeof *names);
  int rc = keys && names ? 0 : -1;
  for (int i = 0; i < n && !rc; i++) names[i] = torch_key(&cfg, i, keys[i], sizeof keys[i]);
  const char *weights = argv[load ? 2 : 3];
  kiln_scope_begin();
  if (!rc) rc = load ? kiln_load_tensors_into(weights, n, names, g.p) : kiln_save_tensors(weights, n, names, g.p);
  if (!rc) rc = write_logits(&g, argv[load ? 3 : 4], argv[load ? 4 : 5]);
  kiln_scope_end();
  if (rc) fprintf(stderr, "gpt_weights: %s\n", kiln_last_error());
  free(keys);
  free(names);
  gpt_free(&g);
  return rc ? 1 : 0;
}
