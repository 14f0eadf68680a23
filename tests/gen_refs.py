#!/usr/bin/python3
"""Reference cases for tests/test_ops_ref.c, computed with numpy.

Usage: /usr/bin/python3 tests/gen_refs.py OUTDIR   (writes OUTDIR/ops.txt)

numpy is the oracle for the eager ops. Every case is an op name, attributes,
inputs and expected outputs. An input is a contiguous base array plus a list of
view transforms (transpose, permute, slice, expand) that the C side replays
with kiln's view ops, so ops see non-contiguous operands; numpy applies the
same views before computing the reference. Floats are written as hex floats
(float.hex) so they round-trip exactly; f32 data is exactly representable.

File format (whitespace separated tokens):
  case FAMILY OP
  attr NAME N V1..VN                  numbers, or dtype names (f32 f64 i64 bool)
  in DTYPE NDIM D1..DN NVIEWS VIEW... VALUES    (row-major values of the base)
     VIEW: transpose D0 D1 | permute N P1..PN | slice DIM START END STEP
         | expand N D1..DN
  out DTYPE NDIM D1..DN VALUES
  VALUES are the numbers, or 'gen A B M C S' (inputs: see formula()), or
  'bin OFFSET': raw little-endian values at that byte offset of OUTDIR/big.bin
  (bool as one byte), for large expected outputs.
  tol RTOL ATOL                       pass when |got-exp| <= atol + rtol*|exp|
  end

Semantics the references follow (the contract kiln is held to):
  - inputs of a binary op share a dtype; the result has it, except comparisons,
    which return bool. div on i64 is an error, so it is not generated.
  - sum of i64 is i64; mean and var of f32 are f32; argmax returns the i64
    index of the first maximum. var(correction=c) = sum((x-mean)^2)/(N-c).
  - max/min over an empty reduced dim, and mean/var over one, are not generated.
  - gelu is the tanh form 0.5*x*(1+tanh(0.7978845608*(x+0.044715*x^3)));
    gelu_erf is 0.5*x*(1+erf(x/sqrt(2))); rsqrt = 1/sqrt; relu = max(x, 0);
    sigmoid = 1/(1+exp(-x)).
  - layer_norm normalizes the last dim with the biased variance:
    (x-mean)/sqrt(var+eps)*w+b.
  - embedding(table (V,C), idx) -> idx.shape+(C,); index_select(a, dim, idx 1-D).
  - cross_entropy(logits (N,C), targets (N,)) = mean_n -log_softmax(logits)[n, t_n];
    mse_loss(a, b) = mean((a-b)^2) over the broadcast shape; both are 0-d.
  - matmul follows numpy.matmul (1-D, 2-D, batched with broadcast batch dims).
  - cast: float->i64 truncates toward zero; anything->bool is x != 0.
  - arange(start, stop, step) has ceil((stop-start)/step) elements start+i*step.
  - in-place ops: outputs are the returned tensor and the whole base tensor the
    destination view was made from (so writes through strided views are checked).
"""
import math
import os
import sys

import numpy as np

SEED = 20240611
NP = {"f32": np.float32, "f64": np.float64, "i64": np.int64, "bool": np.bool_, "f16": np.float16, "i32": np.int32}
FLOATS = ("f32", "f64")
NARROW = ("f16", "bf16")   # their own family (narrow_family), so the cases above keep their random streams


class BF16(np.ndarray):
    """float64 values that are bfloat16 numbers (numpy has no bfloat16): see bf16_round."""


def bf16_round(x):
    """x rounded to bfloat16: 8 significant bits, ties to even (np.round), as a BF16 array."""
    x = np.asarray(x, dtype=np.float64)
    m, e = np.frexp(x)
    r = np.where(np.isfinite(x), np.ldexp(np.round(np.ldexp(m, 8)), e - 8), x)
    return np.asarray(r).view(BF16)

GELU_C = 0.7978845608
GELU_A = 0.044715
_erf = np.vectorize(math.erf, otypes=[np.float64])


def dtname(a):
    if isinstance(a, BF16):
        return "bf16"
    for k, v in NP.items():
        if a.dtype == v:
            return k
    raise ValueError(a.dtype)


def fmt_values(a):
    flat = np.ascontiguousarray(a).reshape(-1)
    dt = dtname(a)
    if dt in FLOATS + NARROW:
        return " ".join(float(x).hex() for x in flat.tolist())
    if dt == "bool":
        return " ".join("1" if x else "0" for x in flat.tolist())
    return " ".join(str(int(x)) for x in flat.tolist())


def fmt_num(x):
    if isinstance(x, str):
        return x
    if isinstance(x, (bool, np.bool_)):
        return "1" if x else "0"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    return float(x).hex()


# ---- inputs: a base array plus view transforms -----------------------------

def apply_view(a, v):
    kind = v[0]
    if kind == "transpose":
        return np.swapaxes(a, v[1], v[2])
    if kind == "permute":
        return np.transpose(a, v[1])
    if kind == "slice":
        idx = [slice(None)] * a.ndim
        idx[v[1]] = slice(v[2], v[3], v[4])
        return a[tuple(idx)]
    if kind == "expand":
        return np.broadcast_to(a, tuple(v[1]))
    raise ValueError(kind)


class Input:
    def __init__(self, base, views=(), gen=None):
        self.base = np.array(base, order="C", subok=True)   # keeps 0-d arrays 0-d, BF16 BF16
        self.views = list(views)
        self.gen = gen                          # (A, B, M, C, S): see formula()

    def value(self):
        a = self.base
        for v in self.views:
            a = apply_view(a, v)
        return a

    def text(self):
        b = self.base
        parts = ["in", dtname(b), str(b.ndim)] + [str(d) for d in b.shape]
        parts.append(str(len(self.views)))
        for v in self.views:
            if v[0] == "transpose":
                parts += ["transpose", str(v[1]), str(v[2])]
            elif v[0] == "permute":
                parts += ["permute", str(len(v[1]))] + [str(p) for p in v[1]]
            elif v[0] == "slice":
                parts += ["slice"] + [str(int(x)) for x in v[1:]]
            elif v[0] == "expand":
                parts += ["expand", str(len(v[1]))] + [str(d) for d in v[1]]
        if self.gen:
            return " ".join(parts + ["gen"] + [fmt_num(x) for x in self.gen])
        vals = fmt_values(b)
        return " ".join(parts) + ((" " + vals) if vals else "")


def formula(dt, shape, a, b, m, c, s):
    """Element i of the base is ((i*a + b) % m - c) * s in exact integer
    arithmetic (bool: > 0), so C rebuilds large inputs from five numbers. With
    s a power of two and small m the values are exact in f32, and so are their
    sums while they stay below 2^24 * s."""
    n = int(np.prod(shape)) if shape else 1
    k = (np.arange(n, dtype=np.int64) * a + b) % m - c
    if dt == "bool":
        v = k > 0
    elif dt == "i64":
        v = k * int(s)
    else:
        v = (k.astype(np.float64) * s).astype(NP[dt])
    return Input(v.reshape(shape), gen=(a, b, m, c, s))


def pre_shape(rng, shape, layout):
    """The shape before one view of kind `layout`, and that view."""
    r = len(shape)
    shape = list(shape)
    if layout == "transpose":
        d0, d1 = sorted(rng.choice(r, 2, replace=False).tolist())
        s = list(shape)
        s[d0], s[d1] = s[d1], s[d0]
        return s, ("transpose", d0, d1)
    if layout == "permute":
        while True:
            p = rng.permutation(r).tolist()
            if p != list(range(r)):
                break
        s = [0] * r
        for i in range(r):
            s[p[i]] = shape[i]
        return s, ("permute", p)
    if layout == "slice":
        d = int(rng.integers(r))
        n = shape[d]
        s0 = int(rng.integers(0, 2))
        length = s0 + 2 * n
        ends = [length, length + 3] + ([-1] if n >= 1 else [])
        end = ends[int(rng.integers(len(ends)))]
        # a negative start names the same element when the slice is non-empty
        start = s0 - length if n >= 1 and rng.random() < 0.3 else s0
        s = list(shape)
        s[d] = length
        return s, ("slice", d, start, end, 2)
    if layout == "expand":
        s = [1 if rng.random() < 0.5 else shape[i] for i in range(r)]
        drop = int(rng.integers(0, r + 1)) if rng.random() < 0.4 else 0
        return s[drop:], ("expand", list(shape))
    raise ValueError(layout)


def layouts_for(rank, rng, allow_expand=True):
    opts = [[]]
    if rank >= 1:
        opts += [["slice"]]
        if allow_expand:
            opts += [["expand"]]
    if rank >= 2:
        opts += [["transpose"], ["transpose", "slice"]]
    if rank >= 3:
        opts += [["permute"]]
    return opts[int(rng.integers(len(opts)))]


def make_input(rng, shape, gen, layouts=None, allow_expand=True):
    """An Input whose value has `shape`; gen(shape) makes base data."""
    if layouts is None:
        # about half the operands are plain contiguous
        layouts = [] if rng.random() < 0.45 else layouts_for(len(shape), rng, allow_expand)
    shape = list(shape)
    views = []
    for layout in reversed(layouts):
        shape, v = pre_shape(rng, shape, layout)
        views.insert(0, v)
    return Input(gen(tuple(shape)), views)


# ---- value generators -------------------------------------------------------

def g_normal(rng, dt, scale=1.0, shift=0.0):
    return lambda s: (rng.standard_normal(s) * scale + shift).astype(NP[dt])


def g_uniform(rng, dt, lo, hi):
    return lambda s: rng.uniform(lo, hi, s).astype(NP[dt])


def g_grid(rng, dt):
    """Few distinct values, so comparisons and argmax meet ties."""
    if dt == "i64":
        return lambda s: rng.integers(-3, 4, s).astype(np.int64)
    return lambda s: (rng.integers(-4, 5, s) / 2.0).astype(NP[dt])


def g_int(rng, lo=-20, hi=21):
    return lambda s: rng.integers(lo, hi, s).astype(np.int64)


def g_bool(rng):
    return lambda s: rng.random(s) < 0.5


def g_default(rng, dt):
    if dt == "i64":
        return g_int(rng)
    if dt == "bool":
        return g_bool(rng)
    return g_normal(rng, dt)


def g_nonzero(rng, dt, lo=0.5, hi=2.0):
    def f(s):
        mag = rng.uniform(lo, hi, s)
        sign = np.where(rng.random(s) < 0.5, -1.0, 1.0)
        return (mag * sign).astype(NP[dt])
    return f


# ---- shapes -----------------------------------------------------------------

def rand_dim(rng, allow0=True):
    if allow0 and rng.random() < 0.06:
        return 0
    return int(rng.choice([1, 2, 3, 4, 5], p=[0.2, 0.25, 0.25, 0.15, 0.15]))


def rand_shape(rng, rmin=0, rmax=4, allow0=True):
    r = int(rng.integers(rmin, rmax + 1))
    return [rand_dim(rng, allow0) for _ in range(r)]


def derive(rng, out):
    """A shape that broadcasts to `out`: leading dims dropped, some dims 1."""
    drop = int(rng.integers(0, len(out) + 1)) if rng.random() < 0.4 else 0
    return [1 if rng.random() < 0.3 else d for d in out[drop:]]


BCAST_PAIRS = [
    ([], [3, 4]), ([3, 4], []), ([3, 1], [1, 4]), ([2, 1, 5], [4, 1]),
    ([4, 1], [2, 1, 5]), ([], []), ([1], []), ([0], [1]), ([2, 0, 3], [3]),
    ([2, 0, 3], [1, 1]), ([5], [5]), ([1, 1, 1, 1], [3]), ([2, 3, 4, 5], [2, 3, 4, 5]),
    ([3, 1, 4, 1], [2, 1, 5]), ([1, 4], [3, 1]), ([4], [2, 3, 4]),
]


def bshape(*shapes):
    return list(np.broadcast_shapes(*[tuple(s) for s in shapes]))


# ---- tolerances -------------------------------------------------------------

EXACT = (0.0, 0.0)


def tol(dt, kind="transc"):
    if dt not in FLOATS:
        return EXACT
    table = {
        # correctly rounded in IEEE arithmetic; a little slack for fused or
        # reciprocal-based kernels
        "arith": {"f32": (2e-6, 1e-30), "f64": (1e-14, 1e-300)},
        "transc": {"f32": (1e-5, 1e-6), "f64": (1e-10, 1e-12)},
        "reduce": {"f32": (1e-5, 1e-5), "f64": (1e-12, 1e-12)},
        "norm": {"f32": (1e-4, 2e-5), "f64": (1e-11, 1e-11)},
    }
    return table[kind][dt]


def tol_matmul(dt, k):
    s = max(1.0, math.sqrt(k))
    return (1e-5, 2e-5 * s) if dt == "f32" else (1e-12, 1e-12 * s)


def ref(x, dt):
    """A float64 reference rounded to dtype dt."""
    return np.asarray(x).astype(NP[dt])


def f64(a):
    return np.asarray(a).astype(np.float64)


# ---- the case file ----------------------------------------------------------

BIN_MIN = 2048   # outputs with more elements go to big.bin


class Writer:
    def __init__(self):
        self.lines = []
        self.count = {}
        self.bin = bytearray()

    def case(self, family, op, inputs, outputs, attrs=None, tolerance=EXACT):
        self.lines.append("case %s %s" % (family, op))
        for name, vals in (attrs or {}).items():
            if not isinstance(vals, (list, tuple)):
                vals = [vals]
            line = "attr %s %d %s" % (name, len(vals), " ".join(fmt_num(v) for v in vals))
            self.lines.append(line.rstrip())
        for inp in inputs:
            self.lines.append(inp.text())
        for out in outputs:
            out = np.asanyarray(out)
            head = "out %s %d %s" % (dtname(out), out.ndim, " ".join(str(d) for d in out.shape))
            if out.size > BIN_MIN:
                vals = "bin %d" % len(self.bin)
                le = out.dtype.newbyteorder("<") if out.dtype != np.bool_ else np.uint8
                self.bin += np.ascontiguousarray(out).astype(le).tobytes()
            else:
                vals = fmt_values(out)
            self.lines.append((head.rstrip() + " " + vals).rstrip())
        self.lines.append("tol %s %s" % (float(tolerance[0]).hex(), float(tolerance[1]).hex()))
        self.lines.append("end")
        self.count[family] = self.count.get(family, 0) + 1


# ---- families ---------------------------------------------------------------

BIN_FN = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
    "pow": np.power, "maximum": np.maximum, "minimum": np.minimum,
}
CMP_FN = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
          "gt": np.greater, "ge": np.greater_equal}


def binary_family(w, rng):
    dtypes = {"add": FLOATS + ("i64",), "sub": FLOATS + ("i64",), "mul": FLOATS + ("i64",),
              "div": FLOATS, "pow": FLOATS, "maximum": FLOATS + ("i64",),
              "minimum": FLOATS + ("i64",)}
    rot = 0
    for op, dts in dtypes.items():
        for dt in dts:
            if op == "add":
                pairs = list(BCAST_PAIRS)
            else:
                pairs = [BCAST_PAIRS[(rot + j) % len(BCAST_PAIRS)] for j in range(4)]
                rot += 4
            for _ in range(5):
                out = rand_shape(rng)
                pairs.append((derive(rng, out), derive(rng, out)))
            for sa, sb in pairs:
                ga = gb = g_default(rng, dt)
                if op == "div":
                    gb = g_nonzero(rng, dt)
                elif op in ("maximum", "minimum") and rng.random() < 0.5:
                    ga = gb = g_grid(rng, dt)
                elif op == "pow":
                    if rng.random() < 0.5:
                        # positive base, real exponent
                        ga = g_uniform(rng, dt, 0.1, 3.0)
                        gb = g_uniform(rng, dt, -2.5, 2.5)
                    else:
                        # either sign of base, integral exponent: no NaN
                        ga = g_nonzero(rng, dt, 0.25, 2.0)
                        gb = lambda s, dt=dt: rng.integers(-3, 4, s).astype(NP[dt])
                a = make_input(rng, sa, ga)
                b = make_input(rng, sb, gb)
                av, bv = a.value(), b.value()
                if dt == "i64":
                    exp = BIN_FN[op](av, bv).astype(np.int64)
                    t = EXACT
                else:
                    exp = ref(BIN_FN[op](f64(av), f64(bv)), dt)
                    t = tol(dt, "transc" if op == "pow" else "arith")
                w.case("binary", op, [a, b], [exp], tolerance=t)


def compare_family(w, rng):
    rot = 0
    for op, fn in CMP_FN.items():
        for dt in FLOATS + ("i64",):
            pairs = [BCAST_PAIRS[(rot + j) % len(BCAST_PAIRS)] for j in range(3)]
            rot += 3
            for _ in range(3):
                out = rand_shape(rng)
                pairs.append((derive(rng, out), derive(rng, out)))
            for sa, sb in pairs:
                g = g_grid(rng, dt) if rng.random() < 0.7 else g_default(rng, dt)
                a = make_input(rng, sa, g)
                b = make_input(rng, sb, g)
                exp = fn(a.value(), b.value())
                w.case("compare", op, [a, b], [exp])


def where_family(w, rng):
    fixed = [([], [3, 4], [4]), ([3, 1], [1, 4], []), ([2, 1, 5], [4, 1], [5]),
             ([0, 3], [3], [1, 1]), ([], [], []), ([4], [], [2, 1])]
    for dt in FLOATS + ("i64",):
        shapes = list(fixed)
        for _ in range(5):
            out = rand_shape(rng)
            shapes.append((derive(rng, out), derive(rng, out), derive(rng, out)))
        for sc, sa, sb in shapes:
            c = make_input(rng, sc, g_bool(rng))
            a = make_input(rng, sa, g_default(rng, dt))
            b = make_input(rng, sb, g_default(rng, dt))
            exp = np.where(c.value(), a.value(), b.value()).astype(NP[dt])
            w.case("where", "where", [c, a, b], [exp])


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(GELU_C * (x + GELU_A * x ** 3)))


UNARY = {
    # name: (reference on float64, domain generator factory, dtypes)
    "neg": (np.negative, None, FLOATS + ("i64",)),
    "abs": (np.abs, None, FLOATS + ("i64",)),
    "exp": (np.exp, (-10.0, 10.0), FLOATS),
    "log": (np.log, (0.01, 20.0), FLOATS),
    "sqrt": (np.sqrt, (0.0, 20.0), FLOATS),
    "rsqrt": (lambda x: 1.0 / np.sqrt(x), (0.01, 20.0), FLOATS),
    "tanh": (np.tanh, "wide", FLOATS),
    "sigmoid": (lambda x: 1.0 / (1.0 + np.exp(-x)), "wide", FLOATS),
    "relu": (lambda x: np.maximum(x, 0.0), None, FLOATS),
    "gelu": (gelu_tanh, "wide", FLOATS),
    "gelu_erf": (lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))), "wide", FLOATS),
    "erf": (_erf, "wide", FLOATS),
    "sin": (np.sin, (-10.0, 10.0), FLOATS),
    "cos": (np.cos, (-10.0, 10.0), FLOATS),
}


def unary_family(w, rng):
    for op, (fn, dom, dts) in UNARY.items():
        for dt in dts:
            shapes = [[], [0], [7], [3, 4], [2, 3, 4]] + [rand_shape(rng) for _ in range(3)]
            for i, s in enumerate(shapes):
                if dt == "i64":
                    g = g_int(rng)
                elif dom is None:
                    g = g_normal(rng, dt, 3.0)
                elif dom == "wide":
                    # the last shapes reach saturation, where naive formulas give NaN
                    lim = 30.0 if i >= 5 else 4.0
                    g = g_uniform(rng, dt, -lim, lim)
                else:
                    g = g_uniform(rng, dt, dom[0], dom[1])
                a = make_input(rng, s, g)
                if dt == "i64":
                    exp = fn(a.value()).astype(np.int64)
                    t = EXACT
                else:
                    exp = ref(fn(f64(a.value())), dt)
                    t = tol(dt, "arith" if op in ("neg", "abs", "relu") else "transc")
                w.case("unary", op, [a], [exp], tolerance=t)


def reduction_family(w, rng):
    def red_np(op, x, axes, keepdim, corr=0):
        ax = tuple(axes) if axes is not None else None
        if op == "sum":
            return np.sum(x, axis=ax, keepdims=keepdim)
        if op == "mean":
            return np.mean(x, axis=ax, keepdims=keepdim)
        if op == "max":
            return np.max(x, axis=ax, keepdims=keepdim)
        if op == "min":
            return np.min(x, axis=ax, keepdims=keepdim)
        if op == "var":
            return np.var(x, axis=ax, ddof=corr, keepdims=keepdim)
        raise ValueError(op)

    kinds = {"sum": FLOATS + ("i64",), "mean": FLOATS, "max": FLOATS + ("i64",),
             "min": FLOATS + ("i64",), "var": FLOATS}
    for op, dts in kinds.items():
        for dt in dts:
            for form in ("axis", "axes"):
                n_cases = 6 if form == "axis" else 7
                made = 0
                tries = 0
                while made < n_cases and tries < 500:
                    tries += 1
                    if form == "axis":
                        shape = rand_shape(rng, 1, 4)
                        r = len(shape)
                        ax = int(rng.integers(-r, r))
                        axes = [ax % r]
                        attrs_axes = ax
                    else:
                        shape = rand_shape(rng, 0, 4)
                        r = len(shape)
                        if made == 0 or r == 0 or rng.random() < 0.2:
                            axes = list(range(r))
                            attrs_axes = []          # naxes == 0: every axis
                        else:
                            k = int(rng.integers(1, r + 1))
                            axes = sorted(rng.choice(r, k, replace=False).tolist())
                            attrs_axes = [a - r if rng.random() < 0.3 else a for a in axes]
                    nred = int(np.prod([shape[a] for a in axes])) if axes else 1
                    corr = int(rng.integers(0, 3)) if op == "var" else 0
                    if op in ("max", "min") and nred == 0:
                        continue
                    if op in ("mean", "var") and nred - corr <= 0:
                        continue
                    keepdim = bool(rng.random() < 0.5)
                    g = g_default(rng, dt)
                    if op in ("max", "min") and rng.random() < 0.4:
                        g = g_grid(rng, dt)
                    a = make_input(rng, shape, g)
                    x = a.value()
                    if dt == "i64":
                        exp = red_np(op, x, axes, keepdim).astype(np.int64)
                        t = EXACT
                    else:
                        exp = ref(red_np(op, f64(x), axes, keepdim, corr), dt)
                        t = tol(dt, "norm" if op == "var" else "reduce")
                        if op == "sum":
                            # rounding grows with the count when kiln sums in the dtype
                            t = (t[0], max(t[1], (1e-6 if dt == "f32" else 1e-15) * nred))
                        if op in ("max", "min"):
                            t = EXACT
                    attrs = {"keepdim": int(keepdim)}
                    if form == "axis":
                        attrs["axis"] = attrs_axes
                    else:
                        attrs["axes"] = attrs_axes
                    if op == "var":
                        attrs["correction"] = corr
                    w.case("reduce", op if form == "axis" else op + "_axes", [a], [exp], attrs, t)
                    made += 1
        # sum_all / mean_all spelled through naxes == 0 are the _axes form above;
        # the macros kiln_sum_all/kiln_mean_all get their own op names.
    for op in ("sum_all", "mean_all"):
        for dt in FLOATS:
            for shape in ([], [5], [3, 4], [2, 3, 4]):
                a = make_input(rng, shape, g_normal(rng, dt))
                x = f64(a.value())
                exp = ref(np.sum(x) if op == "sum_all" else np.mean(x), dt)
                w.case("reduce", op, [a], [exp], tolerance=tol(dt, "reduce"))
    # argmax: first index of the maximum, ties included
    for dt in FLOATS + ("i64",):
        for i in range(9):
            shape = rand_shape(rng, 1, 4, allow0=False) if i else [6]
            r = len(shape)
            ax = int(rng.integers(-r, r))
            keepdim = bool(rng.random() < 0.5)
            g = g_grid(rng, dt) if i % 2 == 0 else g_default(rng, dt)
            a = make_input(rng, shape, g)
            exp = np.argmax(a.value(), axis=ax % r)
            if keepdim:
                exp = np.expand_dims(exp, ax % r)
            w.case("reduce", "argmax", [a], [exp.astype(np.int64)], {"axis": ax, "keepdim": int(keepdim)})
    # sums over size-0 dims are zeros
    for dt in FLOATS + ("i64",):
        a = make_input(rng, [2, 0, 3], g_default(rng, dt), layouts=[])
        w.case("reduce", "sum", [a], [np.zeros((2, 3), NP[dt])], {"axis": 1, "keepdim": 0})
        w.case("reduce", "sum_axes", [a], [np.zeros((), NP[dt])], {"axes": [], "keepdim": 0})


def matmul_family(w, rng):
    shapes = [
        ([4], [4]), ([3], [3, 5]), ([3, 5], [5]), ([2, 3], [3, 4]), ([1, 1], [1, 1]),
        ([5, 7], [7, 3]), ([2, 3, 4], [2, 4, 5]), ([2, 3, 4], [4, 5]), ([3, 4], [2, 4, 5]),
        ([2, 1, 3, 4], [5, 4, 2]), ([2, 3, 4], [4]), ([4], [2, 4, 3]),
        ([3, 0], [0, 4]), ([0, 3], [3, 4]), ([2, 3], [3, 0]), ([0, 2, 3], [3, 2]),
        ([1, 4, 3], [3, 3, 2]), ([16, 33], [33, 17]), ([8, 64], [64, 8]),
        ([2, 2, 3, 5], [2, 1, 5, 3]),
    ]
    for dt in FLOATS:
        for sa, sb in shapes:
            for variant in range(2):
                # variant 1: transposed (or sliced) operands
                la = lb = []
                if variant:
                    la = ["transpose"] if len(sa) >= 2 and rng.random() < 0.7 else (["slice"] if sa else [])
                    lb = ["transpose"] if len(sb) >= 2 and rng.random() < 0.7 else (["slice"] if sb else [])
                    if not la and not lb:
                        continue
                a = make_input(rng, sa, g_normal(rng, dt), layouts=la)
                b = make_input(rng, sb, g_normal(rng, dt), layouts=lb)
                exp = ref(np.matmul(f64(a.value()), f64(b.value())), dt)
                w.case("matmul", "matmul", [a, b], [exp], tolerance=tol_matmul(dt, sa[-1]))
        # a last-two-dims transpose, as in q @ k^T
        a = make_input(rng, [2, 5, 4], g_normal(rng, dt), layouts=[])
        b = Input(g_normal(rng, dt)((2, 6, 4)), [("transpose", 1, 2)])
        exp = ref(np.matmul(f64(a.value()), f64(b.value())), dt)
        w.case("matmul", "matmul", [a, b], [exp], tolerance=tol_matmul(dt, 4))


def log_softmax_np(x, axis):
    m = np.max(x, axis=axis, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=axis, keepdims=True))


def nn_family(w, rng):
    for op in ("softmax", "log_softmax"):
        for dt in FLOATS:
            for i in range(8):
                shape = rand_shape(rng, 1, 4, allow0=False) if i else [5]
                r = len(shape)
                ax = int(rng.integers(-r, r))
                # large offsets and scales check the max-subtraction
                shift = [0.0, 100.0, -300.0][i % 3]
                scale = 10.0 if i % 4 == 3 else 1.0
                a = make_input(rng, shape, g_normal(rng, dt, scale, shift))
                ls = log_softmax_np(f64(a.value()), ax % r)
                exp = ref(np.exp(ls) if op == "softmax" else ls, dt)
                # log_softmax values can be large: a relative bound suits them;
                # x - (max + log sum) rounds at the scale of the offset
                t = (1e-5, 3e-5 if op == "log_softmax" else 1e-6) if dt == "f32" else (1e-11, 1e-12)
                w.case("nn", op, [a], [exp], {"axis": ax}, t)
    for dt in FLOATS:
        for i, shape in enumerate([[4], [3, 5], [2, 3, 8], [2, 2, 2, 16], [1, 1], [0, 4], [3, 64], [5, 2]]):
            eps = [1e-5, 0.1, 1.0][i % 3]
            x = make_input(rng, shape, g_normal(rng, dt, 2.0, 0.5))
            xv = f64(x.value())
            mu = xv.mean(axis=-1, keepdims=True)
            var = ((xv - mu) ** 2).mean(axis=-1, keepdims=True)
            y = (xv - mu) / np.sqrt(var + eps)
            ins = [x]
            if i % 2 == 0:
                c = shape[-1]
                wt = make_input(rng, [c], g_normal(rng, dt, 0.1, 1.0))
                bs = make_input(rng, [c], g_normal(rng, dt, 0.1))
                y = y * f64(wt.value()) + f64(bs.value())
                ins += [wt, bs]
            w.case("nn", "layer_norm", ins, [ref(y, dt)], {"eps": eps}, tol(dt, "norm"))
    for dt in FLOATS:
        for ishape in ([], [4], [2, 3], [0], [2, 0, 2], [3, 1, 2]):
            v, c = int(rng.integers(1, 7)), int(rng.integers(1, 5))
            table = make_input(rng, [v, c], g_normal(rng, dt))
            idx = make_input(rng, ishape, lambda s, v=v: rng.integers(0, v, s).astype(np.int64))
            exp = table.value()[idx.value()]
            w.case("nn", "embedding", [table, idx], [exp.astype(NP[dt])])
    for dt in FLOATS + ("i64",):
        for i in range(6):
            shape = rand_shape(rng, 1, 4, allow0=(i > 2))
            d = int(rng.integers(0, len(shape)))
            if shape[d] == 0:
                shape[d] = 2
            n = int(rng.integers(0, 6))
            a = make_input(rng, shape, g_default(rng, dt))
            idx = Input(rng.integers(0, shape[d], n).astype(np.int64))
            exp = np.take(a.value(), idx.value(), axis=d)
            w.case("nn", "index_select", [a, idx], [exp], {"dim": d})
    for dt in FLOATS:
        for i, (n, c) in enumerate([(1, 2), (4, 3), (8, 10), (3, 7), (5, 5), (2, 4)]):
            scale = 20.0 if i % 3 == 2 else 1.0
            lg = make_input(rng, [n, c], g_normal(rng, dt, scale), layouts=(["transpose"] if i % 2 else []))
            tg = Input(rng.integers(0, c, n).astype(np.int64))
            ls = log_softmax_np(f64(lg.value()), 1)
            loss = -np.mean(ls[np.arange(n), tg.value()])
            w.case("nn", "cross_entropy", [lg, tg], [ref(loss, dt)], tolerance=tol(dt, "norm"))
    for dt in FLOATS:
        pairs = [([3, 4], [3, 4]), ([], [5]), ([3, 1], [1, 4]), ([2, 1, 5], [4, 1]), ([7], [7])]
        for _ in range(3):
            out = rand_shape(rng, allow0=False)
            pairs.append((derive(rng, out), derive(rng, out)))
        for sa, sb in pairs:
            a = make_input(rng, sa, g_normal(rng, dt))
            b = make_input(rng, sb, g_normal(rng, dt))
            loss = np.mean((f64(a.value()) - f64(b.value())) ** 2)
            w.case("nn", "mse_loss", [a, b], [ref(loss, dt)], tolerance=tol(dt, "reduce"))


def np_strides(a):
    return [s // a.itemsize for s in a.strides]


def view_attrs(out, attrs):
    """Expected strides, where numpy's are meaningful (every dim > 1)."""
    if out.ndim and all(d > 1 for d in out.shape):
        attrs["strides"] = np_strides(out)
    return attrs


def views_family(w, rng):
    dts = FLOATS + ("i64", "bool")
    for i in range(12):
        dt = dts[i % 4]
        shape = rand_shape(rng, 0, 4)
        n = int(np.prod(shape)) if shape else 1
        # a target shape with the same element count, one dim maybe -1
        target = []
        rem = n
        for f in (2, 3, 2, 5):
            if rem > 0 and rem % f == 0 and rng.random() < 0.6:
                target.append(f)
                rem //= f
        target.append(rem)
        rng.shuffle(target)
        spec = list(target)
        if rng.random() < 0.6 and n > 0:
            spec[int(rng.integers(len(spec)))] = -1
        # reshape of contiguous tensors; a view in torch's sense
        a = make_input(rng, shape, g_default(rng, dt), layouts=[])
        w.case("views", "reshape", [a], [a.value().reshape(target)], {"shape": spec})
    # reshape of a transposed tensor must copy, as torch's reshape does
    for dt in FLOATS:
        a = make_input(rng, [3, 4], g_default(rng, dt), layouts=["transpose"])
        w.case("views", "reshape", [a], [a.value().reshape(12)], {"shape": [-1]})
        a = make_input(rng, [2, 3, 4], g_default(rng, dt), layouts=["transpose"])
        w.case("views", "reshape", [a], [a.value().reshape(6, 4)], {"shape": [6, 4]})
    for i in range(10):
        dt = dts[i % 4]
        shape = rand_shape(rng, 2, 4)
        r = len(shape)
        d0, d1 = int(rng.integers(r)), int(rng.integers(r))
        a = make_input(rng, shape, g_default(rng, dt), allow_expand=False)
        out = np.swapaxes(a.value(), d0, d1)
        w.case("views", "transpose", [a], [out], view_attrs(out, {"d0": d0, "d1": d1}))
    for i in range(8):
        dt = dts[i % 4]
        shape = rand_shape(rng, 1, 4)
        p = rng.permutation(len(shape)).tolist()
        a = make_input(rng, shape, g_default(rng, dt), allow_expand=False)
        out = np.transpose(a.value(), p)
        w.case("views", "permute", [a], [out], view_attrs(out, {"perm": p}))
    for i in range(10):
        dt = dts[i % 4]
        out_shape = rand_shape(rng, 1, 4)
        src_shape = derive(rng, out_shape)
        a = make_input(rng, src_shape, g_default(rng, dt), layouts=[] if i % 2 else None, allow_expand=False)
        out = np.broadcast_to(a.value(), out_shape)
        w.case("views", "expand", [a], [out], view_attrs(out, {"shape": out_shape}))
    for i in range(8):
        dt = dts[i % 4]
        shape = rand_shape(rng, 1, 4)
        d = int(rng.integers(len(shape)))
        shape[d] = 1
        a = make_input(rng, shape, g_default(rng, dt))
        w.case("views", "squeeze", [a], [np.squeeze(a.value(), d)], {"dim": d})
    for i in range(8):
        dt = dts[i % 4]
        shape = rand_shape(rng, 0, 3)
        d = int(rng.integers(0, len(shape) + 1))
        a = make_input(rng, shape, g_default(rng, dt))
        w.case("views", "unsqueeze", [a], [np.expand_dims(a.value(), d)], {"dim": d})
    # Python slice rules: negative and out-of-range bounds, steps 1..3
    for i in range(16):
        dt = dts[i % 4]
        shape = rand_shape(rng, 1, 3)
        d = int(rng.integers(len(shape)))
        n = shape[d]
        start = int(rng.integers(-n - 3, n + 4))
        end = int(rng.integers(-n - 3, n + 4))
        if i % 5 == 0:
            end = 2 ** 62       # "to the end"
        step = int(rng.integers(1, 4))
        a = make_input(rng, shape, g_default(rng, dt), allow_expand=False)
        idx = [slice(None)] * len(shape)
        idx[d] = slice(start, end, step)
        out = a.value()[tuple(idx)]
        w.case("views", "slice", [a], [out], view_attrs(out, {"dim": d, "start": start, "end": end, "step": step}))
    for i in range(6):
        dt = dts[i % 4]
        a = make_input(rng, rand_shape(rng, 1, 4), g_default(rng, dt), layouts=["transpose"] if i % 2 else ["expand"])
        w.case("views", "contiguous", [a], [a.value()])
    a = make_input(rng, [], g_default(rng, "f32"))
    w.case("views", "contiguous", [a], [a.value()])
    for i in range(12):
        dt = dts[i % 4] if i % 3 else "f32"
        shape = rand_shape(rng, 1, 4)
        d = int(rng.integers(len(shape)))
        k = int(rng.integers(1, 5))
        ins = []
        for _ in range(k):
            s = list(shape)
            s[d] = int(rng.integers(0, 4))
            ins.append(make_input(rng, s, g_default(rng, dt)))
        out = np.concatenate([x.value() for x in ins], axis=d)
        w.case("views", "cat", ins, [out], {"dim": d})
    for i in range(10):
        dt = dts[i % 4] if i % 3 else "f32"
        shape = rand_shape(rng, 0, 3)
        d = int(rng.integers(0, len(shape) + 1))
        k = int(rng.integers(1, 4))
        ins = [make_input(rng, shape, g_default(rng, dt)) for _ in range(k)]
        out = np.stack([x.value() for x in ins], axis=d)
        w.case("views", "stack", ins, [out], {"dim": d})
    # cast between all four dtypes
    def g_cast(src):
        if src in FLOATS:
            def f(s):
                v = rng.uniform(-40, 40, s)
                v = np.where(rng.random(s) < 0.2, np.round(v), v)   # exact integers
                v = np.where(rng.random(s) < 0.15, 0.0, v)          # zeros
                v = np.where(rng.random(s) < 0.1, rng.uniform(-1, 1, s), v)
                return v.astype(NP[src])
            return f
        if src == "i64":
            return lambda s: np.where(rng.random(s) < 0.2, 0, rng.integers(-1000, 1000, s)).astype(np.int64)
        return g_bool(rng)
    for src in dts:
        for dst in dts:
            for j in range(2):
                shape = rand_shape(rng, 0, 3) if j else [3, 4]
                a = make_input(rng, shape, g_cast(src))
                x = a.value()
                if dst == "bool":
                    out = x != 0
                elif dst == "i64" and src in FLOATS:
                    out = np.trunc(x).astype(np.int64)
                else:
                    out = x.astype(NP[dst])
                w.case("views", "cast", [a], [out], {"dtype": dst})
    # i64 -> f32 rounds to nearest, ties to even
    big = Input(np.array([16777217, 16777219, -16777217, 2 ** 40 + 1, 3], np.int64))
    w.case("views", "cast", [big], [big.value().astype(np.float32)], {"dtype": "f32"})
    neg0 = Input(np.array([-0.0, 0.0, 1e-30, -2.7, 2.7, -0.5], np.float64))
    w.case("views", "cast", [neg0], [neg0.value() != 0], {"dtype": "bool"})
    w.case("views", "cast", [neg0], [np.trunc(neg0.value()).astype(np.int64)], {"dtype": "i64"})


def creation_family(w, rng):
    dts = FLOATS + ("i64", "bool")
    for dt in dts:
        for shape in ([], [0], [3], [2, 3], [2, 0, 4], [1, 2, 1, 3]):
            w.case("creation", "zeros", [], [np.zeros(shape, NP[dt])], {"dtype": dt, "shape": shape})
            w.case("creation", "ones", [], [np.ones(shape, NP[dt])], {"dtype": dt, "shape": shape})
        for shape, v in (([2, 2], 1.0), ([3], 0.0), ([], 1.0), ([2, 0], 1.0)):
            if dt in FLOATS:
                v = [3.25, -1.5e-3, 7.0, 2.0][len(shape) % 4]
            elif dt == "i64":
                v = [-7.0, 42.0, 3.0, 1.0][len(shape) % 4]
            w.case("creation", "full", [], [np.full(shape, v, NP[dt])], {"dtype": dt, "shape": shape, "value": v})
        for v in ((0.0, 1.0) if dt == "bool" else (2.5, -4.0) if dt in FLOATS else (-9.0, 12.0)):
            w.case("creation", "scalar", [], [np.array(v).astype(NP[dt])], {"dtype": dt, "value": v})
    ar = [(0.0, 5.0, 1.0), (0.0, 1.0, 0.25), (-3.0, 3.0, 1.5), (2.0, 2.0, 1.0), (0.0, 10.0, 3.0),
          (5.0, 0.0, -1.0), (1.0, 2.0, 0.3), (0.5, 4.0, 0.5)]
    for dt in FLOATS + ("i64",):
        for start, stop, step in ar:
            if dt == "i64" and (start != int(start) or step != int(step)):
                continue
            n = max(0, math.ceil((stop - start) / step))
            vals = np.array([start + i * step for i in range(n)], np.float64).astype(NP[dt])
            t = (1e-6, 1e-12) if dt == "f32" else (1e-15, 1e-15) if dt == "f64" else EXACT
            w.case("creation", "arange", [], [vals], {"dtype": dt, "start": start, "stop": stop, "step": step}, t)


def inplace_family(w, rng):
    def dst_layout(shape):
        opts = [[]]
        if shape:
            opts.append(["slice"])
        if len(shape) >= 2:
            opts += [["transpose"], ["transpose", "slice"]]
        if len(shape) >= 3:
            opts.append(["permute"])
        return opts[int(rng.integers(len(opts)))]

    fns = {"add_": np.add, "sub_": np.subtract, "mul_": np.multiply}
    for op in ("add_", "sub_", "mul_", "copy_", "fill_", "zero_"):
        for dt in FLOATS + ("i64",):
            for i in range(5):
                shape = rand_shape(rng, 0, 3) if i > 1 else [[3, 4], [2, 3, 2]][i]
                layout = dst_layout(shape) if i != 0 else (["transpose", "slice"])
                dst = make_input(rng, shape, g_default(rng, dt), layouts=layout)
                base = dst.base.copy()
                view = base                              # a view: writes go through to base
                for v in dst.views:
                    view = apply_view(view, v)
                ins = [dst]
                attrs = {}
                if op in fns or op == "copy_":
                    src = make_input(rng, derive(rng, shape), g_default(rng, dt))
                    ins.append(src)
                    if op == "copy_":
                        view[...] = src.value()
                    else:
                        fns[op](view, src.value(), out=view)
                elif op == "fill_":
                    v = float(rng.integers(-9, 10)) if dt == "i64" else float(np.float32(rng.standard_normal()))
                    attrs["value"] = v
                    view[...] = v
                else:
                    view[...] = 0
                t = tol(dt, "arith") if op == "mul_" else EXACT
                w.case("inplace", op, ins, [view.copy(), base], attrs, t)


def big_family(w, rng):
    """Tensors large enough that kiln splits the work across threads (the C
    side runs these with 3 threads, so chunk edges fall mid-row)."""
    def fx(dt, shape, seed, views=(), m=1021):
        a = [97, 389, 211, 613, 59, 743][seed % 6]
        inp = formula(dt, list(shape), a, 13 + seed, m, (m - 1) // 2, 1 if dt == "i64" else 2.0 ** -8)
        inp.views = list(views)
        return inp

    def case(op, ins, outs, attrs=None, t=EXACT):
        w.case("big", op, ins, outs, attrs, t)

    f32a = tol("f32", "arith")
    a = fx("f32", (350, 300), 0, [("transpose", 0, 1)])
    b = fx("f32", (350,), 1)
    case("add", [a, b], [a.value() + b.value()], t=f32a)
    a = fx("f64", (300, 460), 2, [("slice", 1, 1, 460, 2)])
    b = fx("f64", (300, 1), 3)
    case("mul", [a, b], [a.value() * b.value()], t=tol("f64", "arith"))
    a = fx("i64", (240, 300), 4, [("transpose", 0, 1)])
    b = fx("i64", (240,), 5)
    case("sub", [a, b], [a.value() - b.value()])
    a = fx("f32", (30, 40, 100), 0, [("permute", [2, 0, 1])])
    case("exp", [a], [ref(np.exp(f64(a.value())), "f32")], t=tol("f32"))
    a = fx("f32", (1, 300), 1, [("expand", [350, 300])])
    case("gelu", [a], [ref(gelu_tanh(f64(a.value())), "f32")], t=tol("f32"))
    a = fx("f32", (350, 300), 2)
    b = fx("f32", (300,), 3)
    case("lt", [a, b], [a.value() < b.value()])
    c = fx("bool", (350, 1), 4)
    a = fx("f32", (300, 350), 5, [("transpose", 0, 1)])
    b = Input(np.array(0.5, np.float32))
    case("where", [c, a, b], [np.where(c.value(), a.value(), b.value()).astype(np.float32)])
    # sums of these values are exact in f32 in any order
    x = fx("f32", (400, 300), 0)
    for ax in (0, 1):
        case("sum", [x], [np.sum(x.value(), axis=ax)], {"axis": ax, "keepdim": 0}, (1e-7, 1e-7))
    xl = fx("f32", (400, 400), 1)
    case("sum_all", [xl], [np.sum(f64(xl.value())).astype(np.float32)], t=(1e-7, 1e-7))
    xt = fx("f32", (300, 400), 2, [("transpose", 0, 1)])
    case("sum", [xt], [np.sum(xt.value(), axis=0, keepdims=True)], {"axis": 0, "keepdim": 1}, (1e-7, 1e-7))
    case("max", [xt], [np.max(xt.value(), axis=0)], {"axis": 0, "keepdim": 0})
    case("argmax", [xt], [np.argmax(xt.value(), axis=0).astype(np.int64)], {"axis": 0, "keepdim": 0})
    case("argmax", [xt], [np.argmax(xt.value(), axis=1).astype(np.int64)], {"axis": 1, "keepdim": 0})
    xi = fx("i64", (200000,), 3)
    case("sum_axes", [xi], [np.sum(xi.value())], {"axes": [], "keepdim": 0})
    xi2 = fx("i64", (300, 400), 4)
    case("min", [xi2], [np.min(xi2.value(), axis=1)], {"axis": 1, "keepdim": 0})
    x3 = fx("f32", (40, 50, 60), 5)
    case("sum_axes", [x3], [np.sum(x3.value(), axis=(0, 2))], {"axes": [0, 2], "keepdim": 0}, (1e-7, 1e-7))
    x = fx("f32", (400, 300), 0)
    case("mean", [x], [ref(np.mean(f64(x.value()), axis=1, keepdims=True), "f32")], {"axis": 1, "keepdim": 1},
         tol("f32", "reduce"))
    xd = fx("f64", (400, 300), 1, [("transpose", 0, 1)])
    case("var", [xd], [np.var(xd.value(), axis=1, ddof=1)], {"axis": 1, "keepdim": 0, "correction": 1},
         tol("f64", "norm"))
    # row-wise nn ops, along the last dim and across rows
    x = fx("f32", (400, 300), 2)
    case("softmax", [x], [ref(np.exp(log_softmax_np(f64(x.value()), 1)), "f32")], {"axis": -1}, (1e-5, 1e-6))
    xt = fx("f32", (400, 300), 3, [("transpose", 0, 1)])
    case("softmax", [xt], [ref(np.exp(log_softmax_np(f64(xt.value()), 0)), "f32")], {"axis": 0}, (1e-5, 1e-6))
    xd = fx("f64", (300, 250), 4)
    case("log_softmax", [xd], [log_softmax_np(xd.value(), 1)], {"axis": 1}, (1e-11, 1e-12))
    x = fx("f32", (400, 256), 5)
    wt = fx("f32", (256,), 0)
    bs = fx("f32", (256,), 1)
    xv = f64(x.value())
    mu = xv.mean(axis=-1, keepdims=True)
    y = (xv - mu) / np.sqrt(((xv - mu) ** 2).mean(axis=-1, keepdims=True) + 1e-5) * f64(wt.value()) + f64(bs.value())
    case("layer_norm", [x, wt, bs], [ref(y, "f32")], {"eps": 1e-5}, tol("f32", "norm"))
    lg = fx("f32", (1000, 100), 2)
    tg = formula("i64", [1000], 7, 3, 100, 0, 1)
    ls = log_softmax_np(f64(lg.value()), 1)
    case("cross_entropy", [lg, tg], [ref(-np.mean(ls[np.arange(1000), tg.value()]), "f32")], t=tol("f32", "norm"))
    a = fx("f32", (400, 300), 3)
    b = fx("f32", (300,), 4)
    case("mse_loss", [a, b], [ref(np.mean((f64(a.value()) - f64(b.value())) ** 2), "f32")], t=tol("f32", "norm"))
    table = fx("f32", (50, 64), 5)
    idx = formula("i64", [1100], 17, 5, 50, 0, 1)
    case("embedding", [table, idx], [table.value()[idx.value()]])
    a = fx("f32", (350, 300), 0, [("transpose", 0, 1)])
    case("contiguous", [a], [a.value()])
    a = fx("f64", (350, 300), 1)
    case("cast", [a], [a.value().astype(np.float32)], {"dtype": "f32"})
    p = fx("f32", (300, 120), 2)
    q = fx("f32", (130, 300), 3, [("transpose", 0, 1)])
    case("cat", [p, q], [np.concatenate([p.value(), q.value()], axis=1)], {"dim": 1})
    a = fx("f32", (200, 300), 4)
    b = fx("f32", (150, 300), 5, [("transpose", 0, 1)])
    case("matmul", [a, b], [ref(f64(a.value()) @ f64(b.value()), "f32")], t=tol_matmul("f32", 300))
    # in place through a strided view of a large base
    dst = fx("f32", (300, 460), 0, [("slice", 1, 0, 460, 2)])
    src = fx("f32", (230,), 1)
    base = dst.base.copy()
    view = base                                  # a view: writes go through to base
    for v in dst.views:
        view = apply_view(view, v)
    view += src.value()
    case("add_", [dst, src], [view.copy(), base], t=f32a)


# ---- convolution, pooling, batch norm (NCHW) --------------------------------
#
#   conv2d(x, w[, bias]) attrs stride, padding, dilation (pairs; absent: NULL,
#   the defaults 1, 0, 1) and groups: torch's conv2d (cross-correlation), x 4-D
#   or 3-D (one image, no batch dim); conv1d likewise with single numbers.
#   conv2d_grad_input(gy, w, x) and conv2d_grad_weight(gy, x, w) are the
#   gradients of sum(conv2d(x, w) * gy) (x, w give their shapes).
#   max_pool2d, avg_pool2d(x) attrs kernel, stride (absent: the kernel),
#   padding (absent: 0): a max ignores the padding and its gradient goes to the
#   first maximum of each window in row-major order; an average divides by
#   kh*kw, padding included. adaptive_avg_pool2d attr out: window i covers
#   [floor(i*H/OH), ceil((i+1)*H/OH)). The _grad ops take (gy, x).
#   batch_norm(x, running_mean, running_var[, weight, bias]) attrs training,
#   momentum, eps; outputs y and the running statistics after the call
#   (training: r = (1-m) r + m s with the unbiased batch variance).

def conv_out(n, k, s, p, d):
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def conv_taps(xp, i, j, ho, wo, s, d):
    """The input elements tap (i, j) of every output position reads, from the padded xp."""
    return xp[:, :, i * d[0]: i * d[0] + (ho - 1) * s[0] + 1: s[0],
              j * d[1]: j * d[1] + (wo - 1) * s[1] + 1: s[1]]


def conv2d_np(x, w, s, p, d, groups):
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    ho, wo = conv_out(h, kh, s[0], p[0], d[0]), conv_out(wd, kw, s[1], p[1], d[1])
    xp = np.pad(x, ((0, 0), (0, 0), (p[0], p[0]), (p[1], p[1])))
    y = np.zeros((n, o, ho, wo))
    og = o // groups
    for g in range(groups):
        xs, ws = xp[:, g * cg:(g + 1) * cg], w[g * og:(g + 1) * og]
        for i in range(kh):
            for j in range(kw):
                y[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", conv_taps(xs, i, j, ho, wo, s, d), ws[:, :, i, j])
    return y


def conv2d_grads_np(x, w, gy, s, p, d, groups):
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    ho, wo = gy.shape[2], gy.shape[3]
    xp = np.pad(x, ((0, 0), (0, 0), (p[0], p[0]), (p[1], p[1])))
    gxp, gw = np.zeros(xp.shape), np.zeros(w.shape)
    og = o // groups
    for g in range(groups):
        xs, ws, gs = xp[:, g * cg:(g + 1) * cg], w[g * og:(g + 1) * og], gy[:, g * og:(g + 1) * og]
        for i in range(kh):
            for j in range(kw):
                gw[g * og:(g + 1) * og, :, i, j] = np.einsum("nohw,nchw->oc", gs, conv_taps(xs, i, j, ho, wo, s, d))
                tap = conv_taps(gxp[:, g * cg:(g + 1) * cg], i, j, ho, wo, s, d)
                tap += np.einsum("nohw,oc->nchw", gs, ws[:, :, i, j])   # a view into gxp
    return gxp[:, :, p[0]:p[0] + h, p[1]:p[1] + wd], gw


def pool_windows(h, wd, k, s, p):
    """Per output position, its window clipped to the input: (h0, h1, w0, w1)."""
    ho, wo = conv_out(h, k[0], s[0], p[0], 1), conv_out(wd, k[1], s[1], p[1], 1)
    return [[(max(a * s[0] - p[0], 0), min(a * s[0] - p[0] + k[0], h), max(b * s[1] - p[1], 0), min(b * s[1] - p[1] + k[1], wd))
             for b in range(wo)] for a in range(ho)]


def adaptive_windows(h, wd, oh, ow):
    return [[(a * h // oh, -(-(a + 1) * h // oh), b * wd // ow, -(-(b + 1) * wd // ow)) for b in range(ow)] for a in range(oh)]


def pool_np(op, x, wins, k=None):
    n, c = x.shape[:2]
    ho, wo = len(wins), len(wins[0]) if wins else 0
    y = np.zeros((n, c, ho, wo))
    for a in range(ho):
        for b in range(wo):
            h0, h1, w0, w1 = wins[a][b]
            win = x[:, :, h0:h1, w0:w1]
            if op == "max":
                y[:, :, a, b] = win.max(axis=(2, 3))
            else:
                y[:, :, a, b] = win.sum(axis=(2, 3)) / (k[0] * k[1] if k else (h1 - h0) * (w1 - w0))
    return y


def pool_grad_np(op, x, gy, wins, k=None):
    gx = np.zeros(x.shape)
    for a in range(len(wins)):
        for b in range(len(wins[0])):
            h0, h1, w0, w1 = wins[a][b]
            if op == "max":
                for ni in range(x.shape[0]):
                    for ci in range(x.shape[1]):
                        win = x[ni, ci, h0:h1, w0:w1]
                        r, q = np.unravel_index(int(np.argmax(win)), win.shape)   # the first maximum
                        gx[ni, ci, h0 + r, w0 + q] += gy[ni, ci, a, b]
            else:
                cnt = k[0] * k[1] if k else (h1 - h0) * (w1 - w0)
                gx[:, :, h0:h1, w0:w1] += (gy[:, :, a, b] / cnt)[:, :, None, None]
    return gx


def conv_family(w, rng):
    # (x shape, w shape, stride, padding, dilation, groups): odd sizes, strides,
    # dilations, groups (depthwise and a multiplier), 1x1, a kernel as large as
    # the padded input, and an empty batch
    convs = [
        ([2, 3, 7, 6], [4, 3, 3, 3], (1, 1), (1, 1), (1, 1), 1),
        ([1, 2, 9, 8], [5, 2, 3, 2], (2, 3), (1, 0), (1, 1), 1),
        ([2, 4, 9, 9], [6, 2, 3, 3], (2, 1), (2, 1), (2, 1), 2),
        ([2, 4, 7, 8], [4, 1, 3, 3], (1, 2), (1, 1), (1, 2), 4),      # depthwise
        ([1, 3, 6, 5], [6, 1, 2, 3], (1, 1), (0, 1), (1, 1), 3),      # depthwise, multiplier 2
        ([3, 5, 4, 6], [7, 5, 1, 1], (1, 1), (0, 0), (1, 1), 1),      # 1x1: no columns
        ([2, 6, 7, 7], [8, 6, 1, 1], (2, 2), (0, 0), (1, 1), 1),      # 1x1, stride 2
        ([2, 8, 5, 5], [8, 2, 3, 3], (1, 1), (1, 1), (1, 1), 4),      # groups of 2 in, 2 out
        ([1, 2, 3, 4], [3, 2, 5, 6], (1, 1), (1, 1), (1, 1), 1),      # kernel = padded input
        ([0, 3, 5, 5], [4, 3, 3, 3], (1, 1), (0, 0), (1, 1), 1),      # no images
        ([5, 8, 4, 4], [16, 8, 3, 3], (1, 1), (1, 1), (1, 1), 1),     # several images per GEMM
        ([3, 16, 6, 6], [8, 4, 3, 3], (2, 2), (1, 1), (1, 1), 4),     # several images, groups
        # 3x3 stride 1 with channels and tiles enough for Winograd F(2x2, 3x3) (conv.c
        # chooses it; ctest runs these once more with KILN_CONV=gemm and =winograd):
        # odd sizes (partial tiles), channel counts that are multiples of nothing
        ([2, 17, 15, 13], [19, 17, 3, 3], (1, 1), (1, 1), (1, 1), 1),
        ([1, 16, 17, 19], [21, 16, 3, 3], (1, 1), (1, 1), (1, 1), 1),  # one image
        ([3, 16, 9, 11], [16, 16, 3, 3], (1, 1), (0, 2), (1, 1), 1),   # unequal padding
    ]
    for dt in FLOATS:
        for idx, (xs, ws, st, pd, dl, gr) in enumerate(convs):
            x = make_input(rng, xs, g_normal(rng, dt))
            wt = make_input(rng, ws, g_normal(rng, dt, 0.5))
            xv, wv = f64(x.value()), f64(wt.value())
            y = conv2d_np(xv, wv, st, pd, dl, gr)
            kk = ws[1] * ws[2] * ws[3]
            t = tol_matmul(dt, kk)
            attrs = {"groups": gr}
            if (st, pd, dl) != ((1, 1), (0, 0), (1, 1)) or idx % 2 == 0:   # else NULL pointers: the defaults
                attrs.update({"stride": list(st), "padding": list(pd), "dilation": list(dl)})
            ins = [x, wt]
            if idx % 3 == 0:
                b = make_input(rng, [ws[0]], g_normal(rng, dt))
                ins.append(b)
                y = y + f64(b.value())[None, :, None, None]
            w.case("conv", "conv2d", ins, [ref(y, dt)], attrs, t)
            gy = make_input(rng, list(y.shape), g_normal(rng, dt))
            gx, gw = conv2d_grads_np(xv, wv, f64(gy.value()), st, pd, dl, gr)
            full = {"stride": list(st), "padding": list(pd), "dilation": list(dl), "groups": gr}
            w.case("conv", "conv2d_grad_input", [gy, wt, x], [ref(gx, dt)], full, tol_matmul(dt, ws[0]))
            w.case("conv", "conv2d_grad_weight", [gy, x, wt], [ref(gw, dt)], full,
                   tol_matmul(dt, xs[0] * y.shape[2] * y.shape[3]))
        # one image without a batch dim
        x = make_input(rng, [3, 6, 5], g_normal(rng, dt))
        wt = make_input(rng, [2, 3, 3, 3], g_normal(rng, dt))
        y = conv2d_np(f64(x.value())[None], f64(wt.value()), (1, 1), (1, 1), (1, 1), 1)[0]
        w.case("conv", "conv2d", [x, wt], [ref(y, dt)], {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1],
                                                      "groups": 1}, tol_matmul(dt, 27))
        # conv1d: (N,C,L) and (C,L)
        for xs, ws, st, pd, dl, gr in [([2, 4, 11], [6, 2, 3], 2, 1, 2, 2), ([3, 9], [4, 3, 4], 1, 2, 1, 1),
                                       ([1, 3, 5], [3, 1, 5], 1, 2, 1, 3)]:
            x = make_input(rng, xs, g_normal(rng, dt))
            wt = make_input(rng, ws, g_normal(rng, dt))
            xv = f64(x.value())
            x4 = xv[:, :, None, :] if len(xs) == 3 else xv[None, :, None, :]
            y = conv2d_np(x4, f64(wt.value())[:, :, None, :], (1, st), (0, pd), (1, dl), gr)[:, :, 0, :]
            if len(xs) == 2:
                y = y[0]
            ins = [x, wt]
            if gr == 1:
                b = make_input(rng, [ws[0]], g_normal(rng, dt))
                ins.append(b)
                y = y + f64(b.value())[:, None]
            w.case("conv", "conv1d", ins, [ref(y, dt)], {"stride": st, "padding": pd, "dilation": dl, "groups": gr},
                   tol_matmul(dt, ws[1] * ws[2]))

    # pools: (x shape, kernel, stride or None, padding or None)
    pools = [([2, 3, 7, 6], (2, 2), None, None), ([1, 2, 9, 8], (3, 3), (2, 2), (1, 1)),
             ([2, 2, 8, 7], (3, 2), (1, 2), (1, 0)), ([1, 3, 5, 5], (5, 5), (1, 1), (2, 2)),
             ([3, 1, 4, 9], (1, 3), (3, 1), (0, 1)), ([0, 2, 4, 4], (2, 2), None, None),
             ([3, 6, 5], (3, 3), (2, 2), (1, 1))]   # one image without a batch dim
    for dt in FLOATS:
        for op in ("max", "avg"):
            for xs, k, st, pd in pools:
                x = make_input(rng, xs, g_normal(rng, dt))
                xv = f64(x.value())
                x4 = xv if len(xs) == 4 else xv[None]
                s2, p2 = st or k, pd or (0, 0)
                wins = pool_windows(x4.shape[2], x4.shape[3], k, s2, p2)
                y4 = pool_np(op, x4, wins, k)
                attrs = {"kernel": list(k)}
                if st:
                    attrs["stride"] = list(st)
                if pd:
                    attrs["padding"] = list(pd)
                y = y4 if len(xs) == 4 else y4[0]
                w.case("pool", op + "_pool2d", [x], [ref(y, dt)], attrs, tol(dt, "reduce"))
                if len(xs) == 4:
                    gy = make_input(rng, list(y4.shape), g_normal(rng, dt))
                    gx = pool_grad_np(op, x4, f64(gy.value()), wins, k)
                    full = {"kernel": list(k), "stride": list(s2), "padding": list(p2)}
                    w.case("pool", op + "_pool2d_grad", [gy, x], [ref(gx, dt)], full, tol(dt, "reduce"))
        for xs, out in [([2, 3, 7, 6], (3, 2)), ([1, 2, 5, 5], (5, 5)), ([2, 2, 4, 9], (1, 1)), ([1, 3, 6, 4], (4, 3)),
                        ([3, 5, 7], (2, 3)), ([2, 4, 3, 3], (1, 1)), ([1, 1, 3, 2], (6, 5))]:
            x = make_input(rng, xs, g_normal(rng, dt))
            xv = f64(x.value())
            x4 = xv if len(xs) == 4 else xv[None]
            wins = adaptive_windows(x4.shape[2], x4.shape[3], out[0], out[1])
            y4 = pool_np("avg", x4, wins)
            w.case("pool", "adaptive_avg_pool2d", [x], [ref(y4 if len(xs) == 4 else y4[0], dt)], {"out": list(out)},
                   tol(dt, "reduce"))
            if len(xs) == 4:
                gy = make_input(rng, list(y4.shape), g_normal(rng, dt))
                gx = pool_grad_np("avg", x4, f64(gy.value()), wins)
                w.case("pool", "adaptive_avg_pool2d_grad", [gy, x], [ref(gx, dt)], {"out": list(out)}, tol(dt, "reduce"))

    # batch norm: x (N,C,...), rank 2 to 5
    for dt in FLOATS:
        for i, xs in enumerate([[4, 3], [2, 3, 5], [3, 2, 4, 5], [2, 4, 3, 2, 2], [1, 3, 2, 2], [5, 1, 3, 1]]):
            for training in (True, False):
                c = xs[1]
                x = make_input(rng, xs, g_normal(rng, dt, 2.0, 0.5))
                rm = Input(rng.standard_normal(c).astype(NP[dt]))
                rv = Input(rng.uniform(0.5, 2.0, c).astype(NP[dt]))
                eps, mom = [1e-5, 0.1, 1e-3][i % 3], [0.1, 0.5, 0.01][i % 3]
                xv = f64(x.value())
                axes = tuple(d for d in range(len(xs)) if d != 1)
                cs = [1, c] + [1] * (len(xs) - 2)
                rmv, rvv = f64(rm.value()), f64(rv.value())
                if training:
                    mu = xv.mean(axis=axes)
                    var = ((xv - mu.reshape(cs)) ** 2).mean(axis=axes)
                    y = (xv - mu.reshape(cs)) / np.sqrt(var.reshape(cs) + eps)
                    cnt = xv.size // c
                    rm_after = (1 - mom) * rmv + mom * mu
                    rv_after = (1 - mom) * rvv + mom * var * cnt / (cnt - 1)
                else:
                    y = (xv - rmv.reshape(cs)) / np.sqrt(rvv.reshape(cs) + eps)
                    rm_after, rv_after = rmv, rvv
                ins = [x, rm, rv]
                if i % 2 == 0:
                    wt = make_input(rng, [c], g_normal(rng, dt, 0.1, 1.0))
                    bs = make_input(rng, [c], g_normal(rng, dt, 0.1))
                    y = y * f64(wt.value()).reshape(cs) + f64(bs.value()).reshape(cs)
                    ins += [wt, bs]
                w.case("norm", "batch_norm", ins, [ref(y, dt), ref(rm_after, dt), ref(rv_after, dt)],
                       {"training": int(training), "momentum": mom, "eps": eps}, tol(dt, "norm"))


def silu_np(x):
    return x / (1.0 + np.exp(-x))


def softplus_np(x):
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


ACTIVATIONS = {
    # name: (reference on float64, value generators by dtype, dtypes)
    "silu": (silu_np, lambda rng, dt: g_uniform(rng, dt, -30.0, 30.0), FLOATS),
    "softplus": (softplus_np, lambda rng, dt: g_uniform(rng, dt, -40.0, 40.0), FLOATS),
    "log1p": (np.log1p, lambda rng, dt: g_uniform(rng, dt, -0.99, 20.0), FLOATS),
    "expm1": (np.expm1, lambda rng, dt: g_uniform(rng, dt, -12.0, 12.0), FLOATS),
    "floor": (np.floor, lambda rng, dt: g_grid(rng, dt) if dt == "i64" else g_normal(rng, dt, 3.0), FLOATS + ("i64",)),
    "ceil": (np.ceil, lambda rng, dt: g_grid(rng, dt) if dt == "i64" else g_normal(rng, dt, 3.0), FLOATS + ("i64",)),
    # halves on the grid: ties round to even
    "round": (np.round, lambda rng, dt: g_grid(rng, dt), FLOATS + ("i64",)),
    "sign": (np.sign, lambda rng, dt: g_grid(rng, dt), FLOATS + ("i64",)),
}


def activation_family(w, rng):
    """The newer pointwise ops: silu, softplus (torch: beta 1, threshold 20),
    log1p, expm1, floor, ceil, round (half to even), sign; clamp
    (min(max(x, lo), hi)), leaky_relu, and the scalar forms of the four
    arithmetic ops. Family "unary", on a stream of its own."""
    for op, (fn, gen, dts) in ACTIVATIONS.items():
        for dt in dts:
            shapes = [[], [0], [7], [3, 4], [2, 3, 4]] + [rand_shape(rng) for _ in range(3)]
            for i, s in enumerate(shapes):
                g = gen(rng, dt)
                if op in ("log1p", "expm1") and i == 3 and dt != "i64":
                    g = g_uniform(rng, dt, -1e-3, 1e-3)   # where the naive forms cancel
                a = make_input(rng, s, g)
                if dt == "i64":
                    exp, t = fn(a.value()).astype(np.int64), EXACT
                else:
                    exp = ref(fn(f64(a.value())), dt)
                    t = EXACT if op in ("floor", "ceil", "round", "sign") else tol(dt)
                w.case("unary", op, [a], [exp], tolerance=t)
    inf = float("inf")
    for dt in FLOATS + ("i64",):
        bounds = [(-1.0, 1.0), (0.0, inf), (-inf, 0.5), (2.0, -2.0), (-1.5, 2.5)]
        for lo, hi in bounds:
            s = rand_shape(rng, 1, 3)
            a = make_input(rng, s, g_grid(rng, dt) if dt == "i64" else g_normal(rng, dt, 2.0))
            x = a.value()
            frac = any(v != math.floor(v) for v in (lo, hi) if abs(v) != inf)
            odt = "f32" if dt == "i64" and frac else dt
            if odt == "i64":
                exp = np.minimum(np.maximum(x, -2**63 if lo == -inf else int(lo)), 2**63 - 1 if hi == inf else int(hi))
            else:
                xl, lf, hf = x.astype(NP[odt]), NP[odt](lo), NP[odt](hi)
                exp = np.minimum(np.maximum(xl, lf), hf)
            w.case("unary", "clamp", [a], [np.asarray(exp).astype(NP[odt])], {"lo": lo, "hi": hi})
    for dt in FLOATS:
        for slope in (0.01, 0.2, -0.5):
            a = make_input(rng, rand_shape(rng, 0, 3), g_grid(rng, dt) if slope < 0 else g_normal(rng, dt))
            x = f64(a.value())
            exp = ref(np.where(x > 0, x, x * float(NP[dt](slope))), dt)
            w.case("unary", "leaky_relu", [a], [exp], {"slope": slope}, tol(dt, "arith"))
    fns = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}
    for op, fn in fns.items():
        for dt in FLOATS + ("i64",):
            for v in (2.0, -0.75, 3.0):
                a = make_input(rng, rand_shape(rng, 0, 3), g_default(rng, dt) if op != "div" or dt == "i64" else g_nonzero(rng, dt))
                x = a.value()
                odt = "f32" if dt == "i64" and (v != math.floor(v) or op == "div") else dt
                if odt == "i64":
                    exp, t = fn(x, int(v)).astype(np.int64), EXACT
                else:
                    exp, t = ref(fn(f64(x.astype(NP[odt])), float(NP[odt](v))), odt), tol(odt, "arith")
                w.case("unary", op + "_scalar", [a], [exp], {"value": v}, t)


def reduce_more_family(w, rng):
    """argmin (the first index of the minimum), logsumexp, max_all, min_all,
    masked_fill, rms_norm and group_norm, on a stream of their own."""
    for dt in FLOATS + ("i64",):
        for i in range(9):
            shape = rand_shape(rng, 1, 4, allow0=False) if i else [6]
            r = len(shape)
            ax = int(rng.integers(-r, r))
            keepdim = bool(rng.random() < 0.5)
            a = make_input(rng, shape, g_grid(rng, dt) if i % 2 == 0 else g_default(rng, dt))
            exp = np.argmin(a.value(), axis=ax % r)
            if keepdim:
                exp = np.expand_dims(exp, ax % r)
            w.case("reduce", "argmin", [a], [exp.astype(np.int64)], {"axis": ax, "keepdim": int(keepdim)})
    for dt in FLOATS:
        for i in range(8):
            shape = rand_shape(rng, 1, 4, allow0=False)
            r = len(shape)
            ax = int(rng.integers(-r, r))
            keepdim = bool(rng.random() < 0.5)
            a = make_input(rng, shape, g_normal(rng, dt, 30.0 if i % 3 == 2 else 2.0))
            x = f64(a.value())
            m = np.max(x, axis=ax % r, keepdims=True)
            exp = np.log(np.sum(np.exp(x - m), axis=ax % r, keepdims=True)) + m
            if not keepdim:
                exp = np.squeeze(exp, ax % r)
            w.case("nn", "logsumexp", [a], [ref(exp, dt)], {"axis": ax, "keepdim": int(keepdim)}, tol(dt))
        # rows of -inf give -inf, a row holding +inf gives +inf
        base = np.array([[-np.inf, -np.inf, -np.inf], [0.5, np.inf, 1.0], [1.0, 2.0, -np.inf]], NP[dt])
        exp = np.array([-np.inf, np.inf, 2.0 + math.log1p(math.exp(-1.0))])
        w.case("nn", "logsumexp", [Input(base)], [ref(exp, dt)], {"axis": 1, "keepdim": 0}, tol(dt))
    for op, fn in (("max_all", np.max), ("min_all", np.min)):
        for dt in FLOATS + ("i64",):
            for shape in ([], [5], [3, 4], [2, 3, 4], rand_shape(rng, 1, 4, allow0=False)):
                a = make_input(rng, shape, g_grid(rng, dt) if dt == "i64" else g_default(rng, dt))
                w.case("reduce", op, [a], [np.asarray(fn(a.value())).astype(NP[dt])])
    for dt in FLOATS + ("i64",):
        for _ in range(6):
            out = rand_shape(rng, 0, 4)
            x = make_input(rng, out, g_default(rng, dt))
            m = make_input(rng, derive(rng, out), g_bool(rng))
            v = -2.5 if dt != "i64" else 7
            exp = np.where(m.value(), NP[dt](v), x.value()).astype(NP[dt])
            w.case("nn", "masked_fill", [x, m], [exp], {"value": v})
    for dt in FLOATS:
        for i, shape in enumerate(([5], [3, 8], [2, 3, 4], [2, 1, 6])):
            a = make_input(rng, shape, g_normal(rng, dt, 2.0))
            x = f64(a.value())
            eps = 1e-5 if i % 2 else 1e-2
            y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
            ins = [a]
            if i != 2:
                wt = make_input(rng, [shape[-1]], g_normal(rng, dt, 0.5, 1.0), layouts=[])
                y = y * f64(wt.value())
                ins.append(wt)
            w.case("norm", "rms_norm", ins, [ref(y, dt)], {"eps": eps}, tol(dt, "norm"))
        for shape, groups, affine in (([2, 6, 5], 3, True), ([1, 4, 3, 3], 2, False), ([3, 4], 4, True),
                                      ([2, 6, 2, 3], 1, True), ([2, 4, 3], 4, False)):
            a = make_input(rng, shape, g_normal(rng, dt, 2.0, 0.5))
            x = f64(a.value())
            n, c = shape[0], shape[1]
            g = x.reshape(n, groups, -1)
            mu = g.mean(axis=-1, keepdims=True)
            var = ((g - mu) ** 2).mean(axis=-1, keepdims=True)
            y = ((g - mu) / np.sqrt(var + 1e-5)).reshape(shape)
            ins = [a]
            if affine:
                wt = make_input(rng, [c], g_normal(rng, dt, 0.5, 1.0), layouts=[])
                bs = make_input(rng, [c], g_normal(rng, dt, 0.5), layouts=[])
                cs = [c] + [1] * (len(shape) - 2)
                y = y * f64(wt.value()).reshape(cs) + f64(bs.value()).reshape(cs)
                ins += [wt, bs]
            w.case("norm", "group_norm", ins, [ref(y, dt)], {"groups": groups, "eps": 1e-5}, tol(dt, "norm"))


def pad_np(x, pads, value):
    """torch's constant pad: pairs from the last dim back; a negative width crops."""
    x = np.asarray(x)
    for i in range(len(pads) // 2):
        d = x.ndim - 1 - i
        lo, hi = pads[2 * i], pads[2 * i + 1]
        idx = [slice(None)] * x.ndim
        idx[d] = slice(max(0, -lo), x.shape[d] - max(0, -hi))
        x = x[tuple(idx)]
        widths = [(0, 0)] * x.ndim
        widths[d] = (max(0, lo), max(0, hi))
        x = np.pad(x, widths, constant_values=value)
    return x


def data_family(w, rng):
    """gather, scatter_add, index_copy (the last write wins), tril, triu,
    pad (torch's order; negative widths crop) and cumsum, family "data"."""
    for dt in FLOATS + ("i64",):
        for _ in range(6):
            shape = rand_shape(rng, 1, 4, allow0=False)
            r = len(shape)
            d = int(rng.integers(-r, r))
            dn = d % r
            ishape = [int(rng.integers(1, s + 1)) if j != dn else int(rng.integers(0, 5)) for j, s in enumerate(shape)]
            x = make_input(rng, shape, g_default(rng, dt))
            idx = make_input(rng, ishape, lambda s, n=shape[dn]: rng.integers(0, n, s).astype(np.int64), layouts=[])
            xv, iv = x.value(), idx.value()
            sub = xv[tuple(slice(0, ishape[j]) if j != dn else slice(None) for j in range(r))]
            exp = np.take_along_axis(sub, iv, axis=dn)
            w.case("data", "gather", [x, idx], [exp.astype(NP[dt])], {"dim": d})
            src = make_input(rng, ishape, g_default(rng, dt), layouts=[])
            out = np.array(xv, dtype=NP[dt])
            for pos in np.ndindex(*ishape):
                tgt = list(pos)
                tgt[dn] = iv[pos]
                out[tuple(tgt)] += src.value()[pos]
            t = EXACT if dt == "i64" else tol(dt, "arith")
            w.case("data", "scatter_add", [x, idx, src], [out], {"dim": d}, t)
            # index_copy: a 1-D index with repeats
            k = int(rng.integers(0, 5))
            i1 = Input(rng.integers(0, shape[dn], [k]).astype(np.int64))
            sshape = list(shape)
            sshape[dn] = k
            src1 = make_input(rng, sshape, g_default(rng, dt))
            out = np.array(xv, dtype=NP[dt])
            for j in range(k):
                dst_idx = [slice(None)] * r
                dst_idx[dn] = i1.value()[j]
                src_idx = [slice(None)] * r
                src_idx[dn] = j
                out[tuple(dst_idx)] = src1.value()[tuple(src_idx)]
            w.case("data", "index_copy", [x, i1, src1], [out], {"dim": d})
    for dt in FLOATS + ("i64", "bool"):
        for shape in ([3, 4], [4, 3], [2, 3, 5], [1, 0, 2], [2, 2, 2, 3]):
            x = make_input(rng, shape, g_default(rng, dt))
            for k in (0, 1, -2, 7):
                w.case("data", "tril", [x], [np.tril(x.value(), k).astype(NP[dt])], {"k": k})
                w.case("data", "triu", [x], [np.triu(x.value(), k).astype(NP[dt])], {"k": k})
    for dt in FLOATS + ("i64",):
        for shape, pads in (([3, 4], [1, 2]), ([3, 4], [0, 1, 2, 0]), ([2, 3, 4], [-1, 2, 1, -1]), ([5], [-2, -3]),
                            ([2, 0, 3], [1, 1, 2, 0]), ([2, 3], []), ([4, 5], [-1, -1, 2, 3])):
            x = make_input(rng, shape, g_default(rng, dt))
            v = 1.5 if dt != "i64" else -4
            w.case("data", "pad", [x], [pad_np(x.value(), pads, v).astype(NP[dt])], {"pads": pads, "value": v})
        for _ in range(5):
            shape = rand_shape(rng, 0, 4)
            r = len(shape)
            d = int(rng.integers(-max(r, 1), max(r, 1)))
            x = make_input(rng, shape, g_default(rng, dt))
            xv = x.value()
            exp = np.cumsum(f64(xv) if dt != "i64" else xv, axis=d % r) if r else xv
            t = EXACT if dt == "i64" else tol(dt, "reduce")
            w.case("data", "cumsum", [x], [np.asarray(exp).astype(NP[dt])], {"dim": d}, t)


def topk_np(x, k, axis, largest):
    """Indices of the k best along axis: ties to the lower index, NaN the largest."""
    x = np.moveaxis(np.asarray(x), axis, -1)
    out = np.zeros(x.shape[:-1] + (k,), np.int64)
    for pos in np.ndindex(*x.shape[:-1]):
        row = [(v, i) for i, v in enumerate(x[pos].tolist())]
        def key(t):
            v, i = t
            nan = v != v
            if largest:
                return (0 if nan else 1, 0 if nan else -v, i)
            return (1 if nan else 0, 0 if nan else v, i)
        out[pos] = [i for _, i in sorted(row, key=key)[:k]]
    return np.moveaxis(out, -1, axis)


def select_family(w, rng):
    """topk (values and indices), split (every piece), one_hot and repeat, family "data"."""
    for dt in FLOATS + ("i64",):
        for i in range(8):
            shape = rand_shape(rng, 1, 3, allow0=False)
            r = len(shape)
            d = int(rng.integers(-r, r))
            k = int(rng.integers(0, shape[d % r] + 1))
            largest = bool(i % 2)
            g = g_grid(rng, dt)
            base = g(tuple(shape))
            if dt != "i64" and i == 3:
                base.reshape(-1)[0] = np.nan   # NaN: the largest
            x = Input(base)
            idx = topk_np(base, k, d % r, largest)
            vals = np.take_along_axis(base, idx, axis=d % r)
            w.case("data", "topk", [x], [vals, idx], {"k": k, "dim": d, "largest": int(largest)})
    for dt in FLOATS + ("i64",):
        for shape, size, d in (([7, 3], 3, 0), ([2, 5], 2, -1), ([4], 4, 0), ([4], 9, 0), ([2, 6, 2], 2, 1)):
            x = make_input(rng, shape, g_default(rng, dt))
            xv = x.value()
            n = xv.shape[d]
            pieces = [np.take(xv, range(s, min(s + size, n)), axis=d) for s in range(0, n, size)]
            w.case("data", "split", [x], pieces, {"size": size, "dim": d})
    for shape, n in (([4], 5), ([2, 3], 3), ([0], 2), ([], 4)):
        idx = Input(rng.integers(0, n, shape).astype(np.int64))
        exp = (np.asarray(idx.value())[..., None] == np.arange(n)).astype(np.int64)
        w.case("data", "one_hot", [idx], [exp], {"n": n})
    idx = Input(np.array([1, 4, 2], np.int64))
    w.case("data", "one_hot", [idx], [np.eye(5, dtype=np.int64)[[1, 4, 2]]], {"n": -1})
    for dt in FLOATS + ("i64", "bool"):
        for shape, reps in (([2, 3], [2, 1]), ([2, 3], [1, 2, 3]), ([3], [2]), ([], [3]), ([2, 0], [2, 5]), ([1, 2], [3, 2])):
            x = make_input(rng, shape, g_default(rng, dt))
            w.case("data", "repeat", [x], [np.tile(x.value(), reps).astype(NP[dt])], {"reps": reps})


def narrow_family(w, rng):
    """f16, bf16 and i32: ops compute in f32 (i64) and round once to the
    result's dtype; numpy's float16 and bf16_round give the rounded references.
    Tolerances: one unit in the last place of the narrow dtype (kiln's f32
    result may sit on the other side of a rounding boundary)."""
    def narrow(x, dt):
        with np.errstate(over="ignore"):   # 65520 rounds to f16's Inf, as it should
            return bf16_round(x) if dt == "bf16" else np.asarray(x).astype(NP[dt])

    def gen(dt, lo, hi):
        return lambda s: narrow(rng.uniform(lo, hi, s), dt)

    ulp = {"f16": 2.0 ** -10, "bf16": 2.0 ** -7}
    for dt in NARROW:
        t = (ulp[dt], ulp[dt] * 1e-2)
        for op in ("neg", "abs", "exp", "log", "sqrt", "tanh", "sigmoid", "relu", "gelu", "sin"):
            fn, dom, _ = UNARY[op]
            lo, hi = (-4.0, 4.0) if dom is None or dom == "wide" else dom
            for s in ([], [7], [3, 4]):
                a = make_input(rng, s, gen(dt, lo, min(hi, 8.0)))
                w.case("narrow", op, [a], [narrow(fn(f64(a.value())), dt)], tolerance=t)
        for op in ("add", "sub", "mul", "div", "maximum", "minimum"):
            for sa, sb in (([3, 4], [3, 4]), ([2, 3, 4], [4]), ([5, 1], [1, 6]), ([], [3])):
                lo = 0.5 if op == "div" else -4.0
                a, b = make_input(rng, sa, gen(dt, -4.0, 4.0)), make_input(rng, sb, gen(dt, lo, 4.0))
                w.case("narrow", op, [a, b], [narrow(BIN_FN[op](f64(a.value()), f64(b.value())), dt)], tolerance=t)
        for op, fn in (("sum", np.sum), ("mean", np.mean), ("max", np.max)):
            for shape, axis in (([4, 6], 1), ([3, 5, 2], 0), ([8], -1)):
                a = make_input(rng, shape, gen(dt, -2.0, 2.0))
                want = narrow(fn(f64(a.value()), axis=axis), dt)
                w.case("narrow", op, [a], [want], {"keepdim": 0, "axis": axis}, EXACT if op == "max" else t)
        for sa, sb in (([3, 5], [5, 4]), ([1, 16], [16, 8]), ([2, 3, 4], [4, 2])):
            a, b = make_input(rng, sa, gen(dt, -1.0, 1.0)), make_input(rng, sb, gen(dt, -1.0, 1.0))
            want = narrow(np.matmul(f64(a.value()), f64(b.value())), dt)
            w.case("narrow", "matmul", [a, b], [want], tolerance=(ulp[dt], ulp[dt] * 0.1))
        # casts: f32 to the narrow dtype rounds to nearest even (ties included), back is exact
        ties = np.array([1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 65504.0, 65520.0, 6e-8,
                         -2.0 ** -25, 1e-3, -0.0, np.inf, -np.inf], dtype=np.float32)
        for x in (Input(ties), make_input(rng, [4, 5], lambda s: rng.standard_normal(s).astype(np.float32) * 100)):
            w.case("narrow", "cast", [x], [narrow(f64(x.value()), dt)], {"dtype": dt})
        a = make_input(rng, [6], gen(dt, -100.0, 100.0))
        w.case("narrow", "cast", [a], [f64(a.value()).astype(np.float32)], {"dtype": "f32"})
        w.case("narrow", "cast", [a], [np.trunc(f64(a.value())).astype(np.int32)], {"dtype": "i32"})
        w.case("narrow", "lt", [a, Input(narrow(np.float64(1.5), dt))], [f64(a.value()) < 1.5])
    # i32 computes in i64 and wraps on the way back, as numpy's int32 does
    i32 = lambda s: rng.integers(-2 ** 31, 2 ** 31, s).astype(np.int32)
    for op in ("add", "sub", "mul", "maximum"):
        a, b = make_input(rng, [3, 4], i32), make_input(rng, [4], i32)
        with np.errstate(over="ignore"):
            w.case("narrow", op, [a, b], [BIN_FN[op](a.value(), b.value())])
    a = make_input(rng, [2, 5], lambda s: rng.integers(-1000, 1000, s).astype(np.int32))
    w.case("narrow", "neg", [a], [-a.value()])
    w.case("narrow", "sum", [a], [np.sum(a.value(), axis=1, dtype=np.int32)], {"keepdim": 0, "axis": 1})
    w.case("narrow", "cast", [a], [a.value().astype(np.float16)], {"dtype": "f16"})
    # promotion, torch's: f16 with f32 is f32, f16 with bf16 f32, i32 with i64 i64, i32 with f16 f16
    h, bf = make_input(rng, [3], gen("f16", -4, 4)), make_input(rng, [3], gen("bf16", -4, 4))
    f = make_input(rng, [3], g_normal(rng, "f32"))
    w.case("narrow", "add", [h, f], [ref(f64(h.value()) + f64(f.value()), "f32")], tolerance=tol("f32", "arith"))
    w.case("narrow", "add", [bf, f], [ref(f64(bf.value()) + f64(f.value()), "f32")], tolerance=tol("f32", "arith"))
    w.case("narrow", "mul", [h, bf], [ref(f64(h.value()) * f64(bf.value()), "f32")], tolerance=tol("f32", "arith"))
    w.case("narrow", "add", [a, Input(np.array([1, 2, 3, 4, 5], dtype=np.int64))], [a.value().astype(np.int64) + [1, 2, 3, 4, 5]])
    k = make_input(rng, [3], lambda s: rng.integers(-9, 9, s).astype(np.int32))
    w.case("narrow", "mul", [k, h], [narrow(f64(k.value()) * f64(h.value()), "f16")], tolerance=(ulp["f16"], 0))


def attention_np(q, k, v, mask, scale, drop):
    """softmax(scale * q @ k^T, masked) @ v in float64: a bool mask drops the
    entries equal to drop, a float mask is added to the scores."""
    s = scale * np.matmul(f64(q), np.swapaxes(f64(k), -1, -2))
    if mask is not None:
        s = np.where(mask == drop, -np.inf, s) if mask.dtype == np.bool_ else s + f64(mask)
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    return np.matmul(e / e.sum(axis=-1, keepdims=True), f64(v))


def attention_grad_np(q, k, v, mask, scale, drop, o, do):
    """dq, dk and dv of attention for the gradient do of its result o,
    flattened one after the other, in float64: p recomputed, ds = p (do v^T -
    rowsum(do o))."""
    s = scale * np.matmul(f64(q), np.swapaxes(f64(k), -1, -2))
    if mask is not None:
        s = np.where(mask == drop, -np.inf, s) if mask.dtype == np.bool_ else s + f64(mask)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    dp = np.matmul(f64(do), np.swapaxes(f64(v), -1, -2))
    ds = p * (dp - (f64(do) * f64(o)).sum(axis=-1, keepdims=True))
    dq = scale * np.matmul(ds, f64(k))
    dk = scale * np.matmul(np.swapaxes(ds, -1, -2), f64(q))
    dv = np.matmul(np.swapaxes(p, -1, -2), f64(do))
    return np.concatenate([dq.ravel(), dk.ravel(), dv.ravel()])


def attention_family(w, rng):
    """attention, the fused op the compiler's attention pass makes: odd sizes
    around the kernel's 64-row blocks and 128- (f32) or 64-column (f64) tiles,
    head dims 1 to 128, no mask, causal and random bool masks of either
    polarity (broadcast over the batch), an additive float mask, strided
    operands; family "attention", with attention_grad, the backward, for each.
    Every row keeps its first column, so no row is all -inf."""
    for dt in FLOATS:
        for batch, t, s, d, e in (((), 1, 1, 1, 1), ((2,), 5, 5, 3, 4), ((2,), 65, 65, 17, 16),
                                  ((1, 3), 7, 70, 64, 64), ((2,), 130, 33, 128, 5), ((3,), 64, 64, 2, 33),
                                  ((2,), 70, 260, 24, 20)):
            for kind in ("none", "causal", "drop", "add"):
                q = make_input(rng, batch + (t, d), g_normal(rng, dt))
                k = make_input(rng, batch + (s, d), g_normal(rng, dt))
                v = make_input(rng, batch + (s, e), g_normal(rng, dt))
                scale = 1 / math.sqrt(d)
                ins, mask, drop = [q, k, v], None, False
                if kind == "causal":
                    mask = np.arange(s)[None, :] <= np.arange(t)[:, None] + (s - t if s > t else 0)
                elif kind == "drop":
                    mask = rng.random((1,) * len(batch) + (t, s)) < 0.3
                    mask[..., 0] = False
                    drop = True
                elif kind == "add":
                    mask = (rng.standard_normal(batch + (t, s)) * 0.5).astype(NP[dt])
                    mask[..., 1:][rng.random(mask[..., 1:].shape) < 0.2] = -np.inf
                if mask is not None:
                    ins.append(Input(mask))
                exp = attention_np(q.value(), k.value(), v.value(), mask, scale, drop)
                w.case("attention", "attention", ins, [ref(exp, dt)], {"scale": scale, "drop": int(drop)},
                       (2e-5, 2e-6) if dt == "f32" else (1e-11, 1e-12))
                # its backward, given o (the reference rounded to dt) and a random do
                o = Input(ref(exp, dt))
                do = make_input(rng, batch + (t, e), g_normal(rng, dt))
                grads = attention_grad_np(q.value(), k.value(), v.value(), mask, scale, drop, o.value(), do.value())
                gins = [q, k, v, o, do] + ([Input(mask)] if mask is not None else [])
                # gradients are sums of up to s + d + e terms of size about 1 that cancel: an absolute
                # part of 4 (s + d + e) u, and the relative part of the forward's
                n = s + d + e
                w.case("attention", "attention_grad", gins, [ref(grads, dt)], {"scale": scale, "drop": int(drop)},
                       (2e-5, 4 * n * 2.0**-24) if dt == "f32" else (1e-11, 4 * n * 2.0**-53))
    attention_decode_cases(w, rng)


def attention_decode_cases(w, rng):
    """attention's decode form (fewer than 4 query rows, attention.c): a
    KV cache's bool mask (1, S), or (T, S) one row per query, that keeps
    rows 0 .. n-1 for n of none (the row is NaN, as the ops give), one,
    some and all; a mask that drops whole 16-column blocks between kept
    ones; head sizes 1, 7, 48 and 33 (no whole vector); k and v strided as
    a (S, H*hs) cache seen per head."""
    for dt in FLOATS:
        for batch, t, s, d, e in (((6,), 1, 256, 48, 48), ((2, 3), 1, 37, 7, 5), ((3,), 2, 40, 33, 17),
                                  ((2,), 3, 17, 1, 3)):
            for keep in (0, 1, s // 2 + 3, s, "blocks"):
                if keep == "blocks":
                    mask = rng.random((t, s)) < 0.5
                    mask[:, 16:48] = False
                    mask[:, 0] = True
                else:
                    mask = np.arange(s)[None, :] < np.maximum(keep - (t - 1) + np.arange(t)[:, None], min(keep, 1))
                    if t == 1:
                        mask = mask[:1]
                q = make_input(rng, batch + (t, d), g_normal(rng, dt))
                # k and v as a KV cache (S, H, hs) seen per head (H, S, hs): rows H*hs apart
                h = int(np.prod(batch))
                k = Input(g_normal(rng, dt)((s, h, d)), [("permute", [1, 0, 2])])
                v = Input(g_normal(rng, dt)((s, h, e)), [("permute", [1, 0, 2])])
                if len(batch) > 1:  # (2, 3) heads: the same values, contiguous
                    k, v = Input(k.value().reshape(batch + (s, d))), Input(v.value().reshape(batch + (s, e)))
                kv, vv = k.value(), v.value()
                scale = 1 / math.sqrt(d)
                with np.errstate(invalid="ignore"):
                    exp = attention_np(q.value(), kv, vv, mask, scale, False)
                w.case("attention", "attention", [q, k, v, Input(mask)], [ref(exp, dt)], {"scale": scale, "drop": 0},
                       (2e-5, 2e-6) if dt == "f32" else (1e-11, 1e-12))


def main():
    if len(sys.argv) != 2:
        sys.stderr.write("usage: gen_refs.py OUTDIR\n")
        return 2
    outdir = sys.argv[1]
    os.makedirs(outdir, exist_ok=True)
    rng = np.random.default_rng(SEED)
    w = Writer()
    for fam in (binary_family, compare_family, where_family, unary_family, reduction_family,
                matmul_family, nn_family, views_family, creation_family, inplace_family,
                big_family):
        fam(w, rng)
    conv_family(w, np.random.default_rng(SEED + 21))   # its own stream: other families' cases stay as they are
    activation_family(w, np.random.default_rng(SEED + 22))
    reduce_more_family(w, np.random.default_rng(SEED + 23))
    data_family(w, np.random.default_rng(SEED + 24))
    select_family(w, np.random.default_rng(SEED + 25))
    narrow_family(w, np.random.default_rng(SEED + 37))
    attention_family(w, np.random.default_rng(SEED + 38))
    path = os.path.join(outdir, "ops.txt")
    for name, data in (("big.bin", bytes(w.bin)),
                       ("ops.txt", ("kiln-refs 1\n" + "\n".join(w.lines) + "\n").encode())):
        tmp = os.path.join(outdir, name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(outdir, name))
    total = sum(w.count.values())
    print("gen_refs: %d cases in %s (%s)" % (total, path,
          ", ".join("%s %d" % kv for kv in w.count.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
