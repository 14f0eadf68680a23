"""W13, W14 and R50 in PyTorch: the ResNets of examples/resnet.h, the same
architectures, init, SGD step and data as bench/resnet.c.

  W13_resnet18_b1     ResNet-18 (CIFAR variant, width 64) inference in eval
  W13_resnet18_b32    mode on (1|32, 3, 32, 32): ms per call, under no_grad
  W14_resnet18_train  one training step on 32 images: forward, cross entropy,
                      backward, SGD with momentum 0.9 (lr 0.05), the batch
                      norms' running statistics: ms per step
  R50_resnet50_b1     ResNet-50 inference in eval mode on (1, 3, 224, 224)
                      (named with --only only; kiln's docs/perf.md compares
                      kiln with itself there)

Each is timed two ways, interleaved sample by sample:

  eager     the model as written, PyTorch's builtin conv2d, batch_norm, ...
  compiled  torch.compile of the same function, where the installed PyTorch
            has it (2.0 and later); otherwise reported as not available

Timing as bench/resnet.c: 2 warmups, then samples for about 10 s (at least 5),
median in ms. torch.compile's one-off cost is reported apart ("prep" ms): what
its first call takes beyond the steady state.

    /usr/bin/python3 bench/torch_resnet.py [--threads 1,2] [--only W13,W14]
        [--modes eager,compiled] [--json PATH]

The JSON is {"meta": {...}, "rows": [{"name", "threads", "torch_eager_ms",
"torch_compiled_ms", "torch_compiled_prep_ms"}]}; a mode that did not run has
null. Torch threads: torch.set_num_threads(N) (and OpenBLAS/MKL/OMP through
their variables, which the caller sets before starting Python).
"""

import argparse
import json
import math
import sys
import time

WARMUP = 2
MIN_SAMPLES = 5
MAX_SAMPLES = 100
BUDGET_S = 10.0
CLASSES = 10
MOMENTUM, EPS = 0.1, 1e-5
LR, SGD_MOMENTUM = 0.05, 0.9

WORKLOADS = {
    # name: (model, batch, image size, training)
    "W13_resnet18_b1": ("resnet18_cifar", 1, 32, False),
    "W13_resnet18_b32": ("resnet18_cifar", 32, 32, False),
    "W14_resnet18_train": ("resnet18_cifar", 32, 32, True),
    "R50_resnet50_b1": ("resnet50", 1, 224, False),
}
DEFAULT = ("W13_resnet18_b1", "W13_resnet18_b32", "W14_resnet18_train")

torch = nn = F = None  # imported in main, so that a missing PyTorch is reported cleanly


def build(kind):
    """examples/resnet.h's network, its init included (zero_init_residual)."""

    class ConvBN(nn.Module):
        def __init__(self, cin, cout, k, stride):
            super().__init__()
            self.conv = nn.Conv2d(cin, cout, k, stride, k // 2, bias=False)
            self.bn = nn.BatchNorm2d(cout, eps=EPS, momentum=MOMENTUM)
            nn.init.normal_(self.conv.weight, 0.0, math.sqrt(2.0 / (cout * k * k)))

        def forward(self, x):
            return self.bn(self.conv(x))

    class Block(nn.Module):
        def __init__(self, convs, down):
            super().__init__()
            self.convs = nn.ModuleList(convs)
            self.down = down
            nn.init.zeros_(convs[-1].bn.weight)

        def forward(self, x):
            o = x
            for i, c in enumerate(self.convs):
                o = c(o)
                if i + 1 < len(self.convs):
                    o = F.relu(o)
            return F.relu(o + (self.down(x) if self.down is not None else x))

    class ResNet(nn.Module):
        def __init__(self, imagenet, blocks, classes):
            super().__init__()
            self.imagenet = imagenet
            self.stem = ConvBN(3, 64, 7, 2) if imagenet else ConvBN(3, 64, 3, 1)
            self.blocks = nn.Sequential(*blocks)
            cin = blocks[-1].convs[-1].conv.out_channels
            self.fc = nn.Linear(cin, classes)
            nn.init.normal_(self.fc.weight, 0.0, 1.0 / math.sqrt(cin))
            nn.init.zeros_(self.fc.bias)

        def forward(self, x):
            h = F.relu(self.stem(x))
            if self.imagenet:
                h = F.max_pool2d(h, 3, 2, 1)
            h = self.blocks(h)
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))

    blocks = []
    if kind == "resnet18_cifar":
        cin = 64
        for s in range(4):
            out = 64 << s
            for b in range(2):
                stride = 2 if s > 0 and b == 0 else 1
                down = ConvBN(cin, out, 1, stride) if stride != 1 or cin != out else None
                blocks.append(Block([ConvBN(cin, out, 3, stride), ConvBN(out, out, 3, 1)], down))
                cin = out
        return ResNet(False, blocks, CLASSES)
    cin = 64
    for s, n in enumerate((3, 4, 6, 3)):
        width = 64 << s
        for b in range(n):
            stride = 2 if s > 0 and b == 0 else 1
            down = ConvBN(cin, 4 * width, 1, stride) if b == 0 else None
            blocks.append(Block([ConvBN(cin, width, 1, 1), ConvBN(width, width, 3, stride),
                                 ConvBN(width, 4 * width, 1, 1)], down))
            cin = 4 * width
    return ResNet(True, blocks, 1000)


def data(batch, hw, classes):
    """Class templates (4x4 squares per channel) plus N(0,1) noise, as resnet.h (other values, same law)."""
    g = torch.Generator().manual_seed(7)
    q = hw // 4
    t = torch.randn(classes, 3, 4, 1, 4, 1, generator=g).expand(classes, 3, 4, q, 4, q).reshape(classes, 3, hw, hw)
    labels = torch.randint(0, classes, (batch,), generator=g)
    return t[labels] + torch.randn(batch, 3, hw, hw, generator=g), labels


def make_step(model, training):
    if not training:
        def infer(x, labels):
            with torch.no_grad():
                return model(x)
        return infer
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=SGD_MOMENTUM)

    def loss_of(x, labels):
        return F.cross_entropy(model(x), labels)

    def step(x, labels, loss_fn=loss_of):
        loss = loss_fn(x, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    step.loss_of = loss_of
    return step


def timed(fn, *args):
    t0 = time.perf_counter()
    fn(*args)
    return 1e3 * (time.perf_counter() - t0)


def setup(name):
    """The model (in train or eval mode) and a batch for workload name."""
    kind, batch, hw, training = WORKLOADS[name]
    torch.manual_seed(1)
    model = build(kind)
    model.train(training)
    x, labels = data(batch, hw, model.fc.out_features)
    return model, x, labels, training


def compiled_step(model, training, wrap):
    """One call through wrap's compile: the loss for a training step (the
    backward and SGD eager around it), the whole model for inference."""
    step = make_step(model, training)
    if training:
        compiled_loss = wrap(step.loss_of)
        return lambda a, b: step(a, b, compiled_loss)
    compiled_model = wrap(model)

    def fn(a, b):
        with torch.no_grad():
            return compiled_model(a)
    return fn


def workloads(torch_module):
    """[(id, name, maker)] in torch_workloads.py's form, for bench/side_by_side.py:
    W13 and W14 (R50 is kiln against kiln only). The eager model already runs
    PyTorch's builtin conv2d and batch_norm, so there is no separate fused form."""
    global torch, nn, F
    torch, nn, F = torch_module, torch_module.nn, torch_module.nn.functional

    def maker(name):
        def bind(make):
            model, x, labels, training = setup(name)
            fn = make(model, training)
            return lambda: fn(x, labels)
        return lambda: {"eager": lambda: bind(make_step),
                        "compile": lambda wrap: bind(lambda m, t: compiled_step(m, t, wrap))}
    return [(name.split("_")[0], name, maker(name)) for name in DEFAULT]


def run(name, modes, threads):
    model, x, labels, training = setup(name)
    sides = {}
    if "eager" in modes:
        sides["eager"] = make_step(model, training)
    prep = None
    if "compiled" in modes and hasattr(torch, "compile"):
        fn = compiled_step(model, training, torch.compile)
        first = timed(fn, x, labels)
        sides["compiled"] = fn
        prep = first
    for _ in range(WARMUP):
        for f in sides.values():
            f(x, labels)
    pair = sum(timed(f, x, labels) for f in sides.values()) / 1e3
    n = max(MIN_SAMPLES, min(MAX_SAMPLES, int(BUDGET_S / max(pair, 1e-9))))
    samples = {k: [] for k in sides}
    for _ in range(n):
        for k, f in sides.items():
            samples[k].append(timed(f, x, labels))
    med = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    row = {"name": name, "threads": threads, "torch_eager_ms": med.get("eager"),
           "torch_compiled_ms": med.get("compiled"),
           "torch_compiled_prep_ms": prep - med["compiled"] if "compiled" in med else None}
    return row


def main():
    global torch, nn, F
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="2")
    ap.add_argument("--only", default="")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--json")
    a = ap.parse_args()
    try:
        import torch as _torch
        import torch.nn as _nn
        import torch.nn.functional as _F
    except ImportError:
        sys.stderr.write("torch_resnet.py: PyTorch is not installed; no PyTorch columns\n")
        return 0
    torch, nn, F = _torch, _nn, _F
    wanted = [w for w in WORKLOADS if not a.only and w in DEFAULT or
              any(tok in (w, w.split("_")[0]) for tok in a.only.split(",") if tok)]
    modes = a.modes.split(",")
    rows = []
    for t in [int(v) for v in a.threads.split(",")]:
        torch.set_num_threads(t)
        for w in wanted:
            r = run(w, modes, t)
            rows.append(r)
            fmt = lambda v: "%10.3f" % v if v is not None else "%10s" % "n/a"  # noqa: E731
            print("%-20s %2d threads  eager %s ms  compiled %s ms" % (w, t, fmt(r["torch_eager_ms"]),
                                                                    fmt(r["torch_compiled_ms"])), flush=True)
    meta = {"torch": torch.__version__, "compile": hasattr(torch, "compile")}
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
