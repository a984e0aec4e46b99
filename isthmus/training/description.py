"""What a site trained, as the run's records name it: the one description of what ran.

Isthmus applies the strategy and its loop's settings; the model, the inner
optimizer and the data are the built-in loop's (``isthmus run JOB``) or the
script's own (``isthmus run JOB -- CMD``). Each site's rank 0 says which in its
``start`` record (:func:`describe_training`), and again in a ``described``
record for what the script adds later (``site.describe(...)``); the launcher's
``summary.json`` (and from it ``report.md``, ``compare.md``), TensorBoard and
``/metrics`` read that, never the job file's settings of a loop that did not run.
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
from pathlib import Path
from typing import Any

import torch
from torch import nn

Plain = str | int | float | bool | None


def plain_value(name: str, value: Any) -> Plain | list[Plain]:
    """``value`` as a record holds it: a string, a finite number, a bool, None, or a
    short list of those (an optimizer's ``betas``); refused otherwise, naming it."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, tuple | list) and len(value) <= 8:
        return [plain_value(name, v) for v in value]  # type: ignore[misc]
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise TypeError(
        f"site.describe({name}=...): give a string, a number, a bool or a short list of "
        f"those, got {type(value).__name__}"
    )


def optimizer_description(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's class and its first parameter group's settings (``lr``,
    ``betas``, ``weight_decay``, ...): what it trained with at the start."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    settings = {}
    for key, value in group.items():
        if key == "params":
            continue
        try:
            settings[key] = plain_value(key, value)
        except TypeError:
            continue  # a callable or an object: not a setting a record can state
    return {"name": type(optimizer).__name__, "settings": settings}


def describe_training(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    tokens_per_step: int,
    tokens_given: bool,
    described: dict[str, Any],
) -> dict[str, Any]:
    """The ``ran`` field of a site's ``start`` record. ``tokens_given``: the script
    passed ``tokens_per_step`` (else the job's ``train.batch_size`` stands in for
    it, until ``site.log(tokens=...)`` says). ``described``: what
    ``site.describe(...)`` said (``model``, ``data``, any other field); the model's
    class names it otherwise."""
    return {
        "model": type(model).__name__,
        "optimizer": optimizer_description(optimizer),
        "tokens_per_step": tokens_per_step,
        "tokens_per_step_from": "the script" if tokens_given else "train.batch_size",
        **described,
    }


def parameter_count(state: dict[str, torch.Tensor], parameters: list[str]) -> int:
    """Values in the whole model's parameters (sharded ones gathered): what the
    strategy synchronised, buffers left out."""
    return sum(state[name].numel() for name in parameters)


def save_model_file(
    state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str], *, mode_of: Path
) -> None:
    """The whole model as safetensors, written beside and renamed into place, with the
    file mode of ``mode_of`` (another file of the run: safetensors writes 0600).
    Tensors that share storage (tied weights) are written as copies: safetensors
    refuses shared ones."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors = {}
    for name, tensor in state.items():
        tensor = tensor.detach().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen:
            tensor = tensor.clone()
        seen.add(storage)
        tensors[name] = tensor
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    # Not os.umask(0) and back: other threads of the rank create files meanwhile.
    with contextlib.suppress(OSError):
        os.chmod(tmp, stat.S_IMODE(mode_of.stat().st_mode))
    tmp.replace(path)
