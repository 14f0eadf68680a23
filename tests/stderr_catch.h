/* What the library writes to stderr (or stdout) between two points of a
 * test, caught in a file: stderr_catch returns it, stderr_release puts
 * stderr back and reads it into text; fd_catch and fd_release do the same
 * for fd 1 or 2. Include after <check.h>. */
#ifndef KILN_TESTS_STDERR_CATCH_H
#define KILN_TESTS_STDERR_CATCH_H

#include <stdio.h>
#include <unistd.h>

static inline FILE *fd_catch(int fd, int *saved) {
  fflush(fd == 2 ? stderr : stdout);
  FILE *log = tmpfile();
  ck_assert_ptr_nonnull(log);
  *saved = dup(fd);
  dup2(fileno(log), fd);
  return log;
}

static inline void fd_release(int fd, FILE *log, int saved, char *text, size_t n) {
  fflush(fd == 2 ? stderr : stdout);
  dup2(saved, fd);
  close(saved);
  rewind(log);
  text[fread(text, 1, n - 1, log)] = 0;
  fclose(log);
}

static inline FILE *stderr_catch(int *saved) { return fd_catch(2, saved); }

static inline void stderr_release(FILE *log, int saved, char *text, size_t n) { fd_release(2, log, saved, text, n); }

#endif
