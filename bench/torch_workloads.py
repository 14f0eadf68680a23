"""The workloads of docs/workloads.md in PyTorch, for bench/side_by_side.py.

WORKLOADS lists (id, name, maker); torch_gpt.py adds W8 and W9,
torch_lstm.py W10 (an LSTM), torch_llama.py W11 and W12, torch_resnet.py
W13 and W14. maker()
makes the inputs and returns a dict of builders, each returning step, a
function of no argument that runs one call:

  "eager"    () -> step        op by op, exactly as kiln's bench writes it
  "builtin"  () -> step        PyTorch's own fused ops (F.gelu, torch.softmax,
                               F.layer_norm, addmm, F.scaled_dot_product_attention):
                               the bar for a compiled kernel; optional
  "compile"  (wrap) -> step    the op-by-op program with wrap (torch.compile in
                               one of its modes) applied to its nn.Module; the
                               training steps wrap the loss and run backward
                               and the optimizer from Python

Only side_by_side.py imports this module, and only when PyTorch imports.
"""

import types

import torch
import torch.nn as nn
import torch.nn.functional as F

EPS = 1e-5
LR = 1e-3


# ---- the formulations, op by op ---------------------------------------------

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
    return d * torch.rsqrt(var + EPS) * w + b


def mlp_ops(x, w1, b1, w2, b2):
    h = x @ w1 + b1
    return gelu_ops(h) @ w2 + b2


def mlp_builtin(x, w1, b1, w2, b2):
    h = torch.addmm(b1, x, w1)
    return torch.addmm(b2, F.gelu(h, approximate="tanh"), w2)


def randn(*shape, scale=1.0, shift=0.0):
    return torch.randn(*shape, dtype=torch.float32) * scale + shift


# ---- workloads -------------------------------------------------------------

def inference(forward, inputs, weights, builtin):
    """The builders of an inference workload whose op-by-op form is
    forward(self, *inputs), reading its weights as self.<name>."""
    Module = type("Workload", (nn.Module,), {"forward": forward})

    def eager():
        this = types.SimpleNamespace(**weights)  # no nn.Module call in the way: as kiln eager

        def step():
            return forward(this, *inputs)
        return step

    def compile_(wrap):
        m = Module()
        for k, v in weights.items():
            m.register_buffer(k, v)
        cm = wrap(m.eval())

        def step():
            with torch.no_grad():
                return cm(*inputs)
        return step

    return {"eager": eager, "builtin": lambda: builtin, "compile": compile_}


def make_w1():
    x = randn(4194304)
    return inference(lambda self, x: gelu_ops(x), (x,), {}, lambda: F.gelu(x, approximate="tanh"))


def make_w2():
    x = randn(4096, 1024)
    return inference(lambda self, x: softmax_ops(x), (x,), {}, lambda: torch.softmax(x, -1))


def make_w3():
    x = randn(4096, 1024)
    w = randn(1024, scale=0.1, shift=1.0)
    b = randn(1024, scale=0.1)
    return inference(lambda self, x: layernorm_ops(x, self.w, self.b), (x,), {"w": w, "b": b},
                     lambda: F.layer_norm(x, (1024,), w, b, EPS))


def mlp_inputs():
    return (randn(256, 1024), randn(1024, 4096, scale=0.02), randn(4096, scale=0.02),
            randn(4096, 1024, scale=0.02), randn(1024, scale=0.02))


def make_w4():
    x, w1, b1, w2, b2 = mlp_inputs()
    return inference(lambda self, x: mlp_ops(x, self.w1, self.b1, self.w2, self.b2), (x,),
                     {"w1": w1, "b1": b1, "w2": w2, "b2": b2}, lambda: mlp_builtin(x, w1, b1, w2, b2))


def sgd_train(loss_fn, params, *inputs):
    """One training step: loss_fn(*inputs), backward, SGD p -= LR * grad on
    params, the gradients dropped."""
    def step():
        loss = loss_fn(*inputs)
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.sub_(LR * p.grad)
                p.grad = None
        return loss
    return step


def make_w5():
    x, *init = mlp_inputs()
    t = randn(256, 1024)

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.b1, self.w2, self.b2 = (nn.Parameter(p.clone()) for p in init)

        def forward(self, x, t):
            y = mlp_ops(x, self.w1, self.b1, self.w2, self.b2)
            return torch.mean((y - t) ** 2)

    def eager():
        m = Loss()
        return sgd_train(m, list(m.parameters()), x, t)

    def builtin():
        m = Loss()
        params = list(m.parameters())
        return sgd_train(lambda x, t: F.mse_loss(mlp_builtin(x, *params), t), params, x, t)

    def compile_(wrap):
        m = Loss()
        return sgd_train(wrap(m), list(m.parameters()), x, t)

    return {"eager": eager, "builtin": builtin, "compile": compile_}


def make_w6():
    x = randn(1, 256)
    weights = {}
    for i in (1, 2, 3):
        weights[f"w{i}"], weights[f"b{i}"] = randn(256, 256, scale=1 / 16), randn(256, scale=1 / 16)
    w = weights

    def forward(self, x):
        h = torch.relu(x @ self.w1.t() + self.b1)
        h = torch.relu(h @ self.w2.t() + self.b2)
        return h @ self.w3.t() + self.b3

    def builtin():
        h = torch.relu(F.linear(x, w["w1"], w["b1"]))
        h = torch.relu(F.linear(h, w["w2"], w["b2"]))
        return F.linear(h, w["w3"], w["b3"])
    return inference(forward, (x,), weights, builtin)


def make_w7():
    q, k, v = randn(8, 512, 64), randn(8, 512, 64), randn(8, 512, 64)

    def forward(self, q, k, v):
        s = (q @ k.transpose(1, 2)) / 8
        return softmax_ops(s) @ v
    return inference(forward, (q, k, v), {},
                     lambda: F.scaled_dot_product_attention(q, k, v, scale=1 / 8))


WORKLOADS = [
    ("W1", "W1_gelu", make_w1),
    ("W2", "W2_softmax", make_w2),
    ("W3", "W3_layernorm", make_w3),
    ("W4", "W4_mlp_fwd", make_w4),
    ("W5", "W5_mlp_train", make_w5),
    ("W6", "W6_batch1", make_w6),
    ("W7", "W7_attention", make_w7),
]


def workloads():
    """Every workload, W8 and W9 (torch_gpt.py), W10 (torch_lstm.py), W11 and W12 (torch_llama.py),
    W13 and W14 (torch_resnet.py) included."""
    import torch_gpt
    import torch_llama
    import torch_lstm
    import torch_resnet
    return (WORKLOADS + torch_gpt.workloads(torch) + torch_lstm.WORKLOADS + torch_llama.workloads(torch)
            + torch_resnet.workloads(torch))
