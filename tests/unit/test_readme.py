"""Every fenced snippet in README.md and in docs/*.md runs as written.

Python blocks run as scripts under `mpirun -np 2` (they use collectives); shell blocks run
line by line from the repository root, but for the lines in NOT_RUN and those a test of
their own runs and checks (RUN_BY), and a line that runs
pytest on part of this suite, which the suite runs anyway, collects its tests instead (it
must select some); `text` blocks (output, signatures, fragments) are not run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: The pages whose snippets run: README.md and every page of docs/.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MPIRUN = Path(sys.executable).parent / "mpirun"
#: Shell lines this test does not run, and why.
_SLURM = "needs a Slurm cluster: ci/slurm.sh runs these in CI"
_SUITE = "minutes of the suite, which ci/test.sh runs"
NOT_RUN = {"make test": "this test is part of it",
           "ci/mpitest.sh 3": _SUITE,
           'ci/mpitest.sh 2 "" -k "test_zero"': _SUITE,
           "ci/mpitest.sh 4 2 -k hierarchical": _SUITE,
           'MPITEST_TIMEOUT_S=120 ci/mpitest.sh 2 "" -k "allreduce and random_floats"': _SUITE,
           "ci/paths.sh": _SUITE,
           'ATEN_CPU_CAPABILITY=default ci/mpitest.sh 2 "" -k test_zero': _SUITE,
           "sbatch examples/slurm/train.sbatch": _SLURM,
           "sbatch --nodes=2 --ntasks-per-node=4 examples/slurm/train.sbatch --compression fp16": _SLURM,
           "PMIX_MCA_psec=native srun --mpi=pmix -n 2 .venv/bin/python examples/train.py": _SLURM}

#: Shell lines that a test of their own runs as written and checks what they print: the
#: lines that name the key.
RUN_BY = {"examples/lightning_train.py": "tests/unit/test_lightning.py",
          "examples/accelerate_train.py": "tests/unit/test_accelerate.py",
          "examples/ddp_train.py": "tests/unit/test_ddp_example.py"}


def snippets(page: Path = README) -> list[tuple[str, str]]:
    """(language, code) of every fenced block in page."""
    return re.findall(r"^```(\w+)\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def _cases(language: str) -> list:
    """(page, index) of every block of language, named page:index."""
    return [pytest.param(page, i, id=f"{page.relative_to(ROOT)}:{i}") for page in PAGES
            for i, (lang, _) in enumerate(snippets(page)) if lang == language]


def _env() -> dict[str, str]:
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                PYTHONPATH=str(ROOT), PATH=f"{MPIRUN.parent}{os.pathsep}{os.environ['PATH']}")


def test_the_pages_have_snippets_of_known_languages():
    for page in PAGES:
        assert {lang for lang, _ in snippets(page)} <= {"python", "bash", "text"}, page
    assert sum(lang == "python" for lang, _ in snippets()) >= 2
    assert len(_cases("python")) >= 8  # the docs' pages too


@pytest.mark.parametrize("page,index", _cases("python"))
def test_python_snippet_runs_under_mpirun(page, index, tmp_path):
    script = tmp_path / f"snippet{index}.py"
    script.write_text(snippets(page)[index][1])
    proc = subprocess.run([str(MPIRUN), "-np", "2", "--oversubscribe", sys.executable,
                           str(script)], capture_output=True, text=True, env=_env(),
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("page,index", _cases("bash"))
def test_shell_snippet_runs(page, index):
    commands = [line.split("#")[0].strip() for line in snippets(page)[index][1].splitlines()]
    commands = [c for c in commands
                if c and c not in NOT_RUN and not any(key in c for key in RUN_BY)]
    if not commands:
        pytest.skip("every line is run elsewhere (NOT_RUN, RUN_BY)")
    for command in commands:
        part_of_the_suite = re.search(r"-m pytest .*\btests/", command) is not None
        if part_of_the_suite:
            command += " --collect-only"
        proc = subprocess.run(command, shell=True, capture_output=True, text=True,
                              env=_env(), timeout=600, cwd=ROOT)
        assert proc.returncode == 0, f"{command}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        if part_of_the_suite:
            assert re.search(r"^[1-9]\d*(/\d+)? tests? collected", proc.stdout, re.M), \
                f"{command}: selects no test:\n{proc.stdout[-3000:]}"


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
