"""W8 and W9 in JAX: the GPT of examples/gpt.h and bench/torch_gpt.py (the
same architecture, init scheme, AdamW and benchmark configuration), for
bench/side_by_side.py through jax_workloads.py.

  W8_gpt_train     one jitted training step: forward, cross entropy,
                   jax.grad, and AdamW (PyTorch's formulas, weight decay on
                   the 2-D parameters only) over the parameters and both
                   moments, which are donated so the update is in place
  W9_gpt_generate  greedy generation without a key/value cache: each new byte
                   runs the forward pass over the last BLOCK_SIZE bytes
                   (fewer at the start) and takes the argmax of the last
                   position's logits. jax.jit specializes on shapes, so each
                   context length is its own executable: all of them are
                   compiled ahead of time (53 lengths, 12 to 64), and the
                   compile time is their sum
"""

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from torch_gpt import (ADAMW, BATCH, BLOCK_SIZE, GEN_TOKENS, INIT_STD, LN_EPS, N_EMBD, N_HEAD,
                       N_LAYER, PROMPT_LEN, VOCAB, gen_contexts)

LAYER_PARAMS = ("ln1_w", "ln1_b", "attn_w", "attn_b", "proj_w", "proj_b",
                "ln2_w", "ln2_b", "fc_w", "fc_b", "fc2_w", "fc2_b")


def init_params(seed=0):
    """{name: array}, GPT-2's init: N(0, 0.02^2) matrices and embeddings, the
    residual projections scaled by 1/sqrt(2*n_layer), zero biases, unit norms."""
    rng = np.random.default_rng(seed)
    C = N_EMBD

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)
    p = {"wte": normal((VOCAB, C), INIT_STD), "wpe": normal((BLOCK_SIZE, C), INIT_STD)}
    shapes = {"ln1_w": (C,), "ln1_b": (C,), "attn_w": (C, 3 * C), "attn_b": (3 * C,),
              "proj_w": (C, C), "proj_b": (C,), "ln2_w": (C,), "ln2_b": (C,),
              "fc_w": (C, 4 * C), "fc_b": (4 * C,), "fc2_w": (4 * C, C), "fc2_b": (C,)}
    for layer in range(N_LAYER):
        for name in LAYER_PARAMS:
            shape = shapes[name]
            if name.endswith("_w") and len(shape) == 2:
                std = INIT_STD / math.sqrt(2 * N_LAYER) if name in ("proj_w", "fc2_w") else INIT_STD
                v = normal(shape, std)
            else:
                v = np.ones(shape, np.float32) if name.startswith("ln") and name.endswith("_w") \
                    else np.zeros(shape, np.float32)
            p[f"h{layer}.{name}"] = v
    p["lnf_w"], p["lnf_b"] = np.ones(C, np.float32), np.zeros(C, np.float32)
    return {k: jnp.asarray(v) for k, v in p.items()}


def layer_norm(x, w, b):
    mu = jnp.mean(x, -1, keepdims=True)
    d = x - mu
    var = jnp.mean(d * d, -1, keepdims=True)  # biased
    return d * jax.lax.rsqrt(var + LN_EPS) * w + b


def gelu(x):
    return 0.5 * x * (1.0 + jnp.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))


def hidden(p, idx):
    """The final layer norm's output (B,T,C) for bytes idx (B,T)."""
    B, T = idx.shape
    C, H = N_EMBD, N_HEAD
    hs = C // H
    x = p["wte"][idx] + p["wpe"][:T]
    mask = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]  # col <= row
    for layer in range(N_LAYER):
        w = {name: p[f"h{layer}.{name}"] for name in LAYER_PARAMS}
        a = layer_norm(x, w["ln1_w"], w["ln1_b"])
        qkv = (a @ w["attn_w"] + w["attn_b"]).reshape(B, T, 3, H, hs).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = (q @ jnp.swapaxes(k, 2, 3)) * (1.0 / math.sqrt(hs))
        att = jnp.where(mask, att, -jnp.inf)
        att = jax.nn.softmax(att, -1)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
        x = x + (y @ w["proj_w"] + w["proj_b"])
        m = layer_norm(x, w["ln2_w"], w["ln2_b"])
        x = x + (gelu(m @ w["fc_w"] + w["fc_b"]) @ w["fc2_w"] + w["fc2_b"])
    return layer_norm(x, p["lnf_w"], p["lnf_b"])


def loss_fn(p, idx, targets):
    logits = (hidden(p, idx) @ p["wte"].T).reshape(-1, VOCAB)
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, targets.reshape(-1, 1), 1))


def train_step(p, m, v, t, idx, targets):
    """One step: (loss, params, m, v, t + 1); AdamW as examples/gpt.h writes it."""
    lr, (b1, b2), eps, wd = ADAMW["lr"], ADAMW["betas"], ADAMW["eps"], ADAMW["weight_decay"]
    loss, g = jax.value_and_grad(loss_fn)(p, idx, targets)
    t = t + 1
    c1, c2 = lr / (1 - b1 ** t), jnp.sqrt(1 - b2 ** t)
    np_, nm, nv = {}, {}, {}
    for k in p:
        x = p[k] - lr * wd * p[k] if p[k].ndim == 2 else p[k]
        nm[k] = b1 * m[k] + (1 - b1) * g[k]
        nv[k] = b2 * v[k] + (1 - b2) * g[k] * g[k]
        np_[k] = x - c1 * nm[k] / (jnp.sqrt(nv[k]) / c2 + eps)
    return loss, np_, nm, nv, t


def next_byte(p, idx):
    """The greedy next byte (B,) after idx (B,T)."""
    return jnp.argmax(hidden(p, idx)[:, -1, :] @ p["wte"].T, -1)


def make_w8():
    rng = np.random.default_rng(1)
    data = rng.integers(0, VOCAB, (BATCH, BLOCK_SIZE + 1), dtype=np.int32)
    idx, targets = jnp.asarray(data[:, :-1]), jnp.asarray(data[:, 1:])

    def build():
        p = init_params()
        s = {"p": p, "m": {k: jnp.zeros_like(x) for k, x in p.items()},
             "v": {k: jnp.zeros_like(x) for k, x in p.items()}, "t": jnp.zeros((), jnp.float32)}
        t0 = time.perf_counter()
        exe = jax.jit(train_step, donate_argnums=(0, 1, 2, 3)).lower(
            s["p"], s["m"], s["v"], s["t"], idx, targets).compile()
        ms = 1e3 * (time.perf_counter() - t0)

        def step():
            loss, s["p"], s["m"], s["v"], s["t"] = exe(s["p"], s["m"], s["v"], s["t"], idx, targets)
            return jax.block_until_ready(loss)
        return step, ms
    return build


def make_w9():
    prompt = np.random.default_rng(2).integers(0, VOCAB, PROMPT_LEN).tolist()

    def build():
        p = init_params()
        fn = jax.jit(next_byte)
        exes, t0 = {}, time.perf_counter()
        for T in sorted(set(gen_contexts())):
            exes[T] = fn.lower(p, jnp.zeros((1, T), jnp.int32)).compile()
        ms = 1e3 * (time.perf_counter() - t0)

        def generate():
            text = list(prompt)
            for _ in range(GEN_TOKENS):
                window = np.asarray([text[-BLOCK_SIZE:]], np.int32)
                text.append(int(exes[window.shape[1]](p, window)[0]))
            return text
        return generate, ms
    return build


WORKLOADS = [("W8", "W8_gpt_train", make_w8), ("W9", "W9_gpt_generate", make_w9)]
