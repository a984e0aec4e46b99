"""The sync-frequency tuner: its reasoning by hand, ``--apply``'s edit, ``isthmus tune`` on
fake-fast and fake-slow emulated links, and the online H controller in a real run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import in_process

from isthmus.job.file import JobFileError, load_job, parse_job
from isthmus.job.file.edit import JobEditError, edit_train_keys, set_train_keys
from isthmus.sim.perf_model import Scenario, predict_run, uniform_links
from isthmus.sim.tuner import (
    TuneError,
    TuneSettings,
    model_pick,
    neighbours,
    sweep,
    sync_every_for,
    sync_every_values,
    trial_choice,
)

SITES = ["a", "b"]


def scenario(bandwidth_mbit: float, **changes) -> Scenario:
    # 1e6 parameters: 4 MB in float32; 80 Mbit/s moves it in 0.4 s per direction.
    base = {
        "params": 1e6,
        "step_s": 0.1,
        "tokens_per_step": 1000.0,
        "sites": SITES,
        "links": uniform_links(SITES, bandwidth_mbit=bandwidth_mbit, rtt_ms=20),
        "strategy": "diloco",
    }
    return Scenario(**{**base, **changes})


def isthmus(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "isthmus", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- the reasoning -----------------------------------------------------------------------
def test_the_ladder_keeps_the_bounds():
    assert sync_every_values(5, 500) == [5, 10, 20, 50, 100, 200, 500]
    assert sync_every_values(3, 30) == [3, 5, 10, 20, 30]


def test_the_model_picks_the_smallest_h_that_reaches_the_target():
    tune = TuneSettings(target_utilization=0.9, codecs=("none", "int8"), min_sync_every=5)
    candidates = sweep(scenario(80), tune)
    pick, reaches = model_pick(candidates, 0.9)
    assert reaches
    # Everything with a smaller H, or the same H and a more precise codec, misses.
    for c in candidates:
        if (c.sync_every, c.codec) < (pick.sync_every, pick.codec) or (
            c.sync_every < pick.sync_every
        ):
            assert c.prediction.utilization < 0.9, c.label
    assert pick.prediction.utilization >= 0.9
    # The same H with a finer codec misses the target (else the tuner would take it).
    finer = [c for c in candidates if c.sync_every == pick.sync_every and c.codec == "none"]
    assert pick.codec == "none" or finer[0].prediction.utilization < 0.9


def test_a_faster_link_gives_a_smaller_h_and_a_finer_codec():
    tune = TuneSettings(target_utilization=0.9, min_sync_every=1)
    fast, _ = model_pick(sweep(scenario(10_000), tune), 0.9)
    slow, _ = model_pick(sweep(scenario(20), tune), 0.9)
    assert (fast.sync_every, fast.codec) == (1, "none") or fast.sync_every < slow.sync_every
    assert fast.sync_every < slow.sync_every


def test_when_nothing_reaches_the_target_the_best_is_named():
    tune = TuneSettings(target_utilization=0.99, codecs=("none",), max_sync_every=10)
    pick, reaches = model_pick(sweep(scenario(1), tune), 0.99)
    assert not reaches
    assert (pick.sync_every, pick.codec) == (10, "none")


def test_neighbours_are_the_next_h_each_way_and_a_finer_codec():
    tune = TuneSettings(codecs=("none", "int8", "int4"), min_sync_every=5, max_sync_every=200)
    candidates = sweep(scenario(20), tune)
    pick = next(c for c in candidates if (c.sync_every, c.codec) == (50, "int8"))
    labels = [c.label for c in neighbours(pick, candidates)]
    assert labels == ["H=50 int8", "H=20 int8", "H=100 int8", "H=50 none"]


def test_streaming_sweeps_fragments_too():
    tune = TuneSettings(codecs=("int4",), min_sync_every=10, max_sync_every=100)
    candidates = sweep(scenario(20, strategy="streaming", overlap_steps=1), tune)
    assert {c.fragments for c in candidates} == {1, 2, 4, 8}
    assert all(c.fragments <= c.sync_every for c in candidates)
    pick, _ = model_pick(candidates, 0.9)
    assert pick.settings()["fragments"] == pick.fragments
    # Only settings Streaming accepts: a fragment's exchange ends before the next.
    overlapping = sweep(scenario(20, strategy="streaming", overlap_steps=3), tune)
    assert all(c.sync_every / c.fragments > 3 for c in overlapping)
    assert {(c.sync_every, c.fragments) for c in overlapping} >= {(10, 2), (100, 8)}


def test_the_trials_choose_the_smallest_h_whose_measured_utilisation_reached_it():
    tune = TuneSettings(codecs=("none", "int8"))
    by_label = {c.label: c for c in sweep(scenario(20), tune)}
    trials = [
        (by_label["H=50 int8"], 0.86),
        (by_label["H=20 int8"], 0.79),
        (by_label["H=100 int8"], 0.93),
        (by_label["H=50 none"], 0.84),
    ]
    assert trial_choice(trials, 0.85).label == "H=50 int8"
    assert trial_choice(trials, 0.9).label == "H=100 int8"
    assert trial_choice(trials, 0.95).label == "H=100 int8"  # none did: the highest


def test_online_h_by_hand():
    # DiLoCo: round = H t + X; 90% needs H t >= 9 X: t = 0.1, X = 1 -> H = 90.
    assert (
        sync_every_for(
            "diloco", sync_every=5, step_s=0.1, exposed_s=1.0, target=0.9, low=1, high=500
        )
        == 90
    )
    assert (
        sync_every_for(
            "diloco", sync_every=5, step_s=0.1, exposed_s=1.0, target=0.9, low=1, high=50
        )
        == 50
    )
    # Async: exposed 0.5 at H=5 -> X = 0.5 + 0.5 = 1.0; H t / X >= 0.9 -> H = 9.
    assert (
        sync_every_for(
            "async", sync_every=5, step_s=0.1, exposed_s=0.5, target=0.9, low=1, high=500
        )
        == 9
    )
    # Async with nothing exposed: the exchange fits; H stays.
    assert (
        sync_every_for(
            "async", sync_every=20, step_s=0.1, exposed_s=0.0, target=0.9, low=1, high=500
        )
        == 20
    )
    with pytest.raises(ValueError, match="sync cannot change"):
        sync_every_for("sync", sync_every=1, step_s=0.1, exposed_s=0, target=0.9, low=1, high=2)


def test_the_prediction_at_the_online_h_matches_the_performance_model():
    s = scenario(80, sync_every=5)
    p = predict_run(s)
    h = sync_every_for(
        "diloco",
        sync_every=5,
        step_s=s.step_s,
        exposed_s=p.exposed_s,
        target=0.9,
        low=1,
        high=5000,
    )
    at_h = predict_run(scenario(80, sync_every=h))
    below = predict_run(scenario(80, sync_every=h - 1))
    assert at_h.utilization >= 0.9 > below.utilization


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tune: {target_utilization: 1.5}", "tune.target_utilization: must be a fraction"),
        ("tune: {codecs: [gzip]}", "tune.codecs: list some of"),
        ("tune: {min_sync_every: 50, max_sync_every: 10}", "tune.min_sync_every: 50 is above"),
        ("tune: {sync_evry: 5}", "tune.sync_evry: unknown key"),
        ("train: {strategy: sync}\ntune: {online: true}", "tune.online: the sync strategy fixes"),
        ("tune: {online: yes please}", "tune.online: must be true or false"),
    ],
)
def test_bad_tune_sections_are_named(text, message):
    with pytest.raises(JobFileError) as caught:
        parse_job(f"name: j\nsites: [{{name: a}}, {{name: b}}]\n{text}\n")
    assert message in "\n".join(caught.value.lines())


def test_tune_settings_refuse_nonsense():
    with pytest.raises(TuneError, match="price_per_gb"):
        TuneSettings(price_per_gb=-1)


# -- --apply's edit ------------------------------------------------------------------------
BLOCK_JOB = """\
# The team's job: keep this comment.
name: j
sites:
  - {name: a}
  - {name: b}
train:
  strategy: diloco   # chosen after a long argument
  sync_every: 50     # tuned 2026-11
tune: {codecs: [none, int8]}
"""


def test_apply_changes_only_the_values_in_block_style():
    text = edit_train_keys(BLOCK_JOB, {"sync_every": 100, "codec": "int8"})
    assert text.splitlines()[0] == "# The team's job: keep this comment."
    assert "  sync_every: 100     # tuned 2026-11\n" in text
    assert "  strategy: diloco   # chosen after a long argument\n" in text
    assert "  codec: int8\n" in text
    assert parse_job(text).train.sync_every == 100
    # Nothing else moved: the same lines but the edited and the added one.
    before, after = BLOCK_JOB.splitlines(), text.splitlines()
    assert [x for x in after if x not in before] == [
        "  sync_every: 100     # tuned 2026-11",
        "  codec: int8",
    ]


def test_apply_in_flow_style_and_without_a_train_section():
    flow = "name: j  # x\nsites: [{name: a}, {name: b}]\ntrain: {steps: 9,  # c\n  sync_every: 5}  # d\n"
    text = edit_train_keys(flow, {"sync_every": 20, "fragments": 2})
    assert text == (
        "name: j  # x\nsites: [{name: a}, {name: b}]\n"
        "train: {steps: 9,  # c\n  sync_every: 20, fragments: 2}  # d\n"
    )
    bare = "name: j\nsites: [{name: a}, {name: b}]"
    assert parse_job(edit_train_keys(bare, {"sync_every": 20})).train.sync_every == 20


def test_apply_round_trip_on_every_example_keeps_the_file_valid(tmp_path):
    for example in sorted(Path("deploy/examples").glob("*.yaml")):
        copy = tmp_path / example.name
        copy.write_text(example.read_text())
        set_train_keys(copy, {"sync_every": 20, "codec": "int8"})
        job = load_job(copy)
        assert (job.train.sync_every, job.train.codec) == (20, "int8")
        # Only the train line(s) differ.
        changed = set(copy.read_text().splitlines()) ^ set(example.read_text().splitlines())
        assert all("sync_every" in line or "codec" in line for line in changed), changed


def test_an_edit_that_would_break_the_job_leaves_the_file_unchanged(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(BLOCK_JOB)
    with pytest.raises(JobFileError):
        set_train_keys(job, {"codec": "gzip"})
    assert job.read_text() == BLOCK_JOB
    with pytest.raises(JobEditError):
        edit_train_keys("name: j\nsites: [{name: a}]\ntrain: [1, 2]\n", {"sync_every": 5})


# -- the command -----------------------------------------------------------------------------
SLOW_LINK_JOB = """\
# The tuner's test bed: two sites on a slow link.
name: tune-LABEL
sites: [{name: a}, {name: b}]
wan: {default: {rtt_ms: RTT, bandwidth_mbit: MBIT}}
train: {strategy: diloco, steps: 200, sync_every: 5, warmup_steps: 2, eval_every: 0}   # to be tuned
tune: {target_utilization: 0.8, codecs: [none, int8], min_sync_every: 5, max_sync_every: 100}
"""


def link_job(tmp_path: Path, label: str, mbit: float, rtt_ms: float) -> Path:
    job = tmp_path / f"{label}.yaml"
    text = SLOW_LINK_JOB.replace("LABEL", label).replace("MBIT", str(mbit))
    job.write_text(text.replace("RTT", str(rtt_ms)))
    return job


def test_model_only_tune_with_apply(tmp_path, capsys, monkeypatch):
    job = link_job(tmp_path, "slow", 20, 80)
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = in_process(
        capsys, "tune", str(job), "--budget-minutes", "0", "--step-ms", "70", "--json",
        "--apply", "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert code == 0, stderr
    result = json.loads(stdout)
    choice = result["choice"]["settings"]
    assert result["choice"] == {
        "label": result["model_pick"]["label"],
        "settings": result["model_pick"]["settings"],
    }
    written = load_job(job).train
    assert (written.sync_every, written.codec) == (choice["sync_every"], choice["codec"])
    assert "# to be tuned" in job.read_text()
    for name in ("tune.json", "tune.md", "tune.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert result["rows"][0]["egress_cost"] > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--budget-minutes", "-1"], "--budget-minutes: must be >= 0"),
        (["--target-utilization", "2"], "--target-utilization: must be a fraction"),
        (["--step-ms", "0"], "--step-ms: must be > 0"),
        (["--trial-steps", "0"], "--trial-steps: must be >= 1"),
        (["--budget-minutes", "0.1", "--step-ms", "70"], "--budget-minutes: too small"),
    ],
)
def test_tune_refuses_bad_flags_naming_them(tmp_path, capsys, monkeypatch, flags, message):
    job = link_job(tmp_path, "slow", 20, 80)
    monkeypatch.chdir(tmp_path)
    # In this process: a traceback would be an exception raised here.
    code, _, stderr = in_process(capsys, "tune", str(job), *flags, "--out", str(tmp_path / "out"))
    assert code == 2
    assert message in stderr
    assert "Traceback" not in stderr


@pytest.mark.slow
def test_the_tuner_on_a_fast_and_a_slow_emulated_link(tmp_path):
    """Real trials through the emulator: a fast link keeps exact values and a small H;
    a slow one needs a larger H to reach the target."""
    choices = {}
    for label, mbit, rtt in (("fast", 1000, 2), ("slow", 5, 100)):
        job = link_job(tmp_path, label, mbit, rtt)
        done = isthmus(
            "tune", str(job), "--budget-minutes", "4", "--step-ms", "70", "--trial-steps", "40",
            "--json", "--out", str(tmp_path / label), cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout)
        trials = [r for r in result["rows"] if r.get("status") == "finished"]
        assert trials and all(0 < r["measured_utilization"] <= 1 for r in trials)
        assert all(Path(r["run_dir"], "summary.json").is_file() for r in trials)
        # The trials forked their ranks from one warm template, not one each.
        assert (tmp_path / label / "trials" / "template.log").exists()
        assert not list((tmp_path / label / "trials").glob("*/logs/template.log"))
        choices[label] = result["choice"]["settings"]
    fast, slow = choices["fast"], choices["slow"]
    assert fast["codec"] == "none", choices
    assert slow["sync_every"] > fast["sync_every"], choices


@pytest.mark.slow
def test_the_online_controller_moves_h_and_every_site_switches_at_the_same_round(tmp_path):
    job = link_job(tmp_path, "online", 20, 80)
    text = job.read_text().replace("max_sync_every: 100}", "max_sync_every: 100, online: true}")
    job.write_text(text)
    out = tmp_path / "run"
    done = isthmus("run", str(job), "--out", str(out), "--no-report", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    changes = summary["sync_every_changes"]
    assert changes and changes[0]["sync_every_from"] == 5
    assert 5 < changes[0]["sync_every_to"] <= 100
    change = changes[0]
    # The target, or as near as tune.max_sync_every allows (a fast machine's short
    # steps need an H above 100 for 80%: 33 ms steps and 0.95 s exposed, 78% at 100).
    assert change["measured_utilization"] < 0.8
    assert change["predicted_utilization"] >= 0.8 or (
        change["sync_every_to"] == 100
        and change["predicted_utilization"] > change["measured_utilization"]
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    applied = {(r["site"], r["round"]) for r in records if r["kind"] == "config"}
    first = changes[0]["from_round"]
    assert {("a", first), ("b", first)} <= applied
    assert len({s["param_sha256"] for s in summary["sites"].values()}) == 1
    # The rounds after the change ran with the new H.
    rounds = [r for r in records if r["kind"] == "round" and r["site"] == "a"]
    assert len(rounds) < 200 / 5


def test_the_online_controller_decides_from_rounds_at_the_current_h_only():
    """The controller's bookkeeping, fed metrics as the control plane delivers them
    (the end-to-end run above uses a real broker)."""
    from isthmus.deploy.launch.online_tuner import OnlineTuner
    from isthmus.inter.control_plane import Broker

    job = parse_job(
        "name: j\nsites: [{name: a}, {name: b}]\n"
        "train: {strategy: diloco, sync_every: 5}\n"
        "tune: {online: true, target_utilization: 0.8, online_every_rounds: 2}\n"
    )
    tuner = OnlineTuner(Broker.from_url("mqtt://127.0.0.1:1"), job)
    published = []
    tuner.plane.publish_config = lambda settings, from_round: (
        published.append((settings, from_round)) or len(published)
    )

    def report(round_: int, h: int, blocked_s: float = 1.0) -> None:
        for site in ("a", "b"):
            tuner.plane.metrics[site] = {
                "round": round_, "step": 5 * round_, "sync_every": h, "round_steps": h,
                "compute_s": 0.07 * h, "blocked_s": blocked_s, "wan_bytes_sent": 1e6 * round_,
            }  # fmt: skip
            tuner.poll()

    report(1, 5)  # the first round starts cold: ignored
    report(2, 5)
    assert published == []  # one round at H=5 so far
    report(3, 5)
    # 0.8 of the time computing needs H t >= 4 X: H = ceil(4 * 1.0 / 0.07) = 58.
    assert published == [({"sync_every": 58}, 5)]
    decision = tuner.decisions[0]
    assert decision.sync_every_from == 5 and decision.sync_every_to == 58
    assert decision.measured_utilization == pytest.approx(0.35 / 1.35)
    report(4, 5)  # still the old H until round 5: neither a decision nor a revert
    assert tuner.sync_every == 58 and len(published) == 1
    report(5, 58, blocked_s=1.0)
    report(6, 58, blocked_s=1.0)
    assert len(published) == 1  # 58 reaches the target: no change
    # An operator sets H=20 with `isthmus config set`: the controller follows it.
    report(7, 20, blocked_s=1.0)
    assert tuner.sync_every == 20
