"""The built-in model's shape (:class:`GPTConfig`) and its named sizes, without torch.

Apart from :mod:`isthmus.intra.model` so that validating a job file's ``model:``
and the site layouts against it (``isthmus check``, ``isthmus wan up``) does not
import torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


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


__all__ = ["SIZES", "GPTConfig", "config_for"]
