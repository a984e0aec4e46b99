"""Applying a site's layout to a model with PyTorch's own parallelisms.

Composition order (as torchtitan does it, and for the same reasons):

1. **pipeline** (``pp``): the model is cut into consecutive stages of layers;
   this rank keeps only its stage (:func:`pipeline_stage_module`), and a
   ``torch.distributed.pipelining`` schedule runs the microbatches;
2. **tensor parallel** (``tp``): inside the stage, attention projections and
   MLP layers are split column-wise then row-wise (:data:`GPT_TP_PLAN`), so
   each tensor-parallel rank runs ``n_head / tp`` heads and ``d_ff / tp`` MLP
   columns, with one all-reduce per block half;
3. **FSDP2** over the data-parallel dimensions (``dp_shard``, and HSDP with
   ``dp_replicate``): every block its own unit, the root holding the rest;
4. activation checkpointing, optional, per block;
5. ``torch.compile`` per block (``train.compile``), after tensor parallelism and
   before FSDP so each compiled block is one FSDP unit (torchtitan's order);
6. storage last (:func:`materialise`): a model built on the meta device gets
   memory on the rank's device only for its own shard and stage.

A user's own model takes the same path with its own :class:`ModelPlan`: its
blocks, a tensor-parallel plan (``{"submodule.path": ColwiseParallel, ...}``
per block) and a pipeline stage function; see docs/sites.md.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from isthmus.intra.model import GPT
from isthmus.job.layout import DIMENSIONS, Layout, stage_layers

GPT_TP_PLAN: dict[str, Callable[[], ParallelStyle]] = {
    "attention.wq": ColwiseParallel,
    "attention.wk": ColwiseParallel,
    "attention.wv": ColwiseParallel,
    "attention.wo": RowwiseParallel,
    "mlp.w1": ColwiseParallel,
    "mlp.w2": RowwiseParallel,
}
"""Per block of the built-in GPT: Q, K, V and the MLP's first layer split by
output columns (heads), their partners by input rows, so each half-block needs
one all-reduce."""


def site_mesh(layout: Layout, device_type: str | None = None) -> DeviceMesh:
    """The site's DeviceMesh, dimensions named as in :mod:`isthmus.job.layout`."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return init_device_mesh(device_type, layout.shape, mesh_dim_names=DIMENSIONS)


def materialise(model: nn.Module, device: torch.device, seed: int) -> nn.Module:
    """Give ``model`` (or this rank's part of it, once tensor, pipeline and FSDP have
    cut it) storage on ``device``, initialised from ``seed``.

    A model built for real is moved. One built on the meta device is allocated
    on ``device`` and initialised by its ``reset_parameters()`` after the seed:
    that is also how the built-in model is initialised when it is built for real
    (:func:`isthmus.training.rank_setup.build_model`), so on one rank both give the
    same values. Sharded (DTensor) parameters are initialised shard by shard;
    sites with other layouts are brought to the same values when the sites agree
    on the starting model (the first site's values are taken)."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    if not any(t.is_meta for t in tensors):
        return model.to(device)
    reset = getattr(model, "reset_parameters", None)
    if not callable(reset):
        raise ValueError(
            f"model: {type(model).__name__} was built on the meta device but has no "
            "reset_parameters() to initialise it after allocation; build it for real, or "
            "give it a reset_parameters() that initialises every parameter"
        )
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        reset()
    return model


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """``train.precision`` around a forward (and the backward it records): bf16
    matrix work under autocast, float32 weights, gradients and reductions; nothing
    for fp32."""
    if precision == "fp32":
        yield
        return
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        yield


def pipeline_stage_module(model: GPT, stage: int, stages: int) -> GPT:
    """Keep only ``stage``'s layers (names unchanged), the embeddings on the first
    stage and the final norm and head on the last."""
    keep = {str(i) for i in stage_layers(model.config.n_layer, stages, stage)}
    for name in list(model.layers):
        if name not in keep:
            del model.layers[name]
    if stage > 0:
        model.tok_embeddings = model.pos_embeddings = None
    if stage < stages - 1:
        model.norm = model.output = None
    return model


def apply_tensor_parallel(
    blocks: Iterable[nn.Module],
    tp_mesh: DeviceMesh,
    plan: dict[str, Callable[[], ParallelStyle]] = GPT_TP_PLAN,
) -> None:
    if tp_mesh.size() == 1:
        return
    for block in blocks:
        parallelize_module(block, tp_mesh, {path: style() for path, style in plan.items()})


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, blocks: Iterable[nn.Module]) -> nn.Module:
    """Shard ``model`` over the mesh's data-parallel dimensions (FSDP2, or HSDP
    when both ``dp_replicate`` and ``dp_shard`` are above one)."""
    # Imported here, not at the top: FSDP, pipelining and the checkpoint wrapper
    # pull in torch._dynamo (about a second per process on a small CPU), and a
    # one-rank site, the common case in emulation, uses none of them.
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh["dp_replicate", "dp_shard"]
    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def apply_activation_checkpointing(blocks: nn.ModuleDict) -> None:
    """Recompute each block's activations in the backward pass instead of storing them."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, block in list(blocks.items()):
        blocks[name] = checkpoint_wrapper(block)


@dataclass(frozen=True)
class ModelPlan:
    """How the parallelisms apply to a model: what a user supplies for their own.

    ``blocks(model)``: the ``ModuleDict`` of repeated blocks (FSDP units,
    tensor-parallel targets, activation-checkpointing units); ``tp_plan``: per
    block, submodule path -> ParallelStyle factory; ``stage(model, s, n)``: cut
    the model down to pipeline stage ``s`` of ``n`` in place (keeping parameter
    names) and return it. A model without a stage function cannot be
    pipelined; one without a plan cannot be tensor-parallel.
    """

    blocks: Callable[[nn.Module], nn.ModuleDict]
    tp_plan: dict[str, Callable[[], ParallelStyle]] | None = None
    stage: Callable[[nn.Module, int, int], nn.Module] | None = None


GPT_PLAN = ModelPlan(
    blocks=lambda model: model.layers,  # type: ignore[return-value]
    tp_plan=GPT_TP_PLAN,
    stage=pipeline_stage_module,  # type: ignore[arg-type]
)
"""The built-in model's plan."""


class SiteModel:
    """This rank's part of the model and how one training step runs on it.

    ``step(inputs, targets)`` runs forward and backward (through the pipeline
    schedule when there are stages) and leaves the gradients in
    :meth:`parameters`; it returns the mean loss where this rank computes it
    (the last stage), else None.
    """

    def __init__(
        self,
        model: nn.Module,
        layout: Layout,
        rank: int,
        *,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        plan: ModelPlan | None = GPT_PLAN,
        microbatches: int = 2,
        activation_checkpointing: bool = False,
        device: torch.device | None = None,
        seed: int = 0,
        precision: str = "fp32",
        compile_blocks: bool = False,
    ) -> None:
        self.device = device or torch.device("cpu")
        self.precision = precision
        self.layout = layout
        self.coords = layout.coordinates(rank)
        self.mesh = site_mesh(layout) if layout.size > 1 else None
        stage, stages = self.coords["pp"], layout.pp
        # No plan: no blocks to know of; the model is replicated or sharded whole.
        plan = plan or ModelPlan(blocks=lambda _: nn.ModuleDict())
        if stages > 1:
            if plan.stage is None:
                raise ValueError(
                    f"parallel.pp = {stages}, but the model's plan has no stage function; "
                    "give ModelPlan(stage=...) or use pp: 1"
                )
            model = plan.stage(model, stage, stages)
        blocks = plan.blocks(model)
        if activation_checkpointing:
            apply_activation_checkpointing(blocks)
        if self.mesh is not None and layout.tp > 1:
            if plan.tp_plan is None:
                raise ValueError(
                    f"parallel.tp = {layout.tp}, but the model's plan has no tensor-parallel "
                    "plan; give ModelPlan(tp_plan=...) or use tp: 1"
                )
            apply_tensor_parallel(blocks.values(), self.mesh["tp"], plan.tp_plan)
        if compile_blocks:
            for block in blocks.values():
                block.compile()  # in place: the parameter names stay as they are
        if self.mesh is not None and layout.dp_shard > 1:
            apply_fsdp(model, self.mesh, blocks.values())
        self.model = materialise(model, self.device, seed)
        self.sharded = layout.dp_shard > 1
        """Whether FSDP averages gradients over the site's data-parallel ranks itself."""
        self._schedule = None
        if stages > 1:
            assert self.mesh is not None
            self.microbatches = microbatches
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

            pipeline = PipelineStage(
                model,
                stage_index=stage,
                num_stages=stages,
                device=self.device,
                group=self.mesh["pp"].get_group(),
            )
            # The schedule sums the microbatches' gradients and divides by their
            # number (scale_grads), so the step's gradient is the batch mean's.
            self._schedule = ScheduleGPipe(
                pipeline, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True
            )
        self._loss_fn = loss_fn

    @property
    def stage_group(self) -> dist.ProcessGroup | None:
        """The ranks holding this rank's counterparts in the other pipeline stages
        (None without a pipeline): what sums a whole-model gradient norm."""
        if self.layout.pp == 1:
            return None
        assert self.mesh is not None
        return self.mesh["pp"].get_group()

    @property
    def first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def last_stage(self) -> bool:
        return self.coords["pp"] == self.layout.pp - 1

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        loss = self.forward_backward(inputs, targets)
        return None if loss is None else loss.item()

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """:meth:`step`, the loss left unread where it was computed (a detached 0-dim
        tensor: float32, or float64 for the mean of a pipeline's microbatches).
        Reading it (``.item()``) on a GPU waits for the backward pass to finish,
        and the device idles while the host then launches the rest of the step;
        the training loop reads it later
        (:class:`~isthmus.training.host_values.LaterFloat`)."""
        if self._schedule is None:
            with autocast(self.device, self.precision):
                loss = self._loss_fn(self.model(inputs), targets)
            loss.backward()
            return loss.detach()
        losses: list[torch.Tensor] = []
        with autocast(self.device, self.precision):
            if self.first_stage:
                # Compact: torch 2.11 checks stage 0's input strides against the ones
                # it recorded (compact), and a batch may be a slice of wider tokens.
                self._schedule.step(inputs.contiguous())
            elif self.last_stage:
                self._schedule.step(target=targets, losses=losses)
            else:
                self._schedule.step()
        if not self.last_stage:
            return None
        # The microbatches' mean as Python's sum of their floats was: float64, added
        # in order from the first.
        total = losses[0].detach().double()
        for loss in losses[1:]:
            total = total + loss.detach().double()
        return total / len(losses)
