/* pool.h - the CPU thread pool that eager kernels and compiled loops split
 * their outer loops across. One process-wide pool of persistent workers;
 * nested calls and calls made while the pool is busy run inline, so callers
 * never need to know whether they are already inside a parallel region. */
#ifndef KILN_EAGER_POOL_H
#define KILN_EAGER_POOL_H

#include <stdbool.h>
#include <stdint.h>

/* One chunk of work: process items [begin, end) using ctx. */
typedef void (*pool_fn)(void *ctx, int64_t begin, int64_t end);

/* Run fn over [0, n) split into at most pool_num_threads() contiguous chunks
 * of at least grain items each (the split depends only on n, grain and the
 * thread count); the calling thread runs chunk 0. Runs fn(ctx, 0, n) inline
 * when n <= grain, with one thread, from inside a pool task, or when another
 * thread holds the pool. Returns when every chunk is done; n <= 0 does nothing. */
void pool_parallel_for(int64_t n, int64_t grain, pool_fn fn, void *ctx);

/* Whether the workers a full-width job would use (pool_num_threads() - 1)
 * are all started and none asleep (they spin for a while after a job):
 * handing them a chunk now costs no wakeup. A hint, read without locks. */
bool pool_workers_awake(void);

/* The thread count parallel_for splits into (>= 1). Default: KILN_NUM_THREADS
 * if it is a positive integer, else the number of online CPUs. */
int pool_num_threads(void);

/* Set the thread count for the pool and for OpenBLAS; n < 1 restores the
 * default. Takes effect from the next parallel_for. */
void pool_set_num_threads(int n);

/* Join the workers and free the pool; later calls run inline. Registered with
 * atexit on first use; safe to call more than once. */
void pool_shutdown(void);

#endif
