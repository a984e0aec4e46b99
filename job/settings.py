"""The training settings of a job: one model, read by both front doors.

The fields live in groups (:mod:`isthmus.job.setting_groups`: schedule, inner
optimizer, exchange, outer rounds, each strategy's own, checkpointing, timeouts,
network, placement), each field once with its default, type, doc and check.
:class:`TrainSettings` composes them into the job file's flat ``train:``
section, adds the strategy and the rules between groups; the strategy classes
take their groups' fields as keyword arguments (:func:`strategy_settings`), with
the same defaults, checks and messages. The same names are the keys ``isthmus
config set`` and ``isthmus tune --apply`` use, and the names in ``summary.json``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from isthmus.job import setting_groups as groups
from isthmus.job.basics import FieldError
from isthmus.job.compressor import SparseSettings, is_sparse, parse_sparse
from isthmus.job.setting_checks import SettingError

STRATEGIES = ("sync", "diloco", "streaming", "async")
STRATEGY_DEPENDENT = ("codec", "error_feedback", "inner_optimizer")
"""Settings whose default depends on the strategy: unset in a job file, they follow a
strategy changed on the command line (``--strategy``, ``--compare``)."""

GROUPS: tuple[type, ...] = (
    groups.Schedule,
    groups.Inner,
    groups.Exchange,
    groups.Outer,
    groups.DiLoCoSettings,
    groups.StreamingSettings,
    groups.AsyncSettings,
    groups.Checkpointing,
    groups.Timeouts,
    groups.Network,
    groups.Placement,
)
"""Every group of the ``train:`` section, in the order the job file lists them."""

STRATEGY_GROUPS: dict[str, tuple[type, ...]] = {
    "sync": (groups.Exchange,),
    "diloco": (groups.Exchange, groups.Outer, groups.DiLoCoSettings),
    "streaming": (groups.Exchange, groups.Outer, groups.StreamingSettings),
    "async": (groups.Exchange, groups.Outer, groups.AsyncSettings),
}
"""The groups each strategy class takes as keyword arguments (the rest belong to the
loop that drives it: ``isthmus run``'s, or the user's own)."""

STRATEGY_EXTRAS: dict[str, tuple[str, ...]] = {
    "sync": ("grad_clip", "rejoin_timeout_s"),
    "diloco": ("rejoin_timeout_s",),
    "streaming": ("rejoin_timeout_s",),
    "async": ("rejoin_timeout_s",),
}
"""Single fields of other groups a strategy class also takes: how long it waits to be
let back in, and (``sync``, which steps the averaged gradient itself) the clip."""


def strategy_keys(strategy: str) -> tuple[str, ...]:
    """The settings ``strategy``'s class takes as keyword arguments."""
    names = [f.name for g in STRATEGY_GROUPS[strategy] for f in dataclasses.fields(g)]
    return (*names, *STRATEGY_EXTRAS[strategy])


class _Composed:
    """The methods of :class:`TrainSettings` (its fields come from the groups)."""

    def _fill_strategy_defaults(self) -> None:
        """``codec``, ``error_feedback`` and ``inner_optimizer`` left unset: what
        measured best for the strategy (:data:`STRATEGY_DEPENDENT`)."""
        if self.codec is None:
            object.__setattr__(self, "codec", "none" if self.strategy == "sync" else "int2+zstd")
        if self.error_feedback is None:
            name = self.codec.partition("+")[0] if isinstance(self.codec, str) else ""
            # The sparse codec needs it with every strategy (what it does not send
            # would never be sent); the DiLoCo family's pseudo-gradients gain from it
            # with any lossy codec.
            lossy = self.strategy != "sync" and name not in ("", "none")
            object.__setattr__(self, "error_feedback", is_sparse(name) or lossy)
        if self.inner_optimizer is None:
            chosen = "site_adamw" if self.strategy == "diloco" else "adamw"
            object.__setattr__(self, "inner_optimizer", chosen)

    def _check_compressor(self) -> None:
        """``codec: topk`` with ``compressor``: check the settings and write them into
        the codec string; ``compressor`` for another codec is refused."""
        if not is_sparse(self.codec):
            if self.compressor is not None:
                raise SettingError(
                    "compressor",
                    f"holds the topk codec's settings, but codec is {self.codec!r}: "
                    "set codec: topk, or remove compressor",
                )
            return
        name, plus, stage = self.codec.partition("+")
        if plus and stage != "zstd":
            raise SettingError(
                "codec",
                f"unknown codec {self.codec!r}: the only lossless stage is +zstd (e.g. topk+zstd)",
            )
        if ":" in name and self.compressor is not None:
            raise SettingError(
                "compressor",
                f"codec {self.codec!r} already carries its settings; give them in one place",
            )
        try:
            settings = (
                parse_sparse(self.codec)[0]
                if ":" in name
                else SparseSettings.from_mapping(self.compressor)
            )
        except FieldError as exc:  # the compressor's own checks: a train setting here
            raise SettingError(exc.field, exc.reason) from None
        object.__setattr__(self, "codec", settings.spec() + ("+zstd" if plus else ""))
        object.__setattr__(self, "compressor", None)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise SettingError(
                "strategy",
                f"unknown strategy {self.strategy!r}; use one of {', '.join(STRATEGIES)}",
            )
        self._fill_strategy_defaults()
        if isinstance(self.codec, str):
            self._check_compressor()
        for group in GROUPS:  # each group checks its own fields
            self.group(group)
        # The rules between the strategy and a group that is not its own.
        if self.round_seconds is not None and self.strategy != "diloco":
            raise SettingError(
                "round_seconds",
                f"time-budgeted rounds are a diloco setting; strategy {self.strategy!r} "
                "keeps every site in step (remove round_seconds or use strategy: diloco)",
            )
        if self.strategy == "streaming":
            self._check_streaming_schedule()
        if self.late_contributions != "drop" and self.strategy != "async":
            raise SettingError(
                "late_contributions",
                f"late contributions are an async setting; strategy {self.strategy!r} "
                "applies every round's average in that round (remove late_contributions "
                "or use strategy: async)",
            )

    def _check_streaming_schedule(self) -> None:
        """Every fragment syncs once a period, and one exchange ends before the next."""
        if self.fragments > self.sync_every:
            raise SettingError(
                "fragments",
                f"{self.fragments} fragments cannot sync within sync_every={self.sync_every}",
            )
        spacing = groups.fragment_spacing(self.sync_every, self.fragments)
        if self.overlap_steps > spacing:
            raise SettingError(
                "overlap_steps",
                f"must be an integer in [0, {spacing}] (the steps between two fragments' "
                f"exchanges, sync_every / fragments) so one fragment's exchange ends before "
                f"the next starts, got {self.overlap_steps!r}",
            )

    def group(self, group: type) -> Any:
        """This group's fields, as the group's dataclass."""
        return group(**{f.name: getattr(self, f.name) for f in dataclasses.fields(group)})

    def strategy_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of this strategy's class (:func:`strategy_keys`)."""
        return {name: getattr(self, name) for name in strategy_keys(self.strategy)}

    @property
    def site_wait_s(self) -> float:
        """The longest a rank may wait for the others of its site in a collective that
        waits on other sites or the membership (their own bounds are the round deadline
        and the rejoin timeout; this only keeps the fabric from firing first)."""
        return self.rejoin_timeout_s + 2 * self.round_deadline_s

    def quorum(self, sites: int) -> int:
        """``min_sites`` for a job of ``sites`` sites."""
        return self.min_sites or (sites + 1) // 2

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class _Strategy:
    strategy: str = "diloco"
    """``sync`` (all-reduce gradients every step), ``diloco`` (local steps, then an outer
    step on the averaged pseudo-gradient), ``streaming`` (DiLoCo in overlapped fragments)
    or ``async`` (the exchange hides behind the next round's compute)."""


def _compose() -> type:
    fields: list[tuple[str, Any, Any]] = []
    for source in (_Strategy, *GROUPS):
        for f in dataclasses.fields(source):
            fields.append((f.name, f.type, dataclasses.field(default=f.default)))
    return dataclasses.make_dataclass(
        "TrainSettings",
        fields,
        bases=(_Composed,),
        frozen=True,
        kw_only=True,
        namespace={
            "__doc__": "How sites train and agree on the model: every group's fields, "
            "flat, as the job file's ``train:`` section has them.",
            "__module__": __name__,
        },
    )


TrainSettings: Any = _compose()

SETTING_NAMES = tuple(f.name for f in dataclasses.fields(TrainSettings))


def loop_keys() -> tuple[str, ...]:
    """The settings of the loop that drives a strategy, not of any strategy class
    (schedule, inner optimizer, checkpoints, timeouts, network, placement)."""
    taken = {name for strategy in STRATEGIES for name in strategy_keys(strategy)}
    skip = taken | {"strategy", *STRATEGY_DEPENDENT}
    return tuple(name for name in SETTING_NAMES if name not in skip)


BUILTIN_LOOP_SETTINGS = (
    "warmup_steps",
    "lr_schedule",
    "eval_every",
    "inner_optimizer",
    "inner_lr",
    "inner_beta1",
    "inner_beta2",
    "inner_weight_decay",
    "grad_clip",
    "batch_size",
    "precision",
    "compile",
)
"""Settings only the built-in loop applies (its optimizer, schedule, batches, held-out
evaluations and numerics). A script (``isthmus run JOB -- CMD``) trains with its
own, so its records leave these out; a strategy class that takes one of them
(``sync`` clips the averaged gradient: ``grad_clip``) applies it for scripts too."""


def applied_keys(strategy: str, *, builtin_loop: bool = True) -> tuple[str, ...]:
    """The settings that take effect in a run of ``strategy``, in the job file's order:
    the strategy's own and its loop's (``builtin_loop``: the built-in loop's too);
    never another strategy's. ``sync_every`` is every strategy's: without
    ``eval_every`` it sets when the built-in loop evaluates, and it numbers rounds."""
    mine = {"strategy", *strategy_keys(strategy), *loop_keys(), *STRATEGY_DEPENDENT, "sync_every"}
    if builtin_loop:
        mine |= set(BUILTIN_LOOP_SETTINGS)  # grad_clip: the loop clips for the DiLoCo family
    else:
        mine -= set(BUILTIN_LOOP_SETTINGS) - set(strategy_keys(strategy))
    return tuple(name for name in SETTING_NAMES if name in mine)


def applied_settings(settings: Any, *, builtin_loop: bool = True) -> dict[str, Any]:
    """``settings`` as a run records them: only what took effect (:func:`applied_keys`)."""
    values = settings.to_dict()
    keys = applied_keys(settings.strategy, builtin_loop=builtin_loop)
    return {name: values[name] for name in keys}


def strategy_settings(strategy: str, given: dict[str, Any], job: Any = None) -> Any:
    """A strategy class's keyword arguments checked as a job file's ``train:`` section
    is (the same rules, the same messages), with the job file's defaults for the rest.
    A key the class does not take is refused, naming the ones it does. ``job``: the
    settings of the job the site runs, whose loop settings (the round deadline, ...)
    the rules between fields are checked against."""
    keys = strategy_keys(strategy)
    for name in given:
        if name not in keys:
            where = (
                f"a setting of the loop, not of the {strategy} class"
                if name in SETTING_NAMES
                else "not a setting"
            )
            raise SettingError(name, f"{where}; the {strategy} class takes {', '.join(keys)}")
    loop = {name: getattr(job, name) for name in loop_keys()} if job is not None else {}
    return TrainSettings(strategy=strategy, **loop, **given)


def settings_problems(given: dict[str, Any]) -> tuple[Any, list[SettingError]]:
    """A ``train:`` section's settings, or every problem in it at once: each group
    is checked alone (a bad value in one does not hide another's), then, when they
    all pass, the rules between them."""
    strategy = given.get("strategy", _Strategy.strategy)
    problems: list[SettingError] = []
    if strategy not in STRATEGIES:
        try:
            TrainSettings(strategy=strategy)
        except SettingError as exc:
            problems.append(exc)
        strategy = _Strategy.strategy
    for group in GROUPS:
        mine = {f.name: given[f.name] for f in dataclasses.fields(group) if f.name in given}
        try:
            if group is groups.Exchange:  # filled for the strategy first
                TrainSettings(strategy=strategy, **mine)
            else:  # the group's own rules only: the others' defaults are not the file's
                group(**mine)
        except SettingError as exc:
            problems.append(exc)
    if problems:
        return None, problems
    try:
        return TrainSettings(**given), []
    except SettingError as exc:
        return None, [exc]


def settings_warnings(given: dict[str, Any], settings: Any) -> list[tuple[str, str]]:
    """(field, why) for each setting a ``train:`` section gives that cannot take
    effect as written: another strategy's, or a round that never comes."""
    found = []
    mine = applied_keys(settings.strategy)
    for name in given:
        if name in mine:
            continue
        owners = [s for s in STRATEGIES if name in strategy_keys(s)]
        found.append(
            (name, f"a setting of {' and '.join(owners)}; strategy {settings.strategy} does "
             "not use it (it applies if --strategy or --compare picks one that does)")
        )  # fmt: skip
    if settings.strategy != "sync" and settings.sync_every > settings.steps:
        found.append(
            ("sync_every", f"{settings.sync_every} is more than steps ({settings.steps}): no "
             "round runs before the run's final synchronisation")
        )  # fmt: skip
    return found
