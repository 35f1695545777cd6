"""examples/ddp_train.py runs under mpirun on our backend and on gloo, with a hook, and the
same seed trains the same model on both."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MPIRUN = Path(sys.executable).parent / "mpirun"
#: docs/ddp.md's line that runs the example: this test runs it as written (and
#: test_readme.py leaves it to it), then the same with gloo and with a hook
[LINE] = re.findall(r"^(\S*mpirun .*examples/ddp_train\.py.*)$",
                    (ROOT / "docs" / "ddp.md").read_text(), flags=re.M)


def _run(*args: str) -> dict[str, str]:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run(" ".join([LINE, *args]), shell=True, capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("backend="))
    return dict(re.findall(r"([\w/]+)=(\S+)", line))


def test_trains_on_both_backends_and_with_a_hook():
    assert "--backend" not in LINE and "--hook" not in LINE, LINE
    ours, gloo = _run(), _run("--backend", "gloo")
    assert (ours["backend"], gloo["backend"], ours["np"]) == ("collectives", "gloo", "2")
    assert float(ours["test_accuracy"]) > 0.8
    assert ours["test_accuracy"] == gloo["test_accuracy"]  # the same sums, the same model
    hooked = _run("--hook", "int8")
    assert float(hooked["test_accuracy"]) > 0.8 and float(hooked["samples/s"]) > 0
