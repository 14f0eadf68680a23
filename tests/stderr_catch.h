/* What the library writes to stderr between two points of a test, caught
 * in a file: stderr_catch returns it, stderr_release puts stderr back and
 * reads it into text. Include after <check.h>. */
#ifndef KILN_TESTS_STDERR_CATCH_H
#define KILN_TESTS_STDERR_CATCH_H

#include <stdio.h>
#include <unistd.h>

static inline FILE *stderr_catch(int *saved) {
  fflush(stderr);
  FILE *log = tmpfile();
  ck_assert_ptr_nonnull(log);
  *saved = dup(2);
  dup2(fileno(log), 2);
  return log;
}

static inline void stderr_release(FILE *log, int saved, char *text, size_t n) {
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  rewind(log);
  text[fread(text, 1, n - 1, log)] = 0;
  fclose(log);
}

#endif
