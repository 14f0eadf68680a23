/* The Llama-2 decoder of examples/llama.h against a reference written here
 * in plain C (double precision, one token at a time with its own KV cache,
 * from the weights of a checkpoint this test writes byte by byte in
 * llama2.c's format), then compiled against eager: generation through one
 * compiled variant at every position, a forward of many tokens, and a
 * training step (loss against the reference, gradients against finite
 * differences in f64, compiled against eager). */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../examples/llama.h"
#include "kiln.h"

/* grouped-query (4 heads over 2 kv heads), untied head, hidden not a multiple of dim */
static const llama_config TINY = {.dim = 16, .hidden_dim = 24, .n_layers = 2, .n_heads = 4, .n_kv_heads = 2,
                                  .vocab_size = 40, .seq_len = 24, .untied = true};

/* ---- the reference ---- */

typedef struct ref {
  llama_config c;
  float *emb, *rms_att, *wq, *wk, *wv, *wo, *rms_ffn, *w1, *w2, *w3, *rms_final, *wcls;
  double *kc, *vc; /* (L, seq, KV) */
  float *all;
} ref;

static uint64_t rng_state = 88172645463325252ull;
static float urand(void) {
  rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
  return (float)((double)(rng_state >> 11) * 0x1.0p-53 - 0.5);
}

/* Random weights in the file's order; writes the checkpoint to path. */
static void ref_make(ref *r, const llama_config *c, const char *path) {
  memset(r, 0, sizeof *r);
  r->c = *c;
  int64_t D = c->dim, H = c->hidden_dim, L = c->n_layers, V = c->vocab_size, KV = D * c->n_kv_heads / c->n_heads;
  int64_t hs = D / c->n_heads;
  int64_t sizes[] = {V * D, L * D, L * D * D, L * KV * D, L * KV * D, L * D * D, L * D, L * H * D, L * D * H, L * H * D, D,
                     c->seq_len * hs, V * D};
  int64_t total = 0;
  for (int i = 0; i < 13; i++) total += sizes[i];
  r->all = calloc((size_t)total, sizeof(float));
  ck_assert_ptr_nonnull(r->all);
  float **dst[] = {&r->emb, &r->rms_att, &r->wq, &r->wk, &r->wv, &r->wo, &r->rms_ffn, &r->w1, &r->w2, &r->w3, &r->rms_final,
                   NULL, &r->wcls};
  float *p = r->all;
  for (int i = 0; i < 13; i++) {
    bool norm = i == 1 || i == 6 || i == 10;
    for (int64_t j = 0; j < sizes[i]; j++) p[j] = i == 11 ? 0.0f : norm ? 1.0f + 0.2f * urand() : 0.6f * urand();
    if (dst[i]) *dst[i] = p;
    p += sizes[i];
  }
  FILE *f = fopen(path, "wb");
  ck_assert_ptr_nonnull(f);
  int32_t h[7] = {c->dim, c->hidden_dim, c->n_layers, c->n_heads, c->n_kv_heads, c->untied ? -c->vocab_size : c->vocab_size,
                  c->seq_len};
  ck_assert_int_eq(1, fwrite(h, sizeof h, 1, f));
  ck_assert_int_eq(total, fwrite(r->all, sizeof(float), (size_t)total, f));
  fclose(f);
  r->kc = calloc((size_t)(L * c->seq_len * KV), sizeof(double));
  r->vc = calloc((size_t)(L * c->seq_len * KV), sizeof(double));
}

static void ref_free(ref *r) { free(r->all), free(r->kc), free(r->vc); }

static void rmsnorm(double *o, const double *x, const float *w, int n) {
  double ss = 0;
  for (int i = 0; i < n; i++) ss += x[i] * x[i];
  double s = 1.0 / sqrt(ss / n + 1e-5);
  for (int i = 0; i < n; i++) o[i] = x[i] * s * w[i];
}

/* o[d] = W (d,n) x */
static void matvec(double *o, const double *x, const float *w, int n, int d) {
  for (int i = 0; i < d; i++) {
    double s = 0;
    for (int j = 0; j < n; j++) s += (double)w[(int64_t)i * n + j] * x[j];
    o[i] = s;
  }
}

/* Logits (V) of token tok at position pos, through the reference's cache. */
static void ref_step(ref *r, int tok, int pos, double *logits) {
  const llama_config *c = &r->c;
  int D = c->dim, H = c->hidden_dim, KV = D * c->n_kv_heads / c->n_heads, hs = D / c->n_heads, g = c->n_heads / c->n_kv_heads;
  double x[64], h[64], q[64], k[64], v[64], y[64], o[64], a[64], b[64], att[64];
  for (int i = 0; i < D; i++) x[i] = r->emb[(int64_t)tok * D + i];
  for (int l = 0; l < c->n_layers; l++) {
    rmsnorm(h, x, r->rms_att + l * D, D);
    matvec(q, h, r->wq + (int64_t)l * D * D, D, D);
    matvec(k, h, r->wk + (int64_t)l * KV * D, D, KV);
    matvec(v, h, r->wv + (int64_t)l * KV * D, D, KV);
    /* each head's pairs turn by pos * 10000^(-2j/hs) */
    for (int i = 0; i < D; i += 2) {
      double th = pos * pow(10000.0, -(double)(i % hs) / hs), cs = cos(th), sn = sin(th);
      double q0 = q[i], q1 = q[i + 1];
      q[i] = q0 * cs - q1 * sn, q[i + 1] = q0 * sn + q1 * cs;
      if (i < KV) {
        double k0 = k[i], k1 = k[i + 1];
        k[i] = k0 * cs - k1 * sn, k[i + 1] = k0 * sn + k1 * cs;
      }
    }
    double *kc = r->kc + (int64_t)l * c->seq_len * KV, *vc = r->vc + (int64_t)l * c->seq_len * KV;
    memcpy(kc + pos * KV, k, sizeof(double) * (size_t)KV);
    memcpy(vc + pos * KV, v, sizeof(double) * (size_t)KV);
    for (int hd = 0; hd < c->n_heads; hd++) {
      int kvh = hd / g;
      double mx = -INFINITY, sum = 0;
      for (int t = 0; t <= pos; t++) {
        double s = 0;
        for (int i = 0; i < hs; i++) s += q[hd * hs + i] * kc[t * KV + kvh * hs + i];
        att[t] = s / sqrt((double)hs);
        mx = fmax(mx, att[t]);
      }
      for (int t = 0; t <= pos; t++) sum += att[t] = exp(att[t] - mx);
      for (int i = 0; i < hs; i++) {
        double s = 0;
        for (int t = 0; t <= pos; t++) s += att[t] / sum * vc[t * KV + kvh * hs + i];
        y[hd * hs + i] = s;
      }
    }
    matvec(o, y, r->wo + (int64_t)l * D * D, D, D);
    for (int i = 0; i < D; i++) x[i] += o[i];
    rmsnorm(h, x, r->rms_ffn + l * D, D);
    matvec(a, h, r->w1 + (int64_t)l * H * D, D, H);
    matvec(b, h, r->w3 + (int64_t)l * H * D, D, H);
    for (int i = 0; i < H; i++) a[i] = a[i] / (1 + exp(-a[i])) * b[i];
    matvec(o, a, r->w2 + (int64_t)l * D * H, H, D);
    for (int i = 0; i < D; i++) x[i] += o[i];
  }
  rmsnorm(h, x, r->rms_final, D);
  matvec(logits, h, r->wcls, D, c->vocab_size);
}

/* ---- helpers ---- */

static char ckpt[64];
static void make_path(void) { snprintf(ckpt, sizeof ckpt, "/tmp/kiln_llama_%d.bin", (int)getpid()); }

static double maxdiff_to(kiln_tensor *t, const double *want, int64_t n) {
  ck_assert_msg(t != NULL, "%s", kiln_last_error());
  ck_assert_int_eq(n, kiln_numel(t));
  double *got = malloc(sizeof(double) * (size_t)n), d = 0;
  kiln_scope_begin();
  ck_assert_int_eq(0, kiln_read(kiln_cast(t, KILN_F64), got, sizeof(double) * (size_t)n));
  kiln_scope_end();
  for (int64_t i = 0; i < n; i++) d = fmax(d, fabs(got[i] - want[i]));
  free(got);
  return d;
}

static double maxdiff(kiln_tensor *a, kiln_tensor *b) {
  ck_assert_msg(a && b, "%s", kiln_last_error());
  kiln_scope_begin();
  double r = kiln_item(kiln_max_axes(kiln_abs(kiln_sub(kiln_cast(a, KILN_F64), kiln_cast(b, KILN_F64))), NULL, 0, false));
  kiln_scope_end();
  return r;
}

static const int64_t TOKENS[] = {1, 7, 31, 2, 19, 19, 5, 38, 0, 12, 3, 27, 8, 30, 11, 22, 6, 14, 9, 35};
enum { N_TOK = sizeof TOKENS / sizeof TOKENS[0] };

/* ---- cases ---- */

/* The file's header and weights load as written, and save back byte for byte. */
START_TEST(test_checkpoint_round_trip) {
  make_path();
  ref r;
  ref_make(&r, &TINY, ckpt);
  llama m;
  ck_assert_int_eq(0, llama_load(&m, ckpt, KILN_F32));
  ck_assert_int_eq(TINY.dim, m.cfg.dim);
  ck_assert_int_eq(TINY.n_kv_heads, m.cfg.n_kv_heads);
  ck_assert_int_eq(TINY.vocab_size, m.cfg.vocab_size);
  ck_assert(m.cfg.untied);
  ck_assert(m.wcls != m.tok_emb);
  char again[80];
  snprintf(again, sizeof again, "%s.again", ckpt);
  ck_assert_int_eq(0, llama_save(&m, again));
  FILE *a = fopen(ckpt, "rb"), *b = fopen(again, "rb");
  int ca, cb;
  long n = 0;
  do {
    ca = fgetc(a), cb = fgetc(b), n++;
    ck_assert_msg(ca == cb, "byte %ld differs", n);
  } while (ca != EOF);
  fclose(a), fclose(b);
  /* a truncated file is refused with a message, not a crash */
  ck_assert_int_eq(0, truncate(again, 200));
  llama bad;
  ck_assert_int_eq(-1, llama_load(&bad, again, KILN_F32));
  remove(again), remove(ckpt);
  llama_free(&m);
  ref_free(&r);
}
END_TEST

/* tokenizer.bin: pieces, byte tokens and the space dropped after BOS. */
START_TEST(test_tokenizer) {
  make_path();
  const char *pieces[] = {"<unk>", "<s>", "</s>", "<0x0A>", " Once", "upon", "<0x41>"};
  FILE *f = fopen(ckpt, "wb");
  int32_t mx = 8;
  fwrite(&mx, 4, 1, f);
  for (int i = 0; i < 7; i++) {
    float sc = (float)-i;
    int32_t n = (int32_t)strlen(pieces[i]);
    fwrite(&sc, 4, 1, f), fwrite(&n, 4, 1, f), fwrite(pieces[i], 1, (size_t)n, f);
  }
  fclose(f);
  llama_tokenizer t;
  ck_assert_int_eq(0, llama_tokenizer_load(&t, ckpt, 7));
  char buf[2];
  ck_assert_str_eq("Once", llama_decode_piece(&t, LLAMA_BOS, 4, buf));
  ck_assert_str_eq(" Once", llama_decode_piece(&t, 5, 4, buf));
  ck_assert_str_eq("\n", llama_decode_piece(&t, 4, 3, buf));
  ck_assert_str_eq("A", llama_decode_piece(&t, 4, 6, buf));
  ck_assert_str_eq("upon", llama_decode_piece(&t, 4, 5, buf));
  ck_assert_str_eq("", llama_decode_piece(&t, 4, 99, buf));
  ck_assert_float_eq(-5.0f, t.score[5]);
  llama_tokenizer_free(&t);
  /* more tokens than the file has: refused */
  ck_assert_int_eq(-1, llama_tokenizer_load(&t, ckpt, 8));
  remove(ckpt);
}
END_TEST

/* Eager decoding token by token, and one forward of all the tokens, against the reference. */
START_TEST(test_eager_matches_reference) {
  make_path();
  ref r;
  ref_make(&r, &TINY, ckpt);
  llama m;
  ck_assert_int_eq(0, llama_load(&m, ckpt, KILN_F32));
  double want[N_TOK][40];
  for (int p = 0; p < N_TOK; p++) {
    ref_step(&r, (int)TOKENS[p], p, want[p]);
    kiln_scope_begin();
    kiln_tensor *tok = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){1}), &TOKENS[p]), *y;
    m.pos = p;
    ck_assert_int_eq(0, llama_decode_body(&m, &tok, &y));
    double d = maxdiff_to(y, want[p], TINY.vocab_size);
    ck_assert_msg(d < 2e-4, "position %d: logits differ from the reference by %g", p, d);
    kiln_scope_end();
  }
  kiln_scope_begin();
  kiln_tensor *all = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){N_TOK}), TOKENS), *y;
  ck_assert_int_eq(0, llama_forward_body(&m, &all, &y));
  double d = maxdiff_to(y, &want[0][0], N_TOK * TINY.vocab_size);
  ck_assert_msg(d < 2e-4, "forward of %d tokens differs from the reference by %g", N_TOK, d);
  kiln_scope_end();
  remove(ckpt);
  llama_free(&m);
  ref_free(&r);
}
END_TEST

/* The reference and two models loaded from its checkpoint: e eager, c compiled. */
static void load_pair(ref *r, llama *e, llama *c) {
  make_path();
  ref_make(r, &TINY, ckpt);
  ck_assert_int_eq(0, llama_load(e, ckpt, KILN_F32));
  ck_assert_int_eq(0, llama_load(c, ckpt, KILN_F32));
}

static void free_pair(ref *r, llama *e, llama *c) {
  remove(ckpt);
  llama_free(e), llama_free(c);
  ref_free(r);
}

/* Generation through one compiled variant: logits at every position equal
 * eager's, the caches too, and later calls are hits. */
START_TEST(test_compiled_generation) {
  ref r;
  llama e, c;
  load_pair(&r, &e, &c);
  kiln_options o = {.name = "llama_decode", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(llama_decode_body, &c, &o);
  ck_assert_ptr_nonnull(fn);
  for (int p = 0; p < N_TOK; p++) {
    kiln_scope_begin();
    kiln_tensor *tok = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){1}), &TOKENS[p]), *ye, *yc;
    e.pos = c.pos = p;
    ck_assert_int_eq(0, llama_decode_body(&e, &tok, &ye));
    ck_assert_msg(kiln_call(fn, &tok, &yc) == 0, "%s", kiln_last_error());
    double d = maxdiff(ye, yc);
    ck_assert_msg(d < 1e-4, "position %d: compiled logits differ from eager by %g", p, d);
    kiln_scope_end();
  }
  for (int l = 0; l < TINY.n_layers; l++) {
    ck_assert_msg(maxdiff(e.kc[l], c.kc[l]) < 1e-5, "layer %d key cache differs", l);
    ck_assert_msg(maxdiff(e.vc[l], c.vc[l]) < 1e-5, "layer %d value cache differs", l);
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(1, st.variants);
  ck_assert_int_le(st.traces, 2);
  ck_assert_int_ge(st.hits, N_TOK - 2);
  ck_assert_int_eq(0, st.fallbacks);
  /* greedy generation through fn and eagerly picks the same tokens */
  int64_t te[N_TOK], tc[N_TOK];
  ck_assert_int_eq(0, llama_generate(&e, NULL, TOKENS, 3, N_TOK - 3, te));
  ck_assert_int_eq(0, llama_generate(&c, fn, TOKENS, 3, N_TOK - 3, tc));
  for (int i = 0; i < N_TOK; i++) ck_assert_int_eq(te[i], tc[i]);
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(1, st.variants);
  kiln_fn_free(fn);
  free_pair(&r, &e, &c);
}
END_TEST

/* Decoding with the position as an input (llama_step_body), compiled on the
 * guard-only path: logits at every position equal the reference's, eagerly
 * and compiled; the body ran once (every later call skipped it); and
 * generation through it picks the tokens eager llama_decode_body picks. */
START_TEST(test_step_body_guard_path) {
  ref r;
  llama e, c;
  load_pair(&r, &e, &c);
  /* the kernels dumped to a file, to see the attention fused */
  char dir[] = "/tmp/kiln_llama_stepXXXXXX", path[256];
  ck_assert_ptr_nonnull(mkdtemp(dir));
  ck_assert_int_eq(0, setenv("KILN_DUMP_DIR", dir, 1));
  kiln_options o = {.name = "llama_step", .n_in = 2, .n_out = 1, .capture = KILN_CAPTURE_GUARDS, .dump = KILN_DUMP_KERNELS};
  kiln_fn *fn = kiln_compile(llama_step_body, &c, &o);
  unsetenv("KILN_DUMP_DIR");
  ck_assert_ptr_nonnull(fn);
  for (int64_t p = 0; p < N_TOK; p++) {
    double want[40];
    ref_step(&r, (int)TOKENS[p], (int)p, want);
    kiln_scope_begin();
    kiln_tensor *in[2] = {kiln_tensor_from(KILN_I64, 1, ((int64_t[]){1}), &TOKENS[p]), kiln_tensor_from(KILN_I64, 1, ((int64_t[]){1}), &p)};
    kiln_tensor *ye, *yc;
    ck_assert_int_eq(0, llama_step_body(&e, in, &ye));
    ck_assert_msg(kiln_call(fn, in, &yc) == 0, "%s", kiln_last_error());
    double de = maxdiff_to(ye, want, TINY.vocab_size), dc = maxdiff_to(yc, want, TINY.vocab_size);
    ck_assert_msg(de < 2e-4 && dc < 2e-4, "position %lld: eager %g, compiled %g from the reference", (long long)p, de, dc);
    kiln_scope_end();
  }
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(1, st.traces);
  ck_assert_int_eq(1, st.variants);
  ck_assert_int_eq(N_TOK - 1, st.guard_hits);
  /* each layer's attention over the whole cache, its mask row picked by the
   * position, is one fused kernel (the decode form of attention.c) */
  snprintf(path, sizeof path, "%s/llama_step.1.kernels.txt", dir);
  FILE *f = fopen(path, "r");
  ck_assert_ptr_nonnull(f);
  char line[512];
  int fused = 0;
  while (fgets(line, sizeof line, f)) fused += strstr(line, "_attention ->") != NULL;
  fclose(f);
  ck_assert_int_eq(0, unlink(path));
  ck_assert_int_eq(0, rmdir(dir));
  ck_assert_int_eq(TINY.n_layers, fused);
  int64_t te[N_TOK], tc[N_TOK];
  ck_assert_int_eq(0, llama_generate(&e, NULL, TOKENS, 3, N_TOK - 3, te));
  ck_assert_int_eq(0, llama_generate(&c, fn, TOKENS, 3, N_TOK - 3, tc));
  for (int i = 0; i < N_TOK; i++) ck_assert_int_eq(te[i], tc[i]);
  kiln_fn_free(fn);
  free_pair(&r, &e, &c);
}
END_TEST

/* Mean cross entropy from the reference's logits. */
static double ref_loss(ref *r, int n) {
  double loss = 0, lg[40];
  memset(r->kc, 0, sizeof(double) * (size_t)(r->c.n_layers * r->c.seq_len * (r->c.dim * r->c.n_kv_heads / r->c.n_heads)));
  for (int p = 0; p + 1 < n; p++) {
    ref_step(r, (int)TOKENS[p], p, lg);
    double mx = -INFINITY, s = 0;
    for (int i = 0; i < r->c.vocab_size; i++) mx = fmax(mx, lg[i]);
    for (int i = 0; i < r->c.vocab_size; i++) s += exp(lg[i] - mx);
    loss += mx + log(s) - lg[TOKENS[p + 1]];
  }
  return loss / (n - 1);
}

static int train_body(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  out[0] = llama_train_step(ctx, in[0], 0.05);
  return out[0] ? 0 : -1;
}

/* A training step in f64: the loss is the reference's; the gradient of a few
 * weights matches central differences; compiled steps match eager ones. */
START_TEST(test_train_step) {
  make_path();
  ref r;
  ref_make(&r, &TINY, ckpt);
  llama e, c;
  ck_assert_int_eq(0, llama_load(&e, ckpt, KILN_F64));
  ck_assert_int_eq(0, llama_load(&c, ckpt, KILN_F64));
  enum { N = 9 };
  kiln_tensor *tok = kiln_tensor_from(KILN_I64, 1, ((int64_t[]){N}), TOKENS);
  double want = ref_loss(&r, N);
  /* gradients against central differences, on elements of wq, w2 and wcls */
  llama_requires_grad(&e, true);
  kiln_scope_begin();
  kiln_tensor *loss = llama_loss(&e, tok);
  ck_assert_msg(fabs(kiln_item(loss) - want) < 1e-6, "loss %.9g, reference %.9g", kiln_item(loss), want);
  ck_assert_int_eq(0, kiln_backward(loss));
  kiln_tensor *ws[3] = {llama_w(&e, 1, LL_WQ), llama_w(&e, 0, LL_W2), e.wcls};
  for (int w = 0; w < 3; w++) {
    int64_t n = kiln_numel(ws[w]);
    double *g = malloc(sizeof(double) * (size_t)n), *v = malloc(sizeof(double) * (size_t)n);
    ck_assert_int_eq(0, kiln_read(kiln_grad(ws[w]), g, sizeof(double) * (size_t)n));
    ck_assert_int_eq(0, kiln_read(ws[w], v, sizeof(double) * (size_t)n));
    for (int64_t i = 3; i < n; i += n / 5) {
      double lv[2], h = 1e-5;
      for (int s = 0; s < 2; s++) {
        double vi = v[i] + (s ? -h : h);
        kiln_tensor *one = kiln_tensor_from(KILN_F64, 1, ((int64_t[]){1}), &vi);
        kiln_no_grad_begin();
        kiln_copy_(kiln_slice(kiln_reshape(ws[w], 1, ((int64_t[]){n})), 0, i, i + 1, 1), one);
        lv[s] = kiln_item(llama_loss(&e, tok));
        kiln_no_grad_end();
      }
      kiln_tensor *orig = kiln_tensor_from(KILN_F64, 1, ((int64_t[]){1}), &v[i]);
      kiln_no_grad_begin();
      kiln_copy_(kiln_slice(kiln_reshape(ws[w], 1, ((int64_t[]){n})), 0, i, i + 1, 1), orig);
      kiln_no_grad_end();
      double fd = (lv[0] - lv[1]) / (2 * h);
      ck_assert_msg(fabs(fd - g[i]) < 1e-6 + 1e-4 * fabs(fd), "param %d element %lld: grad %.9g, differences %.9g", w,
                    (long long)i, g[i], fd);
    }
    free(g), free(v);
  }
  kiln_scope_end();
  llama_requires_grad(&e, false);
  kiln_tensor *ps[64];
  int np = llama_params(&e, ps);
  for (int i = 0; i < np; i++) kiln_zero_grad(ps[i]);
  /* three steps, eager and compiled */
  llama_requires_grad(&e, true);
  llama_requires_grad(&c, true);
  kiln_options o = {.name = "llama_train", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(train_body, &c, &o);
  for (int s = 0; s < 3; s++) {
    kiln_scope_begin();
    kiln_tensor *le = llama_train_step(&e, tok, 0.05), *lc = NULL;
    ck_assert_msg(le != NULL, "%s", kiln_last_error());
    ck_assert_msg(kiln_call(fn, &tok, &lc) == 0, "%s", kiln_last_error());
    if (s == 0) ck_assert_msg(fabs(kiln_item(le) - want) < 1e-6, "step loss %.9g, reference %.9g", kiln_item(le), want);
    ck_assert_msg(maxdiff(le, lc) < 1e-9, "step %d: loss eager %.12g, compiled %.12g", s, kiln_item(le), kiln_item(lc));
    kiln_scope_end();
  }
  kiln_tensor *pc[64];
  llama_params(&c, pc);
  for (int i = 0; i < np; i++) ck_assert_msg(maxdiff(ps[i], pc[i]) < 1e-9, "param %d differs after three steps", i);
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(1, st.variants);
  ck_assert_int_ge(st.hits, 1);
  kiln_fn_free(fn);
  kiln_release(tok);
  remove(ckpt);
  llama_free(&e), llama_free(&c);
  ref_free(&r);
}
END_TEST

int main(void) {
  Suite *s = suite_create("llama");
  TCase *tc = tcase_create("llama");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_checkpoint_round_trip);
  tcase_add_test(tc, test_tokenizer);
  tcase_add_test(tc, test_eager_matches_reference);
  tcase_add_test(tc, test_compiled_generation);
  tcase_add_test(tc, test_step_body_guard_path);
  tcase_add_test(tc, test_train_step);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}
