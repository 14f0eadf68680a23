/* A loop kernel's key: its unoptimized LLVM function written out in a form
 * where what differs between kernels of the same code (the function's
 * name, metadata and value numbers) is canonical, then which of its
 * accesses share a buffer (their alias scopes). Kernels with equal keys
 * run the same code. The key is a walk of the function through the C API:
 * instructions with their types, operands, flags and metadata, constants
 * by value. LLVM's own printer gave the same keys, and took 40% of a
 * cached compile of the GPT step (most of it in formatting); it is still
 * the key of a function the walk does not know (a "T" key), and the test
 * build checks that both agree on which kernels are the same. */
#include <stdint.h>
#include <string.h>

#include "codegen/codegen.h"

typedef struct keybuf {
  char *s;
  size_t n, cap;
  bool bad; /* out of memory, or something the walk does not know */
} keybuf;

static void put(keybuf *b, const char *s, size_t n) {
  if (b->bad) return;
  if (b->n + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap * 2 : 4096;
    while (cap < b->n + n + 1) cap *= 2;
    char *ns = alloc_realloc(b->s, cap);
    if (!ns) {
      b->bad = true;
      return;
    }
    b->s = ns, b->cap = cap;
  }
  memcpy(b->s + b->n, s, n);
  b->n += n;
  b->s[b->n] = 0;
}

static void puts_(keybuf *b, const char *s) { put(b, s, strlen(s)); }

static void putc_(keybuf *b, char c) { put(b, &c, 1); }

static void putnum(keybuf *b, int64_t v) {
  char t[24];
  int n = 0;
  uint64_t u = v < 0 ? 0 - (uint64_t)v : (uint64_t)v;
  do t[n++] = (char)('0' + u % 10); while (u /= 10);
  if (v < 0) putc_(b, '-');
  while (n) putc_(b, t[--n]);
}

/* ---- values to numbers: instructions, blocks and arguments by their place ---- */

typedef struct vmap {
  LLVMValueRef *key;
  int *val;
  size_t cap; /* a power of two */
} vmap;

static size_t slot(const vmap *m, LLVMValueRef v) {
  size_t h = ((uintptr_t)v >> 4) * 0x9E3779B97F4A7C15ull, i = h & (m->cap - 1);
  while (m->key[i] && m->key[i] != v) i = (i + 1) & (m->cap - 1);
  return i;
}

static void vmap_put(vmap *m, LLVMValueRef v, int x) {
  size_t i = slot(m, v);
  m->key[i] = v, m->val[i] = x;
}

static int vmap_get(const vmap *m, LLVMValueRef v) {
  size_t i = slot(m, v);
  return m->key[i] ? m->val[i] : -1;
}

/* ---- types, constants, metadata ---- */

static void put_type(keybuf *b, LLVMTypeRef t) {
  switch (LLVMGetTypeKind(t)) {
  case LLVMVoidTypeKind: putc_(b, 'v'); return;
  case LLVMHalfTypeKind: putc_(b, 'h'); return;
  case LLVMFloatTypeKind: putc_(b, 'f'); return;
  case LLVMDoubleTypeKind: putc_(b, 'd'); return;
  case LLVMLabelTypeKind: putc_(b, 'l'); return;
  case LLVMMetadataTypeKind: putc_(b, 'm'); return;
  case LLVMIntegerTypeKind: putc_(b, 'i'), putnum(b, LLVMGetIntTypeWidth(t)); return;
  case LLVMPointerTypeKind: putc_(b, 'p'), putnum(b, LLVMGetPointerAddressSpace(t)); return;
  case LLVMVectorTypeKind:
    putc_(b, '<'), putnum(b, LLVMGetVectorSize(t)), putc_(b, 'x'), put_type(b, LLVMGetElementType(t)), putc_(b, '>');
    return;
  case LLVMArrayTypeKind:
    putc_(b, '['), putnum(b, (int64_t)LLVMGetArrayLength2(t)), putc_(b, 'x'), put_type(b, LLVMGetElementType(t)), putc_(b, ']');
    return;
  default:
    b->bad = true;
  }
}

typedef struct walk {
  keybuf *b;
  vmap vals;          /* instructions, blocks, arguments */
  LLVMValueRef *mds;  /* metadata nodes in the order first written */
  int n_mds, cap_mds;
  LLVMContextRef cx;
} walk;

static void put_value(walk *w, LLVMValueRef v);

/* A metadata node: its operands the first time, ^n after (loop ids refer to themselves). */
static void put_md(walk *w, LLVMValueRef v) {
  keybuf *b = w->b;
  if (!v) {
    putc_(b, '_');
    return;
  }
  if (LLVMIsAMDString(v)) {
    unsigned len;
    const char *s = LLVMGetMDString(v, &len);
    if (s && memchr(s, 0, len)) b->bad = true; /* keys are C strings */
    putc_(b, '"'), putnum(b, len), putc_(b, ':'), put(b, s ? s : "", len);
    return;
  }
  if (!LLVMIsAMDNode(v)) {
    put_value(w, v); /* a constant inside metadata */
    return;
  }
  for (int i = 0; i < w->n_mds; i++)
    if (w->mds[i] == v) {
      putc_(b, '^'), putnum(b, i);
      return;
    }
  if (w->n_mds == w->cap_mds) {
    int cap = w->cap_mds ? 2 * w->cap_mds : 16;
    LLVMValueRef *nm = alloc_realloc(w->mds, sizeof *nm * (size_t)cap);
    if (!nm) {
      b->bad = true;
      return;
    }
    w->mds = nm, w->cap_mds = cap;
  }
  w->mds[w->n_mds++] = v;
  unsigned n = LLVMGetMDNodeNumOperands(v);
  LLVMValueRef ops[160]; /* a noalias list names every other access: at most 64 */
  if (n > 160) {
    b->bad = true;
    return;
  }
  LLVMGetMDNodeOperands(v, ops);
  putc_(b, '(');
  for (unsigned i = 0; i < n && !b->bad; i++) put_md(w, ops[i]), putc_(b, ',');
  putc_(b, ')');
}

static void put_value(walk *w, LLVMValueRef v) {
  keybuf *b = w->b;
  if (!v) {
    putc_(b, '_');
    return;
  }
  int id = vmap_get(&w->vals, v);
  if (id >= 0) {
    putc_(b, '%'), putnum(b, id);
    return;
  }
  if (LLVMIsAFunction(v)) { /* a callee: an intrinsic or a runtime helper, by name */
    size_t len;
    const char *s = LLVMGetValueName2(v, &len);
    putc_(b, '@'), put(b, s, len);
    return;
  }
  if (LLVMIsAMDNode(v) || LLVMIsAMDString(v)) {
    put_md(w, v);
    return;
  }
  if (!LLVMIsAConstant(v)) {
    b->bad = true;
    return;
  }
  LLVMTypeRef t = LLVMTypeOf(v);
  if (LLVMIsAConstantInt(v)) {
    if (LLVMGetIntTypeWidth(t) > 64) {
      b->bad = true;
      return;
    }
    putc_(b, 'c'), put_type(b, t), putc_(b, ':'), putnum(b, LLVMConstIntGetSExtValue(v));
  } else if (LLVMIsAConstantFP(v)) {
    LLVMBool loses;
    double d = LLVMConstRealGetDouble(v, &loses); /* exact for float and double */
    uint64_t bits;
    memcpy(&bits, &d, sizeof bits);
    putc_(b, 'r'), put_type(b, t), putc_(b, ':'), putnum(b, (int64_t)bits);
  } else if (LLVMIsPoison(v)) {
    putc_(b, 'P'), put_type(b, t);
  } else if (LLVMIsUndef(v)) {
    putc_(b, 'U'), put_type(b, t);
  } else if (LLVMIsAConstantPointerNull(v)) {
    putc_(b, 'N'), put_type(b, t);
  } else if (LLVMIsAConstantAggregateZero(v)) {
    putc_(b, 'Z'), put_type(b, t);
  } else if (LLVMIsAConstantDataVector(v) || LLVMIsAConstantVector(v)) {
    unsigned n = LLVMGetVectorSize(t);
    putc_(b, 'C'), put_type(b, t), putc_(b, '{');
    for (unsigned i = 0; i < n && !b->bad; i++) put_value(w, LLVMGetAggregateElement(v, i)), putc_(b, ',');
    putc_(b, '}');
  } else if (LLVMIsAConstantExpr(v)) { /* sizeof: ptrtoint (gep null, 1) */
    LLVMOpcode op = LLVMGetConstOpcode(v);
    putc_(b, 'E'), putnum(b, op), put_type(b, t);
    if (op == LLVMGetElementPtr) putc_(b, 'g'), putnum(b, LLVMGEPGetNoWrapFlags(v)), put_type(b, LLVMGetGEPSourceElementType(v));
    putc_(b, '(');
    for (int i = 0; i < LLVMGetNumOperands(v) && !b->bad; i++) put_value(w, LLVMGetOperand(v, (unsigned)i)), putc_(b, ',');
    putc_(b, ')');
  } else {
    b->bad = true; /* a global: lowering makes none */
  }
}

static void put_attrs(walk *w, LLVMValueRef f, LLVMAttributeIndex idx, bool call) {
  keybuf *b = w->b;
  unsigned n = call ? LLVMGetCallSiteAttributeCount(f, idx) : LLVMGetAttributeCountAtIndex(f, idx);
  if (!n) return;
  LLVMAttributeRef at[32];
  if (n > 32) {
    b->bad = true;
    return;
  }
  if (call) LLVMGetCallSiteAttributes(f, idx, at);
  else LLVMGetAttributesAtIndex(f, idx, at);
  putc_(b, 'A'), putnum(b, (int64_t)idx), putc_(b, '{');
  for (unsigned i = 0; i < n; i++) {
    if (LLVMIsStringAttribute(at[i])) {
      unsigned kl, vl;
      const char *k = LLVMGetStringAttributeKind(at[i], &kl), *v = LLVMGetStringAttributeValue(at[i], &vl);
      putc_(b, 's'), putnum(b, kl), putc_(b, ':'), put(b, k, kl), putnum(b, vl), putc_(b, ':'), put(b, v, vl);
    } else if (LLVMIsTypeAttribute(at[i])) {
      putc_(b, 't'), putnum(b, LLVMGetEnumAttributeKind(at[i])), put_type(b, LLVMGetTypeAttributeValue(at[i]));
    } else {
      putc_(b, 'e'), putnum(b, LLVMGetEnumAttributeKind(at[i])), putc_(b, '='), putnum(b, (int64_t)LLVMGetEnumAttributeValue(at[i]));
    }
    putc_(b, ';');
  }
  putc_(b, '}');
}

static void put_inst(walk *w, LLVMValueRef in) {
  keybuf *b = w->b;
  LLVMOpcode op = LLVMGetInstructionOpcode(in);
  putc_(b, '\n'), putnum(b, op), putc_(b, ' '), put_type(b, LLVMTypeOf(in));
  int n = LLVMGetNumOperands(in);
  for (int i = 0; i < n && !b->bad; i++) putc_(b, ' '), put_value(w, LLVMGetOperand(in, (unsigned)i));
  switch (op) {
  case LLVMAdd: case LLVMSub: case LLVMMul: case LLVMShl:
    putc_(b, 'w'), putnum(b, LLVMGetNSW(in) * 2 + LLVMGetNUW(in));
    break;
  case LLVMSDiv: case LLVMUDiv: case LLVMLShr: case LLVMAShr:
    putc_(b, 'x'), putnum(b, LLVMGetExact(in));
    break;
  case LLVMOr:
    putc_(b, 'j'), putnum(b, LLVMGetIsDisjoint(in));
    break;
  case LLVMZExt:
    putc_(b, 'n'), putnum(b, LLVMGetNNeg(in));
    break;
  case LLVMICmp:
    putc_(b, 'q'), putnum(b, LLVMGetICmpPredicate(in));
    break;
  case LLVMFCmp:
    putc_(b, 'q'), putnum(b, LLVMGetFCmpPredicate(in));
    break;
  case LLVMLoad: case LLVMStore:
    putc_(b, 'a'), putnum(b, LLVMGetAlignment(in)), putc_(b, 'v'), putnum(b, LLVMGetVolatile(in));
    break;
  case LLVMAlloca:
    putc_(b, 'a'), putnum(b, LLVMGetAlignment(in)), put_type(b, LLVMGetAllocatedType(in));
    break;
  case LLVMGetElementPtr:
    putc_(b, 'g'), putnum(b, LLVMGEPGetNoWrapFlags(in)), put_type(b, LLVMGetGEPSourceElementType(in));
    break;
  case LLVMPHI:
    for (unsigned i = 0; i < LLVMCountIncoming(in); i++) putc_(b, ' '), put_value(w, LLVMBasicBlockAsValue(LLVMGetIncomingBlock(in, i)));
    break;
  case LLVMCall:
    putc_(b, 't'), putnum(b, LLVMGetTailCallKind(in));
    put_attrs(w, in, LLVMAttributeFunctionIndex, true);
    for (unsigned i = 0; i <= LLVMGetNumArgOperands(in); i++) put_attrs(w, in, i, true);
    break;
  case LLVMBr: case LLVMRet: case LLVMSelect: case LLVMFAdd: case LLVMFSub: case LLVMFMul: case LLVMFDiv: case LLVMFRem:
  case LLVMFNeg: case LLVMSRem: case LLVMURem: case LLVMAnd: case LLVMXor: case LLVMTrunc: case LLVMSExt:
  case LLVMFPTrunc: case LLVMFPExt: case LLVMSIToFP: case LLVMUIToFP: case LLVMFPToSI: case LLVMFPToUI: case LLVMBitCast:
  case LLVMPtrToInt: case LLVMIntToPtr: case LLVMInsertElement: case LLVMExtractElement: case LLVMShuffleVector:
  case LLVMUnreachable:
    break;
  default:
    b->bad = true; /* an instruction lowering does not make */
  }
  if (op == LLVMShuffleVector) {
    unsigned m = LLVMGetNumMaskElements(in);
    for (unsigned i = 0; i < m; i++) putc_(b, ','), putnum(b, LLVMGetMaskValue(in, i));
  }
  if (LLVMCanValueUseFastMathFlags(in)) putc_(b, 'F'), putnum(b, LLVMGetFastMathFlags(in));
  size_t nmd = 0;
  LLVMValueMetadataEntry *md = LLVMInstructionGetAllMetadataOtherThanDebugLoc(in, &nmd);
  for (size_t i = 0; i < nmd && !b->bad; i++) {
    putc_(b, '!'), putnum(b, LLVMValueMetadataEntriesGetKind(md, (unsigned)i)), putc_(b, '=');
    put_md(w, LLVMMetadataAsValue(w->cx, LLVMValueMetadataEntriesGetMetadata(md, (unsigned)i)));
  }
  if (md) LLVMDisposeValueMetadataEntries(md);
}

static char *walk_key(LLVMValueRef fn) {
  keybuf b = {0};
  walk w = {.b = &b, .cx = LLVMGetTypeContext(LLVMTypeOf(fn))};
  size_t count = 8;
  for (LLVMBasicBlockRef bb = LLVMGetFirstBasicBlock(fn); bb; bb = LLVMGetNextBasicBlock(bb)) {
    count++;
    for (LLVMValueRef in = LLVMGetFirstInstruction(bb); in; in = LLVMGetNextInstruction(in)) count++;
  }
  count += LLVMCountParams(fn);
  w.vals.cap = 16;
  while (w.vals.cap < 2 * count) w.vals.cap *= 2;
  w.vals.key = alloc_calloc(w.vals.cap, sizeof *w.vals.key);
  w.vals.val = alloc_calloc(w.vals.cap, sizeof *w.vals.val);
  if (!w.vals.key || !w.vals.val) b.bad = true;
  /* numbers: the arguments, then each block and its instructions in order */
  int id = 0;
  for (unsigned i = 0; !b.bad && i < LLVMCountParams(fn); i++) vmap_put(&w.vals, LLVMGetParam(fn, i), id++);
  for (LLVMBasicBlockRef bb = LLVMGetFirstBasicBlock(fn); !b.bad && bb; bb = LLVMGetNextBasicBlock(bb)) {
    vmap_put(&w.vals, LLVMBasicBlockAsValue(bb), id++);
    for (LLVMValueRef in = LLVMGetFirstInstruction(bb); in; in = LLVMGetNextInstruction(in)) vmap_put(&w.vals, in, id++);
  }
  puts_(&b, "W1 ");
  put_type(&b, LLVMGetReturnType(LLVMGlobalGetValueType(fn)));
  for (unsigned i = 0; i < LLVMCountParams(fn); i++) putc_(&b, ' '), put_type(&b, LLVMTypeOf(LLVMGetParam(fn, i)));
  put_attrs(&w, fn, LLVMAttributeFunctionIndex, false);
  for (unsigned i = 0; i <= LLVMCountParams(fn); i++) put_attrs(&w, fn, i, false);
  for (LLVMBasicBlockRef bb = LLVMGetFirstBasicBlock(fn); !b.bad && bb; bb = LLVMGetNextBasicBlock(bb)) {
    puts_(&b, "\nB");
    for (LLVMValueRef in = LLVMGetFirstInstruction(bb); in && !b.bad; in = LLVMGetNextInstruction(in)) put_inst(&w, in);
  }
  alloc_free(w.vals.key), alloc_free(w.vals.val), alloc_free(w.mds);
  if (b.bad) {
    alloc_free(b.s);
    return NULL;
  }
  return b.s;
}

/* The same from LLVM's printer, with the name and the metadata and
 * attribute numbers made canonical. */
static char *kernel_key_text(LLVMValueRef fn) {
  char *txt = LLVMPrintValueToString(fn);
  if (!txt) return NULL;
  size_t n = strlen(txt), o = 0;
  char *key = alloc_malloc(n + 2);
  enum { MAXNUM = 4096 };
  int *map = alloc_calloc(2 * MAXNUM, sizeof *map); /* ! then #: old number -> new + 1 */
  int next[2] = {0, 0};
  bool ok = key && map;
  const char *name = LLVMGetValueName(fn);
  size_t nl = strlen(name);
  if (ok) key[o++] = 'T';
  for (size_t i = 0; ok && i < n;) {
    if (txt[i] == '@' && !strncmp(txt + i + 1, name, nl) && txt[i + 1 + nl] == '(') {
      memcpy(key + o, "@k(", 3), o += 3, i += nl + 2;
    } else if ((txt[i] == '!' || txt[i] == '#') && i + 1 < n && txt[i + 1] >= '0' && txt[i + 1] <= '9') {
      int kind = txt[i] == '#', v = 0;
      size_t j = i + 1;
      while (j < n && txt[j] >= '0' && txt[j] <= '9' && v < MAXNUM) v = v * 10 + (txt[j++] - '0');
      if (v >= MAXNUM) ok = false;
      else {
        if (!map[kind * MAXNUM + v]) map[kind * MAXNUM + v] = ++next[kind];
        /* the new number is never longer than the old: it counts distinct ones seen */
        o += (size_t)snprintf(key + o, n + 2 - o, "%c%d", txt[i], map[kind * MAXNUM + v] - 1);
        i = j;
      }
    } else {
      key[o++] = txt[i++];
    }
  }
  LLVMDisposeMessage(txt);
  alloc_free(map);
  if (!ok) {
    alloc_free(key);
    return NULL;
  }
  key[o] = 0;
  return key;
}

char *kernel_key(LLVMValueRef fn, const cg_kernel *k, bool text) {
  char *body = text ? NULL : walk_key(fn);
  if (!body) body = kernel_key_text(fn);
  if (!body) return NULL;
  keybuf b = {.s = body, .n = strlen(body), .cap = strlen(body) + 1};
  for (int a = 0; a < k->n_acc; a++) putc_(&b, '|'), putnum(&b, cg_first_access(k, a));
  if (b.bad) {
    alloc_free(b.s);
    return NULL;
  }
  return b.s;
}
