"""The workloads of docs/workloads.md (and the GPT ones, W8 and W9, from torch_gpt.py) in PyTorch.

Each workload is timed four ways, interleaved sample by sample so that all of
them see the same machine:

  eager        op by op, exactly as kiln's bench writes it
  builtin      PyTorch's own fused ops (F.gelu, torch.softmax, F.layer_norm,
               addmm): the bar for a compiled kernel
  torchscript  the op-by-op program through torch.jit.script, then
               torch.jit.freeze (weights become constants) for inference; the
               training steps script the loss and call backward from Python
  compiled     torch.compile of the op-by-op program, where the installed
               PyTorch has it (2.0 and later); otherwise reported as not available

Same timing as kiln_bench: 5 warmups, then at least 20 samples (W8 and W9:
bench/gpt.c's 3 warmups and at least 5 samples); median and min in ms. A compiler's one-off cost is reported apart ("prep" ms): for
TorchScript the script and freeze calls plus what its first calls (profiling
runs) take beyond the steady state, for torch.compile what its first call
takes beyond the steady state.

    /usr/bin/python3 bench/torch_workloads.py [--threads 1,2] [--only W1,W3]
        [--modes eager,builtin,torchscript,compiled] [--json PATH]

The JSON is {"meta": {...}, "rows": [{"name", "threads", "torch_eager_ms", ...}]}.
"""

import argparse
import json
import math
import os
import sys
import time

EPS = 1e-5
LR = 1e-3

WARMUP = 5
MIN_SAMPLES = 20
MAX_SAMPLES = 1000
SAMPLE_BUDGET_S = 0.6  # per timed function, as kiln_bench
PROFILING_CALLS = 2    # TorchScript's profiling executor optimizes after this many calls

MODES = ("eager", "builtin", "torchscript", "compiled")
torch = F = nn = None  # imported in main, so a missing PyTorch is reported cleanly


# ---- the formulations, op by op (scriptable: TorchScript compiles these) ----

# Constants are literals in the functions TorchScript compiles (it cannot read
# Python globals): C = 0.7978845608, A = 0.044715, EPS = 1e-5.

def gelu_ops(x):
    # pow, mul, add, mul, tanh, add, mul, mul
    return (0.5 * x) * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3))))


def softmax_ops(x):
    m = torch.amax(x, -1, keepdim=True)
    e = torch.exp(x - m)
    s = torch.sum(e, -1, keepdim=True)
    return e / s


def layernorm_ops(x, w, b):
    mu = torch.mean(x, -1, keepdim=True)
    d = x - mu
    var = torch.mean(d * d, -1, keepdim=True)
    return d * torch.rsqrt(var + 1e-5) * w + b


def mlp_ops(x, w1, b1, w2, b2):
    h = x @ w1 + b1
    return gelu_ops(h) @ w2 + b2


def mlp_builtin(x, w1, b1, w2, b2):
    h = torch.addmm(b1, x, w1)
    return torch.addmm(b2, F.gelu(h, approximate="tanh"), w2)


def randn(*shape, scale=1.0, shift=0.0):
    return torch.randn(*shape, dtype=torch.float32) * scale + shift


# ---- workloads ------------------------------------------------------------
#
# Each maker returns a dict of mode -> builder; a builder takes no argument and
# returns (step, prep_ms): the function to time and the one-off cost already
# paid while building it. A mode a workload does not have is left out.

def script_frozen(module, *inputs):
    """torch.jit.script + freeze; returns (call, ms spent scripting and freezing)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        sm = torch.jit.freeze(torch.jit.script(module.eval()))
    ms = 1e3 * (time.perf_counter() - t0)

    def call():
        with torch.no_grad():
            return sm(*inputs)
    return call, ms


def compiled_module(module, *inputs):
    cm = torch.compile(module.eval())

    def call():
        with torch.no_grad():
            return cm(*inputs)
    return call, 0.0


def inference(module_cls, inputs, weights, eager, builtin):
    """The four modes of an inference workload whose op-by-op form is module_cls."""
    def make_module():
        m = module_cls()
        for k, v in weights.items():
            m.register_buffer(k, v)
        return m
    return {
        "eager": lambda: (eager, 0.0),
        "builtin": lambda: (builtin, 0.0),
        "torchscript": lambda: script_frozen(make_module(), *inputs),
        "compiled": lambda: compiled_module(make_module(), *inputs),
    }


def make_w1():
    x = randn(4194304)

    class Gelu(nn.Module):
        def forward(self, x):
            return gelu_ops(x)
    return inference(Gelu, (x,), {}, lambda: gelu_ops(x), lambda: F.gelu(x, approximate="tanh"))


def make_w2():
    x = randn(4096, 1024)

    class Softmax(nn.Module):
        def forward(self, x):
            return softmax_ops(x)
    return inference(Softmax, (x,), {}, lambda: softmax_ops(x), lambda: torch.softmax(x, -1))


def make_w3():
    x = randn(4096, 1024)
    w = randn(1024, scale=0.1, shift=1.0)
    b = randn(1024, scale=0.1)

    class LayerNorm(nn.Module):
        def forward(self, x):
            return layernorm_ops(x, self.w, self.b)
    return inference(LayerNorm, (x,), {"w": w, "b": b}, lambda: layernorm_ops(x, w, b),
                     lambda: F.layer_norm(x, (1024,), w, b, EPS))


def mlp_inputs():
    return (randn(256, 1024), randn(1024, 4096, scale=0.02), randn(4096, scale=0.02),
            randn(4096, 1024, scale=0.02), randn(1024, scale=0.02))


def make_w4():
    x, w1, b1, w2, b2 = mlp_inputs()

    class MLP(nn.Module):
        def forward(self, x):
            return mlp_ops(x, self.w1, self.b1, self.w2, self.b2)
    return inference(MLP, (x,), {"w1": w1, "b1": b1, "w2": w2, "b2": b2},
                     lambda: mlp_ops(x, w1, b1, w2, b2), lambda: mlp_builtin(x, w1, b1, w2, b2))


def make_w5():
    x, *init = mlp_inputs()
    t = randn(256, 1024)

    def fresh():
        return [p.clone().requires_grad_(True) for p in init]

    def sgd(params, sub):
        with torch.no_grad():
            for p in params:
                if sub:
                    p.sub_(LR * p.grad)
                else:
                    p.add_(p.grad, alpha=-LR)
                p.grad = None

    def eager():
        params = fresh()

        def step():
            y = mlp_ops(x, *params)
            loss = torch.mean((y - t) ** 2)
            loss.backward()
            sgd(params, True)
            return loss
        return step, 0.0

    def builtin():
        params = fresh()

        def step():
            loss = F.mse_loss(mlp_builtin(x, *params), t)
            loss.backward()
            sgd(params, False)
            return loss
        return step, 0.0

    class Loss(nn.Module):
        def __init__(self, params):
            super().__init__()
            self.w1, self.b1, self.w2, self.b2 = (nn.Parameter(p.detach()) for p in params)

        def forward(self, x, t):
            y = mlp_ops(x, self.w1, self.b1, self.w2, self.b2)
            return torch.mean((y - t) ** 2)

    def with_module(wrap):
        m = Loss(fresh())
        params = list(m.parameters())
        t0 = time.perf_counter()
        fwd = wrap(m)
        ms = 1e3 * (time.perf_counter() - t0)

        def step():
            loss = fwd(x, t)
            loss.backward()
            sgd(params, True)
            return loss
        return step, ms

    return {"eager": eager, "builtin": builtin,
            "torchscript": lambda: with_module(torch.jit.script),
            "compiled": lambda: with_module(torch.compile)}


def make_w6():
    x = randn(1, 256)
    (w1, b1), (w2, b2), (w3, b3) = [(randn(256, 256, scale=1 / 16), randn(256, scale=1 / 16))
                                    for _ in range(3)]

    def eager():
        h = torch.relu(x @ w1.t() + b1)
        h = torch.relu(h @ w2.t() + b2)
        return h @ w3.t() + b3

    def builtin():
        h = torch.relu(F.linear(x, w1, b1))
        h = torch.relu(F.linear(h, w2, b2))
        return F.linear(h, w3, b3)

    class Batch1(nn.Module):
        def forward(self, x):
            h = torch.relu(x @ self.w1.t() + self.b1)
            h = torch.relu(h @ self.w2.t() + self.b2)
            return h @ self.w3.t() + self.b3
    return inference(Batch1, (x,), {"w1": w1, "b1": b1, "w2": w2, "b2": b2, "w3": w3, "b3": b3},
                     eager, builtin)


def make_w7():
    q, k, v = randn(8, 512, 64), randn(8, 512, 64), randn(8, 512, 64)

    def eager():
        s = (q @ k.transpose(1, 2)) / 8
        return softmax_ops(s) @ v

    def builtin():
        return torch.softmax(torch.matmul(q, k.transpose(1, 2)) / 8, -1) @ v

    class Attention(nn.Module):
        def forward(self, q, k, v):
            s = (q @ k.transpose(1, 2)) / 8
            return softmax_ops(s) @ v
    return inference(Attention, (q, k, v), {}, eager, builtin)


WORKLOADS = [
    ("W1", "W1_gelu", make_w1),
    ("W2", "W2_softmax", make_w2),
    ("W3", "W3_layernorm", make_w3),
    ("W4", "W4_mlp_fwd", make_w4),
    ("W5", "W5_mlp_train", make_w5),
    ("W6", "W6_batch1", make_w6),
    ("W7", "W7_attention", make_w7),
]


# ---- timing ---------------------------------------------------------------

def median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def first_calls(fn, n):
    """Runs fn n times; returns the total ms."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e3 * (time.perf_counter() - t0)


DEFAULT_TIMING = {"warmup": WARMUP, "min_samples": MIN_SAMPLES, "max_samples": MAX_SAMPLES,
                  "budget_s": SAMPLE_BUDGET_S}


def time_interleaved(fns, timing=DEFAULT_TIMING):
    """{mode: (median ms, min ms)} for the given {mode: fn}, plus the sample count.

    Warmups first, then rounds that call every function once each, so a load
    spike on a shared machine hits all modes alike. timing: the counts above,
    which a workload may override (the GPT ones use bench/gpt.c's)."""
    t0 = time.perf_counter()
    for fn in fns.values():
        for _ in range(timing["warmup"]):
            fn()
    per_round = (time.perf_counter() - t0) / max(timing["warmup"], 1)
    n = int(len(fns) * timing["budget_s"] / max(per_round, 1e-9))
    n = max(timing["min_samples"], min(timing["max_samples"], n))
    ms = {k: [] for k in fns}
    for _ in range(n):
        for k, fn in fns.items():
            a = time.perf_counter()
            fn()
            ms[k].append(1e3 * (time.perf_counter() - a))
    return {k: (median(v), min(v)) for k, v in ms.items()}, n


def bench_workload(name, make, modes, errors):
    """One row's timing fields for the selected modes at the current thread count."""
    builders = make()
    fns, prep, first = {}, {}, {}
    for mode in modes:
        if mode not in builders:
            continue
        try:
            fn, prep_ms = builders[mode]()
            # compilers do their work on the first calls: count it as prep, not as a sample
            first[mode] = first_calls(fn, PROFILING_CALLS if mode != "eager" else 1)
            fns[mode], prep[mode] = fn, prep_ms
        except Exception as e:  # a mode that cannot build this workload is reported, not fatal
            msg = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            errors.setdefault(mode, {})[name] = msg
            print(f"  {name}: {mode} failed: {msg}", file=sys.stderr)
    if not fns:
        return {}
    times, n = time_interleaved(fns, getattr(make, "timing", DEFAULT_TIMING))
    row = {"samples": n}
    key = {"eager": "torch_eager", "builtin": "torch_builtin", "torchscript": "torchscript",
           "compiled": "torch_compiled"}
    for mode, (med, mn) in times.items():
        row[f"{key[mode]}_ms"] = med
        row[f"{key[mode]}_min_ms"] = mn
        if mode in ("torchscript", "compiled"):
            calls = PROFILING_CALLS
            row[f"{key[mode]}_prep_ms"] = prep[mode] + max(0.0, first[mode] - calls * med)
    extra = getattr(make, "extra_fields", None)
    if extra:
        row.update(extra(row))
    return row


# ---- machine and versions -------------------------------------------------

def torch_compile_status():
    if not hasattr(torch, "compile"):
        return False, f"not available (PyTorch {torch.__version__} has no torch.compile; it needs 2.0 or later)"
    return True, "available"


def meta_info(threads):
    ok, status = torch_compile_status()
    meta = {"torch_version": torch.__version__, "numpy_version": None,
            "torch_compile": status, "torch_compile_available": ok,
            "torchscript_cpu_fuser": bool(getattr(torch._C, "_jit_can_fuse_on_cpu", lambda: False)()),
            "torch_llvm": bool(getattr(torch._C, "_llvm_enabled", lambda: False)()),
            "threads": threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    try:
        import numpy
        meta["numpy_version"] = numpy.__version__
    except ImportError:
        pass
    return meta


def write_json(path, doc):
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")


def fmt(v):
    return f"{v:.3f}" if isinstance(v, float) and math.isfinite(v) else "-"


def main():
    global torch, F, nn
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", help="comma list of thread counts (default: 1,2)")
    ap.add_argument("--only", help="comma list of workload ids or names (W1,W3)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    ap.add_argument("--json", help="write results to this path")
    args = ap.parse_args()

    try:
        import torch as _torch
        import torch.nn as _nn
        import torch.nn.functional as _F
    except ImportError:
        print("torch_workloads: PyTorch is not installed (apt-get install python3-torch); "
              "skipping the torch side", file=sys.stderr)
        write_json(args.json, {"meta": {"torch_version": None}, "rows": []})
        return 0
    torch, nn, F = _torch, _nn, _F
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch_gpt
    workloads = WORKLOADS + torch_gpt.workloads(torch)

    try:
        threads = [int(t) for t in (args.threads or "1,2").split(",")]
        if any(t < 1 for t in threads):
            raise ValueError
    except ValueError:
        ap.error(f"--threads wants positive integers, got {args.threads}")
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode {bad[0]} (modes: {', '.join(MODES)})")
    only = set(args.only.split(",")) if args.only else None

    meta = meta_info(threads)
    if "compiled" in modes and not meta["torch_compile_available"]:
        modes.remove("compiled")
    print(f"torch {torch.__version__}; torch.compile: {meta['torch_compile']}", flush=True)
    cols = [("eager", "torch_eager_ms"), ("builtin", "torch_builtin_ms"),
            ("script", "torchscript_ms"), ("script prep", "torchscript_prep_ms"),
            ("compiled", "torch_compiled_ms"), ("comp prep", "torch_compiled_prep_ms")]
    print(f"{'workload':<16} {'threads':>7} " + " ".join(f"{c:>11}" for c, _ in cols))
    rows, errors = [], {}
    for wid, name, make in workloads:
        if only and wid not in only and name not in only:
            continue
        for n in threads:
            torch.set_num_threads(n)
            torch.manual_seed(0)
            row = {"name": name, "threads": n}
            row.update(bench_workload(name, make, modes, errors))
            rows.append(row)
            print(f"{name:<16} {n:>7} " + " ".join(f"{fmt(row.get(k)):>11}" for _, k in cols),
                  flush=True)
    if not rows:
        print(f"no workload matches --only {args.only}", file=sys.stderr)
        return 2
    meta["errors"] = errors
    write_json(args.json, {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
