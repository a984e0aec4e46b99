"""Defaults that depend on the strategy: what a job file leaves unset follows it."""

from __future__ import annotations

from pathlib import Path

import pytest

from isthmus.deploy.launch.run_dir import resolve_job
from isthmus.job.settings import SettingError, TrainSettings


@pytest.mark.parametrize("strategy", ["diloco", "streaming", "async"])
def test_the_diloco_family_averages_ternary_pseudo_gradients_with_error_feedback(strategy):
    settings = TrainSettings(strategy=strategy)
    assert settings.codec == "int2+zstd" and settings.error_feedback is True
    # Plain averaging: the outer step moves the global model to the sites' average.
    assert settings.outer_lr == 1.0 and settings.outer_momentum == 0.0


def test_sync_sends_its_gradients_uncompressed():
    settings = TrainSettings(strategy="sync")
    assert settings.codec == "none" and settings.error_feedback is False


def test_given_settings_win_over_the_strategys_defaults():
    assert TrainSettings(strategy="diloco", codec="none").error_feedback is False
    assert TrainSettings(strategy="diloco", codec="int8").error_feedback is True
    assert TrainSettings(strategy="sync", codec="int8").error_feedback is False
    kept = TrainSettings(strategy="diloco", codec="int4", error_feedback=False)
    assert kept.codec == "int4" and kept.error_feedback is False
    # The sparse codec still needs its error feedback, said with the field.
    with pytest.raises(SettingError) as refused:
        TrainSettings(strategy="diloco", codec="topk", error_feedback=False)
    assert refused.value.field == "error_feedback"


def job(tmp_path: Path, train: str) -> Path:
    path = tmp_path / f"job-{len(list(tmp_path.glob('job-*.yaml')))}.yaml"
    path.write_text(
        "name: defaults\nsites: [{name: a}, {name: b}]\n"
        f"wan: {{default: {{rtt_ms: 20, bandwidth_mbit: 100}}}}\ntrain: {train}\n"
    )
    return path


def test_a_strategy_from_the_command_line_brings_its_own_defaults(tmp_path):
    """--strategy and --compare change the strategy of a resolved job: what the job
    file left unset follows the new strategy, what it set stays."""
    diloco_job = job(tmp_path, "{strategy: diloco}")
    resolved, raw = resolve_job(diloco_job, strategy="sync")
    assert resolved.train.codec == "none" and resolved.train.error_feedback is False
    assert raw["train"]["codec"] == "none"  # the run directory's job.yaml, filled in
    resolved, _ = resolve_job(diloco_job)
    assert resolved.train.codec == "int2+zstd" and resolved.train.error_feedback is True
    sync_job = job(tmp_path, "{strategy: sync}")
    resolved, _ = resolve_job(sync_job, strategy="async")
    assert resolved.train.codec == "int2+zstd" and resolved.train.error_feedback is True
    given = job(tmp_path, "{strategy: diloco, codec: int8, error_feedback: false}")
    resolved, _ = resolve_job(given, strategy="streaming")
    assert resolved.train.codec == "int8" and resolved.train.error_feedback is False
    # A null written out (as docs/job-file.md shows the defaults) is unset too.
    nulls = job(tmp_path, "{strategy: diloco, codec: null, error_feedback: null}")
    resolved, _ = resolve_job(nulls, strategy="sync")
    assert resolved.train.codec == "none" and resolved.train.error_feedback is False


def test_a_trials_codec_brings_the_error_feedback_the_job_file_would_get(tmp_path):
    """isthmus tune's trials change the codec of a resolved job: error feedback, left
    unset in the job file, follows the trial's codec, as the job file that tune
    --apply writes would get it."""
    plain = job(tmp_path, "{strategy: diloco, codec: none}")
    resolved, _ = resolve_job(plain, train={"codec": "int8"})
    assert resolved.train.codec == "int8" and resolved.train.error_feedback is True
    kept = job(tmp_path, "{strategy: diloco, codec: none, error_feedback: false}")
    resolved, _ = resolve_job(kept, train={"codec": "int8"})
    assert resolved.train.error_feedback is False


def test_the_sparse_codec_gets_its_error_feedback_under_every_strategy():
    for strategy in ("sync", "diloco", "streaming", "async"):
        assert TrainSettings(strategy=strategy, codec="topk").error_feedback is True
