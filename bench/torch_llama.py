"""W11 and W12 in PyTorch: the Llama-2 of examples/llama.h at stories15M's
shape, the same architecture, init and runs as bench/llama.c.

  W11_llama_generate  greedy generation of GEN_TOKENS tokens from BOS
                      through a KV cache (preallocated (seq_len, kv_dim)
                      tensors per layer, each step's k and v written at its
                      row): timed per generation, reported per token
  W12_llama_forward   logits of FWD_T tokens at once, batch 1, no cache:
                      ms per call

The forms, as torch_workloads.py's builders:

  eager    op by op as llama.h writes it (rmsnorm x * rsqrt(mean(x*x) + eps)
           * w, silu a * sigmoid(a), softmax of the masked scores); a decode
           step takes its position as a Python int and attends over cache
           rows 0..pos, as kiln eager's llama_decode_body
  builtin  the same with F.rms_norm, F.silu, F.linear and
           F.scaled_dot_product_attention
  compile  torch.compile (dynamic=False) of the op-by-op model; a decode
           step takes its position as a (1,) i64 tensor, writes the cache
           row by index_copy_ and attends over every row with those past
           the position masked out, as kiln compiled's llama_step_body: one
           graph serves every position (no recompile per token)

The weights are random (N(0, 0.02^2), norm weights 1, the classifier tied to
the embedding) from PyTorch's generator, not kiln's: the same work, other
numbers. `python bench/torch_llama.py --check BINARY` writes this model (its
matrices at std 0.2, so that greedy tokens vary and a wrong op shows) as a
llama2.c checkpoint, the format examples/llama.h reads, generates greedily
here (eager, builtin, compiled) and with kiln's examples/llama BINARY
(compiled, eager), and compares the tokens; it checks W12's forward against
decoding the same tokens one by one, and counts torch.compile's frames and
recompiles over a generation.

The constants need no PyTorch (side_by_side.py reads PER).
"""

import math
import struct
import subprocess
import sys

# LLAMA_STORIES15M of examples/llama.h
DIM, HIDDEN, N_LAYERS, N_HEADS, N_KV_HEADS, VOCAB, SEQ_LEN = 288, 768, 6, 6, 6, 32000, 256
EPS = 1e-5
INIT_STD = 0.02
BOS = 1
# bench/llama.c: GEN_TOKENS decode steps from BOS, FWD_T tokens at once
GEN_TOKENS = 255
FWD_T = 64

# W11 is timed per generation and reported per token, as kiln's serve.c does
PER = {"W11_llama_generate": GEN_TOKENS}


def fwd_tokens():
    """bench/llama.c's W12 input."""
    return [(i * 7919 + 1) % VOCAB for i in range(FWD_T)]


def model(torch):
    """The Llama class."""
    nn, F = torch.nn, torch.nn.functional
    HS = DIM // N_HEADS
    KV = DIM * N_KV_HEADS // N_HEADS
    G = N_HEADS // N_KV_HEADS

    def rmsnorm_ops(x, w):
        return x * torch.rsqrt(torch.mean(x * x, -1, keepdim=True) + EPS) * w

    def rope(x, c, s):
        """x (T,n,hs) turned in pairs (2j, 2j+1) by the (T,1,hs/2) turns c, s."""
        T, n = x.shape[0], x.shape[1]
        p = x.view(T, n, HS // 2, 2)
        x0, x1 = p[..., 0], p[..., 1]
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).view(T, n, HS)

    class Llama(nn.Module):
        def __init__(self, builtin=False):
            super().__init__()
            self.builtin = builtin
            L = N_LAYERS
            w = lambda *s: torch.randn(*s) * INIT_STD  # noqa: E731
            # weights (out,in) as llama.h; one stacked tensor per kind, layer first
            self.register_buffer("tok_emb", w(VOCAB, DIM))
            self.register_buffer("rms_att", torch.ones(L, DIM))
            self.register_buffer("wq", w(L, DIM, DIM))
            self.register_buffer("wk", w(L, KV, DIM))
            self.register_buffer("wv", w(L, KV, DIM))
            self.register_buffer("wo", w(L, DIM, DIM))
            self.register_buffer("rms_ffn", torch.ones(L, DIM))
            self.register_buffer("w1", w(L, HIDDEN, DIM))
            self.register_buffer("w2", w(L, DIM, HIDDEN))
            self.register_buffer("w3", w(L, HIDDEN, DIM))
            self.register_buffer("rms_final", torch.ones(DIM))
            self.register_buffer("kc", torch.zeros(L, SEQ_LEN, KV))
            self.register_buffer("vc", torch.zeros(L, SEQ_LEN, KV))
            # turns in double, as llama_make: pos / 10000^(2j/hs)
            pos = torch.arange(SEQ_LEN, dtype=torch.float64).unsqueeze(1)
            inv = 10000.0 ** (-torch.arange(0, HS, 2, dtype=torch.float64) / HS)
            self.register_buffer("cos", torch.cos(pos * inv).float())
            self.register_buffer("sin", torch.sin(pos * inv).float())
            r = torch.arange(SEQ_LEN)
            self.register_buffer("mask", r.unsqueeze(0) <= r.unsqueeze(1))  # col <= row

        def params(self):
            """The weights in llama2.c's file order."""
            return [self.tok_emb, self.rms_att, self.wq, self.wk, self.wv, self.wo, self.rms_ffn,
                    self.w1, self.w2, self.w3, self.rms_final]

        def norm(self, x, w):
            return F.rms_norm(x, (DIM,), w, EPS) if self.builtin else rmsnorm_ops(x, w)

        def lin(self, x, w):
            return F.linear(x, w) if self.builtin else x @ w.t()

        def attend(self, q, keys, vals, mask, causal):
            """q (T,nh,hs), keys/vals (S,KV), mask (T,S) bool: (T,D)."""
            T, S = q.shape[0], keys.shape[0]
            k = keys.view(S, N_KV_HEADS, HS).permute(1, 0, 2)
            v = vals.view(S, N_KV_HEADS, HS).permute(1, 0, 2)
            if G > 1:
                k, v = k.repeat_interleave(G, 0), v.repeat_interleave(G, 0)
            q = q.permute(1, 0, 2)  # (nh,T,hs)
            if self.builtin:
                y = (F.scaled_dot_product_attention(q, k, v, is_causal=True) if causal
                     else F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
            else:
                att = (q @ k.transpose(1, 2)) * (1.0 / math.sqrt(HS))
                att = torch.where(mask, att, torch.full_like(att, float("-inf")))
                y = torch.softmax(att, -1) @ v
            return y.permute(1, 0, 2).reshape(T, DIM)

        def layers(self, x, attention):
            for l in range(N_LAYERS):
                h = self.norm(x, self.rms_att[l])
                T = h.shape[0]
                q = self.lin(h, self.wq[l]).view(T, N_HEADS, HS)
                k = self.lin(h, self.wk[l]).view(T, N_KV_HEADS, HS)
                v = self.lin(h, self.wv[l])
                x = x + self.lin(attention(l, q, k, v), self.wo[l])
                h = self.norm(x, self.rms_ffn[l])
                a, b = self.lin(h, self.w1[l]), self.lin(h, self.w3[l])
                g = F.silu(a) if self.builtin else a * torch.sigmoid(a)
                x = x + self.lin(g * b, self.w2[l])
            return self.lin(self.norm(x, self.rms_final), self.tok_emb)

        def forward(self, tokens):
            """W12: logits (T,V) of tokens (T,) at positions 0.., no cache."""
            T = tokens.shape[0]
            c, s = self.cos[:T].unsqueeze(1), self.sin[:T].unsqueeze(1)

            def attention(l, q, k, v):
                k = rope(k, c, s).reshape(T, KV)
                return self.attend(rope(q, c, s), k, v, self.mask[:T, :T], causal=True)
            return self.layers(F.embedding(tokens, self.tok_emb), attention)

        def decode(self, token, pos):
            """Eager decode: token (1,), pos a Python int; cache rows 0..pos."""
            c, s = self.cos[pos:pos + 1].unsqueeze(1), self.sin[pos:pos + 1].unsqueeze(1)

            def attention(l, q, k, v):
                self.kc[l, pos] = rope(k, c, s).reshape(KV)
                self.vc[l, pos] = v[0]
                return self.attend(rope(q, c, s), self.kc[l, :pos + 1], self.vc[l, :pos + 1],
                                   self.mask[pos:pos + 1, :pos + 1], causal=False)
            return self.layers(F.embedding(token, self.tok_emb), attention)

        def step(self, token, at):
            """Compiled decode: token (1,), at (1,) i64 its position; every
            cache row, those past the position masked out."""
            c, s = self.cos.index_select(0, at).unsqueeze(1), self.sin.index_select(0, at).unsqueeze(1)
            mask = self.mask.index_select(0, at)

            def attention(l, q, k, v):
                self.kc[l].index_copy_(0, at, rope(k, c, s).reshape(1, KV))
                self.vc[l].index_copy_(0, at, v)
                return self.attend(rope(q, c, s), self.kc[l], self.vc[l], mask, causal=False)
            return self.layers(F.embedding(token, self.tok_emb), attention)

    class Step(nn.Module):
        """step as a module's forward, for torch.compile."""

        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, token, at):
            return self.m.step(token, at)

    return Llama, Step


def generate(torch, step, n=GEN_TOKENS, tensor_pos=False):
    """Greedy tokens after BOS through step(token (1,), pos); pos an int or,
    with tensor_pos, a (1,) i64 tensor (made before the loop, as kiln's
    caller makes its input)."""
    at = [torch.tensor([p]) for p in range(n)] if tensor_pos else range(n)
    out = [torch.tensor([BOS])]
    with torch.no_grad():
        for i in range(n):
            out.append(step(out[-1], at[i]).argmax(-1))
    return out


def workloads(torch):
    """[(id, name, maker)] in torch_workloads.py's form."""
    Llama, Step = model(torch)

    def make_w11():
        def eager(builtin=False):
            m = Llama(builtin).eval()
            return lambda: generate(torch, m.decode)

        def compile_(wrap):
            step = wrap(Step(Llama()).eval(), dynamic=False)
            return lambda: generate(torch, step, tensor_pos=True)
        return {"eager": eager, "builtin": lambda: eager(True), "compile": compile_}

    def make_w12():
        x = torch.tensor(fwd_tokens())

        def build(m):
            def call():
                with torch.no_grad():
                    return m(x)
            return call
        return {"eager": lambda: build(Llama().eval()), "builtin": lambda: build(Llama(True).eval()),
                "compile": lambda wrap: build(wrap(Llama().eval(), dynamic=False))}

    return [("W11", "W11_llama_generate", make_w11), ("W12", "W12_llama_forward", make_w12)]


# ---- --check: against kiln's examples/llama, and torch.compile's recompiles ----

def write_checkpoint(m, path):
    """llama2.c's format: seven int32 (vocab positive: tied), then the weights in order."""
    with open(path, "wb") as f:
        f.write(struct.pack("7i", DIM, HIDDEN, N_LAYERS, N_HEADS, N_KV_HEADS, VOCAB, SEQ_LEN))
        for t in m.params():
            f.write(t.contiguous().numpy().astype("<f4").tobytes())


def check(binary, n=GEN_TOKENS):
    import os
    import tempfile

    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    Llama, Step = model(torch)
    m = Llama().eval()
    with torch.no_grad():  # matrices at std 0.2: at 0.02 greedy tokens repeat, and a wrong op hardly shows
        for p in m.params():
            if p.dim() > 1:
                p.mul_(10)
    fd, path = tempfile.mkstemp(suffix=".bin")
    os.close(fd)
    try:
        write_checkpoint(m, path)
        kiln = {}
        for flag in ([], ["--eager"]):
            out = subprocess.run([binary, path, "-n", str(n)] + flag, capture_output=True, text=True, check=True)
            kiln["eager" if flag else "compiled"] = [int(t) for t in out.stdout.splitlines()[0].split()]
    finally:
        os.unlink(path)
    ours = {"torch eager": [int(t) for t in generate(torch, m.decode, n)[1:]]}
    b = Llama(True)
    b.load_state_dict(m.state_dict())
    ours["torch builtin"] = [int(t) for t in generate(torch, b.eval().decode, n)[1:]]
    counters.clear()
    step = torch.compile(Step(m), dynamic=False)
    ours["torch.compile"] = [int(t) for t in generate(torch, step, n, tensor_pos=True)[1:]]
    frames = dict(counters["frames"])
    recompiles = dict(counters["recompiles"]) if "recompiles" in counters else {}
    graphs = counters["stats"].get("unique_graphs", None)
    # logits of W12's input: eager against compiled against builtin
    x = torch.tensor(fwd_tokens())
    with torch.no_grad():
        ref = m(x)
        diffs = {"builtin": float((b(x) - ref).abs().max()),
                 "compile": float((torch.compile(m, dynamic=False)(x) - ref).abs().max())}
    # W12's forward (causal, no cache) against the decode steps of the same tokens
    m.kc.zero_(), m.vc.zero_()
    with torch.no_grad():
        rows = torch.cat([m.decode(x[i:i + 1], i) for i in range(FWD_T)])
    diffs["decode"] = float((rows - ref).abs().max())
    ok = max(diffs.values()) < 1e-3 * float(ref.abs().max()) and frames.get("total") == 1 and not recompiles
    for name, toks in ours.items():
        for k, kt in kiln.items():
            same = sum(a == c for a, c in zip(toks, kt))
            print(f"{name:>14} vs kiln {k:<8}: {same}/{n} tokens equal")
            ok &= same == n
    print(f"torch.compile over {n} tokens: frames {frames}, recompiles {recompiles}, unique graphs {graphs}")
    print(f"W12 logits max |diff| from the op-by-op forward: {diffs} (logits max {float(ref.abs().max()):.3g})")
    print("tokens:", ours["torch eager"][:12], "...")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--check":
        sys.exit(check(sys.argv[2]))
    print("usage: python bench/torch_llama.py --check build/examples/llama", file=sys.stderr)
    sys.exit(2)
