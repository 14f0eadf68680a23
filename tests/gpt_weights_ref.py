#!/usr/bin/python3
"""examples/gpt_weights against numpy, without PyTorch (CI has none; the
round trip with PyTorch itself is bench/torch_roundtrip.py):

  load  weights under PyTorch's state_dict keys, written by gen_safetensors.py's
        writer (biases and layer norms random too, and the "mask" buffer a
        state_dict carries), must give the logits of the forward below, in f64
  save  the file kiln writes holds exactly those keys, and its weights give
        the logits kiln wrote with it

  gpt_weights_ref.py GPT_WEIGHTS_PROGRAM
"""
import json
import os
import struct
import subprocess
import sys
import tempfile
from collections import namedtuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_safetensors import write_file  # noqa: E402

L, H, C, T_MAX, V = 4, 4, 128, 64, 256  # GPT_BENCH_CONFIG
B, T = 2, 64
TOL = 1e-4
Tensor = namedtuple("Tensor", "name dtype shape raw")
NP = {"F32": "<f4", "I64": "<i8", "BOOL": "|b1"}


def keys():
    per = ["ln1_w", "ln1_b", "attn_w", "attn_b", "proj_w", "proj_b", "ln2_w", "ln2_b", "fc_w", "fc_b", "fc2_w", "fc2_b"]
    return ["wte", "wpe"] + [f"blocks.{l}.{k}" for l in range(L) for k in per] + ["lnf_w", "lnf_b"]


def shape(k):
    k = k.split(".")[-1]
    return {"wte": (V, C), "wpe": (T_MAX, C), "attn_w": (C, 3 * C), "attn_b": (3 * C,), "proj_w": (C, C),
            "fc_w": (C, 4 * C), "fc_b": (4 * C,), "fc2_w": (4 * C, C)}.get(k, (C,))


def save(path, arrays):
    dt = {np.dtype("float32"): "F32", np.dtype("int64"): "I64", np.dtype("bool"): "BOOL"}
    write_file(path, [Tensor(k, dt[a.dtype], a.shape, np.ascontiguousarray(a).astype(NP[dt[a.dtype]]).tobytes())
                      for k, a in arrays.items()])


def load(path):
    """Every tensor of a safetensors file (the format, read here by hand)."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for k, e in header.items():
        a, b = e["data_offsets"]
        out[k] = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=NP[e["dtype"]]).reshape(e["shape"])
    return out


def layer_norm(x, w, b):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b


def forward(W, idx):
    """gpt.h's architecture (its header comment), in f64: logits (B,T,V)."""
    W = {k: v.astype(np.float64) for k, v in W.items()}
    Bn, Tn = idx.shape
    hs = C // H
    x = W["wte"][idx] + W["wpe"][:Tn]
    causal = np.tril(np.ones((Tn, Tn), bool))
    for l in range(L):
        p = lambda k: W[f"blocks.{l}.{k}"]  # noqa: E731
        a = layer_norm(x, p("ln1_w"), p("ln1_b"))
        q, k, v = (a @ p("attn_w") + p("attn_b")).reshape(Bn, Tn, 3, H, hs).transpose(2, 0, 3, 1, 4)
        att = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(hs), -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        x = x + (att @ v).transpose(0, 2, 1, 3).reshape(Bn, Tn, C) @ p("proj_w") + p("proj_b")
        f = layer_norm(x, p("ln2_w"), p("ln2_b")) @ p("fc_w") + p("fc_b")
        f = 0.5 * f * (1 + np.tanh(np.sqrt(2 / np.pi) * (f + 0.044715 * f ** 3)))
        x = x + f @ p("fc2_w") + p("fc2_b")
    return layer_norm(x, W["lnf_w"], W["lnf_b"]) @ W["wte"].T


def check(what, got, want):
    err, scale = np.abs(got.astype(np.float64) - want).max(), np.abs(want).max()
    ok = got.shape == want.shape and err <= TOL * scale
    print(f"{what}: max |diff| {err:.3g}, max |logit| {scale:.3g} ({'ok' if ok else 'MISMATCH'})")
    return ok


def main():
    prog = sys.argv[1]
    rng = np.random.default_rng(22)
    W = {}
    for k in keys():
        s, last = shape(k), k.split(".")[-1]
        base = 1.0 if last.startswith("ln") and last.endswith("_w") else 0.0
        W[k] = (base + rng.normal(0, 0.02 if len(s) == 2 or base == 0 else 0.1, s)).astype(np.float32)
    idx = rng.integers(0, V, (B, T)).astype(np.int64)
    ok = True
    with tempfile.TemporaryDirectory() as d:
        p = lambda n: os.path.join(d, n)  # noqa: E731
        save(p("idx.safetensors"), {"idx": idx})
        save(p("w.safetensors"), {**W, "mask": np.tril(np.ones((T_MAX, T_MAX), bool))})
        subprocess.run([prog, "load", p("w.safetensors"), p("idx.safetensors"), p("out.safetensors")], check=True)
        out, want = load(p("out.safetensors")), forward(W, idx)
        ok &= check("load, eager", out["logits"], want)
        ok &= check("load, compiled", out["logits_compiled"], want)
        subprocess.run([prog, "save", "5", p("k.safetensors"), p("idx.safetensors"), p("out.safetensors")], check=True)
        K, out = load(p("k.safetensors")), load(p("out.safetensors"))
        if sorted(K) != sorted(keys()):
            print(f"save: the file's keys {sorted(K)}, want {sorted(keys())}")
            ok = False
        else:
            ok &= check("save", out["logits"], forward(K, idx))
    print("gpt_weights_ref:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
