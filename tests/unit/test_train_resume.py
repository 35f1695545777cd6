"""examples/train.py stopped after one epoch and resumed gives bitwise the parameters of an
uninterrupted run (model, every rank's optimizer state incl. 1-bit Adam's error buffers and
ZeRO's shards, RNG and epoch come back from the checkpoint), and its replicas end
bit-identical; a ZeRO checkpoint resumes at another world size, resharded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def train(tmp: Path, name: str, epochs: int, *extra: str, np: int = 2) -> dict:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_osc="^ucx")
    cmd = [str(Path(sys.executable).parent / "mpirun"), "-np", str(np), "--oversubscribe",
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
    ["--optimizer", "adam", "--batch-size", "128", "--zero", "2"],
], ids=["adam", "onebit-adam", "zero-2"])
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


def test_zero_checkpoint_resumes_at_another_world_size(tmp_path):
    """Saved by 4 ranks after one epoch, resumed by 3: every new shard's Adam state goes on
    from the 4 ranks' (its step count is both epochs' steps, 2 x 12, where a state started
    afresh would count 12). That the state is placed right is test_zero.py's resharding
    test; dropout draws per rank, so runs at two world sizes differ anyway."""
    extra = ["--optimizer", "adam", "--batch-size", "128", "--zero", "2"]
    train(tmp_path, "moved.pt", 1, *extra, np=4)
    moved = train(tmp_path, "moved.pt", 2, *extra, np=3)
    assert moved["epoch"] == 2 and moved["size"] == 3
    for r in range(3):
        shard = torch.load(tmp_path / f"moved.pt.rank{r}")
        assert shard["epoch"] == 2 and shard["optimizer"]["world_size"] == 3
        steps = {float(s["step"]) for s in shard["optimizer"]["optimizer"]["state"].values()}
        assert steps == {24.0}, steps
