"""The workloads of docs/workloads.md in JAX (jax.jit on the CPU), for bench/side_by_side.py.

WORKLOADS lists (id, name, maker); jax_gpt.py adds W8 and W9. maker()
makes the inputs and returns a function of no argument that compiles the
workload ahead of time and returns (step, compile_ms):

  compile_ms   jax.jit(f).lower(*args).compile(): tracing, lowering to
               StableHLO and XLA's compile, from an empty cache
  step()       one call of the compiled executable, blocked until its
               results are ready (JAX dispatches asynchronously)

Each function is written op by op as docs/workloads.md writes it; XLA fuses
what it fuses. The training step (W5) is one jitted function: forward,
jax.grad and the SGD update, with the parameters donated so the update
happens in place, as kiln's compiled step writes them back; so is W10's
(an LSTM whose steps are one lax.scan, compiled once per length, since
jax.jit specializes on shapes).

Only side_by_side.py imports this module, and only when JAX imports.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

EPS = 1e-5
LR = 1e-3

_rng = np.random.default_rng(0)


def randn(*shape, scale=1.0, shift=0.0):
    return jnp.asarray((_rng.standard_normal(shape) * scale + shift).astype(np.float32))


def aot(fn, *args, donate=()):
    """(executable, ms) of jax.jit(fn) compiled ahead of time for args."""
    t0 = time.perf_counter()
    exe = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    return exe, 1e3 * (time.perf_counter() - t0)


def pure(fn, *args):
    """The builder of a workload without state: fn(*args), compiled."""
    def build():
        exe, ms = aot(fn, *args)

        def step():
            return jax.block_until_ready(exe(*args))
        return step, ms
    return build


# ---- the formulations, op by op ---------------------------------------------

def gelu_ops(x):
    # pow, mul, add, mul, tanh, add, mul, mul
    return (0.5 * x) * (1.0 + jnp.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))


def softmax_ops(x):
    m = jnp.max(x, -1, keepdims=True)
    e = jnp.exp(x - m)
    s = jnp.sum(e, -1, keepdims=True)
    return e / s


def layernorm_ops(x, w, b):
    mu = jnp.mean(x, -1, keepdims=True)
    d = x - mu
    var = jnp.mean(d * d, -1, keepdims=True)
    return d * jax.lax.rsqrt(var + EPS) * w + b


def mlp_ops(x, w1, b1, w2, b2):
    h = x @ w1 + b1
    return gelu_ops(h) @ w2 + b2


# ---- workloads -------------------------------------------------------------

def make_w1():
    return pure(gelu_ops, randn(4194304))


def make_w2():
    return pure(softmax_ops, randn(4096, 1024))


def make_w3():
    return pure(layernorm_ops, randn(4096, 1024), randn(1024, scale=0.1, shift=1.0), randn(1024, scale=0.1))


def mlp_inputs():
    return (randn(256, 1024), randn(1024, 4096, scale=0.02), randn(4096, scale=0.02),
            randn(4096, 1024, scale=0.02), randn(1024, scale=0.02))


def make_w4():
    return pure(mlp_ops, *mlp_inputs())


def sgd_step(loss_fn, params, x, t):
    """The builder of a training step: loss_fn(params, x, t), jax.grad and
    SGD, one jitted function with the parameters donated (updated in place)."""
    def train_step(params, x, t):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, t)
        return loss, [p - LR * g for p, g in zip(params, grads)]

    def build():
        state = {"params": [jnp.array(p) for p in params]}  # copies: the step donates them
        exe, ms = aot(train_step, state["params"], x, t, donate=(0,))

        def step():
            loss, state["params"] = exe(state["params"], x, t)
            return jax.block_until_ready(loss)
        return step, ms
    return build


def make_w5():
    x, *params = mlp_inputs()
    return sgd_step(lambda p, x, t: jnp.mean((mlp_ops(x, *p) - t) ** 2), params, x, randn(256, 1024))


def make_w6():
    x = randn(1, 256)
    layers = [(randn(256, 256, scale=1 / 16), randn(256, scale=1 / 16)) for _ in range(3)]

    def batch1(x, layers):
        (w1, b1), (w2, b2), (w3, b3) = layers
        h = jax.nn.relu(x @ w1.T + b1)
        h = jax.nn.relu(h @ w2.T + b2)
        return h @ w3.T + b3
    return pure(batch1, x, layers)


def make_w7():
    def attention(q, k, v):
        s = (q @ jnp.swapaxes(k, 1, 2)) / 8
        return softmax_ops(s) @ v
    return pure(attention, randn(8, 512, 64), randn(8, 512, 64), randn(8, 512, 64))


# ---- W10: the LSTM of examples/lstm.h as lax.scan (bench/torch_lstm.py's constants) ----

LSTM_B, LSTM_I, LSTM_H, LSTM_TRAIN_T, LSTM_FWD_T, LSTM_W_SCALE = 32, 128, 128, 64, (16, 32, 64, 128), 0.088


def lstm_scan(params, x):
    """hs (T,B,H) of x (T,B,I) from h = c = 0: the cell is the body of one lax.scan."""
    wx, wh, bias = params
    H = LSTM_H

    def cell(carry, xt):
        h, c = carry
        g = xt @ wx + h @ wh + bias
        i, f = jax.nn.sigmoid(g[:, :H]), jax.nn.sigmoid(g[:, H:2 * H])
        u, o = jnp.tanh(g[:, 2 * H:3 * H]), jax.nn.sigmoid(g[:, 3 * H:])
        c = f * c + i * u
        h = o * jnp.tanh(c)
        return (h, c), h
    zeros = jnp.zeros((x.shape[1], H), x.dtype)
    return jax.lax.scan(cell, (zeros, zeros), x)[1]


def lstm_params():
    return [randn(LSTM_I, 4 * LSTM_H, scale=LSTM_W_SCALE), randn(LSTM_H, 4 * LSTM_H, scale=LSTM_W_SCALE),
            randn(4 * LSTM_H, scale=LSTM_W_SCALE)]


def make_w10_fwd(T):
    return lambda: pure(lstm_scan, lstm_params(), randn(T, LSTM_B, LSTM_I))


def make_w10_train():
    return sgd_step(lambda p, x, t: jnp.mean((lstm_scan(p, x) - t) ** 2), lstm_params(),
                    randn(LSTM_TRAIN_T, LSTM_B, LSTM_I), randn(LSTM_TRAIN_T, LSTM_B, LSTM_H))


WORKLOADS = [
    ("W1", "W1_gelu", make_w1),
    ("W2", "W2_softmax", make_w2),
    ("W3", "W3_layernorm", make_w3),
    ("W4", "W4_mlp_fwd", make_w4),
    ("W5", "W5_mlp_train", make_w5),
    ("W6", "W6_batch1", make_w6),
    ("W7", "W7_attention", make_w7),
    ("W10", "W10_lstm_train", make_w10_train),
] + [("W10", f"W10_lstm_fwd_T{T}", make_w10_fwd(T)) for T in LSTM_FWD_T]


def workloads():
    """Every workload, W8 and W9 (jax_gpt.py) included."""
    import jax_gpt
    return WORKLOADS + jax_gpt.WORKLOADS
