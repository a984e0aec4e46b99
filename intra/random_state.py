"""Every random generator a rank draws from, saved and put back with a checkpoint.

A resumed run must go on bit for bit as if never stopped: dropout masks, data
order drawn by a user's script, sampling. torch's CPU generator alone is not
enough on a GPU, where CUDA ops draw from each device's own generator, nor for a
script that draws from Python's ``random`` or NumPy's global generator.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch


def random_states() -> dict[str, Any]:
    """The state of every generator this process uses (CUDA's when initialised)."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")  # only if the script uses it: never imported for this
    if numpy is not None:
        # As torch and Python values: checkpoints load with weights_only=True.
        name, keys, position, has_gauss, gauss = numpy.random.get_state()
        states["numpy"] = (name, torch.from_numpy(keys.astype("int64")), position, has_gauss, gauss)
    return states


def restore_random_states(states: dict[str, Any] | torch.Tensor) -> None:
    """Put back what :func:`random_states` saved. A bare tensor is torch's CPU state
    alone (checkpoints written before the other generators were kept)."""
    if isinstance(states, torch.Tensor):
        torch.set_rng_state(states)
        return
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states:
        saved = states["cuda"]
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(saved):
            raise RuntimeError(
                f"the checkpoint holds the random state of {len(saved)} GPU(s) but this rank "
                f"sees {torch.cuda.device_count() if torch.cuda.is_available() else 0}; "
                "resume on the same kind of machine, or with the same train.device"
            )
        torch.cuda.set_rng_state_all(saved)
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in states:
        name, keys, position, has_gauss, gauss = states["numpy"]
        numpy.random.set_state((name, keys.numpy().astype("uint32"), position, has_gauss, gauss))


__all__ = ["random_states", "restore_random_states"]
