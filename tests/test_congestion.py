"""The proxy's model of a TCP sender's congestion window (CUBIC, as Linux runs it)."""

from __future__ import annotations

import math

import pytest

from isthmus.sim.congestion import BETA, CUBIC_C, FRIENDLY_ALPHA, CubicWindow

RTT = 0.05


def ack_rounds(window: CubicWindow, start: float, rounds: int) -> float:
    """Acknowledge one window per round trip, ``rounds`` times; the time after."""
    now = start
    for _ in range(rounds):
        now += window.rtt_s
        window.on_ack(math.floor(window.segments(now)), now)
    return now


def after_a_loss(cwnd: float, *, rtt_s: float = RTT) -> tuple[CubicWindow, float]:
    """A window of ``cwnd`` segments in avoidance, just out of a loss's recovery."""
    window = CubicWindow(rtt_s=rtt_s)
    window.cwnd = cwnd
    window.on_loss(sent_at=0.0)
    window.segments(rtt_s)  # the sender learns of it
    return window, 2 * rtt_s


def test_slow_start_doubles_per_round_trip_up_to_ssthresh():
    window = CubicWindow(rtt_s=RTT)
    assert window.segments(0.0) == 10
    window.on_ack(10, 0.05)
    assert window.cwnd == 20
    window.ssthresh = 25
    window.on_ack(20, 0.10)
    # Five segments of slow start reach ssthresh; the other 15 grow it by avoidance.
    assert 25 < window.cwnd < 26


def test_a_loss_cuts_the_window_once_the_sender_learns_of_it():
    window = CubicWindow(rtt_s=RTT)
    window.cwnd = 40.0
    assert window.on_loss(sent_at=1.0)
    assert window.segments(1.0 + RTT / 2) == 40  # the duplicate ACKs are still on their way
    assert window.segments(1.0 + RTT) == pytest.approx(40 * BETA)
    assert window.ssthresh == pytest.approx(40 * BETA)


def test_losses_before_detection_share_one_recovery():
    window = CubicWindow(rtt_s=RTT)
    window.cwnd = 40.0
    assert window.on_loss(sent_at=1.0)
    assert not window.on_loss(sent_at=1.0 + RTT * 0.9)
    assert window.segments(1.2) == pytest.approx(40 * BETA)  # cut once, not twice
    assert window.on_loss(sent_at=1.0 + RTT * 1.1)


def test_a_second_loss_before_the_first_is_detected_keeps_both_cuts():
    # Departures are booked ahead of the clock on a queued link: the second
    # recovery can start before the first one's cut was applied.
    window = CubicWindow(rtt_s=RTT)
    window.cwnd = 100.0
    window.on_loss(sent_at=1.0)
    window.on_loss(sent_at=1.0 + RTT * 1.5)
    assert window.segments(1.0 + RTT * 3) == pytest.approx(100 * BETA * BETA)


def test_the_window_does_not_grow_during_recovery():
    window = CubicWindow(rtt_s=RTT)
    window.cwnd = 40.0
    window.on_loss(sent_at=0.0)
    window.on_ack(10, RTT * 0.5)  # before the sender knows: it still grows
    assert window.cwnd > 40.0
    grown = window.cwnd
    window.on_ack(28, RTT * 1.5)  # the retransmission is not acknowledged yet
    assert window.cwnd == pytest.approx(grown * BETA)
    window.on_ack(28, RTT * 2.5)
    assert window.cwnd > grown * BETA


def test_on_short_paths_growth_follows_renos_rate_for_the_same_beta():
    # At 50 ms and ~20 segments the cubic curve is nearly flat; CUBIC's
    # TCP-friendly estimate sets the pace: 3 (1 - beta) / (1 + beta) per RTT.
    window, now = after_a_loss(20.0)
    start = window.segments(now)
    ack_rounds(window, now, 20)
    per_rtt = (window.cwnd - start) / 20
    assert per_rtt == pytest.approx(FRIENDLY_ALPHA, rel=0.15)


def test_on_long_fat_paths_the_cubic_curve_returns_to_w_max_after_k():
    # 1000 segments at 100 ms: K = cbrt(W_max (1 - beta) / C), about 9.1 s.
    window, now = after_a_loss(1000.0, rtt_s=0.1)
    k = (1000 * (1 - BETA) / CUBIC_C) ** (1 / 3)
    rounds = round(k / 0.1)
    ack_rounds(window, now, rounds)
    assert window.cwnd == pytest.approx(1000, rel=0.05)
    # Reno's pace would have added only alpha per round trip.
    assert window.cwnd > 700 + FRIENDLY_ALPHA * rounds * 1.5


def test_fast_convergence_lowers_w_max_after_a_loss_below_it():
    window, now = after_a_loss(100.0)
    assert window.w_max == 100
    window.on_loss(sent_at=now)
    window.segments(now + RTT)
    assert window.w_max == pytest.approx(70 * (1 + BETA) / 2)


def test_a_timeout_restarts_slow_start_from_one_segment():
    window = CubicWindow(rtt_s=RTT)
    window.cwnd = 2.5
    window.on_timeout(1.0)
    assert window.cwnd == 1
    assert window.ssthresh == 2  # the floor: 0.7 x 2.5 would be less
    window.on_ack(1, 1.3)
    assert window.cwnd == 2


def test_the_window_never_exceeds_its_limit():
    window = CubicWindow(rtt_s=RTT, limit_segments=15)
    window.on_ack(100, 0.05)
    assert window.cwnd == 15


def test_steady_state_under_periodic_loss_matches_cubic_theory():
    # One loss every N segments: the window saws between beta W and W. With
    # growth alpha per RTT, one round trip at W to detect the loss and one at
    # beta W of recovery without growth,
    # N = W^2 (1 - beta^2) / (2 alpha) + (1 + beta) W: for N = 1000, W is
    # about 48 segments. A model that forgot beta, alpha or the recovery
    # would land far from it.
    window = CubicWindow(rtt_s=RTT)
    window.cwnd = 30.0
    window.ssthresh = 30.0
    now, sent, peaks = 0.0, 0.0, []
    for _ in range(4000):
        flight = math.floor(window.segments(now))
        before = sent
        sent += flight
        if int(sent // 1000) > int(before // 1000):
            peaks.append(window.cwnd)
            window.on_loss(sent_at=now)
        now += RTT
        window.on_ack(flight, now)
    w = sum(peaks[5:]) / len(peaks[5:])
    a, b = (1 - BETA**2) / (2 * FRIENDLY_ALPHA), 1 + BETA
    theory = (-b + math.sqrt(b * b + 4 * a * 1000)) / (2 * a)
    assert w == pytest.approx(theory, rel=0.1)
