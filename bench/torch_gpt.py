"""W8 and W9 in PyTorch: the GPT-2-style model of examples/gpt.h, the same
architecture, init scheme, AdamW and benchmark configuration as bench/gpt.c.

  W8_gpt_train     one training step (forward, cross entropy, backward, AdamW)
                   on a batch of GPT_BENCH_BATCH windows of block_size bytes
  W9_gpt_generate  generation without a key/value cache, as gpt_generate does:
                   each new byte runs the forward pass over the last
                   block_size bytes (fewer at the start) and reads the last
                   position's logits; timed per generated token
  W9_gpt_generate_kv the same generation through key/value caches, as
                   gpt_generate_cached does: the context decoded a byte at a
                   time from position 0, then each new byte in one step; when
                   the caches (block_size rows) are full, the last
                   block_size/2 bytes decoded again from position 0

torch_workloads.py imports this (workloads(), in its builder form); the
constants and flop counts below need no PyTorch, so report.py and
jax_gpt.py read them too. "builtin" is the same model with PyTorch's fused
attention (F.scaled_dot_product_attention, causal) and its fused AdamW.

W9_gpt_generate_kv's forms: eager decodes op by op with the position a
Python int, attending over cache rows 0..pos; builtin the same with
F.scaled_dot_product_attention and addmm; compile is torch.compile
(dynamic=False) of one decode step written as kiln compiled's
gpt_decode_body: the position a (1,) i64 tensor, the cache row written by
index_copy_, every row attended with those past the position masked out,
so that one graph serves every position. `python bench/torch_gpt.py
--check-kv` compares their logits with the no-cache forward and counts
torch.compile's frames and recompiles over a generation.
"""

import math

# GPT_BENCH_CONFIG and GPT_BENCH_BATCH of examples/gpt.h
N_LAYER, N_HEAD, N_EMBD, BLOCK_SIZE, VOCAB = 4, 4, 128, 64, 256
BATCH = 8
LN_EPS = 1e-5
INIT_STD = 0.02
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

# Generation as bench/gpt.c times it: a prompt of PROMPT_LEN bytes, then
# GEN_TOKENS bytes, each from the logits of the last block_size bytes.
PROMPT_LEN = 12
GEN_TOKENS = 64

# W9 is timed per call of GEN_TOKENS tokens and reported per token, as kiln does
PER = {"W9_gpt_generate": GEN_TOKENS, "W9_gpt_generate_kv": GEN_TOKENS}


def n_params():
    C, V, T, L = N_EMBD, VOCAB, BLOCK_SIZE, N_LAYER
    per_layer = 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C + (C * 4 * C + 4 * C) + (4 * C * C + C)
    return V * C + T * C + L * per_layer + 2 * C


def forward_flops(B, T, last_only=False):
    """Multiply-add flops (2 per MAC) of the matmuls of one forward pass."""
    C, L, V = N_EMBD, N_LAYER, VOCAB
    per_layer = 2 * B * T * C * (3 * C + C + 8 * C) + 2 * 2 * B * T * T * C  # linears, q@k^T and att@v
    head = 2 * B * (1 if last_only else T) * C * V
    return L * per_layer + head


def train_flops():
    """Forward plus backward (twice the forward) of one training step."""
    return 3 * forward_flops(BATCH, BLOCK_SIZE)


def gen_contexts():
    """The context length of each generated token's forward pass."""
    return [min(PROMPT_LEN + i, BLOCK_SIZE) for i in range(GEN_TOKENS)]


def gen_flops_per_token():
    ctx = gen_contexts()
    return sum(forward_flops(1, t, last_only=True) for t in ctx) / len(ctx)


def models(torch):
    """The model classes: (GPT, NextLogits). torch_roundtrip.py builds them
    too, to move weights to and from kiln."""
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, sdpa):
            super().__init__()
            C = N_EMBD
            self.n_head, self.eps, self.sdpa = N_HEAD, LN_EPS, sdpa
            self.ln1_w, self.ln1_b = nn.Parameter(torch.ones(C)), nn.Parameter(torch.zeros(C))
            self.attn_w, self.attn_b = nn.Parameter(torch.empty(C, 3 * C)), nn.Parameter(torch.zeros(3 * C))
            self.proj_w, self.proj_b = nn.Parameter(torch.empty(C, C)), nn.Parameter(torch.zeros(C))
            self.ln2_w, self.ln2_b = nn.Parameter(torch.ones(C)), nn.Parameter(torch.zeros(C))
            self.fc_w, self.fc_b = nn.Parameter(torch.empty(C, 4 * C)), nn.Parameter(torch.zeros(4 * C))
            self.fc2_w, self.fc2_b = nn.Parameter(torch.empty(4 * C, C)), nn.Parameter(torch.zeros(C))
            nn.init.normal_(self.attn_w, std=INIT_STD)
            nn.init.normal_(self.fc_w, std=INIT_STD)
            nn.init.normal_(self.proj_w, std=INIT_STD / math.sqrt(2 * N_LAYER))
            nn.init.normal_(self.fc2_w, std=INIT_STD / math.sqrt(2 * N_LAYER))

        def forward(self, x, mask):
            B, T, C = x.shape[0], x.shape[1], x.shape[2]
            H = self.n_head
            hs = C // H
            a = F.layer_norm(x, (C,), self.ln1_w, self.ln1_b, self.eps)
            qkv = (a @ self.attn_w + self.attn_b).view(B, T, 3, H, hs).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
            if self.sdpa:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(2, 3)) * (1.0 / math.sqrt(hs))
                att = torch.where(mask[:T, :T], att, torch.full_like(att, float("-inf")))
                att = torch.softmax(att, -1)
                y = att @ v
            y = y.permute(0, 2, 1, 3).contiguous().view(B, T, C)
            x = x + (y @ self.proj_w + self.proj_b)
            m = F.layer_norm(x, (C,), self.ln2_w, self.ln2_b, self.eps)
            f = F.gelu(m @ self.fc_w + self.fc_b, approximate="tanh")
            return x + (f @ self.fc2_w + self.fc2_b)

    class GPT(nn.Module):
        def __init__(self, sdpa=False):
            super().__init__()
            C = N_EMBD
            self.n_embd, self.vocab, self.eps = C, VOCAB, LN_EPS
            self.wte = nn.Parameter(torch.randn(VOCAB, C) * INIT_STD)
            self.wpe = nn.Parameter(torch.randn(BLOCK_SIZE, C) * INIT_STD)
            self.blocks = nn.ModuleList([Block(sdpa) for _ in range(N_LAYER)])
            self.lnf_w, self.lnf_b = nn.Parameter(torch.ones(C)), nn.Parameter(torch.zeros(C))
            pos = torch.arange(BLOCK_SIZE)
            self.register_buffer("mask", pos.unsqueeze(0) <= pos.unsqueeze(1))  # col <= row

        def hidden(self, idx):
            T = idx.shape[1]
            x = F.embedding(idx, self.wte) + self.wpe[:T]
            for block in self.blocks:
                x = block(x, self.mask)
            return F.layer_norm(x, (self.n_embd,), self.lnf_w, self.lnf_b, self.eps)

        def forward(self, idx, targets):
            logits = self.hidden(idx) @ self.wte.t()
            return F.cross_entropy(logits.view(-1, self.vocab), targets.view(-1))

    class NextLogits(nn.Module):
        """Logits (B,V) for the byte after the last position of idx."""

        def __init__(self, gpt):
            super().__init__()
            self.gpt = gpt

        def forward(self, idx):
            h = self.gpt.hidden(idx)
            return h[:, -1, :] @ self.gpt.wte.t()

    class Decode(nn.Module):
        """W9_gpt_generate_kv's decode step over a GPT and its (L, S, C) key
        and value caches: forward(token (1,), at (1,) i64) is the compiled
        form; decode(token, pos int) the eager one."""

        def __init__(self, gpt, builtin=False):
            super().__init__()
            self.gpt, self.builtin = gpt, builtin
            self.register_buffer("kc", torch.zeros(N_LAYER, BLOCK_SIZE, N_EMBD))
            self.register_buffer("vc", torch.zeros(N_LAYER, BLOCK_SIZE, N_EMBD))

        def layers(self, x, attention):
            g, C, H = self.gpt, N_EMBD, N_HEAD
            hs = C // H
            for l, b in enumerate(g.blocks):
                a = F.layer_norm(x, (C,), b.ln1_w, b.ln1_b, b.eps)
                qkv = torch.addmm(b.attn_b, a, b.attn_w) if self.builtin else a @ b.attn_w + b.attn_b
                q, k, v = qkv[:, :C], qkv[:, C:2 * C], qkv[:, 2 * C:]
                keys, vals, mask = attention(l, k, v)  # (P,C) each, mask (1,P) or None
                P = keys.shape[0]
                kh, vh = keys.view(P, H, hs).permute(1, 0, 2), vals.view(P, H, hs).permute(1, 0, 2)
                qh = q.view(1, H, hs).permute(1, 0, 2)  # (H,1,hs)
                if self.builtin:
                    y = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
                else:
                    att = (qh @ kh.transpose(1, 2)) * (1.0 / math.sqrt(hs))  # (H,1,P)
                    if mask is not None:
                        att = torch.where(mask, att, torch.full_like(att, float("-inf")))
                    y = torch.softmax(att, -1) @ vh
                y = y.permute(1, 0, 2).reshape(1, C)
                x = x + (torch.addmm(b.proj_b, y, b.proj_w) if self.builtin else y @ b.proj_w + b.proj_b)
                m = F.layer_norm(x, (C,), b.ln2_w, b.ln2_b, b.eps)
                f = F.gelu(torch.addmm(b.fc_b, m, b.fc_w) if self.builtin else m @ b.fc_w + b.fc_b,
                           approximate="tanh")
                x = x + (torch.addmm(b.fc2_b, f, b.fc2_w) if self.builtin else f @ b.fc2_w + b.fc2_b)
            return F.layer_norm(x, (C,), g.lnf_w, g.lnf_b, g.eps) @ g.wte.t()  # (1,V)

        def decode(self, token, pos):
            """Eager: pos a Python int; attends over cache rows 0..pos."""
            x = F.embedding(token, self.gpt.wte) + self.gpt.wpe[pos:pos + 1]

            def attention(l, k, v):
                self.kc[l, pos] = k[0]
                self.vc[l, pos] = v[0]
                return self.kc[l, :pos + 1], self.vc[l, :pos + 1], None
            return self.layers(x, attention)

        def forward(self, token, at):
            """Compiled: at (1,) i64; every row, those past it masked out."""
            x = F.embedding(token, self.gpt.wte) + F.embedding(at, self.gpt.wpe)
            mask = self.gpt.mask.index_select(0, at)  # (1,S): col <= at

            def attention(l, k, v):
                self.kc[l].index_copy_(0, at, k)
                self.vc[l].index_copy_(0, at, v)
                return self.kc[l], self.vc[l], mask
            return self.layers(x, attention)

    return GPT, NextLogits, Decode


def generate_cached(torch, step, prompt, tensor_pos=False, logits_out=None):
    """gpt_generate_cached's steps, greedy: prompt a list of (1,) i64
    tensors; step(token (1,), pos), pos an int or, with tensor_pos, a (1,)
    i64 tensor (made before the loop, as kiln's caller makes its input).
    Returns the text as (1,) tensors; logits_out collects each step's."""
    at = [torch.tensor([p]) for p in range(BLOCK_SIZE)] if tensor_pos else range(BLOCK_SIZE)
    keep = max(BLOCK_SIZE // 2, 1)
    text, pos, logits = list(prompt), 0, None
    with torch.no_grad():
        def dec(b):
            nonlocal pos
            out = step(b, at[pos])
            pos += 1
            if logits_out is not None:
                logits_out.append(out)
            return out
        for b in text[-BLOCK_SIZE:]:
            logits = dec(b)
        for i in range(GEN_TOKENS):
            text.append(logits.argmax(-1))
            if i + 1 == GEN_TOKENS:
                break
            if pos < BLOCK_SIZE:
                logits = dec(text[-1])
                continue
            pos = 0
            for b in text[-keep:]:
                logits = dec(b)
    return text


def workloads(torch):
    """[(id, name, maker)] in torch_workloads.py's form."""
    GPT, NextLogits, Decode = models(torch)

    def adamw(model, fused=False):
        # weight decay on the 2-D parameters only (matrices and both embeddings)
        decay = [p for p in model.parameters() if p.dim() == 2]
        rest = [p for p in model.parameters() if p.dim() != 2]
        extra = {"fused": True} if fused else {}
        return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], **ADAMW, **extra)

    def batch():
        g = torch.Generator().manual_seed(1)
        data = torch.randint(0, VOCAB, (BATCH, BLOCK_SIZE + 1), generator=g)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def make_w8():
        idx, targets = batch()

        def build(wrap, fused=False):
            torch.manual_seed(0)
            model = GPT(sdpa=fused)
            opt = adamw(model, fused)
            loss_fn = wrap(model)

            def step():
                loss = loss_fn(idx, targets)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss
            return step

        return {"eager": lambda: build(lambda m: m),
                "builtin": lambda: build(lambda m: m, fused=True),
                "compile": lambda wrap: build(wrap)}

    def make_w9():
        prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(2))

        def build(wrap, sdpa=False):
            torch.manual_seed(0)
            model = NextLogits(GPT(sdpa=sdpa)).eval()
            with torch.no_grad():
                fn = wrap(model)

            def generate():
                # greedy: the sampling rule does not change the work per token
                with torch.no_grad():
                    text = prompt
                    for _ in range(GEN_TOKENS):
                        logits = fn(text[:, -BLOCK_SIZE:])
                        text = torch.cat([text, logits.argmax(-1, keepdim=True)], 1)
                return text
            return generate

        # one graph with the sequence length symbolic, as kiln's W9 (kiln_mark_dynamic)
        return {"eager": lambda: build(lambda m: m),
                "builtin": lambda: build(lambda m: m, sdpa=True),
                "compile": lambda wrap: build(lambda m: wrap(m, dynamic=True))}

    def make_w9_kv():
        prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(2))
        prompt = [prompt[0, i:i + 1] for i in range(PROMPT_LEN)]

        def eager(builtin=False):
            torch.manual_seed(0)
            m = Decode(GPT(), builtin).eval()
            return lambda: generate_cached(torch, m.decode, prompt)

        def compile_(wrap):
            torch.manual_seed(0)
            step = wrap(Decode(GPT()).eval(), dynamic=False)
            return lambda: generate_cached(torch, step, prompt, tensor_pos=True)
        return {"eager": eager, "builtin": lambda: eager(True), "compile": compile_}

    return [("W8", "W8_gpt_train", make_w8), ("W9", "W9_gpt_generate", make_w9),
            ("W9", "W9_gpt_generate_kv", make_w9_kv)]


def check_kv():
    """W9_gpt_generate_kv: each form's logits against the no-cache forward of
    the same bytes, and torch.compile's frames and recompiles. 0 if right."""
    import torch
    from torch._dynamo.utils import counters
    GPT, NextLogits, Decode = models(torch)
    torch.manual_seed(0)
    g = GPT().eval()
    for p in g.parameters():  # larger weights, so that a wrong op shows
        p.data.mul_(10.0 if p.dim() == 2 else 1.0)
    prompt = [torch.tensor([b]) for b in torch.randint(0, VOCAB, (PROMPT_LEN,)).tolist()]
    ref_logits = []
    text = generate_cached(torch, Decode(g).eval().decode, prompt, logits_out=ref_logits)
    # the no-cache forward: the steps before the first context shift see bytes 0..pos
    seq = torch.cat(text).view(1, -1)
    nxt = NextLogits(g).eval()
    with torch.no_grad():
        full = [nxt(seq[:, :p + 1]) for p in range(BLOCK_SIZE)]
    scale = float(torch.cat(full).abs().max())
    diffs = {"eager vs forward": max(float((a - b).abs().max()) for a, b in zip(ref_logits, full))}
    forms = {"builtin": (Decode(g, True).eval().decode, False)}
    counters.clear()
    forms["torch.compile"] = (torch.compile(Decode(g).eval(), dynamic=False), True)
    ok = True
    for name, (step, tensor_pos) in forms.items():
        logits = []
        t = generate_cached(torch, step, prompt, tensor_pos=tensor_pos, logits_out=logits)
        diffs[name + " vs eager"] = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits))
        same = sum(int(a) == int(b) for a, b in zip(t, text))
        print(f"{name:>14}: {same}/{len(text)} bytes equal to eager's, {len(logits)} decode steps")
        ok &= same == len(text) and len(logits) == len(ref_logits)
    frames = dict(counters["frames"])
    recompiles = dict(counters["recompiles"]) if "recompiles" in counters else {}
    print(f"torch.compile over {len(ref_logits)} decode steps: frames {frames}, recompiles {recompiles}")
    print(f"logits max |diff|: {diffs} (logits max {scale:.3g})")
    ok &= max(diffs.values()) < 1e-4 * scale and frames.get("total") == 1 and not recompiles
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["--check-kv"]:
        sys.exit(check_kv())
    print("usage: python bench/torch_gpt.py --check-kv", file=sys.stderr)
    sys.exit(2)
