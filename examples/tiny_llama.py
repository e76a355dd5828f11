"""A small Llama-style decoder in torch: RMSNorm, rotary embeddings, grouped-query attention
over a paged KV cache, SwiGLU, greedy decoding. Weights are deterministic random numbers (no
download). It runs whole (one process) or tensor-parallel over `tp` processes (attention heads
and MLP columns split, outputs summed with torch.distributed all-reduce, as Megatron-style TP
does), so each rank holds exactly the KV heads a serving engine's TP rank would.

Computation is float64 and the cache float32, so a TP run and a whole run round the same
values the same way and greedy decoding gives the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Shape:
    vocab: int = 512
    dim: int = 128
    layers: int = 3
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 16
    hidden: int = 256
    page_size: int = 4
    seed: int = 1234


@dataclass
class Weights:
    """One rank's share of the weights: whole embeddings and norms, its heads' attention
    projections, its columns of the MLP."""

    embed: torch.Tensor
    lm_head: torch.Tensor
    final_norm: torch.Tensor
    attn_norm: list[torch.Tensor]
    mlp_norm: list[torch.Tensor]
    wq: list[torch.Tensor]
    wk: list[torch.Tensor]
    wv: list[torch.Tensor]
    wo: list[torch.Tensor]
    w_gate: list[torch.Tensor]
    w_up: list[torch.Tensor]
    w_down: list[torch.Tensor]


def make_weights(shape: Shape, tp_rank: int = 0, tp_size: int = 1) -> Weights:
    """The full model from the seed, then this rank's slices of it."""
    generator = torch.Generator().manual_seed(shape.seed)

    def normal(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator, dtype=torch.float64) / math.sqrt(size[-1])

    heads, kv_heads = shape.heads // tp_size, shape.kv_heads // tp_size
    q_rows = slice(tp_rank * heads * shape.head_dim, (tp_rank + 1) * heads * shape.head_dim)
    kv_rows = slice(tp_rank * kv_heads * shape.head_dim, (tp_rank + 1) * kv_heads * shape.head_dim)
    columns = slice(tp_rank * shape.hidden // tp_size, (tp_rank + 1) * shape.hidden // tp_size)
    weights = Weights(
        embed=normal(shape.vocab, shape.dim) * math.sqrt(shape.dim),
        lm_head=normal(shape.vocab, shape.dim),
        final_norm=1 + 0.1 * normal(shape.dim),
        attn_norm=[],
        mlp_norm=[],
        wq=[],
        wk=[],
        wv=[],
        wo=[],
        w_gate=[],
        w_up=[],
        w_down=[],
    )
    for _ in range(shape.layers):
        weights.attn_norm.append(1 + 0.1 * normal(shape.dim))
        weights.mlp_norm.append(1 + 0.1 * normal(shape.dim))
        weights.wq.append(normal(shape.heads * shape.head_dim, shape.dim)[q_rows])
        weights.wk.append(normal(shape.kv_heads * shape.head_dim, shape.dim)[kv_rows])
        weights.wv.append(normal(shape.kv_heads * shape.head_dim, shape.dim)[kv_rows])
        weights.wo.append(normal(shape.dim, shape.heads * shape.head_dim)[:, q_rows])
        weights.w_gate.append(normal(shape.hidden, shape.dim)[columns])
        weights.w_up.append(normal(shape.hidden, shape.dim)[columns])
        weights.w_down.append(normal(shape.dim, shape.hidden)[:, columns])
    return weights


class PagedCache:
    """One rank's KV cache: per layer a K and a V tensor ``[pages, page_size, kv_heads,
    head_dim]`` (float32), K of every layer first, then V — the layout kvbridge registers."""

    def __init__(self, shape: Shape, pages: int, tp_size: int = 1) -> None:
        kv_heads = shape.kv_heads // tp_size
        self.page_size = shape.page_size
        self.buffers = [
            torch.zeros(pages, shape.page_size, kv_heads, shape.head_dim, dtype=torch.float32)
            for _ in range(2 * shape.layers)
        ]
        self.layers = shape.layers

    def k(self, layer: int) -> torch.Tensor:
        return self.buffers[layer]

    def v(self, layer: int) -> torch.Tensor:
        return self.buffers[self.layers + layer]

    def slots(self, pages: list[int], positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(page, offset) of each token position of a request whose pages are `pages`."""
        table = torch.tensor(pages)
        return table[positions // self.page_size], positions % self.page_size

    def write(
        self,
        layer: int,
        pages: list[int],
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        page, offset = self.slots(pages, positions)
        self.k(layer)[page, offset] = k.to(torch.float32)
        self.v(layer)[page, offset] = v.to(torch.float32)

    def read(self, layer: int, pages: list[int], length: int) -> tuple[torch.Tensor, ...]:
        page, offset = self.slots(pages, torch.arange(length))
        return (
            self.k(layer)[page, offset].to(torch.float64),
            self.v(layer)[page, offset].to(torch.float64),
        )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on ``[tokens, heads, head_dim]``."""
    half = x.shape[-1] // 2
    frequencies = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = positions.to(torch.float64)[:, None] * frequencies[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


def _all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size > 1:
        dist.all_reduce(x)
    return x


def forward(
    shape: Shape,
    weights: Weights,
    cache: PagedCache,
    pages: list[int],
    tokens: torch.Tensor,
    start: int,
    tp_size: int = 1,
) -> torch.Tensor:
    """Run `tokens` at positions start.. of a request whose KV lives in `pages` (their K and
    V are written there); the logits of the last token."""
    positions = torch.arange(start, start + tokens.numel())
    x = weights.embed[tokens]
    heads, kv_heads = shape.heads // tp_size, shape.kv_heads // tp_size
    for layer in range(shape.layers):
        h = _rms_norm(x, weights.attn_norm[layer])
        q = _rotate((h @ weights.wq[layer].T).view(-1, heads, shape.head_dim), positions)
        k = _rotate((h @ weights.wk[layer].T).view(-1, kv_heads, shape.head_dim), positions)
        v = (h @ weights.wv[layer].T).view(-1, kv_heads, shape.head_dim)
        cache.write(layer, pages, positions, k, v)
        keys, values = cache.read(layer, pages, start + tokens.numel())
        group = heads // kv_heads
        keys = keys.repeat_interleave(group, dim=1)  # [context, heads, head_dim]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,chd->htc", q, keys) / math.sqrt(shape.head_dim)
        future = torch.arange(keys.shape[0])[None, :] > positions[:, None]
        scores = scores.masked_fill(future[None], float("-inf"))
        attended = torch.einsum("htc,chd->thd", scores.softmax(-1), values)
        x = x + _all_reduce(attended.reshape(tokens.numel(), -1) @ weights.wo[layer].T, tp_size)
        h = _rms_norm(x, weights.mlp_norm[layer])
        gated = torch.nn.functional.silu(h @ weights.w_gate[layer].T) * (h @ weights.w_up[layer].T)
        x = x + _all_reduce(gated @ weights.w_down[layer].T, tp_size)
    last = _rms_norm(x[-1], weights.final_norm)
    logits: torch.Tensor = last @ weights.lm_head.T
    return logits


def prompt_tokens(shape: Shape, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, shape.vocab, (length,), generator=torch.Generator().manual_seed(seed))


def generate_whole(shape: Shape, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """The reference: the whole model in this process, greedy."""
    weights = make_weights(shape)
    pages = list(range(math.ceil((prompt.numel() + new_tokens) / shape.page_size)))
    cache = PagedCache(shape, len(pages))
    logits = forward(shape, weights, cache, pages, prompt, 0)
    generated = [int(logits.argmax())]
    for step in range(new_tokens - 1):
        token = torch.tensor([generated[-1]])
        logits = forward(shape, weights, cache, pages, token, prompt.numel() + step)
        generated.append(int(logits.argmax()))
    return generated
