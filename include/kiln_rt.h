/* kiln_rt.h - the runtime an exported model links against (libkiln_rt).
 *
 * kiln_export (kiln.h) writes a model as an object file and a header; the
 * header includes this one and declares the model's two entry points:
 *
 *   int <name>_run(const kiln_rt_buffer *in, kiln_rt_buffer *out);
 *   const char *<name>_error(void);
 *
 * A program links the object with this runtime alone, no libkiln or LLVM:
 *
 *   cc app.c model.o -lkiln_rt -lopenblas -lm -lpthread
 *
 * Tensors cross the boundary as kiln_rt_buffer: row-major, contiguous, of
 * the dtype the generated header documents for each input and output.
 * docs/deploy.md has the whole story. */
#ifndef KILN_RT_H
#define KILN_RT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(KILN_RT_BUILD) && defined(__GNUC__)
#define KILN_RT_API __attribute__((visibility("default")))
#else
#define KILN_RT_API
#endif

/* One tensor: data (row-major, contiguous), its rank and sizes. An output
 * whose data is NULL is allocated with malloc (the caller free()s it) and
 * its ndim and shape filled in; an output with data must have the shape
 * the call produces (a mismatch is an error, nothing is written). */
typedef struct kiln_rt_buffer {
  void *data;
  int ndim;
  int64_t shape[8];
} kiln_rt_buffer;

struct kiln_rt_model; /* what an exported object holds (opaque) */

/* Runs an exported model: 0, or -1 when an input breaks the guards of the
 * exported variant (dtype, rank, a size out of its bounds, a relation
 * between sizes), memory runs out or the model's data is from another
 * runtime version; kiln_rt_error() then says why. <name>_run calls this. */
KILN_RT_API int kiln_rt_run(const struct kiln_rt_model *model, const kiln_rt_buffer *in, kiln_rt_buffer *out);
/* Why the last failed call on this thread failed ("" when none). */
KILN_RT_API const char *kiln_rt_error(void);
/* Threads the models' loops split across (default: KILN_NUM_THREADS, else
 * the core count); also OpenBLAS's. n < 1 restores the default. */
KILN_RT_API void kiln_rt_set_num_threads(int n);
/* The plan version this runtime reads (a model carries the one it was exported for). */
KILN_RT_API int kiln_rt_plan_version(void);

#ifdef __cplusplus
}
#endif

#endif
