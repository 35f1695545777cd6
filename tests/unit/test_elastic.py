"""Fault-tolerant mode and elastic training, in whole jobs under `mpirun --with-ft ulfm` in
which the last rank dies by SIGKILL (tests/scripts/survive.py): every survivor raises
RanksFailedError naming it, within a second, from every kind of call; elastic training
shrinks the job, rolls back to the last commit and ends with the parameters of a replay.
Also ElasticSampler's dealing of what is left of an epoch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from collectives.elastic import torch_state

ROOT = Path(__file__).resolve().parents[2]
MPIRUN = Path(sys.executable).parent / "mpirun"
#: (ranks, simulated ranks per node or None)
LAYOUTS = {"1node": (3, None), "2nodes": (4, 2)}


def survive(layout: str, tmp: Path, *args: str) -> str:
    np_, per_node = LAYOUTS[layout]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               COLLECTIVES_AUTOTUNE="0", XDG_CACHE_HOME=str(tmp))
    if per_node:
        env["COLLECTIVES_RANKS_PER_NODE"] = str(per_node)
    cmd = [str(MPIRUN), "--with-ft", "ulfm", "-np", str(np_), "--oversubscribe",
           sys.executable, str(ROOT / "tests" / "scripts" / "survive.py"), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=90, cwd=ROOT)
    return done.stdout + done.stderr


CALLS_1NODE = ["allreduce-small", "allreduce-large", "allreduce-ring", "allreduce-tree",
               "allreduce-mpi", "allreduce-async", "allreduce-int8", "allgather", "broadcast",
               "alltoall", "reducescatter", "barrier", "torch-all-reduce"]
CALLS_2NODES = ["allreduce-small", "allreduce-large", "allreduce-ring", "allgather",
                "broadcast", "barrier"]


@pytest.mark.parametrize("layout,call", [("1node", c) for c in CALLS_1NODE]
                         + [("2nodes", c) for c in CALLS_2NODES])
def test_every_survivor_raises_naming_the_dead_rank(tmp_path, layout, call):
    np_ = LAYOUTS[layout][0]
    out = survive(layout, tmp_path, "raise", call, str(tmp_path / "killed"))
    found = re.findall(r"rank (\d+): RanksFailedError \[(\d+)\] after ([\d.]+) s at step "
                       r"(\d+); the next call raised too", out)
    assert sorted(int(r) for r, *_ in found) == list(range(np_ - 1)), out
    for _, dead, took, step in found:
        assert int(dead) == np_ - 1 and int(step) == 20, out
        assert float(took) < 1.0, out


@pytest.mark.parametrize("layout,api", [("1node", "train"), ("2nodes", "train"),
                                        ("1node", "horovod")])
def test_elastic_training_goes_on_from_the_last_commit(tmp_path, layout, api):
    np_ = LAYOUTS[layout][0]
    out = survive(layout, tmp_path, api, str(tmp_path / "killed"))
    found = re.findall(r"rank (\d+): trained 40 steps, steps at each size \{(\d+): (\d+), "
                       r"(\d+): (\d+)\}, resets \[(\d+)\], recovered ([\d.]+) s after the "
                       r"kill, max error (\S+), digest (\S+)", out)
    assert sorted(int(f[0]) for f in found) == list(range(np_ - 1)), out
    for _, n0, steps0, n1, steps1, reset, recovered, err, _ in found:
        # 20 steps at np, the last commit at step 18, so 22 at np - 1
        assert (int(n0), int(steps0), int(n1), int(steps1)) == (np_, 18, np_ - 1, 22), out
        assert int(reset) == np_ - 1
        assert float(recovered) < 1.0, out
        assert float(err) < 1e-12, out
    assert len({f[-1] for f in found}) == 1, out  # the survivors' parameters are alike


def test_elastic_sampler_deals_what_is_left(monkeypatch):
    """10 samples over 3 ranks, batch 1: after one batch each rank has done its first
    sample (3 of the epoch's order); 2 survivors then share the other 7, padded to 8."""
    dataset = list(range(10))
    seen: list[int] = []
    for r in range(3):
        monkeypatch.setattr(torch_state.topology, "rank", lambda r=r: r)
        monkeypatch.setattr(torch_state.topology, "size", lambda: 3)
        s = torch_state.ElasticSampler(dataset, shuffle=True, seed=4)
        mine = list(s)
        assert len(mine) == len(s) == 4
        seen.append(mine[0])
        s.record_batch(0, 1)
        state = s.state_dict()
    order = s._order()
    assert sorted(seen) == sorted(order[:3])
    left = []
    for r in range(2):
        monkeypatch.setattr(torch_state.topology, "rank", lambda r=r: r)
        monkeypatch.setattr(torch_state.topology, "size", lambda: 2)
        s = torch_state.ElasticSampler(dataset, shuffle=True, seed=4)
        s.load_state_dict(state)
        assert len(s) == 4
        left += list(s)
    assert sorted(set(left)) == sorted(order[3:])
    s.set_epoch(1)
    assert len(s) == 5 and s._order() != order
