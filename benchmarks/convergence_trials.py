"""Quick single-process trials of the convergence protocol: settings explored before a full run.

``benchmarks/strategies.py`` runs the protocol for real (4 site processes,
gRPC, every byte counted by the engine) and is what the README's table
quotes. A trial here runs the same recipe in one process in about 3-5 min:
4 workers of the tiny GPT, each on its own shard, batch 16 x 64, AdamW 3e-3
with 30 warm-up steps and cosine decay, gradients clipped, 600 steps. It
averages parameters (DiLoCo with plain averaging or an outer Nesterov step)
or gradients (sync) in memory, through a blockwise quantiser that stands for
the codecs, and counts the bytes the direct all-reduce would send. Its
figures are for choosing what to run in full, not for quoting as Isthmus's.

The README's trials (seed 0), one command each (T: ``--sync-every 7 --levels 1
--error-feedback``, ternary at H=7):

    python benchmarks/convergence_trials.py --mode sync
    python benchmarks/convergence_trials.py --sync-every 2
    python benchmarks/convergence_trials.py T
    python benchmarks/convergence_trials.py --sync-every 4 --sign --error-feedback
    python benchmarks/convergence_trials.py T --outer-lr 1.6     (and 2.2)
    python benchmarks/convergence_trials.py T --inner-lr-scale 2   (and 0.6)
    python benchmarks/convergence_trials.py --mode sync --top-k 0.0025
    python benchmarks/convergence_trials.py --sync-every 50 --outer-lr 0.7 --outer-momentum 0.9
    python benchmarks/convergence_trials.py T --moments-every 3,6

The reference recipe's open parts, on DiLoCo H=50 with the outer Nesterov (N:
``--sync-every 50 --outer-lr 0.7 --outer-momentum 0.9``):

    python benchmarks/convergence_trials.py N --beta2 0.95   (and --mode sync --beta2 0.95)
    python benchmarks/convergence_trials.py --sync-every 50 --beta2 0.95
    python benchmarks/convergence_trials.py N --weight-decay 0.1
    python benchmarks/convergence_trials.py N --beta2 0.95 --grad-clip 0
    python benchmarks/convergence_trials.py N --beta2 0.95 --lr 1e-3
    python benchmarks/convergence_trials.py N --beta2 0.95 --inner-lr-scale 0.5
    python benchmarks/convergence_trials.py N --schedule constant   (and --mode sync, and
        --sync-every 50 alone for plain averaging; each again with --beta2 0.95)
    python benchmarks/convergence_trials.py N --schedule constant --beta2 0.95 --seed 1
        (and 2, each with --mode sync; and N --seed 1 for the cosine recipe)

With that recipe (C: ``--schedule constant --beta2 0.95``), plain averaging, seed
0; E: ``--error-feedback``; the README gives each figure:

    python benchmarks/convergence_trials.py C --sync-every 2   (and --outer-lr 2)
    python benchmarks/convergence_trials.py C E --sync-every 13 --levels 7
    python benchmarks/convergence_trials.py C E --sync-every 7 --levels 1
        (and --outer-lr 0.5 --outer-momentum 0.5)
    python benchmarks/convergence_trials.py C E --sync-every 4 --sign
    python benchmarks/convergence_trials.py C E --levels 1 --sync-every 5:150,7:400,10
        (and 10:200,7:400,5; and that with --schedule wsd, next to --mode sync)
    python benchmarks/convergence_trials.py C E --codec int2+zstd --sync-every 5
        (and 7:200,5:400,4; 4; 4:300,3; 32)

Prints one JSON line: the settings, held-out loss, WAN MB and exchanges.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable

import torch

from isthmus.deploy.examples.diloco_train import (
    add_recipe_arguments,
    evaluate,
    parse_schedule,
    sync_every_at,
)
from isthmus.inter.codecs import Codec, CodecError, parse_codec
from isthmus.intra.data import Dataset, ShardSpec, stdlib_corpus
from isthmus.intra.model import GPT, config_for, lm_loss
from isthmus.intra.schedule import learning_rate_at
from isthmus.intra.site_adamw import SiteAdamW

WORKERS = 4
BATCH = 16
WARMUP_STEPS = 30
SCALE_BYTES = 4
"""One float32 scale per block of quantised values."""


def quantise(values: torch.Tensor, levels: int, block: int, sign: bool) -> torch.Tensor:
    """``values`` as the receiver decodes them: rounded to ``levels`` steps either side
    of zero per block (absmax scale; 7: int4, 1: ternary), or with ``sign`` to
    sign x the block's mean magnitude (1 bit). ``levels`` 0: exact."""
    if not sign and levels == 0:
        return values.clone()
    pad = (-values.numel()) % block
    blocks = torch.cat([values, values.new_zeros(pad)]).view(-1, block)
    if sign:
        decoded = torch.sign(blocks) * blocks.abs().mean(1, keepdim=True)
    else:
        scale = blocks.abs().amax(1, keepdim=True).clamp_min(1e-30) / levels
        decoded = torch.round(blocks / scale).clamp(-levels, levels) * scale
    return decoded.view(-1)[: values.numel()]


def sparse_ternary(values: torch.Tensor, keep: float, block: int) -> tuple[torch.Tensor, int]:
    """The largest ``keep`` of each block's values as sign x their mean magnitude,
    the rest zero; and the bytes it takes: 2-bit codes packed four to a byte,
    zstd-compressed (most codes are zero, the position costs what entropy says),
    plus a float32 magnitude per block."""
    import zstandard

    pad = (-values.numel()) % block
    blocks = torch.cat([values, values.new_zeros(pad)]).view(-1, block)
    k = max(1, round(keep * block))
    index = blocks.abs().topk(k, dim=1).indices
    chosen = torch.zeros_like(blocks, dtype=torch.bool).scatter_(1, index, True)
    magnitude = (blocks.abs() * chosen).sum(1, keepdim=True) / k
    decoded = torch.sign(blocks) * magnitude * chosen
    codes = (torch.sign(blocks) * chosen).to(torch.int64) + 1  # 0, 1 (zero), 2
    codes = codes.view(-1)
    codes = torch.cat([codes, codes.new_ones((-codes.numel()) % 4)]).view(-1, 4)
    packed = (codes[:, 0] | codes[:, 1] << 2 | codes[:, 2] << 4 | codes[:, 3] << 6).to(torch.uint8)
    size = len(zstandard.ZstdCompressor(level=3).compress(packed.numpy().tobytes()))
    return decoded.view(-1)[: values.numel()], size + 4 * blocks.shape[0]


def encoded_bytes(count: int, args: argparse.Namespace) -> float:
    if args.sign:
        bits = 1
    elif args.levels == 0:
        return 4.0 * count
    else:
        bits = (2 * args.levels + 1).bit_length()
    return count * bits / 8 + count / args.block * SCALE_BYTES


def flat(model: torch.nn.Module) -> torch.Tensor:
    return flat_of(model.parameters())


def flat_of(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


@torch.no_grad()
def load_flat(tensors: Iterable[torch.Tensor], values: torch.Tensor) -> None:
    """Copy the flat ``values`` into ``tensors`` (parameters, or their gradients)."""
    offset = 0
    for t in tensors:
        t.copy_(values[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def orthonormal(columns: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(columns.double()).Q.float()


def low_rank_round(
    deltas: list[torch.Tensor],
    residuals: list[torch.Tensor],
    shapes: list[tuple[int, ...]],
    factors: list[torch.Tensor | None],
    args: argparse.Namespace,
) -> tuple[torch.Tensor, float]:
    """One PowerSGD step (Vogels et al., 2019) on every matrix of the pseudo-gradient,
    error feedback per site: returns the average every site applies and the bytes each
    all-reduced vector would take, counted once for the reduce-scatter and once for
    the all-gather. ``factors`` holds each matrix's Q, warm-started round to round."""
    corrected = [d + r for d, r in zip(deltas, residuals, strict=True)]
    average = torch.zeros_like(deltas[0])
    sent = 0.0
    offset = 0
    levels = args.low_rank_levels
    for index, shape in enumerate(shapes):
        count = 1
        for n in shape:
            count *= n
        parts = [c[offset : offset + count] for c in corrected]
        if factors[index] is None:  # a vector: the quantiser, as the dense rounds
            sent_parts = [quantise(p, args.levels, args.block, args.sign) for p in parts]
            mean = quantise(sum(sent_parts) / WORKERS, args.levels, args.block, args.sign)
            sent += 2 * encoded_bytes(count, args)
        else:
            rows, columns = shape
            matrices = [p.view(rows, columns) for p in parts]
            q = factors[index]
            p_mean = sum(quantise((m @ q).reshape(-1), levels, args.block, False) for m in matrices)
            p_mean = quantise(p_mean / WORKERS, levels, args.block, False).view(rows, -1)
            p_hat = orthonormal(p_mean)
            q_mean = sum(
                quantise((m.T @ p_hat).reshape(-1), levels, args.block, False) for m in matrices
            )
            q_mean = quantise(q_mean / WORKERS, levels, args.block, False).view(columns, -1)
            factors[index] = q_mean
            mean = (p_hat @ q_mean.T).reshape(-1)
            bits = (2 * levels + 1).bit_length()
            for length in (rows * q.shape[1], columns * q.shape[1]):
                sent += 2 * (length * bits / 8 + length / args.block * SCALE_BYTES)
        average[offset : offset + count] = mean
        offset += count
    if args.error_feedback:
        for w, c in enumerate(corrected):
            residuals[w] = c - average
    return average, sent


def projected_round(
    deltas: list[torch.Tensor],
    residuals: list[torch.Tensor],
    exchange: int,
    args: argparse.Namespace,
) -> tuple[torch.Tensor, float]:
    """Each site's pseudo-gradient (error feedback added) projected onto a random
    subspace the sites share: every block of ``--projection-block`` values times
    the same orthonormal block x m matrix, drawn afresh each round from a seed
    they all know, so no positions cross and the all-reduce sums the projections
    (linear: the projection of the sum). The m values a block becomes go through
    the quantiser; the mean is quantised again, as an owner re-encodes it. Each
    site keeps what its own projection did not carry, which next round's subspace
    partly catches. Returns the average and one vector sent plus one received."""
    block = args.projection_block
    m = max(1, round(args.projection * block))
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + exchange)
    basis = orthonormal(torch.randn(block, m, generator=generator))
    size = deltas[0].numel()
    pad = (-size) % block

    def project(values: torch.Tensor) -> torch.Tensor:
        return torch.cat([values, values.new_zeros(pad)]).view(-1, block) @ basis

    def lift(coefficients: torch.Tensor) -> torch.Tensor:
        return (coefficients @ basis.T).reshape(-1)[:size]

    sent_mean = torch.zeros(-(-size // block), m)
    for w, delta in enumerate(deltas):
        corrected = delta + residuals[w] if args.error_feedback else delta
        coefficients = project(corrected)
        sent = quantise(coefficients.reshape(-1), args.levels, args.block, args.sign)
        sent = sent.view_as(coefficients)
        if args.error_feedback:
            residuals[w] = corrected - lift(sent)
        sent_mean += sent / WORKERS
    mean = quantise(sent_mean.reshape(-1), args.levels, args.block, args.sign)
    nbytes = 2 * encoded_bytes(sent_mean.numel(), args)
    return lift(mean.view_as(sent_mean)), nbytes


def dense_round(
    deltas: list[torch.Tensor],
    residuals: list[torch.Tensor],
    codec: Codec | None,
    args: argparse.Namespace,
) -> tuple[torch.Tensor, float]:
    """Each site's pseudo-gradient through the chosen compression (error feedback
    per site), and their mean through it again, as an owner re-encodes it: the
    average every site applies, and the bytes of one vector sent and one received
    (the sites' mean payload, and the mean's), as :func:`low_rank_round` counts
    them; the caller multiplies by the direct all-reduce's share."""
    sent_parts, sent_bytes = [], 0.0
    for w, delta in enumerate(deltas):
        if args.error_feedback:
            delta = delta + residuals[w]
        sent, nbytes = compress(delta, codec, args)
        if args.error_feedback:
            residuals[w] = delta - sent
        sent_parts.append(sent)
        sent_bytes += nbytes / WORKERS
    average, nbytes = compress(sum(sent_parts) / WORKERS, codec, args)
    return average, sent_bytes + nbytes


def compress(
    values: torch.Tensor, codec: Codec | None, args: argparse.Namespace
) -> tuple[torch.Tensor, float]:
    """``values`` as the receiver decodes them, and their encoded bytes."""
    if args.sparse_ternary:
        return sparse_ternary(values, args.sparse_ternary, args.block)
    if codec is not None:  # the engine's own codec: its bytes, counted
        encoded = codec.encode(values)
        return codec.decode(encoded), float(len(encoded.payload))
    return quantise(values, args.levels, args.block, args.sign), encoded_bytes(values.numel(), args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("diloco", "sync"), default="diloco")
    parser.add_argument("--sync-every", default="50", help="H, or a schedule: 5:100,10:200,50")
    parser.add_argument("--outer-lr", type=float, default=1.0)
    parser.add_argument("--outer-momentum", type=float, default=0.0, help="Nesterov")
    parser.add_argument("--levels", type=int, default=0, help="0: float32, 7: int4, 1: ternary")
    parser.add_argument("--sign", action="store_true", help="1 bit: sign x block mean")
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument(
        "--codec",
        help="diloco: encode with this Isthmus codec (e.g. int2+zstd) instead of the "
        "quantiser above, and count its payload bytes",
    )
    parser.add_argument("--error-feedback", action="store_true")
    parser.add_argument("--top-k", type=float, default=0.0, help="sync: keep this fraction")
    parser.add_argument("--inner-lr-scale", type=float, default=1.0, help="diloco's inner lr")
    parser.add_argument("--grad-clip", type=float, default=1.0, help="0: none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=3e-3)
    add_recipe_arguments(parser, schedule_flag="--schedule")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's")
    parser.add_argument(
        "--moments-every",
        default="",
        metavar="KU,KV",
        help="DES-LOC-style (arXiv 2505.22549): also average AdamW's first moment every "
        "KU rounds and its second every KV rounds (float32), e.g. 3,6",
    )
    parser.add_argument(
        "--low-rank",
        type=int,
        default=0,
        metavar="R",
        help="diloco: PowerSGD-style rank-R pseudo-gradients for every matrix (one power "
        "step a round, Q warm-started, error feedback), vectors through the quantiser",
    )
    parser.add_argument("--low-rank-levels", type=int, default=127, help="P and Q: 127 int8")
    parser.add_argument(
        "--projection",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="diloco: send each block's projection onto SHARE x block random directions "
        "the sites share (drawn anew each round; no positions cross), through the "
        "quantiser, error feedback per site",
    )
    parser.add_argument("--projection-block", type=int, default=256)
    parser.add_argument(
        "--noise-corrected",
        action="store_true",
        help="diloco: each site's optimizer is isthmus.SiteAdamW (the extra noise of its "
        "smaller batch taken out of AdamW's second moment; "
        "its second moment (two half-batch gradients a step)",
    )
    parser.add_argument(
        "--sparse-ternary",
        type=float,
        default=0.0,
        metavar="KEEP",
        help="diloco: the largest KEEP of each block as sign x their mean magnitude, "
        "packed 2-bit codes zstd-compressed (bytes counted as sent)",
    )
    parser.add_argument(
        "--overlap",
        type=int,
        default=0,
        metavar="T",
        help="diloco: each round's average is applied T inner steps after it was sent "
        "(the sites train on meanwhile), merged eagerly: global + (local - sent)",
    )
    parser.add_argument(
        "--keep",
        type=float,
        default=1.0,
        metavar="BETA",
        help="with --overlap: the share of the overlap's local progress a site keeps on "
        "the new global parameters (1: eager); the rest goes into its next contribution",
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    try:
        codec = parse_codec(args.codec) if args.codec else None
    except CodecError as exc:
        parser.error(f"--codec: {exc}")

    torch.manual_seed(args.seed)
    models = [GPT(config_for("tiny")) for _ in range(WORKERS)]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    data = Dataset(stdlib_corpus(None), models[0].config.seq_len)
    streams = [
        data.batches(ShardSpec(w, (1,) * WORKERS, 0, seed=args.seed), BATCH) for w in range(WORKERS)
    ]
    if args.noise_corrected and args.mode == "diloco":
        optimizers: list[torch.optim.Optimizer] = [
            SiteAdamW(
                m.parameters(),
                lr=args.lr,
                betas=(0.9, args.beta2),
                weight_decay=args.weight_decay,
                batch_share=1 / WORKERS,
            )
            for m in models
        ]
    else:
        optimizers = [
            torch.optim.AdamW(
                m.parameters(), lr=args.lr, betas=(0.9, args.beta2), weight_decay=args.weight_decay
            )
            for m in models
        ]
    size = flat(models[0]).numel()
    shapes = [tuple(p.shape) for p in models[0].parameters()]
    generator = torch.Generator().manual_seed(1234)
    factors = [
        torch.randn(shape[1], args.low_rank, generator=generator) if len(shape) == 2 else None
        for shape in shapes
    ]
    global_params = flat(models[0]).clone()
    momentum = torch.zeros(size)
    residuals = [torch.zeros(size) for _ in range(WORKERS)]
    schedule = parse_schedule(args.sync_every)
    # In rounds, for (exp_avg, exp_avg_sq); 0: never.
    given = args.moments_every
    moments_every = [int(k) for k in given.split(",")] if given else [0, 0]
    if len(moments_every) != 2 or (given and min(moments_every) < 1):
        parser.error("--moments-every: two intervals >= 1 in rounds, e.g. 3,6")
    # The direct all-reduce: every site sends (S-1)/S of the vector in each phase.
    share = (WORKERS - 1) / WORKERS * WORKERS
    wan_bytes, exchanges, since = 0.0, 0, 0
    # An overlapped round in flight: (steps until it lands, new global, what each sent).
    in_flight: tuple[int, torch.Tensor, list[torch.Tensor]] | None = None
    carried = [torch.zeros(size) for _ in models]
    started = time.monotonic()
    for step in range(args.steps):
        lr = learning_rate_at(args.lr_schedule, args.lr, step, WARMUP_STEPS, args.steps)
        if args.mode == "diloco":
            lr *= args.inner_lr_scale
        for model, optimizer, stream in zip(models, optimizers, streams, strict=True):
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = next(stream)
            if isinstance(optimizer, SiteAdamW):  # two halves, each recorded
                half = len(x) // 2
                for part in (slice(0, half), slice(half, None)):
                    (lm_loss(model(x[part]), y[part]) / 2).backward()
                    optimizer.record_micro_batch()
            else:
                lm_loss(model(x), y).backward()
        if args.mode == "sync":
            grads = [torch.cat([p.grad.reshape(-1) for p in m.parameters()]) for m in models]
            if args.top_k:
                keep = max(1, int(args.top_k * size))
                for w in range(WORKERS):
                    accumulated = grads[w] + residuals[w]
                    index = accumulated.abs().topk(keep).indices
                    grads[w] = torch.zeros_like(accumulated)
                    grads[w][index] = accumulated[index]
                    residuals[w] = accumulated - grads[w]
                average = sum(grads) / WORKERS
                # Values as float16 and int32 indices: 6 bytes each; the
                # all-gather carries the union of the sites' indices.
                wan_bytes += share * 6 * (keep + int((average != 0).sum()))
            else:
                average = sum(grads) / WORKERS
                wan_bytes += share * 2 * 4 * size
            for model in models:
                load_flat((p.grad for p in model.parameters()), average)
        for model, optimizer in zip(models, optimizers, strict=True):
            if args.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            optimizer.zero_grad()
        if args.mode == "sync":
            continue
        if in_flight is not None:
            due, landed, sent = in_flight
            if due == 1 or step == args.steps - 1:
                # Eager merge: the new global parameters plus what each site trained
                # while the average was on the wire.
                global_params = landed
                for w, (model, before) in enumerate(zip(models, sent, strict=True)):
                    progress = flat(model) - before
                    load_flat(model.parameters(), landed + args.keep * progress)
                    carried[w] = (1 - args.keep) * progress
                in_flight = None
            else:
                in_flight = (due - 1, landed, sent)
        since += 1
        if since < sync_every_at(schedule, step) and step != args.steps - 1:
            continue
        since = 0
        # What a site did not keep of its last overlap's progress counts here.
        deltas = [global_params - flat(m) - c for m, c in zip(models, carried, strict=True)]
        carried = [torch.zeros(size) for _ in models]
        if args.low_rank:
            average, sent_bytes = low_rank_round(deltas, residuals, shapes, factors, args)
        elif args.projection:
            average, sent_bytes = projected_round(deltas, residuals, exchanges, args)
        else:
            average, sent_bytes = dense_round(deltas, residuals, codec, args)
        wan_bytes += share * sent_bytes
        exchanges += 1
        update = average
        if args.outer_momentum:
            momentum = args.outer_momentum * momentum + average
            update = average + args.outer_momentum * momentum
        if args.overlap and step != args.steps - 1:
            if in_flight is not None:
                parser.error("--overlap must be at most H: a round is still in flight")
            sent = [flat(m) for m in models]
            in_flight = (args.overlap, global_params - args.outer_lr * update, sent)
            continue
        global_params -= args.outer_lr * update
        for model in models:
            load_flat(model.parameters(), global_params)
        for state, every in zip(("exp_avg", "exp_avg_sq"), moments_every, strict=True):
            if every and exchanges % every == 0:
                tensors = [
                    [o.state[p][state] for p in o.param_groups[0]["params"]] for o in optimizers
                ]
                mean = sum(flat_of(t) for t in tensors) / WORKERS
                for t in tensors:
                    load_flat(t, mean)
                wan_bytes += share * 2 * 4 * size
    result = {
        "settings": vars(args),
        "eval_loss": evaluate(models[0], data, 32),
        "wan_mb": wan_bytes / 1e6,
        "exchanges": exchanges,
        "seconds": round(time.monotonic() - started),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
