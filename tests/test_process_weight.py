"""What a run's processes import before they do any work.

On a small machine most of a short run's CPU goes into imports: every rank and
the launcher are new Python processes. The launcher needs no torch at all on a
machine without a GPU driver (1.5-3 s of CPU saved per run), and a rank of a
one-rank site needs neither FSDP2 nor pipelining, whose imports pull in
torch._dynamo (about a second per rank). These guards keep it so.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from isthmus.intra.devices import _GPU_DRIVER_NODES

LAUNCHER = """
import sys, tempfile
from pathlib import Path
import isthmus.deploy.cli.run, isthmus.deploy.launch.execute, isthmus.deploy.launch.report
import isthmus.deploy.launch.progress, isthmus.deploy.launch.run_dir, isthmus.deploy.launch.compare
from isthmus.deploy.launch.tensorboard import TensorBoardWriter
from isthmus.intra.devices import emulated_gpu_map
emulated_gpu_map([("a", 1), ("b", 2)], "auto")
writer = TensorBoardWriter(Path(tempfile.mkdtemp()), ["a"], {})
writer.add({"site": "a", "kind": "step", "t": 1.0, "step": 1, "loss": 2.0, "tokens": 8, "lr": 0.1})
writer.close()
print(sorted(m for m in ("torch", "grpc") if m in sys.modules))
"""

RANK = """
import sys
import isthmus.training.worker
print(sorted(m for m in ("torch._dynamo", "torch.distributed.pipelining") if m in sys.modules))
"""


def _last_line(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(
    any(Path(n).exists() for n in _GPU_DRIVER_NODES), reason="a GPU driver: torch counts GPUs"
)
def test_the_launcher_of_a_run_imports_neither_torch_nor_grpc_without_a_gpu():
    assert _last_line(LAUNCHER) == "[]"


def test_a_rank_loads_pipelining_and_dynamo_only_when_its_layout_uses_them():
    assert _last_line(RANK) == "[]"


def test_tensorboard_events_still_take_tensors_once_torch_is_loaded(tmp_path):
    """The launcher's writer hides torch from tensorboardX only while torch is not
    loaded; in a process that has torch, the same writer is the usual one."""
    code = (
        "import torch\nfrom pathlib import Path\n"
        "from isthmus.deploy.launch.tensorboard import TensorBoardWriter\n"
        f"w = TensorBoardWriter(Path({str(tmp_path)!r}), ['a'], {{}})\n"
        "w.add({'site': 'a', 'kind': 'step', 't': 1.0, 'step': 1, 'loss': torch.tensor(2.0),"
        " 'tokens': 8, 'lr': 0.1})\nw.close()\nprint('ok')\n"
    )
    assert _last_line(code) == "ok"
    assert any((tmp_path / "a").iterdir())
