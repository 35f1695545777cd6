"""examples/lightning_train.py under mpirun: Lightning's Trainer and Fabric train on the
"collectives" backend (their gradient allreduces counted in this library's stats), the
replicas agree, and the model is the one the same script trains on gloo; one of our DDP
hooks, registered on Trainer's model, is applied."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="Lightning is an optional test dependency "
                                        "(pip install lightning)")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "lightning_train.py"
MPIRUN = Path(sys.executable).parent / "mpirun"


def _run(*args: str) -> list[dict[str, str]]:
    """Each rank's printed line, as a dict."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([str(MPIRUN), "-np", "2", "--oversubscribe", sys.executable,
                           str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in proc.stdout.splitlines()
             if line.startswith("rank=")]
    assert sorted(r["rank"] for r in ranks) == ["0", "1"], proc.stdout
    assert len({r["digest"] for r in ranks}) == 1, f"replicas differ: {ranks}"
    return ranks


def test_trainer_and_fabric_train_through_the_library():
    ours, gloo = _run(), _run("--backend", "gloo")
    assert all(int(r["library_calls"]) > 0 for r in ours), ours  # the gradients went through us
    assert all(int(r["library_calls"]) == 0 for r in gloo), gloo
    assert float(ours[0]["test_accuracy"]) > 0.9, ours
    assert ours[0]["digest"] == gloo[0]["digest"], "not the model gloo's sums train"
    fabric = _run("--api", "fabric")
    assert all(int(r["library_calls"]) > 0 for r in fabric), fabric
    assert float(fabric[0]["test_accuracy"]) > 0.9, fabric


def test_trainer_with_our_int8_hook():
    hooked = _run("--hook", "int8")
    assert float(hooked[0]["test_accuracy"]) > 0.9, hooked
    assert hooked[0]["digest"] != _run()[0]["digest"], "the hook's compression changed nothing"
