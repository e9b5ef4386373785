#!/usr/bin/python3
"""The peer for bench/gpt on one device: PyTorch eager on the same GPT (the zoo's `gpt`:
decoder-only, pre-norm, a causal attention through scaled_dot_product_attention where this torch
has it, an MLP of 4 x width with GELU, tied embeddings, learned positions, 256 byte tokens), the
same random tokens, batch, context and AdamW (fp32 state; torch's fused kernels on CUDA where it
has them), with bf16 autocast on CUDA. Prints the mean step time of the timed steps (after the
first), tokens/s and, on CUDA, model FLOPs utilisation by bench/gpt's count
(models::GptImpl::flops_per_token) against --peak-tflops, as one JSON line.

  /usr/bin/python3 bench/gpt_torch.py --device cuda --layers 24 --width 1024 --heads 16 \\
      --context 1024 --batch-size 8 --steps 10

Uses Debian's python3-torch (or the GPU host's torch); run with /usr/bin/python3."""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads)  # its in_proj and out_proj weights
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def attend(self, h):  # h [T, N, width]
        t, n, w = h.shape
        qkv = F.linear(h, self.attention.in_proj_weight, self.attention.in_proj_bias)
        d = w // self.heads
        if hasattr(F, "scaled_dot_product_attention"):
            # [batch, heads, tokens, head_dim]: CUDA's fused kernels take four dimensions only
            # (with three the math kernel runs), as cohort's self_attention_heads passes them.
            q, k, v = (x.reshape(t, n, self.heads, d).permute(1, 2, 0, 3)
                       for x in qkv.chunk(3, dim=-1))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o = o.permute(2, 0, 1, 3).reshape(t, n, w)
        else:  # torch 1.13: the same arithmetic, spelled out
            q, k, v = (x.reshape(t, n * self.heads, d).transpose(0, 1)
                       for x in qkv.chunk(3, dim=-1))
            scores = q @ k.transpose(1, 2) / math.sqrt(d)
            mask = torch.ones(t, t, dtype=torch.bool, device=h.device).triu(1)
            o = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
            o = o.transpose(0, 1).reshape(t, n, w)
        return self.attention.out_proj(o)

    def forward(self, x):
        x = x + self.attend(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Gpt(nn.Module):
    def __init__(self, layers, width, heads, context):
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB, width)
        self.positions = nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        nn.init.normal_(self.token_embedding.weight, 0, 0.02)

    def forward(self, tokens):  # [N, T]
        x = self.token_embedding(tokens) + self.positions[: tokens.shape[1]]
        x = self.blocks(x.transpose(0, 1)).transpose(0, 1)
        return F.linear(self.norm(x), self.token_embedding.weight)


def flops_per_token(layers, width, context):
    # bench/gpt's count: 6 per weight and token (the blocks' 12 w^2 and the head's w v) and
    # attention's 12 depth width T.
    return 6 * (layers * 12 * width * width + width * VOCAB) + 12 * layers * width * context


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="steps, the first untimed")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    a = p.parse_args()
    if a.width % a.heads != 0:
        p.error(f"--heads {a.heads} does not divide --width {a.width}: choose heads that do")
    if a.steps < 2:
        p.error(f"--steps {a.steps}: give at least 2 (the first is not timed)")
    if a.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "--device cuda: not measured: no GPU here"}))
        return
    device = torch.device(a.device)
    torch.manual_seed(0)
    model = Gpt(a.layers, a.width, a.heads, a.context).to(device)
    parameters = sum(t.numel() for t in model.parameters())
    # torch's fused AdamW on CUDA where it has one (2.0 and later), as cohort's flat one is.
    fused = "fused" in torch.optim.AdamW.__init__.__code__.co_varnames
    kwargs = {"fused": True} if a.device == "cuda" and fused else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **kwargs)
    timed = 0.0
    for step in range(a.steps):
        torch.manual_seed(step + 1000)
        tokens = torch.randint(0, VOCAB, (a.batch_size, a.context + 1)).to(device)
        if a.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(a.device, dtype=torch.bfloat16, enabled=a.device == "cuda"):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if a.device == "cuda":
            torch.cuda.synchronize()
        if step > 0:
            timed += time.perf_counter() - start
    step_s = timed / (a.steps - 1)
    tokens_per_s = a.batch_size * a.context / step_s
    out = {"peer": "pytorch eager", "torch": torch.__version__, "device": a.device,
           "parameters": parameters, "step_s": step_s, "tokens_per_s": tokens_per_s,
           "loss": loss.item()}
    if a.device == "cuda":
        flops = flops_per_token(a.layers, a.width, a.context)
        out["mfu"] = tokens_per_s * flops / (a.peak_tflops * 1e12)
        out["gpu_memory_mb"] = torch.cuda.max_memory_reserved() / 1e6
    print(json.dumps(out))


if __name__ == "__main__":
    main()
