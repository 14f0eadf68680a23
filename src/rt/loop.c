/* A loop kernel run over the thread pool, shared by the JIT's runtime
 * (codegen/runtime.c) and exported models' (rt.c). A kernel's range is
 * handed out in blocks: each thread of the pool takes the next block until
 * none is left, so a thread the OS delays (a shared machine) leaves its
 * blocks to the others instead of holding up the kernel. The exception is
 * a small dot-product kernel (a matvec whose weight the caches hold): one
 * fixed share of its rows a thread, so that each core keeps its part of
 * the weight from call to call; a worker preempted inside its share then
 * holds the kernel up. Results do not depend on who runs a block: a
 * pointwise element, and a whole row of a staged kernel, are computed in
 * one call. */
#include <stdatomic.h>

#include "eager/pool.h"
#include "rt/plan.h"

typedef struct kern_job {
  rt_kernel_fn fn;
  const int64_t *p;
  char *const *bufs;
  int64_t range, block;
  _Atomic int64_t next;
} kern_job;

static void kern_chunk(void *ctx, int64_t begin, int64_t end) {
  (void)begin, (void)end;
  kern_job *j = ctx;
  for (int64_t b; (b = atomic_fetch_add_explicit(&j->next, j->block, memory_order_relaxed)) < j->range;)
    j->fn(j->p, j->bufs, b, b + j->block < j->range ? b + j->block : j->range);
}

/* A dot-product kernel's rows in RT_JAM groups: chunk [begin, end) of them
 * (a kern_job whose block and next go unused). */
static void rows_chunk(void *ctx, int64_t begin, int64_t end) {
  const kern_job *j = ctx;
  int64_t hi = end * RT_JAM < j->range ? end * RT_JAM : j->range;
  j->fn(j->p, j->bufs, begin * RT_JAM, hi);
}

void rt_run_loop(rt_kernel_fn fn, const int64_t *p, char **acc, int n_acc, int64_t range, int64_t inner, int staged,
                 int split) {
  /* about 64K elements of work per block; a kernel of fewer than two blocks
   * runs on the calling thread, since waking a worker costs more */
  bool dot = staged == RT_STAGED_DOT || staged == RT_STAGED_DOT_COARSE;
  int64_t g = staged == RT_STAGED_DOT ? RT_DOT_GRAIN : RT_GRAIN;
  int64_t grain = staged ? (inner >= g ? 1 : g / (inner ? inner : 1)) : g;
  int threads = pool_num_threads();
  if (split) {
    /* a full reduction: its fixed blocks in parallel, then the combine */
    double scratch[RT_BLOCKS];
    acc[n_acc] = (char *)scratch;
    if (inner < 2 * 65536 || threads < 2) {
      fn(p, acc, 0, RT_BLOCKS);
    } else {
      kern_job job = {fn, p, acc, RT_BLOCKS, 1, 0};
      pool_parallel_for(threads, 1, kern_chunk, &job);
    }
    fn(p, acc, -1, 0);
    acc[n_acc] = NULL;
  } else if (range < 2 * grain || threads < 2) {
    fn(p, acc, 0, range);
  } else if (dot && inner <= RT_DOT_STATIC / range) {
    /* a matvec whose weight a core's cache holds: one contiguous share of
     * the rows a thread, the same share every call (pool_parallel_for's
     * split depends on the sizes alone), so each core keeps its part of
     * the weight in its own cache from call to call; blocks taken in turn
     * would move rows between the cores' caches */
    kern_job job = {fn, p, acc, range, 0, 0};
    pool_parallel_for((range + RT_JAM - 1) / RT_JAM, grain >= RT_JAM ? grain / RT_JAM : 1, rows_chunk, &job);
  } else {
    /* about 8 blocks per thread, for the balance */
    int64_t block = range / (8 * (int64_t)threads);
    if (block < grain) block = grain;
    if (staged) block = (block + RT_JAM - 1) / RT_JAM * RT_JAM; /* grouped outer elements, lower.c */
    kern_job job = {fn, p, acc, range, block, 0};
    pool_parallel_for(threads, 1, kern_chunk, &job);
  }
}
