/* kiln_bench --serve: kiln's side of bench/side_by_side.py. The driver, a
 * Python process that also runs PyTorch and JAX, asks for one call at a
 * time, so that kiln's samples interleave with the others' round by round
 * and a load spike on a shared machine hits every contender alike. Each
 * call is timed here, in C, so the pipe between the two processes is not
 * in any sample.
 *
 * One request per line on stdin, one answer per line on stdout:
 *
 *   list                 the workloads, "ID NAME" per line, then "end"
 *   threads N            kiln_set_num_threads(N) (pool and OpenBLAS)  -> ok N
 *   open ID|NAME         make the inputs and the compiled function    -> ok NAME PER
 *   prepare              the first compiled call (trace and compile), then
 *                        the first call of the compiled code          -> ok COMPILE_MS TRACE_MS
 *   run eager|compiled   one call in its own scope                    -> ms MS (per PER)
 *   close                free the case; its variants and fallbacks    -> ok VARIANTS FALLBACKS
 *   quit
 *
 * A failure answers "err MESSAGE"; the driver leaves kiln's cell empty.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "kiln.h"
#include "stats.h"

void bench_case_close(bench_case *c) {
  if (c->fn) kiln_fn_free(c->fn);
  if (c->close) c->close(c->ctx);
  *c = (bench_case){0};
}

static void answer_err(const char *what) {
  const char *e = kiln_last_error();
  printf("err %s%s%s\n", what, e && *e ? ": " : "", e ? e : "");
}

int bench_serve(void) {
  char line[256];
  bench_case c = {0};
  while (fgets(line, sizeof line, stdin)) {
    line[strcspn(line, "\r\n")] = 0;
    char *arg = strchr(line, ' ');
    if (arg) *arg++ = 0;
    if (!strcmp(line, "quit")) {
      break;
    } else if (!strcmp(line, "list")) {
      workloads_list(stdout);
      gpt_list(stdout);
      lstm_list(stdout);
      llama_list(stdout);
      resnet_list(stdout);
      printf("end\n");
    } else if (!strcmp(line, "threads") && arg && atoi(arg) > 0) {
      kiln_set_num_threads(atoi(arg));
      printf("ok %d\n", kiln_get_num_threads());
    } else if (!strcmp(line, "open") && arg) {
      bench_case_close(&c);
      int rc = workloads_case_open(arg, &c);
      if (rc == 1) rc = gpt_case_open(arg, &c);
      if (rc == 1) rc = lstm_case_open(arg, &c);
      if (rc == 1) rc = llama_case_open(arg, &c);
      if (rc == 1) rc = resnet_case_open(arg, &c);
      if (rc == 0)
        printf("ok %s %d\n", c.name, c.per);
      else if (rc == 1)
        printf("err no workload %s\n", arg);
      else
        answer_err("setup failed");
    } else if (!strcmp(line, "prepare") && c.fn) {
      kiln_fn_stats st;
      if (c.run(c.ctx, c.fn) || c.run(c.ctx, c.fn) || kiln_fn_get_stats(c.fn, &st))
        answer_err("compiled call failed");
      else
        printf("ok %.6f %.6f\n", st.compile_ms, st.trace_ms);
    } else if (!strcmp(line, "run") && c.run && arg && (!strcmp(arg, "eager") || !strcmp(arg, "compiled"))) {
      double a = bench_now_s();
      int rc = c.run(c.ctx, strcmp(arg, "eager") ? c.fn : NULL);
      double ms = 1e3 * (bench_now_s() - a) / c.per;
      if (rc)
        answer_err(arg);
      else
        printf("ms %.9f\n", ms);
    } else if (!strcmp(line, "close")) {
      kiln_fn_stats st = {0};
      if (c.fn) kiln_fn_get_stats(c.fn, &st);
      printf("ok %d %d\n", (int)st.variants, (int)st.fallbacks);
      bench_case_close(&c);
    } else {
      printf("err bad request: %s\n", line);
    }
    fflush(stdout);
  }
  bench_case_close(&c);
  return 0;
}
