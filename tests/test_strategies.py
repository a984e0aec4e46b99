"""The sync strategies across real sites (separate processes, real gRPC).

DiLoCo across two sites must equal an independent single-process implementation
of the paper's algorithm, and leave both sites with bitwise-identical parameters.
"""

from __future__ import annotations

import json

import pytest
import torch
from example_sites import loopback_job, run_sites

from isthmus.intra.data import Dataset, ShardSpec, stdlib_corpus
from isthmus.intra.model import GPT, config_for, lm_loss

STEPS, H, BATCH, CORPUS, SEED = 9, 3, 8, 300_000, 0
# Inner SGD, not AdamW: AdamW turns the float32 noise of parameters whose true
# gradient is zero (attention's key bias: softmax ignores it) into full-size
# steps, so two correct implementations that sum in another order part ways
# there. The outer algorithm, what this tests, is the same for any inner one.
OUTER_LR, OUTER_MOMENTUM, INNER_LR = 0.7, 0.9, 0.05


def _reference_workers(workers: int):
    """The references' start: the global parameters and their outer momentum, and
    each worker's model (the same initial one), inner SGD and shard of the data."""
    torch.manual_seed(SEED)
    template = GPT(config_for("tiny"))
    global_params = {k: v.detach().clone() for k, v in template.named_parameters()}
    momentum = {k: torch.zeros_like(v) for k, v in global_params.items()}
    data = Dataset(stdlib_corpus(CORPUS), template.config.seq_len)
    models, optimizers, streams = [], [], []
    for w in range(workers):
        torch.manual_seed(SEED)
        model = GPT(config_for("tiny"))
        models.append(model)
        optimizers.append(torch.optim.SGD(model.parameters(), lr=INNER_LR))
        streams.append(data.batches(ShardSpec(w, (1,) * workers, 0), BATCH))
    return global_params, momentum, models, optimizers, streams


def reference_diloco(workers: int) -> dict[str, torch.Tensor]:
    """DiLoCo as the paper writes it, one process, written without Isthmus's
    strategy code: H AdamW steps per worker, average of (global - local), outer
    SGD with Nesterov momentum on the global parameters, workers reset."""
    global_params, momentum, models, optimizers, streams = _reference_workers(workers)
    for _ in range(STEPS // H):
        for model, optimizer, stream in zip(models, optimizers, streams, strict=True):
            for _ in range(H):
                x, y = next(stream)
                lm_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
        for name, g in global_params.items():
            local = [dict(m.named_parameters())[name].detach() for m in models]
            delta = sum(g - p for p in local) / workers
            momentum[name] = OUTER_MOMENTUM * momentum[name] + delta
            g -= OUTER_LR * (delta + OUTER_MOMENTUM * momentum[name])
        for model in models:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(global_params[name])
    return global_params


def _run(tmp_path, sites: list[str], extra: tuple[str, ...] = ()) -> dict[str, dict]:
    job = loopback_job(tmp_path / "job.yaml", "strategies", sites)
    args = ["--steps", str(STEPS), "--sync-every", str(H), "--batch", str(BATCH)]
    args += ["--corpus-bytes", str(CORPUS), "--seed", str(SEED), "--lr", str(INNER_LR)]
    # No clipping: the reference is the paper's algorithm as written.
    args += ["--inner", "sgd", "--grad-clip", "0", *extra]
    return run_sites(job, sites, args, tmp_path, timeout_s=240)


def test_diloco_equals_the_papers_algorithm_in_one_process(tmp_path):
    reports = _run(tmp_path, ["a", "b"])
    assert len({r["param_sha256"] for r in reports.values()}) == 1
    assert all(r["outer_steps"] == STEPS // H for r in reports.values())
    # Every byte counted: the pseudo-gradients and the seals, both ways.
    values = sum(p.numel() for p in GPT(config_for("tiny")).parameters())
    for r in reports.values():
        assert r["wan_bytes_sent"] >= STEPS // H * values * 4
    reference = reference_diloco(2)
    got = torch.load(tmp_path / "a.pt", weights_only=True)
    for name, value in reference.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "bytes_vs_float32"),
    # topk at 5%, 2-bit values: up 0.09 bytes a value, down (the union of 3 sites'
    # positions) 0.26, against float32's 4 each way: under a tenth.
    [(("--codec", "int8"), 0.3), (("--codec", "topk:density=0.05", "--error-feedback"), 0.1)],
    ids=["int8", "topk"],
)
def test_diloco_with_a_lossy_codec_stays_identical_across_sites(tmp_path, flags, bytes_vs_float32):
    reports = _run(tmp_path, ["a", "b", "c"], flags)
    assert len({r["param_sha256"] for r in reports.values()}) == 1
    values = sum(p.numel() for p in GPT(config_for("tiny")).parameters())
    float32 = STEPS // H * 2 * (2 / 3) * values * 4  # the direct algorithm, both phases
    for r in reports.values():
        assert r["wan_bytes_sent"] < bytes_vs_float32 * float32, (r["wan_bytes_sent"], float32)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"sync_every": 0}, "sync_every"),
        ({"outer_lr": -1.0}, "outer_lr"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"codec": "int3"}, "codec"),
        ({"round_seconds": 0}, "round_seconds"),
        ({"round_seconds": float("nan")}, "round_seconds"),
    ],
)
def test_bad_settings_are_refused_at_construction(kwargs, field):
    from isthmus.inter.strategies import DiLoCo
    from isthmus.job.settings import SettingError

    model = torch.nn.Linear(2, 2)
    with pytest.raises(SettingError) as info:
        DiLoCo(None, model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


@pytest.mark.parametrize(
    ("strategy", "kwargs"),
    [
        ("sync", {"error_feedback": "yes"}),
        ("diloco", {"outer_momentum": 1.0}),
        ("diloco", {"round_seconds": 0}),
        ("diloco", {"codec": "int3"}),
        ("async", {"late_contributions": "late"}),
        ("async", {"staleness_weight": 0}),
        ("streaming", {"fragments": 0}),
        ("streaming", {"alpha": 1.5}),
    ],
)
def test_a_strategy_refuses_a_setting_as_the_job_file_does(strategy, kwargs):
    """The same rule and the same message from ``isthmus.DiLoCo(...)`` as from a job
    file's ``train:`` section: one definition of each setting."""
    from isthmus.inter.strategies import AsyncDiLoCo, DiLoCo, StreamingDiLoCo, Sync
    from isthmus.job.settings import SettingError, TrainSettings

    classes = {"sync": Sync, "diloco": DiLoCo, "async": AsyncDiLoCo, "streaming": StreamingDiLoCo}
    with pytest.raises(SettingError) as from_job:
        TrainSettings(strategy=strategy, **kwargs)
    model = GPT(config_for("tiny"))
    with pytest.raises(SettingError) as from_api:
        classes[strategy](None, model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    assert str(from_api.value) == str(from_job.value)


@pytest.mark.parametrize("norm", [-1.0, float("nan"), "1"])
def test_a_bad_gradient_norm_limit_is_refused(norm):
    from isthmus.inter.strategies import Sync
    from isthmus.job.settings import SettingError

    model = torch.nn.Linear(2, 2)
    with pytest.raises(SettingError) as info:
        Sync(None, model, torch.optim.SGD(model.parameters(), lr=0.1), grad_clip=norm)  # type: ignore[arg-type]
    assert info.value.field == "grad_clip"


@pytest.mark.slow
def test_streaming_with_one_fragment_no_overlap_no_mixing_is_diloco(tmp_path):
    diloco, streaming = tmp_path / "diloco", tmp_path / "streaming"
    diloco.mkdir()
    streaming.mkdir()
    a = _run(diloco, ["a", "b"])
    flags = ("--strategy", "streaming", "--fragments", "1", "--overlap-steps", "0")
    b = _run(streaming, ["a", "b"], (*flags, "--alpha", "0"))
    assert a["a"]["param_sha256"] == b["a"]["param_sha256"] == b["b"]["param_sha256"]


def reference_eager(workers: int, overlap: int) -> dict[str, torch.Tensor]:
    """DiLoCo with its exchange overlapping ``overlap`` inner steps and the eager
    merge, one process, written without Isthmus's strategy code: at a round's end
    each worker keeps training from its own result; ``overlap`` steps later the
    average arrives, the outer step (SGD, Nesterov) moves the global parameters,
    and each worker becomes the new global parameters plus what it trained since
    the round's end."""
    global_params, momentum, models, optimizers, streams = _reference_workers(workers)
    in_flight: tuple[int, list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]] | None
    in_flight = None  # (due step, each worker's pseudo-gradient, each worker's parameters)

    def arrive(deltas: list[dict[str, torch.Tensor]], sent: list[dict[str, torch.Tensor]]):
        for name, g in global_params.items():
            delta = sum(d[name] for d in deltas) / workers
            momentum[name] = OUTER_MOMENTUM * momentum[name] + delta
            g -= OUTER_LR * (delta + OUTER_MOMENTUM * momentum[name])
        with torch.no_grad():
            for model, anchor in zip(models, sent, strict=True):
                for name, p in model.named_parameters():
                    p.sub_(anchor[name]).add_(global_params[name])

    for step in range(1, STEPS + 1):
        for model, optimizer, stream in zip(models, optimizers, streams, strict=True):
            x, y = next(stream)
            lm_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        if in_flight is not None and in_flight[0] == step:
            arrive(*in_flight[1:])
            in_flight = None
        if step % H == 0:
            params = [{k: v.detach().clone() for k, v in m.named_parameters()} for m in models]
            deltas = [{k: global_params[k] - v for k, v in p.items()} for p in params]
            in_flight = (step + overlap, deltas, params)
            if overlap == 0:
                arrive(deltas, params)
                in_flight = None
    if in_flight is not None:  # the last round's, completed at the end
        arrive(*in_flight[1:])
    return global_params


@pytest.mark.parametrize(
    "overlap", [1, pytest.param(H, marks=pytest.mark.slow)], ids=["one-step", "whole-round"]
)
def test_overlapped_diloco_with_the_eager_merge_equals_its_reference(tmp_path, overlap):
    """Streaming with one fragment is DiLoCo with its exchange overlapped; with the
    eager merge each site keeps what it trained while the average was on the
    wire. Up to a whole round of overlap (the next exchange starts as the last
    one is applied)."""
    flags = ("--strategy", "streaming", "--fragments", "1", "--overlap-steps", str(overlap))
    reports = _run(tmp_path, ["a", "b"], (*flags, "--merge", "eager"))
    assert len({r["param_sha256"] for r in reports.values()}) == 1
    assert all(r["outer_steps"] == STEPS // H for r in reports.values())
    reference = reference_eager(2, overlap)
    got = torch.load(tmp_path / "a.pt", weights_only=True)
    for name, value in reference.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "flags",
    [
        ("--strategy", "streaming", "--fragments", "2", "--overlap-steps", "1", "--codec", "int4"),
        pytest.param(
            ("--strategy", "diloco", "--codec", "int4", "--error-feedback"),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ("--strategy", "diloco", "--codec", "int2+zstd", "--error-feedback"),
            marks=pytest.mark.slow,
        ),
        ("--strategy", "async"),
        ("--strategy", "sync"),
    ],
    ids=[
        *("streaming-int4-overlap", "diloco-int4-error-feedback"),
        *("diloco-int2-zstd-error-feedback", "async", "sync"),
    ],
)
def test_every_strategy_ends_identical_on_every_site(tmp_path, flags):
    reports = _run(tmp_path, ["a", "b"], flags)
    assert len({r["param_sha256"] for r in reports.values()}) == 1
    assert all(r["wan_bytes_sent"] > 0 and r["outer_steps"] > 0 for r in reports.values())


def test_fragments_are_strided_over_blocks_and_staggered():
    from isthmus.inter.fragments import assign_fragments, count_blocks
    from isthmus.job.setting_groups import sync_offsets

    names = [n for n, _ in GPT(config_for("small")).named_parameters()]
    assert count_blocks(names) == 4
    fragments = assign_fragments(names, 2)
    by_block = {
        n.split(".")[1]: f for n, f in zip(names, fragments, strict=True) if ".layers." in f".{n}"
    }
    assert by_block == {"0": 0, "1": 1, "2": 0, "3": 1}
    assert fragments[0] == 0  # the embeddings, before any block
    assert fragments[-1] == 1  # the head joins the last block's fragment
    assert sync_offsets(100, 4) == [25, 50, 75, 100]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"fragments": 3}, "fragments"),  # the tiny model has 2 layers
        ({"fragments": 2, "overlap_steps": 6, "sync_every": 10}, "overlap_steps"),
        ({"alpha": 1.5}, "alpha"),
        ({"merge": "lazy"}, "merge"),
        ({"fragments": 1, "overlap_steps": 11, "sync_every": 10}, "overlap_steps"),
    ],
)
def test_bad_streaming_settings_are_refused(kwargs, field):
    from isthmus.inter.strategies import StreamingDiLoCo
    from isthmus.job.settings import SettingError

    model = GPT(config_for("tiny"))
    with pytest.raises(SettingError) as info:
        StreamingDiLoCo(None, model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


@pytest.mark.slow
def test_diloco_through_the_emulated_wan(tmp_path):
    """`isthmus.join` finds the emulator's state file of the job and the sites'
    traffic crosses its links (counted there)."""
    from isthmus.deploy.bench.emulator_bench import wan_up
    from isthmus.sim.emulator_control import ControlClient

    job = loopback_job(
        tmp_path / "job.yaml",
        "emulated",
        ["a", "b"],
        wan="wan:\n  default: {rtt_ms: 20, bandwidth_mbit: 500}\n",
    )
    state = tmp_path / "emulated.wan.json"  # the default name join() looks for
    with wan_up(job, state, "--stats-every", "0"):
        args = ["--steps", "6", "--sync-every", "3", "--corpus-bytes", str(CORPUS)]
        reports = list(
            run_sites(job, ["a", "b"], args, tmp_path, cwd=tmp_path, timeout_s=240).values()
        )
        control = json.loads(state.read_text())["control"].rsplit(":", 1)
        stats = ControlClient((control[0], int(control[1]))).stats()
    assert reports[0]["param_sha256"] == reports[1]["param_sha256"]
    wire = sum(d["bytes"] for link in stats["links"] for k, d in link.items() if "->" in k)
    assert wire >= reports[0]["wan_bytes_sent"] + reports[1]["wan_bytes_sent"]


@pytest.mark.slow
def test_sync_overlapped_in_buckets_equals_sync_after_backward(tmp_path):
    overlapped, after = tmp_path / "overlapped", tmp_path / "after"
    overlapped.mkdir()
    after.mkdir()
    a = _run(overlapped, ["a", "b"], ("--strategy", "sync", "--bucket-mb", "0.3"))
    b = _run(after, ["a", "b"], ("--strategy", "sync", "--no-overlap"))
    assert a["a"]["param_sha256"] == a["b"]["param_sha256"] == b["a"]["param_sha256"]
    # Every bucket's bytes counted, not the last one's several times.
    assert a["a"]["wan_bytes_sent"] == b["a"]["wan_bytes_sent"]


def _scripted_rounds(tmp_path, flags: dict[str, list[str]]) -> dict[str, dict]:
    """Run tests/workers/diloco_rounds.py once per site (separate processes)."""
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).parent / "workers" / "diloco_rounds.py"
    job = loopback_job(tmp_path / "job.yaml", "rounds", list(flags))
    from warm_popen import popen

    procs = {
        site: popen(
            [sys.executable, str(worker), str(job), site, str(tmp_path / f"{site}.json"), *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for site, extra in flags.items()
    }
    logs = {}
    for site, proc in procs.items():
        _, logs[site] = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"site {site}:\n{logs[site][-2000:]}"
    reports = {s: json.loads((tmp_path / f"{s}.json").read_text()) for s in flags}
    for site, report in reports.items():
        report["log"] = logs[site]
    return reports


def _close(a, b) -> bool:
    return all(
        torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-6)
        for x, y in zip(a, b, strict=True)
    )


def test_a_site_with_nan_values_is_left_out_of_the_round_by_every_site(tmp_path):
    reports = _scripted_rounds(tmp_path, {"a": [], "b": ["--poison", "1"], "c": []})
    a, b, c = reports["a"], reports["b"], reports["c"]
    for r in range(3):
        afters = [site["rounds"][r]["after"] for site in (a, b, c)]
        assert afters[0] == afters[1] == afters[2], f"round {r}: sites differ"
        assert all(torch.isfinite(torch.tensor(p)).all() for p in afters[0])
    poisoned = a["rounds"][1]
    assert poisoned["participants"] == ["a", "c"] and poisoned["refused"] == ["b"]
    assert poisoned["weights"]["b"] == 0.0
    # Outer lr 1, no momentum: the new global model is the average of a's and c's
    # local models (equal tokens), b's NaN nowhere in it.
    expected = [
        ((torch.tensor(x) + torch.tensor(y)) / 2).tolist()
        for x, y in zip(poisoned["before"], c["rounds"][1]["before"], strict=True)
    ]
    assert _close(poisoned["after"], expected)
    # Every site says which site was left out, and why; the next round counts b again.
    for site in (a, b, c):
        assert "left out of the round: {'b': 'refused its contribution (NaN/Inf)'}" in site["log"]
    assert "NaN/Inf values" in b["log"]
    assert a["rounds"][2]["participants"] == ["a", "b", "c"]
    assert a["outer_steps"] == 3


def test_a_site_that_trained_no_tokens_takes_the_average_without_counting(tmp_path):
    reports = _scripted_rounds(tmp_path, {"a": [], "b": ["--steps-in", "0=0"]})
    a, b = reports["a"], reports["b"]
    first = a["rounds"][0]
    assert first["participants"] == ["a"] and first["weights"] == {"a": 2.0, "b": 0.0}
    assert first["after"] == b["rounds"][0]["after"]
    assert _close(first["after"], first["before"])  # a's model alone, exactly averaged
    assert "'b': 'trained no tokens'" in a["log"]


def test_a_round_in_which_no_site_has_tokens_leaves_the_global_model_alone(tmp_path):
    reports = _scripted_rounds(tmp_path, {"a": ["--steps-in", "1=0"], "b": ["--steps-in", "1=0"]})
    a, b = reports["a"], reports["b"]
    assert a["rounds"][1]["participants"] == []
    assert a["rounds"][1]["after"] == a["rounds"][0]["after"] == b["rounds"][1]["after"]
    assert a["outer_steps"] == 2


def test_time_budgeted_rounds_let_a_slow_site_take_fewer_steps(tmp_path):
    # b takes 5x longer per step than a; rounds end every 0.5 s on both.
    reports = _scripted_rounds(
        tmp_path,
        {
            "a": ["--round-seconds", "0.5", "--steps", "150", "--step-sleep", "0.01"],
            "b": ["--round-seconds", "0.5", "--steps", "150", "--step-sleep", "0.05"],
        },
    )
    a, b = reports["a"], reports["b"]
    # a ran out of steps first; b learnt it from that round's seal and stopped.
    assert a["inner_steps"] == 150 and b["inner_steps"] < 100
    assert a["outer_steps"] == b["outer_steps"] >= 3
    assert a["params"] == b["params"]
    assert a["seals"] == b["seals"]
    # Full rounds weigh each site by what it trained: a's steps outnumber b's.
    full = a["seals"][:-1]
    assert all(w["a"] >= 2 * w["b"] > 0 for w in full), full
    assert sum(w["a"] for w in a["seals"]) == 150
    assert sum(w["b"] for w in a["seals"]) == b["inner_steps"]


def _weighted(rounds: dict[str, dict], r: int) -> list:
    """Round r's token-weighted average of the sites' local models (outer lr 1, no
    momentum: the new global model)."""
    weights = rounds[next(iter(rounds))]["rounds"][r]["weights"]
    total = sum(weights.values())
    befores = {s: report["rounds"][r]["before"] for s, report in rounds.items()}
    return [
        (sum(weights[s] * torch.tensor(befores[s][k]) for s in befores) / total).tolist()
        for k in range(len(befores["a"]))
    ]


def test_after_the_first_round_the_data_go_beside_the_vote_weighted_by_tokens(tmp_path):
    """The first round votes, then averages; from then on the sites share a scale
    (the participants' mean count) and send their data beside the vote, each
    scaled by its own count over it: the result is still the token-weighted
    average, identical on every site."""
    reports = _scripted_rounds(tmp_path, {"a": [], "b": ["--steps-in", "1=6", "--steps-in", "2=3"]})
    a, b = reports["a"], reports["b"]
    assert a["rounds"][0]["scale_tokens"] == {"a": 0, "b": 0}  # the vote went first
    assert a["rounds"][1]["scale_tokens"] == {"a": 2, "b": 2}  # beside: round 0's mean
    assert a["rounds"][1]["weights"] == {"a": 2.0, "b": 6.0}
    assert a["rounds"][2]["scale_tokens"] == {"a": 4, "b": 4}
    assert a["rounds"][2]["weights"] == {"a": 2.0, "b": 3.0}
    for r in range(3):
        assert a["rounds"][r]["after"] == b["rounds"][r]["after"], f"round {r}: sites differ"
        assert _close(a["rounds"][r]["after"], _weighted(reports, r)), f"round {r}"
    assert "averaging the round again" not in a["log"] + b["log"]


def test_diloco_tells_a_site_adamw_its_share_of_every_rounds_tokens(tmp_path):
    """SiteAdamW corrects its second moment to the batch the sites' averaged step
    stands for: DiLoCo starts it at the site's share of the layout and then
    gives it the share of the tokens each seal counted; the sites stay identical."""
    extra = ["--site-adamw"]
    reports = _scripted_rounds(tmp_path, {"a": extra, "b": [*extra, "--steps-in", "1=6"]})
    a, b = reports["a"], reports["b"]
    assert a["first_share"] == b["first_share"] == 0.5
    assert [r["batch_share"] for r in a["rounds"]] == [0.5, 0.25, 0.5]
    assert [r["batch_share"] for r in b["rounds"]] == [0.5, 0.75, 0.5]
    # Checkpointed with the strategy's state; given back as it came on closing.
    assert a["saved_share"] == 0.5 and a["share_after_close"] == 1.0
    for r in range(3):
        assert a["rounds"][r]["after"] == b["rounds"][r]["after"], f"round {r}: sites differ"


def test_a_site_that_sent_its_data_at_another_scale_is_caught_by_the_seal(tmp_path):
    """Sites share their scale through the rounds they completed; one that used
    another (a bug, or state from elsewhere) must not be averaged in at the wrong
    weight: the seal shows the scales differ, and every site averages the round
    again with the seal's weights."""
    reports = _scripted_rounds(
        tmp_path, {"a": ["--scale-tokens", "1=7"], "b": ["--steps-in", "1=6"]}
    )
    a, b = reports["a"], reports["b"]
    assert a["rounds"][1]["scale_tokens"] == {"a": 7, "b": 2}
    for r in range(3):
        assert a["rounds"][r]["after"] == b["rounds"][r]["after"], f"round {r}: sites differ"
        assert _close(a["rounds"][r]["after"], _weighted(reports, r)), f"round {r}"
    for site in (a, b):
        assert "sent their data at different scales" in site["log"]
    assert a["rounds"][2]["scale_tokens"] == {"a": 4, "b": 4}  # in step again
