"""Where ranks compute (train.device, precision, compile, outer_state) and what the
device-generic path does on the CPU: the same code a GPU rank runs, with the
CUDA-only checks marked to skip with the reason."""

from __future__ import annotations

import io
import random

import numpy
import pytest
import torch
from torch import nn

from isthmus.deploy.cli import main
from isthmus.inter.outer import outer_device
from isthmus.intra.devices import (
    check_site_fits,
    compute_device,
    describe_gpu_map,
    emulated_gpu_map,
    out_of_memory_message,
)
from isthmus.intra.model import GPT, config_for, lm_loss
from isthmus.intra.parallelize import SiteModel, materialise
from isthmus.intra.random_state import random_states, restore_random_states
from isthmus.job.file import load_job
from isthmus.job.layout import Layout
from isthmus.job.settings import SettingError, TrainSettings
from isthmus.training.rank_setup import build_model, evaluate, to_device

NEEDS_GPU = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU: run python benchmarks/gpu.py there"
)


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("device", "gpu", "use one of auto, cuda, cpu"),
        ("precision", "fp16", "use one of fp32, bf16"),
        ("outer_state", "disk", "use one of device, host"),
        ("compile", "yes", "must be true or false"),
    ],
)
def test_bad_device_settings_are_refused_naming_the_field(field, value, words):
    with pytest.raises(SettingError) as refused:
        TrainSettings(**{field: value})
    assert refused.value.field == field and words in str(refused.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without GPU")
def test_cuda_without_a_gpu_is_refused_before_anything_starts(tmp_path, capsys):
    with pytest.raises(SettingError, match=r"shows no GPU.*use device: auto or cpu"):
        compute_device("cuda")
    assert compute_device("auto") == torch.device("cpu")
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: gpu\nsites:\n  - {name: a, ranks: 1}\n  - {name: b, ranks: 1}\n"
        "train: {steps: 2, device: cuda}\n"
    )
    assert main(["run", str(job), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "train.device: cuda, but this machine shows no GPU" in err
    assert not (tmp_path / "run" / "sites").exists()  # refused before any site started


def test_ranks_map_onto_gpus_and_a_site_larger_than_the_machine_is_refused():
    placement = emulated_gpu_map([("a", 1), ("b", 1), ("c", 2)], "auto", gpus=2)
    assert placement == {"a": [0], "b": [0], "c": [0, 1]}
    assert "sites share GPUs" in describe_gpu_map(placement)
    assert emulated_gpu_map([("a", 4)], "cpu", gpus=2) == {}
    assert emulated_gpu_map([("a", 4)], "auto", gpus=0) == {}
    with pytest.raises(SettingError, match="site 'c' has 3 ranks but this machine shows 2"):
        emulated_gpu_map([("a", 1), ("c", 3)], "auto", gpus=2)
    with pytest.raises(SettingError, match="torchrun --nnodes 2 --nproc-per-node 4"):
        check_site_fits("big", 8, "cuda", gpus=4)
    check_site_fits("big", 8, "cpu", gpus=4)  # the CPU takes any number of ranks


def test_a_model_built_on_meta_gets_the_values_it_gets_when_built_for_real():
    """Each rank allocates only its part; the seed gives the same values either way."""
    job = _job()
    real, _, _ = build_model(job)
    meta, _, _ = build_model(job, on_meta=True)
    assert all(p.is_meta for p in meta.parameters())
    materialise(meta, torch.device("cpu"), job.seed)
    for (name, a), (_, b) in zip(real.state_dict().items(), meta.state_dict().items(), strict=True):
        assert torch.equal(a, b), name

    class NoReset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(2, 2, device="meta")

    with pytest.raises(ValueError, match="has no reset_parameters"):
        materialise(NoReset(), torch.device("cpu"), 0)


def test_bf16_computes_in_bfloat16_and_keeps_float32_weights_and_gradients():
    torch.manual_seed(0)
    model = GPT(config_for("tiny"))
    part = SiteModel(model, Layout.for_ranks(1), 0, loss_fn=lm_loss, precision="bf16")
    seen = []
    part.model.layers["0"].mlp.w1.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    x = torch.randint(0, 256, (2, 16))
    loss = part.step(x, torch.roll(x, -1, 1))
    assert seen == [torch.bfloat16]
    assert loss is not None and torch.isfinite(torch.tensor(loss))
    assert all(
        p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in part.parameters()
    )
    assert evaluate(part.model, [(x, x)], lm_loss, "bf16") > 0


def test_outer_state_lives_beside_the_model_or_in_host_memory():
    model = nn.Linear(2, 2)
    assert outer_device("device", model) == torch.device("cpu")
    assert outer_device("host", model) == torch.device("cpu")


def test_every_random_state_survives_a_checkpoint_loaded_weights_only():
    saved = random_states()
    before = (torch.rand(3), random.random(), numpy.random.rand())
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    restore_random_states(torch.load(buffer, weights_only=True))
    assert torch.equal(before[0], torch.rand(3))
    assert (before[1], before[2]) == (random.random(), numpy.random.rand())
    old = torch.get_rng_state()  # a checkpoint from before: torch's CPU state alone
    expected = torch.rand(2)
    restore_random_states(old)
    assert torch.equal(torch.rand(2), expected)


def test_out_of_memory_names_the_rank_what_it_asked_for_and_what_to_lower():
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 ...")
    message = out_of_memory_message(error, "us-east", 3)
    assert "site 'us-east' rank 3 ran out of device memory (asked for 2.50 GiB" in message
    for setting in ("train.batch_size", "train.precision: bf16", "train.outer_state: host"):
        assert setting in message


def test_batches_stay_put_on_the_cpu():
    batch = (torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))
    assert to_device(batch, torch.device("cpu")) is batch


@NEEDS_GPU
def test_batches_reach_the_gpu_from_pinned_memory():
    x = torch.arange(6).view(2, 3)
    moved, _ = to_device((x, x), torch.device("cuda", 0))
    assert moved.is_cuda and torch.equal(moved.cpu(), x)


@NEEDS_GPU
def test_a_meta_model_materialises_on_the_gpu_with_the_cpu_values():
    job = _job()
    real, _, _ = build_model(job)
    meta, _, _ = build_model(job, on_meta=True)
    materialise(meta, torch.device("cuda", 0), job.seed)
    # Same seed, other generator: the GPU draws its own numbers, so only shapes match;
    # the sites agree on the first site's values before training.
    assert [p.shape for p in meta.parameters()] == [p.shape for p in real.parameters()]
    assert all(p.is_cuda for p in meta.parameters())


def test_compile_compiles_each_block_in_place_and_keeps_the_parameter_names():
    """train.compile: each block compiled in place (FSDP units and checkpoint keys
    unchanged). Compiling runs at the first step: a GPU run times it (benchmarks/gpu.py)."""
    torch.manual_seed(0)
    eager = [n for n, _ in GPT(config_for("tiny")).named_parameters()]
    part = SiteModel(
        GPT(config_for("tiny")), Layout.for_ranks(1), 0, loss_fn=lm_loss, compile_blocks=True
    )
    assert [n for n, _ in part.model.named_parameters()] == eager
    assert all(block._compiled_call_impl is not None for block in part.model.layers.values())
    assert part.model.output._compiled_call_impl is None  # blocks only


@NEEDS_GPU
def test_compiled_blocks_train_like_the_eager_ones_on_the_gpu():
    losses = []
    for compiled in (False, True):
        torch.manual_seed(0)
        part = SiteModel(
            GPT(config_for("tiny")),
            Layout.for_ranks(1),
            0,
            loss_fn=lm_loss,
            device=torch.device("cuda", 0),
            compile_blocks=compiled,
        )
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1)).cuda()
        losses.append(part.step(x, torch.roll(x, -1, 1)))
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)


def _job():
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp())
    (folder / "job.yaml").write_text("name: d\nsites:\n  - {name: a, ranks: 1}\n")
    return load_job(folder / "job.yaml")
