"""benchmarks/gpu.py, the GPU-sites issue's one command, checked on the CPU.

The figures need a GPU; what runs here is the script's own logic at tiny sizes
(``--device cpu --quick``): every part it selects runs, the JSON holds every
field a GPU run fills in, and it says its figures are not the targets. Also its
help, and its refusal without a GPU. The parts that start ``isthmus run`` jobs
are slow (three jobs of a few sites each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu.py"


def _gpu_py(*args: str, env: dict | None = None, timeout: float = 300):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _smoke(tmp_path: Path, only: str, timeout: float) -> dict:
    out = tmp_path / "gpu.json"
    done = _gpu_py(
        "--device", "cpu", "--quick", "--only", only, "--json", str(out), timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"figures: {out}" in done.stdout
    figures = json.loads(out.read_text())
    assert figures["device"] == "cpu" and figures["quick"] is True
    assert figures["targets_apply"] is False and "no figure here" in figures["note"]
    assert list(figures["parts"]) == only.split(",")
    for part in figures["parts"].values():
        assert "error" not in part, part["error"]
    for t in figures["targets"]:
        assert t["applies"] is False
        assert {"name", "figure", "target", "pass", "part"} <= set(t)
    machine = figures["machine"]
    assert machine["torch"] and machine["python"] and len(machine["commit"]) == 40
    assert machine["gpu"] is None  # the CPU run names no GPU
    return figures


def test_help_names_every_part_and_option():
    done = _gpu_py("--help", timeout=120)
    assert done.returncode == 0
    for word in ("--only", "--json", "--device", "--quick", "codecs", "exchange", "two-ranks"):
        assert word in done.stdout


def test_without_a_gpu_it_refuses_in_one_line_naming_the_cpu_smoke():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a machine with one
    done = _gpu_py("--only", "codecs", env=env, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a GPU" in lines[0]
    assert "--device cpu --quick" in lines[0]
    assert done.stdout == ""


def test_cpu_without_quick_and_unknown_parts_are_refused():
    assert _gpu_py("--device", "cpu", timeout=120).returncode == 2
    done = _gpu_py("--device", "cpu", "--quick", "--only", "codecs,warp", timeout=120)
    assert done.returncode == 2 and "warp" in done.stderr


def test_codecs_and_exchange_smoke_fill_every_figure(tmp_path):
    figures = _smoke(tmp_path, "codecs,exchange", timeout=300)

    codecs = figures["parts"]["codecs"]["figures"]
    assert codecs["input_bytes"] == 4 * codecs["values"]
    for spec in ("int8", "int4", "int2"):
        row = codecs["codecs"][spec]
        assert row["GBps"] > 0 and row["encode_s"] > 0 and row["decode_s"] > 0
        assert row["identical_to_cpu"] is True
        assert row["payload_on"] == "host bytes"
    assert codecs["codecs"]["int8"]["encoded_bytes"] < codecs["input_bytes"] / 3

    exchange = figures["parts"]["exchange"]["figures"]
    pieces = exchange["pieces_s"]
    assert {"encode", "decode", "average", "outer_step"} <= set(pieces)
    assert exchange["beside_wire_s"] == pytest.approx(sum(pieces.values()))
    assert exchange["wire_10gbit_s"] == pytest.approx(
        exchange["encoded_bytes_sent_per_site"] * 8 / 10e9
    )
    assert exchange["beside_wire_over_wire"] == pytest.approx(
        exchange["beside_wire_s"] / exchange["wire_10gbit_s"]
    )
    engine = exchange["engine"]
    assert engine["identical"] is True and engine["input"] == "cpu tensors"
    # Each site sends its contribution to the other's half and its half's result:
    # about the encoded size of the whole tensor.
    assert engine["bytes_sent_per_site"] == pytest.approx(
        exchange["encoded_bytes_sent_per_site"], rel=0.05
    )
    names = [t["name"] for t in figures["targets"]]
    assert any("GB/s" in n for n in names) and any("wire" in n for n in names)


@pytest.mark.slow
def test_isthmus_run_parts_smoke(tmp_path):
    figures = _smoke(tmp_path, "inner,shared,two-ranks", timeout=1500)

    inner = figures["parts"]["inner"]["figures"]
    assert inner["model"] == "tiny" and inner["precision"] == "bf16"
    assert inner["median_tokens_per_s"]["plain"] > 0
    assert inner["median_tokens_per_s"]["isthmus_run"] > 0
    assert inner["mfu"] == {"plain": None, "isthmus_run": None}  # no GPU, no peak to count
    assert inner["flops_per_token"] > 0

    shared = figures["parts"]["shared"]
    assert shared["figures"]["status"] == "finished"
    assert len(shared["figures"]["sites"]) == 3
    assert len({s["param_sha256"] for s in shared["figures"]["sites"].values()}) == 1
    assert all(t["pass"] for t in shared["targets"])

    two = figures["parts"]["two-ranks"]
    assert all(t["pass"] for t in two["targets"]), two
    (gloo,) = two["figures"]["collective"]
    assert gloo["backend"] == "gloo" and gloo["correct"] is True
