"""The ``with site.strategy(model, optimizer):`` block: one site's training run.

:class:`TrainingRun` is what the block holds. On entry it goes on from a
checkpoint (``--resume``), or pulls the others' state (a restarted site), or
makes every site start from the first site's model
(:func:`isthmus.inter.agreement.agree_on_model`); then it builds the job's
strategy, which hooks the optimizer. :meth:`TrainingRun.steps` hands out the
step numbers and, after each step, does what the run needs of it: the step's
record, the site's status, each round's record and metrics on the control
plane, live settings (the same round on every site), checkpoints, and a jump
to the others' step when this site pulled their state. On a clean exit it
runs the final synchronisation and writes the site's ``result.json``; a site
that left the run (``LeftTheRun``) exits the block quietly with
``status: "left"``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from isthmus.inter.agreement import agree_on_model
from isthmus.inter.membership import LeftTheRun, RunOver
from isthmus.inter.strategies import AsyncDiLoCo, Blocked, Strategy
from isthmus.intra import collectives
from isthmus.intra.checkpoint import (
    CheckpointWriteError,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    load_extra,
    save_checkpoint,
)
from isthmus.intra.random_state import random_states, restore_random_states
from isthmus.training.description import describe_training, parameter_count
from isthmus.training.environment import RUN_OVER_STATUS
from isthmus.training.host_values import LaterFloat
from isthmus.training.round_records import write_blocked, write_round, write_views
from isthmus.training.site_control import apply_settings
from isthmus.training.slowdown import SlowSteps
from isthmus.training.strategy_choice import strategy_from_settings

if TYPE_CHECKING:
    from isthmus.training.site import Site

log = logging.getLogger("isthmus.session")


@dataclasses.dataclass
class RoundClock:
    """Where the round under way began (time, tokens, compute, step) and how long the
    loop was blocked in it: the control plane's metrics when it ends."""

    started: float
    tokens: int
    compute_s: float
    step: int
    waiting_s: float = 0.0
    blocked_s: float = 0.0

    def add_blocked(self, blocked: Iterable[Blocked]) -> None:
        for span in blocked:
            self.blocked_s += span.seconds
            if span.kind == "waiting":
                self.waiting_s += span.seconds

    def metrics(self, *, tokens: int, compute_s: float, step: int) -> dict[str, Any]:
        round_s = time.perf_counter() - self.started
        return {
            "tokens_per_s": (tokens - self.tokens) / round_s if round_s > 0 else None,
            "round_s": round_s,
            "waiting_s": self.waiting_s,
            "blocked_s": self.blocked_s,
            "compute_s": compute_s - self.compute_s,
            "round_steps": step - self.step,
        }


class TrainingRun:
    """One site's run of the job's strategy over a script's model and optimizer."""

    def __init__(
        self,
        site: Site,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        tokens_per_step: int | None = None,
        stage_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.site = site
        # DDP only wraps the model (its parameters are the module's): names and state
        # as every site has them, whether it runs DDP or has one rank.
        if isinstance(model, DistributedDataParallel):
            model = model.module
        self.model = model
        self.optimizer = optimizer
        self.settings = site.job.train
        self.stage_group = stage_group
        """With pipeline stages: the group of this rank's stage peers (the strategy's
        gradient norm spans it, and the final model is merged over the site)."""
        self._tokens_per_step = tokens_per_step
        self.strategy: Strategy | None = None
        """The job's strategy, built on entering the block."""
        self.start_step = 0
        self.step = 0
        """The step the loop is on (0-based): what :meth:`steps` last handed out."""
        self.steps_done = 0
        """Inner steps this site has completed (a resumed or pulled start counts)."""
        self.tokens = 0
        self.compute_s = 0.0
        self._loss: float | LaterFloat = math.nan
        self.last_round: dict[str, Any] = {}
        """The last round's timings (``tokens_per_s``, ``round_s``, ``waiting_s``, ...),
        as the control plane's metrics carry them: for ``/metrics``."""
        self.waiting_s = 0.0
        """Seconds the loop waited on other sites, summed over the rounds."""
        self.left = False
        self.final_state: dict[str, torch.Tensor] | None = None
        """After a clean exit, on rank 0: the whole model's parameters and buffers by
        name (every site holds the same), e.g. to evaluate or save it."""
        self.result: dict[str, Any] | None = None
        self._parameter_names: list[str] = []
        self._logged: dict[str, Any] = {}
        self._views_seen = (0, 0)
        self._outer_seen = 0
        self._train_started = 0.0
        self.eval_s = 0.0
        """Held-out evaluations the script timed inside steps (eval_seconds)."""
        self._clock: RoundClock | None = None
        self._resume_round = site.launch.resume_round if site.launch else None
        self._rejoin = bool(site.launch and site.launch.rejoin)
        self._resumed: dict[str, Any] = {}
        self._logged_ever: set[str] = set()
        """Which of ``loss`` and ``tokens`` the script has logged at all."""
        self._warned: set[str] = set()
        self._slow = SlowSteps.for_site(site.job, site.name, site.records.write)

    # -- entering ----------------------------------------------------------------------
    def __enter__(self) -> TrainingRun:
        site, records = self.site, self.site.records
        if self._resume_round is not None:
            self._load_checkpoint(self._resume_round)
        elif not self._rejoin:
            agreed = agree_on_model(
                site.runtime, list(self.model.named_parameters()), device=site.device
            )
            if agreed.differing_values:
                log.warning(
                    "site %s: the model started from site %s's parameters (%s had others)",
                    site.name,
                    site.names[0],
                    ", ".join(agreed.differing_values),
                )
        self.strategy = strategy = strategy_from_settings(
            self.settings,
            site.runtime,
            self.model,
            self.optimizer,
            self._tokens_per_step or self.settings.batch_size,
            self.stage_group,
        )
        if self._resumed:
            strategy.load_state_dict(self._resumed["strategy"])
            restore_random_states(self._resumed["rng"])
        strategy.observer = lambda kind, start: records.write(
            "state", state=kind if start else "computing"
        )
        records.write(
            "start",
            ranks=site.runtime.site.ranks,
            strategy=self.settings.strategy,
            steps=self.settings.steps,
            ran=describe_training(
                self.model,
                self.optimizer,
                tokens_per_step=strategy.tokens_per_step,
                tokens_given=self._tokens_per_step is not None,
                described=site.described,
            ),
        )
        if self._resumed:
            records.write("resume", round=self._resume_round, step=self.start_step)
        if self._rejoin:
            try:
                self.start_step = self._rejoin_run(strategy)
            except RunOver as exc:
                strategy.close()
                self._run_over(exc)
        self._views_seen = (0, len(strategy.member.caught_up))
        self.tokens = int(self._resumed.get("tokens", 0))
        self.compute_s = float(self._resumed.get("compute_s", 0.0))
        self.eval_s = float(self._resumed.get("eval_s", 0.0))
        self._train_started = time.time() - float(self._resumed.get("wall_s", 0.0))
        self._outer_seen = strategy.outer_steps
        self._clock = RoundClock(time.perf_counter(), self.tokens, self.compute_s, self.start_step)
        self.step = self.steps_done = self.start_step
        return self

    def _load_checkpoint(self, round: int) -> None:
        path = checkpoint_path(self.site.checkpoints, round, "round")
        load_checkpoint(path, self.model, self.optimizer)
        self._resumed = load_extra(path)
        self.settings = dataclasses.replace(self.settings, **self._resumed["settings"])
        self.start_step = int(self._resumed.get("step", 0))

    def _rejoin_run(self, strategy: Strategy) -> int:
        """A restarted site: wait to be let in, pull the others' state, record where it
        came from; returns the inner step to train on from."""
        records = self.site.records
        records.write("state", state="rejoining")
        start_step = strategy.rejoin()
        pulled = strategy.member.caught_up[-1]
        records.write(
            "rejoin",
            round=pulled.rounds,
            step=start_step,
            donor=pulled.donor,
            view=pulled.view,
            bytes=pulled.bytes,
            seconds=pulled.seconds,
            resumed=pulled.resumed,
        )
        return start_step

    @property
    def loss(self) -> float:
        """The last step's loss (the site's mean): read from the device when asked."""
        return float(self._loss)

    # -- the loop ------------------------------------------------------------------------
    def steps(self) -> Iterator[int]:
        """The step numbers to train, from where this site starts (0, the resumed or
        pulled step) to ``train.steps``; ends early when the run is over for this site
        (time-budgeted rounds over, or it left). After a step in which this site
        pulled the others' state, the next number is theirs: index data by it."""
        strategy = self._active()
        step = self.step
        while step < self.settings.steps:
            if self.site.leave_requested and not strategy.member.leave_requested:
                strategy.member.leave_requested = True  # acted on at the next round
                self.site.records.write("state", state="leaving")
            self.step = step
            self._logged = {}
            started = time.perf_counter()
            yield step
            next_step = self._after_step(step, started)
            if next_step is None:
                break
            step = next_step
        # The last step's record, held while its loss came from the device.
        self.site.records.release()

    def log(self, **metrics: Any) -> None:
        """What this rank reports of the step under way: ``loss`` (a float), ``tokens``
        (how many it trained on in this step), ``eval_loss`` (a held-out loss of the
        model as it is now; ``eval_seconds``: how long that took), and any other
        numbers (kept in the step's record). A tensor is read on the host with
        ``.item()``; a floating-point one on a GPU (the loss) later, without
        stalling the device (:class:`~isthmus.training.host_values.LaterFloat`):
        the step's record is then written once it has arrived, at the latest with
        the next record, under the time of its step."""
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor):
                later = value.is_floating_point() and value.device.type == "cuda"
                # tokens and eval_seconds are counted at once; the rest only recorded.
                if later and value.numel() == 1 and name not in ("tokens", "eval_seconds"):
                    value = LaterFloat(value)
                else:
                    value = value.item()
            if not isinstance(value, int | float | LaterFloat) or isinstance(value, bool):
                raise TypeError(f"site.log({name}=...): must be a number, got {value!r}")
            self._logged[name] = value

    def _after_step(self, step: int, started: float) -> int | None:
        site, records, strategy = self.site, self.site.records, self._active()
        logged = self._logged
        self._logged_ever.update(k for k in ("loss", "tokens") if k in logged)
        # Compute: the step's time less what the strategy blocked it and a held-out
        # evaluation the script timed (eval_seconds): neither is training.
        blocked = sum(b.seconds for b in strategy.blocked) + logged.get("eval_seconds", 0.0)
        # The site's ranks meet here every step (loss and tokens over the site): part
        # of the step, so inside compute. Timed outside it, a 2-rank site on Gloo
        # showed 8-13 ms per step that was neither compute nor waiting on the
        # strategy, which the performance model could not see.
        loss, tokens = self._site_totals(logged)
        if self._slow is not None:  # a fail-slow fault of the job's schedule: real time
            self._slow.slow_down(
                time.time() - self._train_started,
                strategy.outer_steps,
                time.perf_counter() - started - blocked,
            )
        self.compute_s += time.perf_counter() - started - blocked
        self.eval_s += logged.get("eval_seconds", 0.0)
        self._loss = loss
        self.tokens += tokens
        assert self._clock is not None
        self._clock.add_blocked(strategy.blocked)
        write_blocked(records, strategy)
        extra = {
            k: v
            for k, v in logged.items()
            if k not in ("loss", "tokens", "eval_loss", "eval_seconds")
        }
        extra.setdefault("lr", self.optimizer.param_groups[0]["lr"])
        self.steps_done = step + 1
        records.write(
            "step",
            step=step + 1,
            loss=loss,
            tokens=self.tokens,
            compute_s=self.compute_s,
            **extra,
        )
        site.control.step(step + 1, strategy.outer_steps)
        self._views_seen = write_views(records, site.runtime, strategy, self._views_seen, step + 1)
        round_ended = strategy.outer_steps != self._outer_seen
        if round_ended:
            self._round_ended(step + 1)
        if "eval_loss" in logged:
            timing = {"seconds": logged["eval_seconds"]} if "eval_seconds" in logged else {}
            records.write(
                "eval", step=step + 1, tokens=self.tokens, eval_loss=logged["eval_loss"], **timing
            )
        if getattr(strategy, "training_over", False):
            return None  # time-budgeted rounds: a site has finished, so has everyone
        every = self.settings.checkpoint_every
        if round_ended and every and self._outer_seen % every == 0:
            self._checkpoint(step + 1)
        if strategy.inner_steps != step + 1:
            # This site fell behind (cut off, left out) and pulled the others' state:
            # go on from their step.
            return strategy.inner_steps
        return step + 1

    def _site_totals(self, logged: dict[str, Any]) -> tuple[float | LaterFloat, int]:
        """The step's loss (the mean over the site's ranks that logged one) and tokens
        (summed over its data-parallel replicas: tp and pp ranks share a batch). A
        one-rank site's loss may still be on its way from the device (LaterFloat);
        several ranks read theirs to average them (a collective of host values)."""
        loss = logged.get("loss")
        tokens = logged.get("tokens")
        if tokens is None:
            tokens = self._active().tokens_per_step
        runtime = self.site.runtime
        if runtime.site.ranks == 1:
            if isinstance(loss, LaterFloat):
                return loss, int(tokens)
            return (math.nan if loss is None else float(loss)), int(tokens)
        layout = runtime.layout
        values = collectives.all_reduce_values(
            [0.0 if loss is None else float(loss), 0.0 if loss is None else 1.0, float(tokens)],
            device=runtime.device,
            where="training.site_totals",
        )
        mean = float(values[0] / values[1]) if values[1] else math.nan
        return mean, round(float(values[2]) / (layout.tp * layout.pp))

    def _round_ended(self, steps: int) -> None:
        strategy, site = self._active(), self.site
        self._outer_seen = strategy.outer_steps
        totals = write_round(site.records, strategy, site.runtime, steps)
        assert self._clock is not None
        self.last_round = self._clock.metrics(
            tokens=self.tokens, compute_s=self.compute_s, step=steps
        )
        self.waiting_s += self.last_round["waiting_s"]
        changes = site.control.round_ended(
            self._outer_seen,
            steps,
            loss=self.loss,
            wan_bytes_sent=totals["wan_bytes_sent"],
            sync_every=self.settings.sync_every,
            **self.last_round,
        )
        self._clock = RoundClock(time.perf_counter(), self.tokens, self.compute_s, steps)
        self._warn_of_logging()
        if changes:
            self.settings, applied = apply_settings(
                changes, self.settings, strategy, site.name, builtin_loop=site.builtin_loop
            )
            if applied:
                site.records.write("config", round=self._outer_seen, step=steps, settings=applied)

    def _warn_of_logging(self) -> None:
        """Once per site, at a round's end: a script that logs no loss (its records and
        summary then say null), a loss that is not finite, tokens never counted."""
        if not self._warned:
            # What the counts below rest on, for the run's description (once).
            tokens_from = (
                "site.log" if "tokens" in self._logged_ever
                else "tokens_per_step" if self._tokens_per_step is not None
                else "train.batch_size"
            )  # fmt: skip
            self._warned.add("described")
            self.site.records.write(
                "described",
                fields={"tokens_counted_from": tokens_from,
                        "loss_logged": "loss" in self._logged_ever},
            )  # fmt: skip
        if self.site.builtin_loop:
            return  # it logs both (a pipeline's first stage has no loss of its own)
        name = self.site.name
        if "loss" not in self._logged_ever:
            self._warn_once(
                "no-loss",
                "site %s: the script logs no loss (site.log(loss=...)); its records and "
                "summary.json say null",
                name,
            )
        elif not math.isfinite(self.loss):
            self._warn_once(
                "non-finite",
                "site %s: the script logged a loss that is not finite (%s); recorded as null",
                name,
                self.loss,
            )
        if "tokens" not in self._logged_ever and self._tokens_per_step is None:
            self._warn_once(
                "no-tokens",
                "site %s: tokens are counted as train.batch_size (%d) a step: the script "
                "passes neither site.strategy(..., tokens_per_step=N) nor site.log(tokens=N)",
                name,
                self.settings.batch_size,
            )

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned and self.site.rank == 0:
            self._warned.add(what)
            log.warning(message, *args)

    def _checkpoint(self, steps: int) -> None:
        """Every rank's checkpoint after this round (the same round in every site), and
        its record: what ``--resume`` goes on from, bit for bit."""
        site, strategy = self.site, self._active()
        if site.checkpoints is None:
            return
        saved = time.perf_counter()
        extra = {
            "strategy": strategy.state_dict(),
            "rng": random_states(),
            "settings": self.settings.to_dict(),
            "step": steps,
            "tokens": self.tokens,
            "compute_s": self.compute_s,
            "eval_s": self.eval_s,
            "wall_s": time.time() - self._train_started,
        }
        rounds = strategy.outer_steps
        try:
            path = save_checkpoint(
                site.checkpoints, rounds, self.model, self.optimizer, extra=extra, kind="round"
            )
        except CheckpointWriteError as exc:
            # That checkpoint fails, loudly; the run and its model go on, and the newest
            # complete checkpoint stays what --resume goes on from.
            previous = latest_checkpoint(site.checkpoints, "round")
            kept = (
                f"{previous.relative_to(site.run_dir) if site.run_dir else previous} stays "
                "the one to resume from" if previous is not None else "there is no earlier one"
            )  # fmt: skip
            log.error("site %s: %s; training goes on, %s", site.name, exc, kept)
            site.records.write(
                "checkpoint_failed",
                round=rounds,
                step=steps,
                error=str(exc),
                previous=str(previous.relative_to(site.run_dir)) if previous and site.run_dir
                else None,
            )  # fmt: skip
            return
        where = path.relative_to(site.run_dir) if site.run_dir is not None else path
        site.records.write(
            "checkpoint",
            round=rounds,
            step=steps,
            path=str(where),
            seconds=time.perf_counter() - saved,
        )

    # -- leaving -----------------------------------------------------------------------
    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        strategy = self._active()
        records = self.site.records
        if isinstance(exc, LeftTheRun):
            records.write("state", state="left", reason=str(exc))
            self.left = True
        elif isinstance(exc, RunOver):
            strategy.close()
            self._run_over(exc)
        elif exc_type is not None:
            strategy.close()  # a failure: no final round, no result
            return False
        if not self.left:
            # Every run ends with a final synchronisation: the same model on every site.
            records.write("state", state="syncing")
            strategy.finish()
        strategy.close()
        write_blocked(records, strategy)
        totals = write_round(records, strategy, self.site.runtime, self.step + 1)
        whole = whole_model(self.model, self.site, self.stage_group)
        if whole is not None:
            self.final_state, self._parameter_names = whole
        self.site.run_ended(self, totals)
        return True

    def _run_over(self, exc: RunOver) -> None:
        """The others finished while this site came back: say so once and end the
        process with :data:`RUN_OVER_STATUS` (the launcher then neither fails the run
        nor starts the site again); ``finally`` blocks still run."""
        log.warning("%s; the run is over for this site", exc)
        # Not "lost": the launcher decides that from the exit status, with the reason.
        self.site.records.write("state", state="run_over", reason=str(exc))
        raise SystemExit(RUN_OVER_STATUS) from None

    def result_fields(self, totals: dict[str, Any]) -> dict[str, Any]:
        """The site's ``result.json`` (rank 0, after the final synchronisation)."""
        strategy = self._active()
        assert self.final_state is not None
        result = {
            "status": "left" if self.left else "finished",
            "final_loss": self.loss,
            "eval_loss": None,
            "tokens": self.tokens,
            "inner_steps": strategy.inner_steps,
            "outer_steps": strategy.outer_steps,
            "compute_seconds": self.compute_s,
            "wall_seconds": time.time() - self._train_started,
            "eval_seconds": self.eval_s,
            "wan_bytes_sent": totals["wan_bytes_sent"],
            "wan_bytes_received": totals["wan_bytes_received"],
            "wan_bytes_sent_to": totals["wan_bytes_sent_to"],
            "all_reduce_rounds": totals["all_reduce_rounds"],
            "param_sha256": state_digest(self.final_state, self._parameter_names),
            "parameters": parameter_count(self.final_state, self._parameter_names),
        }
        if isinstance(strategy, AsyncDiLoCo):
            result["late_contributions_applied"] = strategy.late_contributions_applied
        return result

    def _active(self) -> Strategy:
        if self.strategy is None:
            raise RuntimeError(
                "site.steps() and site.log() run inside `with site.strategy(model, optimizer):`"
            )
        return self.strategy


def whole_model(
    model: nn.Module, site: Site, stage_group: dist.ProcessGroup | None
) -> tuple[dict[str, torch.Tensor], list[str]] | None:
    """The whole model on rank 0 (a collective on every rank): its state with sharded
    tensors gathered and pipeline stages merged by name, and the names of its
    parameters in order. None on the other ranks."""
    state = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
        for k, v in model.state_dict().items()
    }
    names = [name for name, _ in model.named_parameters()]
    runtime = site.runtime
    if stage_group is None or runtime.layout.pp == 1:
        return (state, names) if runtime.rank == 0 else None
    parts: list[Any] = [None] * runtime.site.ranks
    collectives.all_gather_object(
        parts, (state, names), device=runtime.device, where="training.whole_model"
    )
    if runtime.rank != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    merged_names: list[str] = []
    for one, stage_names in parts:
        merged.update(one)
        merged_names += [n for n in stage_names if n not in merged_names]
    return merged, merged_names


def state_digest(state: dict[str, torch.Tensor], parameters: list[str]) -> str:
    """SHA-256 of the model's parameters, as
    :func:`isthmus.training.records.parameter_digest` computes it from the model:
    for each parameter in order, its name, a newline, its values as contiguous
    little-endian float32. Equal digests mean bitwise-equal models."""
    digest = hashlib.sha256()
    for name in parameters:
        digest.update(name.encode() + b"\n")
        digest.update(state[name].float().contiguous().numpy().tobytes())
    return digest.hexdigest()
