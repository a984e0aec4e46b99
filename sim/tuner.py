"""The sync-frequency tuner's reasoning: which H, codec and fragments to try, and why.

Smaller H converges better per token (DiLoCo's results, and ours); larger H and
smaller codecs hide the exchange behind more compute. The tuner therefore
looks, with the performance model, for the *smallest* H whose predicted
compute utilisation reaches the target, preferring the most precise codec
that gets there; ``isthmus tune`` then confirms that choice and its
neighbours with short emulated trials. The online controller applies the same
rule to what a running job measures. Pure functions of plain numbers, like the
model itself.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from isthmus.job.basics import CODECS
from isthmus.job.tune import LIVE_SYNC_EVERY, TUNE_KEYS, TuneError, TuneSettings
from isthmus.sim.perf_model import (
    Prediction,
    Scenario,
    ScenarioError,
    predict_run,
)

SYNC_EVERY_LADDER = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
"""H values the sweep considers (1-2-5 steps), plus the configured bounds."""
FRAGMENT_CHOICES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Candidate:
    """One setting the tuner considered, with the model's prediction for it."""

    sync_every: int
    codec: str
    fragments: int
    prediction: Prediction

    @property
    def label(self) -> str:
        frag = f" P={self.fragments}" if self.prediction.strategy == "streaming" else ""
        return f"H={self.sync_every} {self.codec}{frag}"

    def settings(self) -> dict[str, int | str]:
        """The ``train:`` keys this candidate sets."""
        keys: dict[str, int | str] = {"codec": self.codec}
        if self.prediction.strategy != "sync":
            keys["sync_every"] = self.sync_every
        if self.prediction.strategy == "streaming":
            keys["fragments"] = self.fragments
        return keys


def sync_every_values(low: int, high: int) -> list[int]:
    """The ladder's H values within [low, high], and the bounds themselves."""
    return sorted({low, high, *(h for h in SYNC_EVERY_LADDER if low <= h <= high)})


def sweep(scenario: Scenario, tune: TuneSettings) -> list[Candidate]:
    """Every (H, codec, fragments) the tuner may choose, each with its prediction."""
    strategy = scenario.strategy
    values = (
        [1] if strategy == "sync" else sync_every_values(tune.min_sync_every, tune.max_sync_every)
    )
    candidates = []
    for h in values:
        # Streaming: each fragment's exchange must end before the next starts.
        fragment_choices = (
            [f for f in FRAGMENT_CHOICES if f <= h and scenario.overlap_steps < h / f]
            if strategy == "streaming"
            else [1]
        )
        for codec in tune.codecs:
            for fragments in fragment_choices:
                changed = dataclasses.replace(
                    scenario,
                    sync_every=h,
                    codec=codec,
                    fragments=fragments if strategy == "streaming" else 1,
                )
                candidates.append(Candidate(h, codec, fragments, predict_run(changed)))
    return candidates


def _precision(codec: str) -> int:
    return CODECS.index(codec)  # most precise first


def model_pick(candidates: Sequence[Candidate], target: float) -> tuple[Candidate, bool]:
    """The smallest H that reaches ``target`` per the model, with the most precise codec
    (and for streaming the fragments hiding most); else, if nothing reaches it, the
    candidate with the highest utilisation. Returns it and whether it reaches the target."""
    if not candidates:
        raise ScenarioError("sync_every", "no candidate settings to choose from")
    reaching = [c for c in candidates if c.prediction.utilization >= target]
    if reaching:
        best = min(
            reaching,
            key=lambda c: (c.sync_every, _precision(c.codec), -c.prediction.utilization),
        )
        return best, True
    best = max(
        candidates,
        key=lambda c: (c.prediction.utilization, -c.sync_every, -_precision(c.codec)),
    )
    return best, False


def neighbours(pick: Candidate, candidates: Sequence[Candidate], limit: int = 4) -> list[Candidate]:
    """What the trials confirm: the pick, the next smaller and larger H with its codec
    (and fragments), and the next more precise codec at its H; the pick first."""
    same = sorted(
        {c.sync_every for c in candidates if (c.codec, c.fragments) == (pick.codec, pick.fragments)}
    )
    index = same.index(pick.sync_every)
    wanted: list[tuple[int, str, int]] = []
    if index > 0:
        wanted.append((same[index - 1], pick.codec, pick.fragments))
    if index + 1 < len(same):
        wanted.append((same[index + 1], pick.codec, pick.fragments))
    finer = sorted(
        {c.codec for c in candidates if _precision(c.codec) < _precision(pick.codec)},
        key=_precision,
    )
    if finer:
        wanted.append((pick.sync_every, finer[-1], pick.fragments))
    by_key = {(c.sync_every, c.codec, c.fragments): c for c in candidates}
    chosen = [pick] + [by_key[k] for k in wanted if k in by_key]
    return chosen[:limit]


def trial_choice(trials: Sequence[tuple[Candidate, float]], target: float) -> Candidate:
    """After the trials: the smallest H whose *measured* utilisation reached the target
    (the most precise codec among equals); if none did, the highest measured."""
    if not trials:
        raise ValueError("no trials to choose from")
    reaching = [c for c, measured in trials if measured >= target]
    if reaching:
        return min(reaching, key=lambda c: (c.sync_every, _precision(c.codec), -c.fragments))
    return max(trials, key=lambda t: t[1])[0]


def sync_every_for(
    strategy: str,
    *,
    sync_every: int,
    step_s: float,
    exposed_s: float,
    target: float,
    low: int,
    high: int,
) -> int:
    """The smallest H within [low, high] that reaches ``target`` given what one round
    measured: ``step_s`` compute per inner step and ``exposed_s`` per round that the
    compute waited for the exchange.

    DiLoCo's exchange X does not depend on H, so round = H t + X and
    H = ceil(target X / ((1 - target) t)). Async hides X behind the next H t: only the
    part beyond it shows (X = exposed + H t), utilisation is H t / X, and
    H = ceil(target X / t); with nothing exposed X is only known to fit, so H stays.
    """
    if strategy not in LIVE_SYNC_EVERY:
        raise ValueError(f"{strategy} cannot change sync_every while it runs")
    if not (step_s > 0):
        return sync_every
    if strategy == "diloco":
        wanted = target * exposed_s / ((1 - target) * step_s)
    else:
        if exposed_s <= 0.02 * sync_every * step_s:
            return min(max(sync_every, low), high)
        wanted = target * (exposed_s + sync_every * step_s) / step_s
    return int(min(max(math.ceil(wanted - 1e-9), low), high))


__all__ = [
    "LIVE_SYNC_EVERY",
    "SYNC_EVERY_LADDER",
    "TUNE_KEYS",
    "Candidate",
    "TuneError",
    "TuneSettings",
    "model_pick",
    "neighbours",
    "sweep",
    "sync_every_for",
    "sync_every_values",
    "trial_choice",
]
