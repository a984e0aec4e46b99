"""The virtual-clock rate limiter behind every emulated bandwidth cap."""

import pytest

from isthmus.sim.token_bucket import TokenBucket


def test_reservations_leave_at_the_rate():
    bucket = TokenBucket(1000.0)  # bytes per second
    departures = [bucket.reserve(100, now=0.0) for _ in range(10)]
    assert departures == pytest.approx([0.1 * (i + 1) for i in range(10)])


def test_idle_time_is_not_banked_without_burst():
    bucket = TokenBucket(1000.0)
    bucket.reserve(100, now=0.0)
    # Long idle: the next batch still takes its own serialisation time.
    assert bucket.reserve(100, now=10.0) == pytest.approx(10.1)


def test_burst_lets_a_first_batch_through_at_once():
    bucket = TokenBucket(1000.0, burst_bytes=500)
    assert bucket.reserve(500, now=0.0) == pytest.approx(0.0)
    assert bucket.reserve(500, now=0.0) == pytest.approx(0.5)


def test_late_callers_do_not_lower_the_long_run_rate():
    bucket = TokenBucket(1000.0)
    # A caller that always arrives a little after its previous departure
    # (a late timer) keeps the rate as long as it arrives before the slot ends.
    t = 0.0
    for _ in range(100):
        t = bucket.reserve(10, now=t - 0.005)
    assert t == pytest.approx(1.0)


def test_backlog_counts_reserved_seconds_still_waiting():
    bucket = TokenBucket(1000.0)
    bucket.reserve(500, now=0.0)
    assert bucket.backlog_s(0.0) == pytest.approx(0.5)
    assert bucket.backlog_s(0.2) == pytest.approx(0.3)
    assert bucket.backlog_s(1.0) == 0.0


def test_uncapped_bucket_never_delays():
    bucket = TokenBucket(None)
    assert bucket.reserve(10**9, now=3.0) == 3.0
    assert bucket.backlog_s(3.0) == 0.0


def test_rate_change_applies_to_later_reservations():
    bucket = TokenBucket(1000.0)
    assert bucket.reserve(1000, now=0.0) == pytest.approx(1.0)
    bucket.set_rate(2000.0)
    assert bucket.reserve(1000, now=0.0) == pytest.approx(1.5)


@pytest.mark.parametrize("rate", [0, -1.0])
def test_bad_rates_are_refused(rate):
    with pytest.raises(ValueError, match="rate_bytes_per_s"):
        TokenBucket(rate)
