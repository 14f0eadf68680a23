/* Fuzzing safetensors files (src/eager/safetensors.c): the input is a whole
 * file. kiln_tensors_open accepts it or refuses it with a message that names
 * kiln_tensors_open and the file, and never crashes, leaks or reads outside
 * the file. For a file it accepts, what it reports must be the file:
 *   - the entries, in the order of their data, cover the data exactly, and
 *     each one's byte count is its element count times its dtype's size
 *     (the sizes here are this file's own table, not kiln's);
 *   - every loadable entry loads with exactly the bytes at its offset (a
 *     bool byte as 0 or 1), and kiln_load_tensors of them all agrees;
 *   - saved again and reopened, the entries come back with the same names,
 *     dtypes, shapes and bytes.
 * Then the file is opened once more with one allocation failing (which one
 * is chosen by the input's hash, so an input replays alike): it opens or
 * fails with a message, and nothing leaks. */
#include <string.h>
#include <unistd.h>

#include "fuzz/fuzz.h"
#include "kiln.h"

int64_t alloc_fail_after(int64_t n); /* src/eager/alloc.c (test build) */

static char path[64], again[64];

static void cleanup(void) {
  unlink(path);
  unlink(again);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  snprintf(path, sizeof path, "/tmp/kiln-fuzz-st-%ld.safetensors", (long)getpid());
  snprintf(again, sizeof again, "/tmp/kiln-fuzz-st-%ld-again.safetensors", (long)getpid());
  atexit(cleanup);
  return 0;
}

/* Bits per element of the format's dtypes. */
static int dtype_bits(const char *dt) {
  static const struct {
    const char *name;
    int bits;
  } t[] = {{"BOOL", 8},     {"U8", 8},       {"I8", 8},       {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8},
           {"I16", 16},     {"U16", 16},     {"F16", 16},     {"BF16", 16},   {"I32", 32},    {"U32", 32},
           {"F32", 32},     {"F64", 64},     {"I64", 64},     {"U64", 64},    {"C64", 64},    {"F4", 4},
           {"F6_E2M3", 6},  {"F6_E3M2", 6}};
  for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
    if (!strcmp(t[i].name, dt)) return t[i].bits;
  return -1;
}

/* kiln's dtypes by the format's names (a dtype kiln gains is a case here too). */
static const char *kiln_name_of(kiln_dtype dt) {
  switch (dt) {
  case KILN_F32: return "F32";
  case KILN_F64: return "F64";
  case KILN_I64: return "I64";
  case KILN_BOOL: return "BOOL";
  case KILN_I32: return "I32";
  case KILN_F16: return "F16";
  case KILN_BF16: return "BF16";
  }
  return "?";
}

/* t's elements equal bytes[0..n), bool bytes read as 0 or 1. */
static bool same_bytes(const kiln_tensor *t, const uint8_t *bytes, int64_t n) {
  uint8_t *buf = malloc((size_t)n + 1);
  bool ok = kiln_read(t, buf, (size_t)n) == 0;
  for (int64_t i = 0; ok && i < n; i++) ok = buf[i] == (kiln_type(t) == KILN_BOOL ? bytes[i] != 0 : bytes[i]);
  free(buf);
  return ok;
}

static bool same_shape(const kiln_tensor *t, const kiln_tensor_info *in) {
  if (kiln_ndim(t) != in->ndim || kiln_type(t) != in->type) return false;
  for (int d = 0; d < in->ndim; d++)
    if (kiln_size(t, d) != in->shape[d]) return false;
  return true;
}

#define MAX_ENTRIES 64

static void check_open_file(kiln_tensor_file *f, const uint8_t *data, size_t size) {
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = hlen << 8 | data[i];
  int n = kiln_tensors_count(f);
  FUZZ_CHECK(n >= 0, "count %d", n);
  int64_t at = (int64_t)(8 + hlen);
  const char *names[MAX_ENTRIES];
  kiln_tensor *got[MAX_ENTRIES];
  kiln_tensor_info infos[MAX_ENTRIES];
  int nl = 0;
  for (int i = 0; i < n; i++) {
    kiln_tensor_info in;
    FUZZ_CHECK(kiln_tensors_info(f, i, &in) == 0, "info %d: %s", i, kiln_last_error());
    FUZZ_CHECK(in.offset == at, "entry %d starts at byte %lld of the file, not %lld", i, (long long)in.offset,
               (long long)at);
    FUZZ_CHECK(in.nbytes >= 0 && (uint64_t)in.nbytes <= size - (uint64_t)at, "entry %d: %lld bytes at %lld of %zu", i,
               (long long)in.nbytes, (long long)at, size);
    at += in.nbytes;
    FUZZ_CHECK(kiln_tensors_find(f, in.name) == i, "entry %d is not found by its name", i);
    int bits = dtype_bits(in.dtype);
    FUZZ_CHECK(bits > 0, "entry %d: dtype %s", i, in.dtype);
    unsigned __int128 count = 1;
    for (int d = 0; d < in.ndim; d++) {
      FUZZ_CHECK(in.shape[d] >= 0, "entry %d: size %lld", i, (long long)in.shape[d]);
      count = count * (unsigned __int128)in.shape[d];
      if (count > ((unsigned __int128)1 << 64)) count = ((unsigned __int128)1 << 64) + 1; /* stays above any byte count */
    }
    FUZZ_CHECK(count * (unsigned)bits == (unsigned __int128)in.nbytes * 8, "entry %d: %s shape and %lld bytes disagree", i,
               in.dtype, (long long)in.nbytes);
    FUZZ_CHECK(in.loadable == (dtype_bits(in.dtype) > 0 && strcmp(kiln_name_of(in.type), in.dtype) == 0 &&
                               in.ndim <= KILN_MAX_DIMS),
               "entry %d: loadable %d for %s rank %d", i, in.loadable, in.dtype, in.ndim);
    kiln_clear_error();
    kiln_tensor *t = kiln_tensors_get(f, in.name);
    if (!in.loadable) {
      FUZZ_CHECK(!t && strstr(kiln_last_error(), "kiln_tensors_get") && strstr(kiln_last_error(), path),
                 "entry %d (%s, rank %d) is not loadable, but get gave %p: %s", i, in.dtype, in.ndim, (void *)t,
                 kiln_last_error());
      continue;
    }
    FUZZ_CHECK(t, "get of loadable entry %d: %s", i, kiln_last_error());
    FUZZ_CHECK(same_shape(t, &in), "entry %d: the tensor's dtype or shape is not the entry's", i);
    FUZZ_CHECK(same_bytes(t, data + in.offset, in.nbytes), "entry %d: the tensor's bytes are not the file's", i);
    if (nl < MAX_ENTRIES && in.name[0]) names[nl] = in.name, infos[nl++] = in;
  }
  FUZZ_CHECK((uint64_t)at == size, "the entries end at %lld of %zu bytes", (long long)at, size);
  if (!nl) return;
  /* all at once, then saved and read again */
  FUZZ_CHECK(kiln_load_tensors(path, nl, names, got) == 0, "load_tensors: %s", kiln_last_error());
  for (int i = 0; i < nl; i++)
    FUZZ_CHECK(same_shape(got[i], &infos[i]) && same_bytes(got[i], data + infos[i].offset, infos[i].nbytes),
               "load_tensors: entry %s differs from get", names[i]);
  FUZZ_CHECK(kiln_save_tensors(again, nl, names, got) == 0, "save: %s", kiln_last_error());
  kiln_tensor_file *g = kiln_tensors_open(again);
  FUZZ_CHECK(g, "reopen: %s", kiln_last_error());
  FUZZ_CHECK(kiln_tensors_count(g) == nl, "reopened: %d entries, saved %d", kiln_tensors_count(g), nl);
  for (int i = 0; i < nl; i++) {
    kiln_tensor_info in;
    FUZZ_CHECK(kiln_tensors_info(g, kiln_tensors_find(g, names[i]), &in) == 0, "reopened: %s", kiln_last_error());
    FUZZ_CHECK(!strcmp(in.dtype, infos[i].dtype) && in.ndim == infos[i].ndim &&
                   !memcmp(in.shape, infos[i].shape, sizeof(int64_t) * (size_t)in.ndim) && in.nbytes == infos[i].nbytes,
               "reopened: entry %s changed", names[i]);
    kiln_tensor *t = kiln_tensors_get(g, names[i]);
    FUZZ_CHECK(t && same_bytes(t, data + infos[i].offset, infos[i].nbytes), "reopened: entry %s's bytes changed",
               names[i]);
  }
  kiln_tensors_close(g);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  FILE *out = fopen(path, "wb");
  if (!out) return 0;
  size_t w = fwrite(data, 1, size, out);
  if (fclose(out) || w != size) return 0;
  size_t base = kiln_mem_in_use();
  kiln_scope_begin();
  kiln_clear_error();
  kiln_tensor_file *f = kiln_tensors_open(path);
  if (f) {
    check_open_file(f, data, size);
    kiln_tensors_close(f);
  } else {
    FUZZ_CHECK(strstr(kiln_last_error(), "kiln_tensors_open: ") && strstr(kiln_last_error(), path),
               "a refusal without the function or the file: %s", kiln_last_error());
  }
  kiln_scope_end();
  FUZZ_CHECK(kiln_mem_in_use() == base, "%zu bytes of tensors left", kiln_mem_in_use() - base);

  /* the same with one allocation failing */
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < size; i++) h = (h ^ data[i]) * 16777619u;
  kiln_scope_begin();
  kiln_clear_error();
  alloc_fail_after(1 + h % 24);
  f = kiln_tensors_open(path);
  kiln_tensor *t = NULL;
  kiln_tensor_info in;
  for (int i = 0; f && i < kiln_tensors_count(f) && !t; i++)
    if (!kiln_tensors_info(f, i, &in) && in.loadable) {
      if (!(t = kiln_tensors_get(f, in.name)))
        FUZZ_CHECK(strstr(kiln_last_error(), "kiln_tensors_get"), "get failed without a message: %s", kiln_last_error());
      break;
    }
  bool fired = alloc_fail_after(0) == 0;
  if (!f) FUZZ_CHECK(strstr(kiln_last_error(), "kiln_tensors_open: "), "open failed without a message (allocation failed: %d)", fired);
  kiln_tensors_close(f);
  kiln_scope_end();
  FUZZ_CHECK(kiln_mem_in_use() == base, "%zu bytes of tensors left after a failed allocation", kiln_mem_in_use() - base);
  return 0;
}
