"""In-site collectives Isthmus issues, and the check that their tensors are on the group's device.

An NCCL group refuses CPU tensors and a Gloo group most CUDA ones, and says so
deep inside torch at the first call, minutes into a job and without naming the
Isthmus code that made the tensor. Every in-site collective Isthmus issues
(the hierarchical step, agreement, membership flags, records, the control
plane's settings, gradient averaging, checkpoint barriers) goes through the
wrappers here. Each takes the rank's compute device as ``device=`` (where the
caller created its tensors: ``SiteRuntime.device``) and a short ``where=``
naming the call site, and refuses, naming ``where``, a tensor that is not on a
device the group can use:

- NCCL: the rank's CUDA device (``torch.cuda.current_device()``), and ``device``
  must be that device too;
- Gloo: the CPU; CUDA tensors only for ``all_reduce`` and ``broadcast``, the
  operations Gloo implements for CUDA (conservatively: Gloo grows CUDA support
  release by release, and a false refusal here is clearer than torch's);
- a group of both (``cpu:gloo,cuda:nccl``): either.

That refusal is always on (one device comparison per tensor, next to a
collective). With ``ISTHMUS_CHECK_DEVICES=1`` in the environment, or
:func:`checking` in code, every call is also recorded (:class:`CollectiveCall`:
op, call site, each tensor's device, dtype and shape, the group's backend, the
expected device), so a test can see that each call site ran and where.

What a CPU-only run catches, and what needs a GPU
-------------------------------------------------
On a CPU machine the compute device *is* the CPU, so comparing a tensor with
it can never fail: a ``torch.zeros(1)`` that forgot ``device=`` looks right.
Two things catch that mistake without a GPU:

1. **Device emulation** (``checking(emulate="cuda:0")``): a torch function mode
   that pretends, in the thread that enters it, that the rank computes on
   ``cuda:0`` behind an NCCL group. Tensors are really made on the CPU (so Gloo
   can run the collective) but carry a mark saying they are "on cuda:0":
   factories given ``device=cuda:0``, ``.to("cuda:0")`` and ``.cuda()`` mark
   their result, every other op marks its result when an input is marked, and
   ``.cpu()`` / ``.to("cpu")`` copy and unmark, as on a GPU. A collective then
   refuses any unmarked tensor, exactly as NCCL would refuse a CPU one; an
   op that would mix a marked and an unmarked (non-scalar) tensor, ``.numpy()``
   of a marked one, and a different CUDA index are refused where they happen.
   Tensors made outside torch functions (autograd's gradients, ``nn.Parameter``)
   are not marked by themselves: :meth:`DeviceCheck.place` marks them.
2. **A static guard** (``tests/test_collective_devices.py``): no module but this
   one calls a ``torch.distributed`` collective, and in every function that
   hands tensors to these wrappers each tensor factory names a ``device=``.

Only a GPU run shows what the emulation cannot model: NCCL's own behaviour
(streams, a tensor on the right device but the wrong stream, the
communicator's device chosen at ``init_process_group``), torch internals that
issue their own collectives (FSDP, DTensor, DCP), dtypes NCCL lacks, and code
paths the CPU tests never take.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

CHECK_ENV = "ISTHMUS_CHECK_DEVICES"
"""``1``: record every in-site collective (see :func:`current_check`)."""

GLOO_CUDA_OPS = frozenset({"all_reduce", "broadcast"})
"""Collectives Gloo runs on CUDA tensors (the others need CPU tensors)."""

MAX_RECORDED = 10_000
"""Calls kept in full; beyond that only :attr:`DeviceCheck.counts` grows (a
long job run with the check on must not grow without bound)."""

_MARK = "_isthmus_emulated_device"


class DeviceMismatch(RuntimeError):
    """A tensor handed to an in-site collective is not on the group's device."""


@dataclass(frozen=True)
class TensorInfo:
    device: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class CollectiveCall:
    """One in-site collective, as the check saw it."""

    op: str
    where: str
    backend: str
    expected: str
    """The device the group needs (``cuda:0``, ``cpu``; ``cpu|cuda:0`` for a mixed group)."""
    device: str
    """The compute device the call site said its tensors are on."""
    tensors: tuple[TensorInfo, ...]


@dataclass
class DeviceCheck:
    """Records every in-site collective; with ``emulate``, pretends the rank computes
    on that CUDA device (see the module's docstring)."""

    emulate: torch.device | None = None
    calls: list[CollectiveCall] = field(default_factory=list)
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(call site, op) -> calls, all of them."""

    @property
    def sites(self) -> set[str]:
        """The call sites seen."""
        return {where for where, _ in self.counts}

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mark ``tensor`` as on the emulated device (for tensors no torch function
        made: gradients, parameters); returns it."""
        if self.emulate is None:
            raise ValueError("place() needs a check that emulates a device")
        setattr(tensor, _MARK, self.emulate)
        return tensor

    def _record(self, call: CollectiveCall) -> None:
        self.counts[(call.where, call.op)] += 1
        if len(self.calls) < MAX_RECORDED:
            self.calls.append(call)


_check: DeviceCheck | None = (
    DeviceCheck() if os.environ.get(CHECK_ENV, "").lower() in ("1", "true", "yes") else None
)


def current_check() -> DeviceCheck | None:
    """The check in force (None: refusals only, nothing recorded)."""
    return _check


@contextmanager
def checking(*, emulate: str | torch.device | None = None) -> Iterator[DeviceCheck]:
    """Record every in-site collective inside the block; ``emulate`` (``"cuda:0"``):
    pretend, in this thread, that the rank computes on that device behind NCCL."""
    global _check
    previous = _check
    check = DeviceCheck(emulate=None if emulate is None else torch.device(emulate))
    if check.emulate is not None and (check.emulate.type != "cuda" or check.emulate.index is None):
        raise ValueError(f"emulate a CUDA device with its index (cuda:0), not {emulate!r}")
    _check = check
    try:
        if check.emulate is None:
            yield check
        else:
            with _Emulation(check.emulate):
                yield check
    finally:
        _check = previous


# -- where a group needs its tensors ---------------------------------------------------
def backend_of(group: dist.ProcessGroup | None) -> str:
    """The group's backend in lower case (``nccl``, ``gloo``, ``cpu:gloo,cuda:nccl``)."""
    return str(dist.get_backend(group)).lower()


def _allowed(op: str, backend: str) -> tuple[list[torch.device], bool]:
    """(devices the group takes for ``op``, whether any CUDA device will do)."""
    if _check is not None and _check.emulate is not None:
        return [_check.emulate], False  # every group is NCCL on the emulated device
    cpu = torch.device("cpu")
    if "nccl" in backend:
        cuda = torch.device("cuda", torch.cuda.current_device())
        return ([cpu, cuda] if "gloo" in backend else [cuda]), False
    return [cpu], op in GLOO_CUDA_OPS


def device_of(tensor: torch.Tensor) -> torch.device:
    """Where ``tensor`` is, emulation included."""
    mark = getattr(tensor, _MARK, None)
    return mark if mark is not None else tensor.device


def _info(tensor: torch.Tensor) -> TensorInfo:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return TensorInfo(str(device_of(tensor)), dtype, tuple(tensor.shape))


def _check_call(
    op: str,
    where: str,
    group: dist.ProcessGroup | None,
    device: torch.device | str,
    tensors: Sequence[torch.Tensor],
) -> None:
    backend = backend_of(group)
    allowed, any_cuda = _allowed(op, backend)
    device = torch.device(device)

    def fits(d: torch.device) -> bool:
        return d in allowed or (any_cuda and d.type == "cuda")

    expected = "|".join(str(d) for d in allowed) + ("|cuda" if any_cuda else "")
    if _check is not None:
        _check._record(
            CollectiveCall(
                op=op,
                where=where,
                backend=backend if _check.emulate is None else f"nccl (emulated on {backend})",
                expected=expected,
                device=str(device),
                tensors=tuple(_info(t) for t in tensors),
            )
        )
    for i, t in enumerate(tensors):
        if not fits(device_of(t)):
            raise DeviceMismatch(
                f"{where}: {op} got tensor {i} ({t.dtype}, shape {tuple(t.shape)}) on "
                f"{device_of(t)}, but its {backend} group needs {expected}; create it with "
                f"device= the rank's compute device ({device})"
            )
    if not fits(device):
        raise DeviceMismatch(
            f"{where}: {op} was told the rank computes on {device}, but its {backend} group "
            f"needs {expected}; pass the runtime's device (SiteRuntime.device)"
        )


# -- the collectives -------------------------------------------------------------------
def all_reduce(
    tensor: torch.Tensor,
    *,
    device: torch.device | str,
    where: str,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> None:
    _check_call("all_reduce", where, group, device, [tensor])
    dist.all_reduce(tensor, op=op, group=group)


def all_reduce_values(
    values: Sequence[float],
    *,
    device: torch.device | str,
    where: str,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """A few numbers (flags, counters, a loss) reduced over ``group``: made on
    ``device``, returned on the CPU (a device-to-host sync: they are read at once)."""
    tensor = torch.tensor(list(values), dtype=dtype, device=device)
    all_reduce(tensor, device=device, where=where, op=op, group=group)
    return tensor.cpu()


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    device: torch.device | str,
    where: str,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> None:
    """``output`` = this rank's block of ``input`` reduced over ``group``."""
    _check_call("reduce_scatter_tensor", where, group, device, [output, input])
    _REDUCE_SCATTER_SINGLE(output, input, op=op, group=group)


def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    device: torch.device | str,
    where: str,
    group: dist.ProcessGroup | None = None,
) -> None:
    """``output`` = every rank's ``input``, concatenated in rank order."""
    _check_call("all_gather_into_tensor", where, group, device, [output, input])
    _ALL_GATHER_SINGLE(output, input, group=group)


# torch 2.13 renamed the single-tensor collectives (``*_single``) and warns at every
# call of the old names, once per rank log; the GPU machines' torch 2.11 has only those.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(
    outputs: list[torch.Tensor],
    input: torch.Tensor,
    *,
    device: torch.device | str,
    where: str,
    group: dist.ProcessGroup | None = None,
) -> None:
    _check_call("all_gather", where, group, device, [*outputs, input])
    dist.all_gather(outputs, input, group=group)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    *,
    device: torch.device | str,
    where: str,
    group: dist.ProcessGroup | None = None,
) -> None:
    _check_call("broadcast", where, group, device, [tensor])
    dist.broadcast(tensor, src, group=group)


def barrier(
    *, device: torch.device | str, where: str, group: dist.ProcessGroup | None = None
) -> None:
    """A barrier; on NCCL it names the rank's GPU (without ``device_ids`` torch
    guesses one, and warns)."""
    _check_call("barrier", where, group, device, [])
    device = torch.device(device)
    if "nccl" in backend_of(group) and device.type == "cuda" and _emulated() is None:
        dist.barrier(group=group, device_ids=[device.index or 0])
    else:
        dist.barrier(group=group)


def _object_device(
    device: torch.device | str, group: dist.ProcessGroup | None
) -> torch.device | None:
    """The device an object collective stages its pickles on: the rank's GPU on
    NCCL (torch otherwise takes the current device, which a caller may not have
    set); torch's own choice (the CPU) on Gloo and under emulation."""
    if _emulated() is not None or "nccl" not in backend_of(group):
        return None
    return torch.device(device)


def broadcast_object_list(
    objects: list[Any],
    src: int = 0,
    *,
    device: torch.device | str,
    where: str,
    group: dist.ProcessGroup | None = None,
) -> None:
    _check_call("broadcast_object_list", where, group, device, [])
    dist.broadcast_object_list(objects, src=src, group=group, device=_object_device(device, group))


def all_gather_object(
    outputs: list[Any],
    obj: Any,
    *,
    device: torch.device | str,
    where: str,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Every rank's ``obj``. torch stages the pickles on ``torch.cuda.current_device()``
    under NCCL (it takes no device): the site sets it to the rank's GPU before NCCL
    starts (``intra/process_group.py``), which the check's ``device`` test confirms."""
    _check_call("all_gather_object", where, group, device, [])
    dist.all_gather_object(outputs, obj, group=group)


# -- device emulation ------------------------------------------------------------------
def _emulated() -> torch.device | None:
    return None if _check is None else _check.emulate


# Ops that may legitimately see a CPU and a CUDA tensor together (copies across
# devices, indexing a CUDA tensor with CPU indices).
_MIXING_OK = frozenset({"to", "copy_", "__setitem__", "__getitem__", "__get__", "__set__"})


class _Emulation(TorchFunctionMode):
    """Tensors "on" the emulated device are CPU tensors carrying a mark (see the
    module's docstring); this mode makes and follows the marks."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def _is_emulated(self, value: Any) -> bool | None:
        """True: the emulated device; False: the CPU; None: not a device."""
        if isinstance(value, torch.Tensor):
            return getattr(value, _MARK, None) is not None
        if isinstance(value, int) and not isinstance(value, bool):
            value = torch.device("cuda", value)
        if not isinstance(value, (str, torch.device)):
            return None
        try:
            d = torch.device(value)
        except (RuntimeError, TypeError):
            return None
        if d.type == "cpu":
            return False
        if d.type == "cuda" and d.index in (None, self.device.index):
            return True
        raise DeviceMismatch(
            f"a tensor is being put on {d}, but this rank computes on {self.device} "
            "(emulated): every tensor of a rank belongs on its own device"
        )

    def _target(self, name: str, args: tuple, kwargs: dict) -> tuple[bool | None, tuple, dict]:
        """(where the op puts its result, args and kwargs with the emulated device
        replaced by the CPU)."""
        if "device" in kwargs and kwargs["device"] is not None:
            target = self._is_emulated(kwargs["device"])
            return target, args, {**kwargs, "device": "cpu"}
        if name == "cuda":
            index = args[1] if len(args) > 1 else kwargs.get("device")
            return self._is_emulated(self.device if index is None else index), args, kwargs
        if name == "cpu":
            return False, args, kwargs
        if name == "to":
            for i, value in enumerate(args[1:], start=1):
                target = self._is_emulated(value)
                if target is not None:
                    if not isinstance(value, torch.Tensor):
                        args = (*args[:i], "cpu", *args[i + 1 :])
                    return target, args, kwargs
        return None, args, kwargs

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "numpy" and args and getattr(args[0], _MARK, None) is not None:
            raise DeviceMismatch(
                f".numpy() of a tensor on {self.device} (emulated): on a GPU this fails; "
                "copy it to the host first (.cpu())"
            )
        target, args, kwargs = self._target(name, args, kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        marked = [getattr(t, _MARK, None) is not None for t in inputs]
        if name not in _MIXING_OK and target is None:
            sizes = {m for t, m in zip(inputs, marked, strict=True) if t.dim() > 0}
            if len(sizes) == 2:
                raise DeviceMismatch(
                    f"{name} mixes tensors on {self.device} (emulated) with CPU tensors: on a "
                    "GPU this fails; create them all with device= the rank's compute device"
                )
        # .cuda() cannot run on a CPU build: the copy ``place`` makes stands for it.
        result = args[0] if name == "cuda" else func(*args, **kwargs)
        in_place = name.endswith("_") and not name.endswith("__")
        if in_place or name.startswith("__i") or name in ("__setitem__", "__set__"):
            return result  # in place: the destination stays where it is
        if target is None:
            target = any(marked)
        by_id = {id(t) for t in inputs}

        def place(out: Any) -> Any:
            if not isinstance(out, torch.Tensor):
                return out
            if id(out) in by_id:
                was = getattr(out, _MARK, None) is not None
                if was == target:
                    return out
                out = out.clone()  # a real device change copies; the CPU one did not
            if target:
                setattr(out, _MARK, self.device)
            elif getattr(out, _MARK, None) is not None:
                delattr(out, _MARK)
            return out

        return tree_map(place, result)


__all__ = [
    "CHECK_ENV",
    "CollectiveCall",
    "DeviceCheck",
    "DeviceMismatch",
    "TensorInfo",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_values",
    "backend_of",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "checking",
    "current_check",
    "device_of",
    "reduce_scatter_tensor",
]
