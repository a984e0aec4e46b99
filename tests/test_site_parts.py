"""The site's building blocks on their own: layouts, the built-in model, the built-in data."""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import pytest
import torch

from isthmus.inter.member_rounds import state_transferable
from isthmus.intra.data import (
    EXCLUDED_STDLIB_DIRS,
    Dataset,
    ShardSpec,
    load_corpus,
    stdlib_corpus,
    stdlib_sources,
)
from isthmus.intra.gradients import clip_grad_norm
from isthmus.intra.model import GPT, SIZES, GPTConfig, config_for, lm_loss
from isthmus.job.layout import Layout, LayoutError, check_sites, stage_layers


# -- layouts ---------------------------------------------------------------------------
def test_layout_defaults_to_data_parallel_and_fills_dp_replicate():
    assert Layout.for_ranks(4) == Layout(dp_replicate=4)
    assert Layout.for_ranks(4, {"dp_shard": 2}) == Layout(dp_replicate=2, dp_shard=2)
    assert Layout.for_ranks(8, {"tp": 2, "pp": 2}).dp == 2


@pytest.mark.parametrize(
    ("ranks", "given", "message"),
    [
        (3, {"tp": 2}, "does not divide the site's 3 ranks"),
        (4, {"dp_replicate": 3}, "is 3 ranks, but the site has 4"),
        (2, {"fsdp": 2}, "unknown dimension"),
        (2, {"tp": 0}, "integer >= 1"),
    ],
)
def test_bad_layouts_name_the_numbers(ranks, given, message):
    with pytest.raises(LayoutError, match=message):
        Layout.for_ranks(ranks, given)


def test_coordinates_and_ranks_round_trip():
    layout = Layout(pp=2, dp_replicate=2, dp_shard=2, tp=2)
    for rank in range(layout.size):
        c = layout.coordinates(rank)
        dp = c["dp_replicate"] * layout.dp_shard + c["dp_shard"]
        assert layout.rank_of(pp=c["pp"], dp=dp, tp=c["tp"]) == rank
        assert rank in layout.dp_peers(rank)
    assert layout.coordinates(1)["tp"] == 1  # tp is innermost: neighbours


def test_state_is_pulled_across_layouts_only_where_replicas_hold_it_whole():
    one, two = Layout.for_ranks(1), Layout.for_ranks(2)
    assert state_transferable(two, one) and state_transferable(one, two)
    sharded = Layout.for_ranks(2, {"dp_shard": 2})
    assert state_transferable(sharded, sharded)
    assert not state_transferable(sharded, one)  # a's rank holds half of what b needs
    assert not state_transferable(Layout.for_ranks(4, {"dp_shard": 2}), sharded)
    assert not state_transferable(Layout.for_ranks(2, {"tp": 2}), one)


def test_clipping_matches_torch_and_leaves_small_or_broken_gradients_alone():
    torch.manual_seed(0)
    ours, theirs = GPT(config_for("tiny")), GPT(config_for("tiny"))
    theirs.load_state_dict(ours.state_dict())
    x = torch.randint(0, 256, (2, 64))
    for model in (ours, theirs):
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    norm = clip_grad_norm(ours.parameters(), 0.5)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
    assert norm == pytest.approx(float(expected), rel=1e-6) and norm > 0.5
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    before = [p.grad.clone() for p in ours.parameters()]
    assert clip_grad_norm(ours.parameters(), 10.0) == pytest.approx(0.5, rel=1e-5)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, ours.parameters(), strict=True))
    first = next(ours.parameters())
    first.grad[0] = float("nan")  # refused later, by the strategy, with the site's name
    broken = [p.grad.clone() for p in ours.parameters()]
    assert math.isnan(clip_grad_norm(ours.parameters(), 0.1))
    for a, p in zip(broken, ours.parameters(), strict=True):
        torch.testing.assert_close(p.grad, a, rtol=0, atol=0, equal_nan=True)


def test_model_and_sites_checks():
    with pytest.raises(LayoutError, match=r"divide model\.n_head"):
        Layout(tp=3).check_model(config_for("tiny"))
    with pytest.raises(LayoutError, match="at least one layer"):
        Layout(pp=3).check_model(config_for("tiny"))
    with pytest.raises(LayoutError, match="differ in tp or pp"):
        check_sites({"a": Layout(tp=2), "b": Layout(dp_replicate=2)})
    check_sites({"a": Layout(dp_shard=2), "b": Layout()})
    assert [len(stage_layers(5, 2, s)) for s in range(2)] == [3, 2]


# -- model -----------------------------------------------------------------------------
def test_model_shapes_parameter_count_and_bad_sizes():
    model = GPT(config_for("tiny"))
    tokens = torch.randint(0, 256, (2, 16))
    assert model(tokens).shape == (2, 16, 256)
    assert sum(p.numel() for p in model.parameters()) == model.config.parameter_count()
    assert set(SIZES) >= {"tiny", "125m", "1b", "7b"}
    with pytest.raises(ValueError, match="choose one of"):
        config_for("huge")
    with pytest.raises(ValueError, match=r"divisible by model\.n_head"):
        GPTConfig(d_model=100, n_head=3)
    with pytest.raises(ValueError, match=r"longer than model\.seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.slow  # 10-14 s of training on one core: the slow pass, not the fast tier
def test_model_learns_the_corpus():
    torch.manual_seed(0)
    model = GPT(config_for("tiny"))
    data = Dataset(stdlib_corpus(200_000), model.config.seq_len)
    batches = data.batches(ShardSpec(0, (1,), 0), 16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        x, y = next(batches)
        loss = lm_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 5.0 and sum(losses[-5:]) / 5 < 3.5


def test_activation_checkpointing_gives_the_same_gradients():
    from isthmus.intra.parallelize import apply_activation_checkpointing

    torch.manual_seed(0)
    plain = GPT(config_for("tiny"))
    torch.manual_seed(0)
    recomputed = GPT(config_for("tiny"))
    apply_activation_checkpointing(recomputed.layers)
    tokens = torch.randint(0, 256, (2, 17))
    for model in (plain, recomputed):
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    for a, b in zip(plain.parameters(), recomputed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_a_pipeline_stage_without_embeddings_passes_hidden_states_through():
    model = GPT(config_for("tiny"))
    model.tok_embeddings = model.pos_embeddings = None
    model.norm = model.output = None
    hidden = torch.randn(2, 8, model.config.d_model)
    assert model(hidden).shape == hidden.shape


# -- data ------------------------------------------------------------------------------
def test_the_stdlib_corpus_reads_the_files_a_full_listing_would_in_its_order():
    """The pruned walk must give the corpus of the plain listing it replaced: the
    built-in data, and every run's shards, depend on the file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    listed = [
        p
        for p in sorted(root.rglob("*.py"))
        if not EXCLUDED_STDLIB_DIRS.intersection(p.relative_to(root).parts)
    ]
    assert stdlib_sources(root) == listed
    assert len(listed) > 100


def test_shards_are_disjoint_deterministic_and_cover_the_split():
    data = Dataset(stdlib_corpus(300_000), 64)
    ranks = (1, 2, 3)
    for iid in (True, False):
        shards = [
            data.shard_windows(ShardSpec(s, ranks, r, iid=iid, seed=5))
            for s, n in enumerate(ranks)
            for r in range(n)
        ]
        everything = torch.cat(shards)
        assert everything.unique().numel() == everything.numel() == data.train_windows
        again = data.shard_windows(ShardSpec(1, ranks, 1, iid=iid, seed=5))
        assert torch.equal(again, shards[2])
    # Non-IID: each site reads its own contiguous part of the corpus.
    site0 = data.shard_windows(ShardSpec(0, ranks, 0, iid=False))
    site2 = data.shard_windows(ShardSpec(2, ranks, 0, iid=False))
    assert site0.max() < site2.min()


def test_batches_and_the_held_out_split():
    data = Dataset(stdlib_corpus(300_000), 32)
    x, y = next(data.batches(ShardSpec(0, (1,), 0), 8))
    assert x.shape == y.shape == (8, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])
    eval_x, _ = next(data.eval_batches(8))
    assert int(data.eval_start) >= data.train_windows * 32
    assert eval_x.shape == (8, 32)
    assert len(list(data.eval_batches(4, max_batches=3))) == 3


def test_user_corpora_and_their_errors(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"hello world " * 2000)
    assert load_corpus(str(text)).tokens.numel() == 24000
    tokens = tmp_path / "ids.pt"
    torch.save(torch.arange(5000) % 1000, tokens)
    corpus = load_corpus(str(tokens))
    assert corpus.vocab_size == 1000
    torch.save(torch.randn(10), tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="1-D integer tensor"):
        load_corpus(str(tmp_path / "bad.pt"))
    with pytest.raises(ValueError, match="no file"):
        load_corpus(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="too few"):
        Dataset(load_corpus(str(text)), 20_000)


def test_json_files_are_strict_json_whatever_the_values(tmp_path):
    """NaN and infinity are not JSON: every file Isthmus writes says null instead."""
    import json
    import math

    from isthmus.training.records import RecordWriter, write_json_atomic

    write_json_atomic(tmp_path / "s.json", {"final_loss": math.nan, "x": [math.inf, 1.0]})
    strict = {"parse_constant": lambda c: pytest.fail(f"non-JSON constant {c}")}
    assert json.loads((tmp_path / "s.json").read_text(), **strict) == {
        "final_loss": None, "x": [None, 1.0],
    }  # fmt: skip
    writer = RecordWriter(tmp_path / "m.jsonl", "a")
    writer.write("step", loss=-math.inf)
    writer.close()
    record = json.loads((tmp_path / "m.jsonl").read_text(), **strict)
    assert record["loss"] is None and record["kind"] == "step"
