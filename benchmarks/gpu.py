"""GPU sites: every figure of the GPU-sites issue from one command, into one JSON.

    python benchmarks/gpu.py                      # on a machine with a GPU: every part
    python benchmarks/gpu.py --only codecs,exchange
    python benchmarks/gpu.py --device cpu --quick # the script's own smoke test; no figures

Parts (``--only``, in this order) and their targets:

* ``codecs``: int8 encode + decode of a float32 tensor on the GPU, >= 200 GB/s
  of float32 input (and its fraction of the GPU's memory bandwidth); int4 and
  int2 beside it; the same payload bytes and decoded bits as the CPU codec.
* ``exchange``: one round of a 1B-parameter int8 pseudo-gradient between two
  sites: the work beside the wire (encode, device-host copies, decode, the
  average, the outer step), each piece once, <= 10% of the time the encoded
  bytes take on a 10 Gbit/s link; and the real round through the engine over
  loopback gRPC with no cap.
* ``inner``: the built-in ``125m`` model in bf16 under ``isthmus run`` (one
  site, DiLoCo, no round inside the timed steps) against the same model, batch
  and optimizer in a plain PyTorch loop: tokens/s ratio >= 0.98; MFU of both.
* ``shared``: three one-rank sites on one GPU, ``125m``, DiLoCo with int8,
  through ``isthmus run``: every site finished, one param_sha256, the report.
* ``two-ranks``: a site of two ranks on the GPU path: with two GPUs through
  ``isthmus run`` (NCCL) and a two-process NCCL all-reduce; with one GPU,
  isthmus run's refusal, and the closest that works: Gloo with CUDA tensors.

Progress goes to stdout as it runs; the JSON (``--json``) is rewritten after
every part, so a part that fails or hangs leaves the others' figures. Exit
status: 0 every target met (or the CPU smoke ran), 1 a target missed or a part
failed, 2 no GPU (or bad arguments).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import gpu_parts as parts
import gpu_runs as processes
import torch
from gpu_parts import ROOT, Context, check, target

PARTS = ("codecs", "exchange", "inner", "shared", "two-ranks")
NOT_A_TARGET = (
    "CPU smoke (--device cpu --quick): tiny sizes that test this script's logic; "
    "no figure here is one of the issue's targets"
)


# -- inner steps: isthmus run against a plain loop -----------------------------------------
def flops_per_token(size: str) -> float:
    """Training FLOPs per token: 6 x the parameters a token's matmuls touch (all but
    the embeddings' lookups) plus attention's 12 x layers x seq_len x d_model (PaLM's
    count, causal masking not subtracted)."""
    from isthmus.job.sizes import config_for

    c = config_for(size)
    matmul_params = c.parameter_count() - (c.vocab_size + c.seq_len) * c.d_model
    return 6 * matmul_params + 12 * c.n_layer * c.seq_len * c.d_model


def plain_loop(ctx: Context, steps: int) -> float:
    """Tokens/s of the built-in model in a plain PyTorch loop: the job's AdamW, gradient
    clipping and bf16 autocast, the built-in data; no host sync inside the timed span."""
    from isthmus.intra.data import Dataset, ShardSpec, load_corpus
    from isthmus.intra.model import GPT, config_for, lm_loss
    from isthmus.job.settings import TrainSettings

    settings, device = TrainSettings(), ctx.device
    torch.manual_seed(0)
    model = GPT(config_for(ctx.model)).to(device)
    if ctx.compile:
        for block in model.layers.values():
            block.compile()
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=settings.inner_lr,
        betas=(settings.inner_beta1, settings.inner_beta2),
        weight_decay=settings.inner_weight_decay,
    )
    data = Dataset(load_corpus("stdlib"), model.config.seq_len)
    batches = data.batches(ShardSpec(0, (1,), 0, seed=0), ctx.batch_size)

    def step() -> None:
        x, y = (t.to(device, non_blocking=True) for t in next(batches))
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(ctx.inner_skip):
        step()
    parts.synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    parts.synchronize(device)
    elapsed = time.perf_counter() - started
    return steps * ctx.batch_size * config_for(ctx.model).seq_len / elapsed


def inner(ctx: Context) -> dict[str, Any]:
    steps = ctx.inner_steps
    job = processes.write_job(
        ctx.workdir / "inner" / "inner.yaml",
        sites=[("a", 1)],
        ctx=ctx,
        steps=steps,
        sync_every=steps + 1,  # no round inside the run: only the final sync, after the last step
    )
    plain, isthmus, runs = [], [], []
    for i in range(ctx.runs):  # alternating, so a machine's drift hits both alike
        plain.append(plain_loop(ctx, steps - ctx.inner_skip))
        parts.free_memory()  # the plain loop's model and optimizer, before isthmus run's
        ctx.say(f"  [{i + 1}/{ctx.runs}] plain loop   {plain[-1]:12,.0f} tokens/s")
        out = ctx.workdir / "inner" / f"run-{i}"
        run = processes.isthmus_run(job, out, ctx.run_timeout_s)
        runs.append({k: run[k] for k in ("rc", "placement", "report_written")})
        if run["rc"] != 0:
            raise RuntimeError(f"isthmus run exited {run['rc']}:\n{run['tail']}")
        isthmus.append(processes.steady_tokens_per_s(out, ctx.inner_skip))
        ctx.say(f"  [{i + 1}/{ctx.runs}] isthmus run  {isthmus[-1]:12,.0f} tokens/s")
    medians = {"plain": statistics.median(plain), "isthmus_run": statistics.median(isthmus)}
    ratio = medians["isthmus_run"] / medians["plain"]
    per_token = flops_per_token(ctx.model)
    mfu = {
        k: (v * per_token / ctx.peak_flops if ctx.peak_flops else None) for k, v in medians.items()
    }
    ctx.say(
        f"  median: plain {medians['plain']:,.0f}, isthmus run {medians['isthmus_run']:,.0f} "
        f"tokens/s: ratio {ratio:.3f}; MFU {_pct(mfu['plain'])} / {_pct(mfu['isthmus_run'])}"
    )
    figures = {
        "model": ctx.model,
        "batch_size": ctx.batch_size,
        "steps": steps,
        "skipped_steps": ctx.inner_skip,
        "precision": "bf16",
        "compile": ctx.compile,
        "tokens_per_s": {"plain": plain, "isthmus_run": isthmus},
        "median_tokens_per_s": medians,
        "isthmus_over_plain": ratio,
        "flops_per_token": per_token,
        "mfu": mfu,
        "runs": runs,
    }
    targets = [
        target("isthmus run / plain loop tokens/s, steps without a round", ratio, ">=", 0.98)
    ]
    notes = [
        "isthmus run: one site, one rank, sync_every > steps; steady tokens/s between the step "
        f"records after step {ctx.inner_skip} and the last; plain loop: the same steps after "
        f"{ctx.inner_skip} warm-up steps, timed with one synchronise at each end",
    ]
    if ctx.peak_flops is None:
        notes.append(
            "MFU null: this GPU is not in gpu_parts.GPU_SPECS"
            if ctx.cuda
            else "MFU null: no GPU, no peak to count against"
        )
    return {"figures": figures, "targets": targets, "notes": notes}


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


# -- sites sharing one GPU ------------------------------------------------------------------
def shared(ctx: Context) -> dict[str, Any]:
    steps, sync_every = (6, 3) if ctx.quick else (60, 20)
    job = processes.write_job(
        ctx.workdir / "shared" / "shared.yaml",
        sites=[("a", 1), ("b", 1), ("c", 1)],
        ctx=ctx,
        steps=steps,
        sync_every=sync_every,
    )
    run = processes.isthmus_run(job, ctx.workdir / "shared" / "run", ctx.run_timeout_s)
    ok, detail = processes.one_sha(run["summary"])
    summary = run["summary"] or {}
    ctx.say(f"  rc {run['rc']}: {detail}; report written: {run['report_written']}")
    figures = {
        "model": ctx.model,
        "steps": steps,
        "sync_every": sync_every,
        "rc": run["rc"],
        "placement": run["placement"],
        "status": summary.get("status"),
        "wall_seconds": summary.get("wall_seconds"),
        "wan_bytes": summary.get("wan_bytes"),
        "sites": {
            name: {k: site.get(k) for k in ("status", "tokens", "outer_steps", "param_sha256")}
            for name, site in summary.get("sites", {}).items()
        },
    }
    if not ok:
        figures["tail"] = run["tail"]
    targets = [
        check("three sites on one GPU: every site finished, one param_sha256", ok, detail),
        check("the report written", run["report_written"], "RUN_DIR/report.md"),
    ]
    return {"figures": figures, "targets": targets, "notes": []}


# -- a site of two ranks ----------------------------------------------------------------
def two_ranks(ctx: Context) -> dict[str, Any]:
    gpus = torch.cuda.device_count() if ctx.cuda else 0
    n = (1 << 16) if ctx.quick else 85_000_000  # the 125m model's gradient, float32
    steps, sync_every = (4, 2) if ctx.quick else (30, 15)
    job = processes.write_job(
        ctx.workdir / "two-ranks" / "two-ranks.yaml",
        sites=[("pair", 2), ("solo", 1)],
        ctx=ctx,
        steps=steps,
        sync_every=sync_every,
    )
    run = processes.isthmus_run(job, ctx.workdir / "two-ranks" / "run", ctx.run_timeout_s)
    ok, detail = processes.one_sha(run["summary"])
    figures: dict[str, Any] = {"gpus": gpus, "isthmus_run": {"rc": run["rc"], "detail": detail}}
    notes: list[str] = []
    targets = []
    if not ctx.cuda or gpus >= 2:
        backend = "nccl" if ctx.cuda else "gloo"
        ctx.say(f"  isthmus run, a 2-rank site ({backend}): rc {run['rc']}, {detail}")
        figures["isthmus_run"]["placement"] = run["placement"]
        if not ok:
            figures["isthmus_run"]["tail"] = run["tail"]
        targets.append(check(f"a 2-rank site through isthmus run ({backend})", ok, detail))
        devices = ["cuda:0", "cuda:1"] if ctx.cuda else ["cpu", "cpu"]
        figures["collective"] = [processes.collective(backend, devices, n, ctx.workdir)]
    else:  # one GPU: the refusal, then what does work with two ranks on it
        refusal = [line for line in run["tail"].splitlines() if "GPU" in line][-1:]
        figures["isthmus_run"]["refusal"] = refusal[0] if refusal else run["tail"][-500:]
        ctx.say(f"  isthmus run, a 2-rank site on 1 GPU: rc {run['rc']}: {refusal}")
        refused = run["rc"] == 2 and bool(refusal)
        targets.append(
            check("one GPU: isthmus run refuses a 2-rank site, naming the fix", refused, "")
        )
        figures["collective"] = [
            processes.collective("gloo", ["cuda:0", "cuda:0"], n, ctx.workdir),
            processes.collective("nccl", ["cuda:0", "cuda:0"], n, ctx.workdir),
        ]
        notes.append(
            "not run: NCCL between two ranks of a site on two GPUs (this machine has one); "
            "shown instead: Gloo all-reduce of CUDA tensors between two processes on "
            "cuda:0, and what NCCL says to two ranks on one GPU"
        )
    for result in figures["collective"]:
        ctx.say(f"  all-reduce {json.dumps(result)[:300]}")
    first = figures["collective"][0]
    targets.append(
        check(
            f"{first['backend']} all-reduce between two processes: correct",
            first.get("correct") is True,
            first.get("error", f"{first.get('bus_GBps', 0):.2f} GB/s bus bandwidth")[:500],
        )
    )
    return {"figures": figures, "targets": targets, "notes": notes}


# -- the command ---------------------------------------------------------------------------
RUNNERS = {
    "codecs": parts.codecs,
    "exchange": parts.exchange,
    "inner": inner,
    "shared": shared,
    "two-ranks": two_ranks,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpu.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--only",
        default=",".join(PARTS),
        help=f"the parts to run, comma-separated (default: all: {','.join(PARTS)})",
    )
    parser.add_argument(
        "--json",
        type=Path,
        help="where the figures go (default: runs/gpu-TIME.json); rewritten after every part",
    )
    parser.add_argument(
        "--device",
        default="cuda",
        help="cuda (default; cuda:N for another GPU: the isthmus run parts still place "
        "ranks as isthmus run does, from GPU 0) or cpu (with --quick: the smoke test)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes and few repeats: checks the script"
    )
    parser.add_argument("--repeats", type=int, help="timed repeats per micro-figure (default 10)")
    parser.add_argument("--runs", type=int, help="isthmus run / plain loop pairs (default 3)")
    parser.add_argument("--steps", type=int, help="inner steps per inner run (default 200)")
    parser.add_argument("--batch-size", type=int, help="sequences per step (default 16)")
    parser.add_argument(
        "--exchange-params", type=int, help="pseudo-gradient values (default 1,000,000,000)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="train.compile: true, and compile the plain loop's blocks",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the isthmus run folders (printed at the end)"
    )
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        parser.error(f"--only: unknown part(s) {unknown}; choose from {','.join(PARTS)}")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device: cuda, cuda:N or cpu, got {args.device!r}")
    if args.device == "cpu" and not args.quick:
        parser.error("--device cpu runs only with --quick (the smoke test: tiny sizes)")
    return args


def context(args: argparse.Namespace, workdir: Path, gpu: dict | None, say) -> Context:
    quick = args.quick
    peak, bandwidth = parts.gpu_spec(gpu["name"]) if gpu else (None, None)
    return Context(
        device=torch.device(args.device),
        quick=quick,
        repeats=args.repeats or (3 if quick else 10),
        workdir=workdir,
        say=say,
        codec_values=(1 << 20) if quick else (1 << 28),
        exchange_values=args.exchange_params or ((1 << 20) + 77 if quick else 1_000_000_000),
        exchange_rounds=3,
        model="tiny" if quick else "125m",
        batch_size=args.batch_size or (8 if quick else 16),
        inner_steps=args.steps or (12 if quick else 200),
        inner_skip=3 if quick else 20,
        runs=args.runs or (1 if quick else 3),
        compile=args.compile,
        peak_flops=peak,
        memory_GBps=bandwidth,
        run_timeout_s=900 if quick else 1800,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py needs a GPU (torch.cuda.is_available() is False here); "
            "to smoke-test the script itself on the CPU: python benchmarks/gpu.py --device cpu "
            "--quick",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()

    def say(line: str) -> None:
        print(f"[gpu {time.perf_counter() - started:7.1f}s] {line}", flush=True)

    if args.device == "cpu":
        torch.set_num_threads(1)  # a smoke test: leave the machine's other cores alone
    path = args.json or ROOT / "runs" / f"gpu-{datetime.now():%Y%m%d-%H%M%S}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    say(f"machine ({args.device}{', quick' if args.quick else ''})")
    info = parts.machine(device, args.quick)
    if info["gpu"]:
        g = info["gpu"]
        say(
            f"  {g['name']} x{g['count']}, {g['memory_GiB']} GiB, memory "
            f"{g['memory_bandwidth_GBps_spec']} GB/s spec, "
            f"{g['memory_bandwidth_GBps_measured_copy']:,.0f} GB/s copy; "
            f"torch {info['torch']}, CUDA {info['cuda']}, commit {info['commit']}"
        )
    applies = device.type == "cuda"
    report: dict[str, Any] = {
        "command": ["benchmarks/gpu.py", *(sys.argv[1:] if argv is None else argv)],
        "started": datetime.now().isoformat(timespec="seconds"),
        "device": args.device,
        "quick": args.quick,
        "targets_apply": applies,
        "note": None if applies else NOT_A_TARGET,
        "machine": info,
        "parts": {},
        "targets": [],
    }
    failed = False
    workdir = Path(tempfile.mkdtemp(prefix="isthmus-gpu-"))
    ctx = context(args, workdir, info["gpu"], say)
    for name in args.parts:
        say(f"{name} ...")
        began = time.perf_counter()
        try:
            result = RUNNERS[name](ctx)
        except Exception as error:  # the JSON says which part failed, and the rest go on
            failed = True
            result = {"error": parts.error_text(error), "targets": [], "notes": []}
            say(f"  {name} failed: {result['error'][:1000]}")
        parts.free_memory()
        result["seconds"] = time.perf_counter() - began
        for t in result["targets"]:
            t.update(part=name, applies=applies)
        report["parts"][name] = result
        report["targets"] += result["targets"]
        path.write_text(json.dumps(report, indent=2, default=str))
    report["seconds"] = time.perf_counter() - started
    path.write_text(json.dumps(report, indent=2, default=str))

    print("\ntargets" + ("" if applies else f" ({NOT_A_TARGET})") + ":")
    for t in report["targets"]:
        verdict = ("PASS" if t["pass"] else "FAIL") if applies else "n/a "
        figure = t["figure"]
        shown = f"{figure:.4g}" if isinstance(figure, float) else str(figure)
        print(f"  {verdict}  [{t['part']}] {t['name']}: {shown} (target {t['target']})")
    for name, result in report["parts"].items():
        if "error" in result:
            print(f"  FAIL  [{name}] did not complete: {result['error'][:300]}")
        for note in result.get("notes", []):
            print(f"  note  [{name}] {note}")
    print(f"figures: {path}")
    if args.keep:
        print(f"run folders: {workdir}")
    else:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    missed = applies and not all(t["pass"] for t in report["targets"])
    return 1 if failed or missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
