"""Whole jobs under mpirun that fail on purpose: they must end fast and say why."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIRUN = Path(sys.executable).parent / "mpirun"


#: How long a job that must end by itself (a failure, a stall's timeout) may take before
#: it counts as hung: far past the few seconds any of them takes, however loaded the machine.
ENDS_WITHIN_S = 60.0


def mpirun(np_: int, script: str, *args: str, env: dict | None = None,
           timeout: float = ENDS_WITHIN_S, options: tuple[str, ...] = ()) -> tuple[int, str]:
    """(exit status, output) of tests/scripts/<script> under mpirun; TimeoutExpired (the
    test fails) if the job has not ended within timeout."""
    full_env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                    **(env or {}))
    cmd = [str(MPIRUN), "-np", str(np_), "--oversubscribe", *options, sys.executable,
           str(ROOT / "tests" / "scripts" / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout,
                          cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("how", ["exception", "exception_under_torch", "exit", "exit0",
                                 "sigkill"])
def test_dead_rank_ends_the_job(how):
    """exception_under_torch: torch's init_process_group wraps the excepthook and sends
    what it prints to a buffer written after the hook returns, which ours, aborting, never
    did: the job ended with no traceback."""
    code, out = mpirun(3, "die.py", how)
    assert code != 0, out
    assert "unreachable" not in out
    if how.startswith("exception"):
        assert "RuntimeError: simulated failure on rank 1" in out, out
        assert "Traceback" in out and "aborting the job" in out, out


def test_stall_warns_then_raises():
    env = {"COLLECTIVES_STALL_WARNING_S": "0.5", "COLLECTIVES_STALL_TIMEOUT_S": "2"}
    code, out = mpirun(2, "stall.py", "4", env=env)
    assert "collectives stall: rank 0 has waited" in out, out
    assert "not joined: ranks [1]" in out, out
    assert "rank 1: has made no collective call yet" in out, out
    assert "StallError: allreduce #1: Timed out waiting 2" in out, out
    assert "refused after stall" in out, out


def test_a_barrier_beside_the_engine_warns_then_raises():
    env = {"COLLECTIVES_STALL_WARNING_S": "0.5", "COLLECTIVES_STALL_TIMEOUT_S": "2"}
    code, out = mpirun(2, "stall.py", "4", "barrier", env=env)
    assert "collectives stall: rank 0 has waited" in out and "in a barrier for rank 1" in out, out
    assert "StallError: barrier: Timed out waiting 2" in out, out
    assert "ms for rank 1 (timeout 2 s)" in out and "refused after stall" in out, out


@pytest.mark.parametrize("case,what", [("onebit", "1-bit exchange"), ("ring", "ring")])
def test_a_data_phase_wait_ends_at_the_communicators_timeout(tmp_path, case, what):
    """The data phases waited in MPI_Waitall, unbounded: a rank whose messages never came
    held the others forever, whatever the timeout."""
    code, out = mpirun(2, "data_phase_stall.py", case, env={"COLLECTIVES_DUMP_DIR": str(tmp_path)})
    found = re.search(rf"rank 0 StallError after ([0-9.]+) s: {what}: Timed out "
                      r"waiting \d+ms for other ranks \(timeout 1.5 s\)", out)
    assert found and float(found.group(1)) >= 1.5, out  # at the timeout, not before
    assert (tmp_path / "rank0.json").exists(), out


@pytest.mark.parametrize("group", ["default", "new"])
def test_a_torch_groups_timeout_ends_a_barrier_a_rank_skips(group):
    code, out = mpirun(3, "torch_timeout.py", group)
    found = re.search(r"raised after ([0-9.]+) s: (.*)", out)
    assert found, out
    assert float(found.group(1)) >= 1.0, out  # at the group's timeout, not before
    assert "Timed out waiting" in found.group(2) and "torch's pattern matches: True" in out, out


def test_calls_in_flight_at_exit_finish_and_the_job_exits_cleanly():
    """Before the engine drained at exit, its thread was ended inside C++ while the
    interpreter shut down and every rank aborted ("terminate called without an active
    exception")."""
    for _ in range(2):
        code, out = mpirun(4, "exit_in_flight.py")
        assert code == 0, out
        assert sorted(re.findall(r"rank (\d): submitted 2 calls", out)) == list("0123"), out
        assert "terminate called" not in out, out


def test_torch_futures_completed_by_the_engine_are_freed_before_exit():
    """The engine thread freed a call's completion callbacks after the exit handler's wait
    had returned; one held the call's torch future, and freeing it there during interpreter
    shutdown aborted the process (about 1 run in 2 of this script before the fix, with each
    rank bound to a core, as mpirun binds when it does not oversubscribe)."""
    for _ in range(4):
        code, out = mpirun(2, "exit_after_futures.py", options=("--bind-to", "core"))
        assert code == 0, out
        assert sorted(re.findall(r"rank (\d): trained", out)) == list("01"), out
        assert "terminate called" not in out, out
