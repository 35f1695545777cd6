"""examples/lightning_train.py under mpirun: Lightning's Trainer and Fabric train on the
"collectives" backend (their gradient allreduces counted in this library's stats), the
replicas agree, and the model is the one the same script trains on gloo; one of our DDP
hooks, registered on Trainer's model, is applied."""

from __future__ import annotations

import pytest
from mpirun_example import run_example

pytest.importorskip("lightning", reason="Lightning is an optional test dependency "
                                        "(pip install lightning)")


def _run(*args: str) -> list[dict[str, str]]:
    return run_example("lightning_train.py", *args)


def test_trainer_fabric_and_a_hook_train_through_the_library():
    """One run each: Trainer on our backend and on gloo, Fabric, Trainer with int8."""
    ours, gloo = _run(), _run("--backend", "gloo")
    assert all(int(r["library_calls"]) > 0 for r in ours), ours  # the gradients went through us
    assert all(int(r["library_calls"]) == 0 for r in gloo), gloo
    assert float(ours[0]["test_accuracy"]) > 0.9, ours
    assert ours[0]["digest"] == gloo[0]["digest"], "not the model gloo's sums train"
    fabric = _run("--api", "fabric")
    assert all(int(r["library_calls"]) > 0 for r in fabric), fabric
    assert float(fabric[0]["test_accuracy"]) > 0.9, fabric
    hooked = _run("--hook", "int8")
    assert float(hooked[0]["test_accuracy"]) > 0.9, hooked
    assert hooked[0]["digest"] != ours[0]["digest"], "the hook's compression changed nothing"
