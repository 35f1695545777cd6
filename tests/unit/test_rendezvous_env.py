"""init_process_group under mpirun whatever rendezvous variables the environment holds:
MASTER_ADDR / MASTER_PORT that a cluster's job template exports (torch then wants RANK and
WORLD_SIZE, which come from the MPI job), RANK / WORLD_SIZE that agree with it, and a RANK
that does not (a clear error on every rank). Each case trains two DDP steps."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "ddp_from_env.py"
MPIRUN = Path(sys.executable).parent / "mpirun"
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(np: int, backend: str, **variables: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=str(ROOT))
    exported = [arg for name, value in variables.items() for arg in ("-x", f"{name}={value}")]
    return subprocess.run([str(MPIRUN), "-np", str(np), "--oversubscribe", *exported,
                           sys.executable, str(SCRIPT), backend],
                          capture_output=True, text=True, env=env, timeout=240)


def _ranks(proc: subprocess.CompletedProcess, np: int) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in proc.stdout.splitlines()
             if line.startswith("rank=")]
    assert sorted(int(line["rank"]) for line in lines) == list(range(np)), proc.stdout
    assert {line["world"] for line in lines} == {str(np)}
    assert len({line["digest"] for line in lines}) == 1, f"replicas differ: {lines}"


@pytest.mark.parametrize("np", [2, 3])
def test_master_addr_and_port_without_rank_and_world_size(np):
    _ranks(_run(np, "collectives", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())), np)


def test_no_variables_and_all_but_the_rank():
    _ranks(_run(2, "collectives"), 2)
    # what torchrun sets, less the rank (one value for all ranks here), agreeing with MPI's
    _ranks(_run(2, "collectives", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                WORLD_SIZE="2", LOCAL_RANK="0"), 2)


def test_gloo_under_mpirun_with_master_addr_and_port():
    _ranks(_run(2, "gloo", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())), 2)


@pytest.mark.parametrize("np", [2, 3])
def test_a_rank_that_disagrees_with_the_mpi_job_is_a_clear_error(np):
    proc = _run(np, "collectives", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                RANK="0")
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert ("init_process_group: rank=0 (from RANK), but MPI runs this process as rank 1"
            in text), text
