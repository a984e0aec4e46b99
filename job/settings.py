"""The training settings of a job: one set of names everywhere.

The keys of a job file's ``train:`` section are exactly these names; so are
the keyword arguments of the strategy classes (the ``isthmus run``-only ones
say so), the keys ``isthmus config set``
and ``isthmus tune --apply`` use, and the names in ``summary.json``. Units are
in the names. Each field is validated here, once, with the fix in the message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from isthmus.job.basics import CODECS, FieldError, is_number
from isthmus.job.compressor import SPARSE, SparseSettings, is_sparse, parse_sparse

MAX_CONNECTIONS_PER_PEER = 16
"""More TCP connections than this to one peer rank only add handshakes and buffers:
16 windows of 16 MiB fill 10 Gbit/s at 200 ms."""

STRATEGIES = ("sync", "diloco", "streaming", "async")
SCHEDULES = ("cosine", "constant", "wsd")
MERGES = ("mix", "eager")
INNER_OPTIMIZERS = ("adamw", "site_adamw")
STRATEGY_DEPENDENT = ("codec", "error_feedback", "inner_optimizer")
"""Settings whose default depends on the strategy: unset in a job file, they follow a
strategy changed on the command line (``--strategy``, ``--compare``)."""
ALGORITHMS = ("direct", "gather", "ring", "two_level", "auto")
DEVICES = ("auto", "cuda", "cpu")
PRECISIONS = ("fp32", "bf16")
OUTER_STATES = ("device", "host")
"""What follows the linear warm-up of the inner learning rate: ``cosine`` decay to 10%
of the peak, the peak rate held (``constant``: local steps stay useful to the end,
which short DiLoCo runs from scratch need; see the README's convergence table), or
``wsd`` (warm-up, stable, decay): the peak held, then a linear decay to 10% over the
last :data:`isthmus.intra.schedule.WSD_DECAY_FRACTION` of the steps."""


class SettingError(FieldError):
    """A training setting is invalid; ``field`` names it and the message gives the fix."""


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    """How sites train and agree on the model."""

    strategy: str = "diloco"
    """``sync`` (all-reduce gradients every step), ``diloco`` (local steps, then an outer
    step on the averaged pseudo-gradient), ``streaming`` (DiLoCo in overlapped fragments)
    or ``async`` (the exchange hides behind the next round's compute)."""

    steps: int = 200
    """Inner optimizer steps per site for the whole run."""

    sync_every: int = 50
    """Inner steps between synchronisations (DiLoCo's H). Larger sends fewer WAN bytes
    and converges slower; ``isthmus tune`` picks it for a link."""

    round_seconds: float | None = None
    """``diloco``: time-budgeted rounds. A round also ends after this many seconds, so a
    slow site takes fewer inner steps (weighted by its tokens) instead of holding the
    others up; ``sync_every`` is then the most steps a round takes, and the run ends
    for every site when the first one has taken ``steps``."""

    outer_lr: float = 1.0
    """Outer learning rate. The default with ``outer_momentum: 0`` is plain averaging of
    the sites' models, which reached a lower held-out loss than the DiLoCo paper's
    Nesterov (0.7, 0.9) in every measurement here: three sites across continents, H=10,
    600 steps, 2.295 against 2.694; four sites, 600 steps, +3.3% of sync against +19.3%
    (docs/benchmarks.md, "Default recipe"). The paper's setting suits long runs at
    large H: ``outer_lr: 0.7, outer_momentum: 0.9``."""

    outer_momentum: float = 0.0
    """Nesterov momentum of the outer optimizer (0: plain averaging; the DiLoCo paper's
    is 0.9)."""

    codec: str | None = None
    """How values cross the WAN: ``none`` (exact float32), ``fp16``, ``bf16``, ``int8``,
    ``int4`` or ``int2`` (ternary: with ``error_feedback``, for pseudo-gradients),
    or ``topk`` (sparse: each chunk's largest values, 2 or 4 bits each, settings in
    ``compressor``; with ``error_feedback``), optionally followed by ``+zstd``
    (byte-shuffle then zstd: ``int2+zstd`` is about 1.6x smaller than ``int2``, most
    ternary values being zero). Default: ``int2+zstd`` for the DiLoCo family, whose
    held-out loss it left where float32 put it at 32x fewer bytes (2.295 against 2.304,
    three sites, H=10), and ``none`` for sync, whose gradients cross every step."""

    compressor: dict | None = None
    """``codec: topk``'s settings: ``density`` (share of each chunk's values sent, in
    (0, 1]; default 0.02), ``bits`` (2 or 4 per sent value; default 2) and ``chunk``
    (values among which the largest are chosen, a power of two from 256 to 65536;
    default 4096). Once checked, ``codec`` holds them in its string
    (``topk:bits=2,chunk=4096,density=0.02``), which is what crosses the WAN."""

    error_feedback: bool | None = None
    """With a lossy codec, carry what it lost of each site's values into the next
    exchange of the same values (keeps ``int4`` and ``int8`` unbiased over rounds).
    Default: on for the DiLoCo family with a lossy codec, off otherwise."""

    late_contributions: str = "drop"
    """``async``: what becomes of a site's pseudo-gradient when the site missed its
    round (``round_deadline_s`` passed, the others went on without it, and it caught
    up from them): ``drop`` it, or ``stale``: the site adds it, times
    ``staleness_weight``, to its next contribution, so its compute still counts, a
    round late and damped."""

    staleness_weight: float = 0.5
    """``async`` with ``late_contributions: stale``: the weight of a late
    pseudo-gradient in the site's next contribution, in (0, 1]."""

    fragments: int = 2
    """``streaming``: parts of the model that sync at staggered steps."""

    overlap_steps: int = 1
    """``streaming``: inner steps each fragment's exchange overlaps."""

    alpha: float = 0.5
    """``streaming`` with ``merge: mix``: ``local = alpha * local + (1 - alpha) * global``."""

    algorithm: str | None = None
    """How the sites average across the WAN: ``direct`` (every site owns a slice and
    talks to every other), ``gather`` (every site sends everything to every site:
    one trip instead of two, more bytes), ``ring`` (each site to its successor),
    ``two_level`` (inside each region, across regions between counterparts, inside
    again; needs ``regions:``) or ``auto`` (what the cost model predicts fastest on
    the job's emulated links, for each round's encoded bytes). Default:
    ``two_level`` where the job has regions, ``auto`` on emulated links, else
    ``direct``."""

    merge: str = "mix"
    """``streaming``: how an exchange that overlapped inner steps is applied. ``mix``
    (the Streaming DiLoCo paper's): the local parameters mixed with the new global
    ones by ``alpha``. ``eager``: the new global parameters plus the progress this
    site made while the exchange was on the wire; the site trained those steps on
    from its own result, the stand-in for the average until it arrives."""

    inner_optimizer: str | None = None
    """``isthmus run``: ``adamw``, or ``site_adamw``: AdamW whose second moment is
    corrected to the batch the sites' averaged step stands for
    (:class:`~isthmus.intra.site_adamw.SiteAdamW`; each rank's batch is taken as two
    halves, whose difference measures the gradient's noise). Default: what
    measured best on the three-continents job (docs/benchmarks.md, "Default
    recipe"): ``site_adamw`` for ``diloco``, whose sites average steps each took on
    a share of the batch; ``adamw`` for sync (its one step sees the whole batch),
    for ``streaming`` (with its mixing merge SiteAdamW's larger local steps ended
    worse) and for ``async`` (the same loss, for the extra compute)."""

    inner_lr: float = 3e-3
    """``isthmus run``: peak learning rate of the inner optimizer (AdamW)."""

    warmup_steps: int = 20
    """``isthmus run``: inner steps of linear learning-rate warm-up; ``lr_schedule``
    says what follows."""

    lr_schedule: str = "cosine"
    """``isthmus run``: after the warm-up, ``cosine`` decay to 10% of ``inner_lr`` at
    the last step; ``constant``: ``inner_lr`` held to the end (short DiLoCo runs
    from scratch do better with it; the README's convergence table); or ``wsd``:
    held, then a linear decay to 10% over the last fifth of the steps."""

    inner_beta1: float = 0.9
    """``isthmus run``: AdamW's first-moment decay (the inner optimizer's)."""

    inner_beta2: float = 0.999
    """``isthmus run``: AdamW's second-moment decay; 0.95 is the usual choice for
    language models (it follows the gradient's scale faster)."""

    inner_weight_decay: float = 0.01
    """``isthmus run``: AdamW's decoupled weight decay."""

    grad_clip: float = 1.0
    """``isthmus run``: before every inner step, scale the gradient down to this norm
    (the whole model's, every stage and shard) where it is larger; 0: never. With
    ``sync`` it is the averaged gradient that is clipped, after the exchange."""

    batch_size: int = 8
    """``isthmus run``: sequences per step, per data-parallel rank."""

    eval_every: int | None = None
    """``isthmus run``: held-out loss every this many inner steps; 0: only at the end.
    Default (null): every ``sync_every`` steps (after DiLoCo's round: the global
    model), or after every round where ``sync_every`` can change while the job runs.
    An evaluation stops the training thread while exchanges in flight go on (a
    Streaming fragment, an async round), which matters when timing a run."""

    checkpoint_every: int = 0
    """``isthmus run``: checkpoint every site after every this many rounds (outer steps;
    with ``sync``, steps), in ``RUN_DIR/checkpoints/``, so ``isthmus run --resume
    RUN_DIR`` can go on after a stop. 0: no checkpoints. ``sync`` and ``diloco`` only
    (the others have exchanges in flight at every step)."""

    round_deadline_s: float = 120.0
    """``isthmus run``: how long a round waits for a site that does not deliver (down,
    cut off, slow) before it fails; with ``diloco`` the others then go on without
    that site. Longer than the slowest round, shorter than an outage worth
    waiting out."""

    collective_timeout_s: float = 60.0
    """``isthmus run``: how long a rank waits for the other ranks of its site in a
    collective over the fast fabric (gradient averaging, FSDP, tensor parallel) before
    the site fails. Shorter than ``round_deadline_s``: a site with a dead or hung rank
    fails and can be restarted before the other sites give up on it. (In-site waits
    for other sites or for the membership are bounded by the two settings below.)"""

    rejoin_timeout_s: float = 600.0
    """``isthmus run``: how long a site waits to be let into the run
    (restarted, cut off, below quorum) before it gives up. Longer than
    ``round_deadline_s``: the others may need that long to notice the site was gone."""

    connections_per_peer: int | str = "auto"
    """TCP connections each rank opens to each peer rank; every exchange's chunks are
    dealt over them. One connection carries at most its TCP window per round trip,
    and Linux caps the window at the receiver's largest socket buffer (the third
    value of ``net.ipv4.tcp_rmem``): a link whose bandwidth-delay product is larger
    needs several. ``auto``: for a job on emulated links (a ``wan:`` section) as
    many as this site's longest-fat link needs with the emulator's window
    (``window_bytes``, 16 MiB: 3 for 1 Gbit/s at 300 ms); on a real WAN, 1. There,
    give ``ceil(1.25 x bandwidth x RTT / window)``, e.g. 3 for 1 Gbit/s at 300 ms
    with 16 MiB buffers, or raise the buffers (docs/two-clusters.md)."""

    device: str = "auto"
    """Where each rank computes: ``cuda`` (its GPU, ``cuda:LOCAL_RANK``: one process
    per GPU), ``cpu``, or ``auto``: the GPU when the rank sees one, else the CPU."""

    precision: str = "fp32"
    """``isthmus run``: ``fp32``, or ``bf16``: the forward and backward in bfloat16
    under autocast while the weights, the optimizer state, the gradient reductions
    and everything that crosses the WAN stay float32."""

    compile: bool = False
    """``isthmus run``: ``torch.compile`` each transformer block of the built-in model
    (the first steps take longer while it compiles)."""

    outer_state: str = "device"
    """Where the DiLoCo family keeps its outer parameters and momentum (two float32
    copies of the rank's share of the model): ``device`` (beside the model, fastest)
    or ``host`` (pinned CPU memory, for a model whose extra copies do not fit on the
    GPU; each round then copies the pseudo-gradient out and the new model back)."""

    min_sites: int = 0
    """``isthmus run``: the quorum. When sites are lost, the others
    train on while at least this many sites remain, and pause (saying so) below
    it until enough are back. 0: half the job's sites, rounded up."""

    def _fill_strategy_defaults(self) -> None:
        """``codec`` and ``error_feedback`` left unset: what measured best for the
        strategy (:data:`STRATEGY_DEPENDENT`)."""
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
        _positive_int("steps", self.steps)
        _positive_int("sync_every", self.sync_every)
        if not (is_number(self.outer_lr) and self.outer_lr > 0):
            raise SettingError("outer_lr", f"must be a number > 0, got {self.outer_lr!r}")
        if not (is_number(self.outer_momentum) and 0 <= self.outer_momentum < 1):
            raise SettingError("outer_momentum", f"must be in [0, 1), got {self.outer_momentum!r}")
        self._check_compressor()
        name, plus, stage = (
            self.codec.partition("+") if isinstance(self.codec, str) else ("", "", "")
        )
        if (name not in CODECS and not is_sparse(name)) or (plus and stage != "zstd"):
            raise SettingError(
                "codec",
                f"unknown codec {self.codec!r}; use one of {', '.join(CODECS)}, {SPARSE}, "
                "optionally followed by +zstd (e.g. int2+zstd)",
            )
        if self.round_seconds is not None:
            if not (is_number(self.round_seconds) and self.round_seconds > 0):
                raise SettingError(
                    "round_seconds",
                    f"must be a number of seconds > 0 (or null: rounds of sync_every steps), "
                    f"got {self.round_seconds!r}",
                )
            if self.strategy != "diloco":
                raise SettingError(
                    "round_seconds",
                    f"time-budgeted rounds are a diloco setting; strategy {self.strategy!r} "
                    "keeps every site in step (remove round_seconds or use strategy: diloco)",
                )
        if not isinstance(self.error_feedback, bool):
            raise SettingError(
                "error_feedback", f"must be true or false, got {self.error_feedback!r}"
            )
        if is_sparse(self.codec) and not self.error_feedback:
            raise SettingError(
                "error_feedback",
                "codec topk sends only the largest values of each chunk, and without error "
                "feedback the rest would never be sent: set error_feedback: true",
            )
        check_late_contributions(self.late_contributions, self.staleness_weight)
        if self.late_contributions != "drop" and self.strategy != "async":
            raise SettingError(
                "late_contributions",
                f"late contributions are an async setting; strategy {self.strategy!r} "
                "applies every round's average in that round (remove late_contributions "
                "or use strategy: async)",
            )
        _positive_int("fragments", self.fragments)
        if not (isinstance(self.overlap_steps, int) and self.overlap_steps >= 0):
            raise SettingError(
                "overlap_steps", f"must be an integer >= 0, got {self.overlap_steps!r}"
            )
        if not (is_number(self.alpha) and 0 <= self.alpha <= 1):
            raise SettingError("alpha", f"must be in [0, 1], got {self.alpha!r}")
        if self.algorithm is not None and self.algorithm not in ALGORITHMS:
            raise SettingError(
                "algorithm",
                f"unknown algorithm {self.algorithm!r}; use one of {', '.join(ALGORITHMS)}",
            )
        if self.merge not in MERGES:
            raise SettingError(
                "merge", f"unknown merge {self.merge!r}; use one of {', '.join(MERGES)}"
            )
        if self.inner_optimizer not in INNER_OPTIMIZERS:
            raise SettingError(
                "inner_optimizer",
                f"unknown inner optimizer {self.inner_optimizer!r}; use one of "
                f"{', '.join(INNER_OPTIMIZERS)}",
            )
        if not (is_number(self.inner_lr) and self.inner_lr > 0):
            raise SettingError("inner_lr", f"must be a number > 0, got {self.inner_lr!r}")
        if not (is_number(self.grad_clip) and self.grad_clip >= 0):
            raise SettingError(
                "grad_clip",
                f"must be a gradient norm >= 0 (0: no clipping), got {self.grad_clip!r}",
            )
        if self.lr_schedule not in SCHEDULES:
            raise SettingError(
                "lr_schedule",
                f"unknown schedule {self.lr_schedule!r}; use one of {', '.join(SCHEDULES)}",
            )
        for name in ("inner_beta1", "inner_beta2"):
            value = getattr(self, name)
            if not (is_number(value) and 0 <= value < 1):
                raise SettingError(name, f"must be in [0, 1), got {value!r}")
        if not (is_number(self.inner_weight_decay) and self.inner_weight_decay >= 0):
            raise SettingError(
                "inner_weight_decay", f"must be a number >= 0, got {self.inner_weight_decay!r}"
            )
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            raise SettingError(
                "warmup_steps", f"must be an integer >= 0, got {self.warmup_steps!r}"
            )
        _positive_int("batch_size", self.batch_size)
        if self.eval_every is not None:
            _non_negative_int(
                "eval_every",
                self.eval_every,
                "inner steps; 0: only at the end; null: every sync_every steps",
            )
        _non_negative_int("checkpoint_every", self.checkpoint_every, "rounds; 0: no checkpoints")
        connections = self.connections_per_peer
        if connections != "auto" and not (
            isinstance(connections, int)
            and not isinstance(connections, bool)
            and 1 <= connections <= MAX_CONNECTIONS_PER_PEER
        ):
            raise SettingError(
                "connections_per_peer",
                f"must be auto or an integer in 1..{MAX_CONNECTIONS_PER_PEER} (TCP connections "
                f"to each peer rank), got {connections!r}",
            )

        if not (is_number(self.round_deadline_s) and self.round_deadline_s > 0):
            raise SettingError(
                "round_deadline_s",
                f"must be a number of seconds > 0, got {self.round_deadline_s!r}",
            )
        for name in ("collective_timeout_s", "rejoin_timeout_s"):
            value = getattr(self, name)
            if not (is_number(value) and value > 0):
                raise SettingError(name, f"must be a number of seconds > 0, got {value!r}")
        if self.collective_timeout_s >= self.round_deadline_s:
            raise SettingError(
                "collective_timeout_s",
                f"{self.collective_timeout_s:g} s must be shorter than round_deadline_s "
                f"({self.round_deadline_s:g} s): a site with a hung rank must fail before the "
                "other sites give up on it; lower it, or raise round_deadline_s",
            )
        if self.rejoin_timeout_s <= self.round_deadline_s:
            raise SettingError(
                "rejoin_timeout_s",
                f"{self.rejoin_timeout_s:g} s must be longer than round_deadline_s "
                f"({self.round_deadline_s:g} s): a returning site must wait at least as long "
                "as the others take to notice it was gone; raise it, or lower round_deadline_s",
            )
        _non_negative_int("min_sites", self.min_sites, "sites; 0: half the job's, rounded up")
        _one_of("device", self.device, DEVICES, "where each rank computes")
        _one_of("precision", self.precision, PRECISIONS, "the compute precision")
        if not isinstance(self.compile, bool):
            raise SettingError("compile", f"must be true or false, got {self.compile!r}")
        _one_of("outer_state", self.outer_state, OUTER_STATES, "where the outer state lives")

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


SETTING_NAMES = tuple(f.name for f in dataclasses.fields(TrainSettings))


def _positive_int(name: str, value: Any) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise SettingError(name, f"must be an integer >= 1, got {value!r}")


LATE_CONTRIBUTIONS = ("drop", "stale")


def check_late_contributions(late: Any, weight: Any) -> None:
    """Validate ``late_contributions`` and ``staleness_weight`` (job files and the API)."""
    if late not in LATE_CONTRIBUTIONS:
        raise SettingError(
            "late_contributions",
            f"unknown policy {late!r}; use drop (a late site's pseudo-gradient is dropped) "
            "or stale (it is added, damped, to the site's next contribution)",
        )
    if not (is_number(weight) and 0 < weight <= 1):
        raise SettingError("staleness_weight", f"must be a number in (0, 1], got {weight!r}")


def _one_of(name: str, value: Any, choices: tuple[str, ...], meaning: str) -> None:
    if value not in choices:
        raise SettingError(
            name, f"unknown value {value!r} ({meaning}); use one of {', '.join(choices)}"
        )


def _non_negative_int(name: str, value: Any, meaning: str) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise SettingError(name, f"must be an integer >= 0 ({meaning}), got {value!r}")
