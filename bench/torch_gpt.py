"""W8 and W9 in PyTorch: the GPT-2-style model of examples/gpt.h, the same
architecture, init scheme, AdamW and benchmark configuration as bench/gpt.c.

  W8_gpt_train     one training step (forward, cross entropy, backward, AdamW)
                   on a batch of GPT_BENCH_BATCH windows of block_size bytes
  W9_gpt_generate  generation without a key/value cache, as gpt_generate does:
                   each new byte runs the forward pass over the last
                   block_size bytes (fewer at the start) and reads the last
                   position's logits; timed per generated token

torch_workloads.py imports this (workloads(), in its builder form); the
constants and flop counts below need no PyTorch, so report.py and
jax_gpt.py read them too. "builtin" is the same model with PyTorch's fused
attention (F.scaled_dot_product_attention, causal) and its fused AdamW.
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
PER = {"W9_gpt_generate": GEN_TOKENS}


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

    return GPT, NextLogits


def workloads(torch):
    """[(id, name, maker)] in torch_workloads.py's form."""
    GPT, NextLogits = models(torch)

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

    return [("W8", "W8_gpt_train", make_w8), ("W9", "W9_gpt_generate", make_w9)]
