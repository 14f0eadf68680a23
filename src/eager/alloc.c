/* The one allocator. Every allocation in kiln passes through here, so the
 * test build can fail the n-th one and prove that out-of-memory paths return
 * errors instead of crashing or leaking. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

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

/* Tensor storage: 64-byte aligned, freed with alloc_aligned_free. Blocks
 * of 64 KiB and up are cached on free (256 MiB in all) and handed out again
 * to a request of the same rounded size: glibc returns such blocks to the
 * kernel (munmap, or a trimmed heap top), and touching fresh pages (a fault
 * per 4 KiB) cost more than the op itself. With the cache for 1 MiB and up
 * only, an eager LSTM training step (T = 64, 32 x 512 gates) freed and
 * faulted in about 100 MB a step and took 78-93 ms or 23-31 ms by glibc's
 * moving thresholds; it now takes the second. */
#define CACHE_MIN (1u << 16)
#define CACHE_SLOTS 1024
#define CACHE_CAP ((size_t)256 << 20)

static struct {
  void *p;
  size_t n;
} cache[CACHE_SLOTS];
static size_t cache_bytes;
static int cache_top; /* slots at and past it are empty */
static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;

/* A cached size: pages below 1 MiB, 64 KiB above, so that tensors of one shape meet. */
static size_t cache_size(size_t n) {
  size_t g = n < (1u << 20) ? 4095 : 65535;
  return (n + g) & ~g;
}

void *alloc_aligned(size_t n) {
  if (should_fail()) return NULL;
  if (n >= CACHE_MIN) {
    n = cache_size(n);
    void *hit = NULL;
    pthread_mutex_lock(&cache_lock);
    for (int i = 0; i < cache_top && !hit; i++)
      if (cache[i].p && cache[i].n == n) {
        hit = cache[i].p;
        cache[i].p = NULL;
        cache_bytes -= n;
      }
    while (cache_top > 0 && !cache[cache_top - 1].p) cache_top--;
    pthread_mutex_unlock(&cache_lock);
    if (hit) return hit;
  }
  return aligned_alloc(64, n);
}

void alloc_aligned_free(void *p, size_t n) {
  if (!p) return;
  if (n >= CACHE_MIN) {
    n = cache_size(n);
    pthread_mutex_lock(&cache_lock);
    for (int i = 0; i < CACHE_SLOTS && p && cache_bytes + n <= CACHE_CAP; i++)
      if (!cache[i].p) {
        cache[i].p = p;
        cache[i].n = n;
        cache_bytes += n;
        p = NULL;
        if (i >= cache_top) cache_top = i + 1;
      }
    pthread_mutex_unlock(&cache_lock);
  }
  free(p);
}

void alloc_free(void *p) { free(p); }

/* ---- handles ----
 *
 * A handle's memory never goes back to malloc. Its last release parks it at
 * the tail of its pool's queue, and a new handle is taken from the head only
 * while more than `keep` others are parked behind it. So a released tensor or
 * kiln_fn stays readable memory for the life of the process (a second release
 * or a use after release reads defined memory, in every build, and is
 * reported), and stays marked released until at least `keep` later releases
 * have passed. The pool's memory is the most handles ever alive at once, plus
 * `keep`. Each handle sits behind a small header holding its queue link. */
typedef struct parked {
  struct parked *next;
  size_t pad; /* keeps the handle 16-byte aligned */
} parked;

#if defined(__SANITIZE_ADDRESS__)
#define KILN_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KILN_ASAN 1
#endif
#endif
#ifdef KILN_ASAN
#include <sanitizer/asan_interface.h>
/* a parked handle is poisoned past its first `live` bytes (its released
 * mark), so that ASan reports kiln itself reading the rest */
static void poison(handle_pool *p, void *h, bool on) {
  size_t live = (p->live + 7) & ~(size_t)7;
  if (on) ASAN_POISON_MEMORY_REGION((char *)h + live, p->size - live);
  else ASAN_UNPOISON_MEMORY_REGION((char *)h + live, p->size - live);
}
#else
static void poison(handle_pool *p, void *h, bool on) { (void)p, (void)h, (void)on; }
#endif

/* Each thread takes handles from a pool's head and gives released ones to
 * its tail in batches, one lock round trip a batch instead of two a tensor
 * (a recorded op makes a tensor or two). A handle in a thread's batch is
 * parked as in the queue: marked released until handed out, and handed out
 * only after `keep` others were parked behind it. A thread's batches go back
 * to the queue when it exits. */
enum { HANDLE_BATCH = 32 };
typedef struct handle_cache {
  handle_pool *pool;
  parked *take;           /* taken from the pool's head, not handed out yet */
  int n_take;
  parked *rel, *rel_tail; /* released here, not yet at the pool's tail */
  int n_rel;
} handle_cache;
static KILN_TLS_HOT handle_cache tcache[2];
static KILN_TLS_HOT bool tcache_on;
static pthread_key_t tcache_key;
static pthread_once_t tcache_once = PTHREAD_ONCE_INIT;
static bool tcache_ok;

/* ---- small blocks ----
 *
 * Every tensor over new memory has a storage header of its own, and a
 * recorded op makes one and drops it at the call's end: each thread keeps up
 * to SMALL_KEEP freed headers for its next ones instead of a malloc and free
 * a header, oldest first. They are listed in a ring of pointers beside them,
 * not linked through them, so a block is exactly a header and ASan sees an
 * overflow past one; ASan keeps a kept block poisoned, and under ASan a block
 * is handed out again only once SMALL_KEEP others were freed after it (as
 * ASan's own quarantine would), so a use after free is reported in that
 * window. A thread's blocks and ring are freed at its exit. */
enum { SMALL_KEEP = 64 };
static KILN_TLS_HOT void **small_ring; /* SMALL_KEEP slots, made at a thread's first free */
static KILN_TLS_HOT int small_head, small_n; /* the oldest kept block's slot, and how many */
static bool thread_hooked(void);

#ifdef KILN_ASAN
static void small_poison(void *b, bool on) {
  if (on) ASAN_POISON_MEMORY_REGION(b, ALLOC_SMALL);
  else ASAN_UNPOISON_MEMORY_REGION(b, ALLOC_SMALL);
}
enum { SMALL_WAIT = SMALL_KEEP }; /* frees after a block's before it is handed out */
#else
static void small_poison(void *b, bool on) { (void)b, (void)on; }
enum { SMALL_WAIT = 1 };
#endif

/* The oldest kept block, taken out of the ring (small_n > 0). */
static void *small_take(void) {
  void *b = small_ring[small_head];
  small_head = (small_head + 1) % SMALL_KEEP;
  small_n--;
  small_poison(b, false);
  return b;
}

void *alloc_small(void) {
  if (should_fail()) return NULL;
  if (small_n < SMALL_WAIT) return malloc(ALLOC_SMALL);
  return small_take();
}

void alloc_small_free(void *p) {
  if (!p) return;
  if (!thread_hooked() || (!small_ring && !(small_ring = malloc(sizeof *small_ring * SMALL_KEEP)))) return free(p);
  if (small_n == SMALL_KEEP) {
    if (SMALL_WAIT == 1) return free(p);
    free(small_take()); /* the oldest goes, this one waits its turn */
  }
  small_ring[(small_head + small_n) % SMALL_KEEP] = p;
  small_n++;
  small_poison(p, true);
}

static void small_drain(void) {
  while (small_n) free(small_take());
  free(small_ring);
  small_ring = NULL;
  small_head = 0;
}

static void park_list(handle_pool *p, parked *head, parked *tail, int n) {
  if (!n) return;
  tail->next = NULL;
  pthread_mutex_lock(&p->lock);
  if (p->tail) p->tail->next = head;
  else p->head = head;
  p->tail = tail;
  p->n_parked += (size_t)n;
  pthread_mutex_unlock(&p->lock);
}

static void tcache_flush(void *arg) {
  (void)arg;
  for (int i = 0; i < 2; i++) {
    handle_cache *c = &tcache[i];
    if (!c->pool) continue;
    park_list(c->pool, c->rel, c->rel_tail, c->n_rel);
    parked *t = c->take;
    while (t && t->next) t = t->next;
    park_list(c->pool, c->take, t, c->n_take);
    memset(c, 0, sizeof *c);
  }
  small_drain();
  tcache_on = false;
}

static void tcache_init(void) { tcache_ok = pthread_key_create(&tcache_key, tcache_flush) == 0; }

/* Whether this thread's caches go back at its exit (tcache_flush runs then). */
static bool thread_hooked(void) {
  if (!tcache_on) {
    pthread_once(&tcache_once, tcache_init);
    /* the key's value only makes the flush run at the thread's exit */
    if (!tcache_ok || pthread_setspecific(tcache_key, tcache)) return false;
    tcache_on = true;
  }
  return true;
}

/* This thread's cache for pool p, or NULL (the pools go one at a time). */
static handle_cache *cache_of(handle_pool *p) {
  if (!thread_hooked()) return NULL;
  for (int i = 0; i < 2; i++) {
    if (tcache[i].pool == p) return &tcache[i];
    if (!tcache[i].pool) return tcache[i].pool = p, &tcache[i];
  }
  return NULL;
}

void *alloc_handle(handle_pool *p) {
  if (should_fail()) return NULL;
  handle_cache *c = cache_of(p);
  parked *h = NULL;
  if (c) {
    if (!c->n_take) {
      pthread_mutex_lock(&p->lock);
      while (p->n_parked > p->keep && c->n_take < HANDLE_BATCH) {
        parked *x = p->head;
        p->head = x->next;
        if (!p->head) p->tail = NULL;
        p->n_parked--;
        x->next = c->take;
        c->take = x;
        c->n_take++;
      }
      pthread_mutex_unlock(&p->lock);
    }
    if (c->n_take) {
      h = c->take;
      c->take = h->next;
      c->n_take--;
    }
  } else {
    pthread_mutex_lock(&p->lock);
    h = p->n_parked > p->keep ? p->head : NULL;
    if (h) {
      p->head = h->next;
      if (!p->head) p->tail = NULL;
      p->n_parked--;
    }
    pthread_mutex_unlock(&p->lock);
  }
  if (!h) {
    h = calloc(1, sizeof *h + p->size);
    return h ? h + 1 : NULL;
  }
  /* the released mark stays as it is: a late check may be reading it now */
  poison(p, h + 1, false);
  memset((char *)(h + 1) + p->live, 0, p->size - p->live);
  return h + 1;
}

void alloc_handle_park(handle_pool *p, void *handle) {
  parked *h = (parked *)handle - 1;
  poison(p, handle, true);
  h->next = NULL;
  handle_cache *c = cache_of(p);
  if (!c) return park_list(p, h, h, 1);
  if (c->rel_tail) c->rel_tail->next = h;
  else c->rel = h;
  c->rel_tail = h;
  if (++c->n_rel == HANDLE_BATCH) {
    park_list(p, c->rel, c->rel_tail, c->n_rel);
    c->rel = c->rel_tail = NULL;
    c->n_rel = 0;
  }
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

int alloc_grow_slow(void **p, int *cap, int need, size_t size) {
  if (need <= *cap) return 0;
  int c = *cap ? *cap : 64;
  while (c < need) c *= 2;
  void *np = alloc_realloc(*p, size * (size_t)c);
  if (!np) return -1;
  *p = np;
  *cap = c;
  return 0;
}
