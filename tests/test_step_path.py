"""The built-in loop's inner step reads nothing back from the device: its loss and
gradient norm stay tensors until a record needs them, with the same results as
reading them at once (on the CPU, bit for bit)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from isthmus.intra.gradients import clip_grad_norm, clip_gradients
from isthmus.intra.model import GPT, config_for, lm_loss
from isthmus.intra.parallelize import SiteModel
from isthmus.job.layout import Layout
from isthmus.job.settings import TrainSettings
from isthmus.training.host_values import LaterFloat
from isthmus.training.rank_setup import to_device
from isthmus.training.records import RecordWriter, read_records
from isthmus.training.worker import _forward_backward

NEEDS_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.fixture
def no_host_reads(monkeypatch):
    """Every way a tensor's value reaches the host (on a GPU: a wait for the device)
    raises while the fixture's ``on`` flag is set."""
    state = SimpleNamespace(on=False)
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def guarded(self, *args, _name=name, _original=original, **kwargs):
            if state.on:
                raise AssertionError(f"Tensor.{_name}() inside the step: a host sync on a GPU")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, guarded)
    return state


def _old_clip(params, max_norm):
    """clip_grad_norm as it was: each norm read on the host, scaled only when over."""
    squares = None
    for p in params:
        if p.grad is not None:
            norm = torch.linalg.vector_norm(p.grad, dtype=torch.float64)
            squares = norm**2 if squares is None else squares + norm**2
    norm = float(squares.sqrt())
    scale = max_norm / (norm + 1e-6)
    if math.isfinite(norm) and scale < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def _two_models_with_gradients(seed: int):
    torch.manual_seed(seed)
    ours, theirs = GPT(config_for("tiny")), GPT(config_for("tiny"))
    theirs.load_state_dict(ours.state_dict())
    x = torch.randint(0, 256, (4, 65))
    for model in (ours, theirs):
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    return list(ours.parameters()), list(theirs.parameters())


@pytest.mark.parametrize("max_norm", [0.05, 0.3, 1e6])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clipping_on_the_device_is_bitwise_the_host_decision_and_reads_nothing(
    no_host_reads, max_norm, seed
):
    ours, theirs = _two_models_with_gradients(seed)
    expected = _old_clip(theirs, max_norm)
    no_host_reads.on = True
    norm = clip_gradients(ours, max_norm)
    no_host_reads.on = False
    assert isinstance(norm, torch.Tensor) and norm.dtype == torch.float64
    assert norm.item() == expected
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.grad, b.grad)


def test_a_norm_that_is_not_finite_leaves_the_gradients_as_they_are():
    ours, _ = _two_models_with_gradients(0)
    ours[0].grad[0] = float("inf")
    before = [p.grad.clone() for p in ours]
    assert math.isinf(clip_grad_norm(ours, 0.1))
    for a, p in zip(before, ours, strict=True):
        assert torch.equal(a, p.grad)


def test_the_loops_step_reads_nothing_back_and_gives_the_losses_step_gave(no_host_reads):
    """_forward_backward (forward, backward, clipping) as isthmus run calls it, against
    SiteModel.step and the old clipping: the same loss and gradients, bit for bit."""
    settings = TrainSettings(grad_clip=0.1)
    torch.manual_seed(0)
    x = torch.randint(0, 256, (4, 33))
    parts = []
    for _ in range(2):
        torch.manual_seed(3)
        parts.append(SiteModel(GPT(config_for("tiny")), Layout.for_ranks(1), 0, loss_fn=lm_loss))
    ours, theirs = parts
    optimizer = torch.optim.AdamW(ours.parameters())
    site = SimpleNamespace(device=torch.device("cpu"))
    no_host_reads.on = True
    loss = _forward_backward(ours, optimizer, settings, site, 0, x[:, :-1], x[:, 1:], None)
    no_host_reads.on = False
    expected = theirs.step(x[:, :-1], x[:, 1:])
    _old_clip(theirs.parameters(), settings.grad_clip)
    assert isinstance(loss, torch.Tensor) and not loss.requires_grad
    assert loss.item() == expected
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


class _OnItsWay:
    """A value still being copied from the device, as LaterFloat is on a GPU."""

    def __init__(self, value: float) -> None:
        self.value, self.arrived, self.reads = value, False, 0

    def ready(self) -> bool:
        return self.arrived

    def __float__(self) -> float:
        self.reads += 1
        return self.value


def test_a_record_whose_value_is_on_its_way_waits_for_the_next_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = RecordWriter(path, "a")
    first, second = _OnItsWay(2.5), _OnItsWay(2.25)
    writer.write("step", step=1, loss=first)
    assert path.read_text() == "" and first.reads == 0  # held: no wait for the device
    writer.write("step", step=2, loss=second)  # the first goes out, the second waits
    writer.write("state", state="syncing")  # ... and goes out before this one
    second.arrived = True
    writer.write("step", step=3, loss=second)  # arrived: written at once
    third = _OnItsWay(2.0)
    writer.write("step", step=4, loss=third)
    writer.release()
    writer.write("step", step=5, loss=_OnItsWay(1.0))
    writer.close()  # the last held record too
    records = read_records(path)
    assert [(r["kind"], r.get("step"), r.get("loss")) for r in records] == [
        ("step", 1, 2.5),
        ("step", 2, 2.25),
        ("state", None, None),
        ("step", 3, 2.25),
        ("step", 4, 2.0),
        ("step", 5, 1.0),
    ]
    times = [r["t"] for r in records]
    assert times == sorted(times)  # each at the time it was written, in order
    assert all(isinstance(json.loads(line)["t"], float) for line in path.read_text().splitlines())


def test_off_a_gpu_a_logged_tensor_is_read_at_once_as_before():
    loss = torch.tensor(1.2345678, dtype=torch.float32)
    later = LaterFloat(loss)
    assert later.ready() and float(later) == loss.item()
    batch = (torch.arange(6).view(2, 3)[:, 1:], torch.arange(6).view(2, 3)[:, :-1])
    assert to_device(batch, torch.device("cpu")) is batch


@NEEDS_GPU
def test_on_a_gpu_the_loss_and_the_batch_travel_without_a_sync():
    device = torch.device("cuda")
    loss = torch.tensor(3.25, device=device) * 2
    later = LaterFloat(loss)
    assert float(later) == 6.5 and later.ready()
    windows = torch.arange(2 * 9).view(2, 9)
    x, y = to_device((windows[:, :-1], windows[:, 1:]), device)
    assert x.is_contiguous() and torch.equal(x.cpu(), windows[:, :-1])
    assert torch.equal(y.cpu(), windows[:, 1:])
