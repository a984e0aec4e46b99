"""The training settings, by topic: one dataclass per group, each field once.

Each field holds its default, its type and its one-line doc here, and each group
checks its own fields (the message names the field and the fix).
:class:`~isthmus.job.settings.TrainSettings` composes the groups into the job
file's flat ``train:`` section; the strategy classes take the groups that are
theirs (:data:`~isthmus.job.settings.STRATEGY_GROUPS`) as keyword arguments, with
these defaults, so the two front doors cannot differ.
"""

from __future__ import annotations

from dataclasses import dataclass

from isthmus.job.basics import CODECS, is_number
from isthmus.job.compressor import SPARSE, is_sparse
from isthmus.job.setting_checks import (
    SettingError,
    boolean,
    fraction,
    non_negative_int,
    one_of,
    positive_int,
    positive_number,
)

MAX_CONNECTIONS_PER_PEER = 16
"""More TCP connections than this to one peer rank only add handshakes and buffers:
16 windows of 16 MiB fill 10 Gbit/s at 200 ms."""

SCHEDULES = ("cosine", "constant", "wsd")
"""What follows the linear warm-up of the inner learning rate: ``cosine`` decay to 10%
of the peak, the peak rate held (``constant``: local steps stay useful to the end,
which short DiLoCo runs from scratch need; see the README's convergence table), or
``wsd`` (warm-up, stable, decay): the peak held, then a linear decay to 10% over the
last :data:`isthmus.intra.schedule.WSD_DECAY_FRACTION` of the steps."""
MERGES = ("mix", "eager")
INNER_OPTIMIZERS = ("adamw", "site_adamw")
ALGORITHMS = ("direct", "gather", "ring", "two_level", "auto")
DEVICES = ("auto", "cuda", "cpu")
PRECISIONS = ("fp32", "bf16")
OUTER_STATES = ("device", "host")
LATE_CONTRIBUTIONS = ("drop", "stale")


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """How long each site trains, and its learning-rate schedule (every strategy)."""

    steps: int = 200
    """Inner optimizer steps per site for the whole run."""

    warmup_steps: int = 20
    """``isthmus run``: inner steps of linear learning-rate warm-up; ``lr_schedule``
    says what follows."""

    lr_schedule: str = "cosine"
    """``isthmus run``: after the warm-up, ``cosine`` decay to 10% of ``inner_lr`` at
    the last step; ``constant``: ``inner_lr`` held to the end (short DiLoCo runs
    from scratch do better with it; the README's convergence table); or ``wsd``:
    held, then a linear decay to 10% over the last fifth of the steps."""

    eval_every: int | None = None
    """``isthmus run``: held-out loss every this many inner steps; 0: only at the end.
    Default (null): every ``sync_every`` steps (after DiLoCo's round: the global
    model), or after every round where ``sync_every`` can change while the job runs.
    An evaluation stops the training thread while exchanges in flight go on (a
    Streaming fragment, an async round), which matters when timing a run."""

    def __post_init__(self) -> None:
        positive_int("steps", self.steps)
        non_negative_int("warmup_steps", self.warmup_steps, "inner steps of warm-up")
        if self.lr_schedule not in SCHEDULES:
            raise SettingError(
                "lr_schedule",
                f"unknown schedule {self.lr_schedule!r}; use one of {', '.join(SCHEDULES)}",
            )
        if self.eval_every is not None:
            non_negative_int(
                "eval_every",
                self.eval_every,
                "inner steps; 0: only at the end; null: every sync_every steps",
            )


@dataclass(frozen=True, kw_only=True)
class Inner:
    """The inner optimizer every site steps with (every strategy)."""

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

    def __post_init__(self) -> None:
        if self.inner_optimizer is not None and self.inner_optimizer not in INNER_OPTIMIZERS:
            raise SettingError(
                "inner_optimizer",
                f"unknown inner optimizer {self.inner_optimizer!r}; use one of "
                f"{', '.join(INNER_OPTIMIZERS)}",
            )
        positive_number("inner_lr", self.inner_lr)
        fraction("inner_beta1", self.inner_beta1)
        fraction("inner_beta2", self.inner_beta2)
        if not (is_number(self.inner_weight_decay) and self.inner_weight_decay >= 0):
            raise SettingError(
                "inner_weight_decay", f"must be a number >= 0, got {self.inner_weight_decay!r}"
            )
        if not (is_number(self.grad_clip) and self.grad_clip >= 0):
            raise SettingError(
                "grad_clip",
                f"must be a gradient norm >= 0 (0: no clipping), got {self.grad_clip!r}",
            )
        positive_int("batch_size", self.batch_size)


@dataclass(frozen=True, kw_only=True)
class Exchange:
    """What crosses the WAN at each exchange (every strategy)."""

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
    default 4096) and ``feedback_decay`` (how much of what was not sent carries
    into the next exchange, in (0, 1]; default 1). Once checked, ``codec`` holds them in its string
    (``topk:bits=2,chunk=4096,density=0.02``), which is what crosses the WAN."""

    error_feedback: bool | None = None
    """With a lossy codec, carry what it lost of each site's values into the next
    exchange of the same values (keeps ``int4`` and ``int8`` unbiased over rounds).
    Default: on for the DiLoCo family with a lossy codec, off otherwise."""

    def __post_init__(self) -> None:
        if self.codec is None or self.error_feedback is None:
            return  # filled for the strategy by TrainSettings, then checked
        name, plus, stage = (
            self.codec.partition("+") if isinstance(self.codec, str) else ("", "", "")
        )
        if (name not in CODECS and not is_sparse(name)) or (plus and stage != "zstd"):
            raise SettingError(
                "codec",
                f"unknown codec {self.codec!r}; use one of {', '.join(CODECS)}, {SPARSE}, "
                "optionally followed by +zstd (e.g. int2+zstd)",
            )
        boolean("error_feedback", self.error_feedback)
        if is_sparse(self.codec) and not self.error_feedback:
            raise SettingError(
                "error_feedback",
                "codec topk sends only the largest values of each chunk, and without error "
                "feedback the rest would never be sent: set error_feedback: true",
            )


@dataclass(frozen=True, kw_only=True)
class Outer:
    """The DiLoCo family's rounds and outer optimizer (diloco, streaming, async)."""

    sync_every: int = 50
    """Inner steps between synchronisations (DiLoCo's H). Larger sends fewer WAN bytes
    and converges slower; ``isthmus tune`` picks it for a link."""

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

    outer_state: str = "device"
    """Where the DiLoCo family keeps its outer parameters and momentum (two float32
    copies of the rank's share of the model): ``device`` (beside the model, fastest)
    or ``host`` (pinned CPU memory, for a model whose extra copies do not fit on the
    GPU; each round then copies the pseudo-gradient out and the new model back)."""

    def __post_init__(self) -> None:
        positive_int("sync_every", self.sync_every)
        positive_number("outer_lr", self.outer_lr)
        fraction("outer_momentum", self.outer_momentum)
        one_of("outer_state", self.outer_state, OUTER_STATES, "where the outer state lives")


@dataclass(frozen=True, kw_only=True)
class DiLoCoSettings:
    """What only ``diloco`` has."""

    round_seconds: float | None = None
    """``diloco``: time-budgeted rounds. A round also ends after this many seconds, so a
    slow site takes fewer inner steps (weighted by its tokens) instead of holding the
    others up; ``sync_every`` is then the most steps a round takes, and the run ends
    for every site when the first one has taken ``steps``."""

    def __post_init__(self) -> None:
        if self.round_seconds is not None and not (
            is_number(self.round_seconds) and self.round_seconds > 0
        ):
            raise SettingError(
                "round_seconds",
                f"must be a number of seconds > 0 (or null: rounds of sync_every steps), "
                f"got {self.round_seconds!r}",
            )


@dataclass(frozen=True, kw_only=True)
class StreamingSettings:
    """What only ``streaming`` has."""

    fragments: int = 2
    """``streaming``: parts of the model that sync at staggered steps."""

    overlap_steps: int = 1
    """``streaming``: inner steps each fragment's exchange overlaps."""

    alpha: float = 0.5
    """``streaming`` with ``merge: mix``: ``local = alpha * local + (1 - alpha) * global``."""

    merge: str = "mix"
    """``streaming``: how an exchange that overlapped inner steps is applied. ``mix``
    (the Streaming DiLoCo paper's): the local parameters mixed with the new global
    ones by ``alpha``. ``eager``: the new global parameters plus the progress this
    site made while the exchange was on the wire; the site trained those steps on
    from its own result, the stand-in for the average until it arrives."""

    def __post_init__(self) -> None:
        positive_int("fragments", self.fragments)
        non_negative_int("overlap_steps", self.overlap_steps, "inner steps")
        if not (is_number(self.alpha) and 0 <= self.alpha <= 1):
            raise SettingError("alpha", f"must be in [0, 1], got {self.alpha!r}")
        if self.merge not in MERGES:
            raise SettingError(
                "merge", f"unknown merge {self.merge!r}; use one of {', '.join(MERGES)}"
            )


@dataclass(frozen=True, kw_only=True)
class AsyncSettings:
    """What only ``async`` has."""

    late_contributions: str = "drop"
    """``async``: what becomes of a site's pseudo-gradient when the site missed its
    round (``round_deadline_s`` passed, the others went on without it, and it caught
    up from them): ``drop`` it, or ``stale``: the site adds it, times
    ``staleness_weight``, to its next contribution, so its compute still counts, a
    round late and damped."""

    staleness_weight: float = 0.5
    """``async`` with ``late_contributions: stale``: the weight of a late
    pseudo-gradient in the site's next contribution, in (0, 1]."""

    def __post_init__(self) -> None:
        if self.late_contributions not in LATE_CONTRIBUTIONS:
            raise SettingError(
                "late_contributions",
                f"unknown policy {self.late_contributions!r}; use drop (a late site's "
                "pseudo-gradient is dropped) or stale (it is added, damped, to the site's "
                "next contribution)",
            )
        if not (is_number(self.staleness_weight) and 0 < self.staleness_weight <= 1):
            raise SettingError(
                "staleness_weight", f"must be a number in (0, 1], got {self.staleness_weight!r}"
            )


@dataclass(frozen=True, kw_only=True)
class Checkpointing:
    """When sites checkpoint (every strategy)."""

    checkpoint_every: int = 0
    """``isthmus run``: checkpoint every site after every this many rounds (outer steps;
    with ``sync``, steps), in ``RUN_DIR/checkpoints/``, so ``isthmus run --resume
    RUN_DIR`` can go on after a stop. 0: no checkpoints. Every strategy (streaming and async
    save the exchange in flight with the state)."""

    def __post_init__(self) -> None:
        non_negative_int("checkpoint_every", self.checkpoint_every, "rounds; 0: no checkpoints")


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """How long a site waits before it gives up on others, and the quorum."""

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

    min_sites: int = 0
    """``isthmus run``: the quorum. When sites are lost, the others
    train on while at least this many sites remain, and pause (saying so) below
    it until enough are back. 0: half the job's sites, rounded up."""

    def __post_init__(self) -> None:
        positive_number("round_deadline_s", self.round_deadline_s, "a number of seconds")
        positive_number("collective_timeout_s", self.collective_timeout_s, "a number of seconds")
        positive_number("rejoin_timeout_s", self.rejoin_timeout_s, "a number of seconds")
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
        non_negative_int("min_sites", self.min_sites, "sites; 0: half the job's, rounded up")


@dataclass(frozen=True, kw_only=True)
class Network:
    """How the sites' ranks reach each other across the WAN."""

    algorithm: str | None = None
    """How the sites average across the WAN: ``direct`` (every site owns a slice and
    talks to every other), ``gather`` (every site sends everything to every site:
    one trip instead of two, more bytes), ``ring`` (each site to its successor),
    ``two_level`` (inside each region, across regions between counterparts, inside
    again; needs ``regions:``) or ``auto`` (what the cost model predicts fastest on
    the job's emulated links, for each round's encoded bytes). Default:
    ``two_level`` where the job has regions, ``auto`` on emulated links, else
    ``direct``."""

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

    def __post_init__(self) -> None:
        if self.algorithm is not None and self.algorithm not in ALGORITHMS:
            raise SettingError(
                "algorithm",
                f"unknown algorithm {self.algorithm!r}; use one of {', '.join(ALGORITHMS)}",
            )
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


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where and how each rank computes."""

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

    def __post_init__(self) -> None:
        one_of("device", self.device, DEVICES, "where each rank computes")
        one_of("precision", self.precision, PRECISIONS, "the compute precision")
        boolean("compile", self.compile)


def sync_offsets(sync_every: int, fragments: int) -> list[int]:
    """The inner step (1-based, within each period of ``sync_every``) after which
    each fragment starts its exchange."""
    return [(p + 1) * sync_every // fragments for p in range(fragments)]


def fragment_spacing(sync_every: int, fragments: int) -> int:
    """The fewest inner steps between two fragments' exchanges: the most steps one
    exchange may overlap (``overlap_steps``) so it ends before the next starts. An
    exchange due at the step the next one starts is completed first, so the spacing
    itself is allowed."""
    offsets = sync_offsets(sync_every, fragments)
    return min(b - a for a, b in zip([0, *offsets], offsets, strict=False))
