"""Which of our Python files one allreduce enters, in order, and how often it calls back
into a file it had already left: the measure of how far a reader follows a call.

A call back is a call into a file that is further up the current stack but is not the
caller's file (a lower layer running a function of a higher one: the engine running the
api's move, an algorithm calling into online's timing). A plain return is not one.

    mpirun -np 2 -x XDG_CACHE_HOME=$(mktemp -d) python benchmarks/callpath.py   # 1 MiB
    mpirun -np 2 python benchmarks/callpath.py --route fast

Routes: `fast` is a repeated host allreduce that has a C++ fast entry (a small one that rides
in the agreement); `general` is a repeated `auto` allreduce while auto/online.py still tries
its size class (from 256 KiB up, its first calls: a class an earlier job settled runs no
trial, so the general route needs an empty cache), the longest everyday path. Only Python is
traced (sys.setprofile); the C++ files a route enters are listed in docs/architecture.md.
Rank 0 prints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import collectives as C
from collectives.auto import online, select, state
from collectives.runtime import topology

ROOT = Path(__file__).resolve().parents[1]


def trace(call) -> tuple[list[str], list[str]]:
    """(the files of ours, relative to the repository, that call() enters, in order of
    first entry; the call backs, as 'caller file -> file called back into')."""
    files: list[str] = []
    backs: list[str] = []
    stack: list[str] = []  # the file of each frame of ours, outermost first

    def ours(frame) -> str | None:
        path = frame.f_code.co_filename
        if path.startswith(str(ROOT)) and "/benchmarks/" not in path:
            return str(Path(path).relative_to(ROOT))
        return None

    def profile(frame, event, _arg) -> None:
        if event not in ("call", "return"):
            return
        rel = ours(frame)
        if rel is None:
            return
        if event == "return":
            if stack:
                stack.pop()
            return
        if rel not in files:
            files.append(rel)
        if stack and rel != stack[-1] and rel in stack[:-1]:
            backs.append(f"{stack[-1]} -> {rel}")
        stack.append(rel)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return files, backs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--route", choices=("fast", "general", "both"), default="both")
    ap.add_argument("--bytes", type=int, default=1 << 20, help="the general route's size")
    args = ap.parse_args()
    C.init()
    routes = ("fast", "general") if args.route == "both" else (args.route,)
    for route in routes:
        x = np.ones(1024 if route == "fast" else args.bytes // 4, np.float32)
        for _ in range(2):  # described (and, for fast, the fast entry made)
            C.allreduce(x)
        if route == "general" and not online.checks(topology.get(), x.nbytes):
            sys.exit(f"{x.nbytes} bytes: auto does not check this class online; try --bytes "
                     "of 256 KiB or more")
        if route == "general" and select.size_class(x.nbytes) in state.of(topology.get()).settled:
            sys.exit(f"{x.nbytes} bytes: settled from the cache (no trial); run with an empty "
                     "cache: mpirun -x XDG_CACHE_HOME=$(mktemp -d) ...")
        files, backs = trace(lambda x=x: C.allreduce(x))
        if C.rank() == 0:
            print(f"{route}: {len(files)} Python files, {len(backs)} call backs")
            print("  files: " + ", ".join(files))
            for back in dict.fromkeys(backs):
                print(f"  back: {back} (x{backs.count(back)})")


if __name__ == "__main__":
    main()
