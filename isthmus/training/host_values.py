"""A number computed on the device, read on the host later without stalling the device.

``loss.item()`` (or ``float(loss)``) on a GPU waits for every kernel queued
before it: the host stops launching, and once the backward pass ends the
device idles until the host has launched the next kernels. The built-in
loop's loss is wanted only for the step's record, which can be written a
step later. :class:`LaterFloat` starts a non-blocking copy of the value into
pinned host memory, marked by an event; reading it waits for that event
alone (long past by then), not for the work queued since. On any other
device (the CPU) the value is read at once, with ``.item()``, as before.
"""

from __future__ import annotations

import torch


class LaterFloat:
    """The value of a one-element tensor, copied to the host in the background."""

    __slots__ = ("_event", "_host", "_value")

    def __init__(self, tensor: torch.Tensor) -> None:
        value = tensor.detach()
        self._event: torch.cuda.Event | None = None
        self._value: float | None = None
        if value.device.type == "cuda":
            self._host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self._host.copy_(value, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()  # on the current stream, after the copy
        else:
            self._value = value.item()

    def ready(self) -> bool:
        """Whether reading the value now would not wait for the device."""
        return self._event is None or self._event.query()

    def __float__(self) -> float:
        if self._value is None:
            assert self._event is not None
            self._event.synchronize()  # the copy's event, not the queue behind it
            self._value = self._host.item()  # host memory: no wait for the device
        return float(self._value)

    def __repr__(self) -> str:
        return f"LaterFloat({float(self)!r})" if self.ready() else "LaterFloat(pending)"
