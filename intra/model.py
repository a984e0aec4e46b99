"""The built-in model: a decoder-only transformer (GPT) with named sizes.

Pre-norm blocks (LayerNorm, causal self-attention, GELU MLP), learned position
embeddings, an untied output head. Sizes run from ``tiny``, which trains
visibly in a minute on a laptop CPU, to configurations for GPU clusters.

The module layout is what the parallelisms rely on:

* blocks live in a ``ModuleDict`` keyed ``"0" .. "L-1"``, so a pipeline stage
  that keeps some of them keeps their names, and a checkpoint's keys mean the
  same parameter whatever the site's layout;
* a stage without the embeddings (or the head) has them set to ``None`` and
  :meth:`GPT.forward` passes its input through that part (it is then hidden
  states, not token ids);
* attention infers its local head count from its projection's output size, so
  after a column-wise tensor-parallel split each rank runs ``n_head / tp`` heads.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    """256 for byte-level text (the built-in data)."""
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    d_ff: int = 512

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name} must be an integer >= 1, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_head "
                f"({self.n_head}); choose n_head among {_divisors(self.d_model)}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def parameter_count(self) -> int:
        d, f, v, s, n = self.d_model, self.d_ff, self.vocab_size, self.seq_len, self.n_layer
        block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d  # attention, MLP, two norms
        return v * d + s * d + n * block + 2 * d + d * v + v

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


SIZES: dict[str, GPTConfig] = {
    # The size the convergence references use: 2 layers, d128, byte-level.
    "tiny": GPTConfig(),
    "small": GPTConfig(seq_len=128, n_layer=4, n_head=4, d_model=256, d_ff=1024),
    # GPT-2 small's shape; 124M parameters with GPT-2's vocabulary (vocab_size=50304).
    "125m": GPTConfig(seq_len=1024, n_layer=12, n_head=12, d_model=768, d_ff=3072),
    "1b": GPTConfig(seq_len=2048, n_layer=24, n_head=16, d_model=2048, d_ff=8192),
    "7b": GPTConfig(seq_len=4096, n_layer=32, n_head=32, d_model=4096, d_ff=16384),
}


def config_for(size: str, **overrides: int) -> GPTConfig:
    """The named size, with any field overridden (``vocab_size=50304``...)."""
    try:
        base = SIZES[size]
    except KeyError:
        raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(SIZES)}") from None
    unknown = sorted(set(overrides) - set(base.to_dict()))
    if unknown:
        raise ValueError(f"unknown model field(s) {unknown}; fields: {', '.join(base.to_dict())}")
    return replace(base, **overrides)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.head_dim = config.head_dim
        self.wq = nn.Linear(d, d)
        self.wk = nn.Linear(d, d)
        self.wv = nn.Linear(d, d)
        self.wo = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: after a tensor-parallel split the projections are narrower
        # and this rank runs only its share of the heads.
        q, k, v = (
            w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.d_ff)
        self.w2 = nn.Linear(config.d_ff, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.d_model)
        self.attention = Attention(config)
        self.mlp_norm = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab_size)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(config.seq_len, config.d_model)
        self.layers = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layer)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(config.d_model)
        self.output: nn.Linear | None = nn.Linear(config.d_model, config.vocab_size)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2's initialisation: N(0, 0.02), residual projections scaled by
        1 / sqrt(2 * n_layer) so the residual stream's variance does not grow with depth."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(("wo", "w2")) else 0.02
                nn.init.normal_(module.weight, std=std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        if self.tok_embeddings is not None:
            if tokens.size(1) > self.config.seq_len:
                raise ValueError(
                    f"sequence of {tokens.size(1)} tokens is longer than model.seq_len "
                    f"({self.config.seq_len})"
                )
            positions = torch.arange(tokens.size(1), device=tokens.device)
            assert self.pos_embeddings is not None
            x = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.output is not None:
            x = self.output(x)
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats per token)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
