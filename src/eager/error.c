/* Errors: a thread-local message that names the caller's file:line and the op,
 * in the form "mlp.c:42: kiln_matmul: shapes [32,100] and [784,10] ...". */
#include <stdarg.h>
#include <string.h>

#include "eager/eager.h"

static _Thread_local char msg[1024];
static KILN_TLS_HOT unsigned long n_set; /* errors set on this thread */

unsigned long err_count(void) { return n_set; }

/* Why the last eager kernel on this thread failed, when not out of memory
 * (a collective that MPI refused): kernels have no caller's line to name. */
static _Thread_local char kernel_why[256];

void err_kernel_why(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(kernel_why, sizeof kernel_why, fmt, ap);
  va_end(ap);
}

const char *err_kernel_failed(void) {
  static _Thread_local char taken[256];
  snprintf(taken, sizeof taken, "%s", kernel_why[0] ? kernel_why : "out of memory");
  kernel_why[0] = 0;
  return taken;
}

static const char *base_name(const char *path) {
  /* Keep the path as the user's compiler gave it, minus a leading "./". */
  if (path && path[0] == '.' && path[1] == '/') return path + 2;
  return path ? path : "?";
}

void *err_set(const char *file, int line, const char *op, const char *fmt, ...) {
  n_set++;
  /* no location for errors that have no caller (a loaded graph's own nodes) */
  int n = file && *file ? snprintf(msg, sizeof msg, "%s:%d: kiln_%s: ", base_name(file), line, op)
                        : snprintf(msg, sizeof msg, "kiln_%s: ", op);
  if (n < 0 || n >= (int)sizeof msg) return NULL;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg + n, sizeof msg - (size_t)n, fmt, ap);
  va_end(ap);
  return NULL;
}

/* Sets the message to text, an error message made earlier (kept while other
 * errors came after it). */
void err_restore(const char *text) {
  n_set++;
  snprintf(msg, sizeof msg, "%s", text);
}

const char *err_shape(char *buf, int ndim, const int64_t *shape) {
  int n = snprintf(buf, SHAPE_BUF, "[");
  for (int i = 0; i < ndim && n < SHAPE_BUF - 24; i++)
    n += snprintf(buf + n, (size_t)(SHAPE_BUF - n), i ? ",%lld" : "%lld", (long long)shape[i]);
  snprintf(buf + n, (size_t)(SHAPE_BUF - n), "]");
  return buf;
}

void *err_null(const char *file, int line, const char *op, const char *fmt, ...) {
  /* NULL usually means an earlier op failed: keep that op's message, it is the useful one */
  if (msg[0]) return NULL;
  char what[128];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  return err_set(file, line, op, "%s is NULL", what);
}

void err_locate(const char *file, int line) {
  if (!file || !*file || strncmp(msg, "kiln_", 5) != 0) return;
  char pre[256];
  int n = snprintf(pre, sizeof pre, "%s:%d: ", base_name(file), line);
  if (n <= 0 || n >= (int)sizeof pre) return;
  size_t len = strlen(msg);
  if (len + (size_t)n >= sizeof msg) len = sizeof msg - 1 - (size_t)n;
  memmove(msg + n, msg, len);
  msg[(size_t)n + len] = 0;
  memcpy(msg, pre, (size_t)n);
}

const char *kiln_last_error(void) { return msg; }
void kiln_clear_error(void) { msg[0] = 0; }


/* The KILN_VERSION_STRING of the kiln.h the library was compiled with. */
const char *kiln_version(void) { return KILN_VERSION_STRING; }
