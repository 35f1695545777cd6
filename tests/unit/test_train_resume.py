"""examples/train.py stopped after one epoch and resumed gives bitwise the parameters of an
uninterrupted run (model, every rank's optimizer state incl. 1-bit Adam's error buffers, RNG
and epoch come back from the checkpoint), and its replicas end bit-identical."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def train(tmp: Path, name: str, epochs: int, *extra: str) -> dict:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_osc="^ucx")
    cmd = [str(Path(sys.executable).parent / "mpirun"), "-np", "2", "--oversubscribe",
           sys.executable, str(ROOT / "examples" / "train.py"), "--epochs", str(epochs),
           "--checkpoint", str(tmp / name), *extra]
    done = subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=300, cwd=ROOT,
                          text=True)
    assert "replicas bit-identical" in done.stdout, done.stdout
    return torch.load(tmp / name)


@pytest.mark.parametrize("extra", [
    ["--optimizer", "adam", "--batch-size", "128"],
    # frozen from step 5: the second epoch runs on 1-bit momentum and its error buffers
    ["--optimizer", "onebit-adam", "--batch-size", "128", "--freeze-step", "5"],
], ids=["adam", "onebit-adam"])
def test_resume_is_bitwise_identical(tmp_path, extra):
    straight = train(tmp_path, "straight.pt", 2, *extra)
    train(tmp_path, "resumed.pt", 1, *extra)
    resumed = train(tmp_path, "resumed.pt", 2, *extra)
    assert resumed["epoch"] == straight["epoch"] == 2
    for key, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
    if "onebit-adam" in extra:  # the per-rank state is really per rank: restoring rank 0's
        states = [torch.load(tmp_path / f"resumed.pt.rank{r}")["optimizer"]["state"]
                  for r in (0, 1)]  # everywhere would not give the same run
        assert any(not torch.equal(a["worker_error"], b["worker_error"])
                   for a, b in zip(states[0].values(), states[1].values()))
