"""SiteAdamW: AdamW where it should be, and the noise correction where it should be."""

from __future__ import annotations

import copy

import pytest
import torch

from isthmus.intra.site_adamw import SiteAdamW


def _pair(seed: int = 0) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    torch.manual_seed(seed)
    a = torch.nn.Parameter(torch.randn(4, 5))
    return a, torch.nn.Parameter(a.detach().clone())


def _accumulate(p: torch.nn.Parameter, parts: list[torch.Tensor], opt: SiteAdamW | None) -> None:
    """What backward passes over micro-batches do: add each part into .grad."""
    p.grad = None
    for part in parts:
        p.grad = part.clone() if p.grad is None else p.grad + part
        if opt is not None:
            opt.record_micro_batch()


@pytest.mark.parametrize("record", [False, True])
def test_at_share_one_it_is_adamw(record: bool) -> None:
    theirs, ours = _pair()
    reference = torch.optim.AdamW([theirs], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    optimizer = SiteAdamW([ours], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(6):
        parts = [torch.randn(4, 5, generator=generator) for _ in range(2)]
        _accumulate(theirs, parts, None)
        _accumulate(ours, parts, optimizer if record else None)
        reference.step()
        optimizer.step()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("count", [2, 3, 5])
def test_noise_is_the_variance_of_the_accumulated_gradient(count: int) -> None:
    p = torch.nn.Parameter(torch.zeros(1000))
    optimizer = SiteAdamW([p])
    generator = torch.Generator().manual_seed(2)
    samples = [torch.randn(1000, generator=generator) for _ in range(count)]
    # Each micro-batch's loss scaled by 1/count, as gradient accumulation does.
    _accumulate(p, [s / count for s in samples], optimizer)
    noise = optimizer._noise()[p]
    stacked = torch.stack(samples)
    expected = stacked.var(dim=0, unbiased=True) / count  # the variance of their mean
    torch.testing.assert_close(noise, expected, rtol=1e-4, atol=1e-6)


def test_noise_follows_a_gradient_scaled_after_the_last_record() -> None:
    """Clipping (or a sum turned into a mean) after the micro-batches scales the
    gradient the step takes, and its noise by the square of that."""
    p = torch.nn.Parameter(torch.zeros(50))
    optimizer = SiteAdamW([p])
    generator = torch.Generator().manual_seed(3)
    a, b = (torch.randn(50, generator=generator) for _ in range(2))
    _accumulate(p, [a, b], optimizer)  # unscaled: the sum
    with torch.no_grad():
        p.grad.mul_(0.5 * 0.3)  # the mean, then clipped to 0.3 of it
    noise = optimizer._noise()[p]
    torch.testing.assert_close(noise, ((a - b) / 2) ** 2 * 0.3**2, rtol=1e-4, atol=1e-7)


def test_a_share_below_one_takes_the_averaged_steps_noise_out() -> None:
    """One step by hand: the second moment less (1 - share) of the noise's
    running mean, never below share of it."""
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer = SiteAdamW([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.0, batch_share=0.25)
    a = torch.tensor([1.0, 1.0, 3.0])
    b = torch.tensor([1.0, 3.0, -3.0])
    _accumulate(p, [a / 2, b / 2], optimizer)
    optimizer.step()
    g = (a + b) / 2
    v = 0.01 * g**2
    n = 0.01 * ((a - b) / 2) ** 2
    second = torch.maximum(v - 0.75 * n, 0.25 * v) / 0.01
    expected = -0.1 * (0.1 * g / 0.1) / (second.sqrt() + 1e-8)
    torch.testing.assert_close(p.detach(), expected)
    # Noise-free (a == b on the first element): a plain AdamW step, -lr x sign.
    assert p[0].item() == pytest.approx(-0.1, rel=1e-6)
    # Pure noise (the mean is 0 on the last): held at share of the second moment.
    assert p[2].item() == 0.0


def test_without_micro_batches_it_keeps_the_noise_it_had() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    optimizer = SiteAdamW([p], batch_share=0.5)
    _accumulate(p, [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])], optimizer)
    optimizer.step()
    noise = optimizer.state[p]["exp_noise"].clone()
    _accumulate(p, [torch.tensor([1.0, 1.0])], None)
    optimizer.step()
    torch.testing.assert_close(optimizer.state[p]["exp_noise"], noise)


def test_state_round_trips_through_a_checkpoint() -> None:
    first, second = _pair()
    one = SiteAdamW([first], lr=1e-2, batch_share=0.5)
    generator = torch.Generator().manual_seed(4)
    steps = [[torch.randn(4, 5, generator=generator) for _ in range(2)] for _ in range(4)]
    for parts in steps[:2]:
        _accumulate(first, parts, one)
        one.step()
    with torch.no_grad():
        second.copy_(first)
    two = SiteAdamW([second], lr=1e-2, batch_share=0.5)
    two.load_state_dict(copy.deepcopy(one.state_dict()))  # as from a file
    for parts in steps[2:]:
        for p, o in ((first, one), (second, two)):
            _accumulate(p, parts, o)
            o.step()
    assert torch.equal(first, second)
    assert "exp_noise" in two.state_dict()["state"][0]


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5, float("nan")])
def test_a_share_outside_zero_to_one_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match=r"batch_share must be in \(0, 1\]"):
        SiteAdamW([torch.nn.Parameter(torch.zeros(1))], batch_share=share)


def test_parameters_that_skip_steps_keep_their_own_bias_correction() -> None:
    """As torch's AdamW: a parameter without a gradient on a step takes no step
    and its moments' correction counts only its own steps."""
    torch.manual_seed(5)
    ours = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    optimizer = SiteAdamW(ours, lr=0.1)
    reference = torch.optim.AdamW(theirs, lr=0.1)
    for step in range(4):
        for group in (ours, theirs):
            group[0].grad = None if step == 0 else torch.full((3,), 0.5)
            group[1].grad = torch.full((3,), -1.0)
        optimizer.step()
        reference.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_parameter_first_given_a_gradient_in_a_later_micro_batch() -> None:
    """What it held before the step is nothing, not the last step's gradient."""
    p = torch.nn.Parameter(torch.zeros(2))
    optimizer = SiteAdamW([p], batch_share=0.5)
    _accumulate(p, [torch.tensor([5.0, 5.0]), torch.tensor([7.0, 7.0])], optimizer)
    optimizer.step()
    p.grad = None
    optimizer.record_micro_batch()  # no gradient yet in the first micro-batch
    p.grad = torch.tensor([1.0, -1.0])
    optimizer.record_micro_batch()
    # Samples 0 and 2x: their mean's variance is ((0 - 2x) / 2)^2 = x^2.
    torch.testing.assert_close(optimizer._noise()[p], torch.tensor([1.0, 1.0]))


def test_a_skipped_step_lends_nothing_to_the_next() -> None:
    """A step a scaler skipped (inf gradients) was recorded, then zero_grad: the
    next step's noise is its own, and what is not finite adds nothing."""
    p = torch.nn.Parameter(torch.zeros(2))
    optimizer = SiteAdamW([p], batch_share=0.5)
    _accumulate(p, [torch.tensor([float("inf"), 1.0]), torch.tensor([3.0, 1.0])], optimizer)
    optimizer.zero_grad()  # no step
    _accumulate(p, [torch.tensor([1.0, 2.0]) / 2, torch.tensor([3.0, 2.0]) / 2], optimizer)
    torch.testing.assert_close(optimizer._noise()[p], torch.tensor([1.0, 0.0]))
    _accumulate(p, [torch.tensor([float("inf"), 1.0]), torch.tensor([3.0, 1.0])], optimizer)
    assert torch.isfinite(optimizer._noise()[p]).all()
