/* prepare.c - weights a compiled variant prepares once and keeps across
 * calls: a forward conv that runs as Winograd keeps its weight's transform
 * U = G w G^T (conv_prepare_weight), so that a call of an inference graph
 * skips the transform while the weight is unchanged.
 *
 * Sound: an entry is keyed on the weight tensor it was made from (its
 * storage's serial, which no other storage has, and version, which every
 * in-place write bumps, its offset, shape and strides), so a weight written
 * in place (an optimizer, kiln_copy_, kiln_load_tensors_into, a compiled
 * update) or another tensor bound in its place is transformed again. A
 * weight the graph itself writes (a training step) is no candidate.
 *
 * Bounded: kiln's rule is that compiled code takes no more memory than
 * eager. U is 16/9 of the weight, so the entries are admitted in kernel
 * order while they fit the room the runtime gives (runtime.c: the bytes of
 * the graph's intermediates, which eager allocates one tensor each, less
 * the compiled arena's); the others transform at each call, as eager does. */
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "codegen/codegen.h"

/* A kernel whose weight can be prepared: a forward conv2d in f32 (its
 * kernel decides at each call whether it runs as Winograd) whose weight is
 * an argument read whole, that the graph neither updates in place nor writes. */
static int candidate_weight(const cg_program *p, const cg_kernel *k) {
  const ir_graph *g = p->g;
  if (k->kind != CG_K_EAGER || k->scratch_buf < 0) return -1;
  const ir_node *n = &g->nodes[k->node];
  if (n->op != OP_CONV2D || n->dtype != KILN_F32 || n->n_in < 2) return -1;
  int wb = p->views[n->in[1]].buf;
  if (wb < 0 || p->buf[wb].kind != CG_BUF_INPUT || p->buf[wb].updated || p->buf[wb].node != n->in[1]) return -1;
  for (int i = 0; i < g->n_writes; i++)
    if (p->node_buf[g->writes[i].target] == wb) return -1;
  return wb;
}

int prep_init(cg_prep *c, const cg_program *p) {
  memset(c, 0, sizeof *c);
  /* KILN_PREPARE=0: none, to measure against; =all: every candidate, past the memory bound */
  const char *env = getenv("KILN_PREPARE");
  if (env && !strcmp(env, "0")) return 0;
  c->unbounded = env && !strcmp(env, "all");
  int n = 0;
  for (int k = 0; k < p->n_k; k++) n += candidate_weight(p, &p->k[k]) >= 0;
  if (n > CG_PREP_MAX) n = CG_PREP_MAX;
  if (!n) return 0;
  c->e = alloc_calloc((size_t)n, sizeof *c->e);
  c->of_kernel = alloc_calloc((size_t)p->n_k, sizeof *c->of_kernel);
  if (!c->e || !c->of_kernel) {
    prep_free(c);
    return -1;
  }
  for (int k = 0; k < p->n_k; k++) {
    int wb = candidate_weight(p, &p->k[k]);
    c->of_kernel[k] = wb >= 0 && c->n < n ? c->n : -1;
    if (c->of_kernel[k] >= 0) c->e[c->n++] = (cg_prep_entry){.kernel = k, .wbuf = wb};
  }
  return 0;
}

static void drop(cg_prep_entry *en) {
  if (en->data) {
    alloc_aligned_free(en->data, en->bytes);
    alloc_track(-(int64_t)en->bytes);
  }
  en->data = NULL, en->bytes = 0, en->valid = false;
}

void prep_free(cg_prep *c) {
  for (int i = 0; i < c->n; i++) drop(&c->e[i]);
  alloc_free(c->e), alloc_free(c->of_kernel);
  memset(c, 0, sizeof *c);
}

bool prep_decided(const cg_prep *c, const size_t *want, const int64_t *vals, int nvals) {
  if (c->nvals != nvals || (nvals && memcmp(c->vals, vals, sizeof *vals * (size_t)nvals))) return false;
  for (int i = 0; i < c->n; i++)
    if (c->e[i].decided != want[i]) return false;
  return true;
}

void prep_admit(cg_prep *c, const size_t *want, const int64_t *vals, int nvals, size_t room) {
  size_t used = 0;
  c->nvals = nvals;
  if (nvals) memcpy(c->vals, vals, sizeof *vals * (size_t)nvals);
  if (c->unbounded) room = SIZE_MAX;
  for (int i = 0; i < c->n; i++) {
    cg_prep_entry *en = &c->e[i];
    en->decided = want[i];
    en->admitted = want[i] > 0 && used + want[i] <= room;
    if (!en->admitted || en->bytes != want[i]) drop(en);
    if (!en->admitted) continue;
    if (!en->data) {
      if (!(en->data = alloc_aligned(want[i]))) {
        en->admitted = false;
        continue;
      }
      en->bytes = want[i];
      alloc_track((int64_t)en->bytes); /* tensor memory, as the arena: peaks compare with eager's */
    }
    used += want[i];
  }
}

size_t prep_bytes(const cg_prep *c) {
  size_t s = 0;
  for (int i = 0; i < c->n; i++) s += c->e[i].bytes;
  return s;
}

/* Whether en was made from w's values as they are now. */
bool prep_fresh(const cg_prep_entry *en, const kiln_tensor *w) {
  if (!en->valid || en->serial != w->st->serial || en->version != atomic_load(&w->st->version) ||
      en->offset != w->offset || en->ndim != w->ndim)
    return false;
  for (int d = 0; d < w->ndim; d++)
    if (en->shape[d] != w->shape[d] || en->stride[d] != w->stride[d]) return false;
  return true;
}

static _Atomic long made_count;

long prep_made_count(void) { return atomic_load(&made_count); }

void prep_made(cg_prep_entry *en, const kiln_tensor *w) {
  atomic_fetch_add(&made_count, 1);
  en->valid = true;
  en->serial = w->st->serial;
  en->version = atomic_load(&w->st->version);
  en->offset = w->offset;
  en->ndim = w->ndim;
  for (int d = 0; d < w->ndim; d++) en->shape[d] = w->shape[d], en->stride[d] = w->stride[d];
}
