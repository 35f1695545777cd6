"""The command-line tools: `python -m collectives calibrate --out tuning.json` (under mpirun:
measure this job's layout for `auto`), `python -m collectives simulate ...` (the scale
model's predictions) and `python -m collectives bytes ...` (the bytes a rank receives per
allreduce in each compressed form). `python -m collectives <tool> --help` lists a tool's
flags."""

import sys

from collectives import api
from collectives.auto import calibrate, simulate
from collectives.compression import wire

TOOLS = {"calibrate": lambda argv: calibrate.main(api.timed_call, argv),
         "simulate": simulate.main, "bytes": wire.main}

if len(sys.argv) < 2 or sys.argv[1] not in TOOLS:
    sys.exit(f"usage: python -m collectives {{{','.join(TOOLS)}}} [flags]")
TOOLS[sys.argv[1]](sys.argv[2:])
