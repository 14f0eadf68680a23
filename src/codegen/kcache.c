/* kcache.c - compiled kernels by key, so a kernel is optimized and compiled
 * once: per process in memory (later variants, other compiled functions),
 * and across processes in the directory KILN_CACHE_DIR names.
 *
 * The key is the whole text the code depends on (runtime.c: LLVM's version,
 * the host CPU and its features, the pass pipeline, the kernel's IR before
 * optimization), compared in full on every hit: a hash only names things.
 * A kernel's code is in the object of the group it was compiled with, as a
 * weak_odr function named by the key's hash: the object is stored once and
 * each kernel's key points at it, and when two objects loaded into one JIT
 * both have a kernel, the linker keeps one (equal keys, equal code). On
 * disk an index file per key holds the key and the object's hash; a file
 * that is short, foreign, for another key or whose object does not hash to
 * the name is a miss and is replaced. Files appear by rename, so a reader
 * never sees half of one. The cache is an optimization: every error
 * (a full disk, a directory that cannot be made) is a miss, never a failure.
 * The directory is kept under KILN_CACHE_SIZE (default 1G): the files used
 * least recently go first (a hit touches its files), and temporary files a
 * killed process left behind go after an hour.
 *
 * The files hold machine code that kiln runs: a directory kiln makes is
 * private (0700), and no directory it uses may be writable by anyone you
 * would not let run code. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "codegen/codegen.h"

enum { MEM_CAP = 64 << 20, FILE_CAP = 256 << 20 };
static const char KEY_MAGIC[8] = "KILNKEY1", OBJ_MAGIC[8] = "KILNOBJ1";

/* An object file several kernels' code is in, shared by their entries. */
typedef struct blob {
  struct blob *next;
  uint64_t id;
  void *obj;
  size_t len;
  int refs;
} blob;

typedef struct entry {
  struct entry *next, *newer; /* hash chain; the next entry filed, for eviction */
  char *key;
  size_t keylen;
  uint64_t h;
  blob *b;
} entry;

static struct {
  pthread_mutex_t mu;
  entry *slot[1024];
  entry *oldest, *newest;
  blob *blobs;
  size_t bytes;
} mem = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* 64-bit hash of p under seed (a multiply-rotate over 8-byte words). */
static uint64_t hash_bytes(const void *p, size_t n, uint64_t seed) {
  const char *key = p;
  uint64_t h = seed ^ (n * 0x9e3779b97f4a7c15ull);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    memcpy(&w, key + i, 8);
    h = (h ^ (w * 0xff51afd7ed558ccdull)) * 0xc4ceb9fe1a85ec53ull;
    h = (h << 29) | (h >> 35);
  }
  uint64_t w = 0;
  memcpy(&w, key + i, n - i);
  h ^= w * 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 33;
  return h;
}

void kcache_symbol(const char *key, size_t keylen, char out[40]) {
  snprintf(out, 40, "kiln_%016llx%016llx", (unsigned long long)hash_bytes(key, keylen, 1),
           (unsigned long long)hash_bytes(key, keylen, 2));
}

static uint64_t blob_id(const void *obj, size_t len) { return hash_bytes(obj, len, 3); }

static entry **chain(uint64_t h) { return &mem.slot[h % (sizeof mem.slot / sizeof mem.slot[0])]; }

static void *copy_of(const void *p, size_t n) {
  void *c = alloc_malloc(n);
  if (c) memcpy(c, p, n);
  return c;
}

/* With mem.mu held: the blob of id, made from obj when new (NULL: out of memory). */
static blob *blob_ref(uint64_t id, const void *obj, size_t len) {
  for (blob *b = mem.blobs; b; b = b->next)
    if (b->id == id && b->len == len) return b->refs++, b;
  blob *b = alloc_calloc(1, sizeof *b);
  if (!b || !(b->obj = copy_of(obj, len))) {
    alloc_free(b);
    return NULL;
  }
  b->id = id, b->len = len, b->refs = 1;
  b->next = mem.blobs;
  mem.blobs = b;
  mem.bytes += len;
  return b;
}

static void blob_unref(blob *b) {
  if (--b->refs) return;
  for (blob **pp = &mem.blobs; *pp; pp = &(*pp)->next)
    if (*pp == b) {
      *pp = b->next;
      break;
    }
  mem.bytes -= b->len;
  alloc_free(b->obj);
  alloc_free(b);
}

/* With mem.mu held: the oldest entries go until the memory holds at most cap bytes. */
static void evict(size_t cap) {
  while (mem.bytes > cap && mem.oldest) {
    entry *e = mem.oldest;
    for (entry **pp = chain(e->h); *pp; pp = &(*pp)->next)
      if (*pp == e) {
        *pp = e->next;
        break;
      }
    mem.oldest = e->newer;
    if (!mem.oldest) mem.newest = NULL;
    mem.bytes -= e->keylen;
    blob_unref(e->b);
    alloc_free(e->key);
    alloc_free(e);
  }
}

static entry *find(const char *key, size_t keylen, uint64_t h) {
  for (entry *x = *chain(h); x; x = x->next)
    if (x->h == h && x->keylen == keylen && !memcmp(x->key, key, keylen)) return x;
  return NULL;
}

static void mem_put(const char *key, size_t keylen, uint64_t id, const void *obj, size_t len) {
  uint64_t h = hash_bytes(key, keylen, 0);
  char *kc = copy_of(key, keylen);
  entry *e = alloc_calloc(1, sizeof *e);
  pthread_mutex_lock(&mem.mu);
  if (!kc || !e || find(key, keylen, h) || !(e->b = blob_ref(id, obj, len))) {
    /* out of memory, or another thread compiled it too */
    pthread_mutex_unlock(&mem.mu);
    alloc_free(kc);
    alloc_free(e);
    return;
  }
  e->key = kc, e->keylen = keylen, e->h = h;
  e->next = *chain(h);
  *chain(h) = e;
  if (mem.newest) mem.newest->newer = e;
  else mem.oldest = e;
  mem.newest = e;
  mem.bytes += keylen;
  evict(MEM_CAP);
  pthread_mutex_unlock(&mem.mu);
}

static bool is_held(uint64_t id, const uint64_t *held, int n_held) {
  for (int i = 0; i < n_held; i++)
    if (held[i] == id) return true;
  return false;
}

/* A hit copies the object only when the caller does not hold it already:
 * a group's object is filed under each of its kernels' keys. */
static bool mem_get(const char *key, size_t keylen, const uint64_t *held, int n_held, void **obj, size_t *len,
                    uint64_t *id) {
  pthread_mutex_lock(&mem.mu);
  entry *x = find(key, keylen, hash_bytes(key, keylen, 0));
  bool hit = false;
  if (x && is_held(x->b->id, held, n_held)) {
    *obj = NULL, *len = 0, *id = x->b->id, hit = true;
  } else if (x && (*obj = copy_of(x->b->obj, x->b->len)) != NULL) {
    *len = x->b->len, *id = x->b->id, hit = true;
  }
  pthread_mutex_unlock(&mem.mu);
  return hit;
}

/* ---- disk: KILN_CACHE_DIR/kiln_<hash of key>.k names the object file
 * (KILN_CACHE_DIR/obj_<hash of object>.o) a kernel's code is in ---- */

static const char *cache_dir(void) {
  const char *d = getenv("KILN_CACHE_DIR");
  return d && *d ? d : NULL;
}

static bool read_all(int fd, void *p, size_t n) {
  for (size_t got = 0; got < n;) {
    ssize_t r = read(fd, (char *)p + got, n - got);
    if (r <= 0) {
      if (r < 0 && errno == EINTR) continue;
      return false;
    }
    got += (size_t)r;
  }
  return true;
}

static bool write_all(int fd, const void *p, size_t n) {
  for (size_t put = 0; put < n;) {
    ssize_t w = write(fd, (const char *)p + put, n - put);
    if (w <= 0) {
      if (w < 0 && errno == EINTR) continue;
      return false;
    }
    put += (size_t)w;
  }
  return true;
}

/* A whole regular file of at least min bytes (alloc_malloc'ed), or NULL. */
static char *slurp(const char *path, size_t min, size_t *n) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return NULL;
  struct stat st;
  char *buf = NULL;
  bool ok = !fstat(fd, &st) && S_ISREG(st.st_mode) && st.st_size >= (off_t)min && st.st_size <= FILE_CAP &&
            (buf = alloc_malloc((size_t)st.st_size)) && read_all(fd, buf, (size_t)st.st_size);
  close(fd);
  if (!ok) {
    alloc_free(buf);
    return NULL;
  }
  *n = (size_t)st.st_size;
  return buf;
}

/* Writes the parts to path through a temporary file and a rename, so that
 * no reader sees half of it. */
static void publish(const char *path, const void *const *part, const size_t *size, int n) {
  static atomic_uint serial;
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.tmp.%ld.%u", path, (long)getpid(), atomic_fetch_add(&serial, 1));
  int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return;
  bool ok = true;
  for (int i = 0; i < n && ok; i++) ok = write_all(fd, part[i], size[i]);
  ok &= close(fd) == 0;
  if (!ok || rename(tmp, path)) unlink(tmp);
}

/* ---- the directory's size ---- */

enum { STALE_TMP_S = 3600 };
#define DEFAULT_SIZE (1ull << 30)

/* KILN_CACHE_SIZE: bytes, or a number with K, M or G (1024s); 0 is no
 * limit. Anything else keeps the default, with a warning once. */
uint64_t kcache_size_limit(void) {
  static _Atomic int warned;
  const char *s = getenv("KILN_CACHE_SIZE");
  if (!s || !*s) return DEFAULT_SIZE;
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  bool digits = end != s;
  int shift = *end == 'K' || *end == 'k' ? 10 : *end == 'M' || *end == 'm' ? 20 : *end == 'G' || *end == 'g' ? 30 : 0;
  if (shift) end++;
  if (errno || !digits || *end || s[0] == '-' || v > (~0ull >> shift)) {
    if (!atomic_exchange(&warned, 1))
      fprintf(stderr, "kiln: warning: KILN_CACHE_SIZE=%s is not a size (say 512M or 2G); the cache keeps to 1G\n", s);
    return DEFAULT_SIZE;
  }
  return v << shift;
}

/* The cache's own names: kiln_<hash>.k, obj_<hash>.o and their temporaries. */
static bool ours(const char *name, bool *tmp) {
  *tmp = strstr(name, ".tmp.") != NULL;
  size_t l = strlen(name);
  return (!strncmp(name, "kiln_", 5) || !strncmp(name, "obj_", 4)) &&
         (*tmp || (l > 2 && (!strcmp(name + l - 2, ".k") || !strcmp(name + l - 2, ".o"))));
}

typedef struct dfile {
  char name[64];
  uint64_t bytes;
  struct timespec used;
} dfile;

static int older(const void *a, const void *b) {
  const struct timespec *x = &((const dfile *)a)->used, *y = &((const dfile *)b)->used;
  return x->tv_sec != y->tv_sec ? (x->tv_sec > y->tv_sec) - (x->tv_sec < y->tv_sec)
                                : (x->tv_nsec > y->tv_nsec) - (x->tv_nsec < y->tv_nsec);
}

/* Removes temporaries older than an hour, then, when the cache's files
 * come to more than limit bytes, the least recently used until they come
 * to three quarters of it. Another process may trim at the same time: a
 * file already gone is simply gone. */
static void trim(const char *dir, uint64_t limit) {
  DIR *d = opendir(dir);
  if (!d) return;
  dfile *f = NULL;
  size_t n = 0, cap = 0;
  uint64_t total = 0;
  time_t now = time(NULL);
  for (struct dirent *de; (de = readdir(d));) {
    bool tmp;
    struct stat st;
    size_t len = strlen(de->d_name);
    if (len >= sizeof f->name || !ours(de->d_name, &tmp) ||
        fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) || !S_ISREG(st.st_mode))
      continue;
    if (tmp) { /* a write in progress, or one a killed process left */
      if (now - st.st_mtim.tv_sec > STALE_TMP_S) unlinkat(dirfd(d), de->d_name, 0);
      continue;
    }
    if (n == cap) {
      dfile *g = realloc(f, (cap = cap ? 2 * cap : 256) * sizeof *f);
      if (!g) break;
      f = g;
    }
    memcpy(f[n].name, de->d_name, len + 1); /* fits: checked above */
    f[n].bytes = (uint64_t)st.st_size;
    f[n].used = st.st_mtim;
    total += f[n++].bytes;
  }
  if (limit && total > limit) {
    qsort(f, n, sizeof *f, older);
    for (size_t i = 0; i < n && total > limit / 4 * 3; i++) {
      unlinkat(dirfd(d), f[i].name, 0);
      total -= f[i].bytes;
    }
  }
  free(f);
  closedir(d);
}

/* A hit marks its file used (its time is what trim keeps by). */
static void touch(const char *path) { utimensat(AT_FDCWD, path, NULL, 0); }

static bool disk_get(const char *dir, const char *key, size_t keylen, const uint64_t *held, int n_held, void **obj,
                     size_t *len, uint64_t *id) {
  char path[4096], sym[40];
  kcache_symbol(key, keylen, sym);
  if ((size_t)snprintf(path, sizeof path, "%s/%s.k", dir, sym) >= sizeof path) return false;
  size_t n = 0;
  char *idx = slurp(path, 24, &n);
  uint64_t kl = 0;
  if (idx) memcpy(&kl, idx + 8, 8);
  bool ok = idx && !memcmp(idx, KEY_MAGIC, 8) && kl == keylen && n == 24 + keylen && !memcmp(idx + 16, key, keylen);
  if (ok) memcpy(id, idx + 16 + keylen, 8);
  alloc_free(idx);
  if (ok) touch(path);
  if (ok && is_held(*id, held, n_held)) { /* its object is read already: not again */
    *obj = NULL, *len = 0;
    return true;
  }
  if (!ok || (size_t)snprintf(path, sizeof path, "%s/obj_%016llx.o", dir, (unsigned long long)*id) >= sizeof path)
    return false;
  char *o = slurp(path, 17, &n);
  uint64_t ol = 0;
  if (o) memcpy(&ol, o + 8, 8);
  /* the object must be the one the index names, whole */
  ok = o && !memcmp(o, OBJ_MAGIC, 8) && ol == n - 16 && blob_id(o + 16, ol) == *id;
  if (!ok) {
    alloc_free(o);
    return false;
  }
  touch(path);
  memmove(o, o + 16, ol);
  *obj = o;
  *len = ol;
  return true;
}

static void disk_put(const char *dir, const char *const *keys, const size_t *keylens, int n, uint64_t id,
                     const void *obj, size_t len) {
  char path[4096];
  if (mkdir(dir, 0700) && errno != EEXIST) return;
  if ((size_t)snprintf(path, sizeof path, "%s/obj_%016llx.o", dir, (unsigned long long)id) >= sizeof path) return;
  uint64_t ol = len;
  publish(path, (const void *[]){OBJ_MAGIC, &ol, obj}, (size_t[]){8, 8, len}, 3);
  for (int i = 0; i < n; i++) {
    char sym[40];
    kcache_symbol(keys[i], keylens[i], sym);
    if ((size_t)snprintf(path, sizeof path, "%s/%s.k", dir, sym) >= sizeof path) return;
    uint64_t kl = keylens[i];
    publish(path, (const void *[]){KEY_MAGIC, &kl, keys[i], &id}, (size_t[]){8, 8, keylens[i], 8}, 4);
    len += 24 + keylens[i];
  }
  /* the size is checked at a process's first write, then after every
   * eighth of the limit written */
  static _Atomic uint64_t written;
  static atomic_bool checked;
  uint64_t limit = kcache_size_limit();
  if (!atomic_exchange(&checked, true) || (limit && atomic_fetch_add(&written, len + 16) + len + 16 >= limit / 8)) {
    atomic_store(&written, 0);
    trim(dir, limit);
  }
}

void kcache_trim(void) {
  const char *dir = cache_dir();
  if (dir) trim(dir, kcache_size_limit());
}

void kcache_forget(void) {
  pthread_mutex_lock(&mem.mu);
  evict(0);
  pthread_mutex_unlock(&mem.mu);
}

void kiln_cache_clear(void) { kcache_forget(); }

bool kcache_get(const char *key, size_t keylen, const uint64_t *held, int n_held, void **obj, size_t *len, uint64_t *id,
                bool *from_disk) {
  *from_disk = false;
  if (mem_get(key, keylen, held, n_held, obj, len, id)) return true;
  const char *dir = cache_dir();
  if (!dir || !disk_get(dir, key, keylen, held, n_held, obj, len, id)) return false;
  *from_disk = true;
  /* a held object is in memory already, under another key (or in the caller's hands) */
  if (*obj) mem_put(key, keylen, *id, *obj, *len);
  return true;
}

void kcache_put(const char *const *keys, const size_t *keylens, int n, const void *obj, size_t len) {
  uint64_t id = blob_id(obj, len);
  for (int i = 0; i < n; i++) mem_put(keys[i], keylens[i], id, obj, len);
  const char *dir = cache_dir();
  if (dir && n) disk_put(dir, keys, keylens, n, id, obj, len);
}
