/* The memory plan's placement, shared by the JIT's runtime (codegen/plan.c)
 * and the exported models' (rt.c): every intermediate gets an offset in one
 * arena, first fit by liveness over the kernel order, largest first. */
#include <stdbool.h>

#include "rt/plan.h"

#define ALIGN 64

size_t rt_plan_arena(int n, const unsigned char *temp, const int *first, const int *last, const size_t *bytes,
                     size_t *offset) {
  int order[n > 0 ? n : 1], placed[n > 0 ? n : 1], n_placed = 0, k = 0;
  for (int i = 0; i < n; i++)
    if (temp[i]) order[k++] = i;
  /* largest first: small buffers fill the gaps big ones leave */
  for (int i = 1; i < k; i++)
    for (int j = i; j > 0 && bytes[order[j]] > bytes[order[j - 1]]; j--) {
      int t = order[j];
      order[j] = order[j - 1];
      order[j - 1] = t;
    }
  size_t total = 0;
  for (int i = 0; i < k; i++) {
    int b = order[i];
    size_t size = (bytes[b] + ALIGN - 1) / ALIGN * ALIGN, at = 0;
    /* the lowest offset clear of every placed buffer alive at the same time */
    for (bool moved = true; moved;) {
      moved = false;
      for (int j = 0; j < n_placed; j++) {
        int c = placed[j];
        size_t cs = (bytes[c] + ALIGN - 1) / ALIGN * ALIGN, co = offset[c];
        bool live = first[b] <= last[c] && first[c] <= last[b];
        if (live && at < co + cs && co < at + size) {
          at = co + cs;
          moved = true;
        }
      }
    }
    offset[b] = at;
    placed[n_placed++] = b;
    if (at + size > total) total = at + size;
  }
  return total;
}
