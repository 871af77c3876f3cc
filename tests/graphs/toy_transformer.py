"""A small decoder with the traits that make graph capture hard, for exercising the graph layer
without vLLM: a KV cache updated in place by the forward, and an attention custom op that writes
into a buffer allocated before it (like vLLM's `unified_attention_with_output`), so the forward
can be split at it.

Used by the graph tests and `tools/bench_graphs.py`; importing it registers the op
`tracekit_toy::attention`.
"""

import torch
from torch import nn

ATTENTION_OP = "tracekit_toy::attention"


@torch.library.custom_op(ATTENTION_OP, mutates_args=("k_cache", "v_cache", "out"))
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Write k, v at `positions` of the caches ([slots, heads, head_dim]), then causal attention
    of each query over the cache slots up to its position, into `out`."""
    k_cache[positions] = k
    v_cache[positions] = v
    slots, head_dim = k_cache.shape[0], k_cache.shape[-1]
    scores = torch.einsum("nhd,shd->hns", q, k_cache) * head_dim**-0.5
    future = torch.arange(slots, device=q.device)[None, :] > positions[:, None]
    scores = scores.masked_fill(future, float("-inf"))
    out.copy_(torch.einsum("hns,shd->nhd", scores.softmax(dim=-1), v_cache))


@attention.register_fake
def _(q, k, v, positions, k_cache, v_cache, out) -> None:
    return None


class ToyLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, slots: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.attn_norm = nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)
        self.register_buffer("k_cache", torch.zeros(slots, heads, self.head_dim))
        self.register_buffer("v_cache", torch.zeros(slots, heads, self.head_dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(self.attn_norm(x)).view(tokens, 3, self.heads, self.head_dim).unbind(1)
        out = torch.empty_like(q)
        torch.ops.tracekit_toy.attention(q, k, v, positions, self.k_cache, self.v_cache, out)
        x = x + self.o_proj(out.view(tokens, -1))
        return x + self.down(nn.functional.gelu(self.up(self.mlp_norm(x))))


class ToyTransformer(nn.Module):
    """`forward(input_ids [tokens], positions [tokens]) -> logits [tokens, vocab]`."""

    def __init__(
        self, vocab: int = 512, hidden: int = 256, heads: int = 4, layers: int = 2, slots: int = 256
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(ToyLayer(hidden, heads, slots) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.lm_head(self.norm(x))

    def kv_caches(self) -> list[torch.Tensor]:
        """The state the forward writes in place (the one-shot capture restores these)."""
        return [cache for layer in self.layers for cache in (layer.k_cache, layer.v_cache)]
