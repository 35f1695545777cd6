"""Run one of examples/ under mpirun at np 2 and read the line each rank prints (tests of
the examples whose ranks print `rank=... digest=...`; no MPI job in the test process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MPIRUN = Path(sys.executable).parent / "mpirun"


def _env() -> dict[str, str]:
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                PYTHONPATH=str(ROOT))


def run_example(script: str, *args: str) -> list[dict[str, str]]:
    """Each rank's `rank=...` line of examples/<script> as a dict of its key=value pairs,
    after checking that the job succeeded, both ranks printed and their parameters'
    digests agree."""
    return _ranks(subprocess.run([str(MPIRUN), "-np", "2", "--oversubscribe", sys.executable,
                                  str(ROOT / "examples" / script), *args], capture_output=True,
                                 text=True, env=_env(), timeout=300))


def run_line(line: str) -> list[dict[str, str]]:
    """run_example's answer for a shell line from the docs, run as written from the
    repository root."""
    return _ranks(subprocess.run(line, shell=True, capture_output=True, text=True, env=_env(),
                                 timeout=300, cwd=ROOT))


def _ranks(proc: subprocess.CompletedProcess) -> list[dict[str, str]]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in proc.stdout.splitlines()
             if line.startswith("rank=")]
    assert sorted(r["rank"] for r in ranks) == ["0", "1"], proc.stdout
    assert len({r["digest"] for r in ranks}) == 1, f"replicas differ: {ranks}"
    return ranks
