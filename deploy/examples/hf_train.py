"""A Hugging Face causal LM trained across the sites of a job, in a plain PyTorch loop.

    pip install 'isthmus[hf]'
    isthmus run deploy/examples/two-sites.yaml -- python deploy/examples/hf_train.py

The model is a small Llama built from a config (nothing is downloaded); its
tokens are bytes (vocabulary 256), so no tokenizer is needed either. The text
is the Python standard library's own top-level modules: local on every machine.

The loop in ``main()`` is the one you would write without Isthmus; the lines
marked ``# isthmus`` are all that it adds (docs/hf.md shows the two side by side).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import isthmus  # isthmus

SEQ_LEN = 64


def build_model() -> LlamaForCausalLM:
    """A 2-layer Llama of width 64 over byte tokens, about 0.1 M parameters."""
    torch.manual_seed(0)  # Isthmus starts every site from the first site's weights anyway
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def corpus() -> torch.Tensor:
    """The standard library's top-level ``.py`` files in sorted order, as byte tokens
    (about 4.7 MB). Sites must run the same Python version to read the same text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    blob = b"".join(path.read_bytes() for path in sorted(root.glob("*.py")))
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()


def batch(
    tokens: torch.Tensor, step: int, site: int = 0, rank: int = 0, batch_size: int = 8
) -> torch.Tensor:
    """``batch_size`` random windows of ``SEQ_LEN`` tokens, a fixed function of
    (site, rank, step): a site that rejoins at step 120 trains on step 120's data."""
    generator = torch.Generator().manual_seed((site * 1_000 + rank) * 1_000_000_000 + step)
    starts = torch.randint(len(tokens) - SEQ_LEN, (batch_size,), generator=generator)
    return torch.stack([tokens[s : s + SEQ_LEN] for s in starts.tolist()])


def main() -> None:
    site = isthmus.join()  # isthmus
    train = site.job.train  # isthmus
    device = site.device  # isthmus
    model = build_model().to(device)
    if torch.distributed.is_initialized():  # a site of several ranks: replicas, as under torchrun
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.inner_lr)  # isthmus: the job's
    tokens = corpus()
    with site.strategy(model, optimizer):  # isthmus
        for step in site.steps():  # isthmus
            x = batch(tokens, step, site.site_index, site.dp_rank, train.batch_size)  # isthmus
            x = x.to(device)
            loss = model(input_ids=x, labels=x).loss  # the model shifts the labels itself
            loss.backward()
            optimizer.step()  # every sync_every steps the sites' round runs in here
            optimizer.zero_grad()
            site.log(loss=loss.item(), tokens=x.numel())  # isthmus


if __name__ == "__main__":
    main()
