/* Collectives over MPI_COMM_WORLD, for data-parallel training: allreduce as
 * an op (eager, traced, compiled as an eager kernel), rank and size. Built
 * with KILN_MPI; without it the same calls are errors that say so.
 *
 * MPI starts here on first use unless the program started it, with errors
 * returned rather than fatal, so that a failed collective (a peer that died)
 * becomes kiln's error on the caller's line; what kiln started it finalizes
 * at exit. docs/scaling.md. */
#include <stdlib.h>

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

int k_allreduce(op_id op, kiln_tensor *const *in, int n, const op_attrs *a, kiln_tensor *out) {
  (void)op, (void)n;
  /* out is contiguous (eager allocates it; the compiled runtime gives a
   * planned buffer of the node's own): reduce it in place */
  pw_copy(out, in[0]);
  int64_t count = shape_numel(out->ndim, out->shape);
  MPI_Datatype type = out->dtype == KILN_F32 ? MPI_FLOAT : out->dtype == KILN_F64 ? MPI_DOUBLE : MPI_INT64_T;
  char *data = tensor_data(out);
  /* MPI counts are int: large tensors go in pieces */
  const int64_t piece = (int64_t)1 << 30;
  for (int64_t at = 0; at < count; at += piece) {
    int c = (int)(count - at < piece ? count - at : piece);
    int rc = MPI_Allreduce(MPI_IN_PLACE, data + at * (int64_t)kiln_dtype_size(out->dtype), c, type, MPI_SUM,
                           MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) {
      char buf[MPI_MAX_ERROR_STRING];
      err_kernel_why("MPI_Allreduce failed (a process stopped?): %s", mpi_why(rc, buf));
      return -1;
    }
  }
  if (a->flag) {
    int size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (out->dtype == KILN_F32)
      for (int64_t i = 0; i < count; i++) ((float *)data)[i] /= (float)size;
    else
      for (int64_t i = 0; i < count; i++) ((double *)data)[i] /= size;
  }
  return 0;
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
