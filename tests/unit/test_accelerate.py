"""examples/accelerate_train.py under mpirun: an Accelerate script (gloo, set up by
Accelerate) whose DDP buckets go through this library once one of our hooks is registered
with MPI.COMM_WORLD as its state: the library counts the calls, the replicas agree, and the
uncompressed hook trains the model Accelerate alone trains."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mpirun_example import run_example, run_line

pytest.importorskip("accelerate", reason="Accelerate is an optional test dependency "
                                         "(pip install accelerate)")

#: docs/integrations.md's line that runs the example: this test runs it as written (and
#: test_readme.py leaves it to it)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
[LINE] = re.findall(r"^(\S*mpirun .*examples/accelerate_train\.py.*)$", DOCS.read_text(),
                    flags=re.M)


def _gloo(ranks: list[dict[str, str]]) -> list[dict[str, str]]:
    assert all(r["backend"] == "gloo" for r in ranks), ranks  # Accelerate's own choice
    return ranks


def test_the_hook_puts_the_gradients_through_the_library():
    """The docs' run (the default hook, allreduce), the same run with Accelerate alone
    (--hook none) and with int8. One epoch: far above chance (0.1; 0.85 here) and the
    model gloo's sums train."""
    assert "--hook" not in LINE, LINE
    args = LINE.split("accelerate_train.py")[1].split()
    ours = _gloo(run_line(LINE))
    alone = _gloo(run_example("accelerate_train.py", *args, "--hook", "none"))
    assert all(int(r["library_calls"]) > 0 for r in ours), ours
    assert all(int(r["library_calls"]) == 0 for r in alone), alone
    assert float(ours[0]["test_accuracy"]) > 0.8, ours
    assert ours[0]["digest"] == alone[0]["digest"], "not the model gloo's sums train"
    int8 = _gloo(run_example("accelerate_train.py", *args, "--hook", "int8"))
    assert all(int(r["library_calls"]) > 0 for r in int8), int8
    assert float(int8[0]["test_accuracy"]) > 0.8 and int8[0]["digest"] != ours[0]["digest"]
