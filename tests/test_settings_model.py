"""One model of the training settings, read by both front doors: the job file's
``train:`` section and the strategy classes' keyword arguments."""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from isthmus.inter.strategies import AsyncDiLoCo, DiLoCo, StreamingDiLoCo, Sync
from isthmus.job.file import JobFileError, parse_job
from isthmus.job.setting_checks import SettingError
from isthmus.job.settings import (
    GROUPS,
    SETTING_NAMES,
    STRATEGIES,
    TrainSettings,
    strategy_keys,
)

ROOT = Path(__file__).resolve().parents[1]
CLASSES = {"sync": Sync, "diloco": DiLoCo, "streaming": StreamingDiLoCo, "async": AsyncDiLoCo}
NOT_SETTINGS = {"self", "site", "model", "inner_optimizer", "optimizer", "settings",
                "tokens_per_step", "bucket_mb", "overlap", "stage_group"}  # fmt: skip
"""Constructor arguments that are not job settings: the objects, and what only the
API has (how a script counts its tokens; how Sync buckets and overlaps)."""


class _Blocks(torch.nn.Module):
    """A model with numbered blocks (streaming checks its fragments against them)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(4))


def _build(strategy: str, **settings):
    return _build_on(None, strategy, **settings)


def _build_on(site, strategy: str, **settings):
    model = _Blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return CLASSES[strategy](site, model, optimizer, **settings)  # type: ignore[arg-type]


def test_each_field_lives_in_exactly_one_group():
    names = [f.name for group in GROUPS for f in dataclasses.fields(group)]
    assert len(names) == len(set(names))
    assert set(SETTING_NAMES) == {*names, "strategy"}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_classes_take_their_settings_from_the_model_and_nothing_else(strategy):
    """No class writes a default of a setting: its signature has only what is not a
    setting, and the settings it takes are its groups' (with the job file's defaults,
    read when it is built)."""
    params = inspect.signature(CLASSES[strategy].__init__).parameters
    own = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert own <= NOT_SETTINGS, own - NOT_SETTINGS
    doc = CLASSES[strategy].__doc__ or ""
    defaults = TrainSettings(strategy=strategy)
    for name in strategy_keys(strategy):
        assert f"{name}={getattr(defaults, name)!r}" in doc


def _job_text(train: dict) -> str:
    return yaml.safe_dump({"name": "j", "sites": [{"name": "a"}, {"name": "b"}], "train": train})


class _Recorder(Exception):
    """Raised where the class would start talking to the site: the settings are read."""


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_api_default_equals_the_job_files(strategy, monkeypatch):
    """What a class built with no settings uses, field by field, against what a job
    file with only ``strategy:`` gives."""
    import isthmus.inter.strategies.base as base

    seen = {}
    configure = base.configure

    def spy(name, given, site):
        settings, _ = configure(name, given, site)
        seen["settings"] = settings
        raise _Recorder

    for module in ("diloco", "streaming", "async_diloco", "sync"):
        monkeypatch.setattr(f"isthmus.inter.strategies.{module}.configure", spy)
    with pytest.raises(_Recorder):
        _build(strategy)
    job = parse_job(_job_text({"strategy": strategy}))
    for name in strategy_keys(strategy):
        assert getattr(seen["settings"], name) == getattr(job.train, name), name


def _documented_defaults() -> dict[str, object]:
    text = (ROOT / "docs" / "job-file.md").read_text()
    block = re.search(r"\ntrain: .*?\n((?:  .*\n)+)", text)
    assert block, "docs/job-file.md has no train: block"
    section = yaml.safe_load(textwrap.dedent(block.group(1)))
    return section


def test_docs_job_file_lists_every_setting_with_its_default():
    documented = _documented_defaults()
    assert set(documented) == set(SETTING_NAMES), set(documented) ^ set(SETTING_NAMES)
    for field in dataclasses.fields(TrainSettings):
        assert documented[field.name] == field.default, field.name


BAD = [
    ("sync", "grad_clip", -1.0),
    ("sync", "error_feedback", "yes"),
    ("diloco", "sync_every", 0),
    ("diloco", "outer_lr", -0.5),
    ("diloco", "outer_momentum", 1.0),
    ("diloco", "outer_state", "gpu"),
    ("diloco", "round_seconds", 0),
    ("diloco", "codec", "int3"),
    ("diloco", "rejoin_timeout_s", 100),
    ("async", "late_contributions", "late"),
    ("async", "staleness_weight", 0),
    ("streaming", "fragments", 0),
    ("streaming", "overlap_steps", True),
    ("streaming", "alpha", 1.5),
    ("streaming", "merge", "blend"),
    ("streaming", "fragments", 60),  # more than sync_every (50): checked by isthmus check too
    ("streaming", "overlap_steps", 26),  # past the 25 steps between the 2 fragments' exchanges
]


@pytest.mark.parametrize(("strategy", "name", "value"), BAD)
def test_a_bad_value_gets_the_same_message_through_both_front_doors(strategy, name, value):
    with pytest.raises(JobFileError) as from_file:
        parse_job(_job_text({"strategy": strategy, name: value}))
    with pytest.raises(SettingError) as from_api:
        _build(strategy, **{name: value})
    assert from_api.value.field == name
    assert f"train.{name}: {from_api.value.reason}" in str(from_file.value)


def test_a_setting_a_class_does_not_take_is_refused_naming_those_it_does():
    with pytest.raises(SettingError) as other:
        _build("diloco", fragments=3)
    assert other.value.field == "fragments"
    assert "the diloco class takes codec" in str(other.value)
    with pytest.raises(SettingError) as loop:
        _build("diloco", inner_lr=0.1)
    assert "a setting of the loop, not of the diloco class" in str(loop.value)
    with pytest.raises(SettingError) as typo:
        _build("sync", sync_evry=3)
    assert "not a setting" in str(typo.value)


def test_the_rules_between_fields_see_the_sites_job():
    """A class's ``rejoin_timeout_s`` is checked against the job's round deadline (the
    loop's setting), not the default's: a job with short deadlines takes a short
    rejoin timeout."""
    from types import SimpleNamespace

    from isthmus.inter.strategies.base import configure

    job = SimpleNamespace(train=TrainSettings(round_deadline_s=5, collective_timeout_s=2))
    settings, _ = configure("diloco", {"rejoin_timeout_s": 10}, SimpleNamespace(job=job))
    assert (settings.rejoin_timeout_s, settings.round_deadline_s) == (10, 5)
    with pytest.raises(SettingError, match="longer than round_deadline_s"):
        _build("diloco", rejoin_timeout_s=10)  # no job: the default deadline, 120 s
