"""examples/accelerate_train.py under mpirun: an Accelerate script (gloo, set up by
Accelerate) whose DDP buckets go through this library once one of our hooks is registered
with MPI.COMM_WORLD as its state: the library counts the calls, the replicas agree, and the
uncompressed hook trains the model Accelerate alone trains."""

from __future__ import annotations

import pytest
from mpirun_example import run_example

pytest.importorskip("accelerate", reason="Accelerate is an optional test dependency "
                                         "(pip install accelerate)")


def _run(*args: str) -> list[dict[str, str]]:
    ranks = run_example("accelerate_train.py", *args)
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
