"""GPT-2 124M training steps in PyTorch eager, for scripts/gpu-check.sh.

The same model memfit's `gpt2` profile trains (12 layers, 12 heads, d_model
768, vocabulary 50257 padded to 50304, tied embeddings, tanh GELU), bf16
autocast over fp32 parameters, AdamW, causal scaled_dot_product_attention (the
flash kernel in eager mode). Prints one JSON object: tokens/s from the median
step after a warm-up, and torch.cuda.max_memory_allocated().
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=16)
p.add_argument("--seq", type=int, default=1024)
p.add_argument("--steps", type=int, default=12)
a = p.parse_args()

V, VP, L, H, C = 50257, 50304, 12, 12, 768


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(C)
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C)
        self.fc = nn.Linear(C, 4 * C)
        self.out = nn.Linear(4 * C, C)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (z.view(b, t, H, C // H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VP, C)
        self.wpe = nn.Embedding(a.seq, C)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.ln_f = nn.LayerNorm(C)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits[..., :V].float().reshape(-1, V), targets.reshape(-1))


torch.manual_seed(0)
dev = "cuda"
model = GPT().to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
data = torch.randint(0, V, (a.batch, a.seq + 1), device=dev)
x, y = data[:, :-1], data[:, 1:]
times = []
for step in range(a.steps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
med = statistics.median(times[1:])
print(json.dumps({
    "tokens_per_s": a.batch * a.seq / med,
    "step_ms": med * 1e3,
    "loss_last": loss.item(),
    "max_memory_allocated": torch.cuda.max_memory_allocated(),
    "torch": torch.__version__,
}))
