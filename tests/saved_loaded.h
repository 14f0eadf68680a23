/* A compiled function saved to a file and loaded back, for tests. Include
 * after <check.h>. */
#ifndef KILN_TESTS_SAVED_LOADED_H
#define KILN_TESTS_SAVED_LOADED_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "kiln.h"

/* fn saved to a file of its own and loaded back (a process without the C
 * body would do the same); the file is gone after. */
static inline kiln_fn *saved_and_loaded(kiln_fn *fn, const char *tag) {
  char path[64];
  snprintf(path, sizeof path, "/tmp/kiln_%s_XXXXXX", tag);
  int fd = mkstemp(path);
  ck_assert_int_ge(fd, 0);
  close(fd);
  ck_assert_msg(kiln_save(fn, path) == 0, "%s", kiln_last_error());
  kiln_fn *ld = kiln_load(path);
  unlink(path);
  ck_assert_msg(ld != NULL, "%s", kiln_last_error());
  return ld;
}

#endif
