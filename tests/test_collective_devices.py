"""Every in-site collective Isthmus issues passes tensors on its group's device.

A CPU machine cannot catch a CPU tensor on the GPU path by comparing devices
(its compute device is the CPU), so three things stand in for a GPU:

- unit tests of the check (:mod:`isthmus.intra.collectives`), NCCL's rule
  included (by pretending the group's backend is NCCL);
- device emulation: a real 2-rank Gloo site (and a 1-rank one across the WAN)
  agree on a model, run the hierarchical step, average replica gradients and
  write their records while pretending every rank computes on ``cuda:RANK``;
  any tensor a call site made without ``device=`` is refused, naming it;
- a static guard: only ``intra/collectives.py`` calls torch.distributed's
  collectives, and functions that call its wrappers give every tensor
  factory a ``device=``.

The bucketed replica average is compared with one all-reduce per parameter bit
for bit: with 2 ranks every element's sum is a + b = b + a whatever bucket it
falls in (IEEE addition commutes; it only fails to associate, which takes 3).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from isthmus.intra import collectives
from isthmus.intra.collectives import DeviceMismatch, checking, device_of
from isthmus.intra.gradients import average_replica_gradients

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("intra", "inter", "deploy", "job", "sim")

COLLECTIVES = frozenset(
    [
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "_all_gather_base",
        "all_gather_coalesced",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "_reduce_scatter_base",
        "broadcast",
        "broadcast_object_list",
        "all_gather_object",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "reduce",
        "barrier",
        "monitored_barrier",
        "all_to_all",
        "all_to_all_single",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
    ]
)
FACTORIES = frozenset({"tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand"})

ALLOWED_DIRECT = {
    # A benchmark of raw Gloo (the baseline Isthmus's WAN all-reduce is compared
    # with), not a collective of a site's training.
    "deploy/bench/gloo_baseline.py": "the Gloo baseline benchmark",
}
PENDING = {
    # Owned by another engineer while issue 29 is under way; the edits they need
    # are written in the issue's notes. Remove each line when its file is routed.
}


# -- the static guard ------------------------------------------------------------------
def _python_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _direct_collectives(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each torch.distributed collective called or imported."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [(node.lineno, a.name) for a in node.names if a.name in COLLECTIVES]
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in COLLECTIVES:
            continue
        owner = ast.unparse(node.func.value)
        if owner in ("dist", "torch.distributed", "_dist"):
            found.append((node.lineno, f"{owner}.{node.func.attr}"))
    return found


def test_only_the_collectives_module_calls_torch_distributed_collectives():
    offenders, pending_seen = [], set()
    for path in _python_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel == "intra/collectives.py" or rel in ALLOWED_DIRECT:
            continue
        for line, name in _direct_collectives(ast.parse(path.read_text(), rel)):
            if rel in PENDING:
                pending_seen.add(rel)
            else:
                offenders.append(f"{rel}:{line}: {name}")
    assert not offenders, (
        "in-site collectives must go through isthmus.intra.collectives (device check, "
        "call-site name):\n" + "\n".join(offenders)
    )
    stale = sorted(set(PENDING) - pending_seen)
    assert not stale, f"these files route their collectives now: remove them from PENDING: {stale}"


def _factories_without_device(function: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in FACTORIES
            and ast.unparse(node.func.value) == "torch"
            and not any(k.arg == "device" for k in node.keywords)
        ):
            lines.append(node.lineno)
    return lines


def _calls_collectives(function: ast.AST) -> bool:
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and ast.unparse(node.func.value) == "collectives"
        for node in ast.walk(function)
    )


def test_functions_that_issue_collectives_make_their_tensors_with_a_device():
    offenders, users = [], 0
    for path in _python_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel == "intra/collectives.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _calls_collectives(
                node
            ):
                users += 1
                offenders += [
                    f"{rel}:{line} in {node.name}" for line in _factories_without_device(node)
                ]
    assert users >= 10  # the guard looks where the collectives are
    assert not offenders, "tensor made without device= next to a collective:\n" + "\n".join(
        offenders
    )


def test_the_guard_sees_a_direct_call_and_a_factory_without_device():
    bad = ast.parse(
        "def f(g):\n"
        "    t = torch.zeros(3)\n"
        "    collectives.all_reduce(t, device=d, where='x')\n"
        "    dist.all_reduce(t, group=g)\n"
    )
    assert [name for _, name in _direct_collectives(bad)] == ["dist.all_reduce"]
    assert _factories_without_device(bad.body[0]) == [2]


# -- the check, unit by unit -----------------------------------------------------------
@pytest.fixture
def one_rank_group():
    """A one-rank Gloo group in this process (a real backend under the wrappers)."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_a_cpu_tensor_is_refused_by_an_nccl_group_naming_the_call_site(one_rank_group, monkeypatch):
    monkeypatch.setattr(collectives, "backend_of", lambda group: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(DeviceMismatch, match=r"member_rounds\.site_any: all_reduce got tensor 0"):
        collectives.all_reduce(torch.zeros(1), device="cuda:0", where="member_rounds.site_any")
    with pytest.raises(DeviceMismatch, match="told the rank computes on cpu"):
        collectives.barrier(device="cpu", where="checkpoint.save")


def test_gloo_takes_cuda_tensors_only_where_it_can(one_rank_group):
    # No CUDA tensor exists here: a declared CUDA device on a Gloo group stands in.
    collectives.barrier(device="cpu", where="t")
    with pytest.raises(DeviceMismatch, match=r"t\.rs: reduce_scatter_tensor was told"):
        out, inp = torch.zeros(2), torch.zeros(2)
        collectives.reduce_scatter_tensor(out, inp, device="cuda:0", where="t.rs")


def test_a_forgotten_device_passes_on_cpu_and_is_caught_by_emulation(one_rank_group):
    def flag_forgot_device(device: torch.device) -> None:
        value = torch.tensor([1.0])  # the bug: no device=
        collectives.all_reduce(value, device=device, where="example.flag")

    with checking() as check:
        flag_forgot_device(torch.device("cpu"))  # a plain comparison cannot see it
    assert check.counts[("example.flag", "all_reduce")] == 1
    with checking(emulate="cuda:0"), pytest.raises(DeviceMismatch, match=r"example\.flag"):
        flag_forgot_device(torch.device("cuda", 0))


def test_emulation_follows_tensors_as_a_gpu_would(one_rank_group):
    with checking(emulate="cuda:0") as check:
        a = torch.zeros(4, device="cuda:0")
        assert device_of(a) == torch.device("cuda", 0)
        assert device_of(a[1:].float() * 2) == torch.device("cuda", 0)
        host = a.cpu()
        assert device_of(host) == torch.device("cpu") and device_of(a).type == "cuda"
        host += 1
        assert float(a.sum()) == 0.0  # .cpu() copied, as it does from a GPU
        assert device_of(torch.ones(2).to("cuda")) == torch.device("cuda", 0)
        a[:2] = torch.ones(2)  # copies across devices are fine
        with pytest.raises(DeviceMismatch, match="mixes tensors"):
            _ = a + torch.ones(4)
        _ = a + torch.tensor(1.0)  # a CPU scalar may join a GPU op
        with pytest.raises(DeviceMismatch, match="numpy"):
            a.numpy()
        with pytest.raises(DeviceMismatch, match="cuda:1"):
            torch.zeros(1, device="cuda:1")
        collectives.all_reduce(a, device="cuda:0", where="t.ok")
        broadcast = [{"sync_every": 4}]
        collectives.broadcast_object_list(broadcast, device="cuda:0", where="t.objects")
    call = check.calls[0]
    assert (call.op, call.where, call.expected, call.device) == (
        "all_reduce",
        "t.ok",
        "cuda:0",
        "cuda:0",
    )
    assert call.backend == "nccl (emulated on gloo)"
    assert call.tensors[0].device == "cuda:0" and call.tensors[0].dtype == "float32"
    assert check.sites == {"t.ok", "t.objects"}


def test_bucketed_average_in_one_rank_buckets_and_keeps_values(one_rank_group):
    with checking(emulate="cuda:0") as check:
        params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 5, 1000, 2)]
        for p in params:
            check.place(p)
            p.grad = check.place(torch.arange(p.numel(), dtype=torch.float32))
        # 64 bytes: [3, 5] share a bucket, 1000 is alone (in place), [2] its own
        assert average_replica_gradients(params, dist.group.WORLD, bucket_bytes=64) == 3
    for p in params:
        assert torch.equal(p.grad, torch.arange(p.numel(), dtype=torch.float32))
    assert check.counts[("gradients.average_replica_gradients", "all_reduce")] == 3


# -- a real site under emulation --------------------------------------------------------
EXPECTED_SITES = {
    "agreement.site_digest",
    "agreement.site_flags",
    "hierarchical.rank_weights",
    "hierarchical.reduce",
    "hierarchical.outcome",
    "hierarchical.gather",
    "gradients.average_replica_gradients",
    "gradients.total_grad_norm",
    "member_rounds.site_any",
    "round_records.site_mean",
    "round_records.write_round",
    "setup.evaluate",
    "control.live_settings",
    "checkpoint.save",
}


def test_a_two_rank_gloo_site_runs_every_call_site_under_emulation(tmp_path):
    from isthmus.intra.launch import launch_ranks
    from isthmus.job.ports import free_port_blocks

    bases = free_port_blocks("127.0.0.1", [2, 1])
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: devices\nsites:\n"
        f"  - {{name: a, ranks: 2, address: 127.0.0.1:{bases[0]}}}\n"
        f"  - {{name: b, ranks: 1, address: 127.0.0.1:{bases[1]}}}\n"
    )
    command = [sys.executable, __file__, str(job), str(tmp_path)]
    from warm_popen import popen

    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE}
    procs = launch_ranks([*command, "a"], 2, spawn=popen, **quiet)
    procs.append(popen([*command, "b"], **quiet))
    failures = []
    for p in procs:
        _, err = p.communicate(timeout=300)
        if p.returncode:
            failures.append(f"{p.args[-1]} exited {p.returncode}:\n{err.decode()[-2500:]}")
    assert not failures, "\n\n".join(failures)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"a-{rank}.json").read_text())
        assert set(report["sites"]) >= EXPECTED_SITES, EXPECTED_SITES - set(report["sites"])
        assert report["devices"] == [f"cuda:{rank}"]  # every tensor "on" the rank's GPU
        assert report["bitwise_equal"], "bucketed average differs from per-parameter"
        shared, alone = report["evaluate"]  # replicas share the held-out batches
        assert shared == pytest.approx(alone, rel=1e-12)
    a0, a1, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("a-0", "a-1", "b-0"))
    assert a0["average"] == a1["average"] == b["average"]  # the step still averages


def _site_main(job_path: str, out: str, name: str) -> None:
    """One rank of the test above: every call site, under device emulation."""
    from isthmus.inter.agreement import agree_on_model
    from isthmus.inter.join import start_site
    from isthmus.inter.member_rounds import MemberRounds
    from isthmus.intra import checkpoint
    from isthmus.job.file import load_job
    from isthmus.training import round_records
    from isthmus.training.records import RecordWriter
    from isthmus.training.site_control import SiteControl

    rank = int(os.environ.get("RANK", "0"))
    report: dict = {}
    with checking(emulate=f"cuda:{rank}") as check:
        job = load_job(job_path)
        runtime = start_site(job, name, deadline_s=60, device=f"cuda:{rank}")
        device = runtime.device
        try:
            generator = torch.Generator().manual_seed(1 if name == "a" else 2)
            named = [
                (f"w{i}", torch.randn(n, generator=generator).to(device))
                for i, n in enumerate((7, 3))
            ]
            agree_on_model(runtime, named, device=device)
            vector = torch.full((10,), float(rank + (10 if name == "b" else 0)), device=device)
            runtime.step.average(
                [vector],
                round=runtime.next_round(),
                participants=runtime.names,
                weights={"a": 1.0, "b": 1.0},
                abort=lambda: False,
            )
            report["average"] = vector.cpu().tolist()
            if runtime.site.ranks > 1:
                report["bitwise_equal"] = _replica_gradients(check, runtime)
                MemberRounds._site_any(SimpleNamespace(site=runtime), rank == 1)
                round_records.site_mean(float(rank), runtime)
                records = RecordWriter(Path(os.devnull), name, enabled=False)
                strategy = SimpleNamespace(wan_bytes_sent=5, wan_bytes_received=7, outer_steps=1)
                round_records.write_round(records, strategy, runtime, step=1)
                control = SiteControl.__new__(SiteControl)
                control.ranks, control.plane, control.device = 2, None, device
                control.round_ended(1, 1)
                model = torch.nn.Linear(2, 2)
                for p in model.parameters():
                    check.place(p)
                checkpoint._barrier(model)
                report["evaluate"] = _replicas_evaluate(check, runtime)
        finally:
            runtime.close()
    report["sites"] = sorted(check.sites)
    report["devices"] = sorted({t.device for c in check.calls for t in c.tensors})
    Path(out, f"{name}-{rank}.json").write_text(json.dumps(report))


def _replica_gradients(check, runtime) -> bool:
    """The bucketed replica average against one all-reduce per parameter."""
    from isthmus.intra.gradients import total_grad_norm

    generator = torch.Generator().manual_seed(100 + runtime.rank)
    shapes = [(3, 4), (17,), (256,), (5, 5), (1,)]
    grads = [torch.randn(s, generator=generator) / 3 for s in shapes]
    bucketed = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p, g in zip(bucketed, grads, strict=True):
        check.place(p)
        p.grad = check.place(g.clone())
    reference = [check.place(g.clone()) for g in grads]
    group = runtime.dp_group
    for g in reference:
        dist.all_reduce(g, group=group)
        g.div_(dist.get_world_size(group))
    average_replica_gradients(bucketed, group, bucket_bytes=300, device=runtime.device)
    total_grad_norm(bucketed, group, device=runtime.device)
    return all(torch.equal(p.grad, r) for p, r in zip(bucketed, reference, strict=True))


def _replicas_evaluate(check, runtime) -> tuple[float, float]:
    """The held-out loss with the site's replicas sharing 5 batches (3 and 2), and
    with this rank evaluating all 5 alone."""
    from isthmus.training.rank_setup import evaluate

    model = torch.nn.Linear(4, 4)
    torch.nn.init.constant_(model.weight, 0.5)
    for p in model.parameters():
        check.place(p)
    generator = torch.Generator().manual_seed(7)
    batches = [(check.place(torch.randn(3, 4, generator=generator)),) * 2 for _ in range(5)]

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()

    return evaluate(model, batches, loss_fn, replicas=runtime.dp_group), evaluate(
        model, batches, loss_fn
    )


if __name__ == "__main__":
    _site_main(*sys.argv[1:4])
