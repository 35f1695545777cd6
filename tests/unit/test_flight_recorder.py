"""The flight recorder (collectives/runtime/flight.py), its analyzer (collectives/debug.py)
and the straggler accounting (runtime/stragglers.py), in whole jobs under mpirun."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from test_failures import ROOT, mpirun

STALL = {"COLLECTIVES_STALL_WARNING_S": "1", "COLLECTIVES_STALL_TIMEOUT_S": "3"}


def flight(np_: int, *args: str, env: dict) -> tuple[int, str]:
    """tests/scripts/flight.py's case under mpirun, without init's measurement for `auto`:
    the first job of a setup with no cached times runs hundreds of timed calls before the
    script's first one, and the tests name the script's calls by their numbers."""
    return mpirun(np_, "flight.py", *args, env=dict(env, COLLECTIVES_AUTOTUNE="0"))


def analyze(folder) -> str:
    out = subprocess.run([sys.executable, "-m", "collectives.debug", str(folder)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_a_stopped_rank_is_named_from_the_others_records(tmp_path):
    env = dict(STALL, COLLECTIVES_DUMP_DIR=str(tmp_path))
    code, out = flight(3, "stop", env=env)
    assert code != 0, out  # rank 2, still stopped, is ended by mpirun
    assert "rank 0 StallError" in out and "rank 1 StallError" in out, out
    assert f"python -m collectives.debug {tmp_path}" in out, out  # the error says where
    assert sorted(p.name for p in tmp_path.glob("rank*.json")) == ["rank0.json", "rank1.json"]
    report = analyze(tmp_path)
    assert "flight records of 2 of 3 ranks; none from ranks [2]" in report, report
    assert "last call every recorded rank finished: #20 allreduce" in report, report
    assert "they part at #21 allreduce" in report, report
    waited = re.search(r"rank 0: entered it, waiting for the others to agree for ([0-9.]+) s",
                       report)
    assert waited and float(waited.group(1)) >= 3, report  # at least the stall timeout
    assert "rank 2: wrote no record; rank 0's watchdog found it did not answer" in report
    trace = json.loads((tmp_path / "trace.json").read_text())
    rows = {e["pid"] for e in trace["traceEvents"] if e.get("name") == "allreduce"}
    assert rows == {0, 1}, rows


def test_ranks_out_of_step_are_named_as_a_mismatch(tmp_path):
    code, out = flight(3, "mismatch", env={"COLLECTIVES_DUMP_DIR": str(tmp_path)})
    assert code == 0, out  # every rank caught its MismatchError and ended
    assert out.count("MismatchError") == 3, out
    assert len(list(tmp_path.glob("rank*.json"))) == 3
    report = analyze(tmp_path)
    assert "last call every recorded rank finished: #10 allreduce" in report, report
    assert "MISMATCH at #11: ranks [0, 1] called allreduce" in report, report
    assert "ranks [2] called allgather" in report, report


def test_a_straggler_is_named_and_leads_waited_for(tmp_path):
    """Rank 2 sleeps 30 ms before each of 80 allreduces: the watch names it, the counters
    (alike on every rank) and the timeline's calls put it first. How much of the others'
    time it took depends on the machine's load; the watch's arithmetic is
    test_flight_analysis.py's."""
    trace_file = tmp_path / "timeline.json"
    env = {"COLLECTIVES_STRAGGLER_WINDOW_S": "1", "COLLECTIVES_DUMP_DIR": str(tmp_path)}
    code, out = flight(3, "straggler", str(trace_file), env=env)
    assert code == 0, out
    assert re.search(r"collectives straggler: the other ranks spent \d+% of their time in "
                     r"the last \d s waiting for rank 2", out), out
    named = re.findall(r"collectives straggler: the other ranks spent .* waiting for rank (\d)",
                       out)
    assert set(named) == {"2"}, out
    seen = [json.loads(m) for m in re.findall(r"rank \d waited_for (.*)", out)]
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2], seen  # alike on every rank
    waited = {int(r): s for r, s in seen[0].items()}
    assert waited[2] > sum(s for r, s in waited.items() if r != 2), waited
    events = json.loads(trace_file.read_text())["traceEvents"]
    lasts = [e["args"]["last_to_arrive"] for e in events
             if e.get("name") == "allreduce" and "last_to_arrive" in e.get("args", {})]
    assert len(lasts) >= 3 * 80 and 2 * lasts.count(2) > len(lasts), lasts


def test_sigusr1_dumps_a_rank_waiting_inside_a_collective(tmp_path):
    code, out = flight(2, "signal", env={"COLLECTIVES_DUMP_DIR": str(tmp_path)})
    assert code == 0 and "rank 0 done" in out, out
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["reason"] == "signal SIGUSR1", record["reason"]
    state = record["state"]
    assert state["state"] == "waiting" and state["collective"] == "allreduce", state
    assert record["calls"][-1]["phase"] == "entered", record["calls"][-1]
    assert not (tmp_path / "rank1.json").exists()


def test_the_ring_keeps_the_last_calls(tmp_path):
    env = {"COLLECTIVES_FLIGHT_RECORDER": "5", "COLLECTIVES_DUMP_DIR": str(tmp_path)}
    code, out = flight(2, "ring", env=env)
    assert code == 0 and f"rank 1 dumped {tmp_path}/rank1.json" in out, out
    record = json.loads((tmp_path / "rank1.json").read_text())
    calls = record["calls"]
    assert record["reason"] == "asked" and len(calls) == 5, calls
    assert [c["comm_seq"] for c in calls] == list(range(16, 21)), calls
    assert [c["seq"] for c in calls] == list(range(16, 21)), calls
    assert all(c["phase"] == "done" and c["comm"] == "job" and c["collective"] == "allreduce"
               and "(100,)" in c["detail"] for c in calls), calls
    assert all(c["start"] <= c["agreed"] <= c["end"] for c in calls), calls


def test_the_profile_example_draws_a_ddp_step(tmp_path):
    """examples/profile_step.py, which draws README.md's picture: every bucket's allreduce
    is a range in rank 0's trace."""
    from test_failures import MPIRUN

    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = subprocess.run([str(MPIRUN), "-np", "2", "--oversubscribe", sys.executable,
                          str(ROOT / "examples" / "profile_step.py"), "--out",
                          str(tmp_path / "step.png")], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"\d+ allreduces; [0-9.]+ ms of them inside backward", out.stdout), out.stdout
    assert (tmp_path / "step.png").stat().st_size > 0
    trace = json.loads((tmp_path / "profile_step0.json").read_text())
    assert any(e.get("name") == "collectives.allreduce" for e in trace["traceEvents"])
