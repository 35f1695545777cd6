"""PyTorch's own distributed test suite (`DistributedTest._DistTestBase`, shipped in the
torch wheel) run under mpirun against a torch.distributed backend: one mpirun job per
test, with a timeout, and a table of pass / fail / skip per backend.

    python ci/torch_suite.py --np 3                          # gloo and collectives
    python ci/torch_suite.py --np 8 -k group --backend collectives
    python ci/torch_suite.py --np 2 --json build/torch_suite-np2.json

How a test runs: each rank takes its rank from MPI, the job shares one TEMP_DIR (the suite's
file barriers and `file://` init), the process group is made as the suite's own spawn runner
makes it, then the test method runs. The suite decides its skips from the name of the backend
(`BACKEND`, read when the module is imported): every backend here is judged by gloo's
rules (so ours runs every test gloo runs), and the name the tests read while running is the
backend's own, so a test that branches on the name (`if BACKEND == "gloo"`) sees ours
(--name-as-gloo: it sees gloo's, and dist.monitored_barrier, which torch allows on gloo
groups only, calls our group's; to tell such a branch from a fault of the backend).

A test is `pass` when every rank returns, `skip` when a rank skips (unittest's SkipTest, or
the suite's skip exit codes), `fail` with the first failing rank's last traceback line, and
`timeout` when the job outlives --timeout. With gloo among the backends, the others run
only the tests gloo passes (--all: every test). Needs `expecttest` (the suite imports it)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def suite(np: int):
    """The suite's module, imported as for gloo at world size np (its skip rules)."""
    os.environ.update(BACKEND="gloo", WORLD_SIZE=str(np))
    os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())
    os.environ.setdefault("INIT_METHOD", f"file://{os.environ['TEMP_DIR']}/init_dir/init")
    from torch.testing._internal.distributed import distributed_test
    return distributed_test


def tests(np: int) -> tuple[list[str], list[str]]:
    """(the tests to run, the tests the suite skips before running them) at world size np."""
    base = suite(np).DistributedTest._DistTestBase
    run, skipped = [], []
    for name in sorted(n for n in dir(base) if n.startswith("test")):
        (skipped if getattr(getattr(base, name), "__unittest_skip__", False) else run).append(
            name)
    return run, skipped


def worker(backend: str, name: str, temp: str) -> None:
    """One rank of one test: writes `status<TAB>detail` to TEMP_DIR/result.<rank>."""
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    np = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    os.environ.update(TEMP_DIR=temp, INIT_METHOD=f"file://{temp}/init_dir/shared_init_file",
                      MASTER_ADDR="127.0.0.1")
    dt = suite(np)
    dt.BACKEND = os.environ.get("TORCH_SUITE_NAME") or backend  # what test bodies read
    if backend != "gloo":
        import collectives  # noqa: F401  (registers the backend)
    import datetime

    import torch.distributed as dist
    if os.environ.get("TORCH_SUITE_NAME") and backend != "gloo":
        dist.monitored_barrier = _monitored_barrier  # torch's checks the name too
    from torch.testing._internal import common_utils
    from torch.testing._internal.common_distributed import TEST_SKIPS

    class Case(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        pass

    skip_codes = {s.exit_code for s in TEST_SKIPS.values()}
    result = Path(temp) / f"result.{rank}"
    status, detail = "pass", ""
    try:
        case = Case(name)
        case.rank, case.file_name = rank, f"{temp}/init_file"
        case.skip_return_code_checks = []
        timeout = dt.CUSTOM_PG_TIMEOUT.get(name, dt.default_pg_timeout)
        dist.init_process_group(init_method=f"file://{case.file_name}", backend=backend,
                                world_size=np, rank=rank,
                                timeout=datetime.timedelta(seconds=timeout))
        case._barrier()
        common_utils.set_rng_seed()  # as the suite's runner: every rank draws the same
        getattr(case, name)()
        case._barrier()
        if dist.is_initialized():
            dist.destroy_process_group()
    except SystemExit as exc:
        if exc.code in skip_codes:
            status, detail = "skip", f"exit {exc.code}"
        elif exc.code not in (0, None):
            status, detail = "fail", f"exit {exc.code}"
    except BaseException as exc:  # noqa: BLE001 (every error is a result)
        import traceback
        import unittest
        if isinstance(exc, unittest.SkipTest):
            status, detail = "skip", str(exc)
        else:
            status = "fail"
            detail = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            (Path(temp) / f"traceback.{rank}").write_text(traceback.format_exc())
    result.write_text(f"{status}\t{detail}")
    sys.stdout.flush()
    # mpirun ends every rank when the first exits without MPI_Finalize: wait for the others'
    # results first (a while at most: a rank may hang), then exit without atexit work (a
    # group left by a failed test must not hang the exit)
    deadline = time.monotonic() + 30
    while (time.monotonic() < deadline
           and len(list(Path(temp).glob("result.*"))) < np):
        time.sleep(0.05)
    os._exit(0)


def _monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    """dist.monitored_barrier without torch's gloo-only check: the group's own method."""
    import datetime

    import torch.distributed as dist
    if dist.distributed_c10d._rank_not_in_group(group):
        return None
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    return (group or dist.group.WORLD).monitored_barrier(timeout, wait_all_ranks)


def run_one(backend: str, name: str, np: int, timeout: float, keep: Path | None) -> tuple:
    """(status, detail, seconds) of one test in one mpirun job."""
    with tempfile.TemporaryDirectory() as temp:
        for sub in ("barrier", "test_dir", "init_dir"):
            os.mkdir(os.path.join(temp, sub))
        mpirun = Path(sys.executable).parent / "mpirun"
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_osc=os.environ.get("OMPI_MCA_osc", "^ucx"))
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                [str(mpirun), "-np", str(np), "--oversubscribe", sys.executable, __file__,
                 "--worker", backend, name, temp],
                env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
            output = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            output = (exc.stdout or b"").decode(errors="replace") if isinstance(
                exc.stdout, bytes) else (exc.stdout or "")
            subprocess.run(["pkill", "-9", "-f", f"--worker {backend} {name} {temp}"])
            status, detail = "timeout", f"after {timeout:.0f} s"
        else:
            results = []
            for rank in range(np):
                path = Path(temp) / f"result.{rank}"
                results.append(path.read_text().split("\t", 1) if path.exists()
                               else ["fail", f"rank {rank} wrote no result (rc "
                                             f"{proc.returncode})"])
            failed = [r for r in results if r[0] == "fail"]
            if failed:
                status, detail = failed[0]
            elif any(r[0] == "skip" for r in results):
                status, detail = "skip", next(r[1] for r in results if r[0] == "skip")
            else:
                status, detail = "pass", ""
        seconds = time.perf_counter() - start
        if keep is not None and status in ("fail", "timeout"):
            log = keep / f"{backend}-np{np}-{name}.log"
            tracebacks = "".join(p.read_text() for p in sorted(Path(temp).glob("traceback.*")))
            log.write_text(output[-20000:] + "\n" + tracebacks)
    return status, detail, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=3)
    parser.add_argument("--backend", nargs="+", default=["gloo", "collectives"])
    parser.add_argument("-k", default="", help="run the tests whose name matches this regex")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per test job")
    parser.add_argument("--all", action="store_true",
                        help="run every backend on every test (default: the others only "
                             "where gloo passes, the tests the comparison is about)")
    parser.add_argument("--name-as-gloo", action="store_true",
                        help="the test bodies read BACKEND as 'gloo' while running (ours still "
                             "in every group): which failures come from a branch on the name")
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--logs", type=Path, default=ROOT / "build" / "torch_suite",
                        help="a failing test's output and tracebacks go here")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.name_as_gloo:
        os.environ["TORCH_SUITE_NAME"] = "gloo"
    if args.worker:
        worker(*args.worker)
        return
    run, skipped = tests(args.np)
    run = [t for t in run if re.search(args.k, t)]
    args.logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, list]] = {b: {} for b in args.backend}
    for name in run:
        for backend in sorted(args.backend, key=lambda b: b != "gloo"):
            gloo = results.get("gloo", {}).get(name)
            if backend != "gloo" and gloo and gloo[0] != "pass" and not args.all:
                results[backend][name] = ["not run", f"gloo: {gloo[0]}"]
                continue
            status, detail, seconds = run_one(backend, name, args.np, args.timeout, args.logs)
            results[backend][name] = [status, detail]
            print(f"{backend:12} np{args.np} {status:7} {seconds:5.1f}s {name}"
                  f"{'  ' + detail if status in ('fail', 'timeout') else ''}", flush=True)
    print(f"\nnp {args.np}: {len(run)} tests run, {len(skipped)} skipped by the suite before "
          f"running (as for gloo)")
    for backend in args.backend:
        counts = {s: sum(1 for r in results[backend].values() if r[0] == s)
                  for s in ("pass", "fail", "skip", "timeout", "not run")}
        print(f"  {backend:12} " + "  ".join(f"{s} {n}" for s, n in counts.items()))
    if "gloo" in results:
        for backend in (b for b in args.backend if b != "gloo"):
            behind = [t for t, r in results["gloo"].items()
                      if r[0] == "pass" and results[backend][t][0] != "pass"]
            print(f"  gloo passes, {backend} does not ({len(behind)}): "
                  + (", ".join(behind) or "none"))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"np": args.np, "skipped_by_suite": skipped,
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
