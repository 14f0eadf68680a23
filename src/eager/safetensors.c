/* Weights in the safetensors format, the one PyTorch and Hugging Face use
 * (safetensors.torch.save_file): 8 bytes of header length (u64, little-endian),
 * a JSON header that maps each tensor's name to {"dtype", "shape",
 * "data_offsets"} (plus an optional "__metadata__" map of strings), then the
 * data: each tensor row-major and little-endian, at its data_offsets.
 *
 * Everything in a file is data from outside. The header is parsed by cJSON
 * and checked as the format's reference implementation checks it before any
 * memory is sized from it, and no tensor is larger than the bytes the file
 * holds for it. Tensors are read with pread straight into their storage, so a
 * file is read once and never held whole in memory; a handle may serve
 * several threads. docs/reliability.md lists the rules and limits. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "eager/eager.h"

#define HEADER_MAX 100000000 /* header bytes: the reference implementation's limit */
#define VALUES_MAX (1 << 21) /* JSON values in a header: the parse then takes at most ~160 MB */
#define SHOWN_NAMES 4        /* names a "not in the file" error lists */

/* ---- dtypes ---- */

/* The format's dtypes. Giving kiln a new dtype is filling in its row. */
typedef struct st_dtype {
  const char *name; /* as the format spells it */
  int bits;         /* per element */
  int kiln;         /* the kiln_dtype it loads as; -1: kiln has none */
} st_dtype;

static const st_dtype dtypes[] = {
    {"F32", 32, KILN_F32},
    {"F64", 64, KILN_F64},
    {"I64", 64, KILN_I64},
    {"BOOL", 8, KILN_BOOL},
    {"F16", 16, KILN_F16},
    {"BF16", 16, KILN_BF16},
    {"I32", 32, KILN_I32},
    {"I16", 16, -1},
    {"I8", 8, -1},
    {"U64", 64, -1},
    {"U32", 32, -1},
    {"U16", 16, -1},
    {"U8", 8, -1},
    {"C64", 64, -1},
    {"F8_E4M3", 8, -1},
    {"F8_E5M2", 8, -1},
    {"F8_E8M0", 8, -1},
    {"F6_E2M3", 6, -1},
    {"F6_E3M2", 6, -1},
    {"F4", 4, -1},
};
#define N_DTYPES ((int)(sizeof dtypes / sizeof dtypes[0]))

static const st_dtype *dtype_named(const char *s) {
  for (int i = 0; i < N_DTYPES; i++)
    if (!strcmp(dtypes[i].name, s)) return &dtypes[i];
  return NULL;
}

static const st_dtype *dtype_of(kiln_dtype dt) {
  for (int i = 0; i < N_DTYPES; i++)
    if (dtypes[i].kiln == (int)dt) return &dtypes[i];
  return NULL;
}

/* "F32, F64, I64 and BOOL": the dtypes kiln loads, for messages. */
static const char *loadable_list(char *buf, size_t n) {
  int count = 0, k = 0;
  for (int i = 0; i < N_DTYPES; i++) count += dtypes[i].kiln >= 0;
  buf[0] = 0;
  for (int i = 0, len = 0; i < N_DTYPES && len < (int)n; i++)
    if (dtypes[i].kiln >= 0) {
      k++;
      len += snprintf(buf + len, n - (size_t)len, "%s%s", k == 1 ? "" : k == count ? " and " : ", ", dtypes[i].name);
    }
  return buf;
}

/* ---- messages ---- */

/* Where an error goes: the API function, the file it reads or writes, the caller. */
typedef struct ctx {
  const char *op; /* without "kiln_" */
  const char *path;
  const char *file;
  int line;
} ctx;

static int fail(const ctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(const ctx *c, const char *fmt, ...) {
  char m[900];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m, sizeof m, fmt, ap);
  va_end(ap);
  err_set(c->file, c->line, c->op, "%s: %s", c->path, m);
  return -1;
}

/* Text from a file made fit for a message: control bytes escaped, cut after
 * about 64 bytes (at a character boundary); quoted (quotes and backslashes
 * escaped) when quote is set, as names are. */
typedef struct shown {
  char s[320];
} shown;

static const char *escape(shown *b, const char *s, bool quote) {
  size_t n = 0;
  if (quote) b->s[n++] = '"';
  for (size_t i = 0; s[i]; i++) {
    unsigned char ch = (unsigned char)s[i];
    if (i >= 64 && (ch & 0xc0) != 0x80) {
      memcpy(b->s + n, "...", 3);
      n += 3;
      break;
    }
    if (quote && (ch == '"' || ch == '\\')) b->s[n++] = '\\', b->s[n++] = (char)ch;
    else if (ch < 0x20 || ch == 0x7f) n += (size_t)snprintf(b->s + n, 5, "\\x%02x", ch);
    else b->s[n++] = (char)ch;
  }
  if (quote) b->s[n++] = '"';
  b->s[n] = 0;
  return b->s;
}

static const char *show(shown *b, const char *name) { return escape(b, name, true); }

/* Where s[0..n) first breaks strict UTF-8 (no overlong forms, no
 * surrogates, at most U+10FFFF), or n when it does not. */
static size_t utf8_bad(const unsigned char *s, size_t n) {
  size_t i = 0;
  while (i < n) {
    unsigned c = s[i], need, min;
    if (c < 0x80) {
      i++;
      continue;
    }
    if ((c & 0xe0) == 0xc0) need = 1, min = 0x80, c &= 0x1f;
    else if ((c & 0xf0) == 0xe0) need = 2, min = 0x800, c &= 0x0f;
    else if ((c & 0xf8) == 0xf0) need = 3, min = 0x10000, c &= 0x07;
    else return i;
    if (n - i <= need) return i;
    for (unsigned k = 1; k <= need; k++) {
      if ((s[i + k] & 0xc0) != 0x80) return i;
      c = c << 6 | (s[i + k] & 0x3f);
    }
    if (c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff)) return i;
    i += need + 1;
  }
  return n;
}

static bool utf8_valid(const char *s) {
  size_t n = strlen(s);
  return utf8_bad((const unsigned char *)s, n) == n;
}

/* ---- cJSON ---- */

/* cJSON records where every parse stopped in a global (cJSON_GetErrorPtr):
 * parses take turns. */
static pthread_mutex_t parse_lock = PTHREAD_MUTEX_INITIALIZER;

/* In the test build cJSON allocates through alloc.c, so that the failing
 * allocator reaches its out-of-memory paths too. Only there: the setting is
 * process-wide, and outside tests other code in the process may use cJSON. */
#ifdef KILN_TEST_BUILD
static void json_use_alloc(void) {
  cJSON_Hooks h = {.malloc_fn = alloc_malloc, .free_fn = alloc_free};
  cJSON_InitHooks(&h);
}
#endif

static void json_setup(void) {
#ifdef KILN_TEST_BUILD
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, json_use_alloc);
#endif
}

static const char *json_kind(const cJSON *v) {
  return cJSON_IsObject(v) ? "an object"
         : cJSON_IsArray(v) ? "an array"
         : cJSON_IsString(v) ? "a string"
         : cJSON_IsNumber(v) ? "a number"
         : cJSON_IsTrue(v) ? "true"
         : cJSON_IsFalse(v) ? "false"
         : cJSON_IsNull(v) ? "null"
                           : "?";
}

/* v as a size or byte offset: a whole JSON number from 0 to 2^53 - 1
 * (cJSON keeps numbers as doubles; from 2^53 on, the text's number may have
 * been rounded). 0, or -1 with what is wrong in why. */
static int json_count(const cJSON *v, uint64_t *out, char *why, size_t n) {
  double d = cJSON_IsNumber(v) ? v->valuedouble : 0;
  if (!cJSON_IsNumber(v)) snprintf(why, n, "is %s, not an integer", json_kind(v));
  else if (!isfinite(d) || d != floor(d)) snprintf(why, n, "is %.17g, not an integer", d);
  else if (d < 0) snprintf(why, n, "is negative (%.0f)", d);
  else if (d >= 0x1p53) snprintf(why, n, "is %.0f or so, past 2^53 - 1, the largest integer kiln reads exactly", d);
  else return *out = (uint64_t)d, 0;
  return -1;
}

/* Adds item to obj under key (or to the array obj when key is NULL); item
 * is the container's, or freed, either way. */
static bool json_add(cJSON *obj, const char *key, cJSON *item) {
  if (obj && item && (key ? cJSON_AddItemToObject(obj, key, item) : cJSON_AddItemToArray(obj, item))) return true;
  cJSON_Delete(item);
  return false;
}

/* A JSON integer, written as digits (cJSON would print a double). */
static cJSON *json_int(uint64_t v) {
  char buf[24];
  snprintf(buf, sizeof buf, "%" PRIu64, v);
  return cJSON_CreateRaw(buf);
}

/* ---- file I/O ---- */

/* Reads n bytes at offset at: 0, or an errno value (-1: the file ended first). */
static int read_at(int fd, void *buf, size_t n, uint64_t at) {
  char *p = buf;
  while (n) {
    size_t chunk = n < ((size_t)1 << 30) ? n : ((size_t)1 << 30);
    ssize_t r = pread(fd, p, chunk, (off_t)at);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return errno;
    if (r == 0) return -1;
    p += r, n -= (size_t)r, at += (uint64_t)r;
  }
  return 0;
}

static int write_all(int fd, const void *buf, size_t n) {
  const char *p = buf;
  while (n) {
    size_t chunk = n < ((size_t)1 << 30) ? n : ((size_t)1 << 30);
    ssize_t r = write(fd, p, chunk);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return errno;
    if (r == 0) return EIO;
    p += r, n -= (size_t)r;
  }
  return 0;
}

/* ---- an open file ---- */

typedef struct st_meta {
  const char *key, *value; /* in the file's text block */
} st_meta;

typedef struct st_entry {
  const char *name;     /* in the file's text block */
  const st_dtype *dt;
  int ndim;
  const int64_t *shape; /* in the file's dims block */
  uint64_t begin, end;  /* bytes [begin, end) of the data */
} st_entry;

struct kiln_tensor_file {
  char *path;        /* for messages */
  int fd;
  uint64_t data_at;  /* where the data starts: 8 + header length */
  uint64_t data_len; /* bytes of data, all of them some tensor's */
  int n;
  st_entry *e;       /* in the order of their data */
  const st_entry **by_name; /* the entries sorted by name */
  int n_meta;
  st_meta *meta;     /* sorted by key */
  char *text;        /* names, keys and values, each NUL-terminated */
  int64_t *dims;     /* every entry's shape */
};

static void file_free(kiln_tensor_file *f) {
  if (!f) return;
  if (f->fd >= 0) close(f->fd);
  alloc_free(f->path);
  alloc_free(f->e);
  alloc_free(f->by_name);
  alloc_free(f->meta);
  alloc_free(f->text);
  alloc_free(f->dims);
  alloc_free(f);
}

static int oom(const ctx *c) { return fail(c, "out of memory"); }

static int by_offsets(const void *pa, const void *pb) {
  const st_entry *a = pa, *b = pb;
  if (a->begin != b->begin) return a->begin < b->begin ? -1 : 1;
  if (a->end != b->end) return a->end < b->end ? -1 : 1;
  return strcmp(a->name, b->name);
}

static int by_name(const void *pa, const void *pb) {
  return strcmp((*(const st_entry *const *)pa)->name, (*(const st_entry *const *)pb)->name);
}

/* Checks one tensor's entry v and fills e (e->name set) and dims (room for
 * its rank, counted before). 0 or -1 with the error set. */
static int take_entry(const ctx *c, st_entry *e, const cJSON *v, int64_t *dims, uint64_t data_len) {
  shown s1, s2;
  char why[128], b[SHAPE_BUF];
  const char *nm = show(&s1, e->name);
  if (!cJSON_IsObject(v)) return fail(c, "tensor %s is %s, not an object", nm, json_kind(v));
  const cJSON *dt = NULL, *sh = NULL, *off = NULL;
  for (const cJSON *k = v->child; k; k = k->next) {
    const cJSON **slot = !strcmp(k->string, "dtype")          ? &dt
                         : !strcmp(k->string, "shape")        ? &sh
                         : !strcmp(k->string, "data_offsets") ? &off
                                                              : NULL;
    if (!slot) continue; /* other keys are ignored, as the reference ignores them */
    if (*slot) return fail(c, "tensor %s has \"%s\" twice", nm, k->string);
    *slot = k;
  }
  if (!dt || !sh || !off)
    return fail(c, "tensor %s has no \"%s\"", nm, !dt ? "dtype" : !sh ? "shape" : "data_offsets");
  if (!cJSON_IsString(dt)) return fail(c, "tensor %s: \"dtype\" is %s, not a string", nm, json_kind(dt));
  if (!(e->dt = dtype_named(dt->valuestring)))
    return fail(c, "tensor %s: unknown dtype %s", nm, show(&s2, dt->valuestring));
  if (!cJSON_IsArray(sh)) return fail(c, "tensor %s: \"shape\" is %s, not an array of sizes", nm, json_kind(sh));
  /* the element count, exactly: a 0 anywhere makes it 0, whatever the other sizes */
  uint64_t numel = 1, x;
  bool zero = false, overflow = false;
  e->ndim = 0;
  e->shape = dims;
  for (const cJSON *d = sh->child; d; d = d->next, e->ndim++) {
    if (json_count(d, &x, why, sizeof why)) return fail(c, "tensor %s: size %d of \"shape\" %s", nm, e->ndim, why);
    dims[e->ndim] = (int64_t)x;
    zero |= x == 0;
    overflow |= __builtin_mul_overflow(numel, x, &numel);
  }
  uint64_t bits = 0;
  if (zero) numel = 0;
  if ((overflow && !zero) || __builtin_mul_overflow(numel, (uint64_t)e->dt->bits, &bits))
    return fail(c, "tensor %s: shape %s has too many elements", nm, err_shape(b, e->ndim, e->shape));
  if (bits % 8)
    return fail(c, "tensor %s: %" PRIu64 " elements of %s (%d bits each) do not fill whole bytes", nm, numel,
                e->dt->name, e->dt->bits);
  if (!cJSON_IsArray(off)) return fail(c, "tensor %s: \"data_offsets\" is %s, not [begin, end]", nm, json_kind(off));
  if (cJSON_GetArraySize(off) != 2)
    return fail(c, "tensor %s: \"data_offsets\" has %d items, not 2", nm, cJSON_GetArraySize(off));
  for (int i = 0; i < 2; i++)
    if (json_count(cJSON_GetArrayItem(off, i), i ? &e->end : &e->begin, why, sizeof why))
      return fail(c, "tensor %s: the %s of \"data_offsets\" %s", nm, i ? "end" : "begin", why);
  if (e->begin > e->end)
    return fail(c, "tensor %s: \"data_offsets\" [%" PRIu64 ", %" PRIu64 "] are out of order", nm, e->begin, e->end);
  if (e->end > data_len)
    return fail(c, "tensor %s: \"data_offsets\" [%" PRIu64 ", %" PRIu64 "] run past the end of the data (%" PRIu64 " bytes)",
                nm, e->begin, e->end, data_len);
  if (e->end - e->begin != bits / 8)
    return fail(c, "tensor %s: %s%s takes %" PRIu64 " bytes, but \"data_offsets\" [%" PRIu64 ", %" PRIu64 "] hold %" PRIu64,
                nm, e->dt->name, err_shape(b, e->ndim, e->shape), bits / 8, e->begin, e->end, e->end - e->begin);
  return 0;
}

static int by_key(const void *pa, const void *pb) {
  return strcmp(((const st_meta *)pa)->key, ((const st_meta *)pb)->key);
}

/* Fills f from the parsed header root (an object). 0 or -1 with the error set. */
static int take_header(const ctx *c, kiln_tensor_file *f, const cJSON *root) {
  shown s1, s2;
  /* sizes first: entries, metadata pairs, bytes of text, dims */
  size_t n = 0, n_meta = 0, text = 0, dims = 0, seen_meta = 0;
  for (const cJSON *v = root->child; v; v = v->next) {
    if (!strcmp(v->string, "__metadata__")) {
      if (seen_meta++) return fail(c, "the header has \"__metadata__\" twice");
      if (!cJSON_IsObject(v)) return fail(c, "\"__metadata__\" is %s, not an object of strings", json_kind(v));
      for (const cJSON *m = v->child; m; m = m->next) {
        if (!cJSON_IsString(m))
          return fail(c, "\"__metadata__\": the value of %s is %s, not a string", show(&s1, m->string), json_kind(m));
        n_meta++;
        text += strlen(m->string) + strlen(m->valuestring) + 2;
      }
      continue;
    }
    n++;
    text += strlen(v->string) + 1;
    const cJSON *sh = cJSON_IsObject(v) ? cJSON_GetObjectItemCaseSensitive(v, "shape") : NULL;
    if (cJSON_IsArray(sh)) dims += (size_t)cJSON_GetArraySize(sh);
  }
  f->e = alloc_calloc(n ? n : 1, sizeof *f->e);
  f->by_name = alloc_calloc(n ? n : 1, sizeof *f->by_name);
  f->meta = alloc_calloc(n_meta ? n_meta : 1, sizeof *f->meta);
  f->text = alloc_malloc(text + 1);
  f->dims = alloc_calloc(dims ? dims : 1, sizeof *f->dims);
  if (!f->e || !f->by_name || !f->meta || !f->text || !f->dims) return oom(c);
  /* then the entries and the metadata */
  char *t = f->text;
  int64_t *d = f->dims;
  for (const cJSON *v = root->child; v; v = v->next) {
    if (!strcmp(v->string, "__metadata__")) {
      for (const cJSON *m = v->child; m; m = m->next) {
        size_t kn = strlen(m->string) + 1, vn = strlen(m->valuestring) + 1;
        f->meta[f->n_meta++] = (st_meta){memcpy(t, m->string, kn), memcpy(t + kn, m->valuestring, vn)};
        t += kn + vn;
      }
      continue;
    }
    st_entry *e = &f->e[f->n];
    e->name = memcpy(t, v->string, strlen(v->string) + 1);
    t += strlen(v->string) + 1;
    if (take_entry(c, e, v, d, f->data_len)) return -1;
    d += e->ndim;
    f->n++;
  }
  /* names and keys are unique (cJSON keeps both of a repeated key) */
  qsort(f->meta, (size_t)f->n_meta, sizeof *f->meta, by_key);
  for (int i = 1; i < f->n_meta; i++)
    if (!strcmp(f->meta[i - 1].key, f->meta[i].key))
      return fail(c, "\"__metadata__\" has the key %s twice", show(&s1, f->meta[i].key));
  qsort(f->e, (size_t)f->n, sizeof *f->e, by_offsets);
  for (int i = 0; i < f->n; i++) f->by_name[i] = &f->e[i];
  qsort(f->by_name, (size_t)f->n, sizeof *f->by_name, by_name);
  for (int i = 1; i < f->n; i++)
    if (!strcmp(f->by_name[i - 1]->name, f->by_name[i]->name))
      return fail(c, "the header names tensor %s twice", show(&s1, f->by_name[i]->name));
  /* the data must be covered exactly: no overlaps, no gaps, nothing after */
  uint64_t at = 0;
  for (int i = 0; i < f->n; i++) {
    const st_entry *e = &f->e[i];
    if (e->begin < at)
      return fail(c, "tensor %s starts at byte %" PRIu64 " of the data, inside tensor %s (bytes [%" PRIu64 ", %" PRIu64 "))",
                  show(&s1, e->name), e->begin, show(&s2, f->e[i - 1].name), f->e[i - 1].begin, f->e[i - 1].end);
    if (e->begin > at)
      return fail(c, "bytes [%" PRIu64 ", %" PRIu64 ") of the data, before tensor %s, belong to no tensor (the format allows no gaps)",
                  at, e->begin, show(&s1, e->name));
    at = e->end;
  }
  if (at != f->data_len)
    return fail(c, "bytes [%" PRIu64 ", %" PRIu64 ") at the end of the data belong to no tensor (the format allows no gaps)",
                at, f->data_len);
  return 0;
}

/* What cJSON is lenient about, checked first on the raw text: the header is
 * UTF-8, with no control bytes but whitespace outside strings and none in
 * them, and no \u0000 (a C string would end there); and how many values it
 * may hold (each is 64 bytes or more to cJSON). 0 or -1 with the error set. */
static int check_text(const ctx *c, const char *text, size_t len) {
  const unsigned char *s = (const unsigned char *)text;
  size_t bad = utf8_bad(s, len), values = 1;
  if (bad < len) return fail(c, "the header is not valid UTF-8 (byte %zu of it)", bad);
  bool in_string = false;
  for (size_t i = 0; i < len; i++) {
    unsigned ch = s[i];
    if (in_string) {
      if (ch < 0x20) return fail(c, "a string in the header holds the control byte 0x%02x (byte %zu of it)", ch, i);
      if (ch == '"') in_string = false;
      else if (ch == '\\' && i + 1 < len) {
        if (s[i + 1] == 'u' && len - i >= 6 && !memcmp(s + i + 2, "0000", 4))
          return fail(c, "a string in the header holds \\u0000 (byte %zu of it), which no name can", i);
        i++;
      }
      continue;
    }
    if (ch < 0x20 && ch != ' ' && ch != '\t' && ch != '\n' && ch != '\r')
      return fail(c, "the header holds the control byte 0x%02x (byte %zu of it)", ch, i);
    in_string = ch == '"';
    values += ch == '[' || ch == ',' || ch == ':'; /* every value but the first follows one of these */
  }
  if (values > VALUES_MAX)
    return fail(c, "the header holds %zu JSON values, over kiln's limit of %d", values, VALUES_MAX);
  return 0;
}

/* Parses and checks the header text[0..len) (text[len] is 0) into f. 0 or -1 with the error set. */
static int parse_header(const ctx *c, kiln_tensor_file *f, const char *text, size_t len) {
  if (len == 0 || text[0] != '{') return fail(c, "the header does not start with '{' (it must be a JSON object)");
  if (check_text(c, text, len)) return -1;
  json_setup();
  const char *end = text;
  pthread_mutex_lock(&parse_lock);
  cJSON *root = cJSON_ParseWithLengthOpts(text, len + 1, &end, true);
  pthread_mutex_unlock(&parse_lock);
  if (!root) /* cJSON does not tell the two apart */
    return fail(c, "the header is not valid JSON: it breaks off at byte %td (or memory ran out)", end - text);
  int rc = cJSON_IsObject(root) ? take_header(c, f, root) : fail(c, "the header is %s, not a JSON object", json_kind(root));
  cJSON_Delete(root);
  return rc;
}

/* Opens path and checks it whole (header and the extent of the data). */
static kiln_tensor_file *file_open(const ctx *c) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  fail(c, "this host is big-endian; the format is little-endian, and kiln does not convert");
  return NULL;
#endif
  kiln_tensor_file *f = alloc_calloc(1, sizeof *f);
  if (!f) return oom(c), NULL;
  f->fd = -1;
  char *text = NULL;
  size_t plen = strlen(c->path) + 1;
  if (!(f->path = alloc_malloc(plen))) goto nomem;
  memcpy(f->path, c->path, plen);
  struct stat st;
  /* O_NONBLOCK: opening a FIFO would otherwise wait for a writer (reads of a regular file ignore it) */
  if ((f->fd = open(c->path, O_RDONLY | O_CLOEXEC | O_NONBLOCK)) < 0 || fstat(f->fd, &st)) {
    fail(c, "cannot open: %s", strerror(errno));
    goto bad;
  }
  if (!S_ISREG(st.st_mode)) {
    fail(c, "not a regular file");
    goto bad;
  }
  uint64_t size = (uint64_t)st.st_size;
  unsigned char len8[8];
  if (size < 8) {
    fail(c, "the file is %" PRIu64 " bytes, too short for the 8-byte header length", size);
    goto bad;
  }
  int rc = read_at(f->fd, len8, 8, 0);
  if (rc) {
    fail(c, "cannot read: %s", rc < 0 ? "the file ended early" : strerror(rc));
    goto bad;
  }
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = hlen << 8 | len8[i];
  if (hlen > HEADER_MAX) {
    fail(c, "the header length is %" PRIu64 " bytes, over the format's limit of %d (not a safetensors file?)", hlen,
         HEADER_MAX);
    goto bad;
  }
  if (hlen > size - 8) {
    fail(c, "the header length is %" PRIu64 " bytes, but the file has %" PRIu64 " after the length (truncated?)", hlen,
         size - 8);
    goto bad;
  }
  f->data_at = 8 + hlen;
  f->data_len = size - 8 - hlen;
  if (!(text = alloc_malloc(hlen + 1))) goto nomem;
  text[hlen] = 0;
  if ((rc = read_at(f->fd, text, hlen, 8))) {
    fail(c, "cannot read the header: %s", rc < 0 ? "the file ended early" : strerror(rc));
    goto bad;
  }
  if (parse_header(c, f, text, hlen)) goto bad;
  alloc_free(text);
  return f;
nomem:
  oom(c);
bad:
  alloc_free(text);
  file_free(f);
  return NULL;
}

static const st_entry *find(const kiln_tensor_file *f, const char *name) {
  int lo = 0, hi = f->n - 1;
  while (lo <= hi) {
    int mid = lo + (hi - lo) / 2, cmp = strcmp(f->by_name[mid]->name, name);
    if (!cmp) return f->by_name[mid];
    if (cmp < 0) lo = mid + 1;
    else hi = mid - 1;
  }
  return NULL;
}

/* The entry called name, or NULL with an error that lists a few names the file holds. */
static const st_entry *find_or_fail(const ctx *c, const kiln_tensor_file *f, const char *name) {
  const st_entry *e = find(f, name);
  if (e) return e;
  char list[600] = "";
  int len = 0;
  for (int i = 0; i < f->n && i < SHOWN_NAMES && len < (int)sizeof list; i++) {
    shown s;
    len += snprintf(list + len, sizeof list - (size_t)len, "%s%s", i ? ", " : "", show(&s, f->e[i].name));
  }
  if (f->n > SHOWN_NAMES && len < (int)sizeof list)
    snprintf(list + len, sizeof list - (size_t)len, " and %d more", f->n - SHOWN_NAMES);
  shown s;
  if (f->n == 0) fail(c, "tensor %s is not in the file, which holds no tensors", show(&s, name));
  else fail(c, "tensor %s is not in the file, which holds %s", show(&s, name), list);
  return NULL;
}

/* Whether kiln can make e as a tensor; -1 with the error set when not. */
static int check_loadable(const ctx *c, const st_entry *e) {
  shown s;
  char list[64];
  if (e->dt->kiln < 0)
    return fail(c, "tensor %s is %s, a dtype kiln does not have (it loads %s)", show(&s, e->name), e->dt->name,
                loadable_list(list, sizeof list));
  if (e->ndim > MAXD)
    return fail(c, "tensor %s has %d dims; kiln tensors have at most %d", show(&s, e->name), e->ndim, MAXD);
  return 0;
}

/* Reads e's bytes into dst (its size). 0 or -1 with the error set. */
static int read_entry(const ctx *c, const kiln_tensor_file *f, const st_entry *e, void *dst) {
  size_t n = (size_t)(e->end - e->begin);
  int rc = read_at(f->fd, dst, n, f->data_at + e->begin);
  if (rc) {
    shown s;
    return fail(c, "cannot read tensor %s: %s", show(&s, e->name),
                rc < 0 ? "the file ended early (was it changed after it was opened?)" : strerror(rc));
  }
  /* a bool is 0 or 1; any other byte would be undefined behaviour as a C bool */
  if (e->dt->kiln == KILN_BOOL)
    for (size_t i = 0; i < n; i++) ((unsigned char *)dst)[i] = ((unsigned char *)dst)[i] != 0;
  return 0;
}

/* A new tensor (owned by the caller, not a scope) holding e. */
static kiln_tensor *load_entry(const ctx *c, const kiln_tensor_file *f, const st_entry *e) {
  if (check_loadable(c, e)) return NULL;
  kiln_tensor *t = tensor_new((kiln_dtype)e->dt->kiln, e->ndim, e->shape);
  if (!t) return oom(c), NULL;
  if (read_entry(c, f, e, t->st->data)) {
    kiln_release(t);
    return NULL;
  }
  return t;
}

/* Hands t[0..n) to the innermost scope; on failure releases the rest and
 * sets the error (those already handed over go with the scope). */
static int adopt_all(const ctx *c, kiln_tensor **t, int n) {
  for (int i = 0; i < n; i++)
    if (!scope_adopt(t[i])) {
      for (int j = i + 1; j < n; j++) kiln_release(t[j]);
      return oom(c);
    }
  return 0;
}

/* ---- the public API: a file handle ---- */

kiln_tensor_file *kiln_tensors_open_at(const char *path, const char *file, int line) {
  if (!path) return err_set(file, line, "tensors_open", "path is NULL");
  ctx c = {"tensors_open", path, file, line};
  return file_open(&c);
}

int kiln_tensors_count(const kiln_tensor_file *f) {
  if (!f) return err_set("", 0, "tensors_count", "file is NULL"), -1;
  return f->n;
}

int kiln_tensors_info_at(const kiln_tensor_file *f, int i, kiln_tensor_info *info, const char *file, int line) {
  if (!f) return err_set(file, line, "tensors_info", "file is NULL"), -1;
  if (!info) return err_set(file, line, "tensors_info", "info is NULL"), -1;
  if (i < 0 || i >= f->n)
    return err_set(file, line, "tensors_info", "%s: index %d is outside 0..%d", f->path, i, f->n - 1), -1;
  const st_entry *e = &f->e[i];
  *info = (kiln_tensor_info){.name = e->name,
                             .dtype = e->dt->name,
                             .loadable = e->dt->kiln >= 0 && e->ndim <= MAXD,
                             .type = e->dt->kiln >= 0 ? (kiln_dtype)e->dt->kiln : KILN_F32,
                             .ndim = e->ndim,
                             .shape = e->shape,
                             .offset = (int64_t)(f->data_at + e->begin),
                             .nbytes = (int64_t)(e->end - e->begin)};
  return 0;
}

int kiln_tensors_find(const kiln_tensor_file *f, const char *name) {
  const st_entry *e = f && name ? find(f, name) : NULL;
  return e ? (int)(e - f->e) : -1;
}

const char *kiln_tensors_metadata(const kiln_tensor_file *f, const char *key) {
  if (!f || !key) return NULL;
  st_meta want = {key, NULL};
  const st_meta *m = bsearch(&want, f->meta, (size_t)f->n_meta, sizeof *f->meta, by_key);
  return m ? m->value : NULL;
}

kiln_tensor *kiln_tensors_get_at(kiln_tensor_file *f, const char *name, const char *file, int line) {
  if (!f) return err_set(file, line, "tensors_get", "file is NULL");
  if (!name) return err_set(file, line, "tensors_get", "name is NULL");
  ctx c = {"tensors_get", f->path, file, line};
  const st_entry *e = find_or_fail(&c, f, name);
  kiln_tensor *t = e ? load_entry(&c, f, e) : NULL;
  return t && !adopt_all(&c, &t, 1) ? t : NULL;
}

void kiln_tensors_close(kiln_tensor_file *f) { file_free(f); }

/* ---- the public API: whole files ---- */

static int check_names(const ctx *c, int n, const char *const *names, const void *tensors, const char *what) {
  if (n < 0) return fail(c, "n is negative (%d)", n);
  if (n > 0 && !names) return fail(c, "names is NULL");
  if (n > 0 && !tensors) return fail(c, "%s is NULL", what);
  for (int i = 0; i < n; i++)
    if (!names[i]) return fail(c, "names[%d] is NULL", i);
  return 0;
}

int kiln_load_tensors_at(const char *path, int n, const char *const *names, kiln_tensor **out, const char *file,
                         int line) {
  if (!path) return err_set(file, line, "load_tensors", "path is NULL"), -1;
  ctx c = {"load_tensors", path, file, line};
  if (check_names(&c, n, names, out, "out")) return -1;
  for (int i = 0; i < n; i++) out[i] = NULL;
  kiln_tensor_file *f = file_open(&c);
  if (!f) return -1;
  int rc = -1, made = 0;
  /* every name is checked before any memory is taken for the data */
  for (int i = 0; i < n; i++) {
    const st_entry *e = find_or_fail(&c, f, names[i]);
    if (!e || check_loadable(&c, e)) goto done;
  }
  for (; made < n; made++)
    if (!(out[made] = load_entry(&c, f, find(f, names[made])))) goto done;
  rc = adopt_all(&c, out, n);
  made = 0; /* the scope has them now, or adopt_all released them */
done:
  for (int i = 0; i < made; i++) kiln_release(out[i]);
  if (rc)
    for (int i = 0; i < n; i++) out[i] = NULL;
  file_free(f);
  return rc;
}

int kiln_load_tensors_into_at(const char *path, int n, const char *const *names, kiln_tensor *const *dst,
                              const char *file, int line) {
  if (!path) return err_set(file, line, "load_tensors_into", "path is NULL"), -1;
  ctx c = {"load_tensors_into", path, file, line};
  if (check_names(&c, n, names, dst, "dst")) return -1;
  for (int i = 0; i < n; i++) {
    if (!dst[i]) return err_null(file, line, "load_tensors_into", "dst[%d]", i), -1;
    if (tensor_check_live(dst[i], "dst", "load_tensors_into", file, line)) return -1;
  }
  /* a write the tracer does not see would not be in the graph */
  if (dispatch_hooks())
    return fail(&c, "cannot load into tensors inside a function being traced (load before kiln_compile or kiln_call)");
  kiln_tensor_file *f = file_open(&c);
  if (!f) return -1;
  int rc = -1;
  /* every entry is checked against its destination before any is written */
  for (int i = 0; i < n; i++) {
    const st_entry *e = find_or_fail(&c, f, names[i]);
    if (!e || check_loadable(&c, e)) goto done;
    const kiln_tensor *d = dst[i];
    char b0[SHAPE_BUF], b1[SHAPE_BUF];
    shown s;
    if ((int)d->dtype != e->dt->kiln || d->ndim != e->ndim ||
        memcmp(d->shape, e->shape, sizeof(int64_t) * (size_t)e->ndim)) {
      fail(&c, "tensor %s is %s%s in the file, but dst[%d] is %s%s", show(&s, e->name), e->dt->name,
           err_shape(b0, e->ndim, e->shape), i, kiln_dtype_name(d->dtype), err_shape(b1, d->ndim, d->shape));
      goto done;
    }
    for (int k = 0; k < d->ndim; k++)
      if (d->shape[k] > 1 && d->stride[k] == 0) {
        fail(&c, "dst[%d] %s has repeated elements (an expanded view)", i, err_shape(b0, d->ndim, d->shape));
        goto done;
      }
  }
  for (int i = 0; i < n; i++) {
    const st_entry *e = find(f, names[i]);
    kiln_tensor *d = dst[i];
    if (e->end == e->begin) continue;
    if (tensor_contiguous(d)) {
      if (read_entry(&c, f, e, tensor_data(d))) goto done;
    } else {
      kiln_tensor *t = load_entry(&c, f, e);
      if (!t) goto done;
      pw_copy(d, t);
      kiln_release(t);
    }
    atomic_fetch_add(&d->st->version, 1); /* autograd refuses a backward through the old values */
  }
  rc = 0;
done:
  file_free(f);
  return rc;
}

/* Writes t's elements row-major: straight from its storage when it is
 * contiguous, else through a buffer of about 4 MiB, a block of rows of dim 0
 * at a time. 0 or -1 with the error set. */
static int write_tensor(const ctx *c, int fd, const kiln_tensor *t) {
  size_t esize = kiln_dtype_size(t->dtype), bytes = (size_t)kiln_numel(t) * esize;
  int rc;
  if (bytes == 0) return 0;
  if (tensor_contiguous(t)) {
    if ((rc = write_all(fd, tensor_data(t), bytes))) return fail(c, "cannot write: %s", strerror(rc));
    return 0;
  }
  size_t row = bytes / (size_t)t->shape[0];
  int64_t rows = (int64_t)(((size_t)4 << 20) / row);
  if (rows < 1) rows = 1;
  if (rows > t->shape[0]) rows = t->shape[0];
  void *buf = alloc_malloc((size_t)rows * row);
  if (!buf) return oom(c);
  for (int64_t r = 0; r < t->shape[0]; r += rows) {
    kiln_tensor src = tensor_header(t);
    src.shape[0] = rows < t->shape[0] - r ? rows : t->shape[0] - r;
    src.offset += r * t->stride[0];
    storage st = {.data = buf, .bytes = (size_t)src.shape[0] * row};
    kiln_tensor out = {.dtype = t->dtype, .ndim = t->ndim, .st = &st};
    memcpy(out.shape, src.shape, sizeof out.shape);
    contiguous_strides(out.ndim, out.shape, out.stride);
    pw_copy(&out, &src);
    if ((rc = write_all(fd, buf, st.bytes))) {
      alloc_free(buf);
      return fail(c, "cannot write: %s", strerror(rc));
    }
  }
  alloc_free(buf);
  return 0;
}

static int by_name_str(const void *pa, const void *pb) {
  return strcmp(**(const char *const *const *)pa, **(const char *const *const *)pb);
}

/* Checks the caller's names, tensors and metadata; fills order with the
 * order of the data (larger elements first, as the reference writer does, so
 * that every tensor is aligned to its element size in the file). */
static int check_save(const ctx *c, int n, const char *const *names, kiln_tensor *const *t, const char *const *meta,
                      int *order) {
  shown s;
  for (int i = 0; i < n; i++) {
    if (!names[i][0]) return fail(c, "names[%d] is empty", i);
    if (!utf8_valid(names[i])) return fail(c, "names[%d] (%s) is not valid UTF-8", i, show(&s, names[i]));
    if (!strcmp(names[i], "__metadata__")) return fail(c, "names[%d] is \"__metadata__\", a key the format keeps for metadata", i);
    if (!t[i]) return err_null(c->file, c->line, c->op, "tensors[%d]", i), -1;
    if (tensor_check_live(t[i], "tensor", c->op, c->file, c->line)) return -1;
    if (!dtype_of(t[i]->dtype)) return fail(c, "tensors[%d] is %s, which has no safetensors name", i, kiln_dtype_name(t[i]->dtype));
  }
  for (int i = 0; meta && meta[i]; i += 2) {
    if (!meta[i + 1]) return fail(c, "metadata key %s has no value (NULL)", show(&s, meta[i]));
    if (!utf8_valid(meta[i]) || !utf8_valid(meta[i + 1]))
      return fail(c, "metadata %s is not valid UTF-8", show(&s, utf8_valid(meta[i]) ? meta[i + 1] : meta[i]));
    for (int j = 0; j < i; j += 2)
      if (!strcmp(meta[i], meta[j])) return fail(c, "metadata key %s is given twice", show(&s, meta[i]));
  }
  /* duplicates: sort pointers to the names */
  const char *const **p = alloc_malloc(sizeof *p * (size_t)(n ? n : 1));
  if (!p) return oom(c);
  for (int i = 0; i < n; i++) p[i] = &names[i];
  qsort(p, (size_t)n, sizeof *p, by_name_str);
  for (int i = 1; i < n; i++)
    if (!strcmp(*p[i - 1], *p[i])) {
      int a = (int)(p[i - 1] - names), b = (int)(p[i] - names);
      fail(c, "names[%d] and names[%d] are both %s", a < b ? a : b, a < b ? b : a, show(&s, *p[i]));
      alloc_free(p);
      return -1;
    }
  alloc_free(p);
  /* a stable sort by element size, largest first (n is small: insertion sort) */
  for (int i = 0; i < n; i++) {
    int j = i;
    for (; j > 0 && kiln_dtype_size(t[order[j - 1]]->dtype) < kiln_dtype_size(t[i]->dtype); j--) order[j] = order[j - 1];
    order[j] = i;
  }
  return 0;
}

/* The header for tensors in the given order: 8 bytes of length, the JSON,
 * spaces up to a multiple of 8. An alloc_malloc'ed buffer, or NULL with the
 * error set. */
static char *make_header(const ctx *c, int n, const char *const *names, kiln_tensor *const *t, const char *const *meta,
                         const int *order, size_t *size) {
  json_setup();
  cJSON *root = cJSON_CreateObject(), *m = NULL;
  bool ok = root != NULL;
  if (meta && meta[0]) {
    ok = ok && json_add(root, "__metadata__", m = cJSON_CreateObject());
    for (int i = 0; ok && meta[i]; i += 2) ok = json_add(m, meta[i], cJSON_CreateString(meta[i + 1]));
  }
  /* json_add takes its item even when it fails, and a failure stops what follows */
  uint64_t at = 0;
  for (int k = 0; ok && k < n; k++) {
    const kiln_tensor *x = t[order[k]];
    uint64_t bytes = (uint64_t)kiln_numel(x) * kiln_dtype_size(x->dtype);
    cJSON *e = NULL, *shape = NULL, *off = NULL;
    ok = json_add(root, names[order[k]], e = cJSON_CreateObject()) &&
         json_add(e, "dtype", cJSON_CreateString(dtype_of(x->dtype)->name)) &&
         json_add(e, "shape", shape = cJSON_CreateArray()) && json_add(e, "data_offsets", off = cJSON_CreateArray());
    for (int d = 0; ok && d < x->ndim; d++) ok = json_add(shape, NULL, json_int((uint64_t)x->shape[d]));
    ok = ok && json_add(off, NULL, json_int(at)) && json_add(off, NULL, json_int(at + bytes));
    at += bytes;
  }
  char *js = ok ? cJSON_PrintUnformatted(root) : NULL, *buf = NULL;
  cJSON_Delete(root);
  size_t len = js ? strlen(js) : 0, padded = (len + 7) & ~(size_t)7;
  if (js && padded > HEADER_MAX) {
    fail(c, "the header would be %zu bytes, over the format's limit of %d", padded, HEADER_MAX);
  } else if (!js || !(buf = alloc_malloc(8 + padded))) {
    oom(c);
  } else {
    memcpy(buf + 8, js, len);
    memset(buf + 8 + len, ' ', padded - len);
    for (int i = 0; i < 8; i++) buf[i] = (char)(unsigned char)((uint64_t)padded >> (8 * i));
    *size = 8 + padded;
  }
  cJSON_free(js);
  return buf;
}

int kiln_save_tensors_meta_at(const char *path, int n, const char *const *names, kiln_tensor *const *tensors,
                              const char *const *meta, const char *file, int line) {
  if (!path) return err_set(file, line, "save_tensors", "path is NULL"), -1;
  ctx c = {"save_tensors", path, file, line};
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  return fail(&c, "this host is big-endian; the format is little-endian, and kiln does not convert");
#endif
  if (check_names(&c, n, names, tensors, "tensors")) return -1;
  int *order = alloc_malloc(sizeof *order * (size_t)(n ? n : 1));
  if (!order) return oom(&c);
  int rc = -1, fd = -1;
  bool made = false; /* the temporary file exists */
  char *header = NULL, *tmp = NULL;
  size_t hsize = 0;
  if (check_save(&c, n, names, tensors, meta, order)) goto done;
  for (int i = 0; i < n; i++) hook_read("kiln_save_tensors", tensors[i], file, line);
  if (!(header = make_header(&c, n, names, tensors, meta, order, &hsize))) goto done;
  /* written beside path, then renamed over it: a reader sees the old file or the new one, whole */
  static atomic_uint serial;
  size_t tlen = strlen(path) + 48;
  if (!(tmp = alloc_malloc(tlen))) {
    oom(&c);
    goto done;
  }
  snprintf(tmp, tlen, "%s.tmp.%ld.%u", path, (long)getpid(), atomic_fetch_add(&serial, 1));
  if ((fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666)) < 0) {
    fail(&c, "cannot write: %s", strerror(errno));
    goto done;
  }
  made = true;
  int err = write_all(fd, header, hsize);
  if (err) {
    fail(&c, "cannot write: %s", strerror(err));
    goto done;
  }
  for (int k = 0; k < n; k++)
    if (write_tensor(&c, fd, tensors[order[k]])) goto done;
  err = close(fd) ? errno : 0;
  fd = -1;
  if (err || rename(tmp, path)) {
    fail(&c, "cannot write: %s", strerror(err ? err : errno));
    goto done;
  }
  made = false;
  rc = 0;
done:
  if (fd >= 0) close(fd);
  if (made) unlink(tmp);
  alloc_free(tmp);
  alloc_free(header);
  alloc_free(order);
  return rc;
}

int kiln_save_tensors_at(const char *path, int n, const char *const *names, kiln_tensor *const *tensors,
                         const char *file, int line) {
  return kiln_save_tensors_meta_at(path, n, names, tensors, NULL, file, line);
}
