/* The one allocator. Every allocation in kiln passes through here, so the
 * test build can fail the n-th one and prove that out-of-memory paths return
 * errors instead of crashing or leaking. */
#include <pthread.h>
#include <stdlib.h>

#include "eager/eager.h"

static atomic_llong fail_countdown; /* 0: never fail */
static atomic_llong mem_in_use, mem_peak;

int64_t alloc_fail_after(int64_t n) { return atomic_exchange(&fail_countdown, n); }

static bool should_fail(void) {
#ifdef KILN_TEST_BUILD
  long long c = atomic_load(&fail_countdown);
  while (c > 0) {
    if (atomic_compare_exchange_weak(&fail_countdown, &c, c - 1)) return c == 1;
  }
#endif
  return false;
}

void *alloc_malloc(size_t n) {
  if (should_fail()) return NULL;
  return malloc(n ? n : 1);
}

void *alloc_calloc(size_t n, size_t size) {
  if (should_fail()) return NULL;
  return calloc(n ? n : 1, size ? size : 1);
}

void *alloc_realloc(void *p, size_t n) {
  if (should_fail()) return NULL;
  return realloc(p, n ? n : 1);
}

/* Tensor storage: 64-byte aligned, freed with alloc_aligned_free. Large
 * blocks are cached on free and handed out again: glibc returns them to the
 * kernel, and touching fresh pages (a fault per 4 KiB) cost more than the op
 * itself on a 16 MiB tensor. */
#define CACHE_MIN (1u << 20)
#define CACHE_SLOTS 64
#define CACHE_CAP ((size_t)256 << 20)
static struct {
  void *p;
  size_t n;
} cache[CACHE_SLOTS];
static size_t cache_bytes;
static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;

void *alloc_aligned(size_t n) {
  if (should_fail()) return NULL;
  if (n >= CACHE_MIN) {
    n = (n + 65535) & ~(size_t)65535;
    void *hit = NULL;
    pthread_mutex_lock(&cache_lock);
    for (int i = 0; i < CACHE_SLOTS && !hit; i++)
      if (cache[i].p && cache[i].n == n) {
        hit = cache[i].p;
        cache[i].p = NULL;
        cache_bytes -= n;
      }
    pthread_mutex_unlock(&cache_lock);
    if (hit) return hit;
  }
  return aligned_alloc(64, n);
}

void alloc_aligned_free(void *p, size_t n) {
  if (!p) return;
  if (n >= CACHE_MIN) {
    n = (n + 65535) & ~(size_t)65535;
    pthread_mutex_lock(&cache_lock);
    for (int i = 0; i < CACHE_SLOTS && p; i++)
      if (!cache[i].p && cache_bytes + n <= CACHE_CAP) {
        cache[i].p = p;
        cache[i].n = n;
        cache_bytes += n;
        p = NULL;
      }
    pthread_mutex_unlock(&cache_lock);
  }
  free(p);
}

void alloc_free(void *p) { free(p); }

#ifdef KILN_TEST_BUILD
#define QUARANTINE 4096
static void *quarantine[QUARANTINE]; /* a ring: the oldest is freed for real */
static int quarantine_next;
static pthread_mutex_t quarantine_lock = PTHREAD_MUTEX_INITIALIZER;
#endif

void alloc_quarantine(void *p) {
#ifdef KILN_TEST_BUILD
  pthread_mutex_lock(&quarantine_lock);
  void *old = quarantine[quarantine_next];
  quarantine[quarantine_next] = p;
  quarantine_next = (quarantine_next + 1) % QUARANTINE;
  pthread_mutex_unlock(&quarantine_lock);
  p = old;
#endif
  free(p);
}

void alloc_track(int64_t delta) {
  long long now = atomic_fetch_add(&mem_in_use, delta) + delta;
  long long peak = atomic_load(&mem_peak);
  while (now > peak && !atomic_compare_exchange_weak(&mem_peak, &peak, now)) {
  }
}

size_t kiln_mem_in_use(void) { return (size_t)atomic_load(&mem_in_use); }
size_t kiln_mem_peak(void) { return (size_t)atomic_load(&mem_peak); }
void kiln_mem_reset_peak(void) { atomic_store(&mem_peak, atomic_load(&mem_in_use)); }

int alloc_grow(void **p, int *cap, int need, size_t size) {
  if (need <= *cap) return 0;
  int c = *cap ? *cap : 64;
  while (c < need) c *= 2;
  void *np = alloc_realloc(*p, size * (size_t)c);
  if (!np) return -1;
  *p = np;
  *cap = c;
  return 0;
}
