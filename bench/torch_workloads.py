"""The workloads W1..W7 of WORKLOADS.md in PyTorch eager, for comparison.

Each workload is timed twice: written op by op exactly as kiln's bench writes
it ("eager"), and with PyTorch's own fused ops ("builtin": F.gelu, torch.softmax,
F.layer_norm, addmm), the bar for compiled code. Same timing as kiln_bench:
5 warmups, then at least 20 samples; median and min in ms.

    /usr/bin/python3 bench/torch_workloads.py [--threads N] [--only W1,W3] [--json PATH]
"""

import argparse
import json
import sys
import time

C = 0.7978845608  # sqrt(2/pi)
A = 0.044715
EPS = 1e-5
LR = 1e-3

WARMUP = 5
MIN_SAMPLES = 20
MAX_SAMPLES = 1000
SAMPLE_BUDGET_S = 0.6


def gelu_ops(x):
    # pow, mul, add, mul, tanh, add, mul, mul
    return (0.5 * x) * (1.0 + torch.tanh(C * (x + A * torch.pow(x, 3))))


def softmax_ops(x):
    m = torch.amax(x, -1, keepdim=True)
    e = torch.exp(x - m)
    s = torch.sum(e, -1, keepdim=True)
    return e / s


def layernorm_ops(x, w, b):
    mu = torch.mean(x, -1, keepdim=True)
    d = x - mu
    var = torch.mean(d * d, -1, keepdim=True)
    return d * torch.rsqrt(var + EPS) * w + b


def mlp_ops(x, w1, b1, w2, b2):
    h = x @ w1 + b1
    return gelu_ops(h) @ w2 + b2


def mlp_builtin(x, w1, b1, w2, b2):
    h = torch.addmm(b1, x, w1)
    return torch.addmm(b2, F.gelu(h, approximate="tanh"), w2)


def randn(*shape, scale=1.0, shift=0.0):
    return torch.randn(*shape, dtype=torch.float32) * scale + shift


# Each maker returns (eager_fn, builtin_fn), both taking no arguments.

def make_w1():
    x = randn(4194304)
    return (lambda: gelu_ops(x)), (lambda: F.gelu(x, approximate="tanh"))


def make_w2():
    x = randn(4096, 1024)
    return (lambda: softmax_ops(x)), (lambda: torch.softmax(x, -1))


def make_w3():
    x = randn(4096, 1024)
    w = randn(1024, scale=0.1, shift=1.0)
    b = randn(1024, scale=0.1)
    return (lambda: layernorm_ops(x, w, b)), (lambda: F.layer_norm(x, (1024,), w, b, EPS))


def mlp_inputs():
    return (randn(256, 1024), randn(1024, 4096, scale=0.02), randn(4096, scale=0.02),
            randn(4096, 1024, scale=0.02), randn(1024, scale=0.02))


def make_w4():
    args = mlp_inputs()
    return (lambda: mlp_ops(*args)), (lambda: mlp_builtin(*args))


def make_w5():
    x, *params = mlp_inputs()
    t = randn(256, 1024)
    for p in params:
        p.requires_grad_(True)

    def eager():
        y = mlp_ops(x, *params)
        loss = torch.mean((y - t) ** 2)
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.sub_(LR * p.grad)
                p.grad = None
        return loss

    def builtin():
        y = mlp_builtin(x, *params)
        loss = F.mse_loss(y, t)
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-LR)
                p.grad = None
        return loss

    return eager, builtin


def make_w6():
    x = randn(1, 256)
    layers = [(randn(256, 256, scale=1 / 16), randn(256, scale=1 / 16)) for _ in range(3)]
    (w1, b1), (w2, b2), (w3, b3) = layers

    def eager():
        h = torch.relu(x @ w1.t() + b1)
        h = torch.relu(h @ w2.t() + b2)
        return h @ w3.t() + b3

    def builtin():
        h = torch.relu(F.linear(x, w1, b1))
        h = torch.relu(F.linear(h, w2, b2))
        return F.linear(h, w3, b3)

    return eager, builtin


def make_w7():
    q, k, v = randn(8, 512, 64), randn(8, 512, 64), randn(8, 512, 64)

    def eager():
        s = (q @ k.transpose(1, 2)) / 8
        return softmax_ops(s) @ v

    def builtin():
        return torch.softmax(torch.matmul(q, k.transpose(1, 2)) / 8, -1) @ v

    return eager, builtin


WORKLOADS = [
    ("W1", "W1_gelu", make_w1),
    ("W2", "W2_softmax", make_w2),
    ("W3", "W3_layernorm", make_w3),
    ("W4", "W4_mlp_fwd", make_w4),
    ("W5", "W5_mlp_train", make_w5),
    ("W6", "W6_batch1", make_w6),
    ("W7", "W7_attention", make_w7),
]


def time_fn(fn):
    """(median ms, min ms, samples) over the timed calls after the warmups."""
    t0 = time.perf_counter()
    for _ in range(WARMUP):
        fn()
    per_call = (time.perf_counter() - t0) / WARMUP
    n = int(SAMPLE_BUDGET_S / max(per_call, 1e-9))
    n = max(MIN_SAMPLES, min(MAX_SAMPLES, n))
    ms = []
    for _ in range(n):
        a = time.perf_counter()
        fn()
        ms.append(1e3 * (time.perf_counter() - a))
    ms.sort()
    median = ms[n // 2] if n % 2 else 0.5 * (ms[n // 2 - 1] + ms[n // 2])
    return median, ms[0], n


def write_json(path, rows):
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=2)
            f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, help="run at N threads only (default: 1 and 2)")
    ap.add_argument("--only", help="comma list of workload ids or names (W1,W3)")
    ap.add_argument("--json", help="write results to this path")
    args = ap.parse_args()

    global torch, F
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("torch_workloads: PyTorch is not installed (apt-get install python3-torch); "
              "skipping the torch side", file=sys.stderr)
        write_json(args.json, [])
        return 0

    threads = [args.threads] if args.threads else [1, 2]
    only = set(args.only.split(",")) if args.only else None
    torch.manual_seed(0)

    rows = []
    print(f"torch {torch.__version__}")
    print(f"{'workload':<14} {'threads':>7} {'eager ms':>10} {'eager min':>10} "
          f"{'builtin ms':>10} {'builtin min':>11}")
    for wid, name, make in WORKLOADS:
        if only and wid not in only and name not in only:
            continue
        for n in threads:
            torch.set_num_threads(n)
            eager, builtin = make()
            e_med, e_min, e_n = time_fn(eager)
            b_med, b_min, _ = time_fn(builtin)
            rows.append({"name": name, "threads": n,
                         "torch_eager_ms": e_med, "torch_eager_min_ms": e_min,
                         "torch_builtin_ms": b_med, "torch_builtin_min_ms": b_min,
                         "samples": e_n})
            print(f"{name:<14} {n:>7} {e_med:>10.3f} {e_min:>10.3f} {b_med:>10.3f} {b_min:>11.3f}",
                  flush=True)
            del eager, builtin
    if not rows:
        print(f"no workload matches --only {args.only}", file=sys.stderr)
        return 2
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
