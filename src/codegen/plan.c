/* The memory plan: every intermediate (TEMP buffer) gets an offset in one
 * arena, first fit by liveness over the kernel order, largest first. Sizes
 * come from the symbolic shapes evaluated for the call, so the plan is made
 * per call (it is a few comparisons per buffer pair; runtime.c keeps the
 * last one for calls of the same sizes) while the arena itself
 * is kept between calls and only grows. */
#include <string.h>

#include "codegen/codegen.h"

#define ALIGN 64

size_t plan_arena(const cg_program *p, const size_t *bytes, size_t *offset) {
  int n = p->n_buf;
  int order[n > 0 ? n : 1], placed[n > 0 ? n : 1], n_placed = 0, k = 0;
  for (int i = 0; i < n; i++)
    if (p->buf[i].kind == CG_BUF_TEMP) order[k++] = i;
  /* largest first: small buffers fill the gaps big ones leave */
  for (int i = 1; i < k; i++)
    for (int j = i; j > 0 && bytes[order[j]] > bytes[order[j - 1]]; j--) {
      int t = order[j];
      order[j] = order[j - 1];
      order[j - 1] = t;
    }
  size_t total = 0;
  for (int i = 0; i < k; i++) {
    const cg_buf *b = &p->buf[order[i]];
    size_t size = (bytes[order[i]] + ALIGN - 1) / ALIGN * ALIGN, at = 0;
    /* the lowest offset clear of every placed buffer alive at the same time */
    for (bool moved = true; moved;) {
      moved = false;
      for (int j = 0; j < n_placed; j++) {
        const cg_buf *c = &p->buf[placed[j]];
        size_t cs = (bytes[placed[j]] + ALIGN - 1) / ALIGN * ALIGN, co = offset[placed[j]];
        bool live = b->first <= c->last && c->first <= b->last;
        if (live && at < co + cs && co < at + size) {
          at = co + cs;
          moved = true;
        }
      }
    }
    offset[order[i]] = at;
    placed[n_placed++] = order[i];
    if (at + size > total) total = at + size;
  }
  return total;
}
