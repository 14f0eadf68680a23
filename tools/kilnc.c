/* kilnc: the command-line compiler. Exports a saved graph (kiln_save's text)
 * as an object and a header for libkiln_rt, for build systems that never run
 * the C body that traced it (docs/deploy.md):
 *
 *   kilnc graph.kiln -o model.o [--target TRIPLE] [--cpu CPU] [--name NAME]
 *
 * writes model.o and model.h. A loaded graph takes its params as inputs
 * after its own (kiln_load), so the object embeds no weights: the program
 * passes them (from a safetensors file, say). Exit status 0, or 1 with the
 * error on stderr. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

static int usage(void) {
  fprintf(stderr, "usage: kilnc GRAPH -o OUT.o [--target TRIPLE] [--cpu CPU] [--name NAME]\n"
                  "  writes OUT.o and OUT.h: GRAPH (saved by kiln_save) for libkiln_rt (docs/deploy.md)\n");
  return 1;
}

int main(int argc, char **argv) {
  const char *in = NULL, *out = NULL;
  kiln_export_options o = {0};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], **to = NULL;
    if (!strcmp(a, "-o")) to = &out;
    else if (!strcmp(a, "--target")) to = &o.target;
    else if (!strcmp(a, "--cpu")) to = &o.cpu;
    else if (!strcmp(a, "--name")) to = &o.name;
    else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage(), 0;
    else if (a[0] == '-' || in) return usage();
    else in = a;
    if (to) {
      if (++i == argc) return usage();
      *to = argv[i];
    }
  }
  size_t n = out ? strlen(out) : 0;
  if (!in || n < 3 || strcmp(out + n - 2, ".o")) return usage();
  char *prefix = malloc(n - 1);
  if (!prefix) return 1;
  memcpy(prefix, out, n - 2);
  prefix[n - 2] = 0;
  kiln_fn *fn = kiln_load(in);
  int rc = fn ? kiln_export(fn, prefix, &o) : -1;
  if (rc) fprintf(stderr, "kilnc: %s\n", kiln_last_error());
  kiln_fn_free(fn);
  free(prefix);
  return rc ? 1 : 0;
}
