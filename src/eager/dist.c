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
 * a start on an empty queue to the moment the queue was seen empty again),
 * and what callers spent blocked waiting for them. Made by one thread at a
 * time (MPI_THREAD_SERIALIZED). */
static double in_flight_ms, blocked_ms;

static double now_ms(void) { return MPI_Wtime() * 1e3; }

_Static_assert(sizeof(MPI_Request) <= sizeof(((dist_pending *)0)->r[0].req), "MPI_Request does not fit");

bool dist_overlap(void) {
  const char *v = getenv("KILN_DIST_OVERLAP");
  return !(v && !strcmp(v, "0"));
}

int dist_start(dist_pending *q, kiln_tensor *out, bool mean) {
  int64_t count = shape_numel(out->ndim, out->shape);
  MPI_Datatype type = out->dtype == KILN_F32 ? MPI_FLOAT : out->dtype == KILN_F64 ? MPI_DOUBLE : MPI_INT64_T;
  size_t esize = kiln_dtype_size(out->dtype);
  char *data = tensor_data(out);
  /* MPI counts are int: a large tensor goes in pieces */
  const int64_t piece = (int64_t)1 << 30;
  for (int64_t at = 0; at < count || (count == 0 && at == 0); at += piece) {
    if (q->n == DIST_MAX_PENDING && dist_wait(q, q->r[0].data, 1)) return -1;
    int c = (int)(count - at < piece ? count - at : piece);
    MPI_Request req;
    int rc = MPI_Iallreduce(MPI_IN_PLACE, data + at * (int64_t)esize, c, type, MPI_SUM, MPI_COMM_WORLD, &req);
    if (rc != MPI_SUCCESS) {
      char buf[MPI_MAX_ERROR_STRING];
      err_kernel_why("MPI_Iallreduce failed (a process stopped?): %s", mpi_why(rc, buf));
      return -1;
    }
    q->r[q->n].data = data + at * (int64_t)esize;
    q->r[q->n].count = c;
    q->r[q->n].dtype = out->dtype;
    q->r[q->n].mean = mean;
    if (q->n == 0) q->since = now_ms();
    memcpy(q->r[q->n].req, &req, sizeof req);
    q->n++;
    if (count == 0) break;
  }
  return 0;
}

/* Entry i is done (MPI says so): the mean's division, the times; dropped from q. */
static void finish(dist_pending *q, int i, double t) {
  if (q->r[i].mean) {
    int size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (q->r[i].dtype == KILN_F32)
      for (int64_t e = 0; e < q->r[i].count; e++) ((float *)q->r[i].data)[e] /= (float)size;
    else
      for (int64_t e = 0; e < q->r[i].count; e++) ((double *)q->r[i].data)[e] /= size;
  }
  memmove(&q->r[i], &q->r[i + 1], sizeof q->r[0] * (size_t)(q->n - i - 1));
  if (--q->n == 0) in_flight_ms += t - q->since;
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
  /* in the order started: the collectives complete in that order anyway */
  for (int i = 0; i < q->n;) {
    const char *d = q->r[i].data;
    size_t n = (size_t)q->r[i].count * kiln_dtype_size(q->r[i].dtype);
    if (lo && !(d < lo + bytes && lo < d + n)) {
      i++;
      continue;
    }
    MPI_Request req;
    memcpy(&req, q->r[i].req, sizeof req);
    double t = now_ms();
    int rc = MPI_Wait(&req, MPI_STATUS_IGNORE);
    double t1 = now_ms();
    blocked_ms += t1 - t;
    if (rc != MPI_SUCCESS) {
      char buf[MPI_MAX_ERROR_STRING];
      err_kernel_why("MPI_Iallreduce failed (a process stopped?): %s", mpi_why(rc, buf));
      /* the rest cannot be trusted either: drop them all */
      q->n = 0;
      in_flight_ms += t1 - q->since;
      return -1;
    }
    finish(q, i, t1);
  }
  return 0;
}

void kiln_dist_times(double *in_flight, double *blocked) {
  if (in_flight) *in_flight = in_flight_ms;
  if (blocked) *blocked = blocked_ms;
}

int k_allreduce(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op, (void)n;
  if (!tensor_contiguous(out)) {
    err_kernel_why("the result's buffer is not contiguous");
    return -1;
  }
  pw_copy(out, in[0]);
  dist_pending q = {0};
  return dist_start(&q, out, a->flag) || dist_wait(&q, NULL, 0) ? -1 : 0;
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
int dist_start(dist_pending *q, kiln_tensor *out, bool mean) {
  (void)q, (void)out, (void)mean;
  err_kernel_why(NO_MPI);
  return -1;
}
int dist_wait(dist_pending *q, const char *lo, size_t bytes) {
  (void)lo, (void)bytes;
  q->n = 0;
  return 0;
}
void dist_poll(dist_pending *q) { (void)q; }
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
