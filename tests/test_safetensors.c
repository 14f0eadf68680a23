/* Weights in safetensors files (src/eager/safetensors.c), held to an
 * implementation of the format that is not kiln's: tests/gen_safetensors.py
 * (numpy, json and struct) writes files that kiln must load with the values
 * it wrote, and reads the files kiln writes, which must hold the values kiln
 * was given. Then kiln to kiln for every dtype, 0-d, empty and strided
 * tensors; loading into model params; and hostile files, each an error that
 * names the caller's line, the file and what is wrong.
 *
 * Run: /usr/bin/python3 tests/gen_safetensors.py write DIR && KILN_REFS_DIR=DIR
 * KILN_PYTHON=/usr/bin/python3 KILN_GEN_SAFETENSORS=tests/gen_safetensors.py test_safetensors
 * (ctest sets all three); SHOW_ERRORS=1 prints the message of every hostile file. */
#include <check.h>
#include <dirent.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "eager/half.h"
#include "kiln.h"

#define NELEM(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* ---- the expectation format of gen_safetensors.py ---- */

typedef struct exp_tensor {
  char name[256];
  char dtype[16];
  int ndim;
  int64_t shape[16];
  int64_t n;          /* elements */
  bool has_values;
  bool ramp;          /* value i is a + b*(i mod m) */
  double a, b;
  int64_t m;
  char **v;           /* the value tokens, n of them */
} exp_tensor;

typedef struct exp_file {
  char name[64];
  int n, n_meta;
  char meta[8][2][128];
  exp_tensor *t;
} exp_file;

/* 'x' + hex of the bytes -> the string. */
static void unhex(const char *tok, char *out, size_t cap) {
  ck_assert_msg(tok[0] == 'x', "bad name token %s", tok);
  size_t n = 0;
  for (const char *p = tok + 1; p[0] && p[1] && n + 1 < cap; p += 2) {
    unsigned v;
    ck_assert(sscanf(p, "%2x", &v) == 1);
    out[n++] = (char)v;
  }
  out[n] = 0;
}

static char *token(FILE *f) {
  char buf[512];
  if (fscanf(f, "%511s", buf) != 1) return NULL;
  return strdup(buf);
}

static int64_t token_i(FILE *f) {
  char *t = token(f);
  ck_assert_ptr_nonnull(t);
  int64_t v = strtoll(t, NULL, 10);
  free(t);
  return v;
}

/* Reads the next "file" block; false at the end. */
static bool exp_read(FILE *f, exp_file *e) {
  memset(e, 0, sizeof *e);
  char *kw = token(f);
  if (!kw) return false;
  ck_assert_str_eq(kw, "file");
  free(kw);
  char *name = token(f);
  snprintf(e->name, sizeof e->name, "%s", name);
  free(name);
  e->n = (int)token_i(f);
  e->n_meta = (int)token_i(f);
  ck_assert_int_le(e->n_meta, 8);
  for (int i = 0; i < e->n_meta; i++) {
    char *m = token(f), *k = token(f), *v = token(f);
    ck_assert_str_eq(m, "meta");
    unhex(k, e->meta[i][0], sizeof e->meta[i][0]);
    unhex(v, e->meta[i][1], sizeof e->meta[i][1]);
    free(m), free(k), free(v);
  }
  e->t = calloc((size_t)e->n + 1, sizeof *e->t);
  for (int i = 0; i < e->n; i++) {
    exp_tensor *t = &e->t[i];
    char *kw2 = token(f), *nm = token(f), *dt = token(f);
    ck_assert_str_eq(kw2, "t");
    unhex(nm, t->name, sizeof t->name);
    snprintf(t->dtype, sizeof t->dtype, "%s", dt);
    free(kw2), free(nm), free(dt);
    t->ndim = (int)token_i(f);
    t->n = 1;
    for (int d = 0; d < t->ndim; d++) t->n *= t->shape[d] = token_i(f);
    char *first = token(f);
    if (!strcmp(first, "-")) {
      free(first);
      continue;
    }
    t->has_values = true;
    if (!strcmp(first, "ramp")) {
      free(first);
      char *a = token(f), *b = token(f);
      t->ramp = true, t->a = strtod(a, NULL), t->b = strtod(b, NULL), t->m = token_i(f);
      free(a), free(b);
      continue;
    }
    if (t->n == 0) { /* no values: the token read belongs to the next line */
      ungetc(' ', f);
      for (size_t k = strlen(first); k > 0; k--) ungetc(first[k - 1], f);
      free(first);
      continue;
    }
    t->v = calloc((size_t)t->n, sizeof *t->v);
    t->v[0] = first;
    for (int64_t k = 1; k < t->n; k++) t->v[k] = token(f);
  }
  return true;
}

static void exp_free(exp_file *e) {
  for (int i = 0; i < e->n; i++) {
    for (int64_t k = 0; e->t[i].v && k < e->t[i].n; k++) free(e->t[i].v[k]);
    free(e->t[i].v);
  }
  free(e->t);
}

static bool kiln_dtype_of(const char *s, kiln_dtype *dt) {
  static const struct { const char *s; kiln_dtype dt; } map[] = {
      {"F32", KILN_F32}, {"F64", KILN_F64}, {"I64", KILN_I64}, {"BOOL", KILN_BOOL},
      {"F16", KILN_F16}, {"BF16", KILN_BF16}, {"I32", KILN_I32}};
  for (int i = 0; i < NELEM(map); i++)
    if (!strcmp(map[i].s, s)) return *dt = map[i].dt, true;
  return false;
}

/* Value k of the expectation as a double or (for I64) an integer. */
static double exp_f(const exp_tensor *e, int64_t k) {
  return e->ramp ? e->a + e->b * (double)(k % e->m) : strtod(e->v[k], NULL);
}

/* t holds exactly what e says: dtype, shape, every value bit for bit (NaN as NaN). */
static void check_values(const kiln_tensor *t, const exp_tensor *e, const char *where) {
  kiln_dtype dt;
  ck_assert_msg(kiln_dtype_of(e->dtype, &dt), "%s: %s", where, e->dtype);
  ck_assert_msg(kiln_type(t) == dt, "%s: tensor %s: dtype %s, expected %s", where, e->name, kiln_dtype_name(kiln_type(t)),
                e->dtype);
  ck_assert_int_eq(e->ndim, kiln_ndim(t));
  for (int d = 0; d < e->ndim; d++) ck_assert_int_eq(e->shape[d], kiln_size(t, d));
  size_t es = kiln_dtype_size(dt);
  char *buf = malloc((size_t)e->n * es + 1);
  ck_assert_int_eq(0, kiln_read(t, buf, (size_t)e->n * es));
  for (int64_t k = 0; k < e->n; k++) {
    bool ok;
    char got[64], want[64];
    if (dt == KILN_F32) {
      float w = (float)exp_f(e, k), g = ((float *)buf)[k];
      ok = isnan(w) ? isnan(g) : !memcmp(&w, &g, 4);
      snprintf(got, sizeof got, "%a", (double)g), snprintf(want, sizeof want, "%a", (double)w);
    } else if (dt == KILN_F64) {
      double w = exp_f(e, k), g = ((double *)buf)[k];
      ok = isnan(w) ? isnan(g) : !memcmp(&w, &g, 8);
      snprintf(got, sizeof got, "%a", g), snprintf(want, sizeof want, "%a", w);
    } else if (dt == KILN_I64) {
      int64_t w = strtoll(e->v[k], NULL, 10), g = ((int64_t *)buf)[k];
      ok = w == g;
      snprintf(got, sizeof got, "%" PRId64, g), snprintf(want, sizeof want, "%" PRId64, w);
    } else if (dt == KILN_F16 || dt == KILN_BF16) {
      /* every f16 and bf16 is a double: the file's value exactly */
      uint16_t b = ((uint16_t *)buf)[k];
      double w = exp_f(e, k), g = dt == KILN_F16 ? half_to_float(b) : bf16_to_float(b);
      ok = isnan(w) ? isnan(g) : w == g;
      snprintf(got, sizeof got, "%a", g), snprintf(want, sizeof want, "%a", w);
    } else if (dt == KILN_I32) {
      int64_t w = strtoll(e->v[k], NULL, 10), g = ((int32_t *)buf)[k];
      ok = w == g;
      snprintf(got, sizeof got, "%" PRId64, g), snprintf(want, sizeof want, "%" PRId64, w);
    } else {
      unsigned char w = (unsigned char)atoi(e->v[k]), g = ((unsigned char *)buf)[k];
      ok = w == g;
      snprintf(got, sizeof got, "%u", g), snprintf(want, sizeof want, "%u", w);
    }
    ck_assert_msg(ok, "%s: tensor \"%s\" element %" PRId64 ": %s, expected %s", where, e->name, k, got, want);
  }
  free(buf);
}

static const char *refs_dir(void) {
  const char *d = getenv("KILN_REFS_DIR");
  ck_assert_msg(d && *d, "set KILN_REFS_DIR to a folder written by 'tests/gen_safetensors.py write DIR'");
  return d;
}

static FILE *open_expect(void) {
  char path[4096];
  snprintf(path, sizeof path, "%s/safetensors/expect.txt", refs_dir());
  FILE *f = fopen(path, "r");
  ck_assert_msg(f != NULL, "cannot open %s", path);
  return f;
}

static void ref_path(char *out, size_t n, const char *name) { snprintf(out, n, "%s/safetensors/%s", refs_dir(), name); }

/* The last error names the caller's line of this file, the function and each fragment. */
static void expect_error_at(int line, const char *fn, const char *frag1, const char *frag2) {
  const char *e = kiln_last_error();
  char loc[64];
  snprintf(loc, sizeof loc, "test_safetensors.c:%d: %s: ", line, fn);
  ck_assert_msg(strstr(e, loc) != NULL, "error \"%s\" does not start with %s", e, loc);
  if (frag1) ck_assert_msg(strstr(e, frag1) != NULL, "error \"%s\" does not say \"%s\"", e, frag1);
  if (frag2) ck_assert_msg(strstr(e, frag2) != NULL, "error \"%s\" does not say \"%s\"", e, frag2);
}

/* ---- files from the independent writer ---- */

START_TEST(test_python_files_load) {
  FILE *ef = open_expect();
  exp_file e;
  int files = 0, checked = 0;
  while (exp_read(ef, &e)) {
    char path[4096];
    ref_path(path, sizeof path, e.name);
    kiln_scope_begin();
    kiln_tensor_file *f = kiln_tensors_open(path);
    ck_assert_msg(f != NULL, "%s: %s", e.name, kiln_last_error());
    ck_assert_int_eq(e.n, kiln_tensors_count(f));
    for (int i = 0; i < e.n_meta; i++) {
      const char *v = kiln_tensors_metadata(f, e.meta[i][0]);
      ck_assert_msg(v && !strcmp(v, e.meta[i][1]), "%s: metadata %s", e.name, e.meta[i][0]);
    }
    ck_assert_ptr_null(kiln_tensors_metadata(f, "no such key"));
    /* entries come in the order of their data */
    int64_t last = -1;
    for (int i = 0; i < e.n; i++) {
      kiln_tensor_info info;
      ck_assert_int_eq(0, kiln_tensors_info(f, i, &info));
      ck_assert_int_ge(info.offset, last);
      last = info.offset;
      ck_assert_int_eq(i, kiln_tensors_find(f, info.name));
    }
    const char *loadable[64];
    exp_tensor *want[64];
    int nl = 0;
    for (int i = 0; i < e.n; i++) {
      exp_tensor *t = &e.t[i];
      int k = kiln_tensors_find(f, t->name);
      ck_assert_msg(k >= 0, "%s: tensor \"%s\" not found", e.name, t->name);
      kiln_tensor_info info;
      ck_assert_int_eq(0, kiln_tensors_info(f, k, &info));
      ck_assert_str_eq(t->name, info.name);
      ck_assert_str_eq(t->dtype, info.dtype);
      ck_assert_int_eq(t->ndim, info.ndim);
      for (int d = 0; d < t->ndim; d++) ck_assert_int_eq(t->shape[d], info.shape[d]);
      kiln_dtype dt;
      bool kiln_has = kiln_dtype_of(t->dtype, &dt) && t->ndim <= KILN_MAX_DIMS;
      ck_assert_int_eq(kiln_has, info.loadable);
      kiln_clear_error();
      int get_line = __LINE__ + 1;
      kiln_tensor *x = kiln_tensors_get(f, t->name);
      if (kiln_has) {
        ck_assert_msg(x != NULL, "%s: %s", e.name, kiln_last_error());
        ck_assert_int_eq(dt, info.type);
        ck_assert_int_eq((int64_t)kiln_dtype_size(dt) * t->n, info.nbytes);
        check_values(x, t, e.name);
        checked++;
        if (nl < 64) loadable[nl] = t->name, want[nl++] = t;
      } else {
        ck_assert_ptr_null(x);
        if (t->ndim > KILN_MAX_DIMS) expect_error_at(get_line, "kiln_tensors_get", "has 9 dims", "at most 8");
        else expect_error_at(get_line, "kiln_tensors_get", "a dtype kiln does not have (it loads F32, F64, I64, BOOL, F16, BF16 and I32)",
                             t->dtype);
      }
    }
    kiln_tensors_close(f);
    /* the same, all at once */
    kiln_tensor *out[64];
    ck_assert_msg(kiln_load_tensors(path, nl, loadable, out) == 0, "%s", kiln_last_error());
    for (int i = 0; i < nl; i++) check_values(out[i], want[i], e.name);
    kiln_scope_end();
    exp_free(&e);
    files++;
  }
  fclose(ef);
  ck_assert_int_eq(7, files);
  ck_assert_int_eq(31, checked); /* 28, and the f16, bf16 and i32 of others.safetensors */
}
END_TEST

/* A file with entries kiln cannot load lists them all and loads the rest;
 * kiln_load_tensors of a name among them fails whole, naming the entry. */
START_TEST(test_other_dtypes) {
  char path[4096];
  ref_path(path, sizeof path, "others.safetensors");
  const char *names[] = {"ok", "u"};
  kiln_tensor *out[2] = {(kiln_tensor *)1, (kiln_tensor *)1};
  ck_assert_int_eq(-1, kiln_load_tensors(path, 2, names, out));
  expect_error_at(__LINE__ - 1, "kiln_load_tensors", "tensor \"u\" is U8, a dtype kiln does not have", path);
  ck_assert_ptr_null(out[0]);
  ck_assert_ptr_null(out[1]);
  kiln_tensor_file *f = kiln_tensors_open(path);
  ck_assert_ptr_nonnull(f);
  const char *want[] = {"h", "bf", "i", "u", "ok", "rank9"}, *dt[] = {"F16", "BF16", "I32", "U8", "F32", "F32"};
  ck_assert_int_eq(6, kiln_tensors_count(f));
  for (int i = 0; i < 6; i++) { /* written in this order: the data's order is the header's */
    kiln_tensor_info info;
    ck_assert_int_eq(0, kiln_tensors_info(f, i, &info));
    ck_assert_str_eq(want[i], info.name);
    ck_assert_str_eq(dt[i], info.dtype);
  }
  /* the raw bytes of an entry kiln cannot load are the user's to read */
  kiln_tensor_info info;
  ck_assert_int_eq(0, kiln_tensors_info(f, kiln_tensors_find(f, "u"), &info));
  ck_assert_int_eq(4, info.nbytes);
  FILE *raw = fopen(path, "rb");
  unsigned char b[4];
  ck_assert(fseek(raw, (long)info.offset, SEEK_SET) == 0 && fread(b, 1, 4, raw) == 4);
  fclose(raw);
  ck_assert(b[0] == 0 && b[1] == 1 && b[2] == 254 && b[3] == 255);
  kiln_tensors_close(f);
}
END_TEST

/* ---- kiln writes, the independent reader reads ---- */

static char tmp_dir[64];

static void tmp_path(char *out, size_t n, const char *name) { snprintf(out, n, "%s/%s", tmp_dir, name); }

static void make_tmp_dir(void) {
  snprintf(tmp_dir, sizeof tmp_dir, "st_tmp_%d", (int)getpid());
  mkdir(tmp_dir, 0700);
}

/* Files in the temporary folder whose name contains ".tmp.": left-over halves of a save. */
static int stray_temporaries(void) {
  DIR *d = opendir(tmp_dir);
  int n = 0;
  for (struct dirent *de; d && (de = readdir(d));) n += strstr(de->d_name, ".tmp.") != NULL;
  if (d) closedir(d);
  return n;
}

static void remove_tmp_dir(void) {
  DIR *d = opendir(tmp_dir);
  for (struct dirent *de; d && (de = readdir(d));) {
    if (de->d_name[0] == '.') continue;
    char p[512];
    snprintf(p, sizeof p, "%s/%s", tmp_dir, de->d_name);
    unlink(p);
  }
  if (d) closedir(d);
  rmdir(tmp_dir);
}

/* Tensors made from data written here (the expected values), for the writer
 * tests: every dtype, 0-d, empty, and views that are not contiguous. */
typedef struct sample {
  const char *name;
  kiln_tensor *t;
  const char *dtype;
  int ndim;
  int64_t shape[4];
  const char *values[32]; /* the row-major values of the view, as the reader prints them */
} sample;

static const float F32S[6] = {1.5f, -0.0f, INFINITY, 3.0f, -2.25f, 0x1p-149f};
static const double F64S[3] = {1.0 / 3, -INFINITY, 0x1p-1074};
static const int64_t I64S[4] = {INT64_MIN, -1, 0, INT64_MAX};
static const bool BOOLS[3] = {true, false, true};

/* The samples; their tensors belong to the open scope. */
static int make_samples(sample *s) {
  kiln_tensor *m = kiln_tensor_from(KILN_F32, 2, ((int64_t[]){2, 3}), F32S);
  kiln_tensor *big = kiln_tensor_from(KILN_I64, 2, ((int64_t[]){2, 2}), I64S);
  int n = 0;
  s[n++] = (sample){"f32", m, "F32", 2, {2, 3}, {"0x1.8p+0", "-0x0.0p+0", "inf", "0x1.8p+1", "-0x1.2p+1", "0x0.000002p-126"}};
  s[n++] = (sample){"f64", kiln_tensor_from(KILN_F64, 1, ((int64_t[]){3}), F64S), "F64", 1, {3},
                    {"0x1.5555555555555p-2", "-inf", "0x0.0000000000001p-1022"}};
  s[n++] = (sample){"i64", big, "I64", 2, {2, 2}, {"-9223372036854775808", "-1", "0", "9223372036854775807"}};
  s[n++] = (sample){"bool", kiln_tensor_from(KILN_BOOL, 1, ((int64_t[]){3}), BOOLS), "BOOL", 1, {3}, {"1", "0", "1"}};
  s[n++] = (sample){"scalar", kiln_scalar(KILN_F64, -7.5), "F64", 0, {0}, {"-0x1.ep+2"}};
  s[n++] = (sample){"empty", kiln_zeros(KILN_F32, 3, ((int64_t[]){2, 0, 3})), "F32", 3, {2, 0, 3}, {NULL}};
  s[n++] = (sample){"empty_bool", kiln_zeros(KILN_BOOL, 1, ((int64_t[]){0})), "BOOL", 1, {0}, {NULL}};
  /* m^T: (3,2), strides (1,3) */
  s[n++] = (sample){"f32.T", kiln_transpose(m, 0, 1), "F32", 2, {3, 2},
                    {"0x1.8p+0", "0x1.8p+1", "-0x0.0p+0", "-0x1.2p+1", "inf", "0x0.000002p-126"}};
  /* every other column of m: (2,2) */
  s[n++] = (sample){"f32.cols", kiln_slice(m, 1, 0, 3, 2), "F32", 2, {2, 2}, {"0x1.8p+0", "inf", "0x1.8p+1", "0x0.000002p-126"}};
  /* the I64 transposed, and a bool view of a comparison's result */
  s[n++] = (sample){"i64.T", kiln_transpose(big, 0, 1), "I64", 2, {2, 2}, {"-9223372036854775808", "0", "-1", "9223372036854775807"}};
  s[n++] = (sample){"model.layers.0.\xe5\x90\x8d \"q\"", kiln_gt(kiln_transpose(m, 0, 1), kiln_scalar(KILN_F32, 0)), "BOOL", 2, {3, 2},
                    {"1", "1", "0", "0", "1", "1"}};
  for (int i = 0; i < n; i++) ck_assert_msg(s[i].t != NULL, "%s: %s", s[i].name, kiln_last_error());
  return n;
}

/* The value tokens the reader prints for a float, as numpy's float.hex would. */
static bool same_float_token(const char *got, const char *want) {
  double g = strtod(got, NULL), w = strtod(want, NULL);
  return isnan(w) ? isnan(g) : !memcmp(&g, &w, sizeof g);
}

START_TEST(test_kiln_files_read_by_python) {
  const char *py = getenv("KILN_PYTHON"), *script = getenv("KILN_GEN_SAFETENSORS");
  ck_assert_msg(py && script, "set KILN_PYTHON and KILN_GEN_SAFETENSORS");
  make_tmp_dir();
  kiln_scope_begin();
  sample s[16];
  int n = make_samples(s);
  const char *names[16];
  kiln_tensor *ts[16];
  for (int i = 0; i < n; i++) names[i] = s[i].name, ts[i] = s[i].t;
  char path[256], cmd[8192];
  tmp_path(path, sizeof path, "kiln.safetensors");
  const char *meta[] = {"format", "pt", "by", "kiln \xe2\x9c\x93", NULL};
  ck_assert_msg(kiln_save_tensors_meta(path, n, names, ts, meta) == 0, "%s", kiln_last_error());
  snprintf(cmd, sizeof cmd, "%s %s read %s", py, script, path);
  FILE *p = popen(cmd, "r");
  ck_assert_ptr_nonnull(p);
  exp_file e;
  ck_assert_msg(exp_read(p, &e), "the reader printed nothing: the file broke a rule (see its message above)");
  ck_assert_int_eq(0, pclose(p));
  ck_assert_int_eq(n, e.n);
  ck_assert_int_eq(2, e.n_meta);
  ck_assert_str_eq("pt", strcmp(e.meta[0][0], "format") ? e.meta[1][1] : e.meta[0][1]);
  ck_assert_str_eq("kiln \xe2\x9c\x93", strcmp(e.meta[0][0], "by") ? e.meta[1][1] : e.meta[0][1]);
  for (int i = 0; i < n; i++) {
    const exp_tensor *t = NULL;
    for (int k = 0; k < e.n; k++)
      if (!strcmp(e.t[k].name, s[i].name)) t = &e.t[k];
    ck_assert_msg(t != NULL, "the reader did not find \"%s\"", s[i].name);
    ck_assert_str_eq(s[i].dtype, t->dtype);
    ck_assert_int_eq(s[i].ndim, t->ndim);
    for (int d = 0; d < t->ndim; d++) ck_assert_int_eq(s[i].shape[d], t->shape[d]);
    for (int64_t k = 0; k < t->n; k++) {
      bool fl = !strcmp(t->dtype, "F32") || !strcmp(t->dtype, "F64");
      ck_assert_msg(fl ? same_float_token(t->v[k], s[i].values[k]) : !strcmp(t->v[k], s[i].values[k]),
                    "\"%s\" element %" PRId64 ": the reader got %s, kiln was given %s", s[i].name, k, t->v[k],
                    s[i].values[k]);
    }
  }
  exp_free(&e);
  kiln_scope_end();
  remove_tmp_dir();
}
END_TEST

/* The bytes kiln writes, checked here without a JSON parser: the header of a
 * one-tensor file is exactly what the reference writer would write. */
START_TEST(test_kiln_header_bytes) {
  make_tmp_dir();
  kiln_scope_begin();
  char path[256];
  tmp_path(path, sizeof path, "one.safetensors");
  float v[6] = {0, 1, 2, 3, 4, 5};
  kiln_tensor *t = kiln_tensor_from(KILN_F32, 3, ((int64_t[]){1, 2, 3}), v);
  const char *name = "attn.0";
  ck_assert_int_eq(0, kiln_save_tensors(path, 1, &name, &t));
  unsigned char buf[256];
  FILE *f = fopen(path, "rb");
  size_t got = fread(buf, 1, sizeof buf, f);
  fclose(f);
  const char *json = "{\"attn.0\":{\"dtype\":\"F32\",\"shape\":[1,2,3],\"data_offsets\":[0,24]}}";
  size_t jl = strlen(json), padded = (jl + 7) / 8 * 8;
  ck_assert_uint_eq(8 + padded + 24, got);
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = n << 8 | buf[i];
  ck_assert_uint_eq(padded, n);
  ck_assert(!memcmp(buf + 8, json, jl));
  for (size_t i = jl; i < padded; i++) ck_assert_int_eq(' ', buf[8 + i]);
  ck_assert(!memcmp(buf + 8 + padded, v, 24)); /* this host is little-endian, as the format */
  kiln_scope_end();
  remove_tmp_dir();
}
END_TEST

/* ---- kiln to kiln ---- */

START_TEST(test_round_trip) {
  make_tmp_dir();
  kiln_scope_begin();
  sample s[16];
  int n = make_samples(s);
  const char *names[16];
  kiln_tensor *ts[16], *back[16];
  for (int i = 0; i < n; i++) names[i] = s[i].name, ts[i] = s[i].t;
  char path[256];
  tmp_path(path, sizeof path, "rt.safetensors");
  ck_assert_int_eq(0, kiln_save_tensors(path, n, names, ts));
  /* loaded in reverse order, by name */
  const char *rev[16];
  for (int i = 0; i < n; i++) rev[i] = names[n - 1 - i];
  ck_assert_msg(kiln_load_tensors(path, n, rev, back) == 0, "%s", kiln_last_error());
  for (int i = 0; i < n; i++) {
    const sample *x = &s[n - 1 - i];
    exp_tensor e = {.ndim = x->ndim, .n = 1};
    snprintf(e.name, sizeof e.name, "%s", x->name);
    snprintf(e.dtype, sizeof e.dtype, "%s", x->dtype);
    for (int d = 0; d < x->ndim; d++) e.n *= e.shape[d] = x->shape[d];
    e.v = (char **)x->values;
    check_values(back[i], &e, "round trip");
    ck_assert(kiln_is_contiguous(back[i]));
  }
  /* a file with no tensors at all */
  ck_assert_int_eq(0, kiln_save_tensors(path, 0, NULL, NULL));
  kiln_tensor_file *f = kiln_tensors_open(path);
  ck_assert_ptr_nonnull(f);
  ck_assert_int_eq(0, kiln_tensors_count(f));
  kiln_tensors_close(f);
  ck_assert_int_eq(0, stray_temporaries());
  kiln_scope_end();
  remove_tmp_dir();
}
END_TEST

/* Returned tensors belong to the innermost scope, else to the caller. */
START_TEST(test_ownership) {
  make_tmp_dir();
  char path[256];
  tmp_path(path, sizeof path, "own.safetensors");
  size_t base = kiln_mem_in_use();
  kiln_tensor *a = kiln_ones(KILN_F64, 1, ((int64_t[]){100}));
  const char *name = "a";
  ck_assert_int_eq(0, kiln_save_tensors(path, 1, &name, &a));
  kiln_release(a);
  ck_assert_uint_eq(base, kiln_mem_in_use());
  kiln_scope_begin();
  kiln_tensor *x = NULL;
  ck_assert_int_eq(0, kiln_load_tensors(path, 1, &name, &x));
  kiln_tensor_file *f = kiln_tensors_open(path);
  kiln_tensor *y = kiln_tensors_get(f, "a");
  kiln_tensors_close(f);
  ck_assert(x && y);
  ck_assert_uint_eq(base + 1600, kiln_mem_in_use());
  kiln_scope_end(); /* frees both */
  ck_assert_uint_eq(base, kiln_mem_in_use());
  ck_assert_int_eq(0, kiln_load_tensors(path, 1, &name, &x)); /* no scope: the caller's */
  double v[100];
  ck_assert_int_eq(0, kiln_read(x, v, sizeof v));
  for (int i = 0; i < 100; i++) ck_assert_double_eq(1.0, v[i]);
  kiln_release(x);
  ck_assert_uint_eq(base, kiln_mem_in_use());
  remove_tmp_dir();
}
END_TEST

/* ---- loading into model params ---- */

START_TEST(test_load_into) {
  char path[4096];
  ref_path(path, sizeof path, "model.safetensors");
  FILE *ef = open_expect();
  exp_file e;
  bool found = false;
  while (!found && exp_read(ef, &e))
    if (!(found = !strcmp(e.name, "model.safetensors"))) exp_free(&e);
  fclose(ef);
  ck_assert(found);
  kiln_scope_begin();
  /* params as a model holds them: fc2.weight stored transposed (a view), all requiring grad */
  kiln_tensor *w1 = kiln_zeros(KILN_F32, 2, ((int64_t[]){8, 4})), *b1 = kiln_zeros(KILN_F32, 1, ((int64_t[]){8}));
  kiln_tensor *w2t = kiln_zeros(KILN_F32, 2, ((int64_t[]){8, 3})), *b2 = kiln_zeros(KILN_F32, 1, ((int64_t[]){3}));
  kiln_tensor *w2 = kiln_transpose(w2t, 0, 1);
  kiln_tensor *params[] = {w1, b1, w2, b2};
  const char *names[] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
  for (int i = 0; i < 4; i++) kiln_requires_grad(params[i], true);
  /* a graph that saved w1 before the load */
  kiln_tensor *loss = kiln_sum_all(kiln_mul(w1, w1));
  ck_assert_msg(kiln_load_tensors_into(path, 4, names, params) == 0, "%s", kiln_last_error());
  for (int i = 0; i < 4; i++)
    for (int k = 0; k < e.n; k++)
      if (!strcmp(e.t[k].name, names[i])) check_values(params[i], &e.t[k], "load_into");
  /* the backward through the old values of w1 is refused */
  ck_assert_int_eq(-1, kiln_backward(loss));
  ck_assert_msg(strstr(kiln_last_error(), "was modified in place"), "%s", kiln_last_error());

  /* a wrong shape, a wrong dtype, a missing name: nothing is written */
  kiln_tensor *zeros = kiln_zeros(KILN_F32, 1, ((int64_t[]){8}));
  kiln_tensor *wrong_shape[] = {kiln_zeros(KILN_F32, 2, ((int64_t[]){4, 8})), zeros};
  const char *two[] = {"fc1.bias", "fc1.weight"};
  kiln_tensor *first_ok[] = {zeros, wrong_shape[0]};
  ck_assert_int_eq(-1, kiln_load_tensors_into(path, 2, two, first_ok));
  expect_error_at(__LINE__ - 1, "kiln_load_tensors_into", "tensor \"fc1.weight\" is F32[8,4] in the file, but dst[1] is f32[4,8]", path);
  ck_assert_double_eq(0, kiln_item(kiln_sum_all(kiln_abs(zeros)))); /* fc1.bias was not written */
  kiln_tensor *f64[] = {kiln_zeros(KILN_F64, 1, ((int64_t[]){8}))};
  ck_assert_int_eq(-1, kiln_load_tensors_into(path, 1, two, f64));
  expect_error_at(__LINE__ - 1, "kiln_load_tensors_into", "is F32[8] in the file, but dst[0] is f64[8]", NULL);
  const char *missing[] = {"fc3.weight"};
  ck_assert_int_eq(-1, kiln_load_tensors_into(path, 1, missing, f64));
  expect_error_at(__LINE__ - 1, "kiln_load_tensors_into", "tensor \"fc3.weight\" is not in the file, which holds ",
                  "\"fc1.weight\"");
  kiln_tensor *expanded[] = {kiln_expand(kiln_zeros(KILN_F32, 1, ((int64_t[]){1})), 1, ((int64_t[]){8}))};
  ck_assert_int_eq(-1, kiln_load_tensors_into(path, 1, two, expanded));
  expect_error_at(__LINE__ - 1, "kiln_load_tensors_into", "repeated elements", NULL);
  kiln_scope_end();
  exp_free(&e);
}
END_TEST

typedef struct trace_ctx {
  const char *path;
  kiln_tensor *w;
} trace_ctx;

static int loads_in_body(void *vctx, kiln_tensor *const *in, kiln_tensor **out) {
  trace_ctx *c = vctx;
  const char *name = "fc1.bias";
  if (kiln_load_tensors_into(c->path, 1, &name, &c->w)) return -1;
  out[0] = kiln_add(in[0], c->w);
  return out[0] ? 0 : -1;
}

START_TEST(test_load_into_refused_while_tracing) {
  char path[4096];
  ref_path(path, sizeof path, "model.safetensors");
  kiln_scope_begin();
  trace_ctx c = {path, kiln_zeros(KILN_F32, 1, ((int64_t[]){8}))};
  kiln_options o = {.name = "loads", .n_in = 1, .n_out = 1};
  kiln_fn *fn = kiln_compile(loads_in_body, &c, &o);
  kiln_tensor *x = kiln_ones(KILN_F32, 1, ((int64_t[]){8})), *y = NULL;
  ck_assert_int_eq(-1, kiln_call(fn, &x, &y));
  ck_assert_msg(strstr(kiln_last_error(), "kiln_load_tensors_into") && strstr(kiln_last_error(), "being traced"), "%s",
                kiln_last_error());
  kiln_fn_free(fn);
  kiln_scope_end();
}
END_TEST

/* ---- hostile files ---- */

static char hpath[256];

/* Writes a file: the 8-byte length (hlen as a u64, or the header's own
 * length when hlen is AUTO), the header, then ndata bytes of data (byte i is i). */
#define AUTO INT64_MIN
static void write_file(const char *header, int64_t hlen, size_t ndata) {
  FILE *f = fopen(hpath, "wb");
  ck_assert_ptr_nonnull(f);
  uint64_t n = hlen == AUTO ? strlen(header) : (uint64_t)hlen;
  unsigned char len8[8];
  for (int i = 0; i < 8; i++) len8[i] = (unsigned char)(n >> (8 * i));
  ck_assert(fwrite(len8, 1, 8, f) == 8);
  ck_assert(fwrite(header, 1, strlen(header), f) == strlen(header));
  for (size_t i = 0; i < ndata; i++) fputc((int)(i & 0xff), f);
  fclose(f);
}

static int n_hostile, n_cut;

/* Opening must fail at this line, naming the path and saying why. */
#define HOSTILE(header, hlen, ndata, why)                                                   \
  do {                                                                                      \
    write_file((header), (hlen), (ndata));                                                  \
    kiln_clear_error();                                                                     \
    ck_assert_msg(kiln_tensors_open(hpath) == NULL, "not refused: %s", (header));           \
    expect_error_at(__LINE__, "kiln_tensors_open", hpath, (why));                           \
    kiln_tensor *out_ = (kiln_tensor *)1;                                                   \
    const char *none_ = "a";                                                                \
    ck_assert_int_eq(-1, kiln_load_tensors(hpath, 1, &none_, &out_));                       \
    expect_error_at(__LINE__, "kiln_load_tensors", hpath, (why));                           \
    ck_assert_ptr_null(out_);                                                               \
    if (getenv("SHOW_ERRORS")) printf("%s\n", kiln_last_error());                          \
    n_hostile++;                                                                            \
  } while (0)

#define T1(x) "{\"a\":" x "}"
#define F32_8 "{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}"

START_TEST(test_hostile_files) {
  make_tmp_dir();
  tmp_path(hpath, sizeof hpath, "hostile.safetensors");
  size_t base = kiln_mem_in_use();
  /* the length */
  FILE *f = fopen(hpath, "wb");
  fwrite("abc", 1, 3, f);
  fclose(f);
  kiln_clear_error();
  ck_assert_ptr_null(kiln_tensors_open(hpath));
  expect_error_at(__LINE__ - 1, "kiln_tensors_open", "the file is 3 bytes, too short for the 8-byte header length", hpath);
  HOSTILE(T1(F32_8), 1000, 8, "the header length is 1000 bytes, but the file has 62 after the length");
  HOSTILE(T1(F32_8), INT64_MAX, 8, "over the format's limit of 100000000");
  HOSTILE(T1(F32_8), 100000001, 8, "over the format's limit of 100000000");
  HOSTILE(T1(F32_8), -1, 8, "the header length is 18446744073709551615 bytes, over the format's limit");
  HOSTILE("", AUTO, 0, "does not start with '{'");
  /* not JSON, not an object */
  HOSTILE("[1,2]", AUTO, 0, "does not start with '{'");
  HOSTILE(" {}", AUTO, 0, "does not start with '{'");
  HOSTILE("\xef\xbb\xbf{}", AUTO, 0, "does not start with '{'"); /* a byte order mark */
  HOSTILE("{\"a\":", AUTO, 0, "the header is not valid JSON: it breaks off at byte");
  HOSTILE("{} x", AUTO, 0, "not valid JSON");
  HOSTILE("{\"a\":[1,]}", AUTO, 0, "not valid JSON");
  HOSTILE("{\"a\":\"\xff\"}", AUTO, 0, "the header is not valid UTF-8 (byte 6 of it)");
  HOSTILE("{\"\xc0\xaf\":1}", AUTO, 0, "not valid UTF-8 (byte 2"); /* an overlong '/' */
  HOSTILE("{\"\xed\xa0\x80\":1}", AUTO, 0, "not valid UTF-8"); /* a surrogate */
  HOSTILE("{\"a\\u0000b\":1}", AUTO, 0, "a string in the header holds \\u0000 (byte 3 of it)");
  HOSTILE("{\"a\x01\":1}", AUTO, 0, "a string in the header holds the control byte 0x01 (byte 3 of it)");
  HOSTILE("{\x01}", AUTO, 0, "the header holds the control byte 0x01 (byte 1 of it)");
  HOSTILE("{\"a\":\"\\ud800\"}", AUTO, 0, "not valid JSON"); /* an escaped lone surrogate */
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,99999999999999999999]}"), AUTO, 8,
          "the end of \"data_offsets\" is 100000000000000000000 or so, past 2^53 - 1");
  /* types */
  HOSTILE(T1("1"), AUTO, 0, "tensor \"a\" is a number, not an object");
  HOSTILE(T1("[]"), AUTO, 0, "tensor \"a\" is an array, not an object");
  HOSTILE(T1("{\"shape\":[2],\"data_offsets\":[0,8]}"), AUTO, 8, "tensor \"a\" has no \"dtype\"");
  HOSTILE(T1("{\"dtype\":\"F32\",\"data_offsets\":[0,8]}"), AUTO, 8, "tensor \"a\" has no \"shape\"");
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[2]}"), AUTO, 8, "tensor \"a\" has no \"data_offsets\"");
  HOSTILE(T1("{\"dtype\":32,\"shape\":[2],\"data_offsets\":[0,8]}"), AUTO, 8, "\"dtype\" is a number, not a string");
  HOSTILE(T1("{\"dtype\":\"F17\",\"shape\":[2],\"data_offsets\":[0,8]}"), AUTO, 8, "tensor \"a\": unknown dtype \"F17\"");
  HOSTILE(T1("{\"dtype\":\"f32\",\"shape\":[2],\"data_offsets\":[0,8]}"), AUTO, 8, "unknown dtype \"f32\"");
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":\"2\",\"data_offsets\":[0,8]}"), AUTO, 8, "\"shape\" is a string, not an array");
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,8]}"), AUTO, 8, "size 0 of \"shape\" is 2.5, not an integer");
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[1e999],\"data_offsets\":[0,8]}"), AUTO, 8, "size 0 of \"shape\" is inf, not an integer");
  HOSTILE(T1("{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}"), AUTO, 8,
          "tensor \"a\" has \"dtype\" twice");
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[1,null],\"data_offsets\":[0,4]}"), AUTO, 4, "size 1 of \"shape\" is null");
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}"), AUTO, 8, "size 0 of \"shape\" is negative (-2)");
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}"), AUTO, 8, "\"data_offsets\" has 1 items, not 2");
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8,8]}"), AUTO, 8, "\"data_offsets\" has 3 items, not 2");
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,\"8\"]}"), AUTO, 8,
          "the end of \"data_offsets\" is a string, not an integer");
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8.5]}"), AUTO, 8, "the end of \"data_offsets\" is 8.5");
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":{\"0\":8}}"), AUTO, 8,
          "\"data_offsets\" is an object, not [begin, end]");
  /* sizes */
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,8]}"), AUTO, 8, "has too many elements");
  HOSTILE(T1("{\"dtype\":\"F64\",\"shape\":[3037000500,3037000500],\"data_offsets\":[0,8]}"), AUTO, 8, "has too many elements");
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,20]}"), AUTO, 20,
          "F32[2,3] takes 24 bytes, but \"data_offsets\" [0, 20] hold 20");
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,0]}"), AUTO, 0, "F32[] takes 4 bytes");
  HOSTILE(T1("{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,2]}"), AUTO, 2, "3 elements of F4 (4 bits each) do not fill whole bytes");
  /* offsets */
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[-8,0]}"), AUTO, 8, "the begin of \"data_offsets\" is negative (-8)");
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}"), AUTO, 8, "\"data_offsets\" [8, 0] are out of order");
  HOSTILE(T1(F32_8), AUTO, 4, "\"data_offsets\" [0, 8] run past the end of the data (4 bytes)");
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[9007199254740983,9007199254740991]}"), AUTO, 8,
          "run past the end of the data");
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[9007199254740993,9007199254741001]}"), AUTO, 8,
          "the begin of \"data_offsets\" is 9007199254740992 or so, past 2^53 - 1");
  HOSTILE("{\"a\":" F32_8 ",\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", AUTO, 8,
          "tensor \"b\" starts at byte 4 of the data, inside tensor \"a\" (bytes [0, 8))");
  HOSTILE("{\"a\":" F32_8 ",\"b\":" F32_8 "}", AUTO, 8, "inside tensor");
  HOSTILE("{\"a\":" F32_8 ",\"e\":{\"dtype\":\"I64\",\"shape\":[0],\"data_offsets\":[4,4]}}", AUTO, 8,
          "tensor \"e\" starts at byte 4 of the data, inside tensor \"a\"");
  HOSTILE("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
          "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
          AUTO, 12, "bytes [4, 8) of the data, before tensor \"b\", belong to no tensor");
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}"), AUTO, 8, "bytes [0, 4) of the data, before tensor \"a\"");
  HOSTILE(T1("{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}"), AUTO, 8,
          "bytes [4, 8) at the end of the data belong to no tensor");
  HOSTILE("{}", AUTO, 3, "bytes [0, 3) at the end of the data belong to no tensor");
  /* keys */
  HOSTILE("{\"a\":" F32_8 ",\"a\":" F32_8 "}", AUTO, 8, "the header names tensor \"a\" twice");
  HOSTILE("{\"a\":" F32_8 ",\"\\u0061\":" F32_8 "}", AUTO, 8, "the header names tensor \"a\" twice");
  HOSTILE("{\"__metadata__\":[],\"a\":" F32_8 "}", AUTO, 8, "\"__metadata__\" is an array, not an object of strings");
  HOSTILE("{\"__metadata__\":{\"k\":1},\"a\":" F32_8 "}", AUTO, 8, "the value of \"k\" is a number, not a string");
  HOSTILE("{\"__metadata__\":{},\"__metadata__\":{}}", AUTO, 0, "the header has \"__metadata__\" twice");
  HOSTILE("{\"__metadata__\":{\"k\":\"1\",\"j\":\"2\",\"k\":\"3\"}}", AUTO, 0, "\"__metadata__\" has the key \"k\" twice");
  /* odd bytes in names reach messages escaped */
  HOSTILE("{\"\\u0001\\\"x\\\\\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", AUTO, 8,
          "before tensor \"\\x01\\\"x\\\\\", belong");
  HOSTILE("{\"\\u001b[31mred\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", AUTO, 8, "\"\\x1b[31mred\"");
  char *e = strstr(kiln_last_error(), "red");
  ck_assert_msg(e && !strchr(kiln_last_error(), 0x1b), "a raw escape byte reached the message");
  /* nesting and size: a parse that stays bounded */
  size_t deep = 100000;
  char *h = malloc(deep * 2 + 16);
  strcpy(h, "{\"a\":");
  memset(h + 5, '[', deep);
  memset(h + 5 + deep, ']', deep);
  strcpy(h + 5 + 2 * deep, "}");
  HOSTILE(h, AUTO, 0, "not valid JSON"); /* cJSON stops at 1000 levels */
  free(h);
  size_t many = (1 << 21) + 8;
  h = malloc(many * 2 + 64);
  strcpy(h, "{\"a\":[");
  for (size_t i = 0; i < many; i++) memcpy(h + 6 + 2 * i, "0,", 2);
  strcpy(h + 6 + 2 * many - 1, "]}");
  HOSTILE(h, AUTO, 0, "the header holds 2097162 JSON values, over kiln's limit of 2097152");
  free(h);
  /* a file cut short, anywhere */
  char good[256];
  tmp_path(good, sizeof good, "good.safetensors");
  kiln_scope_begin();
  kiln_tensor *t[2] = {kiln_arange(KILN_F32, 0, 10, 1), kiln_arange(KILN_I64, 0, 3, 1)};
  const char *names[2] = {"x", "y"};
  ck_assert_int_eq(0, kiln_save_tensors(good, 2, names, t));
  kiln_scope_end();
  FILE *g = fopen(good, "rb");
  unsigned char whole[512];
  size_t size = fread(whole, 1, sizeof whole, g);
  fclose(g);
  for (size_t cut = 0; cut < size; cut++) {
    FILE *c = fopen(hpath, "wb");
    fwrite(whole, 1, cut, c);
    fclose(c);
    kiln_clear_error();
    ck_assert_msg(kiln_tensors_open(hpath) == NULL, "a file cut to %zu of %zu bytes opened", cut, size);
    ck_assert_msg(strstr(kiln_last_error(), hpath), "%s", kiln_last_error());
    n_cut++;
  }
  /* not a file: a folder, a FIFO (whose open must not wait for a writer) */
  ck_assert_ptr_null(kiln_tensors_open(tmp_dir));
  expect_error_at(__LINE__ - 1, "kiln_tensors_open", "not a regular file", NULL);
  char fifo[256];
  tmp_path(fifo, sizeof fifo, "fifo");
  ck_assert_int_eq(0, mkfifo(fifo, 0600));
  ck_assert_ptr_null(kiln_tensors_open(fifo));
  expect_error_at(__LINE__ - 1, "kiln_tensors_open", "not a regular file", fifo);
  ck_assert_ptr_null(kiln_tensors_open("no/such/file.safetensors"));
  expect_error_at(__LINE__ - 1, "kiln_tensors_open", "no/such/file.safetensors: cannot open: No such file or directory", NULL);
  ck_assert_uint_eq(base, kiln_mem_in_use());
  printf("safetensors: %d hostile files refused, and a valid file cut at each of its %d lengths\n", n_hostile, n_cut);
  remove_tmp_dir();
}
END_TEST

/* Edge cases that are valid: each loads. */
START_TEST(test_valid_edges) {
  make_tmp_dir();
  tmp_path(hpath, sizeof hpath, "edge.safetensors");
  kiln_scope_begin();
  /* bool bytes other than 0 and 1 load as true */
  write_file(T1("{\"dtype\":\"BOOL\",\"shape\":[4],\"data_offsets\":[0,4]}"), AUTO, 0);
  FILE *f = fopen(hpath, "ab");
  fwrite((unsigned char[]){0, 1, 2, 255}, 1, 4, f);
  fclose(f);
  kiln_tensor_file *tf = kiln_tensors_open(hpath);
  ck_assert_ptr_nonnull(tf);
  kiln_tensor *m = kiln_tensors_get(tf, "a");
  kiln_tensors_close(tf);
  unsigned char b[4];
  ck_assert_int_eq(0, kiln_read(m, b, 4));
  ck_assert(b[0] == 0 && b[1] == 1 && b[2] == 1 && b[3] == 1);
  /* an empty tensor with a huge dim (the largest kiln reads: 2^53 - 1); extra keys in an
   * entry are ignored, as the reference ignores them; integral numbers in other forms */
  write_file(T1("{\"dtype\":\"F32\",\"shape\":[0,9007199254740991],\"data_offsets\":[0,0.0],\"extra\":[1]}"), AUTO, 0);
  const char *a = "a";
  kiln_tensor *x = NULL;
  ck_assert_msg(kiln_load_tensors(hpath, 1, &a, &x) == 0, "%s", kiln_last_error());
  ck_assert_int_eq(0, kiln_numel(x));
  ck_assert_int_eq(9007199254740991LL, kiln_size(x, 1));
  /* names: the empty one, odd bytes, escapes; unpadded header; tensors in any order */
  write_file("{\"\\u00e9\\t\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[8,16]},"
             "\"\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}}",
             AUTO, 16);
  const char *odd[2] = {"", "\xc3\xa9\t"};
  kiln_tensor *y[2];
  ck_assert_msg(kiln_load_tensors(hpath, 2, odd, y) == 0, "%s", kiln_last_error());
  ck_assert_int_eq(0, kiln_ndim(y[1]));
  /* byte i of the data is i: element 0 is bytes 0..7, element "é\t" bytes 8..15 */
  int64_t v0, v1;
  ck_assert_int_eq(0, kiln_read(y[0], &v0, 8));
  ck_assert_int_eq(0, kiln_read(y[1], &v1, 8));
  ck_assert_int_eq(0x0706050403020100LL, v0);
  ck_assert_int_eq(0x0f0e0d0c0b0a0908LL, v1);
  /* a missing name lists a few the file holds, escaped */
  const char *missing = "b";
  ck_assert_int_eq(-1, kiln_load_tensors(hpath, 1, &missing, y));
  expect_error_at(__LINE__ - 1, "kiln_load_tensors", "tensor \"b\" is not in the file, which holds \"\", \"\xc3\xa9\\x09\"", NULL);
  kiln_scope_end();
  remove_tmp_dir();
}
END_TEST

/* A missing name in a large file: the first few names, then a count. */
START_TEST(test_missing_name_lists_some) {
  make_tmp_dir();
  char path[256];
  tmp_path(path, sizeof path, "many.safetensors");
  kiln_scope_begin();
  const char *names[10] = {"l0", "l1", "l2", "l3", "l4", "l5", "l6", "l7", "l8", "l9"};
  kiln_tensor *t[10];
  for (int i = 0; i < 10; i++) t[i] = kiln_scalar(KILN_F32, i);
  ck_assert_int_eq(0, kiln_save_tensors(path, 10, names, t));
  kiln_tensor_file *f = kiln_tensors_open(path);
  ck_assert_ptr_null(kiln_tensors_get(f, "l10"));
  expect_error_at(__LINE__ - 1, "kiln_tensors_get", "tensor \"l10\" is not in the file, which holds \"l0\", \"l1\", \"l2\", \"l3\" and 6 more",
                  path);
  kiln_tensor_info info;
  ck_assert_int_eq(-1, kiln_tensors_info(f, 10, &info));
  expect_error_at(__LINE__ - 1, "kiln_tensors_info", "index 10 is outside 0..9", NULL);
  ck_assert_int_eq(-1, kiln_tensors_find(f, "l10"));
  kiln_tensors_close(f);
  kiln_scope_end();
  remove_tmp_dir();
}
END_TEST

/* ---- saving: what is refused ---- */

START_TEST(test_save_errors) {
  make_tmp_dir();
  char path[256];
  tmp_path(path, sizeof path, "bad.safetensors");
  kiln_scope_begin();
  kiln_tensor *a = kiln_ones(KILN_F32, 1, ((int64_t[]){2})), *b = kiln_zeros(KILN_I64, 0, NULL);
  kiln_tensor *ts[3] = {a, b, a};
  const char *dup[3] = {"w", "v", "w"};
  ck_assert_int_eq(-1, kiln_save_tensors(path, 3, dup, ts));
  expect_error_at(__LINE__ - 1, "kiln_save_tensors", "names[0] and names[2] are both \"w\"", path);
  const char *empty[2] = {"w", ""};
  ck_assert_int_eq(-1, kiln_save_tensors(path, 2, empty, ts));
  expect_error_at(__LINE__ - 1, "kiln_save_tensors", "names[1] is empty", NULL);
  const char *meta_name[1] = {"__metadata__"};
  ck_assert_int_eq(-1, kiln_save_tensors(path, 1, meta_name, ts));
  expect_error_at(__LINE__ - 1, "kiln_save_tensors", "names[0] is \"__metadata__\"", NULL);
  const char *bad_utf8[2] = {"ok", "a\xff"};
  ck_assert_int_eq(-1, kiln_save_tensors(path, 2, bad_utf8, ts));
  expect_error_at(__LINE__ - 1, "kiln_save_tensors", "names[1] (\"a\xff\") is not valid UTF-8", NULL);
  const char *surrogate[1] = {"\xed\xa0\x80"};
  ck_assert_int_eq(-1, kiln_save_tensors(path, 1, surrogate, ts));
  expect_error_at(__LINE__ - 1, "kiln_save_tensors", "is not valid UTF-8", NULL);
  const char *nul_name[2] = {"w", NULL};
  ck_assert_int_eq(-1, kiln_save_tensors(path, 2, nul_name, ts));
  expect_error_at(__LINE__ - 1, "kiln_save_tensors", "names[1] is NULL", NULL);
  kiln_tensor *nul_t[2] = {a, NULL};
  const char *two[2] = {"w", "v"};
  kiln_clear_error();
  ck_assert_int_eq(-1, kiln_save_tensors(path, 2, two, nul_t));
  expect_error_at(__LINE__ - 1, "kiln_save_tensors", "tensors[1] is NULL", NULL);
  ck_assert_int_eq(-1, kiln_save_tensors(path, -1, two, ts));
  expect_error_at(__LINE__ - 1, "kiln_save_tensors", "n is negative", NULL);
  const char *meta1[] = {"format", NULL};
  ck_assert_int_eq(-1, kiln_save_tensors_meta(path, 1, two, ts, meta1));
  expect_error_at(__LINE__ - 1, "kiln_save_tensors", "metadata key \"format\" has no value", NULL);
  const char *meta2[] = {"k", "1", "k", "2", NULL};
  ck_assert_int_eq(-1, kiln_save_tensors_meta(path, 1, two, ts, meta2));
  expect_error_at(__LINE__ - 1, "kiln_save_tensors", "metadata key \"k\" is given twice", NULL);
  ck_assert_int_eq(-1, kiln_save_tensors("no/such/dir/x.safetensors", 1, two, ts));
  expect_error_at(__LINE__ - 1, "kiln_save_tensors", "no/such/dir/x.safetensors: cannot write: No such file or directory", NULL);
  /* nothing was written, and no half-written file is left */
  ck_assert_int_ne(0, access(path, F_OK));
  ck_assert_int_eq(0, stray_temporaries());
  /* an existing file is replaced only by a whole new one */
  ck_assert_int_eq(0, kiln_save_tensors(path, 1, two, ts));
  ck_assert_int_eq(-1, kiln_save_tensors(path, 3, dup, ts));
  kiln_tensor_file *f = kiln_tensors_open(path);
  ck_assert_ptr_nonnull(f);
  ck_assert_int_eq(1, kiln_tensors_count(f));
  kiln_tensors_close(f);
  kiln_scope_end();
  remove_tmp_dir();
}
END_TEST

/* NULL for every pointer argument. */
START_TEST(test_null_arguments) {
  kiln_tensor *t = NULL;
  const char *name = "a";
  kiln_tensor_info info;
  kiln_clear_error();
  ck_assert_int_eq(-1, kiln_save_tensors(NULL, 1, &name, &t));
  expect_error_at(__LINE__ - 1, "kiln_save_tensors", "path is NULL", NULL);
  ck_assert_int_eq(-1, kiln_save_tensors("x", 1, NULL, &t));
  expect_error_at(__LINE__ - 1, "kiln_save_tensors", "names is NULL", NULL);
  ck_assert_int_eq(-1, kiln_save_tensors("x", 1, &name, NULL));
  expect_error_at(__LINE__ - 1, "kiln_save_tensors", "tensors is NULL", NULL);
  ck_assert_int_eq(-1, kiln_load_tensors(NULL, 1, &name, &t));
  expect_error_at(__LINE__ - 1, "kiln_load_tensors", "path is NULL", NULL);
  ck_assert_int_eq(-1, kiln_load_tensors("x", 1, NULL, &t));
  expect_error_at(__LINE__ - 1, "kiln_load_tensors", "names is NULL", NULL);
  ck_assert_int_eq(-1, kiln_load_tensors("x", 1, &name, NULL));
  expect_error_at(__LINE__ - 1, "kiln_load_tensors", "out is NULL", NULL);
  ck_assert_int_eq(-1, kiln_load_tensors_into(NULL, 1, &name, &t));
  expect_error_at(__LINE__ - 1, "kiln_load_tensors_into", "path is NULL", NULL);
  ck_assert_int_eq(-1, kiln_load_tensors_into("x", 1, &name, NULL));
  expect_error_at(__LINE__ - 1, "kiln_load_tensors_into", "dst is NULL", NULL);
  kiln_clear_error();
  ck_assert_int_eq(-1, kiln_load_tensors_into("x", 1, &name, &t));
  expect_error_at(__LINE__ - 1, "kiln_load_tensors_into", "dst[0] is NULL", NULL);
  ck_assert_ptr_null(kiln_tensors_open(NULL));
  expect_error_at(__LINE__ - 1, "kiln_tensors_open", "path is NULL", NULL);
  ck_assert_int_eq(-1, kiln_tensors_info(NULL, 0, &info));
  expect_error_at(__LINE__ - 1, "kiln_tensors_info", "file is NULL", NULL);
  ck_assert_ptr_null(kiln_tensors_get(NULL, "a"));
  expect_error_at(__LINE__ - 1, "kiln_tensors_get", "file is NULL", NULL);
  ck_assert_int_eq(-1, kiln_tensors_count(NULL));
  ck_assert_int_eq(-1, kiln_tensors_find(NULL, "a"));
  ck_assert_ptr_null(kiln_tensors_metadata(NULL, "a"));
  kiln_tensors_close(NULL);
  char path[4096];
  ref_path(path, sizeof path, "model.safetensors");
  kiln_tensor_file *f = kiln_tensors_open(path);
  ck_assert_ptr_nonnull(f);
  ck_assert_int_eq(-1, kiln_tensors_info(f, 0, NULL));
  expect_error_at(__LINE__ - 1, "kiln_tensors_info", "info is NULL", NULL);
  ck_assert_ptr_null(kiln_tensors_get(f, NULL));
  expect_error_at(__LINE__ - 1, "kiln_tensors_get", "name is NULL", NULL);
  ck_assert_int_eq(-1, kiln_tensors_find(f, NULL));
  ck_assert_ptr_null(kiln_tensors_metadata(f, NULL));
  kiln_tensors_close(f);
}
END_TEST

int main(void) {
  Suite *s = suite_create("safetensors");
  struct {
    const char *name;
    const TTest *test;
  } cases[] = {
      {"python_files_load", test_python_files_load},
      {"other_dtypes", test_other_dtypes},
      {"kiln_files_read_by_python", test_kiln_files_read_by_python},
      {"kiln_header_bytes", test_kiln_header_bytes},
      {"round_trip", test_round_trip},
      {"ownership", test_ownership},
      {"load_into", test_load_into},
      {"load_into_refused_while_tracing", test_load_into_refused_while_tracing},
      {"hostile_files", test_hostile_files},
      {"valid_edges", test_valid_edges},
      {"missing_name_lists_some", test_missing_name_lists_some},
      {"save_errors", test_save_errors},
      {"null_arguments", test_null_arguments},
  };
  for (int k = 0; k < NELEM(cases); k++) {
    TCase *tc = tcase_create(cases[k].name);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, cases[k].test);
    suite_add_tcase(s, tc);
  }
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
