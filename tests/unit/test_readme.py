"""Every fenced snippet in README.md runs as written.

Python blocks run as scripts under `mpirun -np 2` (they use collectives); shell blocks run
line by line from the repository root. `make test` is the one line not run here: this
test is part of it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MPIRUN = Path(sys.executable).parent / "mpirun"
#: Shell lines this test does not run, and why.
_SLURM = "needs a Slurm cluster: ci/slurm.sh runs these in CI"
NOT_RUN = {"make test": "this test is part of it",
           "sbatch examples/slurm/train.sbatch": _SLURM,
           "sbatch --nodes=2 --ntasks-per-node=4 examples/slurm/train.sbatch --compression fp16": _SLURM,
           "PMIX_MCA_psec=native srun --mpi=pmix -n 2 .venv/bin/python examples/train.py": _SLURM}


def snippets() -> list[tuple[str, str]]:
    """(language, code) of every fenced block in README.md."""
    return re.findall(r"^```(\w+)\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _env() -> dict[str, str]:
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                PYTHONPATH=str(ROOT), PATH=f"{MPIRUN.parent}{os.pathsep}{os.environ['PATH']}")


def test_the_readme_has_snippets_of_known_languages():
    found = snippets()
    assert {lang for lang, _ in found} <= {"python", "bash"}
    assert sum(lang == "python" for lang, _ in found) >= 2


@pytest.mark.parametrize("index", [i for i, (lang, _) in enumerate(snippets()) if lang == "python"])
def test_python_snippet_runs_under_mpirun(index, tmp_path):
    script = tmp_path / f"snippet{index}.py"
    script.write_text(snippets()[index][1])
    proc = subprocess.run([str(MPIRUN), "-np", "2", "--oversubscribe", sys.executable,
                           str(script)], capture_output=True, text=True, env=_env(),
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("index", [i for i, (lang, _) in enumerate(snippets()) if lang == "bash"])
def test_shell_snippet_runs(index):
    for line in snippets()[index][1].splitlines():
        command = line.split("#")[0].strip()
        if not command or command in NOT_RUN:
            continue
        proc = subprocess.run(command, shell=True, capture_output=True, text=True,
                              env=_env(), timeout=600, cwd=ROOT)
        assert proc.returncode == 0, f"{command}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"


def test_the_flags_of_train_py_are_the_ones_its_help_gives():
    """README's list of examples/train.py's flags names each flag --help gives, with all of
    its choices where it lists values."""
    helped = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), "--help"],
                            capture_output=True, text=True, env=_env(), timeout=120, check=True)
    usage = helped.stdout.split("\n\n")[0]
    choices = {name: set(values.split(",")) for name, values in
               re.findall(r"\[(--[\w-]+) \{([^}]*)\}", usage)}
    flags = set(re.findall(r"\[(--[\w-]+)", usage))
    listed = re.search(r"`examples/train\.py` is the full script \(flags: (.*?)\)\.",
                       README.read_text(), flags=re.S).group(1)
    named = dict(re.findall(r"`(--[\w-]+) ?([^`]*)`", listed))
    assert set(named) == flags
    for name, values in named.items():
        if values:
            assert set(values.split("|")) == choices[name], name
