/* The kernel cache (src/codegen/kcache.c): a kernel compiled once is linked
 * again from memory, and with KILN_CACHE_DIR from disk in a later process;
 * damaged files are misses, never wrong code; two cached objects that both
 * hold a kernel link together; a different pass pipeline is another key.
 * Each compile's results are compared with eager. */
#include <check.h>
#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "codegen/codegen.h"
#include "kiln.h"

typedef int (*body_fn)(void *, kiln_tensor *const *, kiln_tensor **);

/* The kernels: a softmax row kernel (S), a GELU pointwise kernel (G) and a
 * row sum (R) of x, two per function. */
static kiln_tensor *softmax_of(kiln_tensor *x) {
  kiln_tensor *e = kiln_exp(kiln_sub(x, kiln_max(x, -1, true)));
  return kiln_div(e, kiln_sum(e, -1, true));
}

static kiln_tensor *gelu_of(kiln_tensor *x) { return kiln_gelu(x); }
static kiln_tensor *rowsum_of(kiln_tensor *x) { return kiln_tanh(kiln_sum(kiln_mul(x, x), -1, false)); }

static int body_sg(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = softmax_of(in[0]), out[1] = gelu_of(in[0]);
  return 0;
}

static int body_gr(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = gelu_of(in[0]), out[1] = rowsum_of(in[0]);
  return 0;
}

static int body_sr(void *ctx, kiln_tensor *const *in, kiln_tensor **out) {
  (void)ctx;
  out[0] = softmax_of(in[0]), out[1] = rowsum_of(in[0]);
  return 0;
}

static double maxdiff(kiln_tensor *a, kiln_tensor *b) {
  int64_t n = kiln_numel(a);
  ck_assert_int_eq(n, kiln_numel(b));
  float *x = malloc(sizeof(float) * (size_t)n), *y = malloc(sizeof(float) * (size_t)n);
  ck_assert_int_eq(0, kiln_read(a, x, sizeof(float) * (size_t)n));
  ck_assert_int_eq(0, kiln_read(b, y, sizeof(float) * (size_t)n));
  double m = 0;
  for (int64_t i = 0; i < n; i++) {
    double e = fabs((double)x[i] - y[i]) / (1 + fabs((double)y[i]));
    if (!(e <= m)) m = isnan(e) ? INFINITY : e;
  }
  free(x), free(y);
  return m;
}

/* Traces body on x, compiles its graph on the LLVM backend with the kernels
 * dump, runs it and compares both outputs with eager. Returns the dump (to
 * free). */
static char *compile_checked(body_fn body, kiln_tensor *x) {
  kiln_scope_begin();
  kiln_options o = {.name = "cached", .n_in = 1, .n_out = 2, .backend = KILN_BACKEND_INTERP};
  kiln_fn *fn = kiln_compile(body, NULL, &o);
  kiln_tensor *got[2] = {0}, *ref[2] = {0};
  ck_assert_int_eq(0, kiln_call(fn, &x, got)); /* the trace */
  char *text = kiln_fn_graph(fn, 0), err[256];
  ck_assert_ptr_nonnull(text);
  ir_graph *g = ir_parse(text, err, sizeof err);
  free(text);
  ck_assert_msg(g != NULL, "%s", err);
  char *dump = NULL;
  size_t dn = 0;
  FILE *f = open_memstream(&dump, &dn);
  backend_exec *e = backend_llvm.compile(g, KILN_DUMP_KERNELS, f, err, sizeof err);
  fclose(f);
  ck_assert_msg(e != NULL, "%s", err);
  ck_assert_int_eq(0, backend_llvm.run(e, &x, NULL, got));
  ck_assert_int_eq(0, body(NULL, &x, ref));
  for (int i = 0; i < 2; i++) {
    ck_assert_double_le(maxdiff(got[i], ref[i]), 1e-6);
    kiln_release(got[i]);
  }
  backend_llvm.free(e);
  ir_free(g);
  kiln_fn_free(fn);
  kiln_scope_end();
  return dump;
}

/* The "kernel cache:" line of a dump: how many kernels came from the cache,
 * of how many, and how many of those from disk; -1 when there is none. */
static int cached(const char *dump, int *of, int *disk) {
  const char *l = strstr(dump, "kernel cache: ");
  if (!l) return -1;
  int n = -1;
  ck_assert_int_eq(3, sscanf(l, "kernel cache: %d of %d distinct kernels compiled before (%d from", &n, of, disk));
  return n;
}

/* fn(path, name, ctx) for every entry of dir but the dot ones; false when
 * dir cannot be opened. */
typedef void (*file_fn)(const char *path, const char *name, void *ctx);
static bool each_file(const char *dir, file_fn fn, void *ctx) {
  DIR *d = opendir(dir);
  if (!d) return false;
  for (struct dirent *de; (de = readdir(d));) {
    if (de->d_name[0] == '.') continue;
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
    fn(path, de->d_name, ctx);
  }
  closedir(d);
  return true;
}

static bool ends_with(const char *name, const char *suffix) {
  size_t l = strlen(name), s = strlen(suffix);
  return l > s && !strcmp(name + l - s, suffix);
}

typedef struct match {
  const char *suffix;
  const char *bytes; /* damage: written over the start */
  int n;             /* count_files: how many */
} match;

static void count_one(const char *path, const char *name, void *ctx) {
  (void)path;
  match *m = ctx;
  m->n += ends_with(name, m->suffix);
}

static int count_files(const char *dir, const char *suffix) {
  match m = {.suffix = suffix};
  ck_assert(each_file(dir, count_one, &m));
  return m.n;
}

static void damage_one(const char *path, const char *name, void *ctx) {
  const match *m = ctx;
  if (!ends_with(name, m->suffix)) return;
  FILE *f = fopen(path, "r+");
  ck_assert_ptr_nonnull(f);
  fwrite(m->bytes, 1, strlen(m->bytes), f);
  fclose(f);
}

/* Writes bytes over the start of every file of dir ending in suffix. */
static void damage(const char *dir, const char *suffix, const char *bytes) {
  match m = {.suffix = suffix, .bytes = bytes};
  ck_assert(each_file(dir, damage_one, &m));
}

static void remove_one(const char *path, const char *name, void *ctx) {
  (void)name, (void)ctx;
  remove(path);
}

static void remove_dir(const char *dir) {
  if (each_file(dir, remove_one, NULL)) rmdir(dir);
}

static kiln_tensor *input(uint64_t seed) { return kiln_randn(KILN_F32, 2, ((int64_t[]){6, 37}), seed); }

/* kiln_cache_clear forgets the kernels kept in memory: the next compile of
 * the same kernels runs LLVM again, and a function compiled before keeps
 * running its code. */
START_TEST(test_cache_clear) {
  unsetenv("KILN_CACHE_DIR");
  int of, disk;
  kiln_scope_begin();
  kiln_tensor *x = input(3);
  kiln_options o = {.name = "kept", .n_in = 1, .n_out = 2, .backend = KILN_BACKEND_LLVM};
  kiln_fn *fn = kiln_compile(body_sg, NULL, &o);
  kiln_tensor *got[2], *ref[2];
  ck_assert_int_eq(0, kiln_call(fn, &x, got));
  ck_assert_int_eq(0, kiln_call(fn, &x, got)); /* compiled */
  char *d = compile_checked(body_sg, x);
  ck_assert_int_eq(2, cached(d, &of, &disk));
  free(d);
  kiln_cache_clear();
  d = compile_checked(body_sg, x);
  ck_assert_msg(cached(d, &of, &disk) < 0, "a kernel cached after kiln_cache_clear:\n%s", d);
  free(d);
  d = compile_checked(body_sg, x); /* kept again */
  ck_assert_int_eq(2, cached(d, &of, &disk));
  free(d);
  kiln_cache_clear();
  ck_assert_int_eq(0, kiln_call(fn, &x, got));
  ck_assert_int_eq(0, body_sg(NULL, &x, ref));
  for (int i = 0; i < 2; i++) ck_assert_double_le(maxdiff(got[i], ref[i]), 1e-6);
  kiln_fn_stats st;
  ck_assert_int_eq(0, kiln_fn_get_stats(fn, &st));
  ck_assert_int_eq(2, st.hits);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

START_TEST(test_memory_and_disk) {
  char dir[] = "/tmp/kiln-cache-XXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  ck_assert_int_eq(0, setenv("KILN_CACHE_DIR", dir, 1));
  kiln_tensor *x = input(1);
  int of, disk;

  kcache_forget();
  char *d = compile_checked(body_sg, x);
  ck_assert_msg(cached(d, &of, &disk) < 0, "an empty cache hit:\n%s", d);
  free(d);
  ck_assert_int_eq(2, count_files(dir, ".k")); /* one index per kernel */
  ck_assert_int_eq(1, count_files(dir, ".o")); /* one object for both */

  d = compile_checked(body_sg, x); /* from this process's memory */
  ck_assert_int_eq(2, cached(d, &of, &disk));
  ck_assert_int_eq(2, of);
  ck_assert_int_eq(0, disk);
  ck_assert_msg(strstr(d, "LLVM optimize 0.00 ms") != NULL, "optimized again:\n%s", d);
  free(d);

  kcache_forget(); /* a later process: from disk */
  d = compile_checked(body_sg, x);
  ck_assert_int_eq(2, cached(d, &of, &disk));
  ck_assert_int_eq(2, disk);
  free(d);

  /* damaged objects and indexes are misses: compiled again, right, rewritten */
  const char *junk[] = {"garbage", "KILNOBJ1\xff\xff\xff\xff"};
  const char *which[] = {".o", ".k"};
  for (int i = 0; i < 2; i++) {
    damage(dir, which[i], junk[i]);
    kcache_forget();
    d = compile_checked(body_sg, x);
    ck_assert_msg(cached(d, &of, &disk) < 0, "a damaged %s file hit:\n%s", which[i], d);
    free(d);
    kcache_forget();
    d = compile_checked(body_sg, x);
    ck_assert_int_eq(2, cached(d, &of, &disk)); /* rewritten */
    ck_assert_int_eq(2, disk);
    free(d);
  }

  /* another pass pipeline is another key */
  ck_assert_int_eq(0, setenv("KILN_LLVM_PASSES", "default<O2>", 1));
  d = compile_checked(body_sg, x);
  ck_assert_msg(cached(d, &of, &disk) < 0, "O2 took the kernel passes' code:\n%s", d);
  free(d);
  unsetenv("KILN_LLVM_PASSES");

  unsetenv("KILN_CACHE_DIR");
  remove_dir(dir);
  kiln_release(x);
}
END_TEST

/* S and G go into one object on disk; G and R into another, in memory only;
 * then S (from disk) and R (from memory) link into one JIT, and both objects
 * hold G: the linker keeps one. */
START_TEST(test_objects_overlap) {
  char dir[] = "/tmp/kiln-cache-XXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  kiln_tensor *x = input(2);
  int of, disk;
  ck_assert_int_eq(0, setenv("KILN_CACHE_DIR", dir, 1));
  kcache_forget();
  free(compile_checked(body_sg, x));
  kcache_forget();
  unsetenv("KILN_CACHE_DIR");
  char *d = compile_checked(body_gr, x);
  ck_assert_msg(cached(d, &of, &disk) < 0, "%s", d);
  free(d);
  ck_assert_int_eq(0, setenv("KILN_CACHE_DIR", dir, 1));
  d = compile_checked(body_sr, x);
  ck_assert_int_eq(2, cached(d, &of, &disk));
  ck_assert_int_eq(1, disk);
  free(d);
  unsetenv("KILN_CACHE_DIR");
  remove_dir(dir);
  kiln_release(x);
}
END_TEST

/* A cache directory that cannot be made is no cache, not an error. */
START_TEST(test_unusable_dir) {
  char path[] = "/tmp/kiln-cache-file-XXXXXX";
  int fd = mkstemp(path);
  ck_assert_int_ge(fd, 0);
  close(fd);
  char dir[600];
  snprintf(dir, sizeof dir, "%s/sub", path); /* under a regular file */
  ck_assert_int_eq(0, setenv("KILN_CACHE_DIR", dir, 1));
  kiln_tensor *x = input(3);
  int of, disk;
  kcache_forget();
  char *d = compile_checked(body_gr, x);
  ck_assert_msg(cached(d, &of, &disk) < 0, "%s", d);
  free(d);
  kcache_forget();
  d = compile_checked(body_gr, x);
  ck_assert_msg(cached(d, &of, &disk) < 0, "%s", d);
  free(d);
  unsetenv("KILN_CACHE_DIR");
  remove(path);
  kiln_release(x);
}
END_TEST

/* A compile that fails (here LLVM cannot parse the pipeline) after it
 * started dumping leaves the caller's dump file to the caller: it once
 * closed it too, and the caller's fclose freed it twice. */
START_TEST(test_failed_compile_keeps_dump_file) {
  kiln_scope_begin();
  kiln_tensor *x = input(4);
  kiln_options o = {.name = "failing", .n_in = 1, .n_out = 2, .backend = KILN_BACKEND_INTERP};
  kiln_fn *fn = kiln_compile(body_sg, NULL, &o);
  kiln_tensor *got[2] = {0};
  ck_assert_int_eq(0, kiln_call(fn, &x, got));
  char *text = kiln_fn_graph(fn, 0), err[256] = "";
  ir_graph *g = ir_parse(text, err, sizeof err);
  free(text);
  ck_assert_ptr_nonnull(g);
  ck_assert_int_eq(0, setenv("KILN_LLVM_PASSES", "no-such-pass", 1));
  kcache_forget();
  char *dump = NULL;
  size_t dn = 0;
  FILE *f = open_memstream(&dump, &dn);
  ck_assert_ptr_null(backend_llvm.compile(g, KILN_DUMP_KERNELS, f, err, sizeof err));
  unsetenv("KILN_LLVM_PASSES");
  ck_assert_msg(strstr(err, "no-such-pass") != NULL, "%s", err);
  fprintf(f, "still open\n");
  fclose(f);
  ck_assert_ptr_nonnull(strstr(dump, "still open"));
  free(dump);
  ir_free(g);
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* Bytes of the files of dir whose names start with prefix. */
typedef struct sized {
  const char *prefix;
  long long bytes;
} sized;

static void size_one(const char *path, const char *name, void *ctx) {
  sized *z = ctx;
  struct stat st;
  if (!strncmp(name, z->prefix, strlen(z->prefix)) && !stat(path, &st) && S_ISREG(st.st_mode)) z->bytes += st.st_size;
}

static long long dir_bytes(const char *dir, const char *prefix) {
  sized z = {prefix, 0};
  ck_assert(each_file(dir, size_one, &z));
  return z.bytes;
}

/* Sets a file's times to *(time_t *)ctx. */
static void age_one(const char *path, const char *name, void *ctx) {
  (void)name;
  time_t t = *(const time_t *)ctx;
  struct timespec ts[2] = {{t, 0}, {t, 0}};
  ck_assert_int_eq(0, utimensat(AT_FDCWD, path, ts, 0));
}

/* Asserts a file was modified after *(time_t *)ctx. */
static void used_since(const char *path, const char *name, void *ctx) {
  struct stat st;
  ck_assert_int_eq(0, stat(path, &st));
  ck_assert_msg(st.st_mtime > *(const time_t *)ctx, "%s was read but not marked used", name);
}

/* A file of size bytes whose times are t. */
static void make_file(const char *dir, const char *name, int size, time_t t) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  ck_assert_ptr_nonnull(f);
  for (int i = 0; i < size; i++) fputc('x', f);
  fclose(f);
  age_one(path, name, &t);
}

static bool exists(const char *dir, const char *name) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  return access(path, F_OK) == 0;
}

START_TEST(test_size_setting) {
  const char *text[] = {"", "100", "64K", "512M", "2g", "0", "12X", "-5", "M", "99999999999999999999", "3G "};
  const unsigned long long want[] = {1ull << 30, 100, 64 << 10, 512ull << 20, 2ull << 30, 0,
                                     1ull << 30, 1ull << 30, 1ull << 30, 1ull << 30, 1ull << 30};
  for (int i = 0; i < (int)(sizeof want / sizeof want[0]); i++) {
    ck_assert_int_eq(0, setenv("KILN_CACHE_SIZE", text[i], 1));
    ck_assert_msg(kcache_size_limit() == want[i], "KILN_CACHE_SIZE=\"%s\": %llu bytes", text[i],
                  (unsigned long long)kcache_size_limit());
  }
  unsetenv("KILN_CACHE_SIZE");
  ck_assert_uint_eq(1ull << 30, kcache_size_limit());
}
END_TEST

/* Ten cache files of 1000 bytes used one second apart, under a limit of
 * 8000: the four used least recently go (down to 6000, three quarters).
 * A temporary older than an hour goes, a new one and files not the
 * cache's stay and do not count. */
START_TEST(test_trim_order) {
  char dir[] = "/tmp/kiln-cache-XXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  time_t t0 = time(NULL) - 1000;
  char name[64];
  for (int i = 0; i < 10; i++) {
    /* used order is not name order */
    snprintf(name, sizeof name, i % 2 ? "kiln_%02d.k" : "obj_%02d.o", 9 - i);
    make_file(dir, name, 1000, t0 + i);
  }
  make_file(dir, "obj_aa.o.tmp.123.0", 500, t0 - 7200);
  make_file(dir, "kiln_bb.k.tmp.124.0", 500, time(NULL));
  make_file(dir, "notes.txt", 50000, t0 - 7200);
  ck_assert_int_eq(0, setenv("KILN_CACHE_DIR", dir, 1));
  ck_assert_int_eq(0, setenv("KILN_CACHE_SIZE", "8000", 1));
  kcache_trim();
  for (int i = 0; i < 10; i++) {
    snprintf(name, sizeof name, i % 2 ? "kiln_%02d.k" : "obj_%02d.o", 9 - i);
    ck_assert_msg(exists(dir, name) == (i >= 4), "%s (used %d of 10) %s", name, i + 1, i >= 4 ? "went" : "stayed");
  }
  ck_assert(!exists(dir, "obj_aa.o.tmp.123.0"));
  ck_assert(exists(dir, "kiln_bb.k.tmp.124.0"));
  ck_assert(exists(dir, "notes.txt"));
  /* under the limit: nothing more goes */
  kcache_trim();
  ck_assert_int_eq(6000 + 500, dir_bytes(dir, "kiln_") + dir_bytes(dir, "obj_"));
  unsetenv("KILN_CACHE_SIZE");
  unsetenv("KILN_CACHE_DIR");
  remove_dir(dir);
}
END_TEST

/* A hit from disk marks its files used, so trim keeps them; under a
 * limit too small for anything, a compile leaves no file behind and its
 * answers are still right, and so are those of the compile after it. */
START_TEST(test_size_limit_in_use) {
  char dir[] = "/tmp/kiln-cache-XXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  ck_assert_int_eq(0, setenv("KILN_CACHE_DIR", dir, 1));
  unsetenv("KILN_CACHE_SIZE");
  kiln_tensor *x = input(5);
  int of, disk;
  kcache_forget();
  free(compile_checked(body_sg, x));
  ck_assert_int_eq(3, count_files(dir, ".k") + count_files(dir, ".o"));
  /* every file used long ago */
  time_t old = time(NULL) - 100000, later = old + 1000;
  ck_assert(each_file(dir, age_one, &old));
  kcache_forget();
  char *dump = compile_checked(body_sg, x);
  ck_assert_int_eq(2, cached(dump, &of, &disk));
  ck_assert_int_eq(2, disk);
  free(dump);
  ck_assert(each_file(dir, used_since, &later));

  ck_assert_int_eq(0, setenv("KILN_CACHE_SIZE", "1", 1));
  kcache_forget();
  free(compile_checked(body_gr, x)); /* G from disk, R new; then the trim */
  ck_assert_int_eq(0, dir_bytes(dir, "kiln_") + dir_bytes(dir, "obj_"));
  kcache_forget();
  dump = compile_checked(body_gr, x);
  ck_assert_msg(cached(dump, &of, &disk) < 0, "a hit from an emptied cache:\n%s", dump);
  free(dump);
  unsetenv("KILN_CACHE_SIZE");
  unsetenv("KILN_CACHE_DIR");
  remove_dir(dir);
  kiln_release(x);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("codegen_cache");
  TCase *tc = tcase_create("cache");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_cache_clear);
  tcase_add_test(tc, test_memory_and_disk);
  tcase_add_test(tc, test_objects_overlap);
  tcase_add_test(tc, test_unusable_dir);
  tcase_add_test(tc, test_failed_compile_keeps_dump_file);
  tcase_add_test(tc, test_size_setting);
  tcase_add_test(tc, test_trim_order);
  tcase_add_test(tc, test_size_limit_in_use);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
