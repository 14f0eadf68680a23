#!/usr/bin/python3
"""safetensors files for tests/test_safetensors.c, written and read with numpy,
json and struct only: an implementation of the format independent of kiln's.

Usage:
  gen_safetensors.py write OUTDIR   writes OUTDIR/safetensors/*.safetensors and
                                    OUTDIR/safetensors/expect.txt (what each holds)
  gen_safetensors.py read FILE      checks FILE against the format's rules and
                                    prints what it holds (exit 1 and why, when it breaks one)
  gen_safetensors.py seeds DIR      writes the fuzzer's seed files (tests/fuzz/corpus/fuzz_safetensors)

The format (https://github.com/huggingface/safetensors, README "Format"):
  8 bytes     N, the header's length, unsigned little-endian
  N bytes     a JSON object, UTF-8, which may end in spaces: for each tensor
              "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [BEGIN, END]},
              and optionally "__metadata__": {"key": "value", ...} (strings only)
  the rest    the data: each tensor's bytes, row-major and little-endian, at
              [BEGIN, END) counted from the start of the data; the tensors
              cover it exactly, with no gaps and no overlaps.
The reference writer pads the header with spaces to a multiple of 8 and lays
out the data by element size, largest first, then by name.

expect.txt and the output of `read` (whitespace separated tokens, one tensor a line):
  file NAME NTENSORS NMETA
  meta KEY VALUE                      NMETA lines
  t NAME DTYPE NDIM D1..DN VALUES     NTENSORS lines, in the order of the header
  NAME, KEY and VALUE are 'x' followed by the hex of their UTF-8 bytes (so any
  name fits in a token, the empty one too). VALUES: F32/F64 as float.hex ('nan',
  'inf', '-inf' too), I64 in decimal, BOOL as 0/1; '-' for any other dtype;
  or, for large tensors, 'ramp A B M': element i is A + B*(i mod M), exactly.
"""
import json
import math
import os
import struct
import sys

import numpy as np

SEED = 20250105
LE = {"F32": "<f4", "F64": "<f8", "I64": "<i8", "BOOL": "|b1", "F16": "<f2", "I32": "<i4", "U8": "|u1",
      "I16": "<i2", "U16": "<u2", "U32": "<u4", "U64": "<u8", "I8": "|i1"}
BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
        "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64,
        "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
KILN = ("F32", "F64", "I64", "BOOL", "F16", "BF16", "I32")


def hexname(s):
    return "x" + s.encode("utf-8").hex()


def bf16_values(raw):
    """bfloat16 bytes as the f32 values they are (the top halves of f32s)."""
    return (np.frombuffer(raw, dtype="<u2").astype("<u4") << 16).view("<f4")


def fmt_values(dtype, arr):
    flat = arr.reshape(-1).tolist()
    if dtype in ("F32", "F64", "F16", "BF16"):
        return [float(v).hex() for v in flat]
    if dtype == "BOOL":
        return ["1" if v else "0" for v in flat]
    return [str(int(v)) for v in flat]


class T:
    """One tensor: its name, the format's dtype, shape, and raw bytes."""

    def __init__(self, name, dtype, shape, values=None, raw=None, ramp=None):
        self.name, self.dtype, self.shape, self.ramp = name, dtype, tuple(shape), ramp
        if ramp is not None:
            a, b, m = ramp
            values = a + b * (np.arange(math.prod(shape)) % m)
        if raw is None:
            arr = np.asarray(values).reshape(self.shape)
            if dtype == "BF16":
                u = arr.astype("<f4").view("<u4")
                raw = (u >> 16).astype("<u2").tobytes()
            else:
                raw = arr.astype(LE[dtype]).tobytes()
            self.values = bf16_values(raw) if dtype == "BF16" else arr.astype(LE[dtype]) if dtype in KILN else None
        else:
            self.values = None
        self.raw = raw


def write_file(path, tensors, meta=None, data_order="reference", header_order="sorted", pad=True, indent=None,
               ensure_ascii=True):
    """Writes tensors per the format. data_order: 'reference' (element size
    descending, then name), 'given', or 'reversed'. header_order: 'sorted'
    (json sort_keys), 'given' or 'reversed'."""
    ts = list(tensors)
    if data_order == "reference":
        data = sorted(ts, key=lambda t: (-BITS[t.dtype], t.name))
    elif data_order == "reversed":
        data = ts[::-1]
    else:
        data = ts
    offsets, at = {}, 0
    for t in data:
        offsets[t.name] = (at, at + len(t.raw))
        at += len(t.raw)
    keys = [t.name for t in ts]
    if header_order == "reversed":
        keys = keys[::-1]
    header = {}
    if meta is not None:
        header["__metadata__"] = dict(meta)
    by = {t.name: t for t in ts}
    for k in keys:
        t = by[k]
        header[k] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": list(offsets[k])}
    text = json.dumps(header, indent=indent, ensure_ascii=ensure_ascii,
                      sort_keys=header_order == "sorted").encode("utf-8")
    if pad:
        text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(t.raw for t in data))
    return keys


def expect_lines(fname, tensors, keys, meta):
    by = {t.name: t for t in tensors}
    out = ["file %s %d %d" % (fname, len(keys), len(meta or {}))]
    for k, v in (meta or {}).items():
        out.append("meta %s %s" % (hexname(k), hexname(v)))
    for k in keys:
        t = by[k]
        vals = fmt_values(t.dtype, t.values) if t.values is not None else ["-"]
        if t.ramp is not None:
            vals = ["ramp"] + [float(x).hex() for x in t.ramp[:2]] + [str(t.ramp[2])]
        out.append(" ".join(["t", hexname(k), t.dtype, str(len(t.shape))] + [str(d) for d in t.shape] + vals))
    return out


def cases(rng):
    """(file name, tensors, metadata, write_file options) for each file."""
    f32 = rng.standard_normal(12).astype(np.float32)
    f32[[1, 4, 7, 10]] = [np.nan, np.inf, -0.0, np.float32(1e-45)]  # the last a denormal
    f64 = np.array([1 / 3, -0.0, -np.inf, np.nan, 5e-324, 1e308])
    i64 = np.array([np.iinfo(np.int64).min, -1, 0, 1, 2 ** 53 + 1, np.iinfo(np.int64).max])
    basic = [
        T("w", "F32", (3, 4), f32),
        T("b", "F64", (6,), f64),
        T("idx", "I64", (2, 3), i64),
        T("mask", "BOOL", (5,), [True, False, True, True, False]),
        T("s", "F32", (), [3.5]),
        T("empty", "F32", (0, 3), []),
        T("empty2", "I64", (2, 0, 4), []),
    ]
    layout = [
        T("a", "F32", (7, 3), rng.standard_normal(21)),
        T("b", "BOOL", (3, 2), rng.standard_normal(6) > 0),
        T("c", "F64", (5,), rng.standard_normal(5)),
        T("d", "I64", (1, 1, 2), [-5, 7]),
    ]
    odd = ["a.b/c", "\u540d\u524d", 'q"uote', "tab\there", "back\\slash", "sp ace", "", "\x01ctl",
           "emoji\U0001F600", "model.layers.0.self_attn.q_proj.weight"]
    names = [T(n, "I64", (1,), [i]) for i, n in enumerate(odd)]
    others = [
        T("h", "F16", (2, 2), [0.5, -1.0, 2.0, 65504.0]),
        T("bf", "BF16", (3,), [1.0, -2.0, 0.15625]),
        T("i", "I32", (2,), [-7, 7]),
        T("u", "U8", (4,), [0, 1, 254, 255]),
        T("ok", "F32", (2,), [1.25, -2.5]),
        T("rank9", "F32", (1,) * 9, [4.0]),
    ]
    model = [
        T("fc1.weight", "F32", (8, 4), rng.standard_normal(32)),
        T("fc1.bias", "F32", (8,), rng.standard_normal(8)),
        T("fc2.weight", "F32", (3, 8), rng.standard_normal(24)),
        T("fc2.bias", "F32", (3,), rng.standard_normal(3)),
    ]
    big = [
        T("big", "F32", (512, 1031), ramp=(-100.0, 0.25, 997)),
        T("tail", "F64", (3,), [1.0, 2.0, 3.0]),
    ]
    return [
        ("basic.safetensors", basic, {"format": "pt", "note": "\u00fcn\u00efcode \u2713"}, {}),
        ("layout.safetensors", layout, None,
         dict(data_order="reversed", header_order="given", pad=False, indent=2, ensure_ascii=False)),
        ("names.safetensors", names, None, dict(header_order="reversed")),
        ("others.safetensors", others, None, dict(data_order="given", header_order="given")),
        ("model.safetensors", model, {"format": "pt"}, {}),
        ("big.safetensors", big, None, {}),
        ("empty.safetensors", [], {"only": "metadata"}, {}),
    ]


def write(outdir):
    d = os.path.join(outdir, "safetensors")
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(SEED)
    lines = []
    for fname, tensors, meta, opts in cases(rng):
        keys = write_file(os.path.join(d, fname), tensors, meta, **opts)
        lines += expect_lines(fname, tensors, keys, meta)
    with open(os.path.join(d, "expect.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def fail(why):
    print("not a valid safetensors file: " + why, file=sys.stderr)
    sys.exit(1)


def read(path):
    """Checks path against the format strictly (and kiln's writer against the
    reference's layout: the header padded to 8) and prints what it holds."""
    blob = open(path, "rb").read()
    if len(blob) < 8:
        fail("shorter than 8 bytes")
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        fail("header length %d past the end" % n)
    if n % 8:
        fail("header length %d is not padded to a multiple of 8" % n)
    text = blob[8:8 + n]
    if not text.startswith(b"{"):
        fail("header does not start with '{'")

    def no_dups(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            fail("duplicate keys")
        return dict(pairs)

    header = json.loads(text.decode("utf-8"), object_pairs_hook=no_dups)
    data = blob[8 + n:]
    meta = header.pop("__metadata__", {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        fail("metadata values must be strings")
    spans = []
    out = ["file %s %d %d" % (os.path.basename(path), len(header), len(meta))]
    for k, v in meta.items():
        out.append("meta %s %s" % (hexname(k), hexname(v)))
    for name, info in header.items():
        if set(info) != {"dtype", "shape", "data_offsets"}:
            fail("entry %r has keys %s" % (name, sorted(info)))
        dt, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
        if dt not in BITS:
            fail("unknown dtype " + dt)
        numel = math.prod(shape)
        if numel * BITS[dt] != (e - b) * 8:
            fail("entry %r: %d bytes for %s%s" % (name, e - b, dt, shape))
        if BITS[dt] >= 8 and b % (BITS[dt] // 8):
            fail("entry %r at %d is not aligned to its element size" % (name, b))
        spans.append((b, e, name))
        vals = ["-"]
        if dt in KILN:
            arr = (bf16_values(data[b:e]) if dt == "BF16" else np.frombuffer(data[b:e], dtype=LE[dt])).reshape(shape)
            vals = fmt_values(dt, arr)
        out.append(" ".join(["t", hexname(name), dt, str(len(shape))] + [str(x) for x in shape] + vals))
    at = 0
    for b, e, name in sorted(spans):
        if b != at:
            fail("entry %r starts at %d, expected %d (gap or overlap)" % (name, b, at))
        at = e
    if at != len(data):
        fail("the data is %d bytes, the entries cover %d" % (len(data), at))
    print("\n".join(out))


def seeds(d):
    """Seed files for fuzz_safetensors: valid files and near misses."""
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(SEED)
    for fname, tensors, meta, opts in cases(rng):
        if fname == "big.safetensors":
            continue
        write_file(os.path.join(d, fname.replace(".safetensors", "")), tensors, meta, **opts)

    def raw(name, header, data=b"", pad=True, length=None):
        text = header.encode("utf-8")
        if pad:
            text += b" " * (-len(text) % 8)
        n = len(text) if length is None else length
        with open(os.path.join(d, name), "wb") as f:
            f.write(struct.pack("<Q", n) + text + data)

    one = '{"a":{"dtype":"F32","shape":[2],"data_offsets":[%d,%d]}%s}'
    raw("gap", '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
               '"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}', bytes(12))
    raw("overlap", '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                   '"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', bytes(8))
    raw("past_end", one % (0, 8, ""), bytes(4))
    raw("bad_dtype", '{"a":{"dtype":"F17","shape":[2],"data_offsets":[0,8]}}', bytes(8))
    raw("negative_dim", '{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}', bytes(8))
    raw("huge_shape", '{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}}', bytes(8))
    raw("duplicate", '{"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]},'
                     '"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}', bytes(4))
    raw("header_too_long", one % (0, 8, ""), bytes(8), length=1 << 40)
    raw("not_object", '[1,2,3]')
    raw("bool_bytes", '{"m":{"dtype":"BOOL","shape":[4],"data_offsets":[0,4]}}', bytes([0, 1, 2, 255]))
    raw("f4", '{"q":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}', bytes(2))


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("write", "read", "seeds"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    {"write": write, "read": read, "seeds": seeds}[sys.argv[1]](sys.argv[2])


if __name__ == "__main__":
    main()
