/* jit.c - the last codegen stage: an LLVM module built by lower.c is verified,
 * optimized for the host CPU (its name and features, so the loop
 * vectorizer uses the widest vectors the machine has), and compiled with ORC
 * LLJIT. Every defined function is looked up inside jit_compile, so all the
 * machine code exists (and is timed) before the first call; jit_lookup only
 * searches the resulting table. One LLJIT per compiled variant: variants are
 * compiled by different threads at once, each in its own LLVM context, and
 * freeing a variant frees its code. LLVM's errors come back as text in err;
 * nothing here aborts. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <llvm-c/Analysis.h>
#include <llvm-c/Error.h>
#include <llvm-c/LLJIT.h>
#include <llvm-c/Orc.h>
#include <llvm-c/Support.h>
#include <llvm-c/Target.h>
#include <llvm-c/TargetMachine.h>
#include <llvm-c/Transforms/PassBuilder.h>

#include "codegen/codegen.h"

/* The host target, found once by jit_init. */
static struct {
  pthread_once_t once;
  int status;          /* 0 or -1 after the first jit_init */
  char err[256];       /* why it failed */
  char *triple;        /* LLVM strings, kept for the life of the process */
  char *cpu;
  char *features;
  char *layout;        /* data layout of the host target machine */
  LLVMTargetRef target;
} host = {.once = PTHREAD_ONCE_INIT};

typedef struct jit_sym {
  char *name;
  void *addr;
} jit_sym;

struct cg_jit {
  LLVMOrcLLJITRef lljit;
  jit_sym *sym;          /* every function the module defines, compiled */
  int n_sym;
  char session_err[256]; /* last error the ORC session reported on its own */
};

/* The passes a kernel needs, in the order O2 runs them: registers for the
 * accumulators (sroa), index arithmetic simplified and hoisted, loops
 * rotated with canonical induction variables, then the vectorizer and a
 * cleanup. Kernels are single loop nests without calls, so O2's inliner,
 * interprocedural passes and repeated instcombines (half its time) found
 * nothing: the code of the bench workloads is the same size or smaller, and
 * this runs in about half the time. KILN_LLVM_PASSES replaces it. */
#define KERNEL_PASSES                                                                               \
  "function(sroa,early-cse,instcombine,simplifycfg,loop-mssa(licm),loop(loop-rotate,indvars),"     \
  "loop-vectorize,instcombine,simplifycfg,early-cse,loop-mssa(licm))"

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Writes "what: LLVM's message" into err and consumes e. */
static void error_text(LLVMErrorRef e, const char *what, char *err, size_t errn) {
  char *msg = LLVMGetErrorMessage(e);
  if (err && errn) snprintf(err, errn, "%s: %s", what, msg);
  LLVMDisposeErrorMessage(msg);
}

static const char *module_name(LLVMModuleRef mod) {
  size_t len;
  return LLVMGetModuleIdentifier(mod, &len);
}

/* The small code model: constants are RIP-relative operands. The JIT
 * default (large) loads each one's 64-bit address into a register, which in
 * a long vector loop (GELU) ran out of registers and spilled. ORC's JITLink
 * places a module's code and data in one allocation, as the small model needs. */
static LLVMTargetMachineRef host_machine(void) {
  return LLVMCreateTargetMachine(host.target, host.triple, host.cpu, host.features, LLVMCodeGenLevelAggressive,
                                 LLVMRelocPIC, LLVMCodeModelSmall);
}

static void init_once(void) {
  host.status = -1;
  if (LLVMInitializeNativeTarget() || LLVMInitializeNativeAsmPrinter() || LLVMInitializeNativeAsmParser()) {
    snprintf(host.err, sizeof host.err, "LLVM has no native target for this machine");
    return;
  }
  /* A vectorized loop keeps a scalar remainder but no second, narrower
   * vector loop for it: that copy of the body costs compile time and gains
   * nothing on rows that are long or a multiple of the vector. Rows of a
   * length not known, or short and ragged, get a masked tail instead
   * (lower.c asks for it per loop). */
  /* Loop strength reduction rewrites a loop's addresses around one
   * induction variable; x86 addressing already does base + index * 4, and
   * the pass took a quarter of the machine-code time for no measured gain. */
  const char *const opts[] = {"kiln", "-enable-epilogue-vectorization=false", "-disable-lsr"};
  LLVMParseCommandLineOptions(3, opts, NULL);
  host.triple = LLVMGetDefaultTargetTriple();
  host.cpu = LLVMGetHostCPUName();
  host.features = LLVMGetHostCPUFeatures();
  char *msg = NULL;
  if (LLVMGetTargetFromTriple(host.triple, &host.target, &msg)) {
    snprintf(host.err, sizeof host.err, "LLVM target %s: %s", host.triple, msg ? msg : "not found");
    LLVMDisposeMessage(msg);
    return;
  }
  LLVMTargetMachineRef tm = host_machine();
  if (!tm) {
    snprintf(host.err, sizeof host.err, "LLVM: no target machine for %s (%s)", host.triple, host.cpu);
    return;
  }
  LLVMTargetDataRef td = LLVMCreateTargetDataLayout(tm);
  host.layout = LLVMCopyStringRepOfTargetData(td);
  LLVMDisposeTargetData(td);
  LLVMDisposeTargetMachine(tm);
  host.status = 0;
}

int jit_init(char *err, size_t errn) {
  pthread_once(&host.once, init_once);
  if (host.status != 0 && err && errn) snprintf(err, errn, "%s", host.err);
  return host.status;
}

int jit_module_new(cg_module *m, const char *name, char *err, size_t errn) {
  memset(m, 0, sizeof *m);
  if (jit_init(err, errn) != 0) return -1;
  LLVMOrcThreadSafeContextRef tsc = LLVMOrcCreateNewThreadSafeContext();
  m->tsc = tsc;
  m->ctx = LLVMOrcThreadSafeContextGetContext(tsc);
  m->mod = LLVMModuleCreateWithNameInContext(name, m->ctx);
  /* the lowering asks the data layout for sizes and alignments */
  LLVMSetTarget(m->mod, host.triple);
  LLVMSetDataLayout(m->mod, host.layout);
  return 0;
}

void jit_module_dispose(cg_module *m) {
  if (m->mod) LLVMDisposeModule(m->mod);
  if (m->tsc) LLVMOrcDisposeThreadSafeContext(m->tsc);
  memset(m, 0, sizeof *m);
}

/* The ORC session reports some failures only here (and by default prints
 * them); keep the text for jit_compile's message instead. */
static void session_error(void *ctx, LLVMErrorRef e) {
  cg_jit *j = ctx;
  error_text(e, "LLJIT", j->session_err, sizeof j->session_err);
}

/* An LLJIT for the host whose main library also resolves the process's
 * symbols (libm, the runtime's helpers). NULL with err. */
static LLVMOrcLLJITRef lljit_new(cg_jit *j, char *err, size_t errn) {
  LLVMTargetMachineRef tm = host_machine();
  if (!tm) {
    snprintf(err, errn, "LLVM: no target machine for %s (%s)", host.triple, host.cpu);
    return NULL;
  }
  LLVMOrcLLJITBuilderRef builder = LLVMOrcCreateLLJITBuilder();
  LLVMOrcLLJITBuilderSetJITTargetMachineBuilder(builder, LLVMOrcJITTargetMachineBuilderCreateFromTargetMachine(tm));
  LLVMOrcLLJITRef lljit = NULL;
  LLVMErrorRef e = LLVMOrcCreateLLJIT(&lljit, builder);
  if (e) {
    error_text(e, "LLJIT", err, errn);
    return NULL;
  }
  LLVMOrcExecutionSessionSetErrorReporter(LLVMOrcLLJITGetExecutionSession(lljit), session_error, j);
  LLVMOrcDefinitionGeneratorRef gen = NULL;
  e = LLVMOrcCreateDynamicLibrarySearchGeneratorForProcess(&gen, LLVMOrcLLJITGetGlobalPrefix(lljit), NULL, NULL);
  if (e) {
    error_text(e, "LLJIT process symbols", err, errn);
    LLVMConsumeError(LLVMOrcDisposeLLJIT(lljit));
    return NULL;
  }
  LLVMOrcJITDylibAddGenerator(LLVMOrcLLJITGetMainJITDylib(lljit), gen);
  return lljit;
}

/* The names of the functions m defines with external linkage (those the
 * JIT can look up). -1 when out of memory. */
static int defined_functions(cg_jit *j, LLVMModuleRef mod) {
  int n = 0;
  for (LLVMValueRef f = LLVMGetFirstFunction(mod); f; f = LLVMGetNextFunction(f))
    if (!LLVMIsDeclaration(f) && LLVMGetLinkage(f) == LLVMExternalLinkage) n++;
  j->sym = alloc_calloc(n ? (size_t)n : 1, sizeof *j->sym);
  if (!j->sym) return -1;
  for (LLVMValueRef f = LLVMGetFirstFunction(mod); f; f = LLVMGetNextFunction(f)) {
    if (LLVMIsDeclaration(f) || LLVMGetLinkage(f) != LLVMExternalLinkage) continue;
    size_t len;
    const char *name = LLVMGetValueName2(f, &len);
    char *copy = alloc_malloc(len + 1);
    if (!copy) return -1;
    memcpy(copy, name, len);
    copy[len] = '\0';
    j->sym[j->n_sym++].name = copy;
  }
  return 0;
}

/* Prints the optimized module, and its machine code from a clone (code
 * generation would change the module the JIT still needs). */
static void dump_module(LLVMModuleRef mod, LLVMTargetMachineRef tm, unsigned dump, FILE *f) {
  if (dump & KILN_DUMP_LLVM) {
    char *text = LLVMPrintModuleToString(mod);
    fprintf(f, "; ---- LLVM module %s (optimized, %s) ----\n", module_name(mod), host.cpu);
    fputs(text, f);
    LLVMDisposeMessage(text);
  }
  if (dump & KILN_DUMP_ASM) {
    LLVMModuleRef clone = LLVMCloneModule(mod);
    char *msg = NULL;
    LLVMMemoryBufferRef buf = NULL;
    fprintf(f, "# ---- machine code %s (%s) ----\n", module_name(mod), host.cpu);
    if (LLVMTargetMachineEmitToMemoryBuffer(tm, clone, LLVMAssemblyFile, &msg, &buf)) {
      fprintf(f, "# no assembly: %s\n", msg ? msg : "LLVM failed");
    } else {
      fwrite(LLVMGetBufferStart(buf), 1, LLVMGetBufferSize(buf), f);
      LLVMDisposeMemoryBuffer(buf);
    }
    LLVMDisposeMessage(msg);
    LLVMDisposeModule(clone);
  }
  fflush(f);
}

static int addr_order(const void *a, const void *b) {
  uintptr_t x = (uintptr_t)((const jit_sym *)a)->addr, y = (uintptr_t)((const jit_sym *)b)->addr;
  return (x > y) - (x < y);
}

/* KILN_PERF_MAP=1: name the kernels for perf in /tmp/perf-PID.map. A function
 * runs to the next one; the last is given 4 KiB. */
static void perf_map_write(const cg_jit *j) {
  static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
  const char *want = getenv("KILN_PERF_MAP");
  if (!want || !*want || !strcmp(want, "0") || j->n_sym == 0) return;
  jit_sym *s = alloc_calloc((size_t)j->n_sym, sizeof *s);
  if (!s) return;
  memcpy(s, j->sym, (size_t)j->n_sym * sizeof *s);
  qsort(s, (size_t)j->n_sym, sizeof *s, addr_order);
  char path[64];
  snprintf(path, sizeof path, "/tmp/perf-%ld.map", (long)getpid());
  pthread_mutex_lock(&mu);
  FILE *f = fopen(path, "a");
  for (int i = 0; f && i < j->n_sym; i++) {
    uintptr_t a = (uintptr_t)s[i].addr, next = i + 1 < j->n_sym ? (uintptr_t)s[i + 1].addr : a + 4096;
    fprintf(f, "%lx %lx %s\n", (unsigned long)a, (unsigned long)(next - a), s[i].name);
  }
  if (f) fclose(f);
  pthread_mutex_unlock(&mu);
  alloc_free(s);
}

cg_jit *jit_compile(cg_module *m, unsigned dump, FILE *dump_to, double *opt_ms, double *codegen_ms, char *err,
                    size_t errn) {
  char scratch[1];
  if (!err || !errn) err = scratch, errn = sizeof scratch;
  if (opt_ms) *opt_ms = 0;
  if (codegen_ms) *codegen_ms = 0;
  cg_jit *j = NULL;
  LLVMTargetMachineRef tm = NULL;
  if (jit_init(err, errn) != 0) goto fail;

  char *msg = NULL;
  if (LLVMVerifyModule(m->mod, LLVMReturnStatusAction, &msg)) {
    size_t len = msg ? strlen(msg) : 0;
    while (len && (msg[len - 1] == '\n' || msg[len - 1] == ' ')) msg[--len] = '\0';
    snprintf(err, errn, "invalid LLVM module %s: %s", module_name(m->mod), msg ? msg : "");
    LLVMDisposeMessage(msg);
    goto fail;
  }
  LLVMDisposeMessage(msg);

  tm = host_machine();
  if (!tm) {
    snprintf(err, errn, "LLVM: no target machine for %s (%s)", host.triple, host.cpu);
    goto fail;
  }
  double t0 = now_ms();
  LLVMPassBuilderOptionsRef po = LLVMCreatePassBuilderOptions();
  LLVMPassBuilderOptionsSetLoopVectorization(po, 1);
  LLVMPassBuilderOptionsSetSLPVectorization(po, 1);
  /* no unrolling beyond the vectorizer's interleaving: it doubled the code
   * (and its compile time) of every loop for no measured gain */
  LLVMPassBuilderOptionsSetLoopUnrolling(po, 0);
  LLVMPassBuilderOptionsSetLoopInterleaving(po, 1);
  const char *passes = getenv("KILN_LLVM_PASSES");
  LLVMErrorRef e = LLVMRunPasses(m->mod, passes && *passes ? passes : KERNEL_PASSES, tm, po);
  LLVMDisposePassBuilderOptions(po);
  if (e) {
    error_text(e, "LLVM optimization", err, errn);
    goto fail;
  }
  if (opt_ms) *opt_ms = now_ms() - t0;
  if (dump & (KILN_DUMP_LLVM | KILN_DUMP_ASM)) dump_module(m->mod, tm, dump, dump_to ? dump_to : stderr);
  LLVMDisposeTargetMachine(tm);
  tm = NULL;

  double t1 = now_ms();

  j = alloc_calloc(1, sizeof *j);
  if (!j || defined_functions(j, m->mod) != 0) {
    snprintf(err, errn, "jit_compile: out of memory");
    goto fail;
  }
  j->lljit = lljit_new(j, err, errn);
  if (!j->lljit) goto fail;
  LLVMOrcThreadSafeModuleRef tsm = LLVMOrcCreateNewThreadSafeModule(m->mod, m->tsc);
  LLVMOrcDisposeThreadSafeContext(m->tsc); /* the module holds its own reference */
  memset(m, 0, sizeof *m);
  e = LLVMOrcLLJITAddLLVMIRModule(j->lljit, LLVMOrcLLJITGetMainJITDylib(j->lljit), tsm);
  if (e) {
    error_text(e, "LLJIT add module", err, errn);
    goto fail;
  }
  /* the first lookup compiles the whole module */
  for (int i = 0; i < j->n_sym; i++) {
    LLVMOrcExecutorAddress addr = 0;
    e = LLVMOrcLLJITLookup(j->lljit, &addr, j->sym[i].name);
    if (e) {
      /* the session's report names the missing symbol; the lookup's only
       * says that materializing failed */
      if (j->session_err[0]) {
        LLVMConsumeError(e);
        snprintf(err, errn, "%s (compiling %s)", j->session_err, j->sym[i].name);
      } else {
        error_text(e, "LLJIT", err, errn);
      }
      goto fail;
    }
    j->sym[i].addr = (void *)(uintptr_t)addr;
  }
  perf_map_write(j);
  if (codegen_ms) *codegen_ms = now_ms() - t1;
  return j;

fail:
  if (tm) LLVMDisposeTargetMachine(tm);
  jit_module_dispose(m);
  jit_free(j);
  return NULL;
}

void *jit_lookup(cg_jit *j, const char *name) {
  if (!j) return NULL;
  for (int i = 0; i < j->n_sym; i++)
    if (strcmp(j->sym[i].name, name) == 0) return j->sym[i].addr;
  return NULL;
}

void jit_free(cg_jit *j) {
  if (!j) return;
  if (j->lljit) LLVMConsumeError(LLVMOrcDisposeLLJIT(j->lljit));
  for (int i = 0; i < j->n_sym; i++) alloc_free(j->sym[i].name);
  alloc_free(j->sym);
  alloc_free(j);
}
