"""W10 in PyTorch, for bench/side_by_side.py: the LSTM of examples/lstm.h
(bench/lstm.c), in torch_workloads.py's form.

  "eager"    the per-step program: a Python loop over T of the cell written
             with PyTorch's ops (x_t @ wx + h @ wh + bias, the gates sliced
             from it), as kiln's scan body writes it
  "builtin"  nn.LSTM, PyTorch's own LSTM kernel, on the same weights
             (weight_ih = wx^T, weight_hh = wh^T, bias_ih = bias, bias_hh = 0)
  "compile"  torch.compile (wrap) of the per-step program's nn.Module: Dynamo
             unrolls the loop, so each T is a graph of its own

The training step: loss = mean((hs - target)^2), backward, SGD p -= LR * grad
on the weights, the gradients dropped. torch.compile compiles the loss
(AOTAutograd its backward) and the update runs eagerly from Python, as in W5.
"""

import torch
import torch.nn as nn

from torch_workloads import LR, inference, sgd_train

B, I, H = 32, 128, 128
TRAIN_T = 64
FWD_T = (16, 32, 64, 128)
W_SCALE = 0.088  # about 1/sqrt(H), as bench/lstm.c


def lstm_steps(x, wx, wh, bias):
    """hs (T,B,H) of x (T,B,I) from h = c = 0, one cell per step."""
    h = x.new_zeros(x.shape[1], H)
    c = x.new_zeros(x.shape[1], H)
    hs = []
    for t in range(x.shape[0]):
        g = x[t] @ wx + h @ wh + bias
        i, f = torch.sigmoid(g[:, :H]), torch.sigmoid(g[:, H:2 * H])
        u, o = torch.tanh(g[:, 2 * H:3 * H]), torch.sigmoid(g[:, 3 * H:])
        c = f * c + i * u
        h = o * torch.tanh(c)
        hs.append(h)
    return torch.stack(hs)


def weights():
    return {"wx": torch.randn(I, 4 * H) * W_SCALE, "wh": torch.randn(H, 4 * H) * W_SCALE,
            "bias": torch.randn(4 * H) * W_SCALE}


def builtin_lstm(w):
    """nn.LSTM with the weights of w (PyTorch keeps them (out,in), with two biases)."""
    m = nn.LSTM(I, H)
    with torch.no_grad():
        m.weight_ih_l0.copy_(w["wx"].t())
        m.weight_hh_l0.copy_(w["wh"].t())
        m.bias_ih_l0.copy_(w["bias"])
        m.bias_hh_l0.zero_()
    return m


def make_fwd(T):
    def make():
        w = weights()
        x = torch.randn(T, B, I)
        lstm = builtin_lstm(w).eval()

        def builtin():
            with torch.no_grad():
                return lstm(x)[0]
        return inference(lambda self, x: lstm_steps(x, self.wx, self.wh, self.bias), (x,), w, builtin)
    return make


def make_train():
    w = weights()
    x, target = torch.randn(TRAIN_T, B, I), torch.randn(TRAIN_T, B, H)

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.wx, self.wh, self.bias = (nn.Parameter(w[k].clone()) for k in ("wx", "wh", "bias"))

        def forward(self, x, target):
            return torch.mean((lstm_steps(x, self.wx, self.wh, self.bias) - target) ** 2)

    def eager():
        m = Loss()
        return sgd_train(m, list(m.parameters()), x, target)

    def builtin():
        m = builtin_lstm(w)
        return sgd_train(lambda x, t: torch.mean((m(x)[0] - t) ** 2), list(m.parameters()), x, target)

    def compile_(wrap):
        m = Loss()
        return sgd_train(wrap(m), list(m.parameters()), x, target)

    return {"eager": eager, "builtin": builtin, "compile": compile_}


WORKLOADS = [("W10", "W10_lstm_train", make_train)] + [("W10", f"W10_lstm_fwd_T{T}", make_fwd(T)) for T in FWD_T]
