"""examples/lightning_train.py under mpirun: Lightning's Trainer and Fabric train on the
"collectives" backend (their gradient allreduces counted in this library's stats), the
replicas agree, and the model is the one the same script trains on gloo; one of our DDP
hooks, registered on Trainer's model, is applied."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mpirun_example import run_example, run_line

pytest.importorskip("lightning", reason="Lightning is an optional test dependency "
                                        "(pip install lightning)")

#: docs/integrations.md's lines that run the example: this test runs them as written (and
#: test_readme.py leaves them to it)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
LINES = re.findall(r"^(.*examples/lightning_train\.py.*)$", DOCS.read_text(), flags=re.M)


def test_trainer_fabric_and_a_hook_train_through_the_library():
    """The docs' runs (Trainer on our backend, Fabric, Trainer with int8), and the same
    Trainer run on gloo. One epoch: far above chance (0.1) and the same model on both
    backends."""
    lines = {}
    for line in LINES:
        api, hook = re.search(r"--api (\w+)", line), re.search(r"--hook (\w+)", line)
        lines[(api.group(1) if api else "trainer", hook.group(1) if hook else "none")] = line
    assert set(lines) == {("trainer", "none"), ("fabric", "none"), ("trainer", "int8")}, LINES
    ours, fabric, hooked = (run_line(lines[key]) for key in
                            (("trainer", "none"), ("fabric", "none"), ("trainer", "int8")))
    args = lines["trainer", "none"].split("lightning_train.py")[1].split()
    gloo = run_example("lightning_train.py", *args, "--backend", "gloo")
    assert all(int(r["library_calls"]) > 0 for r in ours), ours  # the gradients went through us
    assert all(int(r["library_calls"]) == 0 for r in gloo), gloo
    assert float(ours[0]["test_accuracy"]) > 0.7, ours
    assert ours[0]["digest"] == gloo[0]["digest"], "not the model gloo's sums train"
    assert all(int(r["library_calls"]) > 0 for r in fabric), fabric
    assert float(fabric[0]["test_accuracy"]) > 0.7, fabric
    assert float(hooked[0]["test_accuracy"]) > 0.7, hooked
    assert hooked[0]["digest"] != ours[0]["digest"], "the hook's compression changed nothing"
