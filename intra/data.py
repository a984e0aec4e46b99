"""The built-in data: byte-level language modelling on a real corpus, sharded deterministically.

The default corpus is the Python standard library's own source (about 12 MB
of ``.py`` files without the test suites): real text that is on every machine
with Python, needing no download. A user's text file (read as bytes) or token
file (a saved 1-D integer tensor, ``.pt``) replaces it.

The corpus is cut into a grid of windows of ``seq_len + 1`` tokens (inputs and
their next tokens). The last ``eval_fraction`` of the corpus is held out for
evaluation. The training windows are dealt to shards:

* ``iid``: one permutation of all windows (from the job's seed) dealt round
  robin to every data-parallel rank of every site: each shard is a uniform
  sample of the whole corpus;
* non-IID (``iid=False``): site ``i`` of ``S`` takes the ``i``-th contiguous
  ``1/S`` of the corpus (other modules of the library, so other vocabulary and
  style), dealt round robin to its own data-parallel ranks.

Shards are disjoint, depend only on (corpus, seq_len, seed, site index, site
count, rank index, rank count), and a shard's batches are a fixed function of
its epoch: any process computes the same ones.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

EXCLUDED_STDLIB_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "__pycache__"})


@dataclass(frozen=True)
class Corpus:
    tokens: torch.Tensor
    """1-D int64 token ids."""
    name: str
    vocab_size: int

    @property
    def sha256(self) -> str:
        """Identifies the corpus: sites must train on the same one."""
        return hashlib.sha256(self.tokens.numpy().tobytes()).hexdigest()


@functools.lru_cache(maxsize=2)
def stdlib_corpus(limit_bytes: int | None = None) -> Corpus:
    """The standard library's ``.py`` files in sorted path order, as bytes.

    Read once per process and shared (callers only slice it): the warm rank
    template (:mod:`isthmus.deploy.launch.warm_start`) reads it before it forks, so
    every forked rank finds it in memory the template's pages hold, instead of
    reading ~700 files and keeping its own 90 MB of int64 tokens."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in stdlib_sources(root):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if limit_bytes is not None and total >= limit_bytes:
            break
    blob = b"".join(chunks)[:limit_bytes]
    return Corpus(_bytes_to_tokens(blob), "stdlib", 256)


def stdlib_sources(root: Path) -> list[Path]:
    """The ``.py`` files under ``root`` outside :data:`EXCLUDED_STDLIB_DIRS`, in
    sorted path order (the order ``sorted(root.rglob("*.py"))`` gives).

    The excluded folders are pruned as the walk meets them: a Python installation
    keeps its site-packages under the standard library, and listing every file of
    torch's there cost each rank about a second at every start, for ~700 files
    kept out of ~13,000 seen."""
    found: list[Path] = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in EXCLUDED_STDLIB_DIRS]
        found.extend(Path(folder, f) for f in files if f.endswith(".py"))
    return sorted(found)


def _bytes_to_tokens(blob: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()


def load_corpus(source: str = "stdlib") -> Corpus:
    """``stdlib``, a text file (bytes are the tokens), or a ``.pt`` file holding a
    1-D integer tensor of token ids."""
    if source == "stdlib":
        return stdlib_corpus()
    path = Path(source)
    if not path.is_file():
        raise ValueError(
            f"data.source: no file {source!r}; give 'stdlib', a text file, or a .pt token file"
        )
    if path.suffix == ".pt":
        tokens = torch.load(path, weights_only=True)
        if not (
            isinstance(tokens, torch.Tensor)
            and tokens.dim() == 1
            and not tokens.is_floating_point()
            and not tokens.is_complex()
        ):
            raise ValueError(
                f"data.source: {source} must hold a 1-D integer tensor of token ids "
                f"(torch.save(torch.tensor(ids), path))"
            )
        tokens = tokens.long()
        if tokens.numel() and int(tokens.min()) < 0:
            raise ValueError(f"data.source: {source} holds negative token ids")
        vocab = int(tokens.max()) + 1 if tokens.numel() else 1
        return Corpus(tokens, path.name, vocab)
    return Corpus(_bytes_to_tokens(path.read_bytes()), path.name, 256)


@dataclass(frozen=True)
class ShardSpec:
    """Which data-parallel rank of which site a shard feeds."""

    site_index: int
    ranks_per_site: tuple[int, ...]
    """Data-parallel ranks of every site, in the job's site order (sites may differ)."""
    rank_index: int
    """The data-parallel rank within the site (tensor/pipeline peers share a shard)."""
    iid: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.site_index < len(self.ranks_per_site):
            raise ValueError(f"site_index {self.site_index} not in [0, {len(self.ranks_per_site)})")
        if not 0 <= self.rank_index < self.ranks_per_site[self.site_index]:
            raise ValueError(
                f"rank_index {self.rank_index} not in [0, {self.ranks_per_site[self.site_index]})"
            )

    @property
    def site_count(self) -> int:
        return len(self.ranks_per_site)

    @property
    def rank_count(self) -> int:
        return self.ranks_per_site[self.site_index]


class Dataset:
    """The windows of a corpus, split into training shards and a held-out evaluation set."""

    def __init__(self, corpus: Corpus, seq_len: int, *, eval_fraction: float = 0.05) -> None:
        if not 0 < eval_fraction < 1:
            raise ValueError(f"data.eval_fraction must be in (0, 1), got {eval_fraction}")
        self.corpus = corpus
        self.seq_len = seq_len
        window = seq_len + 1
        n = corpus.tokens.numel()
        train_end = int(n * (1 - eval_fraction))
        self.train_windows = max(0, (train_end - 1) // seq_len)
        self.eval_start = self.train_windows * seq_len
        self.eval_windows = max(0, (n - self.eval_start - 1) // seq_len)
        if self.train_windows < 1 or self.eval_windows < 1:
            raise ValueError(
                f"data: corpus {corpus.name!r} has {n} tokens, too few for windows of "
                f"{window} with {eval_fraction:.0%} held out; use a larger corpus or a "
                f"shorter model.seq_len"
            )

    def _window(self, start: int) -> torch.Tensor:
        return self.corpus.tokens[start : start + self.seq_len + 1]

    def shard_windows(self, spec: ShardSpec) -> torch.Tensor:
        """Indices of the training windows of one shard (disjoint across shards)."""
        if spec.iid:
            order = torch.randperm(self.train_windows, generator=_generator(spec.seed, 0))
            index = sum(spec.ranks_per_site[: spec.site_index]) + spec.rank_index
            return order[index :: sum(spec.ranks_per_site)]
        lo = self.train_windows * spec.site_index // spec.site_count
        hi = self.train_windows * (spec.site_index + 1) // spec.site_count
        order = lo + torch.randperm(hi - lo, generator=_generator(spec.seed, 1 + spec.site_index))
        return order[spec.rank_index :: spec.rank_count]

    def batches(
        self, spec: ShardSpec, batch_size: int, *, epoch: int = 0, start: int = 0
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless ``(inputs, targets)`` batches of one shard, reshuffled every epoch.
        ``start``: skip that many batches (where a resumed run left off), without
        building them."""
        windows = self.shard_windows(spec)
        if windows.numel() < batch_size:
            raise ValueError(
                f"data: a shard holds {windows.numel()} windows, fewer than the batch size "
                f"{batch_size}; use a larger corpus, fewer ranks or a smaller batch"
            )
        per_epoch = windows.numel() // batch_size
        epoch += start // per_epoch
        first = start % per_epoch
        while True:
            generator = _generator(spec.seed, 1000 + epoch, spec.site_index, spec.rank_index)
            order = windows[torch.randperm(windows.numel(), generator=generator)]
            for b in range(first * batch_size, order.numel() - batch_size + 1, batch_size):
                yield self._stack(order[b : b + batch_size] * self.seq_len)
            epoch += 1
            first = 0

    def eval_batches(
        self, batch_size: int, max_batches: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The held-out windows in order (the same on every site)."""
        starts = self.eval_start + torch.arange(self.eval_windows) * self.seq_len
        limit = starts.numel() // batch_size
        if max_batches is not None:
            limit = min(limit, max_batches)
        for b in range(limit):
            yield self._stack(starts[b * batch_size : (b + 1) * batch_size])

    def _stack(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = torch.stack([self._window(int(s)) for s in starts])
        return batch[:, :-1], batch[:, 1:]


def _generator(*seeds: int) -> torch.Generator:
    # Mix the parts into one 63-bit seed; sha256 keeps nearby tuples apart.
    digest = hashlib.sha256(repr(seeds).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
