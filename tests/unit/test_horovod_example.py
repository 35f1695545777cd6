"""examples/horovod_train.py is a Horovod script but for its import, trains under mpirun,
and resumes from its checkpoint."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "horovod_train.py"
MPIRUN = Path(sys.executable).parent / "mpirun"


def test_only_the_import_names_collectives():
    tree = ast.parse(SCRIPT.read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    ours = [ast.unparse(node) for node in imports if "collectives" in ast.unparse(node)]
    assert ours == ["import collectives.horovod as hvd"]
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert "collectives" not in names


def _run(tmp_path: Path, *args: str) -> str:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([str(MPIRUN), "-np", "2", "--oversubscribe", sys.executable,
                           str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_trains_and_resumes(tmp_path):
    checkpoint = str(tmp_path / "digits.pt")
    first = _run(tmp_path, "--epochs", "5", "--checkpoint", checkpoint)
    epochs = re.findall(r"epoch (\d+): train loss [\d.]+, test accuracy ([\d.]+)", first)
    assert [int(e) for e, _ in epochs] == [0, 1, 2, 3, 4]
    assert float(epochs[-1][1]) >= 0.85, first
    resumed = _run(tmp_path, "--epochs", "6", "--checkpoint", checkpoint)
    assert re.findall(r"epoch (\d+):", resumed) == ["5"], resumed
