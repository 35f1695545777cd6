"""examples/accelerate_train.py under mpirun: an Accelerate script (gloo, set up by
Accelerate) whose DDP buckets go through this library once one of our hooks is registered
with MPI.COMM_WORLD as its state: the library counts the calls, the replicas agree, and the
uncompressed hook trains the model Accelerate alone trains."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="Accelerate is an optional test dependency "
                                         "(pip install accelerate)")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "accelerate_train.py"
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
    assert all(r["backend"] == "gloo" for r in ranks), ranks  # Accelerate's own choice
    return ranks


def test_the_hook_puts_the_gradients_through_the_library():
    ours, alone = _run("--hook", "allreduce"), _run("--hook", "none")
    assert all(int(r["library_calls"]) > 0 for r in ours), ours
    assert all(int(r["library_calls"]) == 0 for r in alone), alone
    assert float(ours[0]["test_accuracy"]) > 0.85, ours
    assert ours[0]["digest"] == alone[0]["digest"], "not the model gloo's sums train"
    int8 = _run("--hook", "int8")
    assert all(int(r["library_calls"]) > 0 for r in int8), int8
    assert float(int8[0]["test_accuracy"]) > 0.85 and int8[0]["digest"] != ours[0]["digest"]
