"""Delay, jitter and loss models of an emulated link, and the validation of its settings."""

import math
import random
import statistics

import pytest

from isthmus.job.link import DirectionParams, LinkConfigError, LinkParams, direction_params
from isthmus.sim.jitter import JitterSampler
from isthmus.sim.loss import SegmentLoss


def _samples(distribution, jitter_ms, n=40_000, delay_ms=50.0, seed=1):
    sampler = JitterSampler(
        random.Random(seed), delay_ms=delay_ms, jitter_ms=jitter_ms, distribution=distribution
    )
    return [sampler.sample_s() * 1e3 for _ in range(n)]


@pytest.mark.parametrize("distribution", ["normal", "uniform"])
def test_jitter_standard_deviation_matches_setting(distribution):
    samples = _samples(distribution, 5.0)
    assert statistics.mean(samples) == pytest.approx(50.0, abs=0.2)
    assert statistics.stdev(samples) == pytest.approx(5.0, rel=0.03)


def test_uniform_jitter_stays_within_its_width():
    samples = _samples("uniform", 5.0)
    half_width = 5.0 * math.sqrt(3)
    assert min(samples) >= 50 - half_width and max(samples) <= 50 + half_width


def test_pareto_jitter_is_an_extra_heavy_tailed_delay():
    samples = _samples("pareto", 2.0, n=200_000)
    assert min(samples) >= 50.0
    # Shape 3, scale 2: mean extra 2 / (3 - 1) = 1 ms; stdev 2 * sqrt(3 / (4 * 1)).
    assert statistics.mean(samples) - 50 == pytest.approx(1.0, rel=0.05)
    assert statistics.stdev(samples) == pytest.approx(2 * math.sqrt(0.75), rel=0.15)


def test_delay_never_negative_even_with_large_jitter():
    assert min(_samples("normal", 50.0, delay_ms=1.0)) >= 0.0


def test_jitter_is_reproducible_from_its_seed():
    assert _samples("normal", 5.0, n=100, seed=7) == _samples("normal", 5.0, n=100, seed=7)
    assert _samples("normal", 5.0, n=100, seed=7) != _samples("normal", 5.0, n=100, seed=8)


def _loss_pattern(loss, burst, n, seed=3):
    process = SegmentLoss(random.Random(seed), loss=loss, mean_burst_segments=burst)
    return [process.lost_in(1) for _ in range(n)]


def test_bernoulli_loss_rate():
    pattern = _loss_pattern(0.01, 1.0, 400_000)
    assert sum(pattern) / len(pattern) == pytest.approx(0.01, rel=0.05)


def _bursts(pattern):
    bursts, run = [], 0
    for lost in pattern:
        if lost:
            run += 1
        elif run:
            bursts.append(run)
            run = 0
    return bursts


def test_bernoulli_losses_are_mostly_isolated():
    assert statistics.mean(_bursts(_loss_pattern(0.01, 1.0, 400_000))) < 1.05


def test_gilbert_elliott_keeps_mean_loss_and_makes_bursts():
    pattern = _loss_pattern(0.01, 4.0, 1_000_000)
    assert sum(pattern) / len(pattern) == pytest.approx(0.01, rel=0.1)
    assert statistics.mean(_bursts(pattern)) == pytest.approx(4.0, rel=0.1)


def test_counting_by_batches_equals_counting_segment_by_segment():
    one = SegmentLoss(random.Random(5), loss=0.02, mean_burst_segments=3.0)
    many = SegmentLoss(random.Random(5), loss=0.02, mean_burst_segments=3.0)
    by_one = sum(one.lost_in(1) for _ in range(45 * 2000))
    by_batch = sum(many.lost_in(45) for _ in range(2000))
    assert by_one == by_batch


def test_no_loss_means_no_loss():
    assert sum(_loss_pattern(0.0, 1.0, 10_000)) == 0


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"delay_ms": -1}, "delay_ms"),
        ({"jitter_ms": -0.5}, "jitter_ms"),
        ({"loss": 1.5}, "loss"),
        ({"loss": -0.1}, "loss"),
        ({"loss": 1.0}, "loss"),
        ({"bandwidth_mbit": 0}, "bandwidth_mbit"),
        ({"bandwidth_mbit": "fast"}, "bandwidth_mbit"),
        ({"jitter_distribution": "gauss"}, "jitter_distribution"),
        ({"loss_burst_segments": 0.5}, "loss_burst_segments"),
        ({"corrupt": 2}, "corrupt"),
        ({"window_bytes": 10}, "window_bytes"),
        ({"delay_ms": float("nan")}, "delay_ms"),
    ],
)
def test_bad_settings_name_their_field(changes, field):
    with pytest.raises(LinkConfigError) as info:
        DirectionParams(**changes)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}:")


def test_unknown_setting_suggests_the_right_name():
    with pytest.raises(LinkConfigError, match="did you mean 'jitter_ms'"):
        direction_params(jiter_ms=3)


def test_symmetric_link_splits_rtt():
    link = LinkParams.symmetric(rtt_ms=80, bandwidth_mbit=100)
    assert link.a_to_b.delay_ms == link.b_to_a.delay_ms == 40
    assert link.rtt_ms == 80
    with pytest.raises(LinkConfigError, match="rtt_ms"):
        LinkParams.symmetric(rtt_ms=-3)


def test_loss_positions_agree_with_counts():
    by_count = SegmentLoss(random.Random(9), loss=0.03, mean_burst_segments=2.0)
    by_position = SegmentLoss(random.Random(9), loss=0.03, mean_burst_segments=2.0)
    for _ in range(3000):
        positions = by_position.lost_positions(45)
        assert positions == sorted(set(positions)) and all(0 <= p < 45 for p in positions)
        assert len(positions) == by_count.lost_in(45)
