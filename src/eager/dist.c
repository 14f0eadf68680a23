/* Collectives over MPI_COMM_WORLD, for data-parallel training: allreduce as
 * an op (eager, traced, compiled as an eager kernel), rank and size. Built
 * with KILN_MPI; without it the same calls are errors that say so.
 *
 * MPI starts here on first use unless the program started it, with errors
 * returned rather than fatal, so that a failed collective (a peer that died)
 * becomes kiln's error on the caller's line; what kiln started it finalizes
 * at exit. docs/scaling.md. */
#include <stdlib.h>
#include <string.h>

#include "eager/eager.h"

#ifdef KILN_MPI
#include <mpi.h>
#include <pthread.h>

static pthread_once_t once = PTHREAD_ONCE_INIT;
static int start_rc; /* MPI_SUCCESS once started */

static void finalize(void) {
  int done = 0;
  MPI_Finalized(&done);
  if (!done) MPI_Finalize();
}

static void start(void) {
  int up = 0;
  MPI_Initialized(&up);
  if (!up) {
    int provided;
    /* collectives are made by whichever thread runs the op, one at a time */
    start_rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided);
    if (start_rc != MPI_SUCCESS) return;
    atexit(finalize);
  }
  start_rc = MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

static const char *mpi_why(int rc, char *buf) {
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) snprintf(buf, MPI_MAX_ERROR_STRING, "MPI error %d", rc);
  return buf;
}

/* 0 when MPI runs; else -1 and the message. */
static int ready(const char *file, int line, const char *op) {
  pthread_once(&once, start);
  if (start_rc == MPI_SUCCESS) return 0;
  char buf[MPI_MAX_ERROR_STRING];
  err_set(file, line, op, "MPI did not start: %s", mpi_why(start_rc, buf));
  return -1;
}

static int world(const char *op, int rank) {
  int v = -1;
  if (ready(NULL, 0, op)) return -1;
  int rc = rank ? MPI_Comm_rank(MPI_COMM_WORLD, &v) : MPI_Comm_size(MPI_COMM_WORLD, &v);
  if (rc != MPI_SUCCESS) {
    char buf[MPI_MAX_ERROR_STRING];
    err_set(NULL, 0, op, "%s", mpi_why(rc, buf));
    return -1;
  }
  return v;
}

int kiln_dist_rank(void) { return world("dist_rank", 1); }
int kiln_dist_size(void) { return world("dist_size", 0); }

int chk_dist(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file, int line) {
  (void)in, (void)n, (void)a;
  return ready(file, line, op_table[op].name);
}

/* Times over the process's life: wall time with collectives in flight (from
 * an issue on an empty queue to the moment the queue was seen empty again;
 * a bucket being filled is not in flight), what callers spent blocked
 * waiting for them, and how many were issued. Made by one thread at a time
 * (MPI_THREAD_SERIALIZED). */
static double in_flight_ms, blocked_ms;
static int64_t n_issued;

static double now_ms(void) { return MPI_Wtime() * 1e3; }

_Static_assert(sizeof(MPI_Request) <= sizeof(((dist_coll *)0)->req), "MPI_Request does not fit");

bool dist_overlap(void) {
  const char *v = getenv("KILN_DIST_OVERLAP");
  return !(v && !strcmp(v, "0"));
}

/* KILN_DIST_BUCKET_KB: the bucket cap in bytes, DIST_BUCKET_KB when unset; -1 when malformed or not
 * the same on every process. At most 1 GiB, so that a bucket's count fits MPI's int. */
enum { DIST_BUCKET_KB = 1024 };
static int64_t bucket_cap_bad(const char *v) {
  err_kernel_why("KILN_DIST_BUCKET_KB=%s is not a size in KiB (a whole number >= 0; 0: no buckets)", v);
  return -1;
}

static int64_t bucket_cap(void) {
  const char *v = getenv("KILN_DIST_BUCKET_KB");
  int64_t cap = (int64_t)DIST_BUCKET_KB << 10;
  if (v && *v) {
    char *end;
    long long kb = strtoll(v, &end, 10);
    /* malformed: -1 KiB, which the check below still makes with the others (they must not wait for it) */
    cap = *end || kb < 0 ? -1024 : kb > (1 << 20) ? (int64_t)1 << 30 : (int64_t)kb << 10;
  }
  /* Processes with different caps would make collectives of different sizes
   * that MPI pairs up anyway (wrong sums or a hang). The first read (the
   * first compiled allreduce, the same call on every process) is checked
   * against the others' until they agree: an environment not forwarded to
   * another machine (mpirun -x) shows there. A cap the program changes
   * later is its own to change everywhere alike. */
  static bool agreed;
  if (agreed) {
    return cap < 0 ? bucket_cap_bad(v) : cap;
  }
  long long mm[2] = {cap, -cap};
  int rc = MPI_Allreduce(MPI_IN_PLACE, mm, 2, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  if (rc != MPI_SUCCESS) {
    char buf[MPI_MAX_ERROR_STRING];
    err_kernel_why("MPI_Allreduce failed (a process stopped?): %s", mpi_why(rc, buf));
    return -1;
  }
  if (cap < 0) return bucket_cap_bad(v);
  if (mm[0] != -mm[1]) {
    err_kernel_why("KILN_DIST_BUCKET_KB differs between the processes (%lld KiB here, %lld to %lld over all, -1: "
                   "malformed): every process must use the same (mpirun -x KILN_DIST_BUCKET_KB)",
                   (long long)(cap >> 10), -mm[1] >> 10, mm[0] >> 10);
    return -1;
  }
  agreed = true;
  return cap;
}

static void coll_free(dist_coll *c) {
  alloc_free(c->stage);
  alloc_free(c->m);
  memset(c, 0, sizeof *c);
}

static MPI_Datatype mpi_type(kiln_dtype dt) {
  return dt == KILN_F32 ? MPI_FLOAT : dt == KILN_F64 ? MPI_DOUBLE : MPI_INT64_T;
}

static bool overlaps(const char *d, size_t n, const char *lo, size_t bytes) { return d < lo + bytes && lo < d + n; }

/* c's data (a member's, for a bucket) overlaps [lo, lo + bytes), or lo is NULL */
static bool touches(const dist_coll *c, const char *lo, size_t bytes) {
  if (!lo) return true;
  size_t es = kiln_dtype_size(c->dtype);
  if (!c->stage) return overlaps(c->data, (size_t)c->count * es, lo, bytes);
  if (!overlaps(c->lo, (size_t)(c->hi - c->lo), lo, bytes)) return false;
  for (int i = 0; i < c->n_m; i++)
    if (overlaps(c->m[i].dst, (size_t)c->m[i].count * es, lo, bytes)) return true;
  return false;
}

/* Entry i is done (MPI says so): the mean's division, a bucket's members
 * written back, the times; dropped from q. */
static void finish(dist_pending *q, int i, double t) {
  dist_coll *c = &q->r[i];
  if (c->mean) {
    int size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (c->dtype == KILN_F32)
      for (int64_t e = 0; e < c->count; e++) ((float *)c->data)[e] /= (float)size;
    else
      for (int64_t e = 0; e < c->count; e++) ((double *)c->data)[e] /= size;
  }
  size_t es = kiln_dtype_size(c->dtype), at = 0;
  for (int m = 0; m < c->n_m; m++) {
    memcpy(c->m[m].dst, c->stage + at, (size_t)c->m[m].count * es);
    at += (size_t)c->m[m].count * es;
  }
  coll_free(c);
  memmove(&q->r[i], &q->r[i + 1], sizeof q->r[0] * (size_t)(q->n - i - 1));
  if (--q->n == 0) in_flight_ms += t - q->since;
}

static int fail(dist_pending *q, int rc, double t) {
  char buf[MPI_MAX_ERROR_STRING];
  err_kernel_why("MPI_Iallreduce failed (a process stopped?): %s", mpi_why(rc, buf));
  /* the rest cannot be trusted either: drop them all */
  for (int i = 0; i < q->n; i++) coll_free(&q->r[i]);
  if (q->n) in_flight_ms += t - q->since;
  q->n = 0;
  coll_free(&q->open);
  return -1;
}

/* Waits for entry i; 0 or -1 */
static int wait_one(dist_pending *q, int i) {
  MPI_Request req;
  memcpy(&req, q->r[i].req, sizeof req);
  double t = now_ms();
  int rc = MPI_Wait(&req, MPI_STATUS_IGNORE);
  double t1 = now_ms();
  blocked_ms += t1 - t;
  if (rc != MPI_SUCCESS) return fail(q, rc, t1);
  finish(q, i, t1);
  return 0;
}

/* Issues c (its data ready), taking over what it holds; 0 or -1 */
static int issue(dist_pending *q, dist_coll *c) {
  if (q->n == DIST_MAX_PENDING && wait_one(q, 0)) return coll_free(c), -1;
  MPI_Request req;
  int rc = MPI_Iallreduce(MPI_IN_PLACE, c->data, (int)c->count, mpi_type(c->dtype), MPI_SUM, MPI_COMM_WORLD, &req);
  if (rc != MPI_SUCCESS) return coll_free(c), fail(q, rc, now_ms());
  n_issued++;
  memcpy(c->req, &req, sizeof req);
  if (q->n == 0) q->since = now_ms();
  q->r[q->n++] = *c;
  memset(c, 0, sizeof *c);
  return 0;
}

/* The open bucket goes as one collective */
static int flush(dist_pending *q) {
  if (!q->open.n_m) return 0;
  q->open.data = q->open.stage;
  return issue(q, &q->open);
}

/* Copies out's values into the open bucket (flushed first when out cannot join it); 0 or -1 */
static int join(dist_pending *q, kiln_tensor *out, int64_t count, bool mean) {
  dist_coll *b = &q->open;
  size_t es = kiln_dtype_size(out->dtype), have = (size_t)b->count * es, bytes = (size_t)count * es;
  if (b->n_m && (b->dtype != out->dtype || b->mean != mean || have + bytes > (size_t)q->cap)) {
    if (flush(q)) return -1;
    have = 0;
  }
  if (have + bytes > b->stage_cap) {
    /* grows by doubling up to the cap: a small model's bucket stays small */
    size_t want = b->stage_cap ? 2 * b->stage_cap : 4096;
    while (want < have + bytes) want *= 2;
    if (want > (size_t)q->cap) want = (size_t)q->cap;
    char *s = alloc_realloc(b->stage, want);
    if (!s) return err_kernel_why("out of memory for an allreduce bucket of %zu bytes", want), -1;
    b->stage = s, b->stage_cap = want;
  }
  if (b->n_m == b->cap_m) {
    int nc = b->cap_m ? 2 * b->cap_m : 16;
    dist_member *m = alloc_realloc(b->m, sizeof *m * (size_t)nc);
    if (!m) return err_kernel_why("out of memory for an allreduce bucket"), -1;
    b->m = m, b->cap_m = nc;
  }
  char *d = tensor_data(out);
  memcpy(b->stage + have, d, bytes);
  b->m[b->n_m++] = (dist_member){d, count};
  if (b->n_m == 1 || d < b->lo) b->lo = d;
  if (b->n_m == 1 || d + bytes > b->hi) b->hi = d + bytes;
  b->count += count, b->dtype = out->dtype, b->mean = mean;
  return 0;
}

int dist_start(dist_pending *q, kiln_tensor *out, bool mean, bool last) {
  int64_t count = shape_numel(out->ndim, out->shape);
  size_t esize = kiln_dtype_size(out->dtype);
  if (q->cap < 0 && (q->cap = bucket_cap()) < 0) return -1;
  if (q->cap > 0 && count > 0 && (size_t)count * esize <= (size_t)q->cap) {
    if (join(q, out, count, mean)) return -1;
    return (size_t)q->open.count * esize == (size_t)q->cap || last ? flush(q) : 0;
  }
  /* alone, in place; after the open bucket, so that they go in the order made */
  if (flush(q)) return -1;
  char *data = tensor_data(out);
  /* MPI counts are int: a large tensor goes in pieces */
  const int64_t piece = (int64_t)1 << 30;
  for (int64_t at = 0; at < count || (count == 0 && at == 0); at += piece) {
    dist_coll c = {.data = data + at * (int64_t)esize,
                   .count = count - at < piece ? count - at : piece,
                   .dtype = out->dtype,
                   .mean = mean};
    if (issue(q, &c)) return -1;
    if (count == 0) break;
  }
  return 0;
}

void dist_poll(dist_pending *q) {
  for (int i = 0; i < q->n;) {
    MPI_Request req;
    int done = 0;
    memcpy(&req, q->r[i].req, sizeof req);
    if (MPI_Test(&req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return; /* dist_wait reports it */
    memcpy(q->r[i].req, &req, sizeof req);
    if (done) finish(q, i, now_ms());
    else i++;
  }
}

int dist_wait(dist_pending *q, const char *lo, size_t bytes) {
  if (q->open.n_m && touches(&q->open, lo, bytes) && flush(q)) return -1;
  /* in the order issued: the collectives complete in that order anyway */
  for (int i = 0; i < q->n;) {
    if (!touches(&q->r[i], lo, bytes)) i++;
    else if (wait_one(q, i)) return -1;
  }
  return 0;
}

void dist_end(dist_pending *q) {
  coll_free(&q->open);
  while (q->n && wait_one(q, 0) == 0) {
  }
}

void kiln_dist_times(double *in_flight, double *blocked) {
  if (in_flight) *in_flight = in_flight_ms;
  if (blocked) *blocked = blocked_ms;
}

int64_t kiln_dist_collectives(void) { return n_issued; }

int k_allreduce(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op, (void)n;
  if (!tensor_contiguous(out)) {
    err_kernel_why("the result's buffer is not contiguous");
    return -1;
  }
  pw_copy(out, in[0]);
  dist_pending q = {0};
  return dist_start(&q, out, a->flag, true) || dist_wait(&q, NULL, 0) ? -1 : 0;
}

#else /* no MPI: the calls say so */

static const char NO_MPI[] = "kiln was built without MPI (the CMake option KILN_MPI; docs/scaling.md)";

int kiln_dist_rank(void) { return err_set(NULL, 0, "dist_rank", NO_MPI), -1; }
int kiln_dist_size(void) { return err_set(NULL, 0, "dist_size", NO_MPI), -1; }

int chk_dist(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, const char *file, int line) {
  (void)in, (void)n, (void)a;
  err_set(file, line, op_table[op].name, NO_MPI);
  return -1;
}

int k_allreduce(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op, (void)in, (void)n, (void)a, (void)out;
  err_kernel_why(NO_MPI);
  return -1;
}

bool dist_overlap(void) { return false; }
int dist_start(dist_pending *q, kiln_tensor *out, bool mean, bool last) {
  (void)q, (void)out, (void)mean, (void)last;
  err_kernel_why(NO_MPI);
  return -1;
}
int dist_wait(dist_pending *q, const char *lo, size_t bytes) {
  (void)lo, (void)bytes;
  q->n = 0;
  return 0;
}
void dist_poll(dist_pending *q) { (void)q; }
void dist_end(dist_pending *q) { q->n = 0; }
int64_t kiln_dist_collectives(void) { return 0; }
void kiln_dist_times(double *in_flight, double *blocked) {
  if (in_flight) *in_flight = 0;
  if (blocked) *blocked = 0;
}

#endif

/* ---- the public entry points ------------------------------------------- */

kiln_tensor *kiln_allreduce_at(kiln_tensor *t, kiln_reduce_op op, const char *file, int line) {
  if (tensor_bad_arg(t, file, line, "allreduce", "input")) return NULL;
  if (op != KILN_REDUCE_SUM && op != KILN_REDUCE_MEAN)
    return err_set(file, line, "allreduce", "op %d is neither KILN_REDUCE_SUM nor KILN_REDUCE_MEAN", (int)op);
  if (op == KILN_REDUCE_MEAN && !dtype_is_float(t->dtype))
    return err_set(file, line, "allreduce", "KILN_REDUCE_MEAN of %s: a mean needs a float type",
                   kiln_dtype_name(t->dtype));
  op_attrs a = {.flag = op == KILN_REDUCE_MEAN};
  return op_dispatch(OP_ALLREDUCE, &t, 1, &a, file, line);
}

kiln_tensor *kiln_allreduce__at(kiln_tensor *t, kiln_reduce_op op, const char *file, int line) {
  kiln_scope_begin();
  kiln_tensor *r = kiln_allreduce_at(t, op, file, line);
  r = r ? kiln_copy__at(t, r, file, line) : NULL;
  kiln_scope_end();
  return r;
}
