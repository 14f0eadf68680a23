/* The memory plan: every intermediate (TEMP buffer) gets an offset in one
 * arena, first fit by liveness over the kernel order, largest first
 * (rt/arena.c, which exported models share). Sizes come from the symbolic
 * shapes evaluated for the call, so the plan is made per call (it is a few
 * comparisons per buffer pair; runtime.c keeps the last one for calls of
 * the same sizes) while the arena itself is kept between calls and only grows. */
#include "codegen/codegen.h"
#include "rt/plan.h"

size_t plan_arena(const cg_program *p, const size_t *bytes, size_t *offset) {
  int n = p->n_buf;
  unsigned char temp[n > 0 ? n : 1];
  int first[n > 0 ? n : 1], last[n > 0 ? n : 1];
  for (int i = 0; i < n; i++) {
    temp[i] = p->buf[i].kind == CG_BUF_TEMP;
    first[i] = p->buf[i].first;
    last[i] = p->buf[i].last;
  }
  return rt_plan_arena(n, temp, first, last, bytes, offset);
}
