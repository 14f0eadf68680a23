/* jit.c - the last codegen stage: an LLVM module built by lower.c is verified,
 * optimized for the host CPU (its name and features, so the loop vectorizer
 * uses the widest vectors the machine has) and emitted as an object file;
 * objects (fresh, or from the kernel cache) are linked by ORC LLJIT. Every
 * expected function is looked up in jit_link, so all the machine code is
 * linked (and timed) before the first call; jit_lookup only searches the
 * resulting table. One LLJIT per compiled variant: variants are compiled by
 * different threads at once, each module in an LLVM context of its own
 * (built on one thread, then optimized and compiled on another), and freeing
 * a variant frees its code. LLVM's errors come back as text in
 * err; nothing here aborts. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <llvm-c/Analysis.h>
#include <llvm-c/Error.h>
#include <llvm-c/ErrorHandling.h>
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
  char *id;            /* jit_target_id */
  bool wide;           /* 512-bit vectors: the CPU has AVX-512 and KILN_JIT_FEATURES keeps it */
  LLVMTargetRef target;
} host = {.once = PTHREAD_ONCE_INIT};

typedef struct jit_sym {
  char *name;
  char *display; /* perf's name for it, or NULL: the name */
  void *addr;
} jit_sym;

struct cg_jit {
  LLVMOrcLLJITRef lljit;
  jit_sym *sym;          /* the functions to look up, then their addresses */
  int n_sym, cap_sym;
  char session_err[256]; /* last error the ORC session reported on its own */
};

/* The passes a kernel needs, in the order O2 runs them: registers for the
 * accumulators (sroa), index arithmetic simplified and hoisted, loops
 * rotated (the form the vectorizer takes), then the vectorizer and a
 * cleanup. Kernels are single loop nests without calls, so O2's inliner,
 * interprocedural passes and repeated instcombines (half its time) found
 * nothing: the code of the bench workloads is the same size or smaller, and
 * this runs in about half the time. indvars, a quarter of what was left,
 * changed no instruction of the bench workloads' code. KILN_LLVM_PASSES
 * replaces it. instcombine named in a pipeline's text checks that one run
 * reached a fixpoint and, when not, ends the process (O2's does not
 * check): hence no-verify-fixpoint. */
/* The kernel cache's key is the kernel's key (kkey.c) and this. The format
 * number changes with the key's form, and when lowering changes what a
 * printed function's metadata or attributes (!3, #0) hold for the same
 * text (the key of a function the walk does not know is its text), so that
 * objects compiled before are not taken. */
enum { KERNEL_FORMAT = 4 };

/* The pass builder's options jit_emit sets, as they enter the cache key. */
#define PASS_OPTIONS "loop and SLP vectorization, interleaving, no unrolling"

/* After the vectorizer, a second instcombine and licm changed about 1% of
 * the GPT step's machine code and took a fifth of the optimization time:
 * the code generator's own combining does that cleanup. */
#define KERNEL_PASSES                                                                        \
  "function(sroa,early-cse,instcombine<no-verify-fixpoint>,simplifycfg,loop-mssa(licm),"     \
  "loop(loop-rotate),loop-vectorize,simplifycfg,early-cse)"

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

/* A kernel marked CG_QUICK_ATTR gets LLVM's quick code generator: optnone,
 * added after the IR passes, makes instruction selection the fast one and
 * skips the optional machine passes (the register allocator stays the
 * greedy one). It takes about half the machine code time of the full one.
 * True when every function of mod is marked: the module then goes to a
 * target machine at level None, which does not even add those passes (with
 * optnone they are added and skip the function, but the analyses they ask
 * for still run: a fifth of the machine code time of the GPT step's light
 * kernels). -optimize-regalloc (init_once) keeps the greedy allocator there. */
static bool quick_codegen(LLVMModuleRef mod) {
  LLVMContextRef cx = LLVMGetModuleContext(mod);
  unsigned optnone = LLVMGetEnumAttributeKindForName("optnone", 7);
  unsigned noinline = LLVMGetEnumAttributeKindForName("noinline", 8);
  bool all = true, any = false;
  for (LLVMValueRef f = LLVMGetFirstFunction(mod); f; f = LLVMGetNextFunction(f)) {
    if (LLVMIsDeclaration(f)) continue;
    any = true;
    if (!LLVMGetStringAttributeAtIndex(f, LLVMAttributeFunctionIndex, CG_QUICK_ATTR, sizeof CG_QUICK_ATTR - 1)) {
      all = false;
      continue;
    }
    LLVMAddAttributeAtIndex(f, LLVMAttributeFunctionIndex, LLVMCreateEnumAttribute(cx, optnone, 0));
    LLVMAddAttributeAtIndex(f, LLVMAttributeFunctionIndex, LLVMCreateEnumAttribute(cx, noinline, 0));
  }
  return any && all;
}

static const char *module_name(LLVMModuleRef mod) {
  size_t len;
  return LLVMGetModuleIdentifier(mod, &len);
}

/* The small code model: constants are RIP-relative operands. The JIT
 * default (large) loads each one's 64-bit address into a register, which in
 * a long vector loop (GELU) ran out of registers and spilled. ORC's JITLink
 * places a module's code and data in one allocation, as the small model needs. */
static LLVMTargetMachineRef host_machine_at(LLVMCodeGenOptLevel level) {
  return LLVMCreateTargetMachine(host.target, host.triple, host.cpu, host.features, level, LLVMRelocPIC,
                                 LLVMCodeModelSmall);
}
static LLVMTargetMachineRef host_machine(void) { return host_machine_at(LLVMCodeGenLevelAggressive); }

/* The module this thread is optimizing or compiling, for the fatal error handler. */
static _Thread_local const char *compiling;

/* LLVM ends the process after a fatal error (it cannot unwind); before it
 * does, say which compile it was and how to run without LLVM. */
static void fatal_error(const char *reason) {
  fprintf(stderr, "kiln: LLVM failed fatally while compiling %s: %s\n"
                  "kiln: this is a bug in kiln (or in the pipeline KILN_LLVM_PASSES gives); "
                  "KILN_BACKEND=interp runs compiled functions without LLVM\n",
          compiling ? compiling : "(no kiln module)", reason);
}

static void init_once(void) {
  host.status = -1;
  /* LLVM has one handler per process: a host program that installs its own
   * (it embeds LLVM too, say) keeps it with KILN_LLVM_FATAL_HANDLER=0 */
  const char *fh = getenv("KILN_LLVM_FATAL_HANDLER");
  if (!fh || strcmp(fh, "0")) LLVMInstallFatalErrorHandler(fatal_error);
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
  /* The register allocator of level None (quick_codegen) is the fast one,
   * which spills a vector loop's values to the stack; this makes it the
   * greedy one, as at the other levels (which it does not change). */
  static const char *const opts[] = {"kiln", "-enable-epilogue-vectorization=false", "-disable-lsr",
                                     "-optimize-regalloc"};
  LLVMParseCommandLineOptions(4, opts, NULL);
  host.triple = LLVMGetDefaultTargetTriple();
  host.cpu = LLVMGetHostCPUName();
  host.features = LLVMGetHostCPUFeatures();
  /* KILN_JIT_FEATURES: LLVM feature changes after the host's ("-avx512f":
   * the kernels an AVX2 machine would get, to measure one on this one) */
  const char *extra = getenv("KILN_JIT_FEATURES");
  if (extra && *extra) {
    size_t nf = strlen(host.features) + strlen(extra) + 2;
    char *f = malloc(nf);
    if (f) {
      snprintf(f, nf, "%s,%s", host.features, extra);
      LLVMDisposeMessage(host.features);
      host.features = LLVMCreateMessage(f);
      free(f);
    }
  }
  host.wide = __builtin_cpu_supports("avx512f") && !cpu_avx512_turned_off();
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
  unsigned major, minor, patch;
  LLVMGetVersion(&major, &minor, &patch);
  size_t n = strlen(host.triple) + strlen(host.cpu) + strlen(host.features) + 256;
  host.id = malloc(n);
  if (!host.id) {
    snprintf(host.err, sizeof host.err, "out of memory");
    return;
  }
  /* the code model, relocations and level are host_machine's */
  snprintf(host.id, n, "kiln kernels %d; LLVM %u.%u.%u; %s; %s; %s; small PIC O3; %s %s %s; %s", KERNEL_FORMAT, major, minor,
           patch, host.triple, host.cpu, host.features, opts[1], opts[2], opts[3], PASS_OPTIONS);
  host.status = 0;
}

bool jit_wide_vectors(void) {
  pthread_once(&host.once, init_once);
  return host.wide;
}

int jit_init(char *err, size_t errn) {
  pthread_once(&host.once, init_once);
  if (host.status != 0 && err && errn) snprintf(err, errn, "%s", host.err);
  return host.status;
}

static void module_init(cg_module *m, const char *name) {
  m->mod = LLVMModuleCreateWithNameInContext(name, m->ctx);
  /* the lowering asks the data layout for sizes and alignments */
  LLVMSetTarget(m->mod, host.triple);
  LLVMSetDataLayout(m->mod, host.layout);
}

int jit_module_new(cg_module *m, const char *name, char *err, size_t errn) {
  memset(m, 0, sizeof *m);
  if (jit_init(err, errn) != 0) return -1;
  m->ctx = LLVMContextCreate();
  m->own_ctx = true;
  module_init(m, name);
  return 0;
}

void jit_module_dispose(cg_module *m) {
  if (m->mod) LLVMDisposeModule(m->mod);
  if (m->own_ctx && m->ctx) LLVMContextDispose(m->ctx);
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

/* Adds name to the functions jit_link will look up; display is what
 * perf's map calls it (NULL: the name). -1 when out of memory. */
int jit_expect(cg_jit *j, const char *name, const char *display) {
  if (j->n_sym == j->cap_sym) {
    int cap = j->cap_sym ? 2 * j->cap_sym : 16;
    jit_sym *ns = alloc_realloc(j->sym, sizeof *ns * (size_t)cap);
    if (!ns) return -1;
    j->sym = ns;
    j->cap_sym = cap;
  }
  jit_sym *y = &j->sym[j->n_sym];
  size_t n = strlen(name), d = display ? strlen(display) : 0;
  y->name = alloc_malloc(n + 1);
  y->display = display ? alloc_malloc(d + 1) : NULL;
  y->addr = NULL;
  if (!y->name || (display && !y->display)) {
    alloc_free(y->name);
    alloc_free(y->display);
    return -1;
  }
  memcpy(y->name, name, n + 1);
  if (display) memcpy(y->display, display, d + 1);
  j->n_sym++;
  return 0;
}

/* Expects every function mod defines with external linkage (those the JIT
 * can look up). -1 when out of memory. */
static int expect_defined(cg_jit *j, LLVMModuleRef mod) {
  for (LLVMValueRef f = LLVMGetFirstFunction(mod); f; f = LLVMGetNextFunction(f)) {
    if (LLVMIsDeclaration(f) || LLVMGetLinkage(f) != LLVMExternalLinkage) continue;
    size_t len;
    const char *name = LLVMGetValueName2(f, &len);
    if (jit_expect(j, name, NULL)) return -1;
  }
  return 0;
}

/* Prints the optimized module, and its machine code from a clone (code
 * generation changes the module the object is then emitted from). */
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
    fprintf(f, "%lx %lx %s\n", (unsigned long)a, (unsigned long)(next - a), s[i].display ? s[i].display : s[i].name);
  }
  if (f) fclose(f);
  pthread_mutex_unlock(&mu);
  alloc_free(s);
}

const char *jit_target_id(void) { return host.id; }

const char *jit_passes(void) {
  const char *passes = getenv("KILN_LLVM_PASSES");
  return passes && *passes ? passes : KERNEL_PASSES;
}

/* The kernel pipeline passes (NULL: jit_passes()) over mod for tm's costs; 0, or -1 with err. */
static int run_passes(LLVMModuleRef mod, LLVMTargetMachineRef tm, const char *passes, char *err, size_t errn) {
  LLVMPassBuilderOptionsRef po = LLVMCreatePassBuilderOptions();
  LLVMPassBuilderOptionsSetLoopVectorization(po, 1);
  LLVMPassBuilderOptionsSetSLPVectorization(po, 1);
  /* no unrolling beyond the vectorizer's interleaving: it doubled the code
   * (and its compile time) of every loop for no measured gain */
  LLVMPassBuilderOptionsSetLoopUnrolling(po, 0);
  LLVMPassBuilderOptionsSetLoopInterleaving(po, 1);
  LLVMErrorRef e = LLVMRunPasses(mod, passes ? passes : jit_passes(), tm, po);
  LLVMDisposePassBuilderOptions(po);
  if (e) {
    error_text(e, "LLVM optimization", err, errn);
    return -1;
  }
  return 0;
}

/* mod's object file from tm into *obj (alloc_malloc'ed, *len bytes); 0, or -1 with err. */
static int emit_object(LLVMTargetMachineRef tm, LLVMModuleRef mod, void **obj, size_t *len, char *err, size_t errn) {
  char *msg = NULL;
  LLVMMemoryBufferRef buf = NULL;
  if (LLVMTargetMachineEmitToMemoryBuffer(tm, mod, LLVMObjectFile, &msg, &buf)) {
    snprintf(err, errn, "LLVM machine code for %s: %s", module_name(mod), msg ? msg : "failed");
    LLVMDisposeMessage(msg);
    return -1;
  }
  size_t n = LLVMGetBufferSize(buf);
  *obj = alloc_malloc(n ? n : 1);
  if (!*obj) {
    LLVMDisposeMemoryBuffer(buf);
    snprintf(err, errn, "out of memory");
    return -1;
  }
  memcpy(*obj, LLVMGetBufferStart(buf), n);
  *len = n;
  LLVMDisposeMemoryBuffer(buf);
  return 0;
}

/* 0, or -1 with LLVM's complaint about mod in err. */
static int verify(LLVMModuleRef mod, char *err, size_t errn) {
  char *msg = NULL;
  if (LLVMVerifyModule(mod, LLVMReturnStatusAction, &msg)) {
    size_t n = msg ? strlen(msg) : 0;
    while (n && (msg[n - 1] == '\n' || msg[n - 1] == ' ')) msg[--n] = '\0';
    snprintf(err, errn, "invalid LLVM module %s: %s", module_name(mod), msg ? msg : "");
    LLVMDisposeMessage(msg);
    return -1;
  }
  LLVMDisposeMessage(msg);
  return 0;
}

static pthread_once_t all_once = PTHREAD_ONCE_INIT;
static void init_all_targets(void) {
  LLVMInitializeAllTargetInfos();
  LLVMInitializeAllTargets();
  LLVMInitializeAllTargetMCs();
  LLVMInitializeAllAsmPrinters();
}

LLVMTargetMachineRef jit_machine_for(const char *triple, const char *cpu, char *err, size_t errn) {
  if (jit_init(err, errn) != 0) return NULL;
  bool native = cpu && (!strcmp(cpu, "native") || !strcmp(cpu, "host"));
  if (triple && strcmp(triple, host.triple)) {
    if (native) return snprintf(err, errn, "cpu \"%s\" is the host's, and the target %s is not", cpu, triple), NULL;
    pthread_once(&all_once, init_all_targets);
  }
  const char *t = triple ? triple : host.triple;
  LLVMTargetRef target = NULL;
  char *msg = NULL;
  if (LLVMGetTargetFromTriple(t, &target, &msg)) {
    snprintf(err, errn, "LLVM has no target for %s: %s", t, msg ? msg : "unknown");
    LLVMDisposeMessage(msg);
    return NULL;
  }
  LLVMDisposeMessage(msg);
  /* a generic CPU: the object runs on any machine of the target */
  const char *c = native ? host.cpu : cpu ? cpu : "generic", *f = native ? host.features : "";
  LLVMTargetMachineRef tm = LLVMCreateTargetMachine(target, t, c, f, LLVMCodeGenLevelAggressive, LLVMRelocPIC,
                                                    LLVMCodeModelSmall);
  if (!tm) snprintf(err, errn, "LLVM: no target machine for %s (cpu %s)", t, c);
  return tm;
}

int jit_emit_for(LLVMModuleRef mod, LLVMTargetMachineRef tm, void **obj, size_t *len, char *err, size_t errn) {
  *obj = NULL;
  *len = 0;
  compiling = module_name(mod);
  int rc = verify(mod, err, errn) || run_passes(mod, tm, NULL, err, errn) || emit_object(tm, mod, obj, len, err, errn) ? -1 : 0;
  compiling = NULL;
  return rc;
}

int jit_emit(cg_module *m, const char *passes, unsigned dump, FILE *dump_to, double *opt_ms, double *codegen_ms,
             void **obj, size_t *len, char *err, size_t errn) {
  char scratch[1];
  if (!err || !errn) err = scratch, errn = sizeof scratch;
  if (opt_ms) *opt_ms = 0;
  if (codegen_ms) *codegen_ms = 0;
  *obj = NULL;
  *len = 0;
  LLVMTargetMachineRef tm = NULL;
  int rc = -1;
  if (jit_init(err, errn) != 0) goto done;

  if (verify(m->mod, err, errn)) goto done;

  /* the IR passes ask the machine only for its costs, the same at every level */
  tm = host_machine();
  if (!tm) {
    snprintf(err, errn, "LLVM: no target machine for %s (%s)", host.triple, host.cpu);
    goto done;
  }
  compiling = module_name(m->mod);
  double t0 = now_ms();
  if (run_passes(m->mod, tm, passes, err, errn)) goto done;
  if (opt_ms) *opt_ms = now_ms() - t0;
  if (quick_codegen(m->mod)) {
    LLVMDisposeTargetMachine(tm);
    if (!(tm = host_machine_at(LLVMCodeGenLevelNone))) {
      snprintf(err, errn, "LLVM: no target machine for %s (%s)", host.triple, host.cpu);
      goto done;
    }
  }
  if (dump & (KILN_DUMP_LLVM | KILN_DUMP_ASM)) dump_module(m->mod, tm, dump, dump_to ? dump_to : stderr);

  double t1 = now_ms();
  if (emit_object(tm, m->mod, obj, len, err, errn)) goto done;
  if (codegen_ms) *codegen_ms = now_ms() - t1;
  rc = 0;
done:
  compiling = NULL;
  if (tm) LLVMDisposeTargetMachine(tm);
  jit_module_dispose(m);
  return rc;
}

cg_jit *jit_new(char *err, size_t errn) {
  char scratch[1];
  if (!err || !errn) err = scratch, errn = sizeof scratch;
  if (jit_init(err, errn) != 0) return NULL;
  cg_jit *j = alloc_calloc(1, sizeof *j);
  if (!j) {
    snprintf(err, errn, "jit_new: out of memory");
    return NULL;
  }
  j->lljit = lljit_new(j, err, errn);
  if (!j->lljit) {
    alloc_free(j);
    return NULL;
  }
  return j;
}

int jit_add(cg_jit *j, const void *obj, size_t len, const char *what, char *err, size_t errn) {
  char scratch[1];
  if (!err || !errn) err = scratch, errn = sizeof scratch;
  LLVMMemoryBufferRef buf = LLVMCreateMemoryBufferWithMemoryRangeCopy(obj, len, what);
  if (!buf) {
    snprintf(err, errn, "jit_add: out of memory");
    return -1;
  }
  /* the JIT owns buf from here, on failure too */
  LLVMErrorRef e = LLVMOrcLLJITAddObjectFile(j->lljit, LLVMOrcLLJITGetMainJITDylib(j->lljit), buf);
  if (e) {
    error_text(e, "LLJIT add object", err, errn);
    return -1;
  }
  return 0;
}

int jit_link(cg_jit *j, char *err, size_t errn) {
  char scratch[1];
  if (!err || !errn) err = scratch, errn = sizeof scratch;
  /* the first lookup of an object's function links the object */
  for (int i = 0; i < j->n_sym; i++) {
    LLVMOrcExecutorAddress addr = 0;
    LLVMErrorRef e = LLVMOrcLLJITLookup(j->lljit, &addr, j->sym[i].name);
    if (e) {
      /* the session's report names the missing symbol; the lookup's only
       * says that materializing failed */
      if (j->session_err[0]) {
        LLVMConsumeError(e);
        snprintf(err, errn, "%s (linking %s)", j->session_err, j->sym[i].name);
      } else {
        error_text(e, "LLJIT", err, errn);
      }
      return -1;
    }
    j->sym[i].addr = (void *)(uintptr_t)addr;
  }
  perf_map_write(j);
  return 0;
}

cg_jit *jit_compile(cg_module *m, unsigned dump, FILE *dump_to, double *opt_ms, double *codegen_ms, char *err,
                    size_t errn) {
  char scratch[1];
  if (!err || !errn) err = scratch, errn = sizeof scratch;
  if (opt_ms) *opt_ms = 0;
  if (codegen_ms) *codegen_ms = 0;
  cg_jit *j = jit_new(err, errn);
  if (!j) {
    jit_module_dispose(m);
    return NULL;
  }
  if (expect_defined(j, m->mod)) {
    snprintf(err, errn, "jit_compile: out of memory");
    jit_module_dispose(m);
    jit_free(j);
    return NULL;
  }
  char name[256];
  snprintf(name, sizeof name, "%s", module_name(m->mod));
  void *obj = NULL;
  size_t len = 0;
  if (jit_emit(m, NULL, dump, dump_to, opt_ms, codegen_ms, &obj, &len, err, errn)) {
    jit_free(j);
    return NULL;
  }
  double t0 = now_ms();
  int rc = jit_add(j, obj, len, name, err, errn);
  alloc_free(obj);
  if (rc || jit_link(j, err, errn)) {
    jit_free(j);
    return NULL;
  }
  if (codegen_ms) *codegen_ms += now_ms() - t0;
  return j;
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
  for (int i = 0; i < j->n_sym; i++) alloc_free(j->sym[i].name), alloc_free(j->sym[i].display);
  alloc_free(j->sym);
  alloc_free(j);
}
