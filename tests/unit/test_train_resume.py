"""examples/train.py stopped after one epoch and resumed gives bitwise the parameters of an
uninterrupted run (model, optimizer state, RNG and epoch come back from the checkpoint).

Not for onebit-adam yet: train.py checkpoints from rank 0 only, and 1-bit Adam's error
buffers are per rank (other ranks' buffers restart from zero on resume)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def train(tmp: Path, name: str, epochs: int, *extra: str) -> dict:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_osc="^ucx")
    cmd = [str(Path(sys.executable).parent / "mpirun"), "-np", "2", "--oversubscribe",
           sys.executable, str(ROOT / "examples" / "train.py"), "--epochs", str(epochs),
           "--checkpoint", str(tmp / name), *extra]
    subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=300, cwd=ROOT)
    return torch.load(tmp / name)


def test_resume_is_bitwise_identical(tmp_path):
    extra = ["--optimizer", "adam", "--batch-size", "128"]
    straight = train(tmp_path, "straight.pt", 2, *extra)
    train(tmp_path, "resumed.pt", 1, *extra)
    resumed = train(tmp_path, "resumed.pt", 2, *extra)
    assert resumed["epoch"] == straight["epoch"] == 2
    for key, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
