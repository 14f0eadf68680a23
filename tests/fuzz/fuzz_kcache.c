/* Fuzzing the kernel cache's files (src/codegen/kcache.c), the data kiln
 * reads from KILN_CACHE_DIR: an object filed under a key, then the bytes
 * change the index file, the object file, or both (bytes overwritten, cut
 * short, grown), and the cache is asked again from disk. It must not crash
 * or leak, and a hit must give back exactly the object that was filed: any
 * change to either file is a miss. Layout of an input: the object's length
 * (one byte) and bytes, then edits of four bytes each: which file and what
 * (one byte), where (two), the new byte (one). */
#define _GNU_SOURCE
#include <dirent.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fuzz/fuzz.h"

/* kcache.c's interface (codegen.h would bring LLVM's headers) */
bool kcache_get(const char *key, size_t keylen, const uint64_t *held, int n_held, void **obj, size_t *len, uint64_t *id,
                bool *from_disk);
void kcache_put(const char *const *keys, const size_t *keylens, int n, const void *obj, size_t len);
void kcache_forget(void);
void alloc_free(void *p);

static char dir[64];
static const char KEY[] = "LLVM 19; x86_64; fuzz\nfunction(instcombine)\ndefine void @k(ptr %0) {\n  ret void\n}\n|0";

static void clear_dir(void);

static void remove_dir(void) {
  clear_dir();
  rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  snprintf(dir, sizeof dir, "/tmp/kiln-fuzz-kcache-%ld", (long)getpid());
  mkdir(dir, 0700);
  setenv("KILN_CACHE_DIR", dir, 1);
  atexit(remove_dir);
  return 0;
}

static void clear_dir(void) {
  DIR *d = opendir(dir);
  if (!d) return;
  for (struct dirent *de; (de = readdir(d));) {
    if (de->d_name[0] == '.') continue;
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
    unlink(path);
  }
  closedir(d);
}

/* The n-th file of the directory whose name ends in suffix, into path. */
static bool file_of(const char *suffix, char *path, size_t n) {
  DIR *d = opendir(dir);
  bool found = false;
  for (struct dirent *de; d && !found && (de = readdir(d));) {
    size_t l = strlen(de->d_name), s = strlen(suffix);
    if (l > s && !strcmp(de->d_name + l - s, suffix)) {
      snprintf(path, n, "%s/%s", dir, de->d_name);
      found = true;
    }
  }
  if (d) closedir(d);
  return found;
}

static void edit(const char *path, int what, long at, uint8_t byte) {
  FILE *f = fopen(path, "r+b");
  if (!f) return;
  fseek(f, 0, SEEK_END);
  long size = ftell(f);
  if (what == 0 && size > 0) { /* overwrite one byte */
    fseek(f, at % size, SEEK_SET);
    fputc(byte, f);
  } else if (what == 1) { /* grow by one byte */
    fputc(byte, f);
  }
  fclose(f);
  if (what == 2 && size > 0 && truncate(path, at % size)) return; /* cut short */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_in in = {data, size, 0};
  uint8_t obj[256];
  size_t n = 1 + fuzz_byte(&in) % 255;
  for (size_t i = 0; i < n; i++) obj[i] = (uint8_t)fuzz_byte(&in);
  clear_dir();
  kcache_forget();
  const char *keys[] = {KEY};
  size_t keylens[] = {sizeof KEY - 1};
  kcache_put(keys, keylens, 1, obj, n);
  bool changed = false;
  while (fuzz_left(&in)) {
    int op = fuzz_byte(&in);
    long at = (long)fuzz_byte(&in) << 8;
    at |= fuzz_byte(&in);
    uint8_t byte = (uint8_t)fuzz_byte(&in);
    char path[512];
    if (!file_of(op & 1 ? ".o" : ".k", path, sizeof path)) continue;
    edit(path, (op >> 1) % 3, at, byte);
    changed = true; /* an overwrite with the same byte changes nothing: compared below */
  }
  kcache_forget(); /* from disk, as a later process */
  void *got = NULL;
  size_t len = 0;
  uint64_t id = 0;
  bool disk = false;
  if (kcache_get(KEY, sizeof KEY - 1, NULL, 0, &got, &len, &id, &disk)) {
    FUZZ_CHECK(disk, "a hit after forgetting did not come from disk");
    FUZZ_CHECK(len == n && !memcmp(got, obj, n), "a hit gave %zu bytes, not the %zu filed (files changed: %d)", len, n,
               changed);
    alloc_free(got);
  }
  return 0;
}
