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

import torch
import torch.nn.functional as F
from torch import nn

from isthmus.job.sizes import SIZES, GPTConfig, config_for


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


__all__ = ["GPT", "SIZES", "GPTConfig", "config_for", "lm_loss"]
