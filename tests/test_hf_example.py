"""deploy/examples/hf_train.py: a Hugging Face model in a plain loop, then under Isthmus.

The fast tests check the example's pieces without Isthmus (the model trains,
the batches are a fixed function of site, rank and step, the Isthmus part stays
small); the slow one runs it as ``isthmus run JOB -- python hf_train.py`` and
checks that both sites finish with the same parameters. All skip without the
``hf`` extra (in requirements/dev.txt, which scripts/setup.sh installs).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from needs import needs_transformers

if needs_transformers.args[0]:  # the condition: transformers is missing
    pytest.skip(needs_transformers.kwargs["reason"], allow_module_level=True)

import torch

from isthmus.deploy.examples import hf_train
from isthmus.job.settings import TrainSettings

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "deploy" / "examples" / "hf_train.py"


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return hf_train.corpus()


def test_corpus_is_byte_tokens(tokens: torch.Tensor) -> None:
    assert tokens.dim() == 1 and tokens.dtype == torch.long
    assert len(tokens) > 1_000_000
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 256


def test_batches_are_a_function_of_site_rank_and_step(tokens: torch.Tensor) -> None:
    x = hf_train.batch(tokens, 120, 1, 0, 4)
    assert x.shape == (4, hf_train.SEQ_LEN)
    # A site that rejoins at step 120 draws what it would have drawn without the fault.
    assert torch.equal(x, hf_train.batch(tokens, 120, 1, 0, 4))
    assert not torch.equal(x, hf_train.batch(tokens, 121, 1, 0, 4))
    assert not torch.equal(x, hf_train.batch(tokens, 120, 0, 0, 4))
    assert not torch.equal(x, hf_train.batch(tokens, 120, 1, 1, 4))


def test_model_is_the_same_from_every_build() -> None:
    a, b = hf_train.build_model().state_dict(), hf_train.build_model().state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_plain_loop_trains(tokens: torch.Tensor) -> None:
    """The example's loop without Isthmus: 3 steps on fresh batches stay finite, and
    20 steps on one fixed batch bring its loss well down."""
    model = hf_train.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(3):
        x = hf_train.batch(tokens, step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert math.isfinite(loss.item())

    x = hf_train.batch(tokens, 1_000)
    losses = []
    for _ in range(20):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.8 * losses[0], losses


class StandInSite:
    """What ``main()`` uses of ``isthmus.join()``'s site, with no job behind it: the
    loop runs as it would on one site alone."""

    def __init__(self, steps: int) -> None:
        self.job = SimpleNamespace(train=TrainSettings(steps=steps, batch_size=2))
        self.site_index, self.dp_rank, self.device = 1, 0, torch.device("cpu")
        self.logged: list[dict[str, float]] = []
        self.entered: tuple[object, object] | None = None

    @contextmanager
    def strategy(self, model: object, optimizer: object) -> Iterator[None]:
        self.entered = (model, optimizer)
        yield

    def steps(self) -> Iterator[int]:
        yield from range(self.job.train.steps)

    def log(self, **metrics: float) -> None:
        self.logged.append(metrics)


def test_main_runs_its_loop_on_a_stand_in_site(monkeypatch: pytest.MonkeyPatch) -> None:
    site = StandInSite(steps=4)
    monkeypatch.setattr(hf_train.isthmus, "join", lambda: site, raising=False)
    hf_train.main()
    model, optimizer = site.entered  # type: ignore[misc]
    assert isinstance(model, torch.nn.Module) and isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.param_groups[0]["lr"] == site.job.train.inner_lr
    assert [m["tokens"] for m in site.logged] == [2 * hf_train.SEQ_LEN] * 4
    assert all(math.isfinite(m["loss"]) for m in site.logged)


def test_isthmus_adds_at_most_15_lines() -> None:
    """The example's promise (and docs/hf.md's): the lines marked ``# isthmus``."""
    with EXAMPLE.open("rb") as source:
        comments = [t for t in tokenize.tokenize(source.readline) if t.type == tokenize.COMMENT]
    marked = [t.line.strip() for t in comments if re.match(r"#\s*isthmus\b", t.string)]
    assert 0 < len(marked) <= 15, marked


@pytest.mark.slow
def test_two_sites_train_the_example_to_the_same_parameters(tmp_path: Path) -> None:
    """``isthmus run two-sites.yaml --steps 8 -- python hf_train.py``, with a round
    every 4 steps so one runs inside ``optimizer.step()`` and one as the block ends."""
    job = tmp_path / "two-sites.yaml"
    text = (REPO / "deploy" / "examples" / "two-sites.yaml").read_text()
    job.write_text(text.replace("sync_every: 50", "sync_every: 4"))
    out = tmp_path / "run"
    isthmus_run = [sys.executable, "-m", "isthmus", "run", str(job), "--steps", "8", "--no-report"]
    result = subprocess.run(
        [*isthmus_run, "--out", str(out), "--", sys.executable, str(EXAMPLE)],
        cwd=tmp_path,  # what the run leaves beside it stays in the test's folder
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sites = json.loads((out / "summary.json").read_text())["sites"]
    assert set(sites) == {"us-east", "eu-west"}
    assert {s["status"] for s in sites.values()} == {"finished"}, sites
    digests = {s["param_sha256"] for s in sites.values()}
    assert len(digests) == 1 and None not in digests, sites
